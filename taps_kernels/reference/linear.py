"""Reference of :func:`taps_kernels.rows_linear`: torch's own linear layer (BLAS)."""
from __future__ import annotations

from typing import Optional

import torch


def rows_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M,K], weight [N,K], bias [N] or None`` (float32) -> ``x @ weight.T + bias`` ``[M,N]``."""
    return torch.nn.functional.linear(x, weight, bias)
