"""Subtree selection in Triton (ops ``select_subtree`` and ``reindex_subtree``); the spec is
:mod:`taps_kernels.reference.select`.

One program per tree, every phase on the device, no host synchronisation:

* rule ``"reach"``: effective reach ``e = min(log_reach, e(parent))`` by the shared propagation walk
  (:mod:`.propagate_reach`); each candidate's rank under ``(-e, index)`` by counting, in 64x64 tiles, the
  candidates ahead of it (``O(N^2)`` comparisons, no sort, ties exactly as the reference); the kept set is
  ``rank < n``. With a latency table (a device tensor) the size ``n*`` is chosen on the device: the
  ``exp(e)`` values are scattered into rank order and summed one by one in float64, as the reference does,
  so the running sums are the reference's up to the last bit of ``exp`` (the device's float64 ``exp``
  against the host's; a different ``n*`` needs two ratios equal to ~1e-16).
* rule ``"utility"``: ``u`` in float64 (compiled without mul-add fusion, so the denominator rounds as on
  the host), ranks as above, then the reference's greedy loop in rank order: walk up to the first kept
  ancestor, keep the walk if it fits. The loop is sequential by definition; the kept flags live in
  scratch memory with a barrier after each step.
* Output: kept nodes in ascending pool order (a prefix sum per chunk), root first, -1 padding.

``reindex_subtree``: one lane per output row; the new parent index is found by binary search in the
(ascending) ``pool_index`` row.

Out-of-contract values (trusted on the device, ``validate="none"``) give unspecified output, never an
out-of-bounds access or a hang: ``num_nodes`` is clamped into ``[1, N]``; a parent outside ``[0, i-1]``
makes node ``i`` unreachable in the propagation walk and ends the utility rule's ancestor walk (so every
walk strictly descends in index and stops); NaN reach can give equal ranks, so the rank-order slot a step
reads is clamped to a real node and no more than ``max_nodes`` nodes are written after the root;
``depth`` is only arithmetic (never an index); ``pool_index`` entries outside ``[0, N)`` in
``reindex_subtree`` are padding.
"""
from __future__ import annotations

import struct
from typing import List

import torch
import triton
import triton.language as tl

from .propagate_reach import _propagate_row

BLOCK = 256
TILE = 64
NUM_WARPS = 4
REINDEX_BLOCK = 128


def _f64_bits(x: float) -> int:
    # Triton passes Python floats as float32; float64 parameters travel as their int64 bit pattern.
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


@triton.jit
def _as_f64(bits):
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _rank_candidates(val_ptr, rank_ptr, base, lo, hi, TILE: tl.constexpr):
    # rank[i] for lo <= i < hi: candidates j in [lo, hi) ahead of i under (-val, index).
    for i0 in range(lo, hi, TILE):
        i = i0 + tl.arange(0, TILE)
        im = i < hi
        vi = tl.load(val_ptr + base + i, mask=im, other=0.0)
        cnt = tl.zeros([TILE], tl.int32)
        for j0 in range(lo, hi, TILE):
            j = j0 + tl.arange(0, TILE)
            jm = j < hi
            vj = tl.load(val_ptr + base + j, mask=jm, other=0.0)
            ahead = (vj[None, :] > vi[:, None]) | ((vj[None, :] == vi[:, None]) & (j[None, :] < i[:, None]))
            cnt += tl.sum((ahead & jm[None, :]).to(tl.int32), 1)
        tl.store(rank_ptr + base + i, cnt, mask=im)


@triton.jit
def _write_selection(keep_ptr, keep_base, keep_limit, out_ptr, out_base, M, N, BLOCK: tl.constexpr):
    # out row (M entries): 0, then every node i in 1..N-1 with keep[i] < keep_limit in ascending order, then -1.
    # At most M - 1 nodes pass on valid input; the pos < M mask holds the row when NaN reach gives equal ranks.
    for c0 in range(0, M, BLOCK):
        r = c0 + tl.arange(0, BLOCK)
        tl.store(out_ptr + out_base + r, tl.where(r == 0, 0, -1).to(tl.int64), mask=r < M)
    tl.debug_barrier()
    carry = 0
    for c0 in range(0, N, BLOCK):
        r = c0 + tl.arange(0, BLOCK)
        k = tl.load(keep_ptr + keep_base + r, mask=(r > 0) & (r < N), other=keep_limit)
        kept = k < keep_limit
        pos = carry + tl.cumsum(kept.to(tl.int32), 0)
        tl.store(out_ptr + out_base + pos, r.to(tl.int64), mask=kept & (pos < M))
        carry += tl.sum(kept.to(tl.int32), 0)


