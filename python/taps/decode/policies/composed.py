"""A policy assembled from parts: proposal sources, a reach model, a size rule and an optional draft gate.

One round of :meth:`ComposedPolicy.build`::

    draft pool (DraftPool, when the round drafted)  -> pool tree          [timer "pool"]
    reach model (MarginalReach / ScorerReach)        -> log reach          ["scoring" for the scorer]
    lookup chain (LookupChain), grafted in           -> tree, log reach    ["lookup"]
    size rule (ThroughputSize / TopReach / UtilitySize) -> the tree to verify ["selection"]

What the loop asks of a policy follows from the parts: a drafter only with a draft pool (which also maps a
reduced draft vocabulary), committed-token history only with a lookup chain, chains only without a pool and
without the chain's sibling.
The gate (:class:`.gate.DraftGate`) needs the throughput rule: it records that rule's expected rate of each
drafted round. The registered recipes: ``taps*`` (:mod:`.taps`), ``ddtree-cost*`` (:mod:`.ddtree_cost`),
``taps-lookup`` and ``lookup-cost`` (:mod:`.lookup`).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

import taps_kernels
from taps_kernels.backend import builds_round_in_one_call

from ..latency import get_table
from ..tree_ops import IN_ROUND, root_only_tree
from .base import NO_TIMER, BuiltTree, TreePolicy
from .gate import DraftGate
from .reach import MarginalReach
from .sizing import ThroughputSize
from .sources import DraftPool, LookupChain


class ComposedPolicy(TreePolicy):
    """Trees from ``draft`` and/or ``lookup`` proposals, reach from ``reach``, sized by ``size``.

    Args:
        size: the size rule (:mod:`.sizing`).
        draft: the drafter's candidate pool, or None (no drafter runs; rounds start from the root alone).
        reach: the pool's reach model (default :class:`.reach.MarginalReach`).
        lookup: the prompt-lookup chain, or None.
        gate: skip the drafter after rounds predicted to lose to plain decoding (throughput rule only).
    """

    def __init__(self, size, draft: Optional[DraftPool] = None, reach=None, lookup: Optional[LookupChain] = None,
                 gate: bool = False):
        if gate and not isinstance(size, ThroughputSize):
            raise ValueError("gate: the draft gate records the throughput rule's rates; this size rule has none")
        self.size = size
        self.draft = draft
        self.reach = reach if reach is not None else MarginalReach()
        self.lookup = lookup
        self.use_gate = bool(gate)
        self.gate: Optional[DraftGate] = None
        self.uses_drafter = draft is not None
        self.handles_draft_vocab = draft is not None
        self.wants_history = lookup is not None
        self.chain_trees = draft is None and (lookup is None or not lookup.sibling)  # a sibling branches the root
        self._bound = False

    def draft_positions(self, num_positions: int) -> int:
        if self.draft is None:
            return num_positions
        positions = self.draft.round_positions(num_positions)
        if isinstance(self.size, ThroughputSize) and self.size.bound:  # the fixed time of the round it drafts
            self.size.set_draft_positions(positions)
        return positions

    def max_tree_depth(self, draft_positions: int) -> int:
        drafted = self.draft.positions(draft_positions) if self.draft is not None else 0
        return max(drafted, self.lookup.num_tokens if self.lookup is not None else 0)

    def tree_width(self, draft_positions: int) -> int:
        return self.size.max_nodes + 1

    def bind(self, target_model, drafter, device) -> None:
        super().bind(target_model, drafter, device)
        self.reach.bind(self.name, target_model, drafter, device)
        if isinstance(self.size, ThroughputSize):
            latency = self.size.latency
            if latency is None:
                latency = get_table(target_model, drafter if self.draft is not None else None,
                                    n_max=self.size.max_nodes)
            self.size.bind(latency, self._round_positions(drafter))
            self.gate = DraftGate() if self.use_gate else None
        self._bound = True

    def _round_positions(self, drafter) -> Optional[int]:
        """Draft positions a drafted round projects when fewer than the drafter's (None: all of them, whose
        cost is the latency table's ``t0``)."""
        if self.draft is None or drafter is None:
            return None
        every = drafter.config.block_size - 1
        used = self.draft.positions(every)
        return used if used < every else None

    def reset(self) -> None:
        if self.gate is not None:
            self.gate.restart()
        if self.lookup is not None:
            self.lookup.reset()
        if self.draft is not None:
            self.draft.reset()

    def wants_draft(self) -> bool:
        return self.gate is None or self.gate.wants_draft()

    def observe(self, expected, sizes, times) -> None:
        if not isinstance(self.size, ThroughputSize) or not self.size.bound:
            return
        if self.gate is not None and expected is not None and sizes is not None and expected:
            undrafted = self.lookup.undrafted_reach() if self.lookup is not None else None
            self.gate.record(self.size.rate_ratio(expected, sizes, undrafted))
        if self.draft is not None and sizes is not None:
            self.draft.observe_sizes(sizes)
        self.size.observe_times(times)

    def observe_rows(self, accepted, aux) -> None:
        if self.lookup is not None:
            self.lookup.observe_rows(accepted, aux)

    def build(self, draft_logits, draft_hidden, bonus, depth_cap=None, timer=None, rows=None, history=None):
        if not self._bound:
            raise RuntimeError(f"policy {self.name}: bind() was not called (the decoder calls it)")
        timer = timer or NO_TIMER
        if isinstance(self.size, ThroughputSize) and builds_round_in_one_call(bonus.device):
            return self._build_in_one_call(draft_logits, draft_hidden, bonus, depth_cap, timer, rows, history)
        return self._build_by_parts(draft_logits, draft_hidden, bonus, depth_cap, timer, rows, history)

    def _build_by_parts(self, draft_logits, draft_hidden, bonus, depth_cap, timer, rows, history) -> BuiltTree:
        """Each stage through its part's op (any device, any size rule)."""
        if draft_logits is None:  # an undrafted round of a policy that proposes without the drafter
            tree = root_only_tree(bonus)
            log_reach = torch.zeros(tree.tokens.shape, dtype=torch.float32, device=bonus.device)
        else:
            with timer("pool"):
                pool = self.draft.build(draft_logits, bonus, self.vocab_ids, self.reach.top_k)
            tree, log_reach = pool.tree, self.reach(pool, draft_hidden, timer)
        graft = None
        if self.lookup is not None:
            with timer("lookup"):
                tree, log_reach, graft = self.lookup.graft(self.name, tree, log_reach, history)
        with timer("selection"):
            sel, built = self.size.select(tree, log_reach, depth_cap, rows)
            if graft is not None:
                built.aux = self.lookup.aux(graft, sel)
        return built

    def _build_in_one_call(self, draft_logits, draft_hidden, bonus, depth_cap, timer, rows, history) -> BuiltTree:
        """The throughput rule's round on a CPU: :func:`taps_kernels.build_tree` runs the stages of
        :meth:`_build_by_parts` (same tree, bit for bit) in one C++ call. Its stage times are the call's own; the
        Python around it counts as selection."""
        start = time.perf_counter()
        scorer = getattr(self.reach, "weights", None)
        draft = None
        if draft_logits is not None:
            full = scorer is not None and scorer.full
            draft = self.draft.proposal(draft_logits, draft_hidden if full else None, self.vocab_ids,
                                        self.reach.top_k)
        lookup = None if self.lookup is None else self.lookup.proposal(self.name, history)
        rows = bonus.shape[0] if rows is None else rows
        rule = taps_kernels.ThroughputRule(self.size.batch_table(rows), self.size.plain_seconds(rows), rows)
        out = taps_kernels.build_tree(bonus, self.size.max_nodes, rule, draft, scorer if draft is not None else None,
                                      getattr(self.reach, "emb", None), lookup, depth_cap, validate=IN_ROUND)
        sel = out.selection
        built = BuiltTree(sel.tree, sel.expected, sel.num_selected.long(), aux=out.chain)
        for stage, seconds in out.seconds.items():
            if seconds:
                timer.add(stage, seconds)
        timer.add("selection", time.perf_counter() - start - sum(out.seconds.values()))
        return built
