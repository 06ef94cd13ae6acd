"""Scorer training traces: the target run over large marginal pools, one record per round.

A round: the drafter drafts, :func:`taps_kernels.candidate_pool` builds a
``pool_size``-node DDTree pool (top-``top_k`` per position), ONE tree-attention
forward of the target over the whole pool gives its next-token distribution at
every pool node, and the greedy walk over the pool decides the round (so the
trace follows the target's own greedy continuation, like greedy DDTree of
budget ``pool_size``).

What is stored per round (``R`` rounds in a shard, ``N = pool_size + 1`` nodes, ``D`` draft
positions, ``Kl = lattice_k``, ``H`` drafter width), in one ``safetensors`` file per chunk of prompts:

=================  ==================  ==========================================================
key                shape, dtype        value
=================  ==================  ==========================================================
tokens             [R,N] int32         pool tokens (node 0 = bonus), pool (pop) order
parents            [R,N] int16         parent index, -1 for the root and padding
depth              [R,N] int8          0 at the root
num_nodes          [R] int32           real rows
logq, step_logq    [R,N] f32           cumulative / own draft log-prob (0 root, -inf padding)
rank               [R,N] int16         token rank at its position (-1 root, padding)
entropy, margin,   [R,D] f32           per-position draft statistics (top-K = ``top_k``)
topk_mass
lattice_logp       [R,D,Kl] f16        top-``Kl`` draft log-probs per position (the lattice)
lattice_ids        [R,D,Kl] int32      their tokens
hidden             [R,D,H] f16         drafter hidden state at block positions 1..D
child_prob         [R,N] f32           target prob of node v's token at parent(v) (1 at the root)
target_argmax      [R,N] int32         target's greedy token after each node
target_top1_prob   [R,N] f16           its probability
accept_len         [R] int16           nodes on the accepted path, root included (tau of the round)
path               [R,D+1] int16       accepted pool nodes, root first, -1 padded
prompt_index       [R] int32           index of the prompt in the trace set
=================  ==================  ==========================================================

Only what training needs is kept: no full-vocabulary distributions (the
target's KL term over a parent's children plus "other" needs only the
children's probabilities).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, List, Optional

import torch

import taps_kernels
from taps_kernels import CandidatePool, Tree

SHARD_GLOB = "traces_*.safetensors"


def file_digest(path, n: int = 16) -> str:
    """First ``n`` hex digits of the sha256 of a file (identifies the drafter checkpoint a trace used)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:n]


def drafter_identity(drafter_dir) -> dict:
    """``{"path", "sha256"}`` of a drafter directory's weights (a scorer is specific to this pair)."""
    from taps.paths import portable_path

    p = Path(drafter_dir)
    # the weights file; a draft vocabulary file sits beside it and does not name the drafter
    files = sorted(p.glob("model*.safetensors")) or sorted(p.glob("*.safetensors"))
    return {"path": portable_path(p), "sha256": file_digest(files[0]) if files else None}


