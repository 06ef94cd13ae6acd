"""Triton backend: fused top-K statistics, the best-first pool, reach propagation, subtree selection and
re-indexing, the batch throughput rule, edge scoring, tree attention: every op of a decode round except the
CUDA bookkeeping walks.

Importing this package registers the ``"triton"`` implementations in
:mod:`taps_kernels._registry` (same call signatures as the references registered in
``taps_kernels.impls``). It raises ImportError when triton is missing, which leaves the
backend unregistered. Kernels run on CUDA tensors, or on CPU tensors under the
interpreter (``TRITON_INTERPRET=1`` set before this package is imported).
"""
try:
    import triton  # noqa: F401
except Exception as exc:  # a broken install must disable the backend, not the package
    raise ImportError(f"taps_kernels.triton needs triton: {exc}") from exc

from .._registry import register
from ..reference.select import default_utility_options_only
from .best_first_pool import best_first_pool_triton
from .best_first_pool import supports as _pool_supports
from .edge_score import score_edges_triton
from .propagate_reach import propagate_reach_triton
from .select_subtree import reindex_subtree_triton, select_subtree_triton
from .select_throughput import select_throughput_triton
from .select_throughput import supports as _throughput_supports
from .topk_stats import topk_stats_triton
from .tree_attention import tree_attention_triton

register("topk_stats", "triton")(topk_stats_triton)
register("best_first_pool", "triton", supports=_pool_supports)(best_first_pool_triton)
register("propagate_reach", "triton")(propagate_reach_triton)
register("select_subtree", "triton", supports=default_utility_options_only)(select_subtree_triton)
register("select_throughput", "triton", supports=_throughput_supports)(select_throughput_triton)
register("reindex_subtree", "triton")(reindex_subtree_triton)
register("tree_attention", "triton")(tree_attention_triton)
register("score_edges", "triton")(score_edges_triton)

__all__ = ["topk_stats_triton", "best_first_pool_triton", "propagate_reach_triton", "select_subtree_triton",
           "select_throughput_triton", "reindex_subtree_triton", "tree_attention_triton", "score_edges_triton"]
