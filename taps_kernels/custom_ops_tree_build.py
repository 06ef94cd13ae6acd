"""``torch.library`` registration of the tree-building ops (candidate pool, edge scoring, subtree selection).

Importing this module (``import taps_kernels`` does) defines five more ``taps::`` custom ops, so that a whole
decode round, pool to compaction, traces into one ``torch.compile(fullgraph=True)`` graph:

==============================  ====================================================================================
``taps::topk_stats``            ``(draft_logits, top_k) -> (topk_logp, topk_ids, entropy, margin, topk_mass)``
``taps::best_first_pool``       ``(topk_logp, topk_ids, root_tokens, pool_size) -> (tokens, parents, depth,
                                num_nodes, logq, step_logq, rank)``
``taps::score_edges``           ``(tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin,
                                topk_mass, weights[], eps, token_embeddings?, drafter_hidden?) ->
                                (edge_logq, other_logq, log_reach)``
``taps::select_subtree``        ``(parents, depth, num_nodes, log_reach, max_nodes, latency?, t0, rule, lambda_node,
                                lambda_depth, min_utility) -> (pool_index, num_selected)``
``taps::reindex_subtree``       ``(tokens, parents, depth, num_nodes, pool_index, num_selected) -> (tokens, parents,
                                depth, num_nodes)``
==============================  ====================================================================================

Shapes, dtypes and node order are those of the public ops (:func:`taps_kernels.candidate_pool`,
:func:`taps_kernels.score_edges`, :func:`taps_kernels.select_subtree`); every output shape follows from the
input shapes and the int arguments, so the fake (meta) implementations need no data. Each op runs the default
backend of its tensors' device (:func:`taps_kernels.backend.resolve`, ``TAPS_BACKEND`` included), the same one
the public op picks, so on one backend the results are the public op's bit for bit.

What each op checks and what it trusts: the ops check METADATA only (dtypes, ranks, shapes, devices, the
scorer weights' shapes against each other, the Python scalars), eagerly and in the fake implementation, and
never read tensor values, so they stay free of host synchronisation. Values (tree structure, log-probabilities,
token ranges, the latency table) are the backend's business: the C++ backend (the CPU default) raises a
``ValueError`` on a bad value, the Triton kernels clamp every index they compute (unspecified output, never an
out-of-bounds access), and the reference trusts them. Validate once with the public ops where inputs come from
outside, and use these in the hot loop.

Not graph-safe, by design of the backends: a pool the device kernel cannot hold (``best_first_pool`` on CUDA
with no Triton, or ``pool_size`` beyond the Triton kernel's frontier) is searched on the host, as the public op
does (one copy each way: it compiles, but cannot be captured in a CUDA graph); the utility rule's upstream
options (``max_leaves``, ``preset``, ...) exist in the public :func:`taps_kernels.select_subtree` only (the
reference's host loop). No op has a backward; the wrappers refuse inputs that require grad.

The wrappers at the bottom (:func:`candidate_pool`, :func:`score_edges`, :func:`select_subtree`) take the public
ops' arguments minus ``backend``/``validate`` and return the same types.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ._checks import (FLOAT_DTYPES, check_float, check_int, check_no_grad, check_nonempty,
                      check_output_size, check_tensor)
from .backend import pool_placement, resolve
from .layout import CandidatePool, Selection, Tree, validate_tree
from .scorer_weights import ScorerWeights

Tensor = torch.Tensor

RULES = ("reach", "utility")

WEIGHT_FIELDS = ("edge_ln_weight", "edge_ln_bias", "edge_fc1_weight", "edge_fc1_bias", "edge_fc2_weight",
                 "edge_fc2_bias", "other_ln_weight", "other_ln_bias", "other_fc1_weight", "other_fc1_bias",
                 "other_fc2_weight", "other_fc2_bias", "token_proj_weight", "token_proj_bias", "depth_embedding",
                 "hidden_proj_weight", "hidden_proj_bias")
"""Order of the scorer's tensors in ``taps::score_edges``'s ``weights`` list (:class:`ScorerWeights`' fields;
the last five are None for the tiny scorer). An empty list is the marginal model (``weights=None``)."""

_POOL_ROW_BYTES = 8 + 4 + 4 + 4 + 4 + 4  # tokens, parents, depth, logq, step_logq, rank per node


def _impl(op: str, device: torch.device, **context):
    return resolve(op, None, device, **context)[1]


def _fresh(outputs: Sequence[Tensor], inputs: Sequence[Optional[Tensor]]) -> Tuple[Tensor, ...]:
    """A custom op's outputs may alias neither its inputs nor each other; copy any that does (a metadata test)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor) and t.numel()}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if ptr is not None:
            seen.add(ptr)
        out.append(t)
    return tuple(out)


