"""Our tree in SGLang's EAGLE verify topology (``build_tree_kernel_efficient``'s outputs).

SGLang's tree verify (``verify_tree_greedy`` in sgl-kernel, the EAGLE worker and the DDTree work built on
it) reads, per request of ``N = draft_token_num`` nodes (node 0 the root, the verified token):

* ``retrive_index [B, N] int64``: row of node ``i`` of request ``b`` in the batch's flattened verify output,
  ``b * N + i``;
* ``retrive_next_token [B, N] int64``: the first child of each node (-1 for a leaf);
* ``retrive_next_sibling [B, N] int64``: the next sibling (-1 for the last); the greedy walk tries a node's
  children in first-child / next-sibling order and takes the first one whose token is the target's;
* ``positions [B * N] int64``: ``seq_len[b] + depth``;
* the tree mask, in one of three modes. ``QLEN_ONLY``: a flat bool ``[B * N * N]``, request ``b``'s
  ``N x N`` block row-major (element ``b*N*N + i*N + j`` true iff ``j`` is an ancestor of ``i`` or ``i``);
  ``QLEN_ONLY_BITPACKING``: the same rows packed, ``nbytes = 1, 2, 4`` for ``N <= 8, 16, 32`` bytes per row,
  bit ``j`` of a row in byte ``j // 8`` at bit ``j % 8`` (little-endian: the low bytes of our int32 word 0).
  ``FULL_MASK`` adds the prefix columns per request; it is not produced here.

SGLang builds its linked lists by visiting nodes from the last to the first and pushing each in front of its
parent's list, so a node's first child is its child of smallest index and siblings follow in increasing
index: our order, in which ``accept_greedy`` also prefers the smaller index among equal tokens. Every
request has the same ``N``; our padding rows (``i >= num_nodes[b]``) become unreachable nodes (no parent
links them, their mask row holds only their own bit, ``retrive_next_*`` are -1, position ``seq_len[b]``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_tensor
from .tree_bits import ancestor_matrix, parents_and_depth

#: SGLang's ``QLEN_ONLY_BITPACKING`` bytes per mask row, by the largest ``N`` each holds
_PACKED_BYTES = ((8, 1), (16, 2), (32, 4))


@dataclass
class EagleTopology:
    """SGLang's verify inputs for a batch of ``B`` trees of ``N`` nodes (shapes in the module docstring)."""

    candidates: torch.Tensor            # [B, N] int64: node tokens (the verify input ids)
    retrive_index: torch.Tensor         # [B, N] int64
    retrive_next_token: torch.Tensor    # [B, N] int64
    retrive_next_sibling: torch.Tensor  # [B, N] int64
    positions: torch.Tensor             # [B * N] int64
    tree_mask: torch.Tensor             # [B * N * N] bool (QLEN_ONLY)


def to_eagle_topology(tokens: torch.Tensor, ancestor_bits: torch.Tensor, num_nodes: torch.Tensor,
                      seq_lens: torch.Tensor) -> EagleTopology:
    """Convert a batch of our trees to SGLang's EAGLE topology with the ``QLEN_ONLY`` mask.

    Args:
        tokens: ``[B, N] int64`` node tokens, our node order (node 0 the root).
        ancestor_bits: ``[B, N, ceil(N/32)] int32`` from :func:`taps_kernels.tree_mask` (the source of the
            structure: parents, depths and children are read from the bits).
        num_nodes: ``[B] int32/int64`` real nodes per tree (root included), ``1 <= num_nodes[b] <= N``.
        seq_lens: ``[B] int64/int32`` verified tokens before each tree (SGLang's ``verified_seq_len``), ``>= 0``.
    Returns:
        :class:`EagleTopology`; node ``i`` keeps its index (no reordering is needed: SGLang only asks that a
        parent precede its children). CPU or CUDA tensors; the bits' device.
    """
    B, N = _check(tokens, ancestor_bits, num_nodes, seq_lens)
    dev = ancestor_bits.device
    anc = ancestor_matrix(ancestor_bits, num_nodes)
    parents, depth = parents_and_depth(anc, num_nodes)
    idx = torch.arange(N, device=dev)
    is_child = parents >= 0                                           # real non-root nodes
    # first child: the smallest index among a node's children
    slot = torch.where(is_child, parents, torch.full_like(parents, N))  # padding / root -> dump column N
    first = torch.full((B, N + 1), N, dtype=torch.int64, device=dev)
    first.scatter_reduce_(1, slot, idx.expand(B, N).contiguous(), reduce="amin")
    next_token = first[:, :N]
    next_token = torch.where(next_token == N, torch.full_like(next_token, -1), next_token)
    # next sibling: the smallest larger index with the same parent
    same = is_child[:, None, :] & (parents[:, None, :] == parents[:, :, None]) & (idx[None, None, :] > idx[None, :, None])
    later = torch.where(same, idx, torch.full_like(idx, N)).amin(-1)
    next_sibling = torch.where(is_child & (later < N), later, torch.full_like(later, -1))
    retrive_index = (torch.arange(B, device=dev)[:, None] * N + idx[None, :]).to(torch.int64)
    positions = (seq_lens.long()[:, None] + depth).reshape(-1)
    mask = anc | torch.eye(N, dtype=torch.bool, device=dev)[None]     # padding rows: their own bit only
    return EagleTopology(tokens.to(torch.int64), retrive_index, next_token.to(torch.int64),
                         next_sibling.to(torch.int64), positions, mask.reshape(-1))


def pack_qlen_only(tree_mask: torch.Tensor, batch_size: int, num_draft_tokens: int) -> torch.Tensor:
    """SGLang's ``QLEN_ONLY_BITPACKING`` rows from a ``QLEN_ONLY`` mask.

    ``tree_mask``: ``[B * N * N] bool`` (:attr:`EagleTopology.tree_mask`). Returns ``[B * N, nbytes] uint8``,
    ``nbytes`` 1, 2 or 4 for ``N <= 8, 16, 32``; column ``j`` of a row is bit ``j % 8`` of byte ``j // 8``.
    ``N > 32`` raises ValueError (SGLang packs at most 32 columns per row)."""
    B, N = int(batch_size), int(num_draft_tokens)
    check_tensor("tree_mask", tree_mask, dtypes=(torch.bool,), shape=(B * N * N,))
    nbytes = next((nb for top, nb in _PACKED_BYTES if N <= top), None)
    if nbytes is None:
        raise ValueError(f"num_draft_tokens: expected at most 32 for QLEN_ONLY_BITPACKING, received {N}")
    rows = tree_mask.view(B * N, N)
    padded = torch.zeros(B * N, nbytes * 8, dtype=torch.bool, device=rows.device)
    padded[:, :N] = rows
    weights = (1 << torch.arange(8, device=rows.device)).to(torch.int64)
    return (padded.view(B * N, nbytes, 8).long() * weights).sum(-1).to(torch.uint8)


def _check(tokens, ancestor_bits, num_nodes, seq_lens):
    check_tensor("tokens", tokens, dtypes=(torch.int64,), ndim=2)
    B, N = tokens.shape
    check_tensor("ancestor_bits", ancestor_bits, dtypes=(torch.int32,), shape=(B, N, (N + 31) // 32),
                 device=tokens.device)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32, torch.int64), shape=(B,), device=tokens.device)
    if bool((seq_lens < 0).any()):
        b = int((seq_lens < 0).nonzero()[0])
        raise ValueError(f"seq_lens[{b}]: expected >= 0, received {int(seq_lens[b])}")
    return B, N
