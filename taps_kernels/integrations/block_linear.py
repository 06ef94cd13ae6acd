"""Linear layers over Q8_0 blocks for CPU inference: a float layer's weight quantised once per 32-block
(llama.cpp's Q8_0: fp16 scale + 32 int8) and multiplied through the GGUF block kernel
(``taps_kernels._C.gguf_linear``: VNNI, int8 activations per row and 32-block, rows independent).

Used for the drafter's layers and vocabulary head on CPUs where the block kernel runs: its draft logits only
propose tokens the target verifies, so the rounding changes at most a proposal, never a generated token.
Inference only: no backward.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..reference.gguf import Q8_0, quantize_q8_0_reference
from .int8_linear import check_linear_args


class BlockLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` in Q8_0 blocks.

    Args:
        weight: ``[N, K]`` float, ``K`` a multiple of 32 (quantised once here).
        bias: ``[N]`` or None (kept in float32).
    Forward: ``x [..., K]`` float -> ``[..., N]`` in ``x``'s dtype (computed in float32).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        from .. import _C

        check_linear_args(weight, bias)
        if weight.shape[1] % 32:
            raise ValueError(f"weight: expected a multiple of 32 input columns, received {weight.shape[1]}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", _C.gguf_pack(quantize_q8_0_reference(weight.cpu()), Q8_0, self.in_features))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> "BlockLinear":
        return cls(layer.weight, layer.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, Q8_0"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .. import _C

        if x.shape[-1] != self.in_features or not x.is_floating_point():
            raise ValueError(f"x: expected a float tensor [..., {self.in_features}], received {x.dtype} "
                             f"{tuple(x.shape)}")
        rows = x.reshape(math.prod(x.shape[:-1]), self.in_features).float().contiguous()
        y = _C.gguf_linear(rows, self.packed, Q8_0, self.out_features, self.in_features)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def use_block_linear(module: nn.Module, skip=()) -> int:
    """Replace every ``nn.Linear`` inside ``module`` (names in ``skip`` excepted) by a :class:`BlockLinear`;
    returns how many were replaced."""
    swapped = 0
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear) and child.in_features % 32 == 0:
            setattr(module, name, BlockLinear.from_linear(child))
            swapped += 1
        else:
            swapped += use_block_linear(child, skip)
    return swapped
