"""The TAPS edge scorer as a trainable PyTorch module (METHOD.md section 4).

The feature layout, the two heads and the sibling normalisation are defined by
:mod:`taps_kernels.reference.score`; this module only holds the parameters in
``nn`` form and gives a differentiable forward for training. Inference never
runs this forward: the policies call :func:`taps_kernels.score_edges` with
:meth:`TapsScorer.to_weights`, so the fused kernel runs on a GPU and the
reference on CPU, and both compute exactly what this module was trained to.

Two variants:

* full: projected target token embeddings of child and parent (``Pt = 32``), a depth
  embedding (``Pd = 8``), the projected drafter hidden state (``Ph = 32``) and the seven
  scalar statistics, ``F = 111``, MLP width 64. Parameter count depends on the target's
  embedding width ``E`` and the drafter's hidden width ``H``: ``~ 32 (E + H) + 15K``
  (52K for SmolLM2-135M with E = H = 576; the published 177K is for E = H = 2560).
* tiny: the seven scalars only, ``F = 7``, width 32, 303 parameters per head.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from taps_kernels import CandidatePool, ScorerWeights
from taps_kernels.reference.score import scorer_features
from taps_kernels.scorer_weights import NUM_SCALARS

#: Filler logit for rows outside a segment; finite so that gradients never meet ``0 * inf``.
_MASKED = -1e9


def _head(features: int, width: int, eps: float) -> nn.Sequential:
    return nn.Sequential(nn.LayerNorm(features, eps=eps), nn.Linear(features, width), nn.SiLU(), nn.Linear(width, 1))


class TapsScorer(nn.Module):
    """Edge scorer; ``to_weights()`` gives the :class:`taps_kernels.ScorerWeights` that ``score_edges`` runs.

    Args:
        embed_dim: ``E``, width of the target's input embedding table (full variant).
        hidden_dim: ``H``, width of the drafter's hidden state (full variant).
        max_depth: ``D_max``, deepest edge depth (rows of the depth embedding = ``D_max + 1``).
        tiny: the 7-scalar variant (``embed_dim``/``hidden_dim`` ignored).
        token_dim, depth_dim, hidden_proj_dim, mlp_dim: ``Pt``, ``Pd``, ``Ph``, ``M`` (``M`` defaults to 64
            full, 32 tiny).
        top_k: the per-position top-K the candidate pool must use at inference (the ``topk_mass`` feature
            depends on it); stored in the config, not used by the forward.
    """

    def __init__(self, embed_dim: int = 0, hidden_dim: int = 0, max_depth: int = 15, tiny: bool = False,
                 token_dim: int = 32, depth_dim: int = 8, hidden_proj_dim: int = 32, mlp_dim: Optional[int] = None,
                 ln_eps: float = 1e-5, top_k: int = 64):
        super().__init__()
        self.tiny = bool(tiny)
        self.ln_eps = float(ln_eps)
        self.top_k = int(top_k)
        self.max_depth = int(max_depth)
        if self.tiny:
            F, M = NUM_SCALARS, mlp_dim or 32
            self.token_proj = self.depth_embedding = self.hidden_proj = None
            self.embed_dim = self.hidden_dim = 0
        else:
            if embed_dim < 1 or hidden_dim < 1:
                raise ValueError(f"embed_dim, hidden_dim: the full scorer needs both >= 1, received "
                                 f"{embed_dim}, {hidden_dim}")
            F, M = 2 * token_dim + depth_dim + hidden_proj_dim + NUM_SCALARS, mlp_dim or 64
            self.token_proj = nn.Linear(embed_dim, token_dim)
            self.depth_embedding = nn.Embedding(max_depth + 1, depth_dim)
            self.hidden_proj = nn.Linear(hidden_dim, hidden_proj_dim)
            self.embed_dim, self.hidden_dim = int(embed_dim), int(hidden_dim)
        self.dims = dict(token_dim=token_dim, depth_dim=depth_dim, hidden_proj_dim=hidden_proj_dim, mlp_dim=M)
        self.edge_head = _head(F, M, ln_eps)
        self.other_head = _head(F, M, ln_eps)

    # --- conversion -------------------------------------------------------------------------------------------

    def config(self) -> dict:
        """JSON-able constructor arguments (what :mod:`taps.scoring.io` writes to ``config.json``)."""
        return dict(embed_dim=self.embed_dim, hidden_dim=self.hidden_dim, max_depth=self.max_depth, tiny=self.tiny,
                    ln_eps=self.ln_eps, top_k=self.top_k, **self.dims)

    def live_weights(self) -> ScorerWeights:
        """The parameters themselves (not copies) as ScorerWeights, so the reference feature code stays
        differentiable with respect to them."""
        kw = {}
        for name, head in (("edge", self.edge_head), ("other", self.other_head)):
            ln, fc1, _, fc2 = head
            kw.update({f"{name}_ln_weight": ln.weight, f"{name}_ln_bias": ln.bias, f"{name}_fc1_weight": fc1.weight,
                       f"{name}_fc1_bias": fc1.bias, f"{name}_fc2_weight": fc2.weight, f"{name}_fc2_bias": fc2.bias})
        if not self.tiny:
            kw.update(token_proj_weight=self.token_proj.weight, token_proj_bias=self.token_proj.bias,
                      depth_embedding=self.depth_embedding.weight, hidden_proj_weight=self.hidden_proj.weight,
                      hidden_proj_bias=self.hidden_proj.bias)
        return ScorerWeights(ln_eps=self.ln_eps, **kw)

    def to_weights(self, device=None) -> ScorerWeights:
        """Detached float32 copies in the :class:`ScorerWeights` layout (``nn.Linear`` ``[out, in]``)."""
        w = self.live_weights()
        kw = {k: v.detach().to(device=device, dtype=torch.float32).clone() for k, v in w.tensors().items()}
        return ScorerWeights(ln_eps=self.ln_eps, **kw)

    @classmethod
    def from_weights(cls, weights: ScorerWeights, top_k: int = 64) -> "TapsScorer":
        """Module holding exactly ``weights`` (shapes read from them)."""
        weights.validate()
        pt, pd, ph, F, M = weights.dims
        if weights.full:
            m = cls(embed_dim=weights.token_proj_weight.shape[1], hidden_dim=weights.hidden_proj_weight.shape[1],
                    max_depth=weights.depth_embedding.shape[0] - 1, token_dim=pt, depth_dim=pd, hidden_proj_dim=ph,
                    mlp_dim=M, ln_eps=weights.ln_eps, top_k=top_k)
        else:
            m = cls(tiny=True, mlp_dim=M, ln_eps=weights.ln_eps, top_k=top_k)
        with torch.no_grad():
            live = m.live_weights()
            for k, t in weights.tensors().items():
                getattr(live, k).copy_(t.float())
        return m

    # --- training forward -------------------------------------------------------------------------------------

    def logits(self, pool: CandidatePool, token_embeddings: Optional[torch.Tensor],
               drafter_hidden: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw head outputs: ``(edge_logit [B,N], other_logit [B,N], edge_valid [B,N] bool, other_valid [B,N] bool)``."""
        feats_e, edge_valid, feats_o, other_valid = scorer_features(pool, self.live_weights(), token_embeddings,
                                                                    drafter_hidden)
        return self.edge_head(feats_e)[..., 0], self.other_head(feats_o)[..., 0], edge_valid, other_valid

    def forward(self, pool: CandidatePool, token_embeddings: Optional[torch.Tensor] = None,
                drafter_hidden: Optional[torch.Tensor] = None):
        """Differentiable version of :func:`taps_kernels.score_edges` (same definitions, same outputs).

        Args:
            pool: :class:`CandidatePool` (tree ``[B,N]``, stats ``[B,D]``), topological node order.
            token_embeddings: ``[V, E]`` float (full variant; the target's input embeddings, frozen).
            drafter_hidden: ``[B, D, H]`` float (full variant).
        Returns:
            ``edge_logq, other_logq, log_reach``, each ``[B,N] f32``, node order of the pool; root 0 / its
            "other" share, padding rows ``-inf``.
        """
        edge_logit, other_logit, edge_valid, other_valid = self.logits(pool, token_embeddings, drafter_hidden)
        tree = pool.tree
        return normalise_and_propagate(tree.parents, tree.depth, edge_logit, other_logit, edge_valid, other_valid)


