"""The TAPS scorer's weights (:class:`ScorerWeights`) and the constants its definition uses.

The scorer itself (features, network, sibling normalisation, reach) is defined in
:mod:`taps_kernels.reference.score`; this module holds only the public types every backend and
the driver share, so none of them imports a reference to get a type.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Tuple

import torch

OTHER_MASS_FLOOR = 1e-6
NUM_SCALARS = 7


@dataclass
class ScorerWeights:
    """Weights of a TAPS edge scorer; every tensor float (used in float32), ``nn.Linear`` layout ``[out, in]``.

    Embedding parts (all present for the full variant, all None for the tiny one):

    * ``token_proj_weight [Pt, E]``, ``token_proj_bias [Pt]``: projection of the target's input
      embeddings (``E`` = embedding width of ``token_embeddings``), shared by child and parent slots;
    * ``depth_embedding [D_max + 1, Pd]``: row ``d`` for depth ``d`` (row 0 unused); needs ``D_max >= D``;
    * ``hidden_proj_weight [Ph, H]``, ``hidden_proj_bias [Ph]``: projection of the drafter hidden state.

    Heads (``F = 2*Pt + Pd + Ph + 7`` full, ``7`` tiny; ``M`` hidden width), ``edge_*`` for the
    edge logit and ``other_*`` for the parent's "other" logit, same shapes:

    * ``*_ln_weight [F]``, ``*_ln_bias [F]``: LayerNorm affine (epsilon ``ln_eps``);
    * ``*_fc1_weight [M, F]``, ``*_fc1_bias [M]``; then SiLU;
    * ``*_fc2_weight [1, M]``, ``*_fc2_bias [1]``.

    A PyTorch module with ``nn.LayerNorm(F)``, ``nn.Linear(F, M)``, ``nn.Linear(M, 1)`` (and
    ``nn.Linear(E, Pt)``, ``nn.Embedding(D_max + 1, Pd)``, ``nn.Linear(H, Ph)``) maps onto these
    fields tensor for tensor. The feature order is in this module's docstring.
    """

    edge_ln_weight: torch.Tensor
    edge_ln_bias: torch.Tensor
    edge_fc1_weight: torch.Tensor
    edge_fc1_bias: torch.Tensor
    edge_fc2_weight: torch.Tensor
    edge_fc2_bias: torch.Tensor
    other_ln_weight: torch.Tensor
    other_ln_bias: torch.Tensor
    other_fc1_weight: torch.Tensor
    other_fc1_bias: torch.Tensor
    other_fc2_weight: torch.Tensor
    other_fc2_bias: torch.Tensor
    token_proj_weight: Optional[torch.Tensor] = None
    token_proj_bias: Optional[torch.Tensor] = None
    depth_embedding: Optional[torch.Tensor] = None
    hidden_proj_weight: Optional[torch.Tensor] = None
    hidden_proj_bias: Optional[torch.Tensor] = None
    ln_eps: float = 1e-5

    @property
    def full(self) -> bool:
        """True for the variant with token/depth/hidden features, False for the 7-scalar one."""
        return self.token_proj_weight is not None

    @property
    def dims(self) -> Tuple[int, int, int, int, int]:
        """``(Pt, Pd, Ph, F, M)``; the first three are 0 for the tiny variant."""
        if self.full:
            pt, pd, ph = self.token_proj_weight.shape[0], self.depth_embedding.shape[1], self.hidden_proj_weight.shape[0]
        else:
            pt = pd = ph = 0
        return pt, pd, ph, 2 * pt + pd + ph + NUM_SCALARS, self.edge_fc1_weight.shape[0]

    def tensors(self):
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.tensors().values())

    def to(self, device=None, dtype=None) -> "ScorerWeights":
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, t in kw.items():
            if isinstance(t, torch.Tensor):
                kw[k] = t.to(device=device, dtype=dtype)
        return ScorerWeights(**kw)

    def validate(self, embed_dim: Optional[int] = None, hidden_dim: Optional[int] = None,
                 num_positions: Optional[int] = None, name: str = "weights") -> None:
        """Check every tensor's shape against the others (and E, H, D when given); errors name the field."""
        optional = ("token_proj_weight", "token_proj_bias", "depth_embedding", "hidden_proj_weight", "hidden_proj_bias")
        present = [k for k in optional if getattr(self, k) is not None]
        if present and len(present) != len(optional):
            missing = [k for k in optional if getattr(self, k) is None]
            raise ValueError(f"{name}: the full scorer needs all of {optional}; missing {missing} "
                             f"(the tiny scorer has none of them)")
        for k, t in self.tensors().items():
            if not t.is_floating_point():
                raise TypeError(f"{name}.{k}: expected a floating-point tensor, received {t.dtype}")
        pt, pd, ph, F, M = self.dims

        def want(field, shape):
            got = tuple(getattr(self, field).shape)
            if got != tuple(shape):
                raise ValueError(f"{name}.{field}: expected shape {tuple(shape)}, received {got}")

        if self.full:
            E = self.token_proj_weight.shape[1]
            H = self.hidden_proj_weight.shape[1]
            want("token_proj_bias", (pt,))
            want("hidden_proj_bias", (ph,))
            if self.depth_embedding.dim() != 2:
                raise ValueError(f"{name}.depth_embedding: expected [D_max+1, Pd], received "
                                 f"{tuple(self.depth_embedding.shape)}")
            if embed_dim is not None and E != embed_dim:
                raise ValueError(f"{name}.token_proj_weight: expected {embed_dim} input features (token_embeddings "
                                 f"width), received shape {tuple(self.token_proj_weight.shape)}")
            if hidden_dim is not None and H != hidden_dim:
                raise ValueError(f"{name}.hidden_proj_weight: expected {hidden_dim} input features (drafter_hidden "
                                 f"width), received shape {tuple(self.hidden_proj_weight.shape)}")
            if num_positions is not None and self.depth_embedding.shape[0] < num_positions + 1:
                raise ValueError(f"{name}.depth_embedding: expected at least {num_positions + 1} rows (depths "
                                 f"0..{num_positions}), received {self.depth_embedding.shape[0]}")
        for head in ("edge", "other"):
            want(f"{head}_ln_weight", (F,))
            want(f"{head}_ln_bias", (F,))
            want(f"{head}_fc1_weight", (M, F))
            want(f"{head}_fc1_bias", (M,))
            want(f"{head}_fc2_weight", (1, M))
            want(f"{head}_fc2_bias", (1,))

    @classmethod
    def random(cls, embed_dim: int = 0, hidden_dim: int = 0, max_depth: int = 16, tiny: bool = False,
               token_dim: int = 32, depth_dim: int = 8, hidden_proj_dim: int = 32, mlp_dim: Optional[int] = None,
               generator: Optional[torch.Generator] = None) -> "ScorerWeights":
        """Random weights of the published shapes (tests and benchmarks); ``mlp_dim`` defaults to 64 full, 32 tiny."""
        g = generator

        def r(*shape, scale=1.0):
            return torch.randn(*shape, generator=g) * scale

        kw = {}
        if tiny:
            F, M = NUM_SCALARS, mlp_dim or 32
        else:
            F, M = 2 * token_dim + depth_dim + hidden_proj_dim + NUM_SCALARS, mlp_dim or 64
            kw.update(token_proj_weight=r(token_dim, embed_dim, scale=embed_dim ** -0.5), token_proj_bias=r(token_dim, scale=0.1),
                      depth_embedding=r(max_depth + 1, depth_dim),
                      hidden_proj_weight=r(hidden_proj_dim, hidden_dim, scale=hidden_dim ** -0.5),
                      hidden_proj_bias=r(hidden_proj_dim, scale=0.1))
        for head in ("edge", "other"):
            kw.update({f"{head}_ln_weight": 1 + r(F, scale=0.1), f"{head}_ln_bias": r(F, scale=0.1),
                       f"{head}_fc1_weight": r(M, F, scale=F ** -0.5), f"{head}_fc1_bias": r(M, scale=0.1),
                       f"{head}_fc2_weight": r(1, M, scale=M ** -0.5), f"{head}_fc2_bias": r(1, scale=0.1)})
        return cls(**kw)
