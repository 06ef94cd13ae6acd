"""Target-side token choice: greedy argmax, or a sample from the processed target distribution.

Speculative sampling here is the lossless walk of METHOD.md section 1: every
verified node gets one independent target sample; the acceptance walk moves to
the child carrying the sample and stops otherwise. Each emitted token is then a
genuine target draw given its real prefix, whatever tree was verified, as long
as the tree was chosen before the draws. The drafter's probabilities never
enter a rejection test (``min(1, p/q)`` on a deterministic top-K tree is biased).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` means greedy; ``top_k = 0`` and ``top_p = 1.0`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature: expected a value >= 0, received {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 disables it), received {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: expected a value in (0, 1], received {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution a sampled step draws from, in HF's order: temperature, then top-k, then top-p.

    Args:
        logits: ``[N, V]`` target logits (any float dtype).
    Returns:
        ``[N, V] float32`` probabilities (rows sum to 1; filtered tokens are exactly 0).
    top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one token).
    """
    x = logits.float() / cfg.temperature
    V = x.shape[-1]
    if 0 < cfg.top_k < V:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(p, dim=-1) - p
        drop_sorted = mass_before >= cfg.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def choose_tokens(logits: torch.Tensor, cfg: SamplingConfig, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One target token per row: argmax (greedy) or one independent sample per row.

    Args:
        logits: ``[N, V]`` target logits of N nodes (or positions).
        generator: RNG for sampling (CPU generator for CPU tensors).
    Returns:
        ``[N] int64``. Greedy ties go to the smallest token id (``torch.argmax``), as in HF ``generate``.
    """
    if cfg.greedy:
        return logits.argmax(dim=-1)
    probs = processed_probs(logits, cfg)
    return torch.multinomial(probs, 1, generator=generator).view(-1)
