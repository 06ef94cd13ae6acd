"""Log-reach propagation in Triton (op ``propagate_reach``); the spec is
:func:`taps_kernels.reference.reach.propagate_reach_reference`.

One program per tree. Every node gets exactly one float32 operation, its parent's FINAL value combined
with its own edge, so the result is bit-identical to the reference whatever the evaluation order. Nodes
are taken in chunks of ``BLOCK`` in index order; a parent always precedes its child (``parent < i``), so
every parent outside the chunk is already final, and inside the chunk the nodes whose parent is final
are finished round by round (rounds = the chunk's local depth + 1). A ``done`` flag per node in scratch
memory says which values are final; reads and writes of a round are separated by barriers, so a reader
never sees a flag before the value it guards.

``_propagate_row`` is shared with ``select_subtree`` (its effective reach is the same walk with
``min`` in place of ``+``).

Out-of-contract parents (values are trusted on the device): a node whose parent is not in ``[0, i-1]``
(``>= i``, beyond ``N``, or negative other than ``-1``) is treated as padding (``-inf``). The output is then
unspecified, but no index leaves the row and the rounds always end (every pending node's parent comes
before it, so the first pending node of a chunk is always ready).
"""
from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl

BLOCK = 256
NUM_WARPS = 4


@triton.jit
def _propagate_row(parents_ptr, edge_ptr, out_ptr, done_ptr, base, N, num, USE_MIN: tl.constexpr,
                   BLOCK: tl.constexpr):
    # Row ``base`` of [B,N] arrays: out[0] = 0; for 0 < i < num with parents[i] >= 0:
    # out[i] = out[parent] + edge[i] (USE_MIN: edge[i] unless out[parent] < edge[i]); every other node -inf
    # (a child of such a node still reads it, as the reference does). done [B,N] i32 scratch.
    # num is clamped into [0, N] and a parent outside [0, i-1] makes node i padding: these bound every index
    # and, parents pointing backwards only, guarantee each round finishes at least one node.
    num = tl.minimum(tl.maximum(num, 0), N)
    for c0 in range(0, N, BLOCK):
        r = c0 + tl.arange(0, BLOCK)
        rm = r < N
        par = tl.load(parents_ptr + base + r, mask=rm, other=-1)
        pending = rm & (r > 0) & (r < num) & (par >= 0) & (par < r)
        edge = tl.load(edge_ptr + base + r, mask=pending, other=0.0)
        tl.store(out_ptr + base + r, tl.where(r == 0, 0.0, float("-inf")), mask=rm)
        tl.store(done_ptr + base + r, tl.where(pending, 0, 1), mask=rm)
        tl.debug_barrier()
        todo = tl.sum(pending.to(tl.int32), 0)
        while todo > 0:
            pu = tl.maximum(par, 0)
            ready = pending & (tl.load(done_ptr + base + pu, mask=pending, other=0) != 0)
            pv = tl.load(out_ptr + base + pu, mask=ready, other=0.0)
            if USE_MIN:
                val = tl.where(pv < edge, pv, edge)
            else:
                val = pv + edge
            tl.debug_barrier()  # every read of this round precedes every write
            tl.store(out_ptr + base + r, val, mask=ready)
            tl.store(done_ptr + base + r, tl.full([BLOCK], 1, tl.int32), mask=ready)
            tl.debug_barrier()
            pending = pending & (ready == 0)
            todo = tl.sum(pending.to(tl.int32), 0)


@triton.jit
def _propagate_reach_kernel(parents_ptr, edge_ptr, out_ptr, done_ptr, N, BLOCK: tl.constexpr):
    # parents [B,N] i32, edge [B,N] f32 -> out [B,N] f32; done [B,N] i32 scratch.
    base = tl.program_id(0).to(tl.int64) * N
    _propagate_row(parents_ptr, edge_ptr, out_ptr, done_ptr, base, N, N, False, BLOCK)


def propagate_reach_triton(parents: torch.Tensor, edge_logq: torch.Tensor) -> torch.Tensor:
    """Triton ``propagate_reach``: ``parents [B,N] int32`` (topological, -1 for root and padding),
    ``edge_logq [B,N]`` float -> ``log_reach [B,N] float32`` (root 0, padding -inf), bit-identical to the
    reference. No host synchronisation.

    Out-of-contract values (trusted, as on a GPU with ``validate="none"``): a parent outside ``[0, i-1]`` for
    node ``i > 0`` gives that node ``-inf`` (as padding); unspecified output, never an out-of-bounds access
    or a hang."""
    B, N = parents.shape
    out = torch.empty(B, N, dtype=torch.float32, device=parents.device)
    if B == 0 or N == 0:
        return out
    done = torch.empty(B, N, dtype=torch.int32, device=parents.device)
    _propagate_reach_kernel[(B,)](parents.contiguous(), edge_logq.float().contiguous(), out, done, N, BLOCK=BLOCK,
                                  num_warps=NUM_WARPS)
    return out


def aot_configs() -> List[tuple]:
    """The one launch configuration of ``propagate_reach_triton`` (format of ``best_first_pool.aot_configs``)."""
    return [(_propagate_reach_kernel, {"parents_ptr": "*i32", "done_ptr": "*i32"}, dict(BLOCK=BLOCK), (), NUM_WARPS)]


__all__ = ["propagate_reach_triton", "aot_configs"]
