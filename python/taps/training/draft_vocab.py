"""Reduced draft vocabulary (FR-Spec): the most frequent target tokens.

The drafter's vocabulary projection is most of a draft pass on a CPU. The
target's responses use a small part of its 49,152 ids, so the drafter
projects onto the ``N`` ids the target emits most often in the generated
training data (responses only). Tokens outside the set are never proposed;
decoding stays lossless because the target verifies every proposal.

``select_draft_vocab`` is deterministic (count descending, id ascending on
ties) and always keeps the ids in ``always`` (end of turn, ...).

With little data the raw counts leave most of the vocabulary tied at zero;
``expected_token_counts`` adds the target's own probabilities from the stored
top-k of every response position (the expected count of each id), which ranks
the plausible-but-unseen tokens far better than the id order does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import torch


def response_token_counts(data_dir: str, vocab_size: int, shards: Optional[Iterable[int]] = None,
                          exclude: Sequence[int] = ()) -> torch.Tensor:
    """int64 ``[vocab_size]``: how often each id occurs in the RESPONSE part of the shards
    (``shards``: indices to read, default all; ``exclude``: indices to skip)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    want = None if shards is None else set(shards)
    for p in sorted(Path(data_dir).glob("shard_*.pt")):
        s = int(p.stem.split("_")[1])
        if s in exclude or (want is not None and s not in want):
            continue
        b = torch.load(str(p), mmap=True, weights_only=True)
        toks, off, pl = b["tokens"].long(), b["offsets"], b["prompt_lens"]
        for i in range(len(pl)):
            r = toks[int(off[i]) + int(pl[i]):int(off[i + 1])]
            counts += torch.bincount(r.clamp(0, vocab_size - 1), minlength=vocab_size)
    return counts


def expected_token_counts(data_dir: str, vocab_size: int, shards: Optional[Iterable[int]] = None,
                          exclude: Sequence[int] = ()) -> torch.Tensor:
    """float64 ``[vocab_size]``: raw response counts plus, at every response position, the target's
    probability of each of its stored top-k ids (format-2 shards; others add the raw counts only)."""
    counts = response_token_counts(data_dir, vocab_size, shards, exclude).to(torch.float64)
    want = None if shards is None else set(shards)
    for p in sorted(Path(data_dir).glob("shard_*.pt")):
        s = int(p.stem.split("_")[1])
        if s in exclude or (want is not None and s not in want):
            continue
        b = torch.load(str(p), mmap=True, weights_only=True)
        if "topk_ids" not in b:
            continue
        ids = b["topk_ids"].long().flatten().clamp(0, vocab_size - 1)
        counts.index_add_(0, ids, b["topk_logp"].double().exp().flatten())
    return counts


def select_draft_vocab(counts: torch.Tensor, size: Optional[int] = None, coverage: float = 0.99,
                       min_size: int = 1024, always: Sequence[int] = ()) -> torch.Tensor:
    """Sorted int64 ids: the ``size`` most frequent ids, or (``size=None``) the fewest covering
    ``coverage`` of all counted tokens (at least ``min_size``), plus ``always``."""
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"counts: expected a 1-D tensor, received shape {tuple(counts.shape)}")
    V = counts.numel()
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage: expected a value in (0, 1], received {coverage}")
    # stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-counts, stable=True).indices
    if size is None:
        total = float(counts.sum())
        if total == 0:
            raise ValueError("counts: all zero; no data to choose a draft vocabulary from")
        csum = counts[order].cumsum(0)
        size = int((csum < coverage * total).sum()) + 1
        size = max(size, min_size)
    if not 1 <= size <= V:
        raise ValueError(f"size: expected 1..{V}, received {size}")
    keep = set(order[:size].tolist())
    for a in always:
        if not 0 <= int(a) < V:
            raise ValueError(f"always: id {a} outside [0, {V})")
        keep.add(int(a))
    return torch.tensor(sorted(keep), dtype=torch.int64)


def vocab_coverage(ids: torch.Tensor, counts: torch.Tensor) -> float:
    """Share of the counted tokens whose id is in ``ids``."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


def coverage_report(data_dir: str, ids: torch.Tensor, vocab_size: int, holdout: List[int],
                    shards: Optional[Iterable[int]] = None) -> dict:
    """Coverage of ``ids`` on the training shards (``shards``, default all but ``holdout``) and, separately,
    on the held-out shards."""
    tr = response_token_counts(data_dir, vocab_size, shards=shards, exclude=holdout)
    out = {"size": int(ids.numel()), "train_tokens": int(tr.sum()), "train_coverage": round(vocab_coverage(ids, tr), 5)}
    if holdout:
        ho = response_token_counts(data_dir, vocab_size, shards=holdout)
        out.update({"heldout_tokens": int(ho.sum()), "heldout_coverage": round(vocab_coverage(ids, ho), 5)})
    return out
