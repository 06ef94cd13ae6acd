"""Route a model's ``nn.Linear`` layers through :func:`taps_kernels.rows_linear` (few-row CPU kernel).

On CPU, an AR step multiplies every weight by 1 row and a tree verify by a few; BLAS sgemm costs about
twice its 1-row cost from 2 rows on (``taps_kernels.backend.rows_linear_backend`` has the numbers), so a
SmolLM2 verify forward of 4-8 nodes cost ~1.4-1.5x an AR step on this CPU although both stream the same
weights; with the kernel ~1.1x.
:func:`use_rows_linear` swaps the class of every eligible ``nn.Linear`` in place (weights shared, nothing
copied); each call then picks the kernel from its row count: the C++ kernel for 1..32 float32 rows,
torch's linear otherwise (prefill, GPUs, other dtypes). Outputs equal torch's to float32 rounding.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.linear import rows_linear


class RowsLinear(nn.Linear):
    """``nn.Linear`` whose forward runs the few-row kernel where it is faster (same parameters, same outputs).

    The C++ kernel has no backward: calls that need gradients, other dtypes, GPUs and more than
    ``ROWS_LINEAR_MAX_ROWS`` rows run torch's linear.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        bf16_weight = self.weight.dtype == torch.bfloat16 and x.dtype == torch.float32  # see store_bf16_if_exact
        if needs_grad or (x.dtype != self.weight.dtype and not bf16_weight):
            return super().forward(x)
        return rows_linear(x, self.weight, self.bias)  # picks the kernel or torch's linear per call


def store_bf16_if_exact(layer: nn.Linear) -> bool:
    """Keep a float32 layer's weight as bfloat16 when that loses nothing (every value a bfloat16, as in a
    checkpoint saved in bfloat16): :func:`taps_kernels.rows_linear` widens it exactly, so the outputs stay the same
    bits and half the bytes are streamed per call. The layer must be a :class:`RowsLinear` fed float32. Returns
    whether it was converted."""
    w = layer.weight.data
    if type(layer) is not RowsLinear or w.dtype != torch.float32 or not torch.equal(w.bfloat16().float(), w):
        return False
    layer.weight.data = w.bfloat16()
    return True


def use_rows_linear(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` to :class:`RowsLinear` in place; returns how many.

    Subclasses of ``nn.Linear`` (quantised or LoRA layers with their own forward) are left alone;
    :func:`restore_linear` undoes the swap.
    """
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = RowsLinear
            n += 1
    return n


def restore_linear(model: nn.Module) -> int:
    """Undo :func:`use_rows_linear`; returns how many layers were restored."""
    n = 0
    for mod in model.modules():
        if type(mod) is RowsLinear:
            mod.__class__ = nn.Linear
            n += 1
    return n
