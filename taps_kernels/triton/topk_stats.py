"""Fused per-position top-K + softmax statistics over the draft vocabulary (op ``topk_stats``).

Two launches:

1. ``_topk_partial_kernel``, grid ``(B*D, S)``: program ``(row, s)`` streams its slice of the
   vocabulary in ``BLOCK_V`` tiles, once. Per tile it updates an online max ``m``, ``sum exp(x-m)``
   and ``sum exp(x-m)*(x-m)`` (the entropy numerator), and merges the tile into a running
   top-``KSEL`` set. ``S`` splits exist so that a batch of 15 rows still fills a GPU.
2. ``_topk_merge_kernel``, grid ``(B*D,)``: combines the ``S`` partial statistics (rescaling to a
   common max), selects the final sorted top-K from the ``S*KSEL`` candidates and writes outputs.

Ranking key. Each candidate is one int64: the high 32 bits are the fp32 logit's bit pattern
mapped to a signed integer of the same order, the low 32 bits are ``2**32-1-token_id``. A
larger key is a larger logit, or an equal logit with a smaller id, so one ``max`` reduction
gives the deterministic "ties to the smallest id" winner and the logit itself is recovered
exactly from the key. ``-0.0`` is folded into ``+0.0`` first (they compare equal in the
reference's sort).

Non-finite logits. ``-inf`` is an impossible token, identical to the reference: probability 0,
ranked after every finite logit (ties by id), log-prob ``-inf`` when it is among the top K; with no
possible runner-up the margin is 0 (as for ``V = 1``). A row of
only ``-inf`` gives NaN log-probs, margin and mass, entropy 0 and ids ``0..K-1``, as the reference
does (the op refuses such rows on CPU). NaN and ``+inf`` logits are refused by the op layer on CPU
tensors and give unspecified (memory-safe) results here.

Tile top-K. The running set is unsorted; a tile is merged by repeatedly moving the tile's best
key into the set's worst slot while it beats it. That loop runs at most ``KSEL`` times per tile
and usually ~0 times once the set is warm (a tile rarely beats the current K-th best), so it is
cheap on a GPU, and it avoids ``tl.sort``/``tl.topk`` over a whole tile, which is both heavier
on a GPU and ~100x slower under the interpreter.

Ordering note: the reference sorts ``log_softmax`` values; this kernel ranks logits. Both give
the same order because ``x -> x - logZ`` is monotone in fp32, except that two distinct logits
may round to the same log-prob (only for logits of very different magnitude than their gap);
then the reference breaks the tie by id and this kernel keeps the larger logit first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# int64 key that no real candidate can take (every real key is > -2**63 + 2**32 because the
# most negative ordered fp32 pattern, -inf, maps to -2139095041 in the high word).
_KEY_NONE = tl.constexpr(-9223372036854775807)
_KEY_TOP = tl.constexpr(9223372036854775807)
_M_INIT = tl.constexpr(-1.0e30)  # finite, so (m_old - m_new) never becomes (-inf) - (-inf)


@triton.jit
def _encode_keys(x, ids):
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 must tie
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) + (4294967295 - ids.to(tl.int64))


@triton.jit
def _decode_keys(keys):
    ordered = (keys >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    vals = bits.to(tl.float32, bitcast=True)
    ids = 4294967295 - (keys & 4294967295)
    return vals, ids


@triton.jit
def _topk_partial_kernel(logits_ptr, part_keys_ptr, part_stats_ptr,
                         V, row_stride, tiles_per_split, num_splits,
                         KSEL: tl.constexpr, KSEL_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    # logits_ptr:     [R, V] (row stride row_stride, unit column stride), fp32/fp16/bf16
    # part_keys_ptr:  [R, S, KSEL] int64   running top-KSEL keys of this split (unsorted)
    # part_stats_ptr: [R, S, 3] f32        (m, sum exp(x-m), sum exp(x-m)*(x-m)) of this split
    row = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.arange(0, KSEL_PAD)
    # Distinct sentinels so that "replace the worst slot" touches exactly one slot; slots past
    # KSEL are pinned to the top key so they are never the worst.
    run = tl.where(slot < KSEL, _KEY_NONE + 1 + slot.to(tl.int64), _KEY_TOP)
    m = tl.full([], _M_INIT, tl.float32)
    s = tl.full([], 0.0, tl.float32)
    t = tl.full([], 0.0, tl.float32)
    base = logits_ptr + row.to(tl.int64) * row_stride
    tile0 = split * tiles_per_split
    for tile in range(tile0, tile0 + tiles_per_split):
        offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        valid = offs < V
        x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
        # online softmax statistics, relative to the running max
        m_new = tl.maximum(m, tl.max(x, 0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        t = alpha * (t + s * (m - m_new)) + tl.sum(e * tl.where(e > 0, x - m_new, 0.0), 0)
        s = alpha * s + tl.sum(e, 0)
        m = m_new
        # merge the tile into the running top-KSEL set
        keys = tl.where(valid, _encode_keys(x, offs), _KEY_NONE)
        best = tl.max(keys, 0)
        worst = tl.min(run, 0)
        while best > worst:
            run = tl.where(run == worst, best, run)
            keys = tl.where(keys == best, _KEY_NONE, keys)
            best = tl.max(keys, 0)
            worst = tl.min(run, 0)
    part = row.to(tl.int64) * num_splits + split
    tl.store(part_keys_ptr + part * KSEL + slot, run, mask=slot < KSEL)
    tl.store(part_stats_ptr + part * 3 + 0, m)
    tl.store(part_stats_ptr + part * 3 + 1, s)
    tl.store(part_stats_ptr + part * 3 + 2, t)


@triton.jit
def _topk_merge_kernel(part_keys_ptr, part_stats_ptr, topk_logp_ptr, topk_ids_ptr, entropy_ptr, margin_ptr,
                       mass_ptr, num_splits, K, KSEL: tl.constexpr, KSEL_PAD: tl.constexpr,
                       S_PAD: tl.constexpr, HAS_SECOND: tl.constexpr):
    # topk_logp_ptr [R, K] f32, topk_ids_ptr [R, K] int64, entropy/margin/mass [R] f32
    row = tl.program_id(0)
    sp = tl.arange(0, S_PAD)
    slot = tl.arange(0, KSEL_PAD)
    smask = sp < num_splits
    base = row.to(tl.int64) * num_splits
    cand = tl.load(part_keys_ptr + (base + sp[:, None]) * KSEL + slot[None, :],
                   mask=smask[:, None] & (slot < KSEL)[None, :], other=_KEY_NONE)
    # sorted selection: KSEL passes of "take the largest key"
    out = tl.full([KSEL_PAD], _KEY_NONE, tl.int64)
    for j in range(0, KSEL):
        best = tl.max(tl.max(cand, 1), 0)
        out = tl.where(slot == j, best, out)
        cand = tl.where(cand == best, _KEY_NONE, cand)
    # combine the splits' statistics at the common max M
    m_s = tl.load(part_stats_ptr + (base + sp) * 3 + 0, mask=smask, other=_M_INIT)
    s_s = tl.load(part_stats_ptr + (base + sp) * 3 + 1, mask=smask, other=0.0)
    t_s = tl.load(part_stats_ptr + (base + sp) * 3 + 2, mask=smask, other=0.0)
    M = tl.max(m_s, 0)
    alpha = tl.exp(m_s - M)
    S = tl.sum(alpha * s_s, 0)
    T = tl.sum(alpha * (t_s + s_s * (m_s - M)), 0)
    log_s = tl.log(S)
    log_z = M + log_s
    vals, ids = _decode_keys(out)
    logp = vals - log_z
    keep = slot < K
    tl.store(topk_logp_ptr + row.to(tl.int64) * K + slot, logp, mask=keep)
    tl.store(topk_ids_ptr + row.to(tl.int64) * K + slot, ids, mask=keep)
    # H = -sum p log p = log S - T / S with p = exp(x - M) / S; a row of only -inf logits (S = 0) has no
    # distribution: NaN log-probs like the reference, whose nansum makes its entropy 0
    tl.store(entropy_ptr + row, tl.where(S > 0, log_s - T / S, 0.0))
    tl.store(mass_ptr + row, tl.sum(tl.where(keep, tl.exp(logp), 0.0), 0))
    if HAS_SECOND:
        top1 = tl.sum(tl.where(slot == 0, logp, 0.0), 0)
        top2 = tl.sum(tl.where(slot == 1, logp, 0.0), 0)
        margin = top1 - top2  # +inf when no runner-up is possible (every other logit -inf): 0, as for V = 1
        tl.store(margin_ptr + row, tl.where(tl.abs(margin) == float("inf"), 0.0, margin))
    else:
        tl.store(margin_ptr + row, 0.0)


#: Most candidates (splits x padded K) the merge program holds in registers. 2,048 compiles without spills
#: for sm_80/sm_89/sm_90 (``bench/results/triton_aot_resources.json``); 16,384 (256 splits of K = 64) spilled
#: 316-332 bytes per thread. Only single rows over large vocabularies reach the cap (a 15-row draft needs
#: <= 32 splits of K = 64 to fill a 132-SM GPU).
MERGE_CANDIDATES = 2048


def _default_splits(rows: int, num_tiles: int, device: torch.device) -> int:
    if device.type != "cuda":
        return min(num_tiles, 2)  # the interpreter runs programs one by one: splits only exercise the merge
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(num_tiles, (2 * sms + rows - 1) // rows))


def topk_stats_triton(draft_logits: torch.Tensor, top_k: int, block_v: int = None, num_splits: int = None):
    """Triton ``topk_stats``: same contract as :func:`taps_kernels.reference.topk_stats_reference`.

    Args:
        draft_logits: ``[B, D, V]`` float32/float16/bfloat16 (math in float32); ``-inf`` entries are impossible
            tokens (same result as the reference, see the module docstring); NaN and ``+inf`` are not supported.
        top_k: ``K = min(top_k, V)``.
        block_v: vocabulary tile (power of two, default 1024); tests shrink it to force many tiles.
        num_splits: programs per row (default: enough to fill the GPU; 2 under the interpreter).
    Returns:
        ``topk_logp [B,D,K] f32`` (descending, ties to the smallest id), ``topk_ids [B,D,K] int64``,
        ``entropy [B,D] f32``, ``margin [B,D] f32`` (0 when V == 1), ``topk_mass [B,D] f32``.
    """
    B, D, V = draft_logits.shape
    K = min(top_k, V)
    ksel = max(K, 2) if V > 1 else 1  # the margin needs the runner-up even when K == 1
    rows = B * D
    x = draft_logits.reshape(rows, V)
    if x.stride(1) != 1:
        x = x.contiguous()
    block_v = block_v or min(1024, triton.next_power_of_2(V))
    num_tiles = triton.cdiv(V, block_v)
    splits = num_splits or _default_splits(rows, num_tiles, x.device)
    ksel_pad = max(2, triton.next_power_of_2(ksel))
    # the merge holds S*KSEL candidates in registers: at most MERGE_CANDIDATES (compiled without spills)
    splits = max(1, min(splits, num_tiles, max(1, MERGE_CANDIDATES // ksel_pad)))
    tiles_per_split = triton.cdiv(num_tiles, splits)
    splits = triton.cdiv(num_tiles, tiles_per_split)
    dev = x.device
    part_keys = torch.empty(rows, splits, ksel, dtype=torch.int64, device=dev)
    part_stats = torch.empty(rows, splits, 3, dtype=torch.float32, device=dev)
    topk_logp = torch.empty(B, D, K, dtype=torch.float32, device=dev)
    topk_ids = torch.empty(B, D, K, dtype=torch.int64, device=dev)
    entropy = torch.empty(B, D, dtype=torch.float32, device=dev)
    margin = torch.empty(B, D, dtype=torch.float32, device=dev)
    mass = torch.empty(B, D, dtype=torch.float32, device=dev)
    if rows == 0:
        return topk_logp, topk_ids, entropy, margin, mass
    _topk_partial_kernel[(rows, splits)](x, part_keys, part_stats, V, x.stride(0), tiles_per_split, splits,
                                         KSEL=ksel, KSEL_PAD=ksel_pad, BLOCK_V=block_v, num_warps=4)
    _topk_merge_kernel[(rows,)](part_keys, part_stats, topk_logp, topk_ids, entropy, margin, mass, splits, K,
                                KSEL=ksel, KSEL_PAD=ksel_pad, S_PAD=max(2, triton.next_power_of_2(splits)),
                                HAS_SECOND=V > 1, num_warps=4)
    return topk_logp, topk_ids, entropy, margin, mass


def aot_configs():
    """Launch configurations for ahead-of-time compile checks (format: ``bench/aot_resources.py``). ``KSEL`` is the
    top-K itself, so every K is its own compile: listed are K = 1 (the runner-up still kept), 16 and the published
    64, with full vocabulary tiles in each logits dtype, a tiny vocabulary, and the merge at 2, 16-32 (a 15-row draft
    on 108-132 SMs) and the launcher's cap of :data:`MERGE_CANDIDATES` candidates for K = 64, 16 and 2 (a single
    row)."""
    out = []
    for dt in ("*bf16", "*fp16", "*fp32"):
        for ksel in (2, 16, 64):
            out.append((_topk_partial_kernel, {"logits_ptr": dt, "part_keys_ptr": "*i64"},
                        dict(KSEL=ksel, KSEL_PAD=ksel, BLOCK_V=1024), (), 4))
    out.append((_topk_partial_kernel, {"part_keys_ptr": "*i64"}, dict(KSEL=1, KSEL_PAD=2, BLOCK_V=16), (), 4))
    for ksel, s_pad in ((64, 2), (64, 16), (64, 32), (16, 32), (16, 128), (2, 32), (2, 1024)):
        out.append((_topk_merge_kernel, {"part_keys_ptr": "*i64", "topk_ids_ptr": "*i64"},
                    dict(KSEL=ksel, KSEL_PAD=ksel, S_PAD=s_pad, HAS_SECOND=True), (), 4))
    out.append((_topk_merge_kernel, {"part_keys_ptr": "*i64", "topk_ids_ptr": "*i64"},
                dict(KSEL=1, KSEL_PAD=2, S_PAD=2, HAS_SECOND=False), (), 4))
    return out

