"""``build-data``: the target writes the drafter's training data.

Two prompt kinds, mixed in every shard: local code prompts
(:mod:`taps.training.prompts`) and chat prompts the target writes itself
(Magpie, :mod:`taps.data.magpie`). The target answers each greedily with the
chat template and captures the drafter's target features (``hidden_states[id+1]``)
and the top-k log-probabilities in the same pass, in one of the two target formats
(``target_format``, :func:`taps.models.target.resolve_target_format`):

* ``gguf`` (the shipped target, ``auto``'s choice on CPUs with AVX-512 VNNI):
  :class:`taps.data.gguf_generation.GGUFGenerator`, ``batch_size`` rows of one
  preallocated cache, one C++ forward per decode step for all live rows, a finished
  row replaced by the shard's next prompt at once; each row's output is the bits of
  that row generated alone;
* ``fp32``: :class:`taps.data.generation.LlamaGenerator` over transformers' weights
  (left padded batches of each prompt kind, finished rows leave the batch).

The speed of every shard (response tokens/s without the Magpie sampling, threads,
batch, CPU) goes to ``stats.jsonl`` and its sum over the directory to the manifest's
``generation`` record.

Shard format 2 (``shard_XXXXX.pt``, written atomically, skipped if present so
a killed run resumes where it stopped)::

    format       2
    tokens       uint16 [T_total]       prompt+response ids of all sequences, concatenated
    offsets      int64 [n+1]            sequence i = tokens[offsets[i]:offsets[i+1]]
    prompt_lens  int64 [n]
    feats        fp16 [T_total, n_layers*H]  target features of each token (last token of a sequence: zeros)
    topk_ids     uint16 [R_total, k]    top-k next-token ids for each response token
    topk_logp    fp16 [R_total, k]      their log-probabilities (temperature 1)
    topk_offsets int64 [n+1]            sequence i's response rows
    kinds        list[str]              prompt kind per sequence (complete/write/explain/continue/module/chat)
    prompt_idx   int64 [n]              code prompt i -> i, chat prompt i -> 1_000_000 + i
    layer_ids    list[int]

Format 1 (int32 tokens, no top-k, no kinds) is still read by ``ShardData``.
``generate_batch`` / ``_FeatureCapture`` (HF ``generate`` + forward hooks) are
kept as the reference the tests compare against.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

import torch

from taps.decode.latency import cpu_name
from taps.models.drafter import default_target_layer_ids
from taps.models.target import GGUF_FORMATS, TARGET_FORMATS, apply_chat_template, load_target, resolve_target_format
from taps.paths import portable_command, portable_record
from taps.training.prompts import build_prompts, extend_prompts


class _FeatureCapture:
    def __init__(self, model, layer_ids: List[int]):
        self.layer_ids = list(layer_ids)
        self.buf = {i: [] for i in self.layer_ids}
        self.handles = []
        layers = model.model.layers
        for i in self.layer_ids:
            self.handles.append(layers[i].register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def fn(mod, inp, out):
            h = out[0] if isinstance(out, (tuple, list)) else out
            self.buf[i].append(h.detach().float())
        return fn

    def reset(self):
        for i in self.layer_ids:
            self.buf[i] = []

    def collect(self) -> torch.Tensor:
        """[B, steps_total, n*H] along the fed sequence."""
        per = [torch.cat(self.buf[i], dim=1) for i in self.layer_ids]
        return torch.cat(per, dim=-1)

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def generate_batch(model, tok, prompt_ids: List[List[int]], max_new_tokens: int, capture: _FeatureCapture):
    """Greedy batched generation with left padding; returns per-sequence
    (ids list, prompt_len, feats [len, nH])."""
    pad = tok.pad_token_id
    eos = tok.eos_token_id
    L = max(len(p) for p in prompt_ids)
    B = len(prompt_ids)
    x = torch.full((B, L), pad, dtype=torch.long)
    am = torch.zeros((B, L), dtype=torch.long)
    for b, p in enumerate(prompt_ids):
        x[b, L - len(p):] = torch.tensor(p)
        am[b, L - len(p):] = 1
    capture.reset()
    out = model.generate(x, attention_mask=am, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad, eos_token_id=eos, temperature=None, top_p=None, top_k=None)
    feats = capture.collect()  # [B, L + steps - 1 (+0), nH]
    res = []
    for b, p in enumerate(prompt_ids):
        resp = out[b, L:].tolist()
        if eos in resp:
            resp = resp[: resp.index(eos) + 1]
        seq = list(p) + resp
        f = torch.zeros(len(seq), feats.shape[-1])
        start = L - len(p)
        avail = min(len(seq) - 1, feats.shape[1] - start)
        f[:avail] = feats[b, start:start + avail]
        res.append((seq, len(p), f))
    return res


@dataclass
class BuildDataConfig:
    """Options of :func:`build_data` (``build-data`` on the command line).

    ``num_prompts`` sequences in all; ``chat_fraction`` of them answer Magpie chat prompts written by the
    target itself (:mod:`taps.data.magpie`), the rest the local code prompts of
    :mod:`taps.training.prompts`. Every shard holds both kinds in that ratio, so any held-out shard
    measures both. ``topk``: top-k target log-probabilities kept per response token (0: none).
    ``deadline``: unix time after which no new shard is started. ``part``/``num_parts``: this process
    writes the shards ``s`` with ``s % num_parts == part``. ``target_format``: ``auto`` (the GGUF blocks where
    :func:`taps.models.target.resolve_target_format` picks them), ``gguf`` or ``fp32``; with ``gguf``
    ``batch_size`` rows are live at once and a shard's prompts all go through one batch, so a
    ``shard_size`` of a few times ``batch_size`` keeps the batch full until the shard's last rows.
    """

    out: str
    target: str = "smollm2"
    num_prompts: int = 4000
    shard_size: int = 64
    batch_size: int = 32
    max_new_tokens: int = 192
    max_prompt_tokens: int = 384
    num_feature_layers: int = 5
    layer_ids: Optional[List[int]] = None
    seed: int = 0
    feat_dtype: str = "float16"
    threads: Optional[int] = None
    deadline: Optional[float] = None
    part: int = 0
    num_parts: int = 1
    chat_fraction: float = 0.5
    topk: int = 32
    magpie_temperature: float = 1.0
    magpie_max_tokens: int = 96
    target_format: str = "auto"

    def __post_init__(self):
        if self.target_format not in TARGET_FORMATS:
            raise ValueError(f"target_format: expected one of {TARGET_FORMATS}, received {self.target_format!r}")
        if self.feat_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"feat_dtype: expected float16, bfloat16 or float32, received {self.feat_dtype!r}")
        if not 0.0 <= self.chat_fraction <= 1.0:
            raise ValueError(f"chat_fraction: expected a value in [0, 1], received {self.chat_fraction}")
        if not 0 <= self.part < self.num_parts:
            raise ValueError(f"part: expected 0 <= part < num_parts={self.num_parts}, received {self.part}")
        for name in ("num_prompts", "shard_size", "batch_size", "max_new_tokens", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, received {getattr(self, name)}")
        if self.topk < 0:
            raise ValueError(f"topk: expected >= 0, received {self.topk}")


def shard_plan(cfg: BuildDataConfig):
    """(number of shards, code prompts per shard, chat prompts per shard)."""
    n_chat = int(round(cfg.shard_size * cfg.chat_fraction))
    return (cfg.num_prompts + cfg.shard_size - 1) // cfg.shard_size, cfg.shard_size - n_chat, n_chat


def _pack_shard(results, kinds, prompt_idx, layer_ids, feat_dtype, topk):
    """Compact shard blob (format 2): uint16 token ids, fp16 features, uint16/fp16 top-k."""
    toks, offs, plens, feats = [], [0], [], []
    tk_ids, tk_lp, tk_offs = [], [], [0]
    for r in results:
        toks.append(torch.tensor(r.tokens, dtype=torch.int32))
        offs.append(offs[-1] + len(r.tokens))
        plens.append(r.prompt_len)
        feats.append(r.feats.to(feat_dtype))
        if topk:
            tk_ids.append(r.topk_ids.to(torch.int32))
            tk_lp.append(r.topk_logp.to(torch.float16))
            tk_offs.append(tk_offs[-1] + len(r.topk_ids))
    blob = {"format": 2, "tokens": torch.cat(toks).to(torch.uint16), "offsets": torch.tensor(offs),
            "prompt_lens": torch.tensor(plens, dtype=torch.int64), "feats": torch.cat(feats),
            "layer_ids": list(layer_ids), "prompt_idx": torch.tensor(prompt_idx, dtype=torch.int64),
            "kinds": list(kinds)}
    if topk:
        # row j of sequence i (tk_offsets[i] + j) is the distribution of its response token j
        blob.update({"topk_ids": torch.cat(tk_ids).to(torch.uint16), "topk_logp": torch.cat(tk_lp),
                     "topk_offsets": torch.tensor(tk_offs)})
    return blob


def build_data(cfg: BuildDataConfig, command: Optional[str] = None):
    """Generate shards under ``cfg.out`` (resumable: finished shards and Magpie turns are kept).

    Writes ``manifest.json`` (options, exact command, prompt mix), ``code_prompts.jsonl``,
    ``magpie.jsonl``, ``prompts.jsonl`` (the prompts of the written shards, indexed by ``prompt_idx``
    as ``code:<i>`` / ``chat:<i>``), ``shard_XXXXX.pt`` and one ``stats.jsonl`` row per shard.
    """
    from taps.training.prompts import EvalFilter

    if not isinstance(cfg, BuildDataConfig):
        raise TypeError(f"cfg: expected BuildDataConfig, received {type(cfg).__name__}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    fmt, why = resolve_target_format(cfg.target_format, cfg.target)
    model, tok = load_target(cfg.target, linear_kernel="torch", target_format=fmt)
    nl = model.config.num_hidden_layers
    layer_ids = list(cfg.layer_ids) if cfg.layer_ids else default_target_layer_ids(nl, cfg.num_feature_layers)
    _check_stored_options(cfg, out, layer_ids, fmt)
    nshards, n_code, n_chat = shard_plan(cfg)
    ef = EvalFilter()
    code, dropped = _code_prompts(cfg, out, nshards * n_code, ef)
    src = _sources(cfg, out, model, tok, layer_ids, fmt, code, ef)
    _write_manifest(cfg, out, command, model, src, why, dropped)
    cpu = cpu_name()
    for s in range(nshards):
        sp = out / f"shard_{s:05d}.pt"
        if s % cfg.num_parts != cfg.part or sp.exists():
            continue
        if cfg.deadline is not None and time.time() > cfg.deadline:
            print("deadline reached, stopping", flush=True)
            break
        row = _write_shard(cfg, src, s, sp, cpu)
        with open(out / "stats.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        _write_prompt_index(out, code, src.magpie.turns)
        _update_manifest(out)
    _write_prompt_index(out, code, src.magpie.turns)
    _update_manifest(out, magpie=dict(src.magpie.stats, accepted=len(src.magpie.turns)))
    return out


@dataclass
class _Sources:
    """What every shard of a ``build-data`` run reads: the generator, the tokenizer, the Magpie writer, the
    code prompts, the feature layers, the target format and the prompts of each kind per shard."""

    gen: object
    tok: object
    magpie: object
    code: List[dict]
    layer_ids: List[int]
    fmt: str
    n_code: int
    n_chat: int


def _check_stored_options(cfg: BuildDataConfig, out: Path, layer_ids: List[int], fmt: str) -> None:
    """Refuses to add to a directory whose manifest was written with other data-shaping options."""
    man_p = out / "manifest.json"
    keep = ("target", "target_format", "layer_ids", "shard_size", "chat_fraction", "seed", "max_new_tokens", "topk")
    # compared as stored: paths portable, tuples as lists
    asked = portable_record(dict({k: getattr(cfg, k) for k in keep}, layer_ids=layer_ids, target_format=fmt))
    if man_p.exists():
        old = json.loads(man_p.read_text())
        stored = dict(old["config"])
        if stored.get("target_format") in (None, "auto"):  # data written before the GGUF format: fp32
            stored["target_format"] = old.get("target_format", "fp32")
        diff = {k: (stored.get(k), v) for k, v in asked.items() if stored.get(k) != v}
        if diff:
            raise ValueError(f"{out} holds data built with other options (stored, asked): {diff}")


def _code_prompts(cfg: BuildDataConfig, out: Path, n: int, ef):
    """``(code prompts, prompts the eval filter dropped)``: ``code_prompts.jsonl`` when written (extended to
    ``n`` with the written ones kept in place), else ``n`` new ones, written there."""
    code_p = out / "code_prompts.jsonl"
    man_p = out / "manifest.json"
    if code_p.exists():
        code = [json.loads(l) for l in code_p.read_text().splitlines()]
        dropped = json.loads(man_p.read_text()).get("eval_filter_dropped") if man_p.exists() else None
        if len(code) < n:  # a resumed run asked for more prompts: the written ones keep their index
            code = extend_prompts(code, n, seed=cfg.seed, eval_filter=ef)
            _atomic_write(code_p, "".join(json.dumps(p) + "\n" for p in code))
    else:
        code = build_prompts(n, seed=cfg.seed, eval_filter=ef)
        dropped = getattr(build_prompts, "last_dropped", None)
        _atomic_write(code_p, "".join(json.dumps(p) + "\n" for p in code))
    return code, dropped


def _sources(cfg: BuildDataConfig, out: Path, model, tok, layer_ids: List[int], fmt: str, code: List[dict],
             ef) -> _Sources:
    """The run's generator (:class:`GGUFGenerator` for ``gguf``, else :class:`LlamaGenerator`) and Magpie
    writer, with the rest of :class:`_Sources`."""
    from taps.data.generation import generator_for
    from taps.data.magpie import MagpieWriter

    gen = generator_for(model, layer_ids, batch_size=cfg.batch_size)
    magpie = MagpieWriter(out, gen, tok, eval_filter=ef, temperature=cfg.magpie_temperature,
                          max_tokens=cfg.magpie_max_tokens, batch_size=2 * cfg.batch_size, seed=cfg.seed)
    _, n_code, n_chat = shard_plan(cfg)
    return _Sources(gen, tok, magpie, code, layer_ids, fmt, n_code, n_chat)


def _write_manifest(cfg: BuildDataConfig, out: Path, command: Optional[str], model, src: _Sources, why: str,
                    dropped) -> None:
    """``manifest.json`` (options, command, prompt mix, generation speed so far) and ``meta.json``."""
    import sys

    fmt, layer_ids = src.fmt, src.layer_ids
    nl = model.config.num_hidden_layers
    conf = {k: v for k, v in asdict(cfg).items() if k not in ("deadline",)}
    conf["layer_ids"] = layer_ids
    conf["target_format"] = fmt
    manifest = {"config": portable_record(conf), "command": command or portable_command(sys.argv),
                "target_format": fmt, "target_format_why": why, "num_target_layers": nl,
                "hidden_size": model.config.hidden_size, "layer_ids": layer_ids, "num_shards": shard_plan(cfg)[0],
                "code_per_shard": src.n_code, "chat_per_shard": src.n_chat, "prompt_mode": "chat",
                "feat_dtype": cfg.feat_dtype, "eval_filter_dropped": dropped, "format": 2,
                "generation": generation_speed(out)}
    _atomic_write(out / "manifest.json", json.dumps(manifest, indent=1))
    # meta.json: what ShardData reads (layer ids of the features)
    _atomic_write(out / "meta.json", json.dumps({"target": cfg.target, "target_format": fmt, "num_target_layers": nl,
                                                 "layer_ids": layer_ids, "hidden_size": model.config.hidden_size,
                                                 "feat_dtype": cfg.feat_dtype, "format": 2}, indent=1))


def _write_shard(cfg: BuildDataConfig, src: _Sources, s: int, sp: Path, cpu: str) -> dict:
    """Answers shard ``s``'s prompts, writes it atomically to ``sp`` and returns its ``stats.jsonl`` row."""
    t0 = time.time()
    n_code, n_chat, code = src.n_code, src.n_chat, src.code
    turns = src.magpie.ensure((s + 1) * n_chat) if n_chat else []
    t_magpie = time.time() - t0
    items = [("code", i, code[i]) for i in range(s * n_code, min(len(code), (s + 1) * n_code))]
    items += [("chat", i, turns[i]) for i in range(s * n_chat, (s + 1) * n_chat)]
    pids = [apply_chat_template(src.tok, it[2]["text"])[-cfg.max_prompt_tokens:] for it in items]
    results = _answer(src.gen, pids, [it[0] for it in items], cfg, src.tok.eos_token_id, src.fmt)
    kinds = [it[2]["kind"] for it in items]
    pidx = [(i if k == "code" else 1_000_000 + i) for k, i, _ in items]
    blob = _pack_shard(results, kinds, pidx, src.layer_ids, getattr(torch, cfg.feat_dtype), cfg.topk)
    tmp = sp.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, sp)
    ntok = int(blob["tokens"].numel())
    nresp = ntok - int(blob["prompt_lens"].sum())
    el = time.time() - t0
    return {"shard": s, "seqs": len(items), "tokens": ntok, "response_tokens": nresp, "seconds": round(el, 1),
            "magpie_seconds": round(t_magpie, 1), "tokens_per_s": round(ntok / max(el - t_magpie, 1e-6), 1),
            "generation_seconds": round(el - t_magpie, 3),
            "response_tokens_per_s": round(nresp / max(el - t_magpie, 1e-6), 1), "target_format": src.fmt,
            "threads": torch.get_num_threads(), "batch_size": cfg.batch_size, "cpu": cpu,
            "bytes": sp.stat().st_size, "wall": time.strftime("%H:%M:%S")}


