"""Candidate pool: top-K per draft position, then the best-first prefix search (METHOD.md section 3)."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import FLOAT_DTYPES, check_positive_int, check_tensor
from ..backend import resolve
from ..layout import CandidatePool, TopKStats, Tree


def topk_stats(draft_logits: torch.Tensor, top_k: int, backend: Optional[str] = None) -> TopKStats:
    """Per-position top-K of the draft marginals plus the statistics the scorer reads.

    Args:
        draft_logits: ``[B, D, V]`` float32/float16/bfloat16 logits of the D draft positions.
        top_k: tokens kept per position; ``K = min(top_k, V)``.
    Returns:
        :class:`TopKStats` with ``topk_logp [B,D,K] f32`` (log-softmax values, descending, ties to the
        smallest token id), ``topk_ids [B,D,K] int64``, ``entropy [B,D] f32`` (nats),
        ``margin [B,D] f32`` (top1 - top2 log-prob), ``topk_mass [B,D] f32``.
    """
    check_tensor("draft_logits", draft_logits, dtypes=FLOAT_DTYPES, ndim=3)
    check_positive_int("top_k", top_k)
    B, D, V = draft_logits.shape
    if D < 1 or V < 1:
        raise ValueError(f"draft_logits: expected at least one position and one vocabulary entry, received shape {(B, D, V)}")
    _, fn = resolve("topk_stats", backend, draft_logits.device)
    return TopKStats(*fn(draft_logits, top_k))


def best_first_pool(stats: TopKStats, root_tokens: torch.Tensor, pool_size: int, backend: Optional[str] = None):
    """Assemble the ``pool_size`` highest-mass prefixes from a :class:`TopKStats` lattice.

    Returns ``(Tree, logq, step_logq, rank)``; ``N = pool_size + 1`` rows, nodes in pop order
    (non-increasing ``logq``, a valid topological order). Ties: smaller parent index, then smaller rank.
    """
    check_positive_int("pool_size", pool_size)
    B, D, K = stats.topk_logp.shape
    check_tensor("root_tokens", root_tokens, dtypes=(torch.int64,), shape=(B,), device=stats.topk_logp.device)
    _, fn = resolve("best_first_pool", backend, stats.topk_logp.device)
    tokens, parents, depth, num_nodes, logq, step_logq, rank = fn(stats.topk_logp.float().contiguous(),
                                                                  stats.topk_ids.contiguous(), root_tokens.contiguous(),
                                                                  pool_size)
    return Tree(tokens, parents, depth, num_nodes), logq, step_logq, rank


def candidate_pool(draft_logits: torch.Tensor, root_tokens: torch.Tensor, top_k: int, pool_size: int,
                   backend: Optional[str] = None, pool_backend: Optional[str] = None) -> CandidatePool:
    """Build the candidate pool of a draft block.

    Args:
        draft_logits: ``[B, D, V]`` float logits of the D draft positions (position ``i`` predicts depth ``i+1``).
        root_tokens: ``[B] int64`` bonus tokens (node 0 of each tree).
        top_k: tokens per position (``>= 1``; clamped to V).
        pool_size: non-root nodes in the pool (``>= 1``). With ``pool_size = B`` this is the DDTree tree of budget B.
        backend: backend of the top-K pass; ``pool_backend`` of the best-first search (default: same rule).
    Returns:
        :class:`CandidatePool`: ``.tree`` (``N = pool_size + 1`` rows, see ``taps_kernels.layout``),
        ``.logq``/``.step_logq [B,N] f32``, ``.rank [B,N] int32`` and the per-position statistics.
    """
    check_tensor("draft_logits", draft_logits, dtypes=FLOAT_DTYPES, ndim=3)
    B = draft_logits.shape[0]
    check_tensor("root_tokens", root_tokens, dtypes=(torch.int64,), shape=(B,), device=draft_logits.device)
    check_positive_int("top_k", top_k)
    check_positive_int("pool_size", pool_size)
    V = draft_logits.shape[2]
    bad = (root_tokens < 0) | (root_tokens >= V)
    if bad.any():
        b = int(bad.nonzero()[0])
        raise ValueError(f"root_tokens[{b}]: token {int(root_tokens[b])} is outside the vocabulary [0, {V})")
    stats = topk_stats(draft_logits, top_k, backend=backend)
    pool_device = stats.topk_logp.device
    if pool_backend in (None, "cpp", "reference") and pool_device.type == "cuda" and pool_backend is not None:
        stats_host = TopKStats(*(t.cpu() for t in (stats.topk_logp, stats.topk_ids, stats.entropy, stats.margin,
                                                   stats.topk_mass)))
        tree, logq, step_logq, rank = best_first_pool(stats_host, root_tokens.cpu(), pool_size, backend=pool_backend)
        tree, logq, step_logq, rank = tree.to(pool_device), logq.to(pool_device), step_logq.to(pool_device), rank.to(pool_device)
    else:
        tree, logq, step_logq, rank = best_first_pool(stats, root_tokens, pool_size, backend=pool_backend)
    return CandidatePool(tree, logq, step_logq, rank, stats.topk_logp, stats.topk_ids, stats.entropy, stats.margin,
                         stats.topk_mass)
