"""TAPS edge scoring: scorer network, sibling normalisation and reach propagation (METHOD.md section 4)."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import (FEATURE_LIMIT, FLOAT_DTYPES, check_data_device, check_feature_values, check_log_values, check_no_nan,
                       check_nonempty, check_tensor, differentiable_backend, first_index, values_checked)
from ..backend import resolve
from ..layout import CandidatePool, validate_tree
from ..scorer_weights import ScorerWeights


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
    validate_tree(tree, "pool.tree", validate=validate)
    dev = check_data_device("pool.tree.tokens", tree.tokens)
    check_nonempty("pool.tree.tokens", tree.tokens, [(0, "tree (batch row)")])
    check = values_checked(validate, dev)
    B, N = tree.tokens.shape
    check_tensor("pool.logq", pool.logq, dtypes=(torch.float32,), shape=(B, N), device=dev)
    check_tensor("pool.step_logq", pool.step_logq, dtypes=(torch.float32,), shape=(B, N), device=dev)
    check_tensor("pool.topk_logp", pool.topk_logp, ndim=3, device=dev)
    check_nonempty("pool.topk_logp", pool.topk_logp, [(1, "draft position")])
    D = pool.topk_logp.shape[1]
    for name in ("entropy", "margin", "topk_mass"):
        check_tensor(f"pool.{name}", getattr(pool, name), dtypes=(torch.float32,), shape=(B, D), device=dev)
    if check:
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
    if weights is not None:
        if not isinstance(weights, ScorerWeights):
            raise TypeError(f"weights: expected taps_kernels.ScorerWeights or None, received {type(weights).__name__}")
        if weights.full:
            check_tensor("token_embeddings", token_embeddings, dtypes=FLOAT_DTYPES, ndim=2, device=dev)
            check_tensor("drafter_hidden", drafter_hidden, dtypes=FLOAT_DTYPES, shape=(B, D, None), device=dev)
            weights.validate(embed_dim=token_embeddings.shape[1], hidden_dim=drafter_hidden.shape[2], num_positions=D)
            if check:
                V = token_embeddings.shape[0]
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
    _, fn = resolve("score_edges", backend, dev)
    return fn(pool, weights, token_embeddings, drafter_hidden)
