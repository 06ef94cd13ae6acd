"""Reference tree attention: cached prefix always visible, tree keys visible by ancestor bits, GQA."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .mask import unpack_ancestor_bits


def tree_visibility(ancestor_bits: torch.Tensor, prefix_lens: torch.Tensor, kv_len: int) -> torch.Tensor:
    """``[B,N,kv_len] bool``: key k visible to node i of row b."""
    B, N, _ = ancestor_bits.shape
    anc = unpack_ancestor_bits(ancestor_bits, N)  # [B,N,N]
    keys = torch.arange(kv_len, device=ancestor_bits.device)
    rel = keys[None, :] - prefix_lens.long()[:, None]  # [B,L]
    in_tree = (rel >= 0) & (rel < N)
    tree_vis = anc.gather(2, rel.clamp(0, N - 1)[:, None, :].expand(B, N, kv_len))
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_vis)


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor,
                             prefix_lens: torch.Tensor, scale: Optional[float] = None):
    """``q [B,Hq,N,Dh]``, ``k/v [B,Hkv,L,Dh]`` -> ``(out [B,Hq,N,Dh] q.dtype, lse [B,Hq,N] f32)``; math in float32."""
    B, Hq, N, Dh = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    group = Hq // Hkv
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhnd,bhld->bhnl", q.float(), kf) * scale
    visible = tree_visibility(ancestor_bits, prefix_lens, L)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhnl,bhld->bhnd", torch.exp(scores - lse[..., None]), vf)
    return out.to(q.dtype), lse
