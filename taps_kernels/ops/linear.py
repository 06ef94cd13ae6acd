"""Few-row linear layer: the target's matmuls in an AR step (1 row) or a verify forward (a tree's rows)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .._checks import FLOAT_DTYPES, check_data_device, check_tensor, differentiable_backend
from ..backend import resolve, rows_linear_backend


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                backend: Optional[str] = None) -> torch.Tensor:
    """``x @ weight.T + bias``, what ``torch.nn.functional.linear`` computes, fast for few rows on CPU.

    Args:
        x: ``[..., K]`` (any leading dims; their product is the row count ``M``).
        weight: ``[N, K]`` on ``x``'s device, of ``x``'s dtype, or bfloat16 with float32 ``x`` (widened exactly:
            the outputs of its float32 copy, half the bytes to stream).
        bias: ``[N]`` or None.
        backend: None picks per call (:func:`taps_kernels.backend.rows_linear_backend`: the C++ kernel
            for 1..32 float32 rows on an AVX-512 CPU, torch's linear otherwise); ``"cpp"`` needs float32
            CPU tensors.
    Differentiable through the reference backend only: when an input requires grad (grad mode on),
    ``backend=None`` runs torch's linear and ``"cpp"`` is refused.
    Returns:
        ``[..., N]`` in ``x``'s dtype. The C++ kernel sums in another order than BLAS: equal to the
        reference to float32 rounding (~1e-6 relative), not bit for bit.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES + (torch.float64,), ndim=None)
    check_data_device("x", x)
    if x.dim() < 1:
        raise ValueError(f"x: expected at least 1 dimension [..., K], received shape {tuple(x.shape)}")
    K = x.shape[-1]
    weight_dtypes = (x.dtype, torch.bfloat16) if x.dtype == torch.float32 else (x.dtype,)
    check_tensor("weight", weight, dtypes=weight_dtypes, shape=(None, K), device=x.device)
    if bias is not None:
        check_tensor("bias", bias, dtypes=(x.dtype,), shape=(weight.shape[0],), device=x.device)
    # an explicit row count: reshape(-1, 0) is ambiguous when K == 0
    x2 = x.reshape(math.prod(x.shape[:-1]), K)
    grad_backend = differentiable_backend("rows_linear", backend, [("x", x), ("weight", weight), ("bias", bias)])
    if grad_backend != backend:
        backend = grad_backend  # an input needs grad: only torch's linear (the reference) has a backward
    elif backend is None:
        backend = rows_linear_backend(x2.shape[0], x.device, x.dtype)
    _, fn = resolve("rows_linear", backend, x.device)
    return fn(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
