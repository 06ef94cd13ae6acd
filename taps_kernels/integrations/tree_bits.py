"""Reading a tree back from its ancestor bits: the common first step of the engine layout conversions.

Our tree layout (``taps_kernels.layout``): node 0 the root, nodes in topological order, ``ancestor_bits
[B, N, W] int32`` (``W = ceil(N / 32)``) with bit ``j % 32`` of word ``j // 32`` of row ``i`` set when node
``j`` is an ancestor of ``i`` or ``i`` itself, ``num_nodes [B] int32`` real rows per tree. Everything an
engine needs (parents, depths, children, root-to-leaf paths) follows from the bits alone: the strict
ancestors of a node form the chain from the root to its parent, so its parent is the strict ancestor with
the largest index and its depth is the number of strict ancestors.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .._checks import check_tensor
from ..reference.mask import unpack_ancestor_bits


def check_bits(ancestor_bits: torch.Tensor, num_nodes: torch.Tensor) -> Tuple[int, int]:
    """Check ``ancestor_bits [B, N, ceil(N/32)] int32`` (``B, N >= 1``) and ``num_nodes [B] int32/int64`` with
    values in ``[1, N]``; return ``(B, N)``. Errors name the argument, the expected and the received value."""
    check_tensor("ancestor_bits", ancestor_bits, dtypes=(torch.int32,), ndim=3)
    B, N, W = ancestor_bits.shape
    if B < 1 or N < 1:
        raise ValueError(f"ancestor_bits: expected at least one tree and one node, received shape {tuple(ancestor_bits.shape)}")
    if W != (N + 31) // 32:
        raise ValueError(f"ancestor_bits: expected {(N + 31) // 32} words per row for {N} nodes, received {W}")
    check_tensor("num_nodes", num_nodes, dtypes=(torch.int32, torch.int64), shape=(B,), device=ancestor_bits.device)
    bad = (num_nodes < 1) | (num_nodes > N)
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise ValueError(f"num_nodes[{b}]: expected a value in [1, {N}], received {int(num_nodes[b])}")
    return B, N


def ancestor_matrix(ancestor_bits: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """``anc [B, N, N] bool``: ``anc[b, i, j]`` = node ``j`` is an ancestor of ``i`` or ``i`` itself, for real
    nodes ``i, j < num_nodes[b]`` (False wherever either is padding). Bits above the diagonal are refused:
    in topological order an ancestor has a smaller index."""
    B, N = check_bits(ancestor_bits, num_nodes)
    anc = unpack_ancestor_bits(ancestor_bits, N)
    idx = torch.arange(N, device=ancestor_bits.device)
    real = idx[None, :] < num_nodes.long()[:, None]
    anc = anc & real[:, :, None] & real[:, None, :]
    diag = anc.diagonal(dim1=1, dim2=2)
    if not bool((diag | ~real).all()):
        b, i = (int(x) for x in (~diag & real).nonzero()[0])
        raise ValueError(f"ancestor_bits[{b}, {i}]: expected the node's own bit (bit {i % 32} of word {i // 32}) set, "
                         f"it is clear")
    above = anc & (idx[None, None, :] > idx[None, :, None])
    if bool(above.any()):
        b, i, j = (int(x) for x in above.nonzero()[0])
        raise ValueError(f"ancestor_bits[{b}, {i}]: expected no bit above the diagonal (nodes in topological order), "
                         f"received bit {j}")
    if not bool((anc[:, :, 0] | ~real).all()):
        b, i = (int(x) for x in (~anc[:, :, 0] & real).nonzero()[0])
        raise ValueError(f"ancestor_bits[{b}, {i}]: expected the root (bit 0) among the ancestors, it is missing")
    return anc


def parents_and_depth(anc: torch.Tensor, num_nodes: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """From :func:`ancestor_matrix`: ``parents [B, N] int64`` (-1 for the root and padding) and ``depth [B, N]
    int64`` (0 for the root and padding), in our node order. Raises ValueError when the bits are not a tree
    (a node's ancestors must be its parent's ancestors plus itself)."""
    B, N, _ = anc.shape
    idx = torch.arange(N, device=anc.device)
    strict = anc & (idx[None, None, :] < idx[None, :, None])
    parents = torch.where(strict.any(-1), torch.where(strict, idx, -1).amax(-1), -1)
    depth = strict.sum(-1)
    real = idx[None, :] < num_nodes.long()[:, None]
    # a tree: anc[i] == anc[parent(i)] | {i} for every real non-root node
    par = parents.clamp(min=0)
    expect = anc.gather(1, par[:, :, None].expand(B, N, N)) | torch.eye(N, dtype=torch.bool, device=anc.device)
    bad = real & (idx[None, :] > 0) & ((expect != anc).any(-1) | (parents < 0))
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"ancestor_bits[{b}, {i}]: expected the ancestors of node {i} to be its parent's ancestors "
                         f"plus itself (a tree), received another set")
    return parents, depth
