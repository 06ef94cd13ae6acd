"""Subtree selection: keep a prefix-closed subtree of the pool, by reach, throughput or published utility."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .._checks import FLOAT_DTYPES, check_positive_int, check_tensor
from ..backend import has_impl, resolve
from ..layout import Selection, Tree

RULES = ("reach", "utility")


def select_subtree(tree: Tree, log_reach: torch.Tensor, max_nodes: int,
                   latency: Optional[Union[torch.Tensor, Sequence[float]]] = None, t0: float = 0.0,
                   rule: str = "reach", lambda_node: float = 1.0, lambda_depth: float = 0.002,
                   min_utility: float = 0.0, backend: Optional[str] = None) -> Selection:
    """Choose the subtree to verify.

    Args:
        tree: the pool (:class:`Tree`, ``N`` rows).
        log_reach: ``[B, N]`` float log reach of each node (root 0).
        max_nodes: most non-root nodes kept (``>= 1``).
        latency: optional ``[L]`` seconds to verify root + n nodes, ``n = 0..L-1``; with it (rule
            ``"reach"``) the size is ``n* = argmax (1 + sum of the top-n reaches) / (t0 + latency[n])``.
        t0: fixed per-round seconds (draft, pool, selection) added to every latency entry.
        rule: ``"reach"`` (top nodes by prefix-closed reach, parent-first ties) or ``"utility"``
            (published rule ``r / (lambda_node + lambda_depth * depth)`` with ancestor closure,
            stopping below ``min_utility``).
    Returns:
        :class:`Selection`: ``tree`` with ``max_nodes + 1`` rows (pool order kept, root first),
        ``pool_index [B, max_nodes+1] int64`` and ``num_selected [B] int32``.
    """
    tree.validate("tree")
    check_positive_int("max_nodes", max_nodes)
    B, N = tree.tokens.shape
    check_tensor("log_reach", log_reach, dtypes=FLOAT_DTYPES, shape=(B, N), device=tree.device)
    if rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES}, received {rule!r}")
    if latency is not None:
        latency = torch.as_tensor(latency, dtype=torch.float64)
        check_tensor("latency", latency, ndim=1)
        # min() propagates NaN and a NaN comparison is False: one reduction checks both.
        if latency.numel() < 1 or not float(latency.min()) + t0 > 0:
            raise ValueError(f"latency: expected a non-empty 1-D table of seconds with t0 + latency[n] > 0, "
                             f"received {latency.tolist()[:8]}... (t0={t0})")
        if rule != "reach":
            raise ValueError("latency: the throughput rule needs rule='reach'")
    if rule == "utility" and lambda_node <= 0:
        raise ValueError(f"lambda_node: expected > 0 for the utility rule, received {lambda_node}")
    name, fn = resolve("select_subtree", backend, tree.device)
    pool_index, num_selected = fn(tree.parents.contiguous(), tree.depth.contiguous(), tree.num_nodes.contiguous(),
                                  log_reach.float().contiguous(), max_nodes, latency, float(t0), rule,
                                  float(lambda_node), float(lambda_depth), float(min_utility))
    # Re-index with the same backend when it has a re-indexer (cpp); else the torch version, which runs anywhere.
    _, reindex = resolve("reindex_subtree", name if has_impl("reindex_subtree", name) else "reference", tree.device)
    tokens, parents, depth, num_nodes = reindex(tree.tokens.contiguous(), tree.parents.contiguous(),
                                                tree.depth.contiguous(), tree.num_nodes.contiguous(), pool_index,
                                                num_selected)
    return Selection(Tree(tokens, parents, depth, num_nodes), pool_index, num_selected)
