"""TAPS edge scoring: scorer network, sibling normalisation and reach propagation (METHOD.md section 4)."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import FLOAT_DTYPES, check_tensor
from ..backend import resolve
from ..layout import CandidatePool
from ..reference.score import ScorerWeights


def score_edges(pool: CandidatePool, weights: Optional[ScorerWeights], token_embeddings: Optional[torch.Tensor] = None,
                drafter_hidden: Optional[torch.Tensor] = None, backend: Optional[str] = None):
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
    Returns:
        ``edge_logq [B, N] f32``: ``log q_cond(parent -> node)``, 0 at the root;
        ``other_logq [B, N] f32``: log share of the node's "other" bucket (0 for a node without children);
        ``log_reach [B, N] f32``: ``log r``, 0 at the root, sum of ``edge_logq`` along the path.
        Padding rows are ``-inf`` in all three.
    """
    if not isinstance(pool, CandidatePool):
        raise TypeError(f"pool: expected a taps_kernels.CandidatePool, received {type(pool).__name__}")
    tree = pool.tree
    tree.validate("pool.tree", deep=tree.device.type == "cpu")
    B, N = tree.tokens.shape
    dev = tree.device
    check_tensor("pool.logq", pool.logq, dtypes=(torch.float32,), shape=(B, N), device=dev)
    check_tensor("pool.step_logq", pool.step_logq, dtypes=(torch.float32,), shape=(B, N), device=dev)
    check_tensor("pool.topk_logp", pool.topk_logp, ndim=3, device=dev)
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
            if dev.type == "cpu":
                V = token_embeddings.shape[0]
                bad = (tree.tokens < 0) | (tree.tokens >= V)
                if bad.any():
                    b, i = (int(x) for x in bad.nonzero()[0])
                    raise ValueError(f"pool.tree.tokens[{b},{i}]: token {int(tree.tokens[b, i])} is outside "
                                     f"token_embeddings' {V} rows")
        else:
            weights.validate()
        wdev = {t.device for t in weights.tensors().values()}
        if wdev != {dev}:
            raise ValueError(f"weights: expected every tensor on {dev}, received tensors on {sorted(map(str, wdev))}")
    _, fn = resolve("score_edges", backend, dev)
    return fn(pool, weights, token_embeddings, drafter_hidden)
