"""Prompt lookup as a policy of its own and grafted into TAPS trees (:func:`taps_kernels.lookup_chain`,
:func:`taps_kernels.graft_chain`).

* ``lookup[:K]``: prompt-lookup decoding without a drafter. Each round verifies the root and the up to ``K``
  tokens (default :data:`DEFAULT_LOOKUP_TOKENS`) that followed the latest earlier occurrence of the row's
  last 3, else 2, else 1 tokens; no match: the root alone. The baseline a user without a drafter would pick
  (HF ``generate(prompt_lookup_num_tokens=K)`` in this harness).
* ``taps-lookup[:N]``: TAPS (throughput rule, gate, draft positions as ``taps``) whose candidate pool also
  holds the lookup chain. Chain node ``k`` (depth ``k + 1``) gets reach ``q_n ** (k + 1)``, or its scorer reach
  when the pool already has that node and it is larger; ``q_n`` is the measured rate at which the target
  accepts the next chain token after an ``n``-token match (:class:`.sources.ChainAcceptance`), so the throughput rule
  keeps chain nodes exactly while they pay for their verify time, like any other node. Rounds where the gate
  skips the drafter still verify the chain (lookup costs no drafter pass).
* ``lookup-cost[:K]``: the chain alone, no drafter, sized by that same rule (a costed ``lookup``).
* ``taps-lookup-sibling[:N]``, ``lookup-cost-sibling[:K]``: the same with the sibling of the chain's first token
  (the next token of the latest occurrence that continued differently) as a second child of the root, reach
  ``s_n``: the measured rate at which the target's next token was the sibling.
"""
from __future__ import annotations

from typing import Optional

from taps_kernels import lookup_chain
from taps_kernels.ops.lookup import DEFAULT_MAX_NGRAM

from ..token_history import lookup_only_tree
from .base import IN_ROUND, NO_TIMER, BuiltTree, TreePolicy, parse_budget, register_policy
from .composed import ComposedPolicy
from .sizing import ThroughputSize
from .sources import DEFAULT_LOOKUP_TOKENS, LookupChain, check_lookup_args, history_of
from .taps import DEFAULT_CAP, DEFAULT_MAX_DEPTH, OPTIONS, scorer_pool


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
        check_lookup_args("lookup", num_tokens, max_ngram)
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram

    def max_tree_depth(self, draft_positions: int) -> int:
        return self.num_tokens

    def build(self, draft_logits, draft_hidden, bonus, depth_cap=None, timer=None, rows=None, history=None):
        tokens, lengths = history_of(self.name, history)
        with (timer or NO_TIMER)("lookup"):
            chain, chain_len, _, _ = lookup_chain(tokens, lengths, self.num_tokens, self.max_ngram, validate=IN_ROUND)
            return BuiltTree(lookup_only_tree(bonus, chain, chain_len, depth_cap))


def taps_lookup_policy(max_nodes: int = DEFAULT_CAP, num_tokens: int = DEFAULT_LOOKUP_TOKENS,
                       max_ngram: int = DEFAULT_MAX_NGRAM, pool_size: Optional[int] = None, scorer=None, top_k=None,
                       latency=None, gate: bool = True, max_depth: Optional[int] = DEFAULT_MAX_DEPTH,
                       tiny: bool = False, sibling: bool = False) -> ComposedPolicy:
    """TAPS's throughput rule over the scored pool with the prompt-lookup chain (and its sibling) grafted in.

    Args:
        max_nodes: node cap ``N`` (non-root nodes per row).
        num_tokens: longest lookup chain ``K``.
        max_ngram: longest suffix matched.
        pool_size, scorer, top_k, tiny, max_depth: the scored pool's (:func:`.taps.taps_policy`).
        latency: optional latency table dict (default: measured/cached for the bound target).
        gate: skip the drafter after rounds predicted to lose (the chain is verified in skipped rounds too).
        sibling: graft the sibling of the chain's first token too (:class:`.sources.LookupChain`).
    """
    check_lookup_args("taps-lookup", num_tokens, max_ngram)
    pool, reach = scorer_pool(max_nodes, pool_size, tiny, scorer, top_k, max_depth, follow_trees=True)
    return ComposedPolicy(ThroughputSize(max_nodes, latency), draft=pool, reach=reach,
                          lookup=LookupChain(num_tokens, max_ngram, sibling), gate=gate)


def costed_lookup_policy(num_tokens: int = DEFAULT_LOOKUP_TOKENS, max_ngram: int = DEFAULT_MAX_NGRAM,
                         latency=None, sibling: bool = False) -> ComposedPolicy:
    """The lookup chain (and its sibling) alone, no drafter, sized by ``taps-lookup``'s rule: chain node ``k`` is
    verified while its reach ``q_n ** (k + 1)`` pays for the verify time it adds (the latency table of this
    machine), so a chain the target keeps rejecting shrinks to the root alone instead of costing ``K`` nodes every
    round; the sibling likewise with its reach ``s_n``.

    Args:
        num_tokens: longest chain ``K`` (the node cap is ``K + 1`` with the sibling).
        max_ngram: longest suffix matched.
        latency: optional latency table dict (default: measured/cached for the bound target).
        sibling: graft the sibling of the chain's first token too (:class:`.sources.LookupChain`).
    """
    check_lookup_args("lookup-cost", num_tokens, max_ngram)
    return ComposedPolicy(ThroughputSize(num_tokens + int(sibling), latency),
                          lookup=LookupChain(num_tokens, max_ngram, sibling))


@register_policy("lookup", "prompt lookup without a drafter: the up to K tokens after the latest match of the last "
                           "3/2/1 tokens (default 10)", params="[K]")
def _make_lookup(arg):
    return PromptLookupPolicy(parse_budget("lookup", arg, DEFAULT_LOOKUP_TOKENS))


@register_policy("taps-lookup", "TAPS with the prompt-lookup chain in its pool, costed by its measured acceptance; "
                                "N caps nodes per row (default 64)", params="[N]", options=OPTIONS)
def _make_taps_lookup(arg, **options):
    return taps_lookup_policy(parse_budget("taps-lookup", arg, DEFAULT_CAP), **options)


@register_policy("taps-lookup-sibling", "taps-lookup with the sibling of the chain's first token as a second root "
                                        "child, costed by its measured hit rate; N caps nodes per row", params="[N]",
                 options=OPTIONS)
def _make_taps_lookup_sibling(arg, **options):
    return taps_lookup_policy(parse_budget("taps-lookup-sibling", arg, DEFAULT_CAP), sibling=True, **options)


@register_policy("lookup-cost", "prompt lookup without a drafter, chain nodes kept while their measured acceptance "
                                "pays for their verify time; K caps the chain (default 10)", params="[K]")
def _make_costed_lookup(arg):
    return costed_lookup_policy(parse_budget("lookup-cost", arg, DEFAULT_LOOKUP_TOKENS))


@register_policy("lookup-cost-sibling", "lookup-cost with the sibling of the chain's first token as a second root "
                                        "child, costed by its measured hit rate; K caps the chain", params="[K]")
def _make_costed_lookup_sibling(arg):
    return costed_lookup_policy(parse_budget("lookup-cost-sibling", arg, DEFAULT_LOOKUP_TOKENS), sibling=True)
