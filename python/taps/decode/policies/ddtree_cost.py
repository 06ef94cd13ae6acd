"""Cost-aware DDTree: the throughput rule of ``taps`` on the drafter's marginal products.

The DDTree pool of ``N`` nodes holds the top-``N`` prefixes by marginal product ``q(u)``; the policy keeps
its top ``n*`` by the same throughput rule as ``taps`` (:class:`.sizing.ThroughputSize`), from the same measured
latency table (:mod:`taps.decode.latency`), with the same overhead accounting and the same draft gating. The
marginal product underestimates acceptance (METHOD.md section 3), so this baseline tends to pick small trees
and to gate more often.
"""
from __future__ import annotations

from typing import Optional

from .base import parse_budget, register_policy
from .composed import ComposedPolicy
from .reach import MarginalReach
from .sizing import ThroughputSize
from .sources import DraftPool
from .taps import DEFAULT_CAP


def cost_aware_ddtree_policy(max_nodes: int = DEFAULT_CAP, latency: Optional[dict] = None,
                             gate: bool = True) -> ComposedPolicy:
    """``ddtree-cost[:N]``: throughput-optimal prefix of the DDTree of budget ``N`` (default 64) per row, sizes
    decided jointly for the batch, with the same draft gating as ``taps`` on the marginal products' expected
    tokens (``gate=False``: none). Only the top-``N`` tokens of a position can enter a pool of ``N`` nodes."""
    return ComposedPolicy(ThroughputSize(max_nodes, latency), draft=DraftPool(max_nodes, top_k=max_nodes),
                          reach=MarginalReach(), gate=gate)


@register_policy("ddtree-cost", "cost-aware DDTree: throughput rule on marginal products, draft gating; "
                                 "N caps nodes per row (default 64)", params="[N]")
def _make(arg):
    return cost_aware_ddtree_policy(parse_budget("ddtree-cost", arg, DEFAULT_CAP))


@register_policy("ddtree-cost-nogate", "cost-aware DDTree without draft gating (ablation); N caps nodes",
                 params="[N]")
def _make_nogate(arg):
    return cost_aware_ddtree_policy(parse_budget("ddtree-cost-nogate", arg, DEFAULT_CAP), gate=False)
