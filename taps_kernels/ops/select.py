"""Subtree selection: keep a prefix-closed subtree of the pool, by reach, throughput or published utility."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .._checks import FLOAT_DTYPES, check_positive_int, check_tensor
from ..backend import resolve
from ..layout import Selection, Tree

RULES = ("reach", "utility")


def reindex_subtree(tree: Tree, pool_index: torch.Tensor, num_selected: torch.Tensor) -> Tree:
    """Gather the kept rows of ``tree`` (``pool_index [B,M]`` ascending, -1 padded) into a new, re-indexed Tree."""
    B, N = tree.tokens.shape
    M = pool_index.shape[1]
    keep = pool_index >= 0
    src = pool_index.clamp(min=0)
    # Padding rows scatter into a spare column N that is dropped afterwards.
    slot = torch.where(keep, src, torch.full_like(src, N))
    new_of_old = torch.full((B, N + 1), -1, dtype=torch.int64, device=tree.device)
    new_of_old.scatter_(1, slot, torch.arange(M, device=tree.device).expand(B, M).contiguous())
    new_of_old = new_of_old[:, :N]
    old_parent = tree.parents.long().gather(1, src)
    new_parent = torch.where(old_parent >= 0, new_of_old.gather(1, old_parent.clamp(min=0)), old_parent)
    tokens = torch.where(keep, tree.tokens.gather(1, src), torch.zeros_like(src))
    parents = torch.where(keep, new_parent, torch.full_like(new_parent, -1)).to(torch.int32)
    depth = torch.where(keep, tree.depth.gather(1, src), torch.zeros_like(tree.depth.gather(1, src)))
    return Tree(tokens, parents, depth, (num_selected + 1).to(torch.int32))


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
        if latency.numel() < 1 or not torch.isfinite(latency).all() or (latency + t0 <= 0).any():
            raise ValueError(f"latency: expected a non-empty 1-D table of finite seconds with t0 + latency[n] > 0, "
                             f"received {latency.tolist()[:8]}... (t0={t0})")
        if rule != "reach":
            raise ValueError("latency: the throughput rule needs rule='reach'")
    if rule == "utility" and lambda_node <= 0:
        raise ValueError(f"lambda_node: expected > 0 for the utility rule, received {lambda_node}")
    _, fn = resolve("select_subtree", backend, tree.device)
    pool_index, num_selected = fn(tree.parents.contiguous(), tree.depth.contiguous(), tree.num_nodes.contiguous(),
                                  log_reach.float().contiguous(), max_nodes, latency, float(t0), rule,
                                  float(lambda_node), float(lambda_depth), float(min_utility))
    return Selection(reindex_subtree(tree, pool_index, num_selected), pool_index, num_selected)
