"""Tree attention for the verifier: flash-attention over ``[cached prefix | tree nodes]`` (op ``tree_attention``).

Grid ``(cdiv(N * G, BLOCK_M), B * Hkv, S)`` with ``G = Hq // Hkv`` and ``S`` prefix splits. A program
owns ``BLOCK_M`` packed query rows of one KV head: row ``r`` is node ``r // G`` of query head
``hkv * G + r % G``. Packing the group's heads into the M dimension lets every K/V tile be loaded once
for the whole group and keeps ``BLOCK_M`` full even for trees of a few nodes.

Keys are visited with one online softmax (base 2, scale folded in):

* prefix keys ``[0, prefix_len)``: whole tiles take no mask at all; only the ragged last tile masks
  the keys past ``prefix_len``;
* tree keys ``prefix_len + j``: visible by bit ``j % 32`` of word ``j // 32`` of the node's
  ``ancestor_bits`` row. Ancestors precede their node (topological order), so the loop stops at the
  largest node of the tile, and bits above the diagonal (``j > i``) are ignored.

Decode shapes (batch 1, a few KV heads, long prefix) give only ``B * Hkv * cdiv(N*G, BLOCK_M)``
programs, far fewer than a GPU has SMs. The prefix is then split (flash-decoding): split ``s`` covers
prefix keys ``[s * chunk, (s + 1) * chunk)``, the last split also takes the tree keys, each writes its
normalised partial output and log-sum-exp in float32, and ``_merge_splits_kernel`` combines them.
:func:`choose_num_splits` says how many.

Safety on any VALUES (nothing here reads tensor data on the host): ``prefix_lens[b]`` is clamped to
``[0, L - N]`` inside the kernel and every load is masked, so no value can address memory outside
q/k/v/bits. Shapes and dtypes are checked by the launcher.

Non-finite values (the reference does the same): a row's output and lse are NaN when its q holds a NaN or
±inf (whether or not it sees any key), or when the scale or the k of a key it sees is NaN; a NaN or ±inf in the v of a key it sees makes that output column NaN.
Keys a row does not see never affect it, tree keys included: tree tiles keep non-finite v values out
of ``tl.dot`` (where ``p = 0`` would still give ``0 * NaN``), and a separate pass, run only when a tree
tile held one, marks the columns of the rows that see it. A row with no visible key (possible only
with malformed bits and prefix_len 0) gives output 0 and lse ``-inf``.

fp32 inputs use IEEE fp32 ``tl.dot`` (not TF32) so a GPU matches the fp32 reference.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)
MAX_HEAD_DIM = 256
MIN_BLOCK_D = 64  # smaller head dims are padded to 64: one tile shape family instead of three

# Shared memory per block (bytes) that a kernel may ask for at launch, by compute capability
# (cudaDevAttrMaxSharedMemoryPerBlockOptin). On CUDA the device's own value is read when torch exposes it.
SHARED_MEMORY_LIMITS = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}
DEFAULT_SHARED_MEMORY = 101376  # unknown architecture: the smallest limit of the table
DEFAULT_SM_COUNT = 132  # H100/H200 SXM; only used when a caller asks for the split heuristic without a device
MIN_KEYS_PER_SPLIT = 256  # below this a split's partial write and merge cost more than its keys
MAX_SPLITS = 64
MERGE_BLOCK_R = 16
MERGE_WARPS = 4


@triton.jit
def _attend(acc, m_i, l_i, q, k_base, v_base, skn, skd, svn, svd, keys, key_ok, visible, d, dm, qk_scale,
            MASKED: tl.constexpr, TREE: tl.constexpr, PRECISION: tl.constexpr):
    # One key tile. keys [BLOCK_N] absolute key indices; visible [BLOCK_M, BLOCK_N] (read only if MASKED).
    if MASKED:
        kmask = dm[:, None] & key_ok[None, :]
    else:
        kmask = dm[:, None]
    kt = tl.load(k_base + keys[None, :].to(tl.int64) * skn + d[:, None] * skd, mask=kmask, other=0.0)
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no key yet keeps m = -inf: shift by 0 instead so no (-inf) - (-inf) appears
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = tl.load(v_base + keys[:, None].to(tl.int64) * svn + d[None, :] * svd, mask=tl.trans(kmask), other=0.0)
    bad = 0
    if TREE:
        # p is 0 for keys a row cannot see, but 0 * NaN is NaN: keep non-finite values out of the dot
        # (the rows that do see them are poisoned afterwards by _poison_tree_rows)
        finite = tl.abs(vt.to(tl.float32)) < float("inf")  # False for NaN and +-inf
        bad = tl.sum(tl.sum(tl.where(finite, 0, 1), 1), 0)
        vt = tl.where(finite, vt, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
    return acc, m_new, l_i, bad


@triton.jit
def _tree_visibility(bits_row, sbw, w, row_ok, node):
    # [BLOCK_M, 32] visibility of tree keys 32w .. 32w+31: one ancestor-bit word per row; j > node ignored
    j = w * 32 + tl.arange(0, 32)
    word = tl.load(bits_row + w * sbw, mask=row_ok, other=0)
    return (((word[:, None] >> tl.arange(0, 32)[None, :]) & 1) != 0) & (j[None, :] <= node[:, None])


@triton.jit
def _poison_tree_rows(acc, v_base, svn, svd, bits_row, sbw, row_ok, node, prefix, N, last_node, d, dm):
    # acc[i, c] = NaN where row i sees a tree key whose v[c] is NaN or +-inf (the same rule as the prefix keys,
    # where IEEE arithmetic already gives it); a separate pass so the common path carries no extra registers.
    for w in range(0, last_node // 32 + 1):
        j = w * 32 + tl.arange(0, 32)
        visible = _tree_visibility(bits_row, sbw, w, row_ok, node)
        vt = tl.load(v_base + (prefix + j)[:, None].to(tl.int64) * svn + d[None, :] * svd,
                     mask=(j < N)[:, None] & dm[None, :], other=0.0)
        wild = tl.where(tl.abs(vt.to(tl.float32)) < float("inf"), 0.0, 1.0).to(tl.float16)
        hits = tl.dot(visible.to(tl.float16), wild)  # counts: exact in fp16 products, fp32 sums
        acc = tl.where(hits > 0.0, float("nan"), acc)
    return acc


@triton.jit
def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, bits_ptr, plen_ptr, out_ptr, lse_ptr,
                           sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbn, sbw,
                           sob, soh, sos, son, slb, slh, sls,
                           N, L, Hkv, group, head_dim, chunk, qk_scale,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           PRECISION: tl.constexpr):
    # q [B,Hq,N,Dh]; k/v [B,Hkv,L,Dh] (any strides); bits [B,N,W] int32; plen [B] int64.
    # out: [B,Hq,N,Dh] q dtype (one split) or [B,Hq,S,N,Dh] f32 partials; lse: [B,Hq,N] / [B,Hq,S,N] f32
    # (natural log). Split s covers prefix keys [s*chunk, (s+1)*chunk); the last split also the tree keys.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N * group
    node = rows // group
    qh = hk * group + rows % group
    d = tl.arange(0, BLOCK_D)
    dm = d < head_dim
    b64 = b.to(tl.int64)
    q_off = b64 * sqb + qh[:, None].to(tl.int64) * sqh + node[:, None].to(tl.int64) * sqn + d[None, :] * sqd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dm[None, :], other=0.0)
    # a non-finite q entry makes the whole row NaN (inf * k alone would give a pattern that depends on k's signs)
    q_bad = tl.sum(tl.where(tl.abs(q.to(tl.float32)) < float("inf"), 0, 1), 1) > 0
    k_base = k_ptr + b64 * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b64 * svb + hk.to(tl.int64) * svh
    # clamp: no prefix_len VALUE can move the key range outside [0, L)
    prefix = tl.minimum(tl.maximum(tl.load(plen_ptr + b), 0), L - N).to(tl.int32)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    no_mask = row_ok[:, None]  # placeholder "visible" for unmasked tiles (not read there)

    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix)
    full_end = lo + (tl.maximum(hi - lo, 0) // BLOCK_N) * BLOCK_N
    for start in range(lo, full_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        acc, m_i, l_i, _ = _attend(acc, m_i, l_i, q, k_base, v_base, skn, skd, svn, svd, cols, cols < hi, no_mask,
                                   d, dm, qk_scale, False, False, PRECISION)
    if full_end < hi:  # the ragged last prefix tile of this split
        cols = full_end + tl.arange(0, BLOCK_N)
        key_ok = cols < hi
        acc, m_i, l_i, _ = _attend(acc, m_i, l_i, q, k_base, v_base, skn, skd, svn, svd, cols, key_ok,
                                   row_ok[:, None] & key_ok[None, :], d, dm, qk_scale, True, False, PRECISION)
    if split == tl.num_programs(2) - 1:
        # tree keys, 32 per tile: one ancestor-bit word per query row and tile, up to the tile's largest node
        last_node = tl.minimum(N - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // group)
        bits_row = bits_ptr + b64 * sbb + node.to(tl.int64) * sbn
        jj = tl.arange(0, 32)
        num_bad = 0
        for w in range(0, last_node // 32 + 1):
            j = w * 32 + jj
            visible = _tree_visibility(bits_row, sbw, w, row_ok, node)
            acc, m_i, l_i, bad = _attend(acc, m_i, l_i, q, k_base, v_base, skn, skd, svn, svd, prefix + j, j < N,
                                         visible, d, dm, qk_scale, True, True, PRECISION)
            num_bad += bad
        if num_bad > 0:  # rare: a tree key's v holds NaN or inf
            acc = _poison_tree_rows(acc, v_base, svn, svd, bits_row, sbw, row_ok, node, prefix, N, last_node, d, dm)

    empty = l_i == 0.0  # no visible key in this split (NaN is not 0: it propagates)
    l_div = tl.where(empty, 1.0, l_i)
    out = acc / l_div[:, None]
    out = tl.where(tl.abs(out) == float("inf"), float("nan"), out)  # a non-finite v seen in the prefix: NaN too
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_div)) * _LN2)
    out = tl.where(q_bad[:, None], float("nan"), out)
    lse = tl.where(q_bad, float("nan"), lse)
    o_off = (b64 * sob + qh[:, None].to(tl.int64) * soh + split.to(tl.int64) * sos + node[:, None].to(tl.int64) * son
             + d[None, :])
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])
    tl.store(lse_ptr + b64 * slb + qh.to(tl.int64) * slh + split.to(tl.int64) * sls + node, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(part_ptr, plse_ptr, out_ptr, lse_ptr, N, num_splits, head_dim,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # part [B*Hq, S, N, Dh] f32, plse [B*Hq, S, N] f32 (natural log, -inf for an empty split), both
    # contiguous; out [B*Hq, N, Dh] (q dtype) and lse [B*Hq, N] f32, contiguous.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    bh = tl.program_id(1).to(tl.int64)
    rm = r < N
    d = tl.arange(0, BLOCK_D)
    dm = d < head_dim
    base = bh * num_splits * N
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(plse_ptr + base + s * N + r, mask=rm, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    w_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s in range(0, num_splits):
        w = tl.exp(tl.load(plse_ptr + base + s * N + r, mask=rm, other=float("-inf")) - m)
        part = tl.load(part_ptr + (base + s * N + r[:, None]) * head_dim + d[None, :], mask=rm[:, None] & dm[None, :],
                       other=0.0)
        acc += w[:, None] * part
        w_sum += w
    empty = w_sum == 0.0
    w_div = tl.where(empty, 1.0, w_sum)
    out = acc / w_div[:, None]
    tl.store(out_ptr + (bh * N + r[:, None]) * head_dim + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rm[:, None] & dm[None, :])
    tl.store(lse_ptr + bh * N + r, tl.where(empty, float("-inf"), m + tl.log(w_div)), mask=rm)


# --- launch configuration ---------------------------------------------------------------------------------------

def block_d_for(head_dim: int) -> int:
    """Head-dim tile: the next power of two, at least ``MIN_BLOCK_D``."""
    return max(MIN_BLOCK_D, triton.next_power_of_2(head_dim))


def launch_config(rows: int, head_dim: int, dtype: torch.dtype, smem_limit: int, interpreter: bool = False):
    """``(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages)`` for ``rows = N * G`` packed query rows.

    Chosen per shared-memory class from ahead-of-time compiles (``bench/aot_resources.py``; every choice
    below fits its class's per-block limit, registers and spills are in
    ``bench/results/triton_aot_resources.json``): ``smem_limit >= 227 KB`` (sm_90), ``>= 163 KB``
    (sm_80), otherwise the 99 KB of sm_86/sm_89.

    * 16-bit: 16 query rows for trees of at most 16 packed rows, else 64 (32 at head dim 256); 8 warps
      from head dim 128 and at head dim 64 on 99 KB parts; 64 keys per tile, 32 where 64 would not fit or
      would spill (head dim 256, and head dim 128 below sm_90); 3 pipeline stages where they fit. Head dim
      256 keeps 16 query rows below sm_90 (64 rows spill ~700 bytes there). The alternatives each choice
      replaced spilled 16-132 bytes in the kernel that writes a 16-bit output (one split).
    * float32: IEEE dot products run on FMA units with wide register operands: 16 query rows and 16 keys
      per tile (head dim 256 still spills a little; on 99 KB parts it runs unpipelined).
    * ``interpreter``: the largest tiles (the interpreter has no registers to spare, only time).
    """
    block_d = block_d_for(head_dim)
    if interpreter:
        return (16 if rows <= 16 else 64), 64, block_d, 4, 1
    big = smem_limit >= SHARED_MEMORY_LIMITS[90]
    mid = smem_limit >= SHARED_MEMORY_LIMITS[80]
    if dtype == torch.float32:
        return 16, 16, block_d, 4 if block_d == 64 else 8, 1 if (block_d == 256 and not mid) else 2
    if rows <= 16 or (block_d == 256 and not big):
        if block_d == 256 and not mid:
            return 16, 32, block_d, 4, 3
        return 16, 64, block_d, 4, 3
    if block_d == 64:
        return 64, 64, block_d, 4 if mid else 8, 3
    if block_d == 256:  # sm_90 only (see above)
        return 32, 32, block_d, 8, 2
    return (64, 64, block_d, 8, 3) if big else (64, 32, block_d, 8, 2)


def shared_memory_limit(device: torch.device) -> int:
    """Bytes of shared memory one block may ask for on ``device`` (CPU: the sm_90 limit, so the interpreter
    runs the tiles an H100/H200 would)."""
    if device.type != "cuda":
        return SHARED_MEMORY_LIMITS[90]
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if optin:
        return int(optin)
    return SHARED_MEMORY_LIMITS.get(props.major * 10 + props.minor, DEFAULT_SHARED_MEMORY)


def choose_num_splits(programs: int, max_prefix: int, block_n: int, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """Prefix splits for a launch of ``programs`` (= B * Hkv * query tiles) programs.

    Heuristic: a launch with fewer than ``sm_count`` programs leaves SMs idle for the whole prefix,
    so split it until there are at least ``2 * sm_count`` programs (two per SM hides the partial
    writes), but keep at least ``MIN_KEYS_PER_SPLIT`` prefix keys per split (``max_prefix`` is the
    longest prefix the cache can hold, ``L - N``: no host read of ``prefix_lens``) and at most
    ``MAX_SPLITS`` splits. Launches that already cover the GPU are not split.
    """
    if programs >= sm_count or max_prefix <= 0:
        return 1
    want = triton.cdiv(2 * sm_count, max(programs, 1))
    by_length = max(1, max_prefix // max(MIN_KEYS_PER_SPLIT, block_n))
    return max(1, min(want, by_length, MAX_SPLITS))


def split_plan(max_prefix: int, num_splits: int, block_n: int):
    """``(splits, chunk)``: at most ``num_splits`` splits of ``chunk`` prefix keys each, a multiple of ``block_n``,
    covering ``[0, max_prefix)``."""
    chunk = triton.cdiv(triton.cdiv(max(max_prefix, 1), num_splits), block_n) * block_n
    return max(1, triton.cdiv(max_prefix, chunk)), chunk


# --- launcher ---------------------------------------------------------------------------------------------------

def _check(q, k, v, bits, prefix_lens):
    for name, t in (("q", q), ("k", k), ("v", v), ("ancestor_bits", bits), ("prefix_lens", prefix_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, received {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's), received {t.device}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"q: expected float32, float16 or bfloat16, received {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}, received {t.dtype}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q, k: expected [B, Hq, N, Dh] and [B, Hkv, L, Dh], received {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    B, Hq, N, Dh = q.shape
    if not 1 <= Dh <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected a head_dim in [1, {MAX_HEAD_DIM}], received head_dim={Dh}")
    if k.shape[0] != B or k.shape[3] != Dh:
        raise ValueError(f"k: expected shape [B={B}, Hkv, L, Dh={Dh}], received {tuple(k.shape)}")
    Hkv, L = k.shape[1], k.shape[2]
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"k: expected a number of kv heads dividing Hq={Hq}, received {Hkv}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, received {tuple(v.shape)}")
    if L < N:
        raise ValueError(f"k: expected at least N={N} keys (the tree's own), received shape {tuple(k.shape)}")
    if bits.dtype != torch.int32:
        raise TypeError(f"ancestor_bits: expected int32, received {bits.dtype}")
    if tuple(bits.shape) != (B, N, (N + 31) // 32):
        raise ValueError(f"ancestor_bits: expected shape {(B, N, (N + 31) // 32)}, received {tuple(bits.shape)}")
    if prefix_lens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"prefix_lens: expected int64 or int32, received {prefix_lens.dtype}")
    if tuple(prefix_lens.shape) != (B,):
        raise ValueError(f"prefix_lens: expected shape ({B},), received {tuple(prefix_lens.shape)}")


def tree_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor,
                          prefix_lens: torch.Tensor, scale: Optional[float] = None, num_splits: Optional[int] = None):
    """Triton tree attention; same contract as :func:`taps_kernels.reference.tree_attention_reference`.

    Args:
        q: ``[B, Hq, N, Dh]`` float32/float16/bfloat16, ``1 <= Dh <= 256``, any strides.
        k, v: ``[B, Hkv, L, Dh]`` q's dtype, same shape, any strides (a view ``cache[:, :, :L]`` of a
            preallocated cache is read in place); ``Hq % Hkv == 0``; row b's tree node j is key
            ``prefix_lens[b] + j``.
        ancestor_bits: ``[B, N, ceil(N/32)] int32`` (``taps_kernels.layout``); bits for ``j > i`` are ignored.
        prefix_lens: ``[B]`` int64/int32; values are clamped to ``[0, L - N]`` in the kernel (the public op
            rejects them on the host), so no value reads outside k/v.
        scale: softmax scale (default ``Dh ** -0.5``).
        num_splits: prefix splits (flash-decoding); default :func:`choose_num_splits` on CUDA and 1 on CPU
            (the interpreter runs programs one after another). At most this many are used: each split gets a
            whole number of key tiles.
    Returns:
        ``out [B, Hq, N, Dh]`` in q's dtype and ``lse [B, Hq, N] float32`` (natural log).

    bfloat16 on CPU (the interpreter, whose bf16 arithmetic is wrong) is computed in float32 and the
    output rounded to bfloat16: same result as the GPU kernel up to bf16 rounding. No backward: inputs
    that require grad (with grad mode on) are refused.
    """
    _check(q, k, v, ancestor_bits, prefix_lens)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("q, k, v: an input requires grad, but the Triton tree attention has no backward; detach the "
                         "inputs, run under torch.no_grad(), or use the reference backend")
    B, Hq, N, Dh = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    out_dtype = q.dtype
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        q, k, v = q.float(), k.float(), v.float()
    bits = ancestor_bits
    plen = prefix_lens if prefix_lens.dtype == torch.int64 else prefix_lens.to(torch.int64)
    out = torch.empty(B, Hq, N, Dh, dtype=out_dtype, device=q.device)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    if B == 0 or N == 0:
        return out, lse

    rows = N * group
    block_m, block_n, block_d, warps, stages = launch_config(rows, Dh, q.dtype, shared_memory_limit(q.device),
                                                             interpreter=q.device.type == "cpu")
    m_tiles = triton.cdiv(rows, block_m)
    max_prefix = L - N
    if num_splits is None:
        if q.device.type == "cuda":
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            num_splits = choose_num_splits(B * Hkv * m_tiles, max_prefix, block_n, sms)
        else:
            num_splits = 1
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1, received {num_splits!r}")
    splits, chunk = split_plan(max_prefix, num_splits, block_n)
    if splits == 1:
        dst, dst_lse, chunk = out, lse, max(max_prefix, 1)
        so = (out.stride(0), out.stride(1), 0, out.stride(2))
        sl = (lse.stride(0), lse.stride(1), 0)
    else:
        dst = torch.empty(B, Hq, splits, N, Dh, dtype=torch.float32, device=q.device)
        dst_lse = torch.empty(B, Hq, splits, N, dtype=torch.float32, device=q.device)
        so = (dst.stride(0), dst.stride(1), dst.stride(2), dst.stride(3))
        sl = (dst_lse.stride(0), dst_lse.stride(1), dst_lse.stride(2))
    _tree_attention_kernel[(m_tiles, B * Hkv, splits)](
        q, k, v, bits, plen, dst, dst_lse,
        *q.stride(), *k.stride(), *v.stride(), *bits.stride(), *so, *sl,
        N, L, Hkv, group, Dh, chunk, scale * _LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    if splits > 1:
        _merge_splits_kernel[(triton.cdiv(N, MERGE_BLOCK_R), B * Hq)](dst, dst_lse, out, lse, N, splits, Dh,
                                                                     BLOCK_R=MERGE_BLOCK_R, BLOCK_D=block_d,
                                                                     num_warps=MERGE_WARPS)
    return out, lse


# --- ahead-of-time configurations (bench/aot_resources.py, tests/test_triton_gpu_compile.py) -----------------------

_ALIGNED = ("sqb", "sqh", "sqn", "skb", "skh", "skn", "svb", "svh", "svn", "sob", "soh", "sos", "son", "head_dim")
_UNIT = dict(sqd=1, skd=1, svd=1, sbw=1)  # unit strides along Dh / the bit words, as Triton specialises them


def _attention_config(dtype_name: str, block_m, block_n, block_d, warps, stages, out_name=None):
    ptrs = {"q_ptr": dtype_name, "k_ptr": dtype_name, "v_ptr": dtype_name, "out_ptr": out_name or dtype_name,
            "bits_ptr": "*i32", "plen_ptr": "*i64", "lse_ptr": "*fp32"}
    consts = dict(_UNIT, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                  PRECISION="ieee" if dtype_name == "*fp32" else "tf32")
    return (_tree_attention_kernel, ptrs, consts, ("qk_scale",), warps, stages, _ALIGNED)


def aot_configs(arch: Optional[int] = None):
    """Every configuration the launcher can choose on compute capability ``arch`` (default 90): head-dim tiles
    64/128/256 x small/large trees x fp16/bf16/fp32 x one split (output in q's dtype) or several (float32
    partials, then the merge kernel). Format: ``bench/aot_resources.py``."""
    limit = SHARED_MEMORY_LIMITS.get(arch or 90, DEFAULT_SHARED_MEMORY)
    dtypes = {"*fp16": torch.float16, "*bf16": torch.bfloat16, "*fp32": torch.float32}
    out, seen = [], set()
    for block_d in (64, 128, 256):
        for rows in (16, 1024):
            for name, dt in dtypes.items():
                block_m, block_n, bd, warps, stages = launch_config(rows, block_d, dt, limit)
                for out_name in dict.fromkeys((name, "*fp32")):  # fp32 partials: the fp32 kernel is both
                    key = (name, out_name, block_m, block_n, bd, warps, stages)
                    if key not in seen:
                        seen.add(key)
                        out.append(_attention_config(name, block_m, block_n, bd, warps, stages, out_name))
        for name in dtypes:
            out.append((_merge_splits_kernel, {"out_ptr": name}, dict(BLOCK_R=MERGE_BLOCK_R, BLOCK_D=block_d), (),
                        MERGE_WARPS, None, ("head_dim",)))
    return out


__all__ = ["tree_attention_triton", "choose_num_splits", "split_plan", "launch_config", "shared_memory_limit",
           "aot_configs"]
