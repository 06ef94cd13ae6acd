"""Reach propagation down a tree in log space."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import FLOAT_DTYPES, check_tensor
from ..backend import resolve
from ..layout import Tree


def _check_parents(name: str, parents: torch.Tensor) -> None:
    check_tensor(name, parents, dtypes=(torch.int32,), ndim=2)
    N = parents.shape[1]
    if N < 1:
        raise ValueError(f"{name}: expected at least one node, received shape {tuple(parents.shape)}")
    idx = torch.arange(N, device=parents.device)
    bad = (parents >= idx) | (parents < -1)
    if bad.any():
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"{name}[{b},{i}]: parent index {int(parents[b, i])} must be -1 or smaller than {i}")


def propagate_reach(parents, edge_logq: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """Cumulative log-reach: ``log r(root) = 0``, ``log r(v) = log r(parent(v)) + edge_logq(v)``.

    Args:
        parents: ``[B, N] int32`` (or a :class:`Tree`); -1 for the root and padding; topological order.
        edge_logq: ``[B, N]`` float log-probability of each node's incoming edge (entry 0 ignored).
    Returns:
        ``log_reach [B, N] float32``; padding nodes (``i > 0`` with parent -1) get ``-inf``.
    """
    if isinstance(parents, Tree):
        parents = parents.parents
    _check_parents("parents", parents)
    check_tensor("edge_logq", edge_logq, dtypes=FLOAT_DTYPES, shape=tuple(parents.shape), device=parents.device)
    _, fn = resolve("propagate_reach", backend, parents.device)
    return fn(parents.contiguous(), edge_logq.float().contiguous())
