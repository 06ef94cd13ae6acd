"""Reach propagation down a tree in log space."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import (FLOAT_DTYPES, check_data_device, check_log_values, check_nonempty, check_tensor,
                       differentiable_backend, first_index, values_checked)
from ..backend import resolve
from ..layout import MAX_NODES, Tree


def _check_parents(name: str, parents: torch.Tensor, check_values: bool) -> None:
    check_tensor(name, parents, dtypes=(torch.int32,), ndim=2)
    check_data_device(name, parents)
    check_nonempty(name, parents, [(0, "tree (batch row)"), (1, "node")])
    N = parents.shape[1]
    if N > MAX_NODES:
        raise ValueError(f"{name}: expected at most 2**31 - 1 nodes (int32 indices), received shape {tuple(parents.shape)}")
    if not check_values:
        return
    idx = torch.arange(N, device=parents.device)
    bad = (parents >= idx) | (parents < -1)
    if bool(bad.any()):
        b, i = first_index(bad)
        raise ValueError(f"{name}[{b},{i}]: parent index {int(parents[b, i])} must be -1 or smaller than {i}")


def propagate_reach(parents, edge_logq: torch.Tensor, backend: Optional[str] = None,
                    validate: Optional[str] = None) -> torch.Tensor:
    """Cumulative log-reach: ``log r(root) = 0``, ``log r(v) = log r(parent(v)) + edge_logq(v)``.

    Args:
        parents: ``[B, N] int32`` (or a :class:`Tree`), ``B, N >= 1``; -1 for the root and padding; topological order.
        edge_logq: ``[B, N]`` float log-probability of each node's incoming edge (entry 0 and padding entries
            ignored). Non-finite values: ``-inf`` is an impossible edge (its subtree is unreachable); NaN and
            ``+inf`` are refused (value check).
        validate: value checks (parent ranges, non-finite edges): ``"auto"`` (default, or ``TAPS_VALIDATE``) on CPU
            tensors only, ``"full"`` on any device, ``"none"`` never (:mod:`taps_kernels._checks`).
    Returns:
        ``log_reach [B, N] float32``; padding nodes (``i > 0`` with parent -1) get ``-inf``.
    Differentiable through the reference backend only (``backend=None`` picks it when ``edge_logq`` requires grad).
    """
    if isinstance(parents, Tree):
        parents = parents.parents
    check_values = isinstance(parents, torch.Tensor) and values_checked(validate, parents.device)
    _check_parents("parents", parents, check_values)
    check_tensor("edge_logq", edge_logq, dtypes=FLOAT_DTYPES, shape=tuple(parents.shape), device=parents.device)
    if check_values:
        check_log_values("edge_logq", torch.where(parents >= 0, edge_logq, torch.zeros_like(edge_logq)))
    backend = differentiable_backend("propagate_reach", backend, [("edge_logq", edge_logq)])
    _, fn = resolve("propagate_reach", backend, parents.device)
    return fn(parents.contiguous(), edge_logq.float().contiguous())
