"""Tree attention for the verifier: flash-attention over ``[cached prefix | tree nodes]`` (op ``tree_attention``).

One launch, grid ``(cdiv(N * G, BLOCK_M), B * Hkv)`` with ``G = Hq // Hkv``. A program owns
``BLOCK_M`` packed query rows of one KV head: row ``r`` is node ``r // G`` of query head
``hkv * G + r % G``. Packing the group's heads into the M dimension lets every K/V tile be
loaded once for the whole group and keeps ``BLOCK_M`` full even for trees of a few nodes
(a 16-node tree with 4:1 GQA is one 64-row tile).

Keys are visited in two phases with one online softmax (base-2, scale folded in):

* prefix ``[0, prefix_len)``: whole tiles take no mask at all; only the ragged last tile
  masks the keys past ``prefix_len``;
* tree keys ``prefix_len + j``: visibility is bit ``j % 32`` of word ``j // 32`` of the
  node's ``ancestor_bits`` row. Ancestors precede their node (topological order), so the
  loop stops at the largest node index of the tile and bits above the diagonal (``j > i``,
  never set by a valid tree) are ignored.

The running max starts at a large finite negative value rather than ``-inf`` so that a row
with no visible key in a tile (common in the tree phase) never evaluates ``-inf - -inf``.
Every load is masked (key range, head-dim padding, query rows past ``N * G``).
fp32 inputs use IEEE fp32 ``tl.dot`` (not TF32) so the GPU matches the fp32 reference.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _attend(acc, m_i, l_i, q, k_base, v_base, skl, svl, cols, key_ok, visible, d, dm, qk_scale,
            MASKED: tl.constexpr, IEEE: tl.constexpr):
    kt = tl.load(k_base + cols[None, :].to(tl.int64) * skl + d[:, None], mask=dm[:, None] & key_ok[None, :],
                 other=0.0)
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, kt) * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = tl.load(v_base + cols[:, None].to(tl.int64) * svl + d[None, :], mask=key_ok[:, None] & dm[None, :],
                 other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, bits_ptr, plen_ptr, out_ptr, lse_ptr,
                           sqb, sqh, sqn, skb, skh, skl, svb, svh, svl, sbb, sbn, sob, soh, son, slb, slh,
                           N, Hkv, qk_scale,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    # q [B,Hq,N,Dh], k/v [B,Hkv,L,Dh] (unit stride on Dh), bits [B,N,W] int32 (unit stride on W),
    # plen [B] int64, out [B,Hq,N,Dh] (q dtype), lse [B,Hq,N] f32 (unit stride on N).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N * GROUP
    node = rows // GROUP
    qh = hk * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    b64 = b.to(tl.int64)
    q_off = b64 * sqb + qh[:, None].to(tl.int64) * sqh + node[:, None].to(tl.int64) * sqn + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dm[None, :], other=0.0)
    k_base = k_ptr + b64 * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b64 * svb + hk.to(tl.int64) * svh
    prefix = tl.load(plen_ptr + b).to(tl.int32)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    no_mask = row_ok[:, None]  # placeholder "visible" for the unmasked phase (not read there)

    # Phase 1: whole prefix tiles, no mask on the scores.
    full_end = (prefix // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, skl, svl, cols, cols < prefix, no_mask,
                                d, dm, qk_scale, False, IEEE)
    # Phase 2: the ragged last prefix tile.
    if full_end < prefix:
        cols = full_end + tl.arange(0, BLOCK_N)
        key_ok = cols < prefix
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, skl, svl, cols, key_ok,
                                row_ok[:, None] & key_ok[None, :], d, dm, qk_scale, True, IEEE)
    # Phase 3: tree keys up to the largest node of this tile, visible by ancestor bits.
    last_node = tl.minimum(N - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP)
    bits_row = bits_ptr + b64 * sbb + node.to(tl.int64) * sbn
    for j0 in range(0, last_node + 1, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        key_ok = j < N
        word = tl.load(bits_row[:, None] + (j // 32)[None, :], mask=row_ok[:, None] & key_ok[None, :], other=0)
        visible = (((word >> (j % 32)[None, :]) & 1) != 0) & (j[None, :] <= node[:, None])
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, skl, svl, prefix + j, key_ok, visible,
                                d, dm, qk_scale, True, IEEE)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_off = b64 * sob + qh[:, None].to(tl.int64) * soh + node[:, None].to(tl.int64) * son + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    tl.store(lse_ptr + b64 * slb + qh.to(tl.int64) * slh + node, lse, mask=row_ok)


def _block_sizes(rows: int, head_dim: int, dtype: torch.dtype):
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = 64 if rows >= 64 else max(16, triton.next_power_of_2(rows))
    # fp32 tiles are twice the bytes: halve the key tile to stay inside registers/shared memory.
    block_n = 32 if (dtype == torch.float32 and block_d >= 128) else 64
    return block_m, block_n, block_d


def tree_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor,
                          prefix_lens: torch.Tensor, scale: Optional[float] = None):
    """Triton tree attention; same contract as :func:`taps_kernels.reference.tree_attention_reference`.

    Args:
        q: ``[B, Hq, N, Dh]`` fp32/fp16/bf16 (bf16 only compiled on a GPU; the interpreter
            computes bf16 wrongly). ``Dh <= 256``.
        k, v: ``[B, Hkv, L, Dh]`` same dtype; ``Hq % Hkv == 0``; row b's tree node j is key
            ``prefix_lens[b] + j``.
        ancestor_bits: ``[B, N, ceil(N/32)] int32`` (``taps_kernels.layout``); bits for ``j > i`` are ignored.
        prefix_lens: ``[B] int64`` with ``prefix_lens[b] + N <= L``.
        scale: softmax scale (default ``Dh ** -0.5``).
    Returns:
        ``out [B, Hq, N, Dh]`` in q's dtype and ``lse [B, Hq, N] float32`` (natural log).
    """
    B, Hq, N, Dh = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    bits = ancestor_bits if ancestor_bits.stride(-1) == 1 else ancestor_bits.contiguous()
    plen = prefix_lens.to(torch.int64).contiguous()
    out = torch.empty(B, Hq, N, Dh, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    if B == 0 or N == 0:
        return out, lse
    block_m, block_n, block_d = _block_sizes(N * group, Dh, q.dtype)
    grid = (triton.cdiv(N * group, block_m), B * Hkv)
    _tree_attention_kernel[grid](
        q, k, v, bits, plen, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), bits.stride(0), bits.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        N, Hkv, scale * _LOG2E,
        GROUP=group, HEAD_DIM=Dh, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32, num_warps=4 if block_d <= 64 else 8)
    return out, lse
