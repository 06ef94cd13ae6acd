"""Cost-aware DDTree: the throughput rule of ``taps`` on the drafter's marginal products.

The DDTree pool of ``N`` nodes holds the top-``N`` prefixes by marginal product ``q(u)``; the policy keeps
its top ``n*`` by the same throughput rule as ``taps`` (:class:`.gate.GatedPolicy`), from the same measured
latency table (:mod:`taps.decode.latency`), with the same overhead accounting and the same draft gating. The marginal product underestimates acceptance (METHOD.md section 3), so this
baseline tends to pick small trees and to gate more often.
"""
from __future__ import annotations

from typing import Optional


import taps_kernels

from ..latency import get_table
from .base import IN_ROUND, NO_TIMER, parse_budget, register_policy
from .gate import GatedPolicy
from .taps import DEFAULT_CAP


class CostAwareDDTreePolicy(GatedPolicy):
    """``ddtree-cost[:N]``: throughput-optimal prefix of the DDTree of budget ``N`` (default 64) per row, sizes
    decided jointly for the batch, with the same draft gating as ``taps`` on the marginal products' expected
    tokens (``gate=False``: none)."""

    handles_draft_vocab = True

    def __init__(self, max_nodes: int = DEFAULT_CAP, latency: Optional[dict] = None, gate: bool = True):
        super().__init__(gate=gate)
        self.max_nodes = max_nodes
        self.latency = latency

    def bind(self, target_model, drafter, device) -> None:
        if self.latency is None:
            self.latency = get_table(target_model, drafter, n_max=self.max_nodes)
        self._bind_throughput(self.latency, self.max_nodes)

    def build(self, draft_logits, draft_hidden, bonus, depth_cap=None, timer=None, rows=None):
        if self._latency is None:
            raise RuntimeError(f"policy {self.name}: bind() was not called (the decoder calls it)")
        timer = timer or NO_TIMER
        with timer("pool"):
            pool = taps_kernels.candidate_pool(draft_logits.float(), bonus.long(), validate=IN_ROUND,
                                               vocab_ids=self.vocab_ids,
                                               top_k=min(self.max_nodes, draft_logits.shape[-1]),
                                               pool_size=self.max_nodes)
        with timer("selection"):
            return self._throughput_build(pool.tree, pool.logq, depth_cap, rows)


@register_policy("ddtree-cost", "cost-aware DDTree: throughput rule on marginal products, draft gating; "
                                 "N caps nodes per row (default 64)", params="[N]")
def _make(arg):
    return CostAwareDDTreePolicy(parse_budget("ddtree-cost", arg, DEFAULT_CAP))


@register_policy("ddtree-cost-nogate", "cost-aware DDTree without draft gating (ablation); N caps nodes",
                 params="[N]")
def _make_nogate(arg):
    return CostAwareDDTreePolicy(parse_budget("ddtree-cost-nogate", arg, DEFAULT_CAP), gate=False)
