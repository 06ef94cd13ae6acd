"""TAPS edge scoring: scorer network, sibling normalisation and reach propagation (METHOD.md section 4)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .._checks import (FEATURE_LIMIT, FLOAT_DTYPES, check_data_device, check_feature_values, check_float,
                       check_log_values, check_no_nan, check_nonempty, check_tensor, check_tree_tensors,
                       differentiable_backend, first_index, grad_needed, values_checked)
from .._library import define, fresh
from ..backend import resolve
from ..layout import CandidatePool, Tree, validate_tree
from ..scorer_weights import ScorerWeights

WEIGHT_FIELDS = ("edge_ln_weight", "edge_ln_bias", "edge_fc1_weight", "edge_fc1_bias", "edge_fc2_weight",
                 "edge_fc2_bias", "other_ln_weight", "other_ln_bias", "other_fc1_weight", "other_fc1_bias",
                 "other_fc2_weight", "other_fc2_bias", "token_proj_weight", "token_proj_bias", "depth_embedding",
                 "hidden_proj_weight", "hidden_proj_bias")
"""Order of the scorer's tensors in ``taps::score_edges``'s ``weights`` list (:class:`ScorerWeights`' fields;
the last five are None for the tiny scorer). An empty list is the marginal model (``weights=None``)."""


def score_edges(pool: CandidatePool, weights: Optional[ScorerWeights], token_embeddings: Optional[torch.Tensor] = None,
                drafter_hidden: Optional[torch.Tensor] = None, backend: Optional[str] = None,
                validate: Optional[str] = None):
    """Path-conditioned edge probabilities and log-reach of every node of a candidate pool.

    Features, network, normalisation and the "other" bucket are defined in
    :mod:`taps_kernels.reference.score` (module docstring), which is the specification.

    Args:
        pool: :class:`CandidatePool` from :func:`candidate_pool`: tree ``[B, N]`` (topological order, node 0
            the root), ``logq``/``step_logq [B, N]``, per-position ``entropy``/``margin``/``topk_mass [B, D]``.
        weights: :class:`ScorerWeights`, full (token/depth/hidden features + 7 scalars) or tiny (7 scalars);
            None for the marginal model (``edge_logq = step_logq``, so ``log_reach = pool.logq``).
        token_embeddings: ``[V, E]`` float, the target's input embedding table (full scorer only).
        drafter_hidden: ``[B, D, H]`` float, the drafter's hidden state at each draft position (full scorer only).
        validate: value checks (tree structure, token range, non-finite pool values): ``"auto"`` (default, or
            ``TAPS_VALIDATE``) on CPU tensors only, ``"full"`` on any device, ``"none"`` never
            (:mod:`taps_kernels._checks`).
    ``B, D >= 1`` (checked before any backend runs). Non-finite values: without a scorer, ``pool.logq`` and
    ``pool.step_logq`` of real non-root nodes are log-probabilities (finite or -inf; NaN and +inf refused) and the
    per-position statistics must not be NaN; with a scorer they are features, so they must be finite and within
    ``+-1e15`` (the LayerNorm squares them in float32); the pools of :func:`candidate_pool` always are. The
    weights, embeddings and hidden states are trusted to be finite. A node deeper than ``D`` reads position
    ``D - 1`` (clamped) on every backend.
    Differentiable through the reference backend only: when a pool tensor, a weight or an embedding requires
    grad, ``backend=None`` runs the reference and another explicit backend is refused.
    Returns:
        ``edge_logq [B, N] f32``: ``log q_cond(parent -> node)``, 0 at the root;
        ``other_logq [B, N] f32``: log share of the node's "other" bucket (0 for a node without children);
        ``log_reach [B, N] f32``: ``log r``, 0 at the root, sum of ``edge_logq`` along the path.
        Padding rows are ``-inf`` in all three.
    """
    if not isinstance(pool, CandidatePool):
        raise TypeError(f"pool: expected a taps_kernels.CandidatePool, received {type(pool).__name__}")
    tree = pool.tree
    validate_tree(tree, "pool.tree", deep=False)  # values (structure, tokens, features): in the op, as validate says
    dev = check_data_device("pool.tree.tokens", tree.tokens)
    check_nonempty("pool.tree.tokens", tree.tokens, [(0, "tree (batch row)")])
    B, N = tree.tokens.shape
    check_tensor("pool.logq", pool.logq, dtypes=(torch.float32,), shape=(B, N), device=dev)
    check_tensor("pool.step_logq", pool.step_logq, dtypes=(torch.float32,), shape=(B, N), device=dev)
    check_tensor("pool.topk_logp", pool.topk_logp, ndim=3, device=dev)
    check_nonempty("pool.topk_logp", pool.topk_logp, [(1, "draft position")])
    D = pool.topk_logp.shape[1]
    for name in ("entropy", "margin", "topk_mass"):
        check_tensor(f"pool.{name}", getattr(pool, name), dtypes=(torch.float32,), shape=(B, D), device=dev)
    if weights is not None:
        if not isinstance(weights, ScorerWeights):
            raise TypeError(f"weights: expected taps_kernels.ScorerWeights or None, received {type(weights).__name__}")
        if weights.full:
            check_tensor("token_embeddings", token_embeddings, dtypes=FLOAT_DTYPES, ndim=2, device=dev)
            check_tensor("drafter_hidden", drafter_hidden, dtypes=FLOAT_DTYPES, shape=(B, D, None), device=dev)
            weights.validate(embed_dim=token_embeddings.shape[1], hidden_dim=drafter_hidden.shape[2], num_positions=D)
        else:
            weights.validate()
        wdev = {t.device for t in weights.tensors().values()}
        if wdev != {dev}:
            raise ValueError(f"weights: expected every tensor on {dev}, received tensors on {sorted(map(str, wdev))}")
    named = [(f"pool.{n}", getattr(pool, n)) for n in ("logq", "step_logq", "entropy", "margin", "topk_mass")]
    if weights is not None:
        named += [(f"weights.{n}", t) for n, t in weights.tensors().items()]
        named += [("token_embeddings", token_embeddings), ("drafter_hidden", drafter_hidden)]
    backend = differentiable_backend("score_edges", backend, named)
    if grad_needed(t for _, t in named) is not None:  # autograd runs through the reference (the op has no backward)
        if values_checked(validate, dev):
            _score_values(pool, weights, token_embeddings, drafter_hidden)
        return resolve("score_edges", backend, dev)[1](pool, weights, token_embeddings, drafter_hidden)
    flat = [] if weights is None else [getattr(weights, name) for name in WEIGHT_FIELDS]
    eps = 1e-5 if weights is None else weights.ln_eps
    return score_edges_op(tree.tokens, tree.parents, tree.depth, tree.num_nodes, pool.logq, pool.step_logq,
                          pool.topk_logp, pool.entropy, pool.margin, pool.topk_mass, flat, eps, token_embeddings,
                          drafter_hidden, backend, validate)


def _score_values(pool: CandidatePool, weights: Optional[ScorerWeights], token_embeddings, drafter_hidden) -> None:
    """The value checks of :func:`score_edges` (tree structure, token range, non-finite pool values)."""
    tree = pool.tree
    validate_tree(tree, "pool.tree", deep=True)
    edge = tree.parents >= 0
    for name in ("logq", "step_logq"):
        t = torch.where(edge, getattr(pool, name), torch.zeros_like(getattr(pool, name)))
        if weights is None:
            check_log_values(f"pool.{name}", t)
        else:
            check_feature_values(f"pool.{name}", t)
    for name in ("entropy", "margin", "topk_mass"):
        if weights is None:
            check_no_nan(f"pool.{name}", getattr(pool, name))
        else:
            check_feature_values(f"pool.{name}", getattr(pool, name))
    if weights is None or not weights.full:
        return
    V, N = token_embeddings.shape[0], tree.tokens.shape[1]
    bad = (tree.tokens < 0) | (tree.tokens >= V)
    if bool(bad.any()):
        b, i = first_index(bad)
        raise ValueError(f"pool.tree.tokens[{b},{i}]: token {int(tree.tokens[b, i])} is outside "
                         f"token_embeddings' {V} rows")
    # features too: the hidden states, and the embedding rows the pool reads (not the whole table)
    check_feature_values("drafter_hidden", drafter_hidden)
    used = token_embeddings[tree.tokens.flatten()]
    bad_rows = ~(used.abs() <= FEATURE_LIMIT).all(-1)
    if bool(bad_rows.any()):
        (r,) = first_index(bad_rows)
        t = int(tree.tokens.flatten()[r])
        raise ValueError(f"token_embeddings[{t}]: expected finite features within +-{FEATURE_LIMIT:g} "
                         f"(row of pool.tree.tokens[{r // N},{r % N}])")


def _weights_of(weights: Sequence[Optional[torch.Tensor]], eps: float) -> Optional[ScorerWeights]:
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


def _score_meta(tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin, topk_mass, weights,
                eps, token_embeddings, drafter_hidden) -> Tuple[int, int, Optional[ScorerWeights]]:
    B, N = check_tree_tensors(tokens, parents, depth, num_nodes)
    check_nonempty("parents", parents, [(0, "tree (batch row)")])
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


def _score_kernel(tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin, topk_mass,
                  weights: List[Optional[torch.Tensor]], eps, token_embeddings, drafter_hidden, backend=None,
                  validate=None):
    # the scorer's weights are rebuilt from the flat list here, so the metadata checks always run
    _, _, w = _score_meta(tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin, topk_mass,
                          weights, eps, token_embeddings, drafter_hidden)
    # rank and topk_ids are not read by any backend's scorer
    pool = CandidatePool(Tree(tokens, parents, depth, num_nodes), logq, step_logq, None, topk_logp, None, entropy,
                         margin, topk_mass)
    if values_checked(validate, parents.device):
        _score_values(pool, w, token_embeddings, drafter_hidden)
    name, fn = resolve("score_edges", backend, parents.device)
    return fresh(fn(pool, w, token_embeddings, drafter_hidden),
                 [tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin, topk_mass,
                  token_embeddings, drafter_hidden, *weights], name)


def _score_fake(tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin, topk_mass, weights,
                eps, token_embeddings, drafter_hidden, backend=None, validate=None):
    B, N, _ = _score_meta(tokens, parents, depth, num_nodes, logq, step_logq, topk_logp, entropy, margin, topk_mass,
                          weights, eps, token_embeddings, drafter_hidden)
    return tuple(logq.new_empty((B, N)) for _ in range(3))


score_edges_op = define("score_edges(Tensor tokens, Tensor parents, Tensor depth, Tensor num_nodes, Tensor logq, "
                        "Tensor step_logq, Tensor topk_logp, Tensor entropy, Tensor margin, Tensor topk_mass, "
                        "Tensor?[] weights, float eps, Tensor? token_embeddings, Tensor? drafter_hidden, "
                        "str? backend=None, str? validate=None) -> (Tensor, Tensor, Tensor)", _score_kernel, _score_fake)
"""``taps::score_edges``: the pool's tensors (tree ``[B,N]``, ``logq/step_logq [B,N] f32``, ``topk_logp [B,D,K]``
(only ``D`` is read), ``entropy/margin/topk_mass [B,D] f32``), the scorer's tensors in :data:`WEIGHT_FIELDS` order
(empty: marginal model; tiny scorer: the last five None), LayerNorm ``eps > 0``, ``token_embeddings [V,E]`` and
``drafter_hidden [B,D,H]`` (full scorer only) -> ``(edge_logq, other_logq, log_reach)``, each ``[B,N] f32``.
Checks every shape, the weights' against each other and against ``E``, ``H``, ``D``, then the values as
``validate`` says."""
