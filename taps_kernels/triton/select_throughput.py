"""The batch throughput rule in Triton (op ``select_throughput``); the spec is
:func:`taps_kernels.reference.select.select_throughput_reference`.

Row b's size depends on every row's reaches, so the rule runs as three launches, no host synchronisation:

* ``_rank_rows_kernel``, one program per row: each non-root node's rank under ``(-log_reach, index)`` by
  counting, in tiles, the nodes ahead of it (as :mod:`.select_subtree`: no sort, ties exactly as the
  reference's stable sort); the row's first ``cap = min(max_nodes, N - 1)`` nodes become candidates
  ``b * cap + rank`` with their float64 reach.
* ``_joint_kernel``, ONE program for the batch: each candidate's merged rank under ``(-reach, b * cap +
  rank)`` by counting (``O((B * cap)^2)`` comparisons; for B = 1 the row's own order, the reference's one-row
  branch), the reaches scattered into merged order and summed one by one in float64 for the gain's first
  maximum, then every row's size and its reach summed in merged order (rows in register blocks of
  ``ROW_BLOCK``): the reference's operations in the reference's order, so the sums are its sums bit for bit.
* ``_write_rows_kernel``, one program per row: the kept nodes (rank below the row's size, log reach above
  -inf) in ascending order, root first, -1 padding.

Size limit: ``B * cap <= MAX_CANDIDATES``, for the quadratic merged ranking in one program; :func:`supports`
declines larger calls (the backend table then falls back). Not tuned on a GPU yet.

Reach: ``exp`` is torch's, computed on the tensors' device before the launches. Under the interpreter (CPU
tensors) that is the reference's ``exp`` bit for bit; on CUDA it is the device's float64 ``exp``, which can
differ from the host's in the last bit (a different size then needs two gains equal to ~1e-16, as for
``select_subtree``'s throughput size).

Out-of-contract values (trusted on the device, ``validate="none"``) give unspecified output, never an
out-of-bounds access: ``num_nodes`` is clamped into ``[1, N]``; NaN reach can tie ranks, so a scattered rank is
used only inside its row's candidates / the merged list, and at most ``max_nodes`` nodes are written per row.
"""
from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl

from .select_subtree import _as_f64, _f64_bits, _rank_candidates, _write_selection

MAX_CANDIDATES = 2048
"""Largest ``B * min(max_nodes, N - 1)`` the one-program joint step ranks (about a million comparisons)."""
BLOCK = 256
TILE = 64
ROW_BLOCK = 64
NUM_WARPS = 4


def supports(batch_size: int = None, max_nodes: int = None, columns: int = None, **_) -> str:
    """Empty when the kernels take a batch of ``batch_size`` rows offering ``min(max_nodes, columns - 1)``
    candidates each (``columns``: the pool's ``N``; unknown: ``max_nodes``), else why not (read by the backend
    table)."""
    if batch_size is None or max_nodes is None:
        return ""
    cap = max(0, max_nodes if columns is None else min(max_nodes, columns - 1))
    if batch_size * cap > MAX_CANDIDATES:
        return (f"the Triton throughput rule ranks the whole batch's candidates in one program, at most "
                f"{MAX_CANDIDATES}; received {batch_size} rows x {cap} candidates")
    return ""


@triton.jit
def _rank_rows_kernel(reach_ptr, x_ptr, num_ptr, eff_ptr, rank_ptr, fin_ptr, cand_ptr, N, cap,
                      BLOCK: tl.constexpr, TILE: tl.constexpr):
    # reach [B,N] f32 (log reach), x [B,N] f64 (its exp), num [B] i32 -> cand [B*cap] f64 (reach in rank order),
    # rank [B,N] i32 (rank, or N where the node is never written: log reach -inf), fin [B] i32 (such nodes).
    # Scratch: eff [B,N] f32.
    b = tl.program_id(0)
    base = b.to(tl.int64) * N
    num = tl.minimum(tl.maximum(tl.load(num_ptr + b), 1), N)
    for c0 in range(0, N, BLOCK):
        r = c0 + tl.arange(0, BLOCK)
        rm = r < N
        e = tl.load(reach_ptr + base + r, mask=rm & (r < num), other=float("-inf"))  # padding counts as -inf
        tl.store(eff_ptr + base + r, e, mask=rm)
    tl.debug_barrier()
    _rank_candidates(eff_ptr, rank_ptr, base, 1, N, TILE)
    tl.debug_barrier()
    fin = 0
    for c0 in range(1, N, BLOCK):
        r = c0 + tl.arange(0, BLOCK)
        rm = r < N
        rk = tl.load(rank_ptr + base + r, mask=rm, other=0)
        e = tl.load(eff_ptr + base + r, mask=rm, other=float("-inf"))
        x = tl.load(x_ptr + base + r, mask=rm & (r < num), other=0.0)
        tl.store(cand_ptr + b.to(tl.int64) * cap + rk, tl.where(e > float("-inf"), x, 0.0), mask=rm & (rk < cap))
        writable = rm & (e > float("-inf"))
        tl.store(rank_ptr + base + r, tl.where(writable, rk, N), mask=rm)
        fin += tl.sum(writable.to(tl.int32), 0)
    tl.store(fin_ptr + b, fin)


