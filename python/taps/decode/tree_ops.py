"""Device-side tree edits the decode loop and the policies share: keep a prefix-closed subset of each
row's nodes (by depth cap, by rank), pad, root-only and chain trees. Torch ops only, static shapes,
no host reads, so they run inside a round on any device (and under CUDA-graph capture).

Node order: a kept subset stays in ascending original index (a valid topological order), root first, and
is re-indexed with the same gather as :func:`taps_kernels.select_subtree`'s re-index
(:func:`taps_kernels.reference.select.reindex_subtree_reference`); padding rows as in
``taps_kernels.layout`` (tokens 0, parents -1, depth 0).
"""
from __future__ import annotations

from typing import Optional

import torch

from taps_kernels import Tree
from taps_kernels.ops.select import reindex_subtree_op


#: ``validate=`` of the public ops called inside a round (policies, verifiers, the loop): their inputs are the
#: loop's own draft, trees and paths, so the value checks would find nothing (measured on CPU: ~0.1-0.3 ms per
#: tree op and ~2.6 ms per 30-layer compaction under load), and on a GPU they would synchronise the device
IN_ROUND = "none"

def root_only_tree(bonus: torch.Tensor) -> Tree:
    """Tree of the root alone per row: ``tokens [B,1] = bonus [B]``."""
    dev = bonus.device
    B = bonus.numel()
    return Tree(bonus.view(B, 1).to(torch.int64), torch.full((B, 1), -1, dtype=torch.int32, device=dev),
                torch.zeros(B, 1, dtype=torch.int32, device=dev), torch.ones(B, dtype=torch.int32, device=dev))


def chain_tree(bonus: torch.Tensor, chain: torch.Tensor) -> Tree:
    """Tree ``bonus -> chain[:, 0] -> chain[:, 1] -> ...`` per row; ``bonus [B]``, ``chain [B, D] int64``
    (a 1-D ``chain`` is one row); node i sits at depth i."""
    dev = bonus.device
    chain = chain.view(1, -1) if chain.dim() == 1 else chain
    B, D = chain.shape
    n = D + 1
    tokens = torch.cat([bonus.view(B, 1).to(torch.int64), chain.to(torch.int64)], 1)
    idx = torch.arange(n, dtype=torch.int32, device=dev)
    return Tree(tokens, (idx - 1).expand(B, n).contiguous(), idx.expand(B, n).contiguous(),
                torch.full((B,), n, dtype=torch.int32, device=dev))


def keep_nodes(tree: Tree, keep: torch.Tensor) -> Tree:
    """The subtree of the nodes where ``keep [B, N] bool`` is set (root always kept; the caller keeps the
    set prefix-closed), re-indexed in ascending node order; same ``N`` columns, padding after the kept ones."""
    B, N = tree.tokens.shape
    idx = torch.arange(N, device=tree.device)
    real = idx[None, :] < tree.num_nodes[:, None]
    keep = (keep & real) | (idx[None, :] == 0)
    # kept nodes first (ascending index), then the rest: a stable order from one sort key
    key = torch.where(keep, idx[None, :], idx[None, :] + N)
    order = key.sort(dim=1).values
    pool_index = torch.where(order < N, order, torch.full_like(order, -1))
    num_selected = (keep.sum(1) - 1).to(torch.int32)
    return Tree(*reindex_subtree_op(tree.tokens, tree.parents, tree.depth, tree.num_nodes, pool_index, num_selected))


def depth_mask(tree: Tree, depth_cap: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B, N] bool``: nodes at depth ``<= depth_cap[b]`` (all when ``depth_cap`` is None)."""
    if depth_cap is None:
        return torch.ones_like(tree.tokens, dtype=torch.bool)
    return tree.depth.to(torch.int64) <= depth_cap.to(torch.int64)[:, None]


def truncate_depth(tree: Tree, max_depth) -> Tree:
    """Drop every node deeper than ``max_depth`` (an int, or ``[B]`` int64 per row on the tree's device);
    the rest stays prefix-closed and keeps its order. Device-side, same shape as the input."""
    if not isinstance(max_depth, torch.Tensor):
        max_depth = torch.full((tree.batch_size,), int(max_depth), dtype=torch.int64, device=tree.device)
    return keep_nodes(tree, depth_mask(tree, max_depth))


def effective_reach(tree: Tree, log_reach: torch.Tensor, levels: Optional[int] = None) -> torch.Tensor:
    """``e(v) = min(log_reach(v), e(parent(v)))`` ``[B, N] float32`` (root 0, padding -inf): the prefix-closed
    ranking key of ``select_subtree``'s reach rule. One gather per tree level: ``levels`` must bound the
    tree's depth (a host int: the draft's positions; default ``N - 1``)."""
    B, N = tree.tokens.shape
    idx = torch.arange(N, device=tree.device)
    real = idx[None, :] < tree.num_nodes[:, None]
    e = torch.where(real, log_reach.float(), torch.full_like(log_reach, float("-inf"), dtype=torch.float32))
    parent = tree.parents.long().clamp(min=0)
    for _ in range(N - 1 if levels is None else min(levels, N - 1)):
        e = torch.where(idx[None, :] > 0, torch.minimum(e, e.gather(1, parent)), e)
    return e


def rank_by_reach(tree: Tree, log_reach: torch.Tensor, levels: Optional[int] = None) -> torch.Tensor:
    """``[B, N] int64``: each non-root node's rank among the row's real non-root nodes by
    ``(-effective reach, index)`` (0 = best); root and padding get ``N`` (never within a budget).
    ``levels=0``: ``log_reach`` is already non-increasing along every path (pool log-masses and scorer reach
    are: each edge adds a log-probability <= 0), so the effective reach is the reach itself."""
    B, N = tree.tokens.shape
    e = effective_reach(tree, log_reach, levels) if levels != 0 else log_reach.float()
    idx = torch.arange(N, device=tree.device)
    real = (idx[None, :] < tree.num_nodes[:, None]) & (idx[None, :] > 0)
    key = torch.where(real, -e, torch.full_like(e, float("inf")))
    order = torch.sort(key, dim=1, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, idx.expand(B, N).contiguous())
    return torch.where(real, rank, torch.full_like(rank, N))


def keep_top(tree: Tree, log_reach: torch.Tensor, sizes: torch.Tensor, depth_cap: Optional[torch.Tensor] = None,
             levels: Optional[int] = None) -> Tree:
    """Per row, the ``sizes[b]`` best non-root nodes by effective reach (prefix-closed), then the depth cap."""
    keep = rank_by_reach(tree, log_reach, levels) < sizes.to(torch.int64)[:, None]
    return keep_nodes(tree, keep & depth_mask(tree, depth_cap))


def pad_tree(tree: Tree, n: int) -> Tree:
    """``tree`` with ``n >= N`` columns (padding nodes appended)."""
    B, N = tree.tokens.shape
    if n == N:
        return tree
    extra = n - N
    z = lambda t, v: torch.cat([t, t.new_full((B, extra), v)], 1)  # noqa: E731
    return Tree(z(tree.tokens, 0), z(tree.parents, -1), z(tree.depth, 0), tree.num_nodes)


def slice_tree(tree: Tree, n: int) -> Tree:
    """The first ``n`` columns (the caller knows every row has at most ``n`` real nodes)."""
    if tree.tokens.shape[1] == n:
        return tree
    return Tree(tree.tokens[:, :n], tree.parents[:, :n], tree.depth[:, :n], tree.num_nodes)