def _update_manifest(out: Path, magpie: Optional[dict] = None) -> None:
    """Refreshes the manifest's ``generation`` record (and sets its ``magpie`` record when given)."""
    man_p = out / "manifest.json"
    m = json.loads(man_p.read_text())
    if magpie is not None:
        m["magpie"] = magpie
    m["generation"] = generation_speed(out)
    _atomic_write(man_p, json.dumps(m, indent=1))


def _answer(gen, prompt_ids: List[List[int]], kinds: List[str], cfg: BuildDataConfig, eos_id: int, fmt: str):
    """Greedy answers (:class:`taps.data.generation.GenResult`, in prompt order) to a shard's prompts.

    ``gguf``: every prompt in one call (shortest first, ``cfg.batch_size`` rows live; rows are independent,
    so the grouping changes no bit). ``fp32``: each prompt kind apart in left-padded batches of
    ``cfg.batch_size`` sorted by length (padding changes float32 rounding, so the grouping is kept as it
    always was).
    """
    order = sorted(range(len(prompt_ids)), key=lambda j: len(prompt_ids[j]))
    if fmt in GGUF_FORMATS:
        groups = [order]
    else:
        groups = []
        for kind in ("code", "chat"):
            sel = [j for j in order if kinds[j] == kind]
            groups += [sel[k:k + cfg.batch_size] for k in range(0, len(sel), cfg.batch_size)]
    results = [None] * len(prompt_ids)
    for chunk in groups:
        res = gen.generate([prompt_ids[j] for j in chunk], cfg.max_new_tokens, eos_id=eos_id, topk=cfg.topk)
        for j, r in zip(chunk, res):
            results[j] = r
    return results


