"""Reference tree attention: cached prefix always visible, tree keys visible by ancestor bits, GQA."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .mask import unpack_ancestor_bits


def tree_visibility(ancestor_bits: torch.Tensor, prefix_lens: torch.Tensor, kv_len: int,
                    ignore_above_diagonal: bool = False) -> torch.Tensor:
    """``[B,N,kv_len] bool``: key k visible to node i of row b.

    Keys ``k < prefix_lens[b]`` are visible; key ``prefix_lens[b] + j`` (``j < N``) is visible iff bit j of
    row i is set (and ``j <= i`` with ``ignore_above_diagonal``); every other key is invisible.
    """
    B, N, _ = ancestor_bits.shape
    anc = unpack_ancestor_bits(ancestor_bits, N)  # [B,N,N]
    if ignore_above_diagonal:
        anc = anc & torch.ones(N, N, dtype=torch.bool, device=anc.device).tril()
    keys = torch.arange(kv_len, device=ancestor_bits.device)
    rel = keys[None, :] - prefix_lens.long()[:, None]  # [B,L]
    in_tree = (rel >= 0) & (rel < N)
    tree_vis = anc.gather(2, rel.clamp(0, N - 1)[:, None, :].expand(B, N, kv_len))
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_vis)


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor,
                             prefix_lens: torch.Tensor, scale: Optional[float] = None):
    """``q [B,Hq,N,Dh]``, ``k/v [B,Hkv,L,Dh]`` -> ``(out [B,Hq,N,Dh] q.dtype, lse [B,Hq,N] f32)``; math in float32.

    The definition every backend follows (``docs/DESIGN.md``, ``tree_attention``):

    * row b sees keys ``[0, p)`` and tree keys ``p + j`` whose bit j is set, ``j <= i`` (bits above the
      diagonal are ignored), with ``p = prefix_lens[b]`` clamped to ``[0, L - N]`` (the public op rejects
      values outside; the GPU kernels clamp, so every backend gives this result);
    * ``lse`` is the natural-log sum of ``exp(scale * q.k)`` over the visible keys; NaN when the scale or a
      visible key's k is NaN; ``-inf`` when no key is visible, and then ``out`` is 0;
    * a NaN or ±inf anywhere in a row's q makes that row's ``out`` and ``lse`` NaN (visible keys or not);
    * ``out[.., c]`` is NaN when a visible key's ``v[c]`` is NaN or ±inf (or when lse is NaN); keys a row
      does not see never change its output, whatever they hold.
    """
    B, Hq, N, Dh = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    group = Hq // Hkv
    plen = prefix_lens.long().clamp(0, max(L - N, 0))
    visible = tree_visibility(ancestor_bits, plen, L, ignore_above_diagonal=True)  # [B,N,L]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhnd,bhld->bhnl", q.float(), kf) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    shift = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)  # no visible key: every weight is 0
    p = torch.exp(scores - shift[..., None])  # exactly 0 for invisible keys
    finite = torch.isfinite(vf)
    out = torch.einsum("bhnl,bhld->bhnd", p, torch.where(finite, vf, torch.zeros_like(vf)))
    if not bool(finite.all()):  # 0 * inf would leak invisible values: count the visible non-finite ones instead
        hits = torch.einsum("bnl,bhld->bhnd", visible.float(), (~finite).float())
        out = out.masked_fill(hits > 0, float("nan"))
    q_bad = ~torch.isfinite(q.float()).all(dim=-1)  # [B,Hq,N]; applied unconditionally: no host sync
    out = out.masked_fill(q_bad[..., None], float("nan"))
    lse = lse.masked_fill(q_bad, float("nan"))
    return out.to(q.dtype), lse
