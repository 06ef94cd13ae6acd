"""Best-first pool assembly in Triton (op ``best_first_pool``); the spec is
:func:`taps_kernels.reference.pool.best_first_pool_reference`.

One program per request, no heap. Every pop of node ``n`` (parent ``p``, rank ``r``) pushes at most two
candidates: its next sibling ``(p, r+1)`` and its first child ``(n, 0)``. So the frontier fits in two
slot vectors indexed by the node that pushed: ``sib[n]`` and ``child[n]`` (``child[0]`` holds the
root's first child). Each step takes the best slot with one max-reduction over ``2 * BLOCK`` int64 keys,
so ``P`` pops cost ``O(P * BLOCK / lanes)`` and everything stays in registers (``BLOCK >= P``).

Key of a candidate (larger is popped first), int64::

    bits 63..32  score, float32 bits mapped to a signed order (``-0.0`` folded into ``+0.0``: a tie)
    bits 31..21  2047 - parent     (smaller parent first on equal scores)
    bits 20..10  2047 - rank       (then smaller rank)
    bits  9..0   depth - 1         (never decides: (parent, rank) is already unique)

The fields hold ``parent, rank <= pool_size`` and ``depth <= pool_size``, hence the 1024-node limit
(``MAX_POOL_SIZE``). Scores are float32 sums from the root in the reference's order
(``logq[parent] + topk_logp[depth-1, rank]``), so ``logq`` is bit-identical.

Out-of-contract values (trusted on the device): no index comes from tensor data. Parent, rank and depth are
decoded from the key's low 32 bits, which the kernel builds itself (``rank < K``, ``depth <= D``, parent a
popped node), whatever the score bits; NaN or ``+inf`` log-probs only change the pop order, and ids and root
tokens are copied as they are. Unspecified output, never an out-of-bounds access; ``P`` steps always.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import triton
import triton.language as tl

MAX_POOL_SIZE = 1024
"""Largest pool (non-root nodes) the kernel keeps in registers; the key packs parent, rank, depth in 32 bits."""

_EMPTY = tl.constexpr(-9223372036854775808)  # int64 min: an empty slot, below every real key


def supports(pool_size: int = None, **_) -> str:
    """Empty when the kernel can build a pool of ``pool_size`` nodes, else why not (read by the backend table)."""
    if pool_size is not None and pool_size > MAX_POOL_SIZE:
        return (f"the Triton pool keeps its frontier in registers for at most {MAX_POOL_SIZE} nodes, "
                f"received pool_size={pool_size}")
    return ""


@triton.jit
def _key(score, parent, rank, depth):
    s = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0 compare equal: one bit pattern
    u = s.to(tl.int32, bitcast=True)
    order = tl.where(u >= 0, u, u ^ 0x7FFFFFFF)  # float order == signed int order
    low = ((tl.cast(2047 - parent, tl.int64) << 21) | (tl.cast(2047 - rank, tl.int64) << 10)
           | tl.cast((depth - 1) & 1023, tl.int64))
    return (order.to(tl.int64) << 32) | low


@triton.jit
def _best_first_pool_kernel(logp_ptr, ids_ptr, root_ptr, tokens_ptr, parents_ptr, depth_ptr, num_ptr, logq_ptr,
                            step_ptr, rank_ptr, D, K, P, BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr):
    # logp [B,D,K] f32, ids [B,D,K] i64, root [B] i64 -> tokens [B,N] i64, parents/depth/rank [B,N] i32,
    # num [B] i32, logq/step [B,N] f32 with N = P + 1 (P = pool_size <= BLOCK).
    b = tl.program_id(0)
    N = P + 1
    out = b.to(tl.int64) * N
    lat = b.to(tl.int64) * D * K
    # padding everywhere first; popped rows overwrite it after the barrier
    for c0 in range(0, N, PAD_BLOCK):
        r = c0 + tl.arange(0, PAD_BLOCK)
        rm = r < N
        root = r == 0
        tl.store(tokens_ptr + out + r, tl.where(root, tl.load(root_ptr + b), 0), mask=rm)
        tl.store(parents_ptr + out + r, tl.full([PAD_BLOCK], -1, tl.int32), mask=rm)
        tl.store(depth_ptr + out + r, tl.zeros([PAD_BLOCK], tl.int32), mask=rm)
        tl.store(rank_ptr + out + r, tl.full([PAD_BLOCK], -1, tl.int32), mask=rm)
        tl.store(logq_ptr + out + r, tl.where(root, 0.0, float("-inf")), mask=rm)
        tl.store(step_ptr + out + r, tl.where(root, 0.0, float("-inf")), mask=rm)
    tl.debug_barrier()

    slot = tl.arange(0, BLOCK)
    node_logq = tl.where(slot == 0, 0.0, float("-inf"))
    has_first = (D > 0) & (K > 0)
    first = tl.load(logp_ptr + lat, mask=has_first, other=0.0)
    child = tl.where((slot == 0) & has_first, _key(0.0 + first, 0, 0, 1), _EMPTY)
    sib = tl.full([BLOCK], _EMPTY, tl.int64)
    count = 1
    for n in range(1, P + 1):
        best = tl.maximum(tl.max(child, 0), tl.max(sib, 0))
        live = best != _EMPTY
        low = best - ((best >> 32) << 32)
        p = 2047 - ((low >> 21) & 2047)
        r = 2047 - ((low >> 10) & 2047)
        d = (low & 1023) + 1
        lq_p = tl.max(tl.where(slot == p, node_logq, float("-inf")), 0)
        pos = lat + (d - 1) * K + r
        step = tl.load(logp_ptr + pos, mask=live, other=0.0)
        score = lq_p + step
        o = out + n
        tl.store(tokens_ptr + o, tl.load(ids_ptr + pos, mask=live, other=0), mask=live)
        tl.store(parents_ptr + o, p.to(tl.int32), mask=live)
        tl.store(depth_ptr + o, d.to(tl.int32), mask=live)
        tl.store(rank_ptr + o, r.to(tl.int32), mask=live)
        tl.store(logq_ptr + o, score, mask=live)
        tl.store(step_ptr + o, step, mask=live)
        node_logq = tl.where(slot == n, score, node_logq)
        child = tl.where(child == best, _EMPTY, child)
        sib = tl.where(sib == best, _EMPTY, sib)
        has_sib = live & (r + 1 < K)
        s_step = tl.load(logp_ptr + pos + 1, mask=has_sib, other=0.0)
        sib = tl.where((slot == n) & has_sib, _key(lq_p + s_step, p, r + 1, d), sib)
        has_child = live & (d < D)
        c_step = tl.load(logp_ptr + lat + d * K, mask=has_child, other=0.0)
        child = tl.where((slot == n) & has_child, _key(score + c_step, n, 0, d + 1), child)
        count += live.to(tl.int32)
    tl.store(num_ptr + b, count)


def _launch_config(pool_size: int) -> Tuple[int, int]:
    """``(BLOCK, num_warps)``: slots for nodes ``0..pool_size-1``; about 8 slots per lane at the top bucket.
    Not tuned on a GPU yet."""
    block = max(16, triton.next_power_of_2(pool_size))
    return block, max(1, block // 256)


def best_first_pool_triton(topk_logp: torch.Tensor, topk_ids: torch.Tensor, root_tokens: torch.Tensor,
                           pool_size: int):
    """Triton ``best_first_pool``: same contract as the reference.

    ``topk_logp [B,D,K] f32``, ``topk_ids [B,D,K] int64``, ``root_tokens [B] int64`` ->
    ``tokens [B,N] int64, parents [B,N] int32, depth [B,N] int32, num_nodes [B] int32, logq [B,N] f32,
    step_logq [B,N] f32, rank [B,N] int32`` with ``N = pool_size + 1``, nodes in pop order (non-increasing
    ``logq``; ties: smaller parent, then smaller rank). Bit-identical to the reference. No host synchronisation.
    """
    why = supports(pool_size=pool_size)
    if why:
        raise ValueError(f"pool_size: {why}")
    B, D, K = topk_logp.shape
    N = pool_size + 1
    dev = topk_logp.device
    tokens = torch.empty(B, N, dtype=torch.int64, device=dev)
    parents = torch.empty(B, N, dtype=torch.int32, device=dev)
    depth = torch.empty(B, N, dtype=torch.int32, device=dev)
    num_nodes = torch.empty(B, dtype=torch.int32, device=dev)
    logq = torch.empty(B, N, dtype=torch.float32, device=dev)
    step_logq = torch.empty(B, N, dtype=torch.float32, device=dev)
    rank = torch.empty(B, N, dtype=torch.int32, device=dev)
    if B > 0:
        block, warps = _launch_config(pool_size)
        _best_first_pool_kernel[(B,)](topk_logp.float().contiguous(), topk_ids.contiguous(),
                                      root_tokens.contiguous(), tokens, parents, depth, num_nodes, logq, step_logq,
                                      rank, D, K, pool_size, BLOCK=block, PAD_BLOCK=256, num_warps=warps)
    return tokens, parents, depth, num_nodes, logq, step_logq, rank


def aot_configs() -> List[tuple]:
    """Every launch configuration ``best_first_pool_triton`` can choose, for ahead-of-time compile checks:
    ``(kernel, pointer types, constexprs, float32 scalar names, num_warps)``."""
    ptrs = {"logp_ptr": "*fp32", "ids_ptr": "*i64", "root_ptr": "*i64", "tokens_ptr": "*i64", "parents_ptr": "*i32",
            "depth_ptr": "*i32", "num_ptr": "*i32", "logq_ptr": "*fp32", "step_ptr": "*fp32", "rank_ptr": "*i32"}
    out = []
    block = 16
    while block <= MAX_POOL_SIZE:
        b, warps = _launch_config(block)
        out.append((_best_first_pool_kernel, ptrs, dict(BLOCK=b, PAD_BLOCK=256), (), warps))
        block *= 2
    return out


__all__ = ["best_first_pool_triton", "aot_configs", "supports", "MAX_POOL_SIZE"]
