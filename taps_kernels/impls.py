"""Registers every backend's implementations with ``taps_kernels.backend``.

Reference implementations always register. The C++, CUDA and Triton modules register
themselves when imported; an optional backend whose module fails to import is simply
absent, and ``backend.unavailable_reason`` reports why when it is asked for.
"""
from __future__ import annotations

import importlib

from . import reference as ref
from .backend import register
from .reference.score import score_edges_reference

register("topk_stats", "reference", gpu_order=("triton",))(ref.topk_stats_reference)
register("best_first_pool", "reference", gpu_order=("cuda",))(ref.best_first_pool_reference)
register("propagate_reach", "reference", gpu_order=("cuda",))(ref.propagate_reach_reference)
register("select_subtree", "reference", gpu_order=("cuda",))(ref.select_subtree_reference)
register("reindex_subtree", "reference")(ref.reindex_subtree_reference)
register("tree_mask", "reference", gpu_order=("cuda",))(ref.tree_mask_reference)
register("tree_attention", "reference", gpu_order=("triton",))(ref.tree_attention_reference)
register("accept_greedy", "reference", gpu_order=("cuda",))(ref.accept_greedy_reference)
register("compact_kv", "reference", gpu_order=("cuda",))(ref.compact_kv_reference)
register("score_edges", "reference", gpu_order=("triton",))(score_edges_reference)
# GPUs keep cuBLAS: the few-row kernel is a CPU answer to BLAS sgemm at small M (see backend.rows_linear_backend)
register("rows_linear", "reference", gpu_order=())(ref.rows_linear_reference)

for _module in ("taps_kernels.cpp_impls", "taps_kernels.cuda_impls", "taps_kernels.triton"):
    try:
        importlib.import_module(_module)
    except ImportError:
        # The backend stays unregistered; unavailable_reason() names what is missing when it is requested.
        pass
