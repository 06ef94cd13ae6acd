"""Reference tree mask: position ids and packed ancestor bits (layout in ``taps_kernels.layout``)."""
from __future__ import annotations

import torch


def _ancestor_matrix(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """``[B,N,N] bool``: ``anc[b,i,j]`` when j is an ancestor of i or i itself; padding rows see only themselves."""
    B, N = parents.shape
    anc = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)
    par = parents.detach().cpu().long()
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            anc[b, i] |= anc[b, int(par[b, i])]
    return anc


def pack_bits(anc: torch.Tensor) -> torch.Tensor:
    """``[B,N,M] bool`` -> ``[B,N,ceil(M/32)] int32`` (bit j%32 of word j//32)."""
    B, N, M = anc.shape
    W = (M + 31) // 32
    padded = torch.zeros(B, N, W * 32, dtype=torch.int64)
    padded[..., :M] = anc.long()
    weights = torch.tensor([1 << s for s in range(32)], dtype=torch.int64)
    words = (padded.view(B, N, W, 32) * weights).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # two's complement wrap into int32
    return words.to(torch.int32)


def unpack_ancestor_bits(ancestor_bits: torch.Tensor, num_cols: int) -> torch.Tensor:
    """``[B,N,W] int32`` -> ``[B,N,num_cols] bool``."""
    shifts = torch.arange(32, device=ancestor_bits.device, dtype=torch.int64)
    bits = (ancestor_bits.long()[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :num_cols].bool()


def ancestor_bits_reference(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    return pack_bits(_ancestor_matrix(parents, num_nodes.cpu())).to(parents.device)


def tree_mask_reference(parents: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor,
                        prefix_lens: torch.Tensor):
    """Return ``(position_ids [B,N] int64 = prefix_lens + depth, ancestor_bits [B,N,W] int32)``."""
    position_ids = prefix_lens.long()[:, None] + depth.long()
    return position_ids, ancestor_bits_reference(parents, num_nodes)
