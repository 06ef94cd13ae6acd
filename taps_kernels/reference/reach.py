"""Reference reach propagation: ``log r(root) = 0``, ``log r(v) = log r(parent) + edge_logq(v)``."""
from __future__ import annotations

import torch


def propagate_reach_reference(parents: torch.Tensor, edge_logq: torch.Tensor) -> torch.Tensor:
    """``parents [B,N] int32``, ``edge_logq [B,N]`` -> ``log_reach [B,N] f32``; padding (parent -1, i > 0) gets -inf.

    Every node gets exactly one float32 addition, its parent's final value plus its edge, so the
    result does not depend on the order of evaluation. It is evaluated for all nodes at once and
    repeated until nothing changes: after k sweeps every node at depth <= k is final, so the loop
    runs (tree depth + 1) times rather than once per node.
    """
    B, N = parents.shape
    edge = edge_logq.float()
    has_parent = parents >= 0
    parent_index = parents.clamp(min=0).long()
    out = torch.full((B, N), float("-inf"), dtype=torch.float32, device=parents.device)
    out[:, 0] = 0.0
    for _ in range(N):
        new = torch.where(has_parent, out.gather(1, parent_index) + edge, out)
        new[:, 0] = 0.0
        if torch.equal(new, out):
            break
        out = new
    return out
