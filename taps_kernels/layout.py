"""Batched, ragged draft trees: the one layout every op in taps_kernels shares.

A batch of ``B`` trees is padded to ``N`` rows:

* ``tokens    [B, N] int64``  token id of each node (padding: 0)
* ``parents   [B, N] int32``  parent node index, ``-1`` for the root and for padding
* ``depth     [B, N] int32``  root 0, child = parent + 1 (padding: 0)
* ``num_nodes [B]    int32``  real rows of each tree, root included

Node 0 is the root: the *bonus* token, chosen by the target but not yet run by
it. Nodes are in topological order: for each real node ``i > 0``,
``0 <= parents[i] < i``. Budgets (``pool_size``, ``max_nodes``) count non-root
nodes, so a tree of budget ``n`` has ``n + 1`` rows.

Ancestor bitmask ``ancestor_bits [B, N, W] int32`` with ``W = ceil(N / 32)``:
bit ``j % 32`` of word ``j // 32`` in row ``i`` is set when node ``j`` is an
ancestor of node ``i`` or ``i`` itself. Padding rows carry only their own bit.
Example, the tree ``0 -> 1 -> 3`` and ``0 -> 2`` (N=4, W=1)::

    row 0: 0b0001   (root sees itself)
    row 1: 0b0011   (0, 1)
    row 2: 0b0101   (0, 2)
    row 3: 0b1011   (0, 1, 3)

Bit 31 is the sign bit of the int32 word; it is a bit like any other.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from ._checks import check_tensor, values_checked


@dataclass
class Tree:
    """A batch of draft trees in the layout of this module's docstring."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    num_nodes: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_nodes(self) -> int:
        """Padded row count ``N`` (root included)."""
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, device) -> "Tree":
        return Tree(*(getattr(self, f.name).to(device) for f in fields(self)))

    def validate(self, name: str = "tree", vocab_size: Optional[int] = None, deep: Optional[bool] = None,
                 validate: Optional[str] = None) -> None:
        """Check shapes, dtypes and devices, and (when deep) the structure; raise ValueError/TypeError naming the field.

        The structural check reads the tensor values. ``deep=None`` follows the validation mode
        (``validate=`` or ``TAPS_VALIDATE``, :mod:`taps_kernels._checks`): by default it runs on CPU trees and is
        skipped on CUDA trees, where it would synchronise the device. ``deep=True`` forces it, ``deep=False``
        skips it.
        """
        validate_tree(self, name=name, vocab_size=vocab_size, deep=deep, validate=validate)


