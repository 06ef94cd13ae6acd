"""KV compaction after acceptance: keep the accepted tree rows, contiguous after the prefix, in place."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .._checks import (FLOAT_DTYPES, check_data_device, check_nonempty, check_not_grad_tracked, check_prefix_lens,
                       check_tensor, check_writable_disjoint, first_index, values_checked)
from .._library import define
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
    skips the memory-overlap checks (the public op leaves them to the op's kernel; fake tensors have no addresses).
    Shared with the ``taps::compact_kv`` op.
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
    dev = ref.device
    # one pass of cheap attribute reads; the named check (and its message) only when something is off
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] == B and t.shape[2] == L
               and t.device == dev and t.dtype in FLOAT_DTYPES for _, t in named):
        for name, t in named:
            check_tensor(name, t, dtypes=FLOAT_DTYPES, shape=(B, None, L, None), device=dev)
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
    # Every check of the cache tensors runs once, in the op's kernel (60 tensors for a 30-layer model: checking
    # them twice cost more than the compaction). Here: the containers and int32 prefix lengths.
    if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)):
        raise TypeError(f"keys/values: expected lists of tensors, received {type(keys).__name__}/{type(values).__name__}")
    for name, group in (("keys", keys), ("values", values)):
        for i, t in enumerate(group):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}]: expected a torch.Tensor, received {type(t).__name__}")
    if isinstance(prefix_lens, torch.Tensor) and prefix_lens.dtype == torch.int32:
        prefix_lens = prefix_lens.long()
    if isinstance(path, torch.Tensor):
        path = path.contiguous()
    return compact_kv_op(list(keys), list(values), prefix_lens, path, backend, validate)


def _compact_kv_kernel(keys, values, prefix_lens, path, backend=None, validate=None):
    check_tensor("path", path, dtypes=(torch.int64,), ndim=2)
    check_data_device("path", path)
    name, fn = resolve("compact_kv", backend, path.device)
    # The C++ entry checks the same metadata, overlap, grad rule and path bounds itself before any write (with the
    # same argument names): the Python checks run for the other backends, or when the value checks are asked for.
    if name != "cpp" or values_checked(validate, path.device):
        check_compact_kv_args(keys, values, prefix_lens, path, validate)
        check_not_grad_tracked([(f"{n}[{i}]", t) for n, g in (("keys", keys), ("values", values))
                                for i, t in enumerate(g)], "compact_kv")
    return fn(list(keys), list(values), prefix_lens.contiguous(), path)


def _compact_kv_fake(keys, values, prefix_lens, path, backend=None, validate=None):
    check_compact_kv_args(keys, values, prefix_lens, path, False, storage=False)
    return path.new_empty((path.shape[0],))


compact_kv_op = define("compact_kv(Tensor(a!)[] keys, Tensor(b!)[] values, Tensor prefix_lens, Tensor path, "
                       "str? backend=None, str? validate=None) -> Tensor", _compact_kv_kernel, _compact_kv_fake)
"""``taps::compact_kv``: in place on every ``[B,H,L,Dh]`` tensor of ``keys``/``values``; ``prefix_lens [B] int64``,
``path [B,P] int64`` -> ``new_lens [B] int64``. Checks metadata and that no two cache tensors share memory, then
the values as ``validate`` says (:mod:`taps_kernels._checks`: by default on CPU tensors), before any write."""