@triton.jit(do_not_specialize=["t0_bits"])
def _select_reach_kernel(parents_ptr, num_ptr, reach_ptr, lat_ptr, eff_ptr, done_ptr, rank_ptr, x_ptr,
                         pool_index_ptr, num_sel_ptr, N, M, max_nodes, L, t0_bits,
                         HAS_LATENCY: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    # parents [B,N] i32, num [B] i32, reach [B,N] f32, lat [L] f64 -> pool_index [B,M] i64, num_sel [B] i32.
    # Scratch: eff [B,N] f32, done/rank [B,N] i32, x [B,N] f64.
    b = tl.program_id(0)
    base = b.to(tl.int64) * N
    num = tl.minimum(tl.maximum(tl.load(num_ptr + b), 1), N)  # bounds every loop and index below
    _propagate_row(parents_ptr, reach_ptr, eff_ptr, done_ptr, base, N, num, True, BLOCK)
    tl.debug_barrier()
    _rank_candidates(eff_ptr, rank_ptr, base, 1, num, TILE)
    n = tl.minimum(max_nodes, num - 1)
    if HAS_LATENCY:
        tl.debug_barrier()
        for c0 in range(1, num, BLOCK):
            r = c0 + tl.arange(0, BLOCK)
            rm = r < num
            e = tl.load(eff_ptr + base + r, mask=rm, other=0.0)
            rk = tl.load(rank_ptr + base + r, mask=rm, other=0)
            tl.store(x_ptr + base + rk, tl.exp(e.to(tl.float64)), mask=rm)
        tl.debug_barrier()
        t0 = _as_f64(t0_bits)
        n_max = tl.minimum(n, L - 1)
        tau = tl.full([], 1.0, tl.float64)
        best_val = tau / (t0 + tl.load(lat_ptr))
        best_n = 0
        for k in range(1, n_max + 1):
            tau = tau + tl.load(x_ptr + base + k - 1)
            val = tau / (t0 + tl.load(lat_ptr + k))
            better = val > best_val
            best_n = tl.where(better, k, best_n)
            best_val = tl.where(better, val, best_val)
        n = best_n
    tl.debug_barrier()
    _write_selection(rank_ptr, base, n, pool_index_ptr, b.to(tl.int64) * M, M, num, BLOCK)
    tl.store(num_sel_ptr + b, n)


@triton.jit
def _parent_below(parents_ptr, base, j):
    # parent of node j (0 < j < N), or -1 when it is not in [0, j-1]: a walk then stops, and since every step
    # goes to a smaller index it always ends and stays in the row
    p = tl.load(parents_ptr + base + j)
    return tl.where((p >= 0) & (p < j), p, -1)


@triton.jit(do_not_specialize=["lam_node_bits", "lam_depth_bits", "min_u_bits"])
def _select_utility_kernel(parents_ptr, depth_ptr, num_ptr, reach_ptr, u_ptr, rank_ptr, order_ptr, chosen_ptr,
                           pool_index_ptr, num_sel_ptr, N, M, max_nodes, lam_node_bits, lam_depth_bits, min_u_bits,
                           BLOCK: tl.constexpr, TILE: tl.constexpr):
    # parents/depth [B,N] i32, num [B] i32, reach [B,N] f32 -> pool_index [B,M] i64, num_sel [B] i32.
    # Scratch: u [B,N] f64, rank/order/chosen [B,N] i32.
    b = tl.program_id(0)
    base = b.to(tl.int64) * N
    num = tl.minimum(tl.maximum(tl.load(num_ptr + b), 1), N)  # bounds every loop and index below
    lam_node = _as_f64(lam_node_bits)
    lam_depth = _as_f64(lam_depth_bits)
    min_u = _as_f64(min_u_bits)
    for c0 in range(0, N, BLOCK):
        r = c0 + tl.arange(0, BLOCK)
        rm = r < N
        lr = tl.load(reach_ptr + base + r, mask=rm, other=0.0)
        dep = tl.load(depth_ptr + base + r, mask=rm, other=0)
        u = tl.exp(lr.to(tl.float64)) / (lam_node + lam_depth * dep.to(tl.float64))
        tl.store(u_ptr + base + r, u, mask=rm)
        tl.store(chosen_ptr + base + r, tl.zeros([BLOCK], tl.int32), mask=rm)
    tl.debug_barrier()
    _rank_candidates(u_ptr, rank_ptr, base, 1, num, TILE)
    tl.debug_barrier()
    for c0 in range(1, num, BLOCK):
        r = c0 + tl.arange(0, BLOCK)
        rm = r < num
        tl.store(order_ptr + base + tl.load(rank_ptr + base + r, mask=rm, other=0), r, mask=rm)
    tl.debug_barrier()
    count = 0
    k = 0
    active = num > 1
    while active:
        # NaN utilities can tie ranks and leave order slots unwritten: keep i a real non-root node
        i = tl.minimum(tl.maximum(tl.load(order_ptr + base + k), 1), num - 1)
        go = (tl.load(u_ptr + base + i) < min_u) == 0  # the reference stops at u < min_utility
        # the node's not-yet-kept ancestors (itself included) end at the first kept one: the kept set is closed
        j = i
        miss = 0
        walking = go & (tl.load(chosen_ptr + base + j) == 0)
        while walking:
            miss += 1
            j = _parent_below(parents_ptr, base, j)
            walking = (j > 0) & (tl.load(chosen_ptr + base + tl.maximum(j, 0)) == 0)
        fits = go & (count + miss <= max_nodes)
        j = i
        for _ in range(0, tl.where(fits, miss, 0)):
            tl.store(chosen_ptr + base + j, 1)
            j = _parent_below(parents_ptr, base, j)
        count += tl.where(fits, miss, 0)
        tl.debug_barrier()
        k += 1
        active = go & (k < num - 1) & (count < max_nodes)
    # kept flag 1 -> keep when "flag < 1" is false: write with limit semantics on (1 - flag)
    for c0 in range(0, N, BLOCK):
        r = c0 + tl.arange(0, BLOCK)
        rm = r < N
        tl.store(rank_ptr + base + r, 1 - tl.load(chosen_ptr + base + r, mask=rm, other=0), mask=rm)
    tl.debug_barrier()
    _write_selection(rank_ptr, base, 1, pool_index_ptr, b.to(tl.int64) * M, M, num, BLOCK)
    tl.store(num_sel_ptr + b, count)


def select_subtree_triton(parents: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor,
                          log_reach: torch.Tensor, max_nodes: int, latency=None, t0: float = 0.0,
                          rule: str = "reach", lambda_node: float = 1.0, lambda_depth: float = 0.002,
                          min_utility: float = 0.0):
    """Triton ``select_subtree``: same arguments and results as the reference.

    ``parents/depth [B,N] int32``, ``num_nodes [B] int32``, ``log_reach [B,N] float32``, ``latency [L]``
    (any float tensor, read as float64 on the tree's device; ``None`` for a fixed size) ->
    ``(pool_index [B, max_nodes+1] int64, num_selected [B] int32)``: kept pool nodes ascending, root first,
    -1 padded. Integer outputs equal the reference's (see the module docstring for the one float64 caveat
    of the throughput size). No host synchronisation.

    Out-of-contract values (``num_nodes`` outside ``[1, N]``, parents not in ``[0, i-1]``, NaN reach, any
    depth) give unspecified output, never an out-of-bounds access or a hang (module docstring).
    """
    if rule not in ("reach", "utility"):
        raise ValueError(f"rule: expected 'reach' or 'utility', received {rule!r}")
    B, N = parents.shape
    M = max_nodes + 1
    dev = parents.device
    pool_index = torch.empty(B, M, dtype=torch.int64, device=dev)
    num_selected = torch.empty(B, dtype=torch.int32, device=dev)
    if B == 0:
        return pool_index, num_selected
    parents, num_nodes = parents.contiguous(), num_nodes.contiguous()
    reach = log_reach.float().contiguous()
    rank = torch.empty(B, N, dtype=torch.int32, device=dev)
    x = torch.empty(B, N, dtype=torch.float64, device=dev)
    if rule == "reach":
        lat = x if latency is None else latency.to(device=dev, dtype=torch.float64).contiguous()
        eff = torch.empty(B, N, dtype=torch.float32, device=dev)
        done = torch.empty(B, N, dtype=torch.int32, device=dev)
        _select_reach_kernel[(B,)](parents, num_nodes, reach, lat, eff, done, rank, x, pool_index, num_selected,
                                   N, M, max_nodes, lat.shape[0] if latency is not None else 1, _f64_bits(t0),
                                   HAS_LATENCY=latency is not None, BLOCK=BLOCK, TILE=TILE, num_warps=NUM_WARPS)
    else:
        order = torch.empty(B, N, dtype=torch.int32, device=dev)
        chosen = torch.empty(B, N, dtype=torch.int32, device=dev)
        _select_utility_kernel[(B,)](parents, depth.contiguous(), num_nodes, reach, x, rank, order, chosen,
                                     pool_index, num_selected, N, M, max_nodes, _f64_bits(lambda_node),
                                     _f64_bits(lambda_depth), _f64_bits(min_utility), BLOCK=BLOCK, TILE=TILE,
                                     num_warps=NUM_WARPS, enable_fp_fusion=False)
    return pool_index, num_selected


@triton.jit
def _reindex_kernel(tokens_ptr, parents_ptr, depth_ptr, pool_index_ptr, out_tokens_ptr, out_parents_ptr,
                    out_depth_ptr, N, M, STEPS, BLOCK: tl.constexpr):
    # tokens [B,N] i64, parents/depth [B,N] i32, pool_index [B,M] i64 (ascending, -1 padded)
    # -> out_tokens [B,M] i64, out_parents/out_depth [B,M] i32.
    b = tl.program_id(0)
    m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mm = m < M
    ib = b.to(tl.int64) * M
    src = tl.load(pool_index_ptr + ib + m, mask=mm, other=-1)
    keep = mm & (src >= 0) & (src < N)  # an entry outside the pool row is padding (trusted values)
    tb = b.to(tl.int64) * N
    s = tl.maximum(src, 0)
    tok = tl.load(tokens_ptr + tb + s, mask=keep, other=0)
    par = tl.load(parents_ptr + tb + s, mask=keep, other=-1).to(tl.int64)
    dep = tl.load(depth_ptr + tb + s, mask=keep, other=0)
    # lower bound of par in the row; -1 entries (padding) sort last
    lo = tl.zeros([BLOCK], tl.int64)
    hi = tl.full([BLOCK], 0, tl.int64) + M
    for _ in range(0, STEPS):
        open_ = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(pool_index_ptr + ib + tl.minimum(mid, M - 1), mask=open_, other=0)
        below = (v >= 0) & (v < par)
        lo = tl.where(open_ & below, mid + 1, lo)
        hi = tl.where(open_ & (below == 0), mid, hi)
    found = tl.load(pool_index_ptr + ib + tl.minimum(lo, M - 1), mask=keep & (par >= 0) & (lo < M), other=-2) == par
    new_par = tl.where(par >= 0, tl.where(found, lo, -1), par)
    tl.store(out_tokens_ptr + ib + m, tl.where(keep, tok, 0), mask=mm)
    tl.store(out_parents_ptr + ib + m, tl.where(keep, new_par, -1).to(tl.int32), mask=mm)
    tl.store(out_depth_ptr + ib + m, tl.where(keep, dep, 0), mask=mm)


def reindex_subtree_triton(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                           num_nodes: torch.Tensor, pool_index: torch.Tensor, num_selected: torch.Tensor):
    """Triton ``reindex_subtree``: gather the kept rows (``pool_index [B,M] int64`` ascending, -1 padded) of
    ``tokens [B,N] int64``, ``parents/depth [B,N] int32`` into ``(tokens [B,M] int64, parents [B,M] int32,
    depth [B,M] int32, num_nodes [B] int32)``; equal to the reference. No host synchronisation.

    Out-of-contract ``pool_index`` (not ascending, entries ``>= N``): unspecified output, never an
    out-of-bounds access; an entry outside ``[0, N)`` gives a padding row."""
    B, N = tokens.shape
    M = pool_index.shape[1]
    dev = tokens.device
    out_tokens = torch.empty(B, M, dtype=torch.int64, device=dev)
    out_parents = torch.empty(B, M, dtype=torch.int32, device=dev)
    out_depth = torch.empty(B, M, dtype=torch.int32, device=dev)
    if B > 0 and M > 0:
        _reindex_kernel[(B, triton.cdiv(M, REINDEX_BLOCK))](
            tokens.contiguous(), parents.contiguous(), depth.contiguous(), pool_index.contiguous(), out_tokens,
            out_parents, out_depth, N, M, max(1, M.bit_length() + 1), BLOCK=REINDEX_BLOCK, num_warps=4)
    return out_tokens, out_parents, out_depth, (num_selected + 1).to(torch.int32)


def aot_configs() -> List[tuple]:
    """Every launch configuration of this module's launchers (format of ``best_first_pool.aot_configs``)."""
    i32 = {n: "*i32" for n in ("parents_ptr", "depth_ptr", "num_ptr", "done_ptr", "rank_ptr", "order_ptr",
                               "chosen_ptr", "num_sel_ptr", "out_parents_ptr", "out_depth_ptr")}
    f64 = {"lat_ptr": "*fp64", "x_ptr": "*fp64", "u_ptr": "*fp64"}
    i64 = {"pool_index_ptr": "*i64", "tokens_ptr": "*i64", "out_tokens_ptr": "*i64"}
    ptrs = {**i32, **f64, **i64}
    out = [(_select_reach_kernel, ptrs, dict(HAS_LATENCY=h, BLOCK=BLOCK, TILE=TILE), (), NUM_WARPS)
           for h in (False, True)]
    out.append((_select_utility_kernel, ptrs, dict(BLOCK=BLOCK, TILE=TILE), (), NUM_WARPS))
    out.append((_reindex_kernel, ptrs, dict(BLOCK=REINDEX_BLOCK), (), 4))
    return out


__all__ = ["select_subtree_triton", "reindex_subtree_triton", "aot_configs"]
