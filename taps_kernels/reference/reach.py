"""Reference reach propagation: ``log r(root) = 0``, ``log r(v) = log r(parent) + edge_logq(v)``."""
from __future__ import annotations

import torch


def propagate_reach_reference(parents: torch.Tensor, edge_logq: torch.Tensor) -> torch.Tensor:
    """``parents [B,N] int32``, ``edge_logq [B,N]`` -> ``log_reach [B,N] f32``; padding (parent -1, i > 0) gets -inf.

    Nodes are visited in index order, so every parent is final before its children read it.
    """
    B, N = parents.shape
    edge = edge_logq.float()
    out = torch.full((B, N), float("-inf"), dtype=torch.float32, device=parents.device)
    out[:, 0] = 0.0
    for i in range(1, N):
        p = parents[:, i].long()
        has_parent = p >= 0
        val = out.gather(1, p.clamp(min=0)[:, None])[:, 0] + edge[:, i]
        out[:, i] = torch.where(has_parent, val, out[:, i])
    return out
