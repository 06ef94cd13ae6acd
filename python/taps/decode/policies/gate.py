"""Draft gating: skip the drafter in rounds where drafting is predicted to lose to decoding without it.

The throughput rule sizes each tree for expected tokens per second, but the drafter pass and the pool
are paid before any tree exists: when even the best tree's expected rate is below one token per plain
(root-only) round, the round would have been faster without drafting at all. Acceptance is strongly
autocorrelated (boilerplate code drafts well for many rounds, free prose drafts badly), so recent drafted
rounds predict the next one. When the running mean of their log rate ratio (below) turns negative, the
next ``skip`` rounds run without the drafter (the root alone, as autoregressive decoding does, or the lookup
chain of a policy that has one; the drafter keeps their target features and projects them when it next drafts,
so its context stays complete), then one round drafts again as a probe. ``skip`` doubles after each losing probe
up to ``max_skip`` and falls back to 1 once the mean is back above zero (exponential backoff). The mean and the
backoff carry over from one generation of a decoder to the next (:meth:`DraftGate.restart`), as they do between
the requests of a continuously batched decoder: whether drafting pays is a property of the workload and the
machine's costs as much as of one text.

A drafted round's rate ratio is ``E / (t0 + overhead + latency[n])`` over the best rate without the drafter: a
plain round's ``1 / latency[0]`` (the context update of the rounds between drafts is paid in ``t0``), or, for a
policy that also looks up, the best lookup round the chain's measured acceptance predicts
(:meth:`.sizing.ThroughputSize.undrafted_rate`), ``E = 1 + sum of the reach of its n verified nodes`` (a learned,
calibrated reach for ``taps``; the drafter's marginal product for ``ddtree-cost``, which underestimates acceptance
and so gates more often), costs from the same measured latency table the throughput rule uses
(:mod:`taps.decode.latency`; :meth:`.sizing.ThroughputSize.rate_ratio`). A :class:`.composed.ComposedPolicy` with
the throughput rule holds one :class:`DraftGate` for the whole batch.

Losslessness is untouched: a skipped round's tree (the root, or the root and its chain) is verified like any
other.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from ..latency import LatencyTable

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
        """Forget everything: a neutral estimate, the next round drafts."""
        self.skip_left = 0
        self.backoff = 1
        self.log_ratio = 0.0

    def restart(self) -> None:
        """A new generation: its first round drafts (a probe), the running estimate and the backoff carry over.
        From a neutral start every generation probed at its rounds 1, 3, 6, 11, 20 even where drafting kept
        losing: on MT-Bench (48-token turns, the Zen 4 of the README) `taps` drafted 24% of rounds, carried 16%
        (0.953x -> 0.967x AR), `taps-lookup` 24% -> 13% (1.161x -> 1.166x); HumanEval, where drafting wins,
        unchanged."""
        self.skip_left = 0

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


def plain_round_seconds(latency, rows: int = 1) -> float:
    """:meth:`taps.decode.latency.LatencyTable.plain_round_seconds` of a table (or its record dict)."""
    return LatencyTable.of(latency).plain_round_seconds(rows)


def batch_table(latency, rows: int, n_total: int) -> torch.Tensor:
    """:func:`batch_seconds` as a ``[n_total + 1] float64`` tensor."""
    return torch.tensor(batch_seconds(latency, rows, n_total), dtype=torch.float64)


def batch_seconds(latency, rows: int, n_total: int) -> List[float]:
    """``n_total + 1`` seconds (host floats) to verify ``rows`` roots plus ``n`` tree nodes in total: the
    table's cost at (rows, n) (:meth:`taps.decode.latency.LatencyTable.batch_seconds`: a measured ``rows``-row
    table, else the one-row table by total verified rows; past the end, the table's one extension rule)."""
    return LatencyTable.of(latency).batch_seconds(rows, n_total)


#: Weight of the newest round in the running mean of a policy's own overhead (added to ``t0``).
OVERHEAD_EMA = 0.2


class OverheadTracker:
    """Running mean of a policy's own per-round seconds (pool + scoring + selection)."""

    def __init__(self):
        self.value: Optional[float] = None

    def update(self, seconds: float) -> None:
        self.value = seconds if self.value is None else (1 - OVERHEAD_EMA) * self.value + OVERHEAD_EMA * seconds

    def get(self) -> float:
        return self.value or 0.0
