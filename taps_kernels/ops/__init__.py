"""Public ops: validate arguments, pick a backend (``taps_kernels.backend``), run it."""
from .accept import accept_greedy, accept_round
from .attention import tree_attention
from .build import BuiltRound, DraftProposal, LookupProposal, build_tree
from .commit import commit_round
from .greedy import greedy_tokens
from .kv import compact_kv
from .linear import rows_linear
from .lookup import graft_chain, lookup_chain
from .mask import ancestor_bits_to_additive_mask, tree_mask
from .pool import best_first_pool, candidate_pool, topk_stats
from .reach import propagate_reach
from .score import score_edges
from .select import select_subtree

__all__ = ["accept_greedy", "accept_round", "tree_attention", "compact_kv", "ancestor_bits_to_additive_mask", "tree_mask",
           "best_first_pool", "candidate_pool", "topk_stats", "propagate_reach", "select_subtree",
           "score_edges", "rows_linear", "lookup_chain", "graft_chain", "greedy_tokens",
           "build_tree", "commit_round", "DraftProposal", "LookupProposal", "BuiltRound"]
