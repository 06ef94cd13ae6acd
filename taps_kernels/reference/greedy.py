"""Reference greedy tokens: the target's argmax over its vocabulary."""
from __future__ import annotations

import torch


def greedy_tokens_reference(logits: torch.Tensor) -> torch.Tensor:
    """``logits [R, V]`` float -> ``[R] int64``: the first index of each row's largest value (NaN largest)."""
    return logits.argmax(dim=-1)
