"""Our tree as llama.cpp sequence sets: one decode call verifies the whole tree.

llama.cpp's batch gives every token a set of sequence ids (``llama_batch.seq_id[i][0 .. n_seq_id[i]-1]``)
and a position; the KV cache cell written for the token holds that set. With a unified KV cache
(``kv_unified``), a query token sees a cell when the cell holds the query's FIRST sequence id
(``seq_id[i][0]``) and the cell's position is not after the query's (``set_input_kq_mask``'s rule), and a
context holds at most ``LLAMA_MAX_SEQ = 256`` sequences.

The conversion: each root-to-leaf path of a tree is one sequence; a node belongs to the sequence of every
leaf below it (or at it), and its first sequence id is the smallest of those. The cells a node then sees
are exactly its ancestors and itself: the sequence of its first leaf holds the whole path from the root to
that leaf, of which the nodes at or above the query's depth are its ancestors and itself (deeper ones sit
at later positions). The cached prefix must be held by every sequence of the tree (``llama_memory_seq_cp``
of the request's sequence to each tree sequence over the prefix), and each sequence's positions run
``prefix_len .. prefix_len + depth(leaf)`` without a gap, as llama.cpp's batch checks require.
After verification, the accepted path's leaf sequence is kept and the others are removed
(``llama_memory_seq_rm``); llama.cpp does not select trees, so the tree itself comes from our ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from .._checks import check_tensor
from .tree_bits import ancestor_matrix, parents_and_depth

#: llama.cpp's LLAMA_MAX_SEQ: sequences a context can hold
LLAMA_MAX_SEQ = 256


@dataclass
class SequenceSets:
    """Sequence sets of a batch of ``B`` trees of ``N`` rows, ``S = max(num_seqs)`` columns."""

    member: torch.Tensor     # [B, N, S] bool: node i of tree b belongs to sequence s (s < num_seqs[b])
    first_seq: torch.Tensor  # [B, N] int64: smallest sequence holding node i (llama.cpp's seq_id[i][0]); -1 padding
    leaves: torch.Tensor     # [B, S] int64: leaf node of sequence s (our node index), -1 past num_seqs[b]
    num_seqs: torch.Tensor   # [B] int64: leaves (sequences) of tree b
    positions: torch.Tensor  # [B, N] int64: prefix_lens[b] + depth (padding: prefix_lens[b])


def to_sequence_sets(ancestor_bits: torch.Tensor, num_nodes: torch.Tensor, prefix_lens: torch.Tensor,
                     max_sequences: int = LLAMA_MAX_SEQ) -> SequenceSets:
    """Convert a batch of our trees to llama.cpp sequence sets (module docstring).

    Args:
        ancestor_bits: ``[B, N, ceil(N/32)] int32`` from :func:`taps_kernels.tree_mask` (the source: leaves
            and paths are read from the bits).
        num_nodes: ``[B] int32/int64`` real nodes per tree, ``1 <= num_nodes[b] <= N``.
        prefix_lens: ``[B] int32/int64`` cached tokens before each tree, ``>= 0``.
        max_sequences: the sequences one tree may use (default 256, llama.cpp's LLAMA_MAX_SEQ; lower it by the
            sequence ids the caller keeps for other requests).
    Returns:
        :class:`SequenceSets`; sequence ids are ``0 .. num_seqs[b]-1`` per tree, leaves in increasing node
        index (the caller adds its own offset). Node order is ours. Raises ValueError naming the tree when it
        has more leaves than ``max_sequences``.
    """
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int32, torch.int64), ndim=1)
    anc = ancestor_matrix(ancestor_bits, num_nodes)
    B, N, _ = anc.shape
    if prefix_lens.shape != (B,) or prefix_lens.device != ancestor_bits.device:
        raise ValueError(f"prefix_lens: expected shape ({B},) on {ancestor_bits.device}, received "
                         f"{tuple(prefix_lens.shape)} on {prefix_lens.device}")
    if bool((prefix_lens < 0).any()):
        b = int((prefix_lens < 0).nonzero()[0])
        raise ValueError(f"prefix_lens[{b}]: expected >= 0, received {int(prefix_lens[b])}")
    if not isinstance(max_sequences, int) or isinstance(max_sequences, bool) or not 1 <= max_sequences <= LLAMA_MAX_SEQ:
        raise ValueError(f"max_sequences: expected an int in [1, {LLAMA_MAX_SEQ}], received {max_sequences!r}")
    _, depth = parents_and_depth(anc, num_nodes)
    dev = anc.device
    idx = torch.arange(N, device=dev)
    real = idx[None, :] < num_nodes.long()[:, None]
    strict_desc = anc.transpose(1, 2) & (idx[None, :, None] != idx[None, None, :])  # [b, j, i]: i below j
    is_leaf = real & ~strict_desc.any(-1)
    num_seqs = is_leaf.sum(-1)
    if bool((num_seqs > max_sequences).any()):
        b = int((num_seqs > max_sequences).nonzero()[0])
        raise ValueError(f"ancestor_bits[{b}]: expected a tree with at most max_sequences = {max_sequences} leaves "
                         f"(one llama.cpp sequence per root-to-leaf path), received {int(num_seqs[b])}")
    S = int(num_seqs.max())
    # leaf node of each sequence: the s-th leaf in node order
    order = torch.where(is_leaf, idx, torch.full_like(idx, N)).sort(-1).values[:, :S]
    leaves = torch.where(order < N, order, torch.full_like(order, -1))
    # member[b, i, s]: node i is an ancestor-or-self of leaf s
    rows = anc.gather(1, leaves.clamp(min=0)[:, :, None].expand(B, S, N))  # [B, S, N]
    member = (rows & (leaves >= 0)[:, :, None]).transpose(1, 2).contiguous()
    has = member.any(-1)
    first = torch.where(has, member.float().argmax(-1), torch.full_like(idx, -1).expand(B, N))
    positions = prefix_lens.long()[:, None] + torch.where(real, depth, torch.zeros_like(depth))
    return SequenceSets(member, first.to(torch.int64), leaves.to(torch.int64), num_seqs.to(torch.int64), positions)


def batch_entries(tokens: torch.Tensor, sets: SequenceSets, row: int, seq_offset: int = 0
                  ) -> List[Tuple[int, int, List[int]]]:
    """The ``llama_batch`` entries of tree ``row``: ``(token, position, seq_ids)`` per real node in our node
    order, ``seq_ids`` increasing so that ``seq_ids[0]`` is the node's first sequence, each id plus
    ``seq_offset``. ``tokens``: ``[B, N] int64``."""
    check_tensor("tokens", tokens, dtypes=(torch.int64,), shape=tuple(sets.first_seq.shape))
    B = tokens.shape[0]
    if not 0 <= row < B:
        raise ValueError(f"row: expected an index in [0, {B}), received {row}")
    out = []
    member = sets.member[row].cpu()
    for i in range(tokens.shape[1]):
        seqs = member[i].nonzero().flatten().tolist()
        if not seqs:
            continue  # padding
        out.append((int(tokens[row, i]), int(sets.positions[row, i]), [s + int(seq_offset) for s in seqs]))
    return out
