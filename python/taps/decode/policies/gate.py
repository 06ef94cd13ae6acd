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
costs from the same measured latency table the throughput rule uses (:mod:`taps.decode.latency`).

Losslessness is untouched: a skipped round is a root-only tree, verified like any other.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

import taps_kernels
from taps_kernels import Selection, Tree

from ..latency import LatencyTable
from ..tree_ops import IN_ROUND, depth_mask
from .base import BuiltTree, TreePolicy

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


class GatedPolicy(TreePolicy):
    """Base of the throughput-rule policies: tree sizes from the latency table, and a :class:`DraftGate`.

    **Size (one row).** Long-run tokens per second, not each round's own ratio, is what a decode maximises.
    When a tree is chosen the drafter pass is already paid, so (renewal-reward argument) node ``i`` of the
    reach-ordered list is worth verifying when its reach exceeds the tokens the policy could otherwise
    produce in the time it adds: ``n* = argmax_n sum_{i<=n} r_(i) - rho * (latency[n] - latency[0])``.
    ``rho`` is the plain-round rate ``1 / (latency[0] + t_context)``: the long-run rate these CPUs reach is
    within ~10% of it, and the choice barely moves over that range (trace replay: +1.1% tokens/s for TAPS
    over the per-round ratio ``(1 + sum r) / (t0 + latency[n])`` of METHOD.md, same within 0.1% for
    rho from 0.9 to 1.2 plain rates). The top-``n`` nodes by reach are prefix-closed (reach never grows
    along a path), so the tree is :func:`taps_kernels.select_subtree`'s top-``n*``; ``n* = 0`` verifies the
    root alone.

    **Size (a batch of R rows, decided jointly).** Take the candidate nodes of all rows (each row's best
    ``max_nodes`` by reach, nodes below its depth cap excluded) in order of reach, and keep each while its
    expected tokens pay for the verify time it adds at the batch's total node count:
    ``k* = argmax_k sum_{i<=k} r_(i) - R * (T_R[k] - T_R[0]) / t_plain_R``, where ``T_R[k]`` is the measured
    time to verify R roots plus k nodes in total (:func:`batch_table`) and ``R / t_plain_R`` the batch's
    plain-round rate (the library's :class:`taps_kernels.ThroughputRule`, through
    :func:`taps_kernels.select_subtree`). Row b's tree is its best ``n_b`` nodes, ``n_b`` = its nodes among the first ``k*``
    (a prefix of its own list, hence prefix-closed). R = 1 is the one-row rule. A row whose draft is poor
    gets few nodes; a batch on a GPU (flat ``T_R``) gets large trees in every row.

    **Gate (the batch).** After each drafted round the loop reads back each row's expected tokens
    (``1 + sum r``) and size; :meth:`observe` records the batch's expected rate ``sum_b E_b / (t0 + overhead
    + T_R[sum n_b])`` over the plain round's ``R / t_plain_R`` (``t0`` the fixed round time, overhead this
    policy's own measured pool/score/select time); the gate then decides for the whole batch whether the
    next rounds draft. ``gate=False`` drafts every round.

    Subclasses call :meth:`_bind_throughput` from ``bind`` and :meth:`_throughput_build` from ``build``.
    """

    def __init__(self, gate: bool = True):
        self.use_gate = bool(gate)
        self.gate: Optional[DraftGate] = None
        self._latency: Optional[LatencyTable] = None
        self._tables = {}
        self._t0 = 0.0
        self._max_nodes = 0
        self.overhead = OverheadTracker()

    @property
    def _table(self) -> Optional[torch.Tensor]:
        """The one-row table (seconds for root + n nodes, ``n <= max_nodes``)."""
        return None if self._latency is None else self._batch_table(1)

    def _bind_throughput(self, latency: dict, max_nodes: int, draft_positions: Optional[int] = None) -> None:
        """Keep the latency table, the fixed round time (a draft projecting ``draft_positions`` block positions,
        default all) and the node cap; make the gate."""
        self._latency = LatencyTable.of(latency)
        self._tables = {}
        self._t0 = self._latency.round_seconds(draft_positions)
        self._max_nodes = int(max_nodes)
        self.gate = DraftGate() if self.use_gate else None

    def _batch_table(self, rows: int, device=None) -> torch.Tensor:
        """The ``rows``-row table as a float64 tensor on ``device`` (default CPU), built once per device."""
        key = (rows, str(torch.device(device)) if device is not None else "cpu")
        if key not in self._tables:
            self._tables[key] = torch.tensor(self._host_table(rows), dtype=torch.float64, device=device or "cpu")
        return self._tables[key]

    def _host_table(self, rows: int) -> list:
        """The same table as Python floats: host-side arithmetic never reads a tensor."""
        if (rows, "host") not in self._tables:
            self._tables[(rows, "host")] = self._latency.batch_seconds(rows, rows * self._max_nodes)
        return self._tables[(rows, "host")]

    def _plain_s(self, rows: int = 1) -> float:
        return self._latency.plain_round_seconds(rows)

    def _throughput_build(self, tree: Tree, log_reach: torch.Tensor, depth_cap: Optional[torch.Tensor],
                          rows: Optional[int] = None) -> BuiltTree:
        """Trees of the joint rule from a pool ``tree [B, N]`` and its ``log_reach [B, N]`` (non-increasing along
        paths, as pool log-masses and scorer reach are): :func:`taps_kernels.select_subtree` with
        :class:`taps_kernels.ThroughputRule` over the nodes within each row's depth cap; ``max_nodes + 1`` columns.
        ``rows``: running rows (default B; rows with depth cap 0 claim no nodes)."""
        sel = self._throughput_select(tree, log_reach, depth_cap, rows)
        return BuiltTree(sel.tree, sel.expected, sel.num_selected.long())

    def _throughput_select(self, tree: Tree, log_reach: torch.Tensor, depth_cap: Optional[torch.Tensor],
                           rows: Optional[int] = None) -> Selection:
        """The joint rule's :class:`taps_kernels.Selection` (``expected`` set); depth-capped nodes are never kept."""
        rows = tree.batch_size if rows is None else rows
        e = log_reach.float().masked_fill(~depth_mask(tree, depth_cap), float("-inf"))
        rule = taps_kernels.ThroughputRule(self._batch_table(rows, e.device), self._plain_s(rows), rows)
        return taps_kernels.select_subtree(tree, e, self._max_nodes, rule=rule, validate=IN_ROUND)

    def observe(self, expected, sizes, times) -> None:
        if self._latency is None:
            return
        own = sum(times.get(k, 0.0) for k in ("pool", "scoring", "selection"))
        if self.gate is not None and expected is not None and sizes is not None and expected:
            rows = len(expected)
            table = self._host_table(rows)
            k = min(int(sum(sizes)), len(table) - 1)
            rate = sum(expected) / (self._t0 + self.overhead.get() + table[k])
            self.gate.record(rate * self._plain_s(rows) / rows)
        self.overhead.update(own)

    def reset(self) -> None:
        if self.gate is not None:
            self.gate.reset()

    def wants_draft(self) -> bool:
        return self.gate is None or self.gate.wants_draft()


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