def generation_speed(data_dir) -> dict:
    """The ``generation`` record of a manifest: response tokens/s over every shard of ``stats.jsonl``, Magpie
    sampling excluded (``response_tokens_per_s``) and included (``..._with_magpie``), with the target formats,
    threads, batch sizes and CPUs the shards were made with."""
    rows = []
    p = Path(data_dir) / "stats.jsonl"
    if p.exists():
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    resp = sum(r["response_tokens"] for r in rows)
    secs = sum(r.get("generation_seconds", r["seconds"] - r.get("magpie_seconds", 0.0)) for r in rows)
    seen = {k: sorted({r[k] for r in rows if k in r}) for k in ("target_format", "threads", "batch_size", "cpu")}
    magpie = sum(r.get("magpie_seconds", 0.0) for r in rows)
    return {"shards": len(rows), "response_tokens": resp, "seconds": round(secs, 3),
            "response_tokens_per_s": round(resp / secs, 1) if secs > 0 else None, "magpie_seconds": round(magpie, 1),
            "response_tokens_per_s_with_magpie": round(resp / (secs + magpie), 1) if secs + magpie > 0 else None,
            **seen}


def _write_prompt_index(out: Path, code: List[dict], chat: List[dict]):
    """``prompts.jsonl``: one line per prompt_idx used in shards (code i -> i, chat i -> 1e6 + i)."""
    recs = [dict(p, idx=i) for i, p in enumerate(code)] + [dict(p, idx=1_000_000 + i) for i, p in enumerate(chat)]
    _atomic_write(out / "prompts.jsonl", "".join(json.dumps(r) + "\n" for r in recs))


def _atomic_write(path: Path, text: str):
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def list_shards(data_dir: str) -> List[Path]:
    return sorted(Path(data_dir).glob("shard_*.pt"))


def data_summary(data_dir: str) -> dict:
    tot = resp = seqs = 0
    secs = 0.0
    p = Path(data_dir) / "stats.jsonl"
    if p.exists():
        for line in p.read_text().splitlines():
            r = json.loads(line)
            tot += r["tokens"]; resp += r["response_tokens"]; seqs += r["seqs"]; secs += r["seconds"]
    return {"shards": len(list_shards(data_dir)), "sequences": seqs, "tokens": tot, "response_tokens": resp,
            "generation_seconds": round(secs, 1)}
