"""Registers the C++ CPU backend (``taps_kernels._C``) of every tree op with :mod:`taps_kernels.backend`.

Each function takes exactly the arguments of its reference in :mod:`taps_kernels.reference` and
returns the same tensors (same shapes, dtypes, node order). The tree and index ops are exact:
bit-identical floats, equal integers. ``score_edges`` with a scorer matches its reference within a
float32 tolerance only (its projections and MLP sum in a different order from torch's matmuls; the
tolerance is in tests/test_cpp_score_edges.py), with the same -inf pattern and the same root values.
Importing this module raises ImportError when the extension is missing or cannot load, which leaves
the backend unregistered.
"""
from __future__ import annotations

from typing import List, Optional

import torch  # must precede the extension: it loads libc10/libtorch

try:
    from . import _C
except Exception as exc:  # ImportError, or an ABI mismatch surfacing as OSError
    raise ImportError(f"taps_kernels._C is not available ({type(exc).__name__}: {exc})") from exc

from ._registry import register
from .layout import Tree
from .reference.select import default_utility_options_only


@register("topk_stats", "cpp")
def topk_stats_cpp(draft_logits: torch.Tensor, top_k: int):
    """``draft_logits [B,D,V]`` -> ``(topk_logp [B,D,K] f32, topk_ids [B,D,K] int64, entropy, margin, topk_mass [B,D] f32)``."""
    return tuple(_C.topk_stats(draft_logits, top_k))


@register("best_first_pool", "cpp")
def best_first_pool_cpp(topk_logp: torch.Tensor, topk_ids: torch.Tensor, root_tokens: torch.Tensor, pool_size: int):
    """``topk_logp [B,D,K] f32, topk_ids [B,D,K] int64, root_tokens [B] int64`` ->
    ``tokens, parents, depth, num_nodes, logq, step_logq, rank`` (``N = pool_size + 1`` rows, pop order)."""
    return tuple(_C.best_first_pool(topk_logp, topk_ids, root_tokens, pool_size))


@register("propagate_reach", "cpp")
def propagate_reach_cpp(parents: torch.Tensor, edge_logq: torch.Tensor) -> torch.Tensor:
    """``parents [B,N] int32, edge_logq [B,N] f32`` -> ``log_reach [B,N] f32``."""
    return _C.propagate_reach(parents, edge_logq)


@register("select_subtree", "cpp", supports=default_utility_options_only)
def select_subtree_cpp(parents: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor, log_reach: torch.Tensor,
                       max_nodes: int, latency: Optional[torch.Tensor] = None, t0: float = 0.0, rule: str = "reach",
                       lambda_node: float = 1.0, lambda_depth: float = 0.002, min_utility: float = 0.0):
    """-> ``(pool_index [B, max_nodes+1] int64, num_selected [B] int32)``: kept pool nodes ascending, -1 padded."""
    return tuple(_C.select_subtree(parents, depth, num_nodes, log_reach, max_nodes, latency, t0, rule, lambda_node,
                                   lambda_depth, min_utility))


@register("select_throughput", "cpp")
def select_throughput_cpp(parents: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor,
                          log_reach: torch.Tensor, max_nodes: int, table: torch.Tensor, plain_seconds: float,
                          rows: int):
    """Batch throughput rule, ``table [L] f64`` -> ``(pool_index [B, max_nodes+1] int64, num_selected [B] int32,
    expected [B] float32)``: kept pool nodes ascending, -1 padded; bit-identical to the reference."""
    return tuple(_C.select_throughput(parents, depth, num_nodes, log_reach, max_nodes, table, float(plain_seconds),
                                      int(rows)))


register("reindex_subtree", "cpp")(_C.reindex_subtree)


@register("tree_mask", "cpp")
def tree_mask_cpp(parents: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor, prefix_lens: torch.Tensor):
    """-> ``(position_ids [B,N] int64, ancestor_bits [B,N,ceil(N/32)] int32)``."""
    return tuple(_C.tree_mask(parents, depth, num_nodes, prefix_lens))


@register("accept_greedy", "cpp")
def accept_greedy_cpp(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                      target_tokens: torch.Tensor, path_len: int):
    """-> ``(path [B,path_len] int64 (-1 padded), accept_len [B] int64, next_token [B] int64)``."""
    return tuple(_C.accept_greedy(tokens, parents, num_nodes, target_tokens, path_len))


@register("greedy_tokens", "cpp")
def greedy_tokens_cpp(logits: torch.Tensor) -> torch.Tensor:
    """``logits [R, V]`` float -> ``[R] int64`` (half and bf16 widened to float32 first: the same argmax)."""
    return _C.argmax_rows(logits.float())


@register("accept_round", "cpp")
def accept_round_cpp(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, target_tokens: torch.Tensor,
                     active: torch.Tensor, path_len: int, history_tokens: Optional[torch.Tensor] = None,
                     history_lengths: Optional[torch.Tensor] = None):
    """-> ``(path, accept_len, next_token, committed)`` int64 (:func:`taps_kernels.accept_round`); one C++ call, the
    history appended to in place."""
    return tuple(_C.accept_round(tokens, parents, num_nodes, target_tokens, active, path_len, history_tokens,
                                 history_lengths))


