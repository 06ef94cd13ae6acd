"""Draft gating: skip the drafter in rounds where speculation is predicted to lose to plain decoding.

The throughput rule sizes each tree for expected tokens per second, but the drafter pass and the pool
are paid before any tree exists: when even the best tree's expected rate is below one token per plain
(root-only) round, the round would have been faster without drafting at all. Acceptance is strongly
autocorrelated (boilerplate code drafts well for many rounds, free prose drafts badly), so recent drafted
rounds predict the next one. When the running mean of their log rate ratio (below) turns negative, the
next ``skip`` rounds verify the root alone (what autoregressive decoding does; the drafter still reads
their target features, so its context stays complete), then one round drafts again as a probe. ``skip``
doubles after each losing probe up to ``max_skip`` and falls back to 1 once the mean is back above zero
(exponential backoff).

A drafted round's rate ratio is ``E / (t0 + overhead + latency[n])`` over ``1 / (latency[0] + t_context)``,
``E = 1 + sum of the reach of its n verified nodes`` (a learned, calibrated reach for ``taps``; the
drafter's marginal product for ``ddtree-cost``, which underestimates acceptance and so gates more often),
costs from the same measured latency table the throughput rule uses (:mod:`taps.scoring.latency`).

Losslessness is untouched: a skipped round is a root-only tree, verified like any other.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .base import TreePolicy

#: Longest run of plain rounds between two probes.
DEFAULT_MAX_SKIP = 16
#: Weight of the newest drafted round in the gate's running estimate.
DEFAULT_SMOOTHING = 0.5


class DraftGate:
    """Backoff schedule of one generation: :meth:`wants_draft` before a round, :meth:`record` after a drafted one.

    Args:
        max_skip: longest run of plain rounds between probes (``>= 1``).
        smoothing: weight of the newest drafted round in the running mean of ``log(rate ratio)``; one
            round's expectation is noisy, and near break-even a single verdict would flip the gate.
    """

    def __init__(self, max_skip: int = DEFAULT_MAX_SKIP, smoothing: float = DEFAULT_SMOOTHING):
        if max_skip < 1:
            raise ValueError(f"max_skip: expected >= 1, received {max_skip}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing: expected a weight in (0, 1], received {smoothing}")
        self.max_skip = int(max_skip)
        self.smoothing = float(smoothing)
        self.reset()

    def reset(self) -> None:
        """Forget everything (a new generation starts drafting, from a neutral estimate)."""
        self.skip_left = 0
        self.backoff = 1
        self.log_ratio = 0.0

    def wants_draft(self) -> bool:
        """Whether the coming round should run the drafter (consumes one skipped round when it says no)."""
        if self.skip_left > 0:
            self.skip_left -= 1
            return False
        return True

    def record(self, rate_ratio: float) -> None:
        """A drafted round's expected tokens per second over a plain round's (``> 0``; 1 is break-even)."""
        self.log_ratio += self.smoothing * (math.log(max(rate_ratio, 1e-9)) - self.log_ratio)
        if self.log_ratio >= 0.0:
            self.backoff = 1
        else:
            self.skip_left = self.backoff
            self.backoff = min(2 * self.backoff, self.max_skip)


class GatedPolicy(TreePolicy):
    """Base of the throughput-rule policies: a :class:`DraftGate` fed from their latency table.

    Subclasses keep the throughput rule's table in ``self._table`` (seconds for root + n nodes, n up to
    their cap), call :meth:`_bind_gate` from ``bind`` and :meth:`_judge` from ``build`` with the tree they
    chose; ``gate=False`` drafts every round.
    """

    _table: Optional[torch.Tensor] = None

    def __init__(self, gate: bool = True):
        self.use_gate = bool(gate)
        self.gate: Optional[DraftGate] = None
        self._plain_s = 0.0

    def _bind_gate(self, latency: dict) -> None:
        if not self.use_gate:
            return
        self.gate = DraftGate()
        self._plain_s = float(latency["latency"][0]) + float(latency.get("t0_parts", {}).get("context", 0.0))

    def _judge(self, selection, log_reach: torch.Tensor, t0: float) -> None:
        """Record the selected tree's expected rate over a plain round's (``t0``: this round's fixed seconds)."""
        if self.gate is None:
            return
        n = int(selection.num_selected[0])
        kept = selection.pool_index[0, 1:1 + n]
        expected = 1.0 + float(log_reach[0, kept].exp().sum())
        seconds = t0 + float(self._table[n])
        self.gate.record(expected * self._plain_s / seconds)

    def reset(self) -> None:
        if self.gate is not None:
            self.gate.reset()

    def wants_draft(self) -> bool:
        return self.gate is None or self.gate.wants_draft()
