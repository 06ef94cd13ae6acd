"""Registers every backend's implementations in :mod:`taps_kernels._registry`.

Reference implementations always register. The C++, CUDA and Triton modules register
themselves when imported; an optional backend whose module fails to import is simply
absent, and ``backend.unavailable_reason`` reports why when it is asked for. Which one runs
by default is decided in :mod:`taps_kernels.backend` alone (its ``PREFERENCES`` table).
"""
from __future__ import annotations

import importlib

from . import reference as ref
from ._registry import register
from .reference.build import build_tree_reference
from .reference.commit import commit_round_reference
from .reference.score import score_edges_reference

register("topk_stats", "reference")(ref.topk_stats_reference)
register("best_first_pool", "reference")(ref.best_first_pool_reference)
register("propagate_reach", "reference")(ref.propagate_reach_reference)
register("select_subtree", "reference")(ref.select_subtree_reference)
register("select_throughput", "reference")(ref.select_throughput_reference)
register("reindex_subtree", "reference")(ref.reindex_subtree_reference)
register("tree_mask", "reference")(ref.tree_mask_reference)
register("tree_attention", "reference")(ref.tree_attention_reference)
register("accept_greedy", "reference")(ref.accept_greedy_reference)
register("accept_round", "reference")(ref.accept_round_reference)
register("greedy_tokens", "reference")(ref.greedy_tokens_reference)
register("compact_kv", "reference")(ref.compact_kv_reference)
register("commit_round", "reference")(commit_round_reference)
register("score_edges", "reference")(score_edges_reference)
register("rows_linear", "reference")(ref.rows_linear_reference)
register("lookup_chain", "reference")(ref.lookup_chain_reference)
register("graft_chain", "reference")(ref.graft_chain_reference)
register("build_tree", "reference")(build_tree_reference)

for _module in ("taps_kernels.cpp_impls", "taps_kernels.cuda_impls", "taps_kernels.triton"):
    try:
        importlib.import_module(_module)
    except ImportError:
        # The backend stays unregistered; unavailable_reason() names what is missing when it is requested.
        pass
