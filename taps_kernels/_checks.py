"""Argument checks shared by every public op: each error names the argument, the expectation and what arrived."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def check_tensor(name: str, value, dtypes: Optional[Sequence[torch.dtype]] = None, ndim: Optional[int] = None,
                 shape: Optional[Sequence[Optional[int]]] = None, device: Optional[torch.device] = None) -> torch.Tensor:
    """Return ``value`` if it is a tensor of the expected dtype/rank/shape/device; raise TypeError/ValueError otherwise.

    ``shape`` entries that are ``None`` match any size.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, received {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, received {str(value.dtype).replace('torch.', '')}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, received shape {tuple(value.shape)}")
    if shape is not None:
        for want, got in zip(shape, value.shape):
            if want is not None and want != got:
                pretty = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
                raise ValueError(f"{name}: expected shape {pretty}, received {tuple(value.shape)}")
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device}, received one on {value.device}")
    return value


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, received {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, received {value}")
    return value


def check_prefix_lens(prefix_lens, B: int, device) -> torch.Tensor:
    """``prefix_lens [B]`` int64/int32, on ``device``, all >= 0; returned as int64."""
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64, torch.int32), shape=(B,), device=device)
    if (prefix_lens < 0).any():
        b = int((prefix_lens < 0).nonzero()[0])
        raise ValueError(f"prefix_lens[{b}]: expected >= 0, received {int(prefix_lens[b])}")
    return prefix_lens.long()


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
