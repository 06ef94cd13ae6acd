"""DDTree: the ``B`` highest-mass prefixes of the drafter's factorised distribution (METHOD.md section 3)."""
from __future__ import annotations

import taps_kernels

from ..tree_ops import truncate_depth
from .base import IN_ROUND, NO_TIMER, BuiltTree, TreePolicy, parse_budget, register_policy

#: ``--policy ddtree`` without a budget: the node budget (non-root nodes) per row. 8 sits between the best
#: fixed budgets of the CPU benchmark (4 on HumanEval and MT-Bench, 8 within 4%:
#: bench/results/taps_bench_cpu_full.md) and what GPUs favour (the published runs peak at 256-512).
DEFAULT_BUDGET = 8


class DDTreePolicy(TreePolicy):
    """Best-first candidate pool with ``pool_size = budget`` per row: the pool IS the DDTree tree of that
    budget (``N = budget + 1`` columns), cut at each row's depth cap.

    Only the top-``min(budget, V)`` tokens of a position can enter a tree of ``budget`` nodes, so that is
    the top-K used.
    """

    handles_draft_vocab = True

    def __init__(self, budget: int = DEFAULT_BUDGET):
        self.budget = budget

    def draft_positions(self, num_positions: int) -> int:
        # a tree of ``budget`` non-root nodes is at most ``budget`` deep
        return min(self.budget, num_positions)

    def tree_width(self, draft_positions: int) -> int:
        return self.budget + 1

    def build(self, draft_logits, draft_hidden, bonus, depth_cap=None, timer=None, rows=None):
        timer = timer or NO_TIMER
        with timer("pool"):
            pool = taps_kernels.candidate_pool(draft_logits.float(), bonus.long(), validate=IN_ROUND,
                                               vocab_ids=self.vocab_ids,
                                               top_k=min(self.budget, draft_logits.shape[-1]),
                                               pool_size=self.budget)
            tree = pool.tree if depth_cap is None else truncate_depth(pool.tree, depth_cap)
        return BuiltTree(tree)


@register_policy("ddtree", f"DDTree: the B highest-mass prefixes of the draft marginals per row "
                           f"(B non-root nodes, default {DEFAULT_BUDGET})", params="[B]")
def _make(arg):
    return DDTreePolicy(parse_budget("ddtree", arg, DEFAULT_BUDGET))