def normalise_and_propagate(parents: torch.Tensor, depth: torch.Tensor, edge_logit: torch.Tensor,
                            other_logit: torch.Tensor, edge_valid: torch.Tensor, other_valid: torch.Tensor):
    """Sibling softmax over ``[other(u)] + children(u)`` and reach propagation, gradient-safe.

    Same values as :func:`taps_kernels.reference.score.normalise_siblings` followed by
    ``propagate_reach``, but masked rows carry a finite filler until the very end (so that no
    ``0 * inf`` reaches the backward pass) and reach is propagated one depth level at a time
    (``D`` steps instead of ``N``). ``parents, depth [B,N] int``; logits ``[B,N]``; returns
    ``edge_logq, other_logq, log_reach [B,N] f32`` with ``-inf`` padding.
    """
    B, N = parents.shape
    dev = parents.device
    parent = parents.long().clamp(min=0)
    idx = torch.arange(N, device=dev)
    real = (idx[None, :] == 0) | (parents >= 0)
    masked = torch.full((B, N), _MASKED, device=dev)
    # A parent at depth D has no children; any finite logit then gives other_logq = 0 (as the reference).
    ol = torch.where(real, torch.where(other_valid, other_logit.float(), torch.zeros_like(masked)), masked)
    el = torch.where(edge_valid, edge_logit.float(), masked)
    with torch.no_grad():
        seg_max = ol.scatter_reduce(1, parent, torch.where(edge_valid, el, masked), reduce="amax", include_self=True)
    total = torch.exp(ol - seg_max)
    child_terms = torch.where(edge_valid, torch.exp(el - seg_max.gather(1, parent)), torch.zeros_like(el))
    total = total.scatter_add(1, parent, child_terms)
    log_z = seg_max + torch.log(total)
    neg_inf = torch.full((B, N), float("-inf"), device=dev)
    edge_fin = torch.where(edge_valid, el - log_z.gather(1, parent), torch.zeros_like(el))
    other_logq = torch.where(real, ol - log_z, neg_inf)
    depth = depth.long()
    reach = torch.zeros(B, N, device=dev)
    max_d = int(depth.max()) if depth.numel() else 0
    for d in range(1, max_d + 1):
        at = edge_valid & (depth == d)
        reach = torch.where(at, reach.gather(1, parent) + edge_fin, reach)
    edge_logq = torch.where(edge_valid, edge_fin, neg_inf)
    edge_logq = torch.where(idx[None, :] == 0, torch.zeros_like(edge_logq), edge_logq)
    log_reach = torch.where(real, reach, neg_inf)
    return edge_logq, other_logq, log_reach


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
