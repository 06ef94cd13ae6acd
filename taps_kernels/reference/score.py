"""Reference TAPS edge scorer: features, scorer network, sibling normalisation, reach (METHOD.md section 4).

This module is the definition that a trained scorer must follow; the Triton kernel and any
training code must produce exactly what :func:`score_edges_reference` produces.

Notation. Pool tree of row ``b`` (``taps_kernels.layout``); node ``v > 0`` has parent ``u``,
depth ``d = depth[v] >= 1`` and sits at draft position ``p = d - 1``. ``D`` is the number of
draft positions (``pool.topk_logp.shape[1]``). Per-position statistics come from the pool:
``entropy[b,p]``, ``margin[b,p]``, ``topk_mass[b,p]``. ``logq`` is the cumulative draft
log-prob of the root-to-node path (0 at the root), ``step_logq`` the node's own marginal
log-prob at its position. ``proj_tok(t) = token_proj_weight @ E[t] + token_proj_bias`` with
``E = token_embeddings`` (the target's input embedding table) and
``proj_hid(p) = hidden_proj_weight @ drafter_hidden[b, p] + hidden_proj_bias``.

Edge features of ``u -> v`` (full variant, ``F = 2*Pt + Pd + Ph + 7``, 111 for 32/8/32),
concatenated in this order:

====================  =====  ==============================================================
slot                  width  value
====================  =====  ==============================================================
child token           Pt     ``proj_tok(tokens[v])``
parent token          Pt     ``proj_tok(tokens[u])``
depth embedding       Pd     ``depth_embedding[d]`` (row index = the child's depth)
drafter hidden        Ph     ``proj_hid(p)``, the child's block position
scalar 0              1      ``step_logq[v]`` (child's draft log-prob at its position)
scalar 1              1      ``entropy[b,p]`` (nats)
scalar 2              1      ``margin[b,p]`` (top1 - top2 log-prob)
scalar 3              1      ``topk_mass[b,p]``
scalar 4              1      ``d / D``
scalar 5              1      ``logq[v]`` (cumulative draft log-prob of the path, v included)
scalar 6              1      ``logq[v] / d``
====================  =====  ==============================================================

"Other" features of a parent ``u`` (depth ``du < D``): the same layout for a *virtual child*
that stands for every token outside ``u``'s pool children, at depth ``d = du + 1`` and
position ``p = du`` (the position ``u``'s children are drafted at):

* child token slot: zeros (exactly 0, no bias);
* parent token slot: ``proj_tok(tokens[u])``;
* depth embedding ``depth_embedding[du + 1]``; drafter hidden ``proj_hid(du)``;
* scalar 0: ``log(max(1 - topk_mass[b,du], 1e-6))`` (draft mass outside the top-K);
* scalars 1-3: ``entropy``, ``margin``, ``topk_mass`` at position ``du``;
* scalar 4: ``(du + 1) / D``; scalar 5: ``logq[u]``; scalar 6: ``logq[u] / (du + 1)``.

Parents at depth ``D`` never have children and get no "other" logit.

Network (one per head, separate weights): ``LayerNorm(F) -> Linear(F, M) -> SiLU -> Linear(M, 1)``
(full: F=111, M=64). The tiny variant keeps only the 7 scalars (F=7, M=32, 303 parameters per
head); its :class:`ScorerWeights` has ``token_proj_*``, ``depth_embedding``, ``hidden_proj_*`` = None.

Normalisation and outputs, for every real parent ``u`` with pool children ``C(u)``:
``Z(u) = logsumexp([l_other(u)] + [l_edge(v) for v in C(u)])``,
``edge_logq[v] = l_edge(v) - Z(u)`` (``log q_cond(u -> v)``), ``other_logq[u] = l_other(u) - Z(u)``
(0 when ``C(u)`` is empty), ``log_reach = propagate_reach(parents, edge_logq)``. Root:
``edge_logq = 0``, ``log_reach = 0``. Padding rows: ``-inf`` in all three outputs.

No scorer (``weights=None``, the DDTree marginal model): ``edge_logq[v] = step_logq[v]``,
``other_logq[u] = log(max(1 - sum_{v in C(u)} exp(step_logq[v]), 0))`` (0 without children),
hence ``log_reach == pool.logq``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .reach import propagate_reach_reference

from ..scorer_weights import OTHER_MASS_FLOOR, ScorerWeights


def scorer_features(pool, weights: ScorerWeights, token_embeddings: Optional[torch.Tensor],
                    drafter_hidden: Optional[torch.Tensor]):
    """Feature rows of every node's incoming edge and of every node's "other" bucket (layout: module docstring).

    Returns ``(edge_feats [B,N,F] f32, edge_valid [B,N] bool, other_feats [B,N,F] f32, other_valid [B,N] bool)``.
    Row ``i`` of ``edge_feats`` is the edge ``parents[i] -> i``; row ``i`` of ``other_feats`` is node i's
    "other" bucket. Rows that are not valid (root edge, padding, depth ``D`` for "other") hold
    finite filler values and must be ignored.
    """
    tree = pool.tree
    B, N = tree.tokens.shape
    D = pool.topk_logp.shape[1]
    parents = tree.parents.long()
    depth = tree.depth.long()
    idx = torch.arange(N, device=parents.device)
    real = (idx[None, :] == 0) | (parents >= 0)
    edge_valid = parents >= 0
    other_valid = real & (depth < D)
    parent = parents.clamp(min=0)

    def at_position(stat, pos):  # stat [B,D] -> [B,N] at position pos [B,N]
        return stat.float().gather(1, pos.clamp(0, D - 1))

    # edge scalars, child v at depth d, position d-1
    d = depth.clamp(min=1).float()
    pos = depth - 1
    logq = torch.where(edge_valid, pool.logq.float(), torch.zeros_like(d))
    step = torch.where(edge_valid, pool.step_logq.float(), torch.zeros_like(d))
    edge_scalars = torch.stack([step, at_position(pool.entropy, pos), at_position(pool.margin, pos),
                                at_position(pool.topk_mass, pos), d / D, logq, logq / d], dim=-1)
    # "other" scalars, virtual child at depth du+1, position du
    d_o = (depth + 1).float()
    pos_o = depth
    mass_o = at_position(pool.topk_mass, pos_o)
    logq_u = torch.where(real, pool.logq.float(), torch.zeros_like(d))
    other_scalars = torch.stack([torch.log(torch.clamp(1 - mass_o, min=OTHER_MASS_FLOOR)),
                                 at_position(pool.entropy, pos_o), at_position(pool.margin, pos_o), mass_o,
                                 d_o / D, logq_u, logq_u / d_o], dim=-1)
    if not weights.full:
        return edge_scalars, edge_valid, other_scalars, other_valid

    w = weights.to(dtype=torch.float32)
    emb = token_embeddings.float()
    tok_proj = emb[tree.tokens] @ w.token_proj_weight.T + w.token_proj_bias      # [B,N,Pt], node's own token
    par_proj = tok_proj.gather(1, parent[..., None].expand_as(tok_proj))            # [B,N,Pt], parent's token
    hid_proj = drafter_hidden.float() @ w.hidden_proj_weight.T + w.hidden_proj_bias  # [B,D,Ph]
    Ph = hid_proj.shape[-1]
    hid_edge = hid_proj.gather(1, pos.clamp(0, D - 1)[..., None].expand(B, N, Ph))
    hid_other = hid_proj.gather(1, pos_o.clamp(0, D - 1)[..., None].expand(B, N, Ph))
    rows = w.depth_embedding.shape[0]
    dep_edge = w.depth_embedding[depth.clamp(0, rows - 1)]
    dep_other = w.depth_embedding[(depth + 1).clamp(0, rows - 1)]
    edge_feats = torch.cat([tok_proj, par_proj, dep_edge, hid_edge, edge_scalars], dim=-1)
    other_feats = torch.cat([torch.zeros_like(tok_proj), tok_proj, dep_other, hid_other, other_scalars], dim=-1)
    return edge_feats, edge_valid, other_feats, other_valid


def scorer_mlp(feats: torch.Tensor, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
               eps: float = 1e-5) -> torch.Tensor:
    """``LayerNorm -> Linear -> SiLU -> Linear`` on ``feats [..., F]`` -> logits ``[...]`` f32."""
    x = torch.nn.functional.layer_norm(feats.float(), (feats.shape[-1],), ln_weight.float(), ln_bias.float(), eps)
    h = torch.nn.functional.silu(x @ fc1_weight.float().T + fc1_bias.float())
    return (h @ fc2_weight.float().T + fc2_bias.float())[..., 0]


def normalise_siblings(parents: torch.Tensor, edge_logit: torch.Tensor, other_logit: torch.Tensor,
                       edge_valid: torch.Tensor, real: torch.Tensor):
    """Per-parent softmax over ``[other] + children``; returns ``(edge_logq, other_logq)`` ``[B,N]`` f32.

    Root edge 0, padding -inf (both outputs); a real node without children gets ``other_logq = 0``.
    """
    B, N = parents.shape
    parent = parents.long().clamp(min=0)
    neg_inf = torch.full((B, N), float("-inf"), device=parents.device)
    el = torch.where(edge_valid, edge_logit.float(), neg_inf)
    ol = torch.where(real, other_logit.float(), neg_inf)
    # segmented logsumexp over {u's other} + {u's children}, stabilised by the segment max
    seg_max = ol.clone().scatter_reduce(1, parent, el, reduce="amax", include_self=True)
    seg_max = torch.where(real, seg_max, torch.zeros_like(seg_max))
    total = torch.exp(ol - seg_max)
    child_terms = torch.where(edge_valid, torch.exp(el - seg_max.gather(1, parent)), torch.zeros_like(el))
    total = total.scatter_add(1, parent, child_terms)
    log_z = seg_max + torch.log(total)
    edge_logq = torch.where(edge_valid, el - log_z.gather(1, parent), neg_inf)
    edge_logq[:, 0] = 0.0
    other_logq = torch.where(real, ol - log_z, neg_inf)
    return edge_logq, other_logq


def score_edges_reference(pool, weights: Optional[ScorerWeights], token_embeddings: Optional[torch.Tensor],
                          drafter_hidden: Optional[torch.Tensor]):
    """Score every pool edge and propagate reach; see the module docstring for every definition.

    Args:
        pool: :class:`taps_kernels.CandidatePool` (tree ``[B,N]``, per-position stats ``[B,D]``).
        weights: :class:`ScorerWeights` (full or tiny) or None for the marginal (DDTree) model.
        token_embeddings: ``[V, E]`` float, the target's input embeddings (full variant only).
        drafter_hidden: ``[B, D, H]`` float, drafter hidden state at each block position (full variant only).
    Returns:
        ``edge_logq [B,N] f32`` (log q_cond of each node's incoming edge), ``other_logq [B,N] f32``,
        ``log_reach [B,N] f32``; node order is the pool's.
    """
    tree = pool.tree
    B, N = tree.tokens.shape
    parents = tree.parents
    idx = torch.arange(N, device=parents.device)
    real = (idx[None, :] == 0) | (parents >= 0)
    edge_valid = parents >= 0
    if weights is None:
        neg_inf = torch.full((B, N), float("-inf"), device=parents.device)
        step = pool.step_logq.float()
        edge_logq = torch.where(edge_valid, step, neg_inf)
        edge_logq[:, 0] = 0.0
        child_mass = torch.zeros(B, N, device=parents.device).scatter_add(
            1, parents.long().clamp(min=0), torch.where(edge_valid, step.exp(), torch.zeros_like(step)))
        other_logq = torch.where(real, torch.log(torch.clamp(1 - child_mass, min=0.0)), neg_inf)
    else:
        edge_feats, edge_valid, other_feats, other_valid = scorer_features(pool, weights, token_embeddings,
                                                                           drafter_hidden)
        w = weights
        edge_logit = scorer_mlp(edge_feats, w.edge_ln_weight, w.edge_ln_bias, w.edge_fc1_weight, w.edge_fc1_bias,
                                w.edge_fc2_weight, w.edge_fc2_bias, w.ln_eps)
        other_logit = scorer_mlp(other_feats, w.other_ln_weight, w.other_ln_bias, w.other_fc1_weight,
                                 w.other_fc1_bias, w.other_fc2_weight, w.other_fc2_bias, w.ln_eps)
        # depth-D parents have no children: any finite "other" logit gives other_logq = 0
        other_logit = torch.where(other_valid, other_logit, torch.zeros_like(other_logit))
        edge_logq, other_logq = normalise_siblings(parents, edge_logit, other_logit, edge_valid, real)
    log_reach = propagate_reach_reference(parents, edge_logq)
    return edge_logq, other_logq, log_reach