@register("compact_kv", "cpp")
def compact_kv_cpp(keys: List[torch.Tensor], values: List[torch.Tensor], prefix_lens: torch.Tensor,
                   path: torch.Tensor) -> torch.Tensor:
    """In place on every ``[B,H,L,Dh]`` cache tensor; -> ``new_lens [B] int64``. Checks the path before any write."""
    return _C.compact_kv(list(keys), list(values), prefix_lens, path)


@register("commit_round", "cpp")
def commit_round_cpp(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, active: torch.Tensor,
                     path_len: int, keys: List[torch.Tensor], values: List[torch.Tensor], lengths: torch.Tensor,
                     logits: Optional[torch.Tensor] = None, target_tokens: Optional[torch.Tensor] = None,
                     history_tokens: Optional[torch.Tensor] = None, history_lengths: Optional[torch.Tensor] = None,
                     moves: bool = True):
    """-> ``(path, accept_len, next_token, committed)`` int64 (:func:`taps_kernels.commit_round`); one C++ call
    (half and bf16 logits widened to float32 first: the same argmax); checks everything before the first write."""
    return tuple(_C.commit_round(tokens, parents, num_nodes, active, path_len, keys, values, lengths,
                                 None if logits is None else logits.float(), target_tokens, history_tokens,
                                 history_lengths, moves))


def _scorer_fields(weights):
    """ScorerWeights as the bindings take them: ``{field: float32 tensor}``, or None for the marginal model."""
    return None if weights is None else {k: t.float() for k, t in weights.tensors().items()}


@register("score_edges", "cpp")
def score_edges_cpp(pool, weights, token_embeddings: Optional[torch.Tensor] = None,
                    drafter_hidden: Optional[torch.Tensor] = None):
    """``pool`` (:class:`taps_kernels.CandidatePool`: tree ``[B,N]``, ``logq``/``step_logq [B,N] f32``,
    ``entropy``/``margin``/``topk_mass [B,D] f32``), ``weights`` (:class:`taps_kernels.ScorerWeights`, full or
    tiny, any float dtype, used as float32; or None for the marginal model), ``token_embeddings [V,E]`` f32/f16/bf16
    (only the pool's rows are read), ``drafter_hidden [B,D,H]`` float (both full scorer only) ->
    ``(edge_logq, other_logq, log_reach)``, each ``[B,N] f32``."""
    tree = pool.tree
    tensors = _scorer_fields(weights)
    eps = 1e-5 if weights is None else float(weights.ln_eps)
    return tuple(_C.score_edges(tree.tokens, tree.parents, tree.depth, pool.logq, pool.step_logq, pool.entropy,
                                pool.margin, pool.topk_mass, tensors, eps, token_embeddings, drafter_hidden))


@register("rows_linear", "cpp")
def rows_linear_cpp(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M,K] f32, weight [N,K] f32, bias [N] f32 or None`` -> ``x @ weight.T + bias [M,N] f32``."""
    return _C.rows_linear(x, weight, bias)


@register("lookup_chain", "cpp")
def lookup_chain_cpp(tokens: torch.Tensor, lengths: torch.Tensor, num_tokens: int, max_ngram: int):
    """``tokens [B,C] int64, lengths [B] int64`` -> ``(chain [B,K] int64, chain_len [B] int64, ngram [B] int64,
    sibling [B] int64)``."""
    return tuple(_C.lookup_chain(tokens, lengths, num_tokens, max_ngram))


@register("graft_chain", "cpp")
def graft_chain_cpp(tree, log_reach: torch.Tensor, chain: torch.Tensor, chain_len: torch.Tensor,
                    chain_log_reach: torch.Tensor):
    """``(tree [B,N+K], log_reach [B,N+K] f32, chain_nodes [B,K] int64)``."""
    tokens, parents, depth, num_nodes, reach, nodes = _C.graft_chain(
        tree.tokens, tree.parents, tree.depth, tree.num_nodes, log_reach, chain, chain_len, chain_log_reach)
    return Tree(tokens, parents, depth, num_nodes), reach, nodes


@register("build_tree", "cpp")
def build_tree_cpp(root_tokens, depth_cap, draft, scorer, token_embeddings, lookup, max_nodes: int,
                   table: torch.Tensor, plain_seconds: float, rows: int):
    """Arguments as :func:`taps_kernels.reference.build.build_tree_reference` -> ``(Selection, chain [B, 5+K] int64 or
    None, {stage: seconds})``: the stages through the routines of their own ops, in one call."""
    from .layout import Selection
    from .ops.build import STAGES

    weights = None if draft is None else _scorer_fields(scorer)
    eps = 1e-5 if scorer is None else float(scorer.ln_eps)
    d = draft
    out = _C.build_round(
        root_tokens, depth_cap, None if d is None else d.logits, None if d is None else d.vocab_ids,
        1 if d is None else d.top_k, 1 if d is None else d.pool_size, weights, eps, token_embeddings,
        None if d is None else d.hidden, None if lookup is None else lookup.history,
        None if lookup is None else lookup.lengths, 0 if lookup is None else lookup.num_tokens,
        1 if lookup is None else lookup.max_ngram, None if lookup is None else lookup.log_q,
        None if lookup is None else lookup.log_s, max_nodes, table, plain_seconds, rows)
    (tokens, parents, depth, num_nodes, pool_index, num_selected, expected, chain), seconds = out
    sel = Selection(Tree(tokens, parents, depth, num_nodes), pool_index, num_selected, expected)
    return sel, (chain if lookup is not None else None), dict(zip(STAGES, seconds))

