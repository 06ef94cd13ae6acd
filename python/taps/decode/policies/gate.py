"""The throughput rule's tree size (:class:`GatedPolicy`) and draft gating: skip the drafter in rounds
where speculation is predicted to lose to plain decoding.

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

import taps_kernels
from taps_kernels import Tree

from .base import TreePolicy, root_only_tree

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


def plain_round_seconds(latency: dict) -> float:
    """Seconds of a plain (root-only, undrafted) round: the 1-node verify plus the drafter's context update."""
    return float(latency["latency"][0]) + float(latency.get("t0_parts", {}).get("context", 0.0))


def throughput_size(log_reach: torch.Tensor, latency: torch.Tensor, plain_s: float):
    """The throughput rule's tree size per row (definition and why: :class:`GatedPolicy`).

    Args:
        log_reach: ``[B, N]`` log reach, root first, padding ``-inf``.
        latency: ``[L]`` float64 seconds to verify root + n nodes; ``n* <= min(L - 1, N - 1)``.
        plain_s: seconds of a plain (root-only, undrafted) round.
    Returns:
        ``(n_star [B] int64, top [B, cap] float64)``: the size, and the reaches in descending order.
    """
    reach = log_reach[:, 1:].double()
    cap = min(latency.numel() - 1, reach.shape[1])
    top = reach.topk(cap, dim=1).values.exp()  # padding rows are -inf: reach 0, never worth a node
    gain = torch.cat([top.new_zeros(top.shape[0], 1), top.cumsum(1)], 1) - (latency[:cap + 1] - latency[0]) / plain_s
    return gain.argmax(1), top  # first maximum: the smaller tree on ties


class GatedPolicy(TreePolicy):
    """Base of the throughput-rule policies: tree size from the latency table, and a :class:`DraftGate`.

    **Size.** Long-run tokens per second, not each round's own ratio, is what a decode maximises. When a
    tree is chosen the drafter pass is already paid, so (renewal-reward argument) node ``i`` of the
    reach-ordered list is worth verifying when its reach exceeds the tokens the policy could otherwise
    produce in the time it adds: ``n* = argmax_n sum_{i<=n} r_(i) - rho * (latency[n] - latency[0])``.
    ``rho`` is the plain-round rate ``1 / (latency[0] + t_context)``: the long-run rate these CPUs reach is
    within ~10% of it, and the choice barely moves over that range (trace replay: +1.1% tokens/s for TAPS
    over the per-round ratio ``(1 + sum r) / (t0 + latency[n])`` of METHOD.md, same within 0.1% for
    rho from 0.9 to 1.2 plain rates). The top-``n`` nodes by reach are prefix-closed (reach never grows
    along a path), so the tree is :func:`taps_kernels.select_subtree`'s top-``n*``; ``n* = 0`` verifies the
    root alone.

    **Gate.** Each drafted round records its expected rate (``1 + sum r`` over ``t0 + latency[n*]``, ``t0``
    the fixed round time plus the policy's own overhead) over a plain round's; ``gate=False`` drafts every
    round.

    Subclasses call :meth:`_bind_throughput` from ``bind`` and :meth:`_throughput_tree` from ``build``.
    """

    def __init__(self, gate: bool = True):
        self.use_gate = bool(gate)
        self.gate: Optional[DraftGate] = None
        self._table: Optional[torch.Tensor] = None
        self._t0 = 0.0
        self._plain_s = 0.0

    def _bind_throughput(self, latency: dict, max_nodes: int) -> None:
        """Keep the table (seconds for root + n nodes, ``n <= max_nodes``), the fixed and the plain-round time."""
        self._table = torch.tensor(latency["latency"][: max_nodes + 1], dtype=torch.float64)
        self._t0 = float(latency.get("t0", 0.0))
        self._plain_s = plain_round_seconds(latency)
        self.gate = DraftGate() if self.use_gate else None

    def _throughput_tree(self, tree: Tree, log_reach: torch.Tensor, overhead_s: float) -> Tree:
        """The size-``n*`` prefix of ``tree`` (``[1, N]`` pool) by ``log_reach [1, N]``; feeds the gate."""
        sizes, top = throughput_size(log_reach, self._table, self._plain_s)
        n = int(sizes[0])
        if self.gate is not None:
            expected = 1.0 + float(top[0, :n].sum())
            self.gate.record(expected * self._plain_s / (self._t0 + overhead_s + float(self._table[n])))
        if n == 0:
            return root_only_tree(tree.tokens[:, 0])
        return taps_kernels.select_subtree(tree, log_reach, n, rule="reach").tree

    def reset(self) -> None:
        if self.gate is not None:
            self.gate.reset()

    def wants_draft(self) -> bool:
        return self.gate is None or self.gate.wants_draft()
