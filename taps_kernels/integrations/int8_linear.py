"""Linear layers with int8 weights for CPU inference (the drafter's vocabulary head).

A draft pass on a CPU spends a third of its time projecting onto the vocabulary, a few rows times a
``[V, H]`` weight. fbgemm's dynamic int8 GEMM (int8 weights, activations quantised per call, int32 sums)
does that ~6x faster than bf16 here. Draft logits only propose tokens that the target verifies, so the
rounding changes at most a proposal, never a generated token.

:class:`Int8Linear` stores ``qweight [N,K] int8`` and ``weight_scale [N]`` (one scale per output row, from
:func:`taps_kernels.reference.quantize_int8_rows_reference`) and runs fbgemm where
:func:`taps_kernels.backend.int8_linear_backend` says it can, else the plain-torch reference
:func:`taps_kernels.reference.int8_linear_reference` (same arithmetic). Inference only: no backward.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch import nn

from ..backend import int8_linear_backend, int8_reduce_range
from ..reference.linear import int8_linear_reference, quantize_int8_rows_reference


def check_linear_args(weight, bias) -> None:
    """The checks of a quantised linear layer's constructor: ``weight [N, K]`` float, ``bias [N]`` or None."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a 2-D float tensor [N, K], received "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias: expected shape ({weight.shape[0]},), received {tuple(bias.shape)}")


class Int8Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` rounded to int8 per output row and ``x`` to uint8 per call.

    Args:
        weight: ``[N, K]`` float (any float dtype; quantised once here).
        bias: ``[N]`` or None (kept in float32).
    Forward: ``x [..., K]`` float -> ``[..., N]`` in ``x``'s dtype (computed in float32).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        check_linear_args(weight, bias)
        qweight, scale = quantize_int8_rows_reference(weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.reduce_range = int8_reduce_range()
        self._packed = None  # fbgemm's packed copy, made on first use on a CPU

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> "Int8Linear":
        return cls(layer.weight, layer.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def _fbgemm_weight(self):
        if self._packed is None:
            with warnings.catch_warnings():  # torch marks quantised tensors deprecated; the GEMM is what we use
                warnings.simplefilter("ignore")
                q = torch._make_per_channel_quantized_tensor(
                    self.qweight, self.weight_scale.double(), torch.zeros(self.out_features, dtype=torch.long), 0)
                self._packed = torch.ops.quantized.linear_prepack(q, self.bias)
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features or not x.is_floating_point():
            raise ValueError(f"x: expected a float tensor [..., {self.in_features}], received {x.dtype} "
                             f"{tuple(x.shape)}")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("Int8Linear is inference only (no backward); call it under torch.no_grad()")
        rows = x.reshape(math.prod(x.shape[:-1]), self.in_features).float().contiguous()
        if int8_linear_backend(x.device)[0] == "fbgemm" and rows.shape[0] > 0:
            y = torch.ops.quantized.linear_dynamic(rows, self._fbgemm_weight(), self.reduce_range)
        else:
            y = int8_linear_reference(rows, self.qweight, self.weight_scale, self.bias, self.reduce_range)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
