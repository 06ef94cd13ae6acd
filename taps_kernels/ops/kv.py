"""KV compaction after acceptance: keep the accepted tree rows, contiguous after the prefix, in place."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .._checks import FLOAT_DTYPES, check_prefix_lens, check_tensor
from ..backend import resolve


def _check_path(path: torch.Tensor, prefix_lens: torch.Tensor, L: int) -> None:
    B, P = path.shape
    valid = path >= 0
    if (path < -1).any():
        b, j = (int(x) for x in (path < -1).nonzero()[0])
        raise ValueError(f"path[{b},{j}]: expected a node index or -1, received {int(path[b, j])}")
    if P > 1 and (valid[:, 1:] & ~valid[:, :-1]).any():
        b, j = (int(x) for x in (valid[:, 1:] & ~valid[:, :-1]).nonzero()[0])
        raise ValueError(f"path[{b},{j + 1}]: a node follows a -1 pad; padding must be trailing")
    if P > 1 and (valid[:, 1:] & (path[:, 1:] <= path[:, :-1])).any():
        b, j = (int(x) for x in (valid[:, 1:] & (path[:, 1:] <= path[:, :-1])).nonzero()[0])
        raise ValueError(f"path[{b},{j + 1}]: node indices along a path must increase, received "
                         f"{int(path[b, j])} then {int(path[b, j + 1])}")
    too_far = valid & (prefix_lens[:, None] + path >= L)
    if too_far.any():
        b, j = (int(x) for x in too_far.nonzero()[0])
        raise ValueError(f"path[{b},{j}]: row prefix_lens + {int(path[b, j])} is past the cache length {L}")


def compact_kv(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], prefix_lens: torch.Tensor,
               path: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """Move the accepted nodes' K/V rows to positions ``prefix_lens[b] + j``, in place, for every layer at once.

    Args:
        keys, values: lists (one entry per layer) of ``[B, H, L, Dh]`` tensors; the tree of row b sits at
            rows ``prefix_lens[b] .. prefix_lens[b] + N - 1``.
        prefix_lens: ``[B] int64``.
        path: ``[B, P] int64`` accepted node indices from :func:`accept_greedy` (root first, -1 padded).
    Returns:
        ``new_lens [B] int64 = prefix_lens + accept_len``; rows past it are stale and should be cropped.
    Everything is validated before the first write, so a rejected call leaves the cache untouched.
    """
    if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)):
        raise TypeError(f"keys/values: expected lists of tensors, received {type(keys).__name__}/{type(values).__name__}")
    if len(keys) != len(values) or not keys:
        raise ValueError(f"keys/values: expected equally long non-empty lists, received {len(keys)} and {len(values)}")
    ref = check_tensor("keys[0]", keys[0], dtypes=FLOAT_DTYPES, ndim=4)
    B, _, L, _ = ref.shape
    for name, group in (("keys", keys), ("values", values)):
        for i, t in enumerate(group):
            check_tensor(f"{name}[{i}]", t, dtypes=FLOAT_DTYPES, shape=(B, None, L, None), device=ref.device)
    ptrs = [t.data_ptr() for t in list(keys) + list(values)]
    if len(set(ptrs)) != len(ptrs):
        # A tensor listed twice would be moved twice by a sequential backend and once by a parallel one.
        raise ValueError("keys/values: the same tensor appears more than once; list each cache tensor once")
    prefix_lens = check_prefix_lens(prefix_lens, B, ref.device)
    check_tensor("path", path, dtypes=(torch.int64,), ndim=2, device=ref.device)
    if path.shape[0] != B:
        raise ValueError(f"path: expected shape ({B}, P), received {tuple(path.shape)}")
    _check_path(path, prefix_lens.long(), L)
    _, fn = resolve("compact_kv", backend, ref.device)
    return fn(list(keys), list(values), prefix_lens.long().contiguous(), path.contiguous())