def validate_tree(tree: Tree, name: str = "tree", vocab_size: Optional[int] = None, deep: Optional[bool] = None,
                  validate: Optional[str] = None) -> None:
    """See :meth:`Tree.validate`."""
    if not isinstance(tree, Tree):
        raise TypeError(f"{name}: expected a taps_kernels.Tree, received {type(tree).__name__}")
    tokens = check_tensor(f"{name}.tokens", tree.tokens, dtypes=(torch.int64,), ndim=2)
    B, N = tokens.shape
    if N < 1:
        raise ValueError(f"{name}.tokens: expected at least one node (the root), received shape {tuple(tokens.shape)}")
    check_tensor(f"{name}.parents", tree.parents, dtypes=(torch.int32,), shape=(B, N), device=tokens.device)
    check_tensor(f"{name}.depth", tree.depth, dtypes=(torch.int32,), shape=(B, N), device=tokens.device)
    check_tensor(f"{name}.num_nodes", tree.num_nodes, dtypes=(torch.int32,), shape=(B,), device=tokens.device)
    if N > MAX_NODES:
        raise ValueError(f"{name}.tokens: expected at most 2**31 - 1 rows (int32 node indices), received {N}")
    if deep is None:
        deep = values_checked(validate, tokens.device)
    if not deep or B == 0:
        return
    if tokens.device.type == "cpu":
        # Fast path: one C++ pass over the batch. It only answers "valid or not"; on a fault the
        # PyTorch checks below run and raise, so the messages have one source.
        from . import backend as _backend
        ext, _ = _backend.load_extension("_C")
        if ext is not None:
            vocab = -1 if vocab_size is None else int(vocab_size)
            if int(ext.validate_tree(tokens, tree.parents, tree.depth, tree.num_nodes, vocab)[0]) == 0:
                return
    parents = tree.parents.detach().cpu().long()
    depth = tree.depth.detach().cpu().long()
    num_nodes = tree.num_nodes.detach().cpu().long()
    toks = tokens.detach().cpu()
    bad = (num_nodes < 1) | (num_nodes > N)
    if bad.any():
        b = int(bad.nonzero()[0])
        raise ValueError(f"{name}.num_nodes[{b}]: expected a value in [1, {N}], received {int(num_nodes[b])}")
    idx = torch.arange(N)
    real = idx[None, :] < num_nodes[:, None]
    nonroot = real & (idx[None, :] > 0)
    # Parent of every real non-root node must precede it.
    bad = nonroot & ((parents < 0) | (parents >= idx[None, :]))
    if bad.any():
        b, i = (int(x) for x in bad.nonzero()[0])
        p = int(parents[b, i])
        why = "out of range" if p < 0 or p >= N else "not smaller than the child's index"
        raise ValueError(f"{name}.parents[{b},{i}]: parent index {p} is {why}; expected 0 <= parent < {i}")
    if (real[:, 0] & (parents[:, 0] != -1)).any():
        b = int((parents[:, 0] != -1).nonzero()[0])
        raise ValueError(f"{name}.parents[{b},0]: the root's parent must be -1, received {int(parents[b, 0])}")
    pad = ~real
    if (pad & (parents != -1)).any():
        b, i = (int(x) for x in (pad & (parents != -1)).nonzero()[0])
        raise ValueError(f"{name}.parents[{b},{i}]: padding node (num_nodes={int(num_nodes[b])}) must have parent -1, "
                         f"received {int(parents[b, i])}")
    safe_parent = parents.clamp(min=0)
    expected_depth = torch.where(nonroot, depth.gather(1, safe_parent) + 1, torch.zeros_like(depth))
    bad = real & (depth != expected_depth)
    if bad.any():
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"{name}.depth[{b},{i}]: depth inconsistent with parents, expected {int(expected_depth[b, i])}, "
                         f"received {int(depth[b, i])}")
    if vocab_size is not None:
        bad = real & ((toks < 0) | (toks >= vocab_size))
        if bad.any():
            b, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{name}.tokens[{b},{i}]: token {int(toks[b, i])} is outside the vocabulary [0, {vocab_size})")


MAX_NODES = 2 ** 31 - 1
"""Most rows a tree may have: node indices (``parents``) are int32."""


def num_bit_words(num_nodes: int) -> int:
    """Words per row of ``ancestor_bits`` for ``num_nodes`` padded rows."""
    return (num_nodes + 31) // 32


@dataclass
class CandidatePool:
    """Output of :func:`taps_kernels.candidate_pool`. Per-node fields are ``[B, N]``, per-position ``[B, D(, K)]``.

    ``logq`` cumulative draft log-prob of the path (0 at the root, -inf on padding),
    ``step_logq`` the node's own marginal log-prob (0 at root, -inf on padding),
    ``rank`` the node's 0-based token rank at its position (-1 at root and padding).
    Node ``i > 0`` sits at draft position ``depth[i] - 1``.
    """

    tree: Tree
    logq: torch.Tensor
    step_logq: torch.Tensor
    rank: torch.Tensor
    topk_logp: torch.Tensor
    topk_ids: torch.Tensor
    entropy: torch.Tensor
    margin: torch.Tensor
    topk_mass: torch.Tensor


@dataclass
class TopKStats:
    """Per-position draft statistics: ``topk_logp/topk_ids [B,D,K]``, ``entropy/margin/topk_mass [B,D]`` (float32)."""

    topk_logp: torch.Tensor
    topk_ids: torch.Tensor
    entropy: torch.Tensor
    margin: torch.Tensor
    topk_mass: torch.Tensor


@dataclass
class Selection:
    """Output of :func:`taps_kernels.select_subtree`.

    ``tree`` the kept subtree re-indexed (pool order preserved, root first, ``max_nodes + 1`` rows),
    ``pool_index [B, max_nodes+1] int64`` the pool node of each row (-1 padding),
    ``num_selected [B] int32`` kept non-root nodes,
    ``expected [B] float32`` ``1 +`` the kept nodes' reach summed (the rule :class:`ThroughputRule` only, else
    None): the tokens the round is expected to commit.
    """

    tree: Tree
    pool_index: torch.Tensor
    num_selected: torch.Tensor
    expected: Optional[torch.Tensor] = None
