"""Reference of :func:`taps_kernels.rows_linear`: torch's own linear layer (BLAS)."""
from __future__ import annotations

from typing import Optional

import torch


def rows_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M,K], weight [N,K], bias [N] or None`` (float32; bfloat16 weights are widened) -> ``x @ weight.T + bias``
    ``[M,N]``."""
    return torch.nn.functional.linear(x, weight.to(x.dtype), bias)


def quantize_int8_rows_reference(weight: torch.Tensor):
    """Symmetric int8 weights, one scale per output row: ``weight [N,K]`` float ->
    ``(qweight [N,K] int8 in [-127, 127], scale [N] float32)`` with ``weight ~ qweight * scale[:, None]``.

    ``scale = max|row| / 127`` (an all-zero row gets scale 1 and zeros); rounding to nearest, ties to even.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight, scale


# fbgemm's rule for the activation range of a dynamic int8 linear (torch's ChooseQuantizationParams): the range
# always contains 0, and a scale below this is raised to it
_MIN_ACTIVATION_SCALE = 6.1e-5


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, reduce_range: bool = False) -> torch.Tensor:
    """Dynamic int8 linear layer, written out: ``x [M,K]`` float32, ``qweight [N,K]`` int8, ``weight_scale [N]``
    float32, ``bias [N]`` or None -> ``[M,N]`` float32.

    The call's activations are quantised as one tensor to uint8 (``[0, 255]``, or ``[0, 127]`` with
    ``reduce_range``) over their range extended to contain 0: ``scale_x = (max - min) / qmax``,
    ``zero = round(-min / scale_x)``, ``xq = clamp(round(x / scale_x) + zero)``. Products are summed exactly
    (integers) and rescaled: ``y[m,n] = scale_x * weight_scale[n] * sum_k (xq[m,k] - zero) * qweight[n,k] + bias[n]``.
    This is the arithmetic of fbgemm's dynamic int8 linear (``torch.ops.quantized.linear_dynamic``); the two may
    differ by one quantisation step of an input element where ``x / scale_x`` falls on a rounding boundary.
    """
    qmax = 127 if reduce_range else 255
    xf = x.float()
    lo = min(float(xf.min()), 0.0) if xf.numel() else 0.0
    hi = max(float(xf.max()), 0.0) if xf.numel() else 0.0
    scale_x = float(torch.tensor((hi - lo) / qmax, dtype=torch.float32))
    if scale_x == 0.0:
        scale_x = 0.1
    scale_x = max(scale_x, _MIN_ACTIVATION_SCALE)
    zero = int(min(max(round(-lo / scale_x), 0), qmax))
    xq = (torch.round(xf / scale_x) + zero).clamp(0, qmax)
    acc = (xq.double() - zero) @ qweight.double().t()  # exact: integer products, sums far below 2**53
    y = (acc * (scale_x * weight_scale.double())[None, :]).float()
    return y if bias is None else y + bias.float()
