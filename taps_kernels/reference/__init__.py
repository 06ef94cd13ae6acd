"""Plain PyTorch references of every op: readable, slow, and the specification the fast paths are tested against."""
from .accept import accept_greedy_reference, accept_round_reference
from .attention import tree_attention_reference
from .commit import commit_round_reference
from .greedy import greedy_tokens_reference
from .kv import compact_kv_reference
from .linear import int8_linear_reference, quantize_int8_rows_reference, rows_linear_reference
from .lookup import graft_chain_reference, lookup_chain_reference
from .mask import ancestor_bits_reference, tree_mask_reference, unpack_ancestor_bits
from .pool import best_first_pool_reference, topk_stats_reference
from .reach import propagate_reach_reference
from .select import reindex_subtree_reference, select_subtree_reference, select_throughput_reference

__all__ = [
    "accept_greedy_reference", "accept_round_reference", "commit_round_reference", "greedy_tokens_reference", "tree_attention_reference", "compact_kv_reference", "ancestor_bits_reference",
    "tree_mask_reference", "unpack_ancestor_bits", "best_first_pool_reference", "topk_stats_reference",
    "propagate_reach_reference", "reindex_subtree_reference", "select_subtree_reference",
    "select_throughput_reference", "rows_linear_reference",
    "int8_linear_reference", "quantize_int8_rows_reference", "lookup_chain_reference", "graft_chain_reference",
]