def _read_jsonl(path) -> List[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def trace_prompts(num_prompts: int, seed: int = 1, exclude_file: Optional[str] = None) -> List[dict]:
    """Training code prompts (never HumanEval / MT-Bench: :mod:`taps.training.prompts` filters them) minus
    the ids listed in ``exclude_file`` (the drafter's own training prompts, JSONL with ``id``)."""
    from taps.training.prompts import build_prompts

    exclude = set()
    if exclude_file and Path(exclude_file).is_file():
        exclude = {p.get("id") for p in _read_jsonl(exclude_file)}
    extra = len(exclude) // 4 + 16
    prompts = [p for p in build_prompts(num_prompts + extra, seed=seed) if p.get("id") not in exclude]
    return prompts[:num_prompts]


def chat_trace_prompts(out_dir, model, tokenizer, num_prompts: int, seed: int = 1,
                       exclude_file: Optional[str] = None) -> List[dict]:
    """``num_prompts`` chat prompts written by the target itself (Magpie, :mod:`taps.data.magpie`) into
    ``out_dir/magpie.jsonl`` (resumable). The sampling seed differs from the drafter data's (seed 0) and
    every turn that duplicates a prompt of ``exclude_file`` (same normalised text or leading words) is
    rejected, so the scorer is trained on requests the drafter never saw."""
    from taps.data.generation import generator_for
    from taps.data.magpie import MagpieWriter

    writer = MagpieWriter(out_dir, generator_for(model), tokenizer, seed=seed)
    if exclude_file and Path(exclude_file).is_file():
        writer.exclude(p["text"] for p in _read_jsonl(exclude_file) if p.get("kind") == "chat")
    return writer.ensure(num_prompts)[:num_prompts]


def interleave(code: List[dict], chat: List[dict]) -> List[dict]:
    """Spread ``chat`` evenly through ``code`` so that any prefix of the list (a run cut by
    ``max_minutes``) holds both kinds in about the asked mix."""
    n = len(code) + len(chat)
    out, ci, hi = [], 0, 0
    for i in range(n):
        take_chat = hi < len(chat) and (ci >= len(code) or (hi + 1) * n <= (i + 1) * len(chat))
        if take_chat:
            out.append(chat[hi])
            hi += 1
        else:
            out.append(code[ci])
            ci += 1
    return out


@torch.inference_mode()
def trace_prompt(model, drafter, prompt_ids: List[int], max_new_tokens: int, pool_size: int, top_k: int,
                 lattice_k: int, stop_ids, prompt_index: int = 0) -> List[Dict[str, torch.Tensor]]:
    """Decode one prompt greedily over ``pool_size``-node pools; return one record per round (keys above)."""
    from taps.decode.verifier import make_verifier

    ver = make_verifier(model, drafter.config.target_layer_ids)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    logits, feats = ver.prefill(torch.tensor([prompt_ids], dtype=torch.int64))
    state = drafter.new_state(1)
    drafter.append_context(state, feats)
    generated = [int(logits.argmax())]
    records = []
    ctx = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    while len(generated) < max_new_tokens and generated[-1] not in stop_ids and ver.length + pool_size + 2 < ctx:
        bonus = torch.tensor([generated[-1]], dtype=torch.int64)
        draft_logits, hidden = drafter.draft(state, bonus, embed, head)
        D = draft_logits.shape[1]
        pool = taps_kernels.candidate_pool(draft_logits.float(), bonus, top_k=top_k, pool_size=pool_size)
        tlogits, hs, tree = ver.verify(pool.tree)
        n = tree.tokens.shape[1]
        logp = torch.log_softmax(tlogits.float(), dim=-1)                  # [n, V]
        top1_logp, argmax = logp.max(dim=-1)
        par = tree.parents[0].long()
        child_lp = logp[par.clamp(min=0), tree.tokens[0]]
        child_prob = torch.where(par >= 0, child_lp.exp(), torch.ones_like(child_lp))
        path, acc, nxt = taps_kernels.accept_greedy(tree, argmax.view(1, n))
        accept_len = int(acc[0])
        nodes = path[0, :accept_len]
        ver.commit(path, accept_len)
        drafter.append_context(state, ver.features(hs, nodes))
        N = pool.tree.tokens.shape[1]

        def pad(x, fill):  # [n] -> [N]
            out = torch.full((N,), fill, dtype=x.dtype)
            out[:n] = x
            return out

        full_path = torch.full((D + 1,), -1, dtype=torch.int16)
        full_path[:accept_len] = nodes.to(torch.int16)
        kl = min(lattice_k, pool.topk_logp.shape[2])
        records.append({
            "tokens": pool.tree.tokens[0].to(torch.int32), "parents": pool.tree.parents[0].to(torch.int16),
            "depth": pool.tree.depth[0].to(torch.int8), "num_nodes": pool.tree.num_nodes.to(torch.int32).view(()),
            "logq": pool.logq[0], "step_logq": pool.step_logq[0], "rank": pool.rank[0].to(torch.int16),
            "entropy": pool.entropy[0], "margin": pool.margin[0], "topk_mass": pool.topk_mass[0],
            "lattice_logp": pool.topk_logp[0, :, :kl].to(torch.float16),
            "lattice_ids": pool.topk_ids[0, :, :kl].to(torch.int32),
            "hidden": hidden[0].to(torch.float16),
            "child_prob": pad(child_prob, 0.0), "target_argmax": pad(argmax.to(torch.int32), 0),
            "target_top1_prob": pad(top1_logp.exp().to(torch.float16), 0.0),
            "accept_len": torch.tensor(accept_len, dtype=torch.int16), "path": full_path,
            "prompt_index": torch.tensor(prompt_index, dtype=torch.int32),
        })
        generated += tree.tokens[0, nodes[1:]].tolist() + [int(nxt[0])]
    return records


def stack_records(records: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack per-round records into ``[R, ...]`` tensors (all rounds of a shard share N, D, Kl, H)."""
    # Lattice width can differ only if V < lattice_k; pad to the widest.
    kl = max(r["lattice_logp"].shape[-1] for r in records)
    out = {}
    for k in records[0]:
        rows = [r[k] for r in records]
        if k in ("lattice_logp", "lattice_ids") and any(x.shape[-1] != kl for x in rows):
            fill = float("-inf") if k == "lattice_logp" else 0
            rows = [torch.nn.functional.pad(x, (0, kl - x.shape[-1]), value=fill) for x in rows]
        out[k] = torch.stack(rows).contiguous()
    return out


@dataclass(frozen=True)
class TraceConfig:
    """Options of :func:`collect_traces` (the CLI flags of ``taps traces``).

    ``worker``/``workers``: this process takes shards ``s`` with ``s % workers == worker``, so several
    processes can fill one directory side by side. ``max_minutes``: stop after the shard in progress once
    this much time has passed. ``exclude_prompts``: JSONL of prompts to skip (the drafter's own).
    ``chat_fraction``: share of Magpie chat prompts (:func:`chat_trace_prompts`) among the code prompts.
    ``draft_dtype``: the drafter's body (:func:`taps.models.drafter.prepare_drafter`); ``"auto"`` drafts as the
    CLI decoders do on this machine (the block forward on AVX-512 VNNI CPUs), so the scorer is trained on the
    hidden states it will read. ``target_format``: the target that verifies the pools
    (:func:`taps.models.target.resolve_target_format`; ``"auto"``: as the CLI decoders run it here), so the
    acceptances are those of the target the scorer serves.
    """

    target: str = "smollm2"
    num_prompts: int = 128
    pool_size: int = 256
    top_k: int = 64
    lattice_k: int = 32
    max_new_tokens: int = 128
    max_prompt_tokens: int = 512
    prompts_per_shard: int = 4
    seed: int = 1
    exclude_prompts: Optional[str] = None
    chat_fraction: float = 0.0
    draft_dtype: str = "auto"
    target_format: str = "auto"
    threads: Optional[int] = None
    max_minutes: Optional[float] = None
    progress: bool = True
    worker: int = 0
    workers: int = 1

    def __post_init__(self):
        for name in ("num_prompts", "pool_size", "top_k", "lattice_k", "max_new_tokens", "max_prompt_tokens",
                     "prompts_per_shard", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TraceConfig.{name}: expected an integer >= 1, received {v!r}")
        if not 0.0 <= self.chat_fraction <= 1.0:
            raise ValueError(f"TraceConfig.chat_fraction: expected a number in [0, 1], received {self.chat_fraction!r}")
        from taps.models.target import TARGET_FORMATS

        if self.target_format not in TARGET_FORMATS:
            raise ValueError(f"TraceConfig.target_format: expected one of {TARGET_FORMATS}, received "
                             f"{self.target_format!r}")
        if self.draft_dtype not in ("auto", "blocks", "float32", "bfloat16"):
            raise ValueError(f"TraceConfig.draft_dtype: expected 'auto', 'blocks', 'float32' or 'bfloat16', "
                             f"received {self.draft_dtype!r}")
        if not 0 <= self.worker < self.workers:
            raise ValueError(f"TraceConfig.worker: expected 0 <= worker < workers ({self.workers}), "
                             f"received {self.worker}")

    @classmethod
    def from_options(cls, **options) -> "TraceConfig":
        """A config from keyword options; an unknown option is a TypeError naming it and the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"TraceConfig: unknown option(s) {unknown}; expected some of {sorted(known)}")
        return cls(**options)


def collect_traces(out_dir, drafter_dir, config: Optional[TraceConfig] = None) -> dict:
    """Collect traces into ``out_dir`` with ``config`` (default :class:`TraceConfig`); resumable: finished
    shards are skipped and ``meta.json`` must agree.

    Stops when every prompt is traced or ``config.max_minutes`` have passed (the shard in progress is
    finished). Returns :func:`trace_summary` of the directory.
    """
    if config is None:
        config = TraceConfig()
    if not isinstance(config, TraceConfig):
        raise TypeError(f"config: expected a TraceConfig, received {type(config).__name__}")
    c = config
    target, num_prompts, pool_size, top_k, lattice_k = c.target, c.num_prompts, c.pool_size, c.top_k, c.lattice_k
    max_new_tokens, max_prompt_tokens, prompts_per_shard = c.max_new_tokens, c.max_prompt_tokens, c.prompts_per_shard
    seed, exclude_prompts, threads, max_minutes = c.seed, c.exclude_prompts, c.threads, c.max_minutes
    progress, worker, workers = c.progress, c.worker, c.workers
    from tqdm import tqdm

    from taps.data import chat_prompt_ids, stop_token_ids
    from taps.models.drafter import load_decoding_drafter
    from taps.models.target import load_target, resolve_target_format
    from taps.paths import portable_path

    if threads:
        torch.set_num_threads(threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fmt, _ = resolve_target_format(c.target_format, target)
    model, tok = load_target(target, target_format=fmt)
    drafter = load_decoding_drafter(drafter_dir, model, body=c.draft_dtype)  # as the CLI decoders draft
    blocks = drafter.block_draft is not None
    body = "blocks" if blocks else str(next(drafter.parameters()).dtype).replace("torch.", "")
    ident = drafter_identity(drafter_dir)
    meta = {"target": target, "target_format": fmt, "drafter": ident, "pool_size": pool_size, "top_k": top_k,
            "lattice_k": lattice_k,
            "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens, "seed": seed,
            "num_prompts": num_prompts, "prompts_per_shard": prompts_per_shard, "decoding": "greedy",
            "num_draft_positions": drafter.config.block_size - 1, "drafter_hidden": drafter.config.hidden_size,
            "exclude_prompts": portable_path(exclude_prompts) if exclude_prompts else None,
            "chat_fraction": c.chat_fraction, "draft_dtype": body,
            "draft_head_dtype": "blocks" if blocks else str(drafter.head_dtype or "lm_head").replace("torch.", "")}
    meta_p = out / "meta.json"
    if meta_p.exists():
        old = json.loads(meta_p.read_text())
        before = {"chat_fraction": 0.0, "target_format": "fp32"}  # what directories without the key were made with
        for k in ("target", "target_format", "drafter", "pool_size", "top_k", "seed", "chat_fraction"):
            if old.get(k, before.get(k)) != meta[k]:
                raise ValueError(f"{out}: holds traces with {k}={old.get(k)!r}, this run asks {meta[k]!r}; "
                                 f"use another --out")
    prompts = _prompt_list(out, c, model, tok)
    if worker == 0:
        meta_p.write_text(json.dumps(meta, indent=1) + "\n")
    stops = set(stop_token_ids(tok, model))
    deadline = time.time() + 60 * max_minutes if max_minutes else None
    nshards = (len(prompts) + prompts_per_shard - 1) // prompts_per_shard
    bar = tqdm(range(worker, nshards, workers), desc=f"traces[{worker}]", unit="shard", disable=not progress)
    for s in bar:
        sp = out / f"traces_{s:05d}.safetensors"
        if sp.exists():
            continue
        if deadline is not None and time.time() > deadline:
            print(f"traces: --max-minutes reached after shard {s}", flush=True)
            break
        t0 = time.time()
        records = []
        for i in range(s * prompts_per_shard, min(len(prompts), (s + 1) * prompts_per_shard)):
            ids = chat_prompt_ids(tok, [{"role": "user", "content": prompts[i]["text"]}])[-max_prompt_tokens:]
            records += trace_prompt(model, drafter, ids, max_new_tokens, pool_size, top_k, lattice_k, stops, i)
        if not records:
            continue
        blob = stack_records(records)
        from safetensors.torch import save_file

        tmp = sp.with_name(sp.name + ".tmp")
        save_file(blob, str(tmp))
        os.replace(tmp, sp)
        tau = float(blob["accept_len"].float().mean())
        bar.set_postfix(rounds=len(records), tau=f"{tau:.2f}", s_per_round=f"{(time.time() - t0) / len(records):.2f}")
    return trace_summary(out)


def _prompt_list(out: Path, c: TraceConfig, model, tok) -> List[dict]:
    """The directory's prompt list: read from ``prompts.jsonl`` when an earlier run or another worker
    wrote it, otherwise built once under a file lock (Magpie sampling must not run twice side by side)."""
    import fcntl

    path = out / "prompts.jsonl"
    with open(out / ".prompts.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            prompts = _read_jsonl(path)
            if len(prompts) != c.num_prompts:
                raise ValueError(f"{out}: holds {len(prompts)} prompts, this run asks num_prompts={c.num_prompts}; "
                                 f"use another --out")
            return prompts
        n_chat = round(c.num_prompts * c.chat_fraction)
        code = trace_prompts(c.num_prompts - n_chat, seed=c.seed, exclude_file=c.exclude_prompts)
        chat = chat_trace_prompts(out, model, tok, n_chat, seed=c.seed, exclude_file=c.exclude_prompts) if n_chat else []
        prompts = interleave(code, chat)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps({"id": p["id"], "kind": p["kind"], "text": p["text"]}) + "\n"
                               for p in prompts), encoding="utf-8")
        os.replace(tmp, path)
        return prompts


def list_shards(trace_dir) -> List[Path]:
    return sorted(Path(trace_dir).glob(SHARD_GLOB))


def load_traces(trace_dirs, prompt_filter=None) -> Dict[str, torch.Tensor]:
    """Concatenate every shard of one or more trace directories into ``[R, ...]`` tensors.

    ``prompt_filter(prompt_index [R]) -> bool mask`` keeps a subset of rounds (train/validation split).
    A ``"source"`` tensor ``[R] int32`` numbers the directory each round came from.
    """
    from safetensors.torch import load_file

    if isinstance(trace_dirs, (str, Path)):
        trace_dirs = [trace_dirs]
    parts = []
    for j, d in enumerate(trace_dirs):
        shards = list_shards(d)
        if not shards:
            raise FileNotFoundError(f"trace dir {d}: no {SHARD_GLOB} files (run `taps traces` first)")
        for sp in shards:
            blob = load_file(str(sp))
            blob["source"] = torch.full((blob["tokens"].shape[0],), j, dtype=torch.int32)
            parts.append(blob)
    keys = parts[0].keys()
    out = {}
    for k in keys:
        rows = [p[k] for p in parts]
        if k in ("lattice_logp", "lattice_ids"):
            kl = min(r.shape[-1] for r in rows)
            rows = [r[..., :kl] for r in rows]
        out[k] = torch.cat(rows)
    if prompt_filter is not None:
        keep = prompt_filter(out["prompt_index"])
        out = {k: v[keep] for k, v in out.items()}
    return out


def split_by_prompt(traces: Dict[str, torch.Tensor], val_fraction: float = 0.15):
    """``(train, val)`` with whole prompts held out: prompts whose index hashes into the last
    ``val_fraction`` go to validation (deterministic, independent of how many shards exist)."""
    pid = traces["prompt_index"].long() + 1000003 * traces["source"].long()
    bucket = (pid * 2654435761) % 1000
    val = bucket < int(round(1000 * val_fraction))
    return ({k: v[~val] for k, v in traces.items()}, {k: v[val] for k, v in traces.items()})


def pool_from_traces(traces: Dict[str, torch.Tensor], rows: torch.Tensor, device=None) -> CandidatePool:
    """Rebuild a batched :class:`CandidatePool` (``[len(rows), N]``) from trace rows (lattice -> topk fields)."""
    def g(k, dtype=None):
        t = traces[k][rows]
        return t.to(device=device, dtype=dtype) if (dtype or device) else t

    tree = Tree(g("tokens", torch.int64), g("parents", torch.int32), g("depth", torch.int32), g("num_nodes", torch.int32))
    return CandidatePool(tree, g("logq", torch.float32), g("step_logq", torch.float32), g("rank", torch.int32),
                         g("lattice_logp", torch.float32), g("lattice_ids", torch.int64), g("entropy", torch.float32),
                         g("margin", torch.float32), g("topk_mass", torch.float32))


def accepted_mask(traces: Dict[str, torch.Tensor]) -> torch.Tensor:
    """``[R,N] bool``: node lies on the round's accepted (greedy) path, root included."""
    R, N = traces["tokens"].shape
    path = traces["path"].long()
    mask = torch.zeros(R, N + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(path >= 0, path, torch.full_like(path, N)), True)
    return mask[:, :N]


def trace_summary(trace_dir) -> dict:
    """Rounds, prompts, mean tau, bytes on disk of a trace directory."""
    from safetensors import safe_open

    shards = list_shards(trace_dir)
    rounds, taus, prompts, nbytes = 0, 0.0, set(), 0
    for sp in shards:
        nbytes += sp.stat().st_size
        with safe_open(str(sp), "pt") as f:
            acc = f.get_tensor("accept_len").float()
            pi = f.get_tensor("prompt_index")
        rounds += acc.numel()
        taus += float(acc.sum())
        prompts.update(pi.tolist())
    meta_p = Path(trace_dir) / "meta.json"
    meta = json.loads(meta_p.read_text()) if meta_p.exists() else {}
    from taps.paths import portable_path

    return {"dir": portable_path(trace_dir), "shards": len(shards), "rounds": rounds, "prompts": len(prompts),
            "tau_pool": taus / rounds if rounds else None, "bytes": nbytes, "pool_size": meta.get("pool_size"),
            "drafter": meta.get("drafter")}
