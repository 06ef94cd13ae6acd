"""KV compaction after acceptance: keep the accepted tree rows, contiguous after the prefix, in place."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .._checks import (FLOAT_DTYPES, check_data_device, check_nonempty, check_not_grad_tracked, check_prefix_lens,
                       check_tensor, check_writable_disjoint, first_index, values_checked)
from ..backend import resolve


def _check_path(path: torch.Tensor, prefix_lens: torch.Tensor, L: int) -> None:
    """Value checks of the path; ``prefix_lens`` already in ``[0, L]``, so ``L - 1 - prefix_lens`` cannot overflow."""
    B, P = path.shape
    if B == 0 or P == 0:
        return
    valid = path >= 0
    if bool((path < -1).any()):
        b, j = first_index(path < -1)
        raise ValueError(f"path[{b},{j}]: expected a node index or -1, received {int(path[b, j])}")
    if P > 1 and bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        b, j = first_index(valid[:, 1:] & ~valid[:, :-1])
        raise ValueError(f"path[{b},{j + 1}]: a node follows a -1 pad; padding must be trailing")
    if P > 1 and bool((valid[:, 1:] & (path[:, 1:] <= path[:, :-1])).any()):
        b, j = first_index(valid[:, 1:] & (path[:, 1:] <= path[:, :-1]))
        raise ValueError(f"path[{b},{j + 1}]: node indices along a path must increase, received "
                         f"{int(path[b, j])} then {int(path[b, j + 1])}")
    room = (L - 1) - prefix_lens  # last node index that stays inside the cache
    too_far = valid & (path > room[:, None])
    if bool(too_far.any()):
        b, j = first_index(too_far)
        raise ValueError(f"path[{b},{j}]: node {int(path[b, j])} is past the cache: expected <= L - 1 - prefix_lens[{b}] "
                         f"= {int(room[b])} (L = {L}, prefix_lens[{b}] = {int(prefix_lens[b])})")


def check_compact_kv_args(keys, values, prefix_lens, path, validate,
                          storage: bool = True) -> Tuple[int, int, torch.Tensor]:
    """Every check of :func:`compact_kv`; -> ``(B, L, prefix_lens as int64)``.

    ``validate``: a mode (see :func:`compact_kv`) or a bool saying whether the value checks run; ``storage=False``
    skips the memory-overlap checks (fake tensors have no addresses). Shared with the ``taps::compact_kv`` custom op.
    """
    if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)):
        raise TypeError(f"keys/values: expected lists of tensors, received {type(keys).__name__}/{type(values).__name__}")
    if len(keys) != len(values) or not keys:
        raise ValueError(f"keys/values: expected equally long non-empty lists, received {len(keys)} and {len(values)}")
    ref = check_tensor("keys[0]", keys[0], dtypes=FLOAT_DTYPES, ndim=4)
    if storage:
        check_data_device("keys[0]", ref)
    check_nonempty("keys[0]", ref, [(0, "batch row")])
    B, _, L, _ = ref.shape
    check_values = validate if isinstance(validate, bool) else values_checked(validate, ref.device)
    named = [(f"{name}[{i}]", t) for name, group in (("keys", keys), ("values", values)) for i, t in enumerate(group)]
    for name, t in named:
        check_tensor(name, t, dtypes=FLOAT_DTYPES, shape=(B, None, L, None), device=ref.device)
    # A tensor listed twice, or two overlapping ones, would be moved twice by a sequential backend and once by a
    # parallel one; a broadcast (stride 0) dimension would receive several rows in one place.
    if storage:
        check_writable_disjoint(named)
    prefix_lens = check_prefix_lens(prefix_lens, B, ref.device, check_values=check_values, upper=(L, "L"))
    check_tensor("path", path, dtypes=(torch.int64,), ndim=2, device=ref.device)
    if path.shape[0] != B:
        raise ValueError(f"path: expected shape ({B}, P), received {tuple(path.shape)}")
    if check_values:
        _check_path(path, prefix_lens, L)
    return B, L, prefix_lens


def compact_kv(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], prefix_lens: torch.Tensor,
               path: torch.Tensor, backend: Optional[str] = None, validate: Optional[str] = None) -> torch.Tensor:
    """Move the accepted nodes' K/V rows to positions ``prefix_lens[b] + j``, in place, for every layer at once.

    Args:
        keys, values: lists (one entry per layer) of ``[B, H, L, Dh]`` tensors (``B >= 1``); the tree of row b sits
            at rows ``prefix_lens[b] .. prefix_lens[b] + N - 1``. Each tensor is written in place, so each must own
            its memory: a tensor listed twice, two tensors whose storage spans overlap, and stride-0 (broadcast)
            dimensions are refused; so is a tensor that requires grad while grad mode is on.
        prefix_lens: ``[B] int64`` with ``0 <= prefix_lens[b] <= L``.
        path: ``[B, P] int64`` accepted node indices from :func:`accept_greedy` (root first, strictly increasing,
            -1 padded) with ``path[b, j] <= L - 1 - prefix_lens[b]``.
        validate: value checks of ``prefix_lens`` and ``path``: ``"auto"`` (default, or ``TAPS_VALIDATE``) on CPU
            tensors only, ``"full"`` on any device, ``"none"`` never (:mod:`taps_kernels._checks`).
    Returns:
        ``new_lens [B] int64 = prefix_lens + accept_len``; rows past it are stale and should be cropped.
    Everything is validated before the first write, so a rejected call leaves the cache untouched.
    """
    B, L, prefix_lens = check_compact_kv_args(keys, values, prefix_lens, path, validate)
    check_not_grad_tracked([(f"{n}[{i}]", t) for n, g in (("keys", keys), ("values", values)) for i, t in enumerate(g)],
                           "compact_kv")
    _, fn = resolve("compact_kv", backend, keys[0].device)
    return fn(list(keys), list(values), prefix_lens.contiguous(), path.contiguous())
