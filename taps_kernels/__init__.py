"""taps_kernels: tree ops for diffusion-drafted speculative decoding (TAPS, DDTree, DFlash).

Public ops (shapes, dtypes and node order in each docstring; tree layout in
:mod:`taps_kernels.layout`): :func:`candidate_pool`, :func:`topk_stats`,
:func:`best_first_pool`, :func:`propagate_reach`, :func:`select_subtree` (rules: :class:`ReachRule`,
:class:`UtilityRule`, :class:`ThroughputRule`),
:func:`tree_mask`, :func:`ancestor_bits_to_additive_mask`,
:func:`tree_attention`, :func:`accept_greedy`, :func:`accept_round` (a decode round's acceptance),
:func:`compact_kv`, :func:`greedy_tokens`, :func:`commit_round` (a verified round's tokens, acceptance, compaction and
counters in one call),
:func:`score_edges` (weights: :class:`ScorerWeights`), :func:`build_tree` (a round's pool, reach, lookup graft and
throughput rule in one call), and :func:`rows_linear` (few-row linear layers for verify forwards on CPU).
Every op takes ``backend=`` ("reference", "cpp", "triton", "cuda"); the default
is chosen in :mod:`taps_kernels.backend`, and :func:`explain` says which and why.
Each tree op is also a ``torch.ops.taps.*`` op (:mod:`taps_kernels._library`), registered by this import: the
public function checks its arguments and calls it, and ``torch.compile`` graphs record it.
"""
from .backend import BackendUnavailable, available_backends, explain, warn_if_cpp_missing
from .layout import CandidatePool, Selection, TopKStats, Tree
from .ops import (BuiltRound, DraftProposal, LookupProposal, accept_greedy, accept_round,
                  ancestor_bits_to_additive_mask, best_first_pool, build_tree, candidate_pool, commit_round, compact_kv, graft_chain, greedy_tokens, lookup_chain, propagate_reach, rows_linear, score_edges, select_subtree,
                  topk_stats, tree_attention, tree_mask)
from .ops.select import ReachRule, ThroughputRule, UtilityRule
from .scorer_weights import ScorerWeights

__version__ = "0.1.0"

warn_if_cpp_missing()

__all__ = [
    "Tree", "CandidatePool", "TopKStats", "Selection", "BackendUnavailable", "available_backends", "explain",
    "candidate_pool", "topk_stats", "best_first_pool", "propagate_reach", "select_subtree", "tree_mask",
    "ancestor_bits_to_additive_mask", "tree_attention", "accept_greedy", "accept_round", "compact_kv",
    "score_edges", "ScorerWeights", "rows_linear", "lookup_chain", "graft_chain", "greedy_tokens", "ReachRule", "UtilityRule",
    "ThroughputRule", "build_tree", "commit_round", "DraftProposal", "LookupProposal", "BuiltRound",
]
