"""``build-data``: the target regenerates responses to local prompts.

For every prompt (see :mod:`taps.training.prompts`) the target greedily
continues the chat-templated prompt (batched, left padding). While it
generates, forward hooks capture the hidden states of the target layers the
drafter is conditioned on (``hidden_states[id+1]`` = output of decoder layer
``id``), so no second target pass is needed at training time.

Shard format (``shard_XXXXX.pt``, written atomically, skipped if present so a
killed run resumes where it stopped)::

    tokens      int32 [T_total]        prompt+response ids of all sequences, concatenated
    offsets     int64 [n+1]            sequence i = tokens[offsets[i]:offsets[i+1]]
    prompt_lens int64 [n]              prompt tokens of each sequence
    feats       fp16/bf16 [T_total, n_layers*H]  target features of each token
                                       (the last token of a sequence has zeros: never fed)
    layer_ids   list[int]
    prompt_idx  int64 [n]              index into the prompt list
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import List, Optional

import torch

from taps.models.drafter import default_target_layer_ids
from taps.models.target import apply_chat_template, load_target
from taps.training.prompts import build_prompts


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


def build_data(out_dir: str, target: str = "smollm2", num_prompts: int = 4000, shard_size: int = 96,
               batch_size: int = 48, max_new_tokens: int = 192, max_prompt_tokens: int = 384,
               num_feature_layers: int = 5, layer_ids: Optional[List[int]] = None, seed: int = 0,
               feat_dtype: str = "float16", threads: Optional[int] = None, deadline: Optional[float] = None,
               part: int = 0, num_parts: int = 1):
    """Generate shards under ``out_dir`` (resumable). ``deadline``: unix time after
    which no new shard is started. ``part``/``num_parts``: this process writes the
    shards ``s`` with ``s % num_parts == part`` (several 1-thread processes share
    one data dir)."""
    from tqdm import tqdm

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_target(target)
    nl = model.config.num_hidden_layers
    layer_ids = list(layer_ids) if layer_ids else default_target_layer_ids(nl, num_feature_layers)
    meta_p = out / "meta.json"
    if meta_p.exists():
        meta = json.loads(meta_p.read_text())
        if meta["layer_ids"] != layer_ids:
            raise ValueError(f"{out} holds data for layer ids {meta['layer_ids']}, asked {layer_ids}")
    prompts = build_prompts(num_prompts, seed=seed)
    meta = {"target": target, "num_target_layers": nl, "layer_ids": layer_ids, "hidden_size": model.config.hidden_size,
            "num_prompts": len(prompts), "shard_size": shard_size, "max_new_tokens": max_new_tokens,
            "prompt_mode": "chat", "seed": seed, "feat_dtype": feat_dtype,
            "eval_filter_dropped": getattr(build_prompts, "last_dropped", None)}
    _atomic_write(meta_p, json.dumps(meta, indent=1))
    _atomic_write(out / "prompts.jsonl", "".join(json.dumps(p) + "\n" for p in prompts))
    cap = _FeatureCapture(model, layer_ids)
    dt = getattr(torch, feat_dtype)
    nshards = (len(prompts) + shard_size - 1) // shard_size
    stats_p = out / "stats.jsonl"
    pbar = tqdm(range(nshards), desc="build-data", unit="shard")
    for s in pbar:
        sp = out / f"shard_{s:05d}.pt"
        if s % num_parts != part or sp.exists():
            continue
        if deadline is not None and time.time() > deadline:
            print("deadline reached, stopping", flush=True)
            break
        t0 = time.time()
        idx = list(range(s * shard_size, min(len(prompts), (s + 1) * shard_size)))
        pids = []
        for i in idx:
            ids = apply_chat_template(tok, prompts[i]["text"])
            pids.append(ids[-max_prompt_tokens:] if len(ids) > max_prompt_tokens else ids)
        order = sorted(range(len(idx)), key=lambda j: len(pids[j]))
        seqs = {}
        for k in range(0, len(order), batch_size):
            chunk = order[k:k + batch_size]
            res = generate_batch(model, tok, [pids[j] for j in chunk], max_new_tokens, cap)
            for j, r in zip(chunk, res):
                seqs[j] = r
        toks, offs, plens, feats, pidx = [], [0], [], [], []
        for j in range(len(idx)):
            seq, pl, f = seqs[j]
            toks.append(torch.tensor(seq, dtype=torch.int32))
            offs.append(offs[-1] + len(seq))
            plens.append(pl)
            feats.append(f.to(dt))
            pidx.append(idx[j])
        blob = {"tokens": torch.cat(toks), "offsets": torch.tensor(offs, dtype=torch.int64),
                "prompt_lens": torch.tensor(plens, dtype=torch.int64), "feats": torch.cat(feats),
                "layer_ids": layer_ids, "prompt_idx": torch.tensor(pidx, dtype=torch.int64)}
        tmp = sp.with_suffix(".tmp")
        torch.save(blob, tmp)
        os.replace(tmp, sp)
        ntok = int(blob["tokens"].numel())
        nresp = ntok - int(sum(plens))
        el = time.time() - t0
        with open(stats_p, "a") as f:
            f.write(json.dumps({"shard": s, "seqs": len(idx), "tokens": ntok, "response_tokens": nresp,
                                "seconds": round(el, 1), "feat_absmax": float(blob["feats"].float().abs().max())}) + "\n")
        pbar.set_postfix(resp_tok=nresp, tok_s=f"{nresp / el:.0f}")
    cap.remove()
    return out


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