@triton.jit(do_not_specialize=["rate_bits"])
def _joint_kernel(cand_ptr, table_ptr, mrank_ptr, sorted_ptr, row_ptr, sizes_ptr, expected_ptr, B, cap, L,
                  rate_bits, BLOCK: tl.constexpr, TILE: tl.constexpr, ROW_BLOCK: tl.constexpr):
    # cand [B*cap] f64, table [L] f64 -> sizes [B] i32 (candidates kept per row), expected [B] f32.
    # Scratch: mrank [C] i32 (merged rank), sorted [C] f64 / row [C] i32 (reach and row in merged order).
    C = B * cap
    if B > 1:
        _rank_candidates(cand_ptr, mrank_ptr, 0, 0, C, TILE)
        tl.debug_barrier()
    K = tl.minimum(C, L - 1)
    for c0 in range(0, C, BLOCK):
        j = c0 + tl.arange(0, BLOCK)
        jm = j < C
        mr = tl.load(mrank_ptr + j, mask=jm & (B > 1), other=0)
        mr = tl.where(B > 1, mr, j)  # one row: its rank order is the merged order
        ok = jm & (mr < K)
        tl.store(sorted_ptr + mr, tl.load(cand_ptr + j, mask=jm, other=0.0), mask=ok)
        tl.store(row_ptr + mr, j // tl.maximum(cap, 1), mask=ok)
    tl.debug_barrier()
    rate = _as_f64(rate_bits)
    t0 = tl.load(table_ptr)
    best = 0.0 - (t0 - t0) * rate
    best_k = 0
    total = tl.zeros([], tl.float64)
    for j in range(1, K + 1):
        total = total + tl.load(sorted_ptr + j - 1)
        gain = total - (tl.load(table_ptr + j) - t0) * rate
        better = gain > best  # first maximum: the smaller batch tree on ties
        best_k = tl.where(better, j, best_k)
        best = tl.where(better, gain, best)
    for b0 in range(0, B, ROW_BLOCK):
        lanes = b0 + tl.arange(0, ROW_BLOCK)
        mass = tl.zeros([ROW_BLOCK], tl.float64)
        count = tl.zeros([ROW_BLOCK], tl.int32)
        for j in range(0, best_k):
            hit = lanes == tl.load(row_ptr + j)
            mass = tl.where(hit, mass + tl.load(sorted_ptr + j), mass)
            count += hit.to(tl.int32)
        tl.store(sizes_ptr + lanes, count, mask=lanes < B)
        tl.store(expected_ptr + lanes, (1.0 + mass).to(tl.float32), mask=lanes < B)


@triton.jit
def _write_rows_kernel(rank_ptr, sizes_ptr, fin_ptr, pool_index_ptr, num_sel_ptr, N, M, BLOCK: tl.constexpr):
    # rank [B,N] i32 (N where never written), sizes/fin [B] i32 -> pool_index [B,M] i64, num_sel [B] i32.
    b = tl.program_id(0)
    n = tl.load(sizes_ptr + b)
    _write_selection(rank_ptr, b.to(tl.int64) * N, n, pool_index_ptr, b.to(tl.int64) * M, M, N, BLOCK)
    tl.store(num_sel_ptr + b, tl.minimum(n, tl.load(fin_ptr + b)))  # writable nodes rank first


def select_throughput_triton(parents: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor,
                             log_reach: torch.Tensor, max_nodes: int, table: torch.Tensor, plain_seconds: float,
                             rows: int):
    """Triton ``select_throughput``: same arguments and results as the reference.

    ``parents/depth [B,N] int32`` (shape only), ``num_nodes [B] int32``, ``log_reach [B,N] float32``,
    ``table [L]`` (read as float64 on the tree's device) -> ``(pool_index [B, max_nodes+1] int64, num_selected
    [B] int32, expected [B] float32)``. Equal to the reference under the interpreter; on CUDA up to the
    device's float64 ``exp`` (module docstring). No host synchronisation. ``B * min(max_nodes, N - 1)`` at most
    :data:`MAX_CANDIDATES`.
    """
    B, N = parents.shape
    if max_nodes < 0:
        raise ValueError(f"max_nodes: expected an int >= 0, received {max_nodes}")
    why = supports(batch_size=B, max_nodes=max_nodes, columns=N)
    if why:
        raise ValueError(f"select_throughput: {why}")
    M = max_nodes + 1
    cap = max(0, min(max_nodes, N - 1))
    C = B * cap
    dev = parents.device
    pool_index = torch.empty(B, M, dtype=torch.int64, device=dev)
    num_selected = torch.empty(B, dtype=torch.int32, device=dev)
    expected = torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return pool_index, num_selected, expected
    reach = log_reach.float().contiguous()
    x = reach.double().exp()  # torch's exp, as the reference's (module docstring)
    lat = table.to(device=dev, dtype=torch.float64).contiguous()
    eff = torch.empty(B, N, dtype=torch.float32, device=dev)
    rank = torch.empty(B, N, dtype=torch.int32, device=dev)
    fin = torch.empty(B, dtype=torch.int32, device=dev)
    sizes = torch.empty(B, dtype=torch.int32, device=dev)
    cand = torch.empty(max(C, 1), dtype=torch.float64, device=dev)
    mrank = torch.empty(max(C, 1), dtype=torch.int32, device=dev)
    in_order = torch.empty(max(C, 1), dtype=torch.float64, device=dev)
    row_of = torch.empty(max(C, 1), dtype=torch.int32, device=dev)
    num_nodes = num_nodes.contiguous()
    _rank_rows_kernel[(B,)](reach, x, num_nodes, eff, rank, fin, cand, N, cap, BLOCK=BLOCK, TILE=TILE,
                            num_warps=NUM_WARPS)
    # float64 gain and sums without mul-add fusion: each operation rounds as on the host
    _joint_kernel[(1,)](cand, lat, mrank, in_order, row_of, sizes, expected, B, cap, lat.shape[0],
                        _f64_bits(rows / plain_seconds), BLOCK=BLOCK, TILE=TILE, ROW_BLOCK=ROW_BLOCK,
                        num_warps=NUM_WARPS, enable_fp_fusion=False)
    _write_rows_kernel[(B,)](rank, sizes, fin, pool_index, num_selected, N, M, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return pool_index, num_selected, expected


def aot_configs() -> List[tuple]:
    """Every launch configuration of this module's launchers (format of ``best_first_pool.aot_configs``)."""
    ptrs = {"reach_ptr": "*fp32", "x_ptr": "*fp64", "num_ptr": "*i32", "eff_ptr": "*fp32", "rank_ptr": "*i32",
            "fin_ptr": "*i32", "cand_ptr": "*fp64", "table_ptr": "*fp64", "mrank_ptr": "*i32", "sorted_ptr": "*fp64",
            "row_ptr": "*i32", "sizes_ptr": "*i32", "expected_ptr": "*fp32", "pool_index_ptr": "*i64",
            "num_sel_ptr": "*i32"}
    return [(_rank_rows_kernel, ptrs, dict(BLOCK=BLOCK, TILE=TILE), (), NUM_WARPS),
            (_joint_kernel, ptrs, dict(BLOCK=BLOCK, TILE=TILE, ROW_BLOCK=ROW_BLOCK), (), NUM_WARPS),
            (_write_rows_kernel, ptrs, dict(BLOCK=BLOCK), (), NUM_WARPS)]


__all__ = ["select_throughput_triton", "aot_configs", "supports", "MAX_CANDIDATES"]
