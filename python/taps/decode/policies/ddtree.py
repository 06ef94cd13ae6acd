"""DDTree: the ``B`` highest-mass prefixes of the drafter's factorised distribution (METHOD.md section 3)."""
from __future__ import annotations

import taps_kernels

from .base import Stopwatch, TreePolicy, parse_budget, register_policy


class DDTreePolicy(TreePolicy):
    """Best-first candidate pool with ``pool_size = budget``: the pool IS the DDTree tree of that budget.

    Only the top-``min(budget, V)`` tokens of a position can enter a tree of ``budget`` nodes, so that is
    the top-K used.
    """

    def __init__(self, budget: int):
        self.budget = budget

    def build(self, draft_logits, draft_hidden, bonus):
        sw = Stopwatch()
        with sw("pool"):
            pool = taps_kernels.candidate_pool(draft_logits.float(), bonus.view(1).long(),
                                               top_k=min(self.budget, draft_logits.shape[-1]),
                                               pool_size=self.budget)
        return pool.tree, sw.times


@register_policy("ddtree", "DDTree of budget B non-root nodes, e.g. ddtree:16")
def _make(arg):
    return DDTreePolicy(parse_budget("ddtree", arg))
