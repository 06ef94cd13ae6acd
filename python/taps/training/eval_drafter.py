"""``eval-drafter``: drafter quality on held-out target-generated text.

For anchors ``a`` in the response part of held-out sequences (greedy
continuations of the target, so ``x[a+1..]`` IS the target's greedy chain),
the drafter block ``[x[a], MASK x D]`` is run with the clean target features
of positions ``< a`` (the training forward, proven equal to the incremental
``draft`` API by the tests) and the FULL-vocabulary LM head.

Metrics:
* ``pos_acc[k]``: agreement of the drafter argmax at block position ``k``
  with the target's greedy token ``x[a+k]`` (k = 1..D),
* ``tau``: mean acceptance length of the argmax chain, ``1 + `` number of
  consecutive matches from position 1 (the bonus counts, METHOD.md section 1),
  i.e. tokens per round of plain DFlash with greedy verification,
* the same split by prompt kind (complete / write / explain / continue / module / chat), and by the two
  prompt families: ``code`` (the local code-prompt pipeline, every kind but chat) and ``chat`` (Magpie).

``block_positions`` P: only block positions ``1..P`` count (tau at most P + 1: what a policy that drafts P
positions can accept); with ``short_blocks`` the block run is ``[x[a], MASK x P]`` instead of the trained
``block_size`` rows (:attr:`taps.models.drafter.DFlashDrafter.short_blocks`).

``use_draft_vocab``: the argmax runs over the drafter's draft vocabulary (what decoding proposes when
one is set); default the full vocabulary. ``dtype``: the drafter body's dtype (bf16 measures what a
bf16 drafter proposes). ``head_dtype``: the vocabulary projection as :meth:`draft` runs it with that
:attr:`~taps.models.drafter.DFlashDrafter.head_dtype` (``torch.int8``: the int8 head); default the LM
head in its own dtype.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional

import torch

from taps.models.drafter import check_compatible, load_drafter
from taps.paths import portable_path
from taps.training.train_drafter import ShardData, make_batch


@dataclass
class EvalOptions:
    """Options of :func:`eval_drafter` (``eval-drafter`` on the command line); see the module docstring.

    ``shards``: the held-out shard indices read (default ``[0]``); ``max_seqs`` sequences, ``anchors_per_seq``
    anchors each (drawn with ``seed``), ``batch_size`` sequences per forward; ``out_json``: also write the
    result there; ``threads``: CPU threads (default: leave as set).
    """

    target: str = "smollm2"
    shards: Optional[List[int]] = None
    max_seqs: int = 96
    anchors_per_seq: int = 16
    seed: int = 1234
    batch_size: int = 4
    out_json: Optional[str] = None
    threads: Optional[int] = None
    use_draft_vocab: bool = False
    dtype: torch.dtype = torch.float32
    block_positions: Optional[int] = None
    short_blocks: bool = False
    head_dtype: Optional[torch.dtype] = None


@torch.no_grad()
def eval_drafter(drafter_dir: str, data: str, options: Optional[EvalOptions] = None, *, drafter=None, tmodel=None,
                 **overrides):
    """The metrics of the module docstring for the drafter in ``drafter_dir`` (or ``drafter``, already loaded)
    on the shards of ``data``. ``options`` (default :class:`EvalOptions`), with any of its fields overridden
    by keyword (``eval_drafter(d, data, shards=[0], max_seqs=8)``); ``tmodel``: the target, already loaded."""
    from taps.models.target import load_target

    opts = replace(options or EvalOptions(), **overrides)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.shards is None:
        opts.shards = [0]
    if tmodel is None:
        tmodel, _ = load_target(opts.target)
    if drafter is None:
        drafter = load_drafter(drafter_dir, target_config=tmodel.config, dtype=opts.dtype)
    else:
        check_compatible(drafter.config, tmodel.config)
    if opts.use_draft_vocab and drafter.draft_vocab is None:
        raise ValueError("use_draft_vocab: the drafter has no draft vocabulary")
    drafter.eval()
    saved_head = drafter.head_dtype, drafter.draft_vocab
    drafter.head_dtype = opts.head_dtype
    if not opts.use_draft_vocab:
        drafter.draft_vocab = None  # the full vocabulary, not the config's reduced one
    try:
        return _eval(drafter, drafter_dir, data, tmodel, opts)
    finally:
        drafter.head_dtype, drafter.draft_vocab = saved_head


def _eval(drafter, drafter_dir, data, tmodel, opts: EvalOptions):
    from tqdm import tqdm

    shards, block_positions, short_blocks = opts.shards, opts.block_positions, opts.short_blocks
    use_draft_vocab, batch_size = opts.use_draft_vocab, opts.batch_size
    embed, head = tmodel.get_input_embeddings(), tmodel.get_output_embeddings()
    ds = ShardData(data, only=shards)
    prompts = []
    pp = Path(data) / "prompts.jsonl"
    if pp.exists():
        prompts = [json.loads(l) for l in pp.read_text().splitlines()]
    S = drafter.config.block_size
    D = S - 1 if block_positions is None else int(block_positions)
    if not 1 <= D <= S - 1:
        raise ValueError(f"block_positions: expected 1..{S - 1} (block_size-1), received {block_positions}")
    if short_blocks and block_positions is None:
        raise ValueError("short_blocks: needs block_positions (the positions the short block drafts)")
    rng = random.Random(opts.seed)
    n = min(opts.max_seqs, len(ds))
    hits = torch.zeros(D)
    cnt = torch.zeros(D)
    taus = []
    by_kind = {}
    t0 = time.time()
    for i in tqdm(range(0, n, batch_size), desc="eval-drafter", unit="batch"):
        ks = list(range(i, min(n, i + batch_size)))
        samples = [ds.get(k) for k in ks]
        feats, blocks, anchors, labels = make_batch(samples, S, opts.anchors_per_seq, drafter.mask_token_id, rng,
                                                    full_blocks_only=True)
        labels = labels[:, :, :D]
        if short_blocks:
            blocks = blocks[:, :, :D + 1]
        h = drafter.forward_blocks(feats, blocks, anchors, embed)[:, :, 1:D + 1]
        if use_draft_vocab or drafter.head_dtype is not None:
            # the projection draft() runs: its head dtype, over the draft vocabulary (-inf outside it)
            pred = drafter._vocab_logits(h, head, full_vocab=True).argmax(-1)
        else:
            pred = head(h.to(head.weight.dtype)).argmax(-1)  # [B,M,D]
        valid = labels >= 0
        hit = (pred == labels) & valid
        hits += hit.float().sum((0, 1))
        cnt += valid.float().sum((0, 1))
        run = torch.cumprod(hit.long(), dim=-1).sum(-1)  # [B,M]
        for b, k in enumerate(ks):
            kind = ds.kind(k)
            if kind is None:  # format-1 shards: the kind comes from prompts.jsonl
                s, si = ds.index[k]
                pidx = int(ds.shards[s]["prompt_idx"][si])
                kind = prompts[pidx]["kind"] if pidx < len(prompts) else "unknown"
            for m in range(anchors.shape[1]):
                if anchors[b, m] >= 0:
                    t = 1.0 + float(run[b, m])
                    taus.append(t)
                    by_kind.setdefault(kind, []).append(t)
    pos_acc = (hits / cnt.clamp(min=1)).tolist()
    res = {
        "drafter": portable_path(drafter_dir), "data": portable_path(data), "shards": shards, "sequences": n, "blocks": len(taus),
        "tau": round(sum(taus) / max(1, len(taus)), 4),
        "pos_acc": [round(a, 4) for a in pos_acc],
        "tau_by_kind": {k: {"tau": round(sum(v) / len(v), 4), "blocks": len(v)} for k, v in sorted(by_kind.items())},
        "code_kinds_tau": None,
        "family_tau": {},
        "draft_vocab": bool(use_draft_vocab),
        "dtype": str(drafter.fc.weight.dtype).replace("torch.", ""),
        "head_dtype": str(drafter.head_dtype or head.weight.dtype).replace("torch.", ""),
        "block_positions": D, "short_blocks": bool(short_blocks),
        "seconds": round(time.time() - t0, 1),
    }
    code = [t for k in ("complete", "write", "continue") for t in by_kind.get(k, [])]
    if code:
        res["code_kinds_tau"] = round(sum(code) / len(code), 4)
    fam = {"code": [t for k, v in by_kind.items() if k != "chat" for t in v], "chat": by_kind.get("chat", [])}
    res["family_tau"] = {k: {"tau": round(sum(v) / len(v), 4), "blocks": len(v)} for k, v in fam.items() if v}
    if opts.out_json:
        Path(opts.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out_json).write_text(json.dumps(res, indent=1) + "\n")
    return res
