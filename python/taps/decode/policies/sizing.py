"""Size rules: which nodes of a proposal (a pool tree and its log reach) a policy verifies.

Every rule takes ``(tree [B, N], log_reach [B, N], depth_cap [B] or None, rows)`` and returns the
:class:`taps_kernels.Selection` it made with the :class:`~.base.BuiltTree` to verify:

* :class:`ThroughputSize`: the batch-joint long-run rule from the measured latency table (the shipped one);
  its trees carry expected tokens and sizes, which the draft gate reads.
* :class:`TopReach`: exactly the top ``max_nodes`` nodes by reach (equal-budget comparisons).
* :class:`UtilitySize`: the published utility rule ``u(v) = r(v) / (lambda_node + lambda_depth * depth)``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

import taps_kernels
from taps_kernels import Selection, Tree

from ..latency import LatencyTable
from ..tree_ops import IN_ROUND, depth_mask, truncate_depth
from .base import BuiltTree
from .gate import OverheadTracker

LAMBDA_NODE = 1.0
LAMBDA_DEPTH = 0.002
DEFAULT_MIN_UTILITY = 0.01


class ThroughputSize:
    """The throughput rule's tree sizes, decided jointly for the batch (:class:`taps_kernels.ThroughputRule`).

    **One row.** Long-run tokens per second, not each round's own ratio, is what a decode maximises. When a
    tree is chosen the drafter pass is already paid, so (renewal-reward argument) node ``i`` of the
    reach-ordered list is worth verifying when its reach exceeds the tokens the policy could otherwise produce
    in the time it adds: ``n* = argmax_n sum_{i<=n} r_(i) - rho * (latency[n] - latency[0])``. ``rho`` is the
    plain-round rate ``1 / latency[0]`` (such a round leaves the drafter's context update to the next drafted
    one): the long-run rate these CPUs reach is within ~10% of it, and the choice barely moves over that range
    (trace replay: +1.1% tokens/s for TAPS over the per-round ratio ``(1 + sum r) / (t0 + latency[n])`` of
    METHOD.md, same within 0.1% for rho from 0.9 to 1.2 plain rates). The top-``n`` nodes by reach are prefix-closed
    (reach never grows along a path); ``n* = 0`` verifies the root alone.

    **A batch of R rows.** The candidate nodes of all rows (each row's best ``max_nodes`` by reach, nodes below
    its depth cap excluded) in order of reach, each kept while its expected tokens pay for the verify time it
    adds at the batch's total node count: ``k* = argmax_k sum_{i<=k} r_(i) - R * (T_R[k] - T_R[0]) /
    t_plain_R``, ``T_R[k]`` the measured time to verify R roots plus k nodes in total and ``R / t_plain_R`` the
    batch's plain-round rate. Row b's tree is its best ``n_b`` nodes, ``n_b`` = its nodes among the first
    ``k*``. A row whose proposal is poor gets few nodes; a batch on a GPU (flat ``T_R``) gets large trees.

    **Rate of a drafted round** (what the draft gate records, :meth:`rate_ratio`): the batch's expected rate
    ``sum_b E_b / (t0 + overhead + T_R[sum n_b])`` over the plain round's ``R / t_plain_R``; ``t0`` the fixed
    round time, overhead the policy's own measured pool/score/select time (:attr:`overhead`).

    Args:
        max_nodes: node cap per row (non-root nodes; the trees have ``max_nodes + 1`` columns).
        latency: latency table record (``{"latency": [...], "t0": s, ...}``) or :class:`LatencyTable`; None:
            the policy measures or loads the cached one for its target in ``bind``.
    """

    #: the stages whose seconds count as the policy's own overhead (added to ``t0``)
    OWN_STAGES = ("pool", "scoring", "selection")

    def __init__(self, max_nodes: int, latency=None):
        self.max_nodes = int(max_nodes)
        self.latency = latency
        self.table: Optional[LatencyTable] = None
        self.t0 = 0.0
        self.overhead = OverheadTracker()
        self._tables = {}

    @property
    def bound(self) -> bool:
        return self.table is not None

    def bind(self, latency, draft_positions: Optional[int] = None) -> None:
        """Keep the latency table and the fixed round time of a draft projecting ``draft_positions`` block
        positions (None: the table's full ``t0``)."""
        self.latency = latency
        self.table = LatencyTable.of(latency)
        self._tables = {}
        self.set_draft_positions(draft_positions)

    def set_draft_positions(self, positions: Optional[int]) -> None:
        """The fixed round time ``t0`` of a draft projecting ``positions`` block positions (None: all)."""
        self.t0 = self.table.round_seconds(positions)

    def batch_table(self, rows: int, device=None) -> torch.Tensor:
        """The ``rows``-row table as a float64 tensor on ``device`` (default CPU), built once per device."""
        key = (rows, str(torch.device(device)) if device is not None else "cpu")
        if key not in self._tables:
            self._tables[key] = torch.tensor(self.host_table(rows), dtype=torch.float64, device=device or "cpu")
        return self._tables[key]

    def host_table(self, rows: int) -> list:
        """The same table as Python floats: host-side arithmetic never reads a tensor."""
        if (rows, "host") not in self._tables:
            self._tables[(rows, "host")] = self.table.batch_seconds(rows, rows * self.max_nodes)
        return self._tables[(rows, "host")]

    def plain_seconds(self, rows: int = 1) -> float:
        return self.table.plain_round_seconds(rows)

    def select(self, tree: Tree, log_reach: torch.Tensor, depth_cap: Optional[torch.Tensor],
               rows: Optional[int] = None) -> Tuple[Selection, BuiltTree]:
        """The joint rule over ``tree [B, N]`` and its ``log_reach [B, N]`` (non-increasing along paths, as pool
        log-masses and scorer reach are); depth-capped nodes are never kept. ``rows``: running rows (default
        B; rows with depth cap 0 claim no nodes)."""
        rows = tree.batch_size if rows is None else rows
        e = log_reach.float().masked_fill(~depth_mask(tree, depth_cap), float("-inf"))
        rule = taps_kernels.ThroughputRule(self.batch_table(rows, e.device), self.plain_seconds(rows), rows)
        sel = taps_kernels.select_subtree(tree, e, self.max_nodes, rule=rule, validate=IN_ROUND)
        return sel, BuiltTree(sel.tree, sel.expected, sel.num_selected.long())

    def rate_ratio(self, expected, sizes, undrafted=None) -> float:
        """A drafted round's expected tokens per second (host floats of the round's read) over the best rate of a
        round without the drafter (:meth:`undrafted_rate`)."""
        rows = len(expected)
        table = self.host_table(rows)
        k = min(int(sum(sizes)), len(table) - 1)
        rate = sum(expected) / (self.t0 + self.overhead.get() + table[k])
        return rate / self.undrafted_rate(rows, undrafted)

    def undrafted_rate(self, rows: int, undrafted=None) -> float:
        """Expected tokens per second of ``rows`` rows in a round without the drafter: the plain round's ``rows /
        t_plain``, or, with ``undrafted`` (per row, the reach of the nodes such a round proposes: the lookup
        chain), the best over the first k of all those nodes by reach, ``(rows + sum r) / (t_plain + T[k] -
        T[0])``. Without it a policy that also looks up would weigh its drafted rounds against plain ones, which
        its lookup rounds beat: the gate would keep drafting where the chain alone is faster."""
        table = self.host_table(rows)
        plain = self.plain_seconds(rows)
        total = float(rows)
        best = total / plain
        reach = sorted((r for row in undrafted or () for r in row), reverse=True)
        for k, r in enumerate(reach[:len(table) - 1], 1):
            total += r
            best = max(best, total / (plain + table[k] - table[0]))
        return best

    def observe_times(self, times) -> None:
        self.overhead.update(sum(times.get(k, 0.0) for k in self.OWN_STAGES))


class TopReach:
    """Exactly the top ``max_nodes`` nodes by reach (prefix-closed), no latency table; cut at the depth caps."""

    latency = None
    bound = False

    def __init__(self, max_nodes: int):
        self.max_nodes = int(max_nodes)

    def _select(self, tree: Tree, log_reach: torch.Tensor) -> Selection:
        return taps_kernels.select_subtree(tree, log_reach, self.max_nodes, validate=IN_ROUND)

    def select(self, tree: Tree, log_reach: torch.Tensor, depth_cap: Optional[torch.Tensor],
               rows: Optional[int] = None) -> Tuple[Selection, BuiltTree]:
        sel = self._select(tree, log_reach)
        return sel, BuiltTree(sel.tree if depth_cap is None else truncate_depth(sel.tree, depth_cap))


class UtilitySize(TopReach):
    """The published utility rule (lambda 1.0 / 0.002): nodes in utility order with their ancestors until
    ``max_nodes``, stopping at the first node with utility below ``min_utility``; cut at the depth caps."""

    def __init__(self, max_nodes: int, min_utility: float = DEFAULT_MIN_UTILITY):
        super().__init__(max_nodes)
        self.min_utility = min_utility

    def _select(self, tree: Tree, log_reach: torch.Tensor) -> Selection:
        rule = taps_kernels.UtilityRule(LAMBDA_NODE, LAMBDA_DEPTH, self.min_utility)
        return taps_kernels.select_subtree(tree, log_reach, self.max_nodes, rule=rule, validate=IN_ROUND)