def _check_tree(tokens: Optional[Tensor], parents: Tensor, depth: Tensor, num_nodes: Tensor) -> Tuple[int, int]:
    """Metadata of the raw tree tensors; -> ``(B, N)`` with ``B, N >= 1``."""
    check_tensor("parents", parents, dtypes=(torch.int32,), ndim=2)
    B, N = parents.shape
    check_nonempty("parents", parents, [(0, "tree (batch row)"), (1, "node (the root)")])
    if tokens is not None:
        check_tensor("tokens", tokens, dtypes=(torch.int64,), shape=(B, N), device=parents.device)
    check_tensor("depth", depth, dtypes=(torch.int32,), shape=(B, N), device=parents.device)
    check_tensor("num_nodes", num_nodes, dtypes=(torch.int32,), shape=(B,), device=parents.device)
    return B, N


# --- taps::topk_stats ---------------------------------------------------------------------------------------------

def _check_topk(draft_logits: Tensor, top_k: int) -> Tuple[int, int, int]:
    check_tensor("draft_logits", draft_logits, dtypes=FLOAT_DTYPES, ndim=3)
    check_nonempty("draft_logits", draft_logits, [(0, "batch row"), (1, "draft position"), (2, "vocabulary entry")])
    top_k = check_int("top_k", top_k)
    B, D, V = draft_logits.shape
    return B, D, min(top_k, V)


