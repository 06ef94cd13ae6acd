"""Prompt lookup as a policy of its own and grafted into TAPS trees (:func:`taps_kernels.lookup_chain`,
:func:`taps_kernels.graft_chain`).

* ``lookup[:K]``: prompt-lookup decoding without a drafter. Each round verifies the root and the up to ``K``
  tokens (default :data:`DEFAULT_LOOKUP_TOKENS`) that followed the latest earlier occurrence of the row's
  last 3, else 2, else 1 tokens; no match: the root alone. The baseline a user without a drafter would pick
  (HF ``generate(prompt_lookup_num_tokens=K)`` in this harness).
* ``taps-lookup[:N]``: TAPS (throughput rule, gate, draft positions as ``taps``) whose candidate pool also
  holds the lookup chain. Chain node ``k`` (depth ``k + 1``) gets reach ``q_n ** (k + 1)``, or its scorer reach
  when the pool already has that node and it is larger; ``q_n`` is the measured rate at which the target
  accepts the next chain token after an ``n``-token match (:class:`ChainAcceptance`), so the throughput rule
  keeps chain nodes exactly while they pay for their verify time, like any other node. Rounds where the gate
  skips the drafter still verify the chain (lookup costs no drafter pass).
* ``lookup-cost[:K]``: the chain alone, no drafter, sized by that same rule (a costed ``lookup``).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from taps_kernels import graft_chain, lookup_chain
from taps_kernels.ops.lookup import DEFAULT_MAX_NGRAM

from ..latency import get_table
from ..lookup import accepted_prefix, lookup_only_tree
from ..tree_ops import root_only_tree
from .base import IN_ROUND, NO_TIMER, BuiltTree, PolicyError, TreePolicy, parse_budget, register_policy
from .taps import DEFAULT_CAP, DEFAULT_MAX_DEPTH, OPTIONS, TapsPolicy

#: Chain length: as HF's prompt-lookup examples (10 tokens).
DEFAULT_LOOKUP_TOKENS = 10
#: Weight of the newest observation's counts (older ones decay by this factor per observation).
ACCEPTANCE_DECAY = 0.9
#: Starting successes / failures of every match length (a chain token is first believed right one time in
#: three). They decay like observations: a prior that stayed would hold the rate above the price of a node
#: (~0.07 tokens on these CPUs) in text where lookup is never right.
PRIOR = (1.0, 2.0)


def _lookup_args(name: str, num_tokens: int, max_ngram: int):
    for arg, v in (("num_tokens", num_tokens), ("max_ngram", max_ngram)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PolicyError(f"policy {name}: {arg} expected an integer >= 1, received {v!r}")


def _history(name: str, history):
    if history is None:
        raise RuntimeError(f"policy {name}: build() needs history= (the decoder passes it)")
    return history


class PromptLookupPolicy(TreePolicy):
    """Prompt-lookup chains, no drafter.

    Args:
        num_tokens: longest chain ``K``.
        max_ngram: longest suffix matched.
    """

    uses_drafter = False
    wants_history = True
    chain_trees = True

    def __init__(self, num_tokens: int = DEFAULT_LOOKUP_TOKENS, max_ngram: int = DEFAULT_MAX_NGRAM):
        _lookup_args("lookup", num_tokens, max_ngram)
        self.num_tokens = self.max_nodes = num_tokens
        self.max_ngram = max_ngram

    def max_tree_depth(self, draft_positions: int) -> int:
        return self.num_tokens

    def build(self, draft_logits, draft_hidden, bonus, depth_cap=None, timer=None, rows=None, history=None):
        tokens, lengths = _history(self.name, history)
        with (timer or NO_TIMER)("lookup"):
            chain, chain_len, _ = lookup_chain(tokens, lengths, self.num_tokens, self.max_ngram, validate=IN_ROUND)
            return BuiltTree(lookup_only_tree(bonus, chain, chain_len, depth_cap))


class ChainAcceptance:
    """Per match length ``n``, the rate ``q_n`` at which the target accepts the next chain token (a geometric
    model of how far a chain holds), from decayed counts that start at ``prior``: a verified chain whose first
    ``m`` tokens were in the tree adds ``a`` successes (its accepted prefix) and one failure when ``a < m``."""

    def __init__(self, max_ngram: int, decay: float = ACCEPTANCE_DECAY, prior=PRIOR):
        self.decay = float(decay)
        self.success = [float(prior[0])] * (max_ngram + 1)
        self.failure = [float(prior[1])] * (max_ngram + 1)

    def record(self, ngram: int, accepted: int, failed: bool) -> None:
        self.success[ngram] = self.decay * self.success[ngram] + accepted
        self.failure[ngram] = self.decay * self.failure[ngram] + float(failed)

    def rate(self, ngram: int) -> float:
        s, f = self.success[ngram], self.failure[ngram]
        return s / (s + f) if s + f > 0 else 0.0

    def log_reach(self, ngram: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[B, K] float32`` chain log reach ``(k + 1) * log q_n`` of rows whose match length is ``ngram [B]``
        (host floats enter as kernel scalars: nothing is copied to the device)."""
        log_q = torch.zeros(ngram.shape, dtype=torch.float32, device=ngram.device)
        for n in range(1, len(self.success)):
            q = self.rate(n)  # 0 once the decayed successes underflow: reach 0, never worth a node
            log_q = log_q.masked_fill(ngram == n, math.log(q) if q > 0 else float("-inf"))
        depth = torch.arange(1, num_tokens + 1, dtype=torch.float32, device=ngram.device)
        return log_q[:, None] * depth[None, :]