@torch.library.custom_op("taps::topk_stats", mutates_args=())
def topk_stats_op(draft_logits: Tensor, top_k: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``draft_logits [B,D,V]`` f32/f16/bf16 (``B, D, V >= 1``), ``top_k >= 1`` (``K = min(top_k, V)``) ->
    ``(topk_logp [B,D,K] f32, topk_ids [B,D,K] int64, entropy [B,D] f32, margin [B,D] f32, topk_mass [B,D] f32)``.

    As :func:`taps_kernels.ops.pool.topk_stats` (margin 0 where no runner-up is possible). Trusts the logits to
    be finite or ``-inf`` (the public op checks them on CPU)."""
    _, _, K = _check_topk(draft_logits, top_k)
    logp, ids, entropy, margin, mass = _impl("topk_stats", draft_logits.device)(draft_logits, K)
    # the public op's rule: no possible runner-up gives margin 0, never inf (the scorer normalises it)
    margin = torch.where(torch.isinf(margin), torch.zeros_like(margin), margin)
    return _fresh((logp, ids, entropy, margin, mass), (draft_logits,))


@topk_stats_op.register_fake
def _topk_stats_fake(draft_logits, top_k):
    B, D, K = _check_topk(draft_logits, top_k)
    f32 = dict(dtype=torch.float32)
    return (draft_logits.new_empty((B, D, K), **f32), draft_logits.new_empty((B, D, K), dtype=torch.int64),
            draft_logits.new_empty((B, D), **f32), draft_logits.new_empty((B, D), **f32),
            draft_logits.new_empty((B, D), **f32))


# --- taps::best_first_pool ----------------------------------------------------------------------------------------

def _check_pool_args(topk_logp: Tensor, topk_ids: Tensor, root_tokens: Tensor, pool_size: int) -> Tuple[int, int]:
    check_tensor("topk_logp", topk_logp, dtypes=(torch.float32,), ndim=3)
    check_nonempty("topk_logp", topk_logp, [(0, "batch row"), (1, "draft position"), (2, "top-K entry")])
    B, D, K = topk_logp.shape
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int64,), shape=(B, D, K), device=topk_logp.device)
    check_tensor("root_tokens", root_tokens, dtypes=(torch.int64,), shape=(B,), device=topk_logp.device)
    pool_size = check_int("pool_size", pool_size)
    check_output_size("pool_size", pool_size, B * (pool_size + 1) * _POOL_ROW_BYTES, topk_logp.device)
    return B, pool_size + 1


@torch.library.custom_op("taps::best_first_pool", mutates_args=())
def best_first_pool_op(topk_logp: Tensor, topk_ids: Tensor, root_tokens: Tensor,
                       pool_size: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``topk_logp [B,D,K] f32``, ``topk_ids [B,D,K] int64``, ``root_tokens [B] int64``, ``pool_size`` in
    ``[1, 2**31 - 2]`` -> ``(tokens [B,N] int64, parents [B,N] int32, depth [B,N] int32, num_nodes [B] int32,
    logq [B,N] f32, step_logq [B,N] f32, rank [B,N] int32)``, ``N = pool_size + 1``, nodes in pop order.

    As :func:`taps_kernels.ops.pool.best_first_pool`, placed like :func:`taps_kernels.candidate_pool`: on CUDA a
    pool the device kernel cannot hold is searched on the host (one copy each way: not CUDA-graph safe). Trusts
    the lattice (log-probs finite or -inf, ids >= 0); the C++ search checks it."""
    _check_pool_args(topk_logp, topk_ids, root_tokens, pool_size)
    device = topk_logp.device
    name, search_device = pool_placement(None, device, pool_size)
    fn = resolve("best_first_pool", name, search_device, pool_size=pool_size)[1]
    args = [t.contiguous().to(search_device) for t in (topk_logp, topk_ids, root_tokens)]
    out = tuple(t.to(device) for t in fn(*args, pool_size))
    return _fresh(out, (topk_logp, topk_ids, root_tokens))


@best_first_pool_op.register_fake
def _best_first_pool_fake(topk_logp, topk_ids, root_tokens, pool_size):
    B, N = _check_pool_args(topk_logp, topk_ids, root_tokens, pool_size)
    i32, f32 = torch.int32, torch.float32
    return (topk_ids.new_empty((B, N)), topk_ids.new_empty((B, N), dtype=i32), topk_ids.new_empty((B, N), dtype=i32),
            topk_ids.new_empty((B,), dtype=i32), topk_logp.new_empty((B, N), dtype=f32),
            topk_logp.new_empty((B, N), dtype=f32), topk_ids.new_empty((B, N), dtype=i32))


# --- taps::score_edges --------------------------------------------------------------------------------------------

def _weights_of(weights: Sequence[Optional[Tensor]], eps: float) -> Optional[ScorerWeights]:
    """The :class:`ScorerWeights` of the flat ``weights`` list (shapes checked against each other), or None."""
    if len(weights) == 0:
        return None
    if len(weights) != len(WEIGHT_FIELDS):
        raise ValueError(f"weights: expected an empty list (marginal model) or the {len(WEIGHT_FIELDS)} tensors of "
                         f"ScorerWeights in the order of WEIGHT_FIELDS, received {len(weights)} entries")
    for name, t in zip(WEIGHT_FIELDS[:12], weights):
        if t is None:
            raise ValueError(f"weights.{name}: required by both scorer variants, received None")
    w = ScorerWeights(**dict(zip(WEIGHT_FIELDS, weights)), ln_eps=check_float("eps", eps, above=0.0))
    w.validate()
    return w


def _check_score_args(tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin, topk_mass,
                      weights, eps, token_embeddings, drafter_hidden) -> Tuple[int, int, Optional[ScorerWeights]]:
    B, N = _check_tree(tokens, parents, depth, num_nodes)
    dev = parents.device
    for name, t in (("logq", logq), ("step_logq", step_logq)):
        check_tensor(name, t, dtypes=(torch.float32,), shape=(B, N), device=dev)
    check_tensor("topk_logp", topk_logp, shape=(B, None, None), device=dev)
    check_nonempty("topk_logp", topk_logp, [(1, "draft position")])
    D = topk_logp.shape[1]
    for name, t in (("entropy", entropy), ("margin", margin), ("topk_mass", topk_mass)):
        check_tensor(name, t, dtypes=(torch.float32,), shape=(B, D), device=dev)
    w = _weights_of(weights, eps)
    if w is None:
        return B, N, None
    for name, t in w.tensors().items():
        check_tensor(f"weights.{name}", t, device=dev)
    if w.full:
        check_tensor("token_embeddings", token_embeddings, dtypes=FLOAT_DTYPES, ndim=2, device=dev)
        check_nonempty("token_embeddings", token_embeddings, [(0, "vocabulary row")])
        check_tensor("drafter_hidden", drafter_hidden, dtypes=FLOAT_DTYPES, shape=(B, D, None), device=dev)
        w.validate(embed_dim=token_embeddings.shape[1], hidden_dim=drafter_hidden.shape[2], num_positions=D)
    return B, N, w


@torch.library.custom_op("taps::score_edges", mutates_args=())
def score_edges_op(tokens: Tensor, parents: Tensor, depth: Tensor, num_nodes: Tensor, logq: Tensor,
                   step_logq: Tensor, topk_logp: Tensor, entropy: Tensor, margin: Tensor, topk_mass: Tensor,
                   weights: List[Optional[Tensor]], eps: float, token_embeddings: Optional[Tensor],
                   drafter_hidden: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """The pool's tensors (tree ``[B,N]``, ``logq/step_logq [B,N] f32``, ``topk_logp [B,D,K]`` (only ``D`` is
    read), ``entropy/margin/topk_mass [B,D] f32``), the scorer's tensors in :data:`WEIGHT_FIELDS` order (empty:
    marginal model; tiny scorer: the last five None), LayerNorm ``eps > 0``, ``token_embeddings [V,E]`` and
    ``drafter_hidden [B,D,H]`` (full scorer only) -> ``(edge_logq, other_logq, log_reach)``, each ``[B,N] f32``.

    As :func:`taps_kernels.ops.score.score_edges`. Checks every shape, including the weights against each other
    and against ``E``, ``H``, ``D``. Trusts the tree structure, token ids inside ``[0, V)`` and finite features."""
    _, _, w = _check_score_args(tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin,
                                topk_mass, weights, eps, token_embeddings, drafter_hidden)
    # rank and topk_ids are not read by any backend's scorer
    pool = CandidatePool(Tree(tokens, parents, depth, num_nodes), logq, step_logq, None, topk_logp, None, entropy,
                         margin, topk_mass)
    out = _impl("score_edges", parents.device)(pool, w, token_embeddings, drafter_hidden)
    return _fresh(out, [tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin, topk_mass,
                        token_embeddings, drafter_hidden, *weights])


@score_edges_op.register_fake
def _score_edges_fake(tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin, topk_mass,
                      weights, eps, token_embeddings, drafter_hidden):
    B, N, _ = _check_score_args(tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin,
                                topk_mass, weights, eps, token_embeddings, drafter_hidden)
    return tuple(logq.new_empty((B, N)) for _ in range(3))


# --- taps::select_subtree -----------------------------------------------------------------------------------------

def _check_select_args(parents, depth, num_nodes, log_reach, max_nodes, latency, t0, rule, lambda_node, lambda_depth,
                       min_utility) -> Tuple[int, int]:
    B, N = _check_tree(None, parents, depth, num_nodes)
    check_tensor("log_reach", log_reach, dtypes=(torch.float32,), shape=(B, N), device=parents.device)
    max_nodes = check_int("max_nodes", max_nodes)
    check_output_size("max_nodes", max_nodes, B * (max_nodes + 1) * (8 + 8 + 4 + 4), parents.device)
    if not isinstance(rule, str) or rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES}, received {rule!r}")
    check_float("t0", t0)
    check_float("lambda_node", lambda_node, above=0.0)
    check_float("lambda_depth", lambda_depth, at_least=0.0)
    check_float("min_utility", min_utility, finite=False)
    if latency is not None:
        check_tensor("latency", latency, dtypes=(torch.float64,), ndim=1, device=parents.device)
        check_nonempty("latency", latency, [(0, "table entry")])
        if rule != "reach":
            raise ValueError("latency: the throughput rule needs rule='reach'")
    return B, max_nodes + 1


@torch.library.custom_op("taps::select_subtree", mutates_args=())
def select_subtree_op(parents: Tensor, depth: Tensor, num_nodes: Tensor, log_reach: Tensor, max_nodes: int,
                      latency: Optional[Tensor], t0: float, rule: str, lambda_node: float, lambda_depth: float,
                      min_utility: float) -> Tuple[Tensor, Tensor]:
    """``parents/depth [B,N] int32``, ``num_nodes [B] int32``, ``log_reach [B,N] f32``, ``max_nodes`` in
    ``[1, 2**31 - 2]``, ``latency [L] float64`` on the tree's device or None, scalars as in
    :func:`taps_kernels.select_subtree` (``rule`` ``"reach"`` or ``"utility"``, without the utility options) ->
    ``(pool_index [B, max_nodes+1] int64 (kept pool rows ascending, -1 padded), num_selected [B] int32)``.

    Trusts the tree structure, ``log_reach`` (finite or -inf) and the latency table (finite, ``t0 + latency > 0``)."""
    _check_select_args(parents, depth, num_nodes, log_reach, max_nodes, latency, t0, rule, lambda_node, lambda_depth,
                       min_utility)
    out = _impl("select_subtree", parents.device)(parents, depth, num_nodes, log_reach, max_nodes, latency, float(t0),
                                                  rule, float(lambda_node), float(lambda_depth), float(min_utility))
    return _fresh(out, (parents, depth, num_nodes, log_reach, latency))


@select_subtree_op.register_fake
def _select_subtree_fake(parents, depth, num_nodes, log_reach, max_nodes, latency, t0, rule, lambda_node, lambda_depth,
                         min_utility):
    B, M = _check_select_args(parents, depth, num_nodes, log_reach, max_nodes, latency, t0, rule, lambda_node,
                              lambda_depth, min_utility)
    return parents.new_empty((B, M), dtype=torch.int64), parents.new_empty((B,), dtype=torch.int32)


# --- taps::reindex_subtree ----------------------------------------------------------------------------------------

def _check_reindex_args(tokens, parents, depth, num_nodes, pool_index, num_selected) -> Tuple[int, int]:
    B, _ = _check_tree(tokens, parents, depth, num_nodes)
    check_tensor("pool_index", pool_index, dtypes=(torch.int64,), shape=(B, None), device=parents.device)
    check_nonempty("pool_index", pool_index, [(1, "row (the root)")])
    check_tensor("num_selected", num_selected, dtypes=(torch.int32,), shape=(B,), device=parents.device)
    return B, pool_index.shape[1]


@torch.library.custom_op("taps::reindex_subtree", mutates_args=())
def reindex_subtree_op(tokens: Tensor, parents: Tensor, depth: Tensor, num_nodes: Tensor, pool_index: Tensor,
                       num_selected: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The pool tree (``[B,N]``), ``pool_index [B,M] int64`` (ascending, -1 padded) and ``num_selected [B] int32``
    of ``taps::select_subtree`` -> the kept subtree ``(tokens [B,M] int64, parents [B,M] int32, depth [B,M] int32,
    num_nodes [B] int32)``, pool order kept, root first.

    Trusts ``pool_index`` to be a prefix-closed selection of real pool rows (as ``taps::select_subtree`` gives)."""
    _check_reindex_args(tokens, parents, depth, num_nodes, pool_index, num_selected)
    out = _impl("reindex_subtree", parents.device)(tokens, parents, depth, num_nodes, pool_index, num_selected)
    return _fresh(out, (tokens, parents, depth, num_nodes, pool_index, num_selected))


@reindex_subtree_op.register_fake
def _reindex_subtree_fake(tokens, parents, depth, num_nodes, pool_index, num_selected):
    B, M = _check_reindex_args(tokens, parents, depth, num_nodes, pool_index, num_selected)
    i32 = torch.int32
    return (tokens.new_empty((B, M)), parents.new_empty((B, M), dtype=i32), parents.new_empty((B, M), dtype=i32),
            parents.new_empty((B,), dtype=i32))


# --- wrappers with the public ops' arguments (metadata checks only: no host synchronisation) -----------------------

def candidate_pool(draft_logits: Tensor, root_tokens: Tensor, top_k: int, pool_size: int,
                   vocab_ids: Optional[Tensor] = None) -> CandidatePool:
    """Graph-safe :func:`taps_kernels.candidate_pool`: ``draft_logits [B,D,V]`` float, ``root_tokens [B] int64`` ->
    :class:`CandidatePool` (tree of ``N = pool_size + 1`` rows in pop order, ``logq/step_logq [B,N] f32``,
    ``rank [B,N] int32``, ``topk_logp/topk_ids [B,D,K]``, ``entropy/margin/topk_mass [B,D] f32``).

    ``vocab_ids``: optional ``[V] int64`` token id of each logit column (a reduced draft vocabulary), as in the
    public op; ``topk_ids`` and the tree's tokens are then full-vocabulary ids.

    Trusts the logits (finite or -inf), ``root_tokens >= 0`` (``< V`` without ``vocab_ids``) and ``vocab_ids``
    strictly increasing and non-negative (the public op checks these values). ``draft_logits`` must not require
    grad."""
    check_tensor("draft_logits", draft_logits, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("root_tokens", root_tokens, dtypes=(torch.int64,), shape=(draft_logits.shape[0],),
                 device=draft_logits.device)
    if vocab_ids is not None:
        check_tensor("vocab_ids", vocab_ids, dtypes=(torch.int64,), shape=(draft_logits.shape[2],),
                     device=draft_logits.device)
    check_no_grad("candidate_pool", [("draft_logits", draft_logits)])
    top_k, pool_size = check_int("top_k", top_k), check_int("pool_size", pool_size)
    logp, ids, entropy, margin, mass = torch.ops.taps.topk_stats(draft_logits.contiguous(), top_k)
    if vocab_ids is not None:  # sorted ids: column order is token order, so ties already fell to the smaller id
        ids = vocab_ids[ids]
    tokens, parents, depth, num_nodes, logq, step_logq, rank = torch.ops.taps.best_first_pool(
        logp, ids, root_tokens.contiguous(), pool_size)
    return CandidatePool(Tree(tokens, parents, depth, num_nodes), logq, step_logq, rank, logp, ids, entropy, margin,
                         mass)


def score_edges(pool: CandidatePool, weights: Optional[ScorerWeights], token_embeddings: Optional[Tensor] = None,
                drafter_hidden: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Graph-safe :func:`taps_kernels.score_edges`: ``(edge_logq, other_logq, log_reach)``, each ``[B,N] f32``.

    ``weights``: :class:`ScorerWeights` (full: with ``token_embeddings [V,E]`` and ``drafter_hidden [B,D,H]``;
    tiny) or None (marginal model). Trusts the pool's values; refuses tensors that require grad (no backward)."""
    if not isinstance(pool, CandidatePool):
        raise TypeError(f"pool: expected a taps_kernels.CandidatePool, received {type(pool).__name__}")
    if weights is not None and not isinstance(weights, ScorerWeights):
        raise TypeError(f"weights: expected taps_kernels.ScorerWeights or None, received {type(weights).__name__}")
    validate_tree(pool.tree, "pool.tree", deep=False)
    flat = [] if weights is None else [getattr(weights, name) for name in WEIGHT_FIELDS]
    eps = 1e-5 if weights is None else weights.ln_eps
    named = [(f"pool.{n}", getattr(pool, n)) for n in ("logq", "step_logq", "entropy", "margin", "topk_mass")]
    named += [(f"weights.{n}", t) for n, t in zip(WEIGHT_FIELDS, flat)]
    named += [("token_embeddings", token_embeddings), ("drafter_hidden", drafter_hidden)]
    check_no_grad("score_edges", named)
    tree = pool.tree
    return torch.ops.taps.score_edges(tree.tokens, tree.parents, tree.depth, tree.num_nodes, pool.logq,
                                      pool.step_logq, pool.topk_logp, pool.entropy, pool.margin, pool.topk_mass, flat,
                                      eps, token_embeddings, drafter_hidden)


def select_subtree(tree: Tree, log_reach: Tensor, max_nodes: int,
                   latency: Optional[Union[Tensor, Sequence[float]]] = None, t0: float = 0.0, rule: str = "reach",
                   lambda_node: float = 1.0, lambda_depth: float = 0.002, min_utility: float = 0.0) -> Selection:
    """Graph-safe :func:`taps_kernels.select_subtree` (rules ``"reach"``/``"utility"`` without the utility options):
    ``log_reach [B,N]`` float, ``latency [L]`` seconds (a tensor, kept on the tree's device as float64: put it there
    once; a sequence is converted on every call) -> :class:`Selection` (subtree of ``max_nodes + 1`` rows in pool
    order, ``pool_index [B, max_nodes+1] int64``, ``num_selected [B] int32``).

    Trusts the tree structure, the reach (finite or -inf) and the latency table (finite, ``t0 + latency > 0``)."""
    validate_tree(tree, "tree", deep=False)
    B, N = tree.tokens.shape
    check_tensor("log_reach", log_reach, dtypes=FLOAT_DTYPES, shape=(B, N), device=tree.device)
    if latency is not None:
        if not isinstance(latency, Tensor):
            latency = torch.as_tensor(latency, dtype=torch.float64)
        latency = check_tensor("latency", latency, dtypes=FLOAT_DTYPES + (torch.float64,), ndim=1)
        latency = latency.to(device=tree.device, dtype=torch.float64)
    parents, depth, num_nodes = tree.parents.contiguous(), tree.depth.contiguous(), tree.num_nodes.contiguous()
    pool_index, num_selected = torch.ops.taps.select_subtree(parents, depth, num_nodes, log_reach.float().contiguous(),
                                                             max_nodes, latency, t0, rule, lambda_node, lambda_depth,
                                                             min_utility)
    sub = torch.ops.taps.reindex_subtree(tree.tokens.contiguous(), parents, depth, num_nodes, pool_index, num_selected)
    return Selection(Tree(*sub), pool_index, num_selected)


__all__ = ["candidate_pool", "score_edges", "select_subtree", "WEIGHT_FIELDS"]