class TapsLookupPolicy(TapsPolicy):
    """TAPS throughput rule over the scored pool with the prompt-lookup chain grafted in.

    Args:
        max_nodes: node cap ``N`` (non-root nodes per row).
        num_tokens: longest lookup chain ``K``.
        max_ngram: longest suffix matched.
        **kwargs: :class:`TapsPolicy`'s (scorer, pool_size, latency, gate, ...).
    """

    wants_history = True

    def __init__(self, max_nodes: int = DEFAULT_CAP, num_tokens: int = DEFAULT_LOOKUP_TOKENS,
                 max_ngram: int = DEFAULT_MAX_NGRAM, **kwargs):
        _lookup_args("taps-lookup", num_tokens, max_ngram)
        kwargs.setdefault("max_depth", DEFAULT_MAX_DEPTH)
        super().__init__(max_nodes, rule="reach", **kwargs)
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        self.acceptance = ChainAcceptance(max_ngram)
        self._chains: Dict[int, List[int]] = {}

    def max_tree_depth(self, draft_positions: int) -> int:
        return max(self.draft_positions(draft_positions), self.num_tokens)

    def reset(self) -> None:
        super().reset()
        self.acceptance = ChainAcceptance(self.max_ngram)
        self._chains = {}

    def build(self, draft_logits, draft_hidden, bonus, depth_cap=None, timer=None, rows=None, history=None):
        tokens, lengths = _history(self.name, history)
        timer = timer or NO_TIMER
        if draft_logits is None:
            tree = root_only_tree(bonus)
            log_reach = torch.zeros(tree.tokens.shape, dtype=torch.float32, device=bonus.device)
        else:
            tree, log_reach = self._scored_pool(draft_logits, draft_hidden, bonus, timer)
        with timer("lookup"):
            chain, chain_len, ngram = lookup_chain(tokens, lengths, self.num_tokens, self.max_ngram,
                                                   validate=IN_ROUND)
            tree, log_reach, nodes = graft_chain(tree, log_reach, chain, chain_len,
                                                 self.acceptance.log_reach(ngram, self.num_tokens),
                                                 validate=IN_ROUND)
        with timer("selection"):
            sel = self._throughput_select(tree, log_reach, depth_cap, rows)
            # the grafted chain's nodes that made the tree (pool_index lists the kept pool nodes)
            kept = ((nodes[:, :, None] == sel.pool_index[:, None, :]).any(-1) & (nodes >= 0)).sum(1)
            built = BuiltTree(sel.tree, sel.expected, sel.num_selected.long())
        built.aux = torch.cat([ngram[:, None], kept[:, None], chain], 1)
        return built

    def observe_rows(self, accepted: Dict[int, Optional[List[int]]], aux: Dict[int, List[int]]) -> None:
        for b, verified in accepted.items():
            prev = self._chains.get(b)
            if verified is not None and prev is not None and prev[1] > 0:
                ngram, kept, chain = prev[0], prev[1], prev[2:2 + prev[1]]
                a = accepted_prefix(verified, chain)
                self.acceptance.record(ngram, a, a < kept)
        self._chains.update(aux)


class CostedLookupPolicy(TapsLookupPolicy):
    """The lookup chain alone, no drafter, sized by ``taps-lookup``'s rule: chain node ``k`` is verified while
    its reach ``q_n ** (k + 1)`` pays for the verify time it adds (the latency table of this machine), so a
    chain the target keeps rejecting shrinks to the root alone instead of costing ``K`` nodes every round.

    Args:
        num_tokens: longest chain ``K``.
        max_ngram: longest suffix matched.
        latency: optional latency table dict (default: measured/cached for the bound target).
    """

    uses_drafter = False
    chain_trees = True

    def __init__(self, num_tokens: int = DEFAULT_LOOKUP_TOKENS, max_ngram: int = DEFAULT_MAX_NGRAM, latency=None):
        super().__init__(num_tokens, num_tokens=num_tokens, max_ngram=max_ngram, latency=latency, gate=False)

    def max_tree_depth(self, draft_positions: int) -> int:
        return self.num_tokens

    def bind(self, target_model, drafter, device) -> None:
        if self.latency is None:
            self.latency = get_table(target_model, None, n_max=self.max_nodes)
        self._bind_throughput(self.latency, self.max_nodes)


@register_policy("lookup", "prompt lookup without a drafter: the up to K tokens after the latest match of the last "
                           "3/2/1 tokens (default 10)", params="[K]")
def _make_lookup(arg):
    return PromptLookupPolicy(parse_budget("lookup", arg, DEFAULT_LOOKUP_TOKENS))


@register_policy("taps-lookup", "TAPS with the prompt-lookup chain in its pool, costed by its measured acceptance; "
                                "N caps nodes per row (default 64)", params="[N]", options=OPTIONS)
def _make_taps_lookup(arg, **options):
    return TapsLookupPolicy(parse_budget("taps-lookup", arg, DEFAULT_CAP), **options)


@register_policy("lookup-cost", "prompt lookup without a drafter, chain nodes kept while their measured acceptance "
                                "pays for their verify time; K caps the chain (default 10)", params="[K]")
def _make_costed_lookup(arg):
    return CostedLookupPolicy(parse_budget("lookup-cost", arg, DEFAULT_LOOKUP_TOKENS))
