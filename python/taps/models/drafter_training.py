"""The drafter's training forward: many blocks per sequence in one pass, each seeing only the context
before its anchor."""
from __future__ import annotations

import torch


class DrafterTraining:
    """Training forward of :class:`taps.models.drafter.DFlashDrafter` (mixed into it): it reads its context
    projection, context K/V, embedding, RoPE, ``layers`` and ``norm``."""

    def forward_blocks(self, ctx_features: torch.Tensor, block_ids: torch.Tensor, anchors: torch.Tensor,
                       embed_tokens) -> torch.Tensor:
        """Training forward over many blocks per sequence in one pass.

        ctx_features ``[B,T,n*H]``: clean target features of positions ``0..T-1``.
        block_ids ``[B,M,S]`` int64: block ``m`` = ``[x[a_m], MASK...]``.
        anchors ``[B,M]`` int64: block ``m`` occupies positions ``a_m .. a_m+S-1``
        and sees context rows ``t < a_m`` only; blocks do not see each other;
        inside a block attention is bidirectional. ``a_m < 0`` marks a padding
        block (sees only itself; ignore its outputs).
        Returns the final-normed hidden states ``[B,M,S,H]`` (position 0 = the bonus row).
        """
        B, T, _ = ctx_features.shape
        _, M, S = block_ids.shape
        dev = ctx_features.device
        ctx_h = self.project_context(ctx_features)
        ctx_pos = torch.arange(T, device=dev).expand(B, T)
        kvs = self._context_kv(ctx_h, ctx_pos)
        a = anchors.clamp(min=0)
        pos = (a[:, :, None] + torch.arange(S, device=dev)).reshape(B, M * S)
        x = self._embed(embed_tokens, block_ids.reshape(B, M * S))
        cos, sin = self._rope(pos, x.dtype)
        # mask [B,1,M*S,T+M*S]
        ctx_vis = torch.arange(T, device=dev)[None, None, :] < anchors[:, :, None]  # [B,M,T]
        ctx_vis = ctx_vis[:, :, None, :].expand(B, M, S, T).reshape(B, M * S, T)
        blk = torch.arange(M, device=dev).repeat_interleave(S)
        blk_vis = (blk[:, None] == blk[None, :]).expand(B, M * S, M * S)
        mask = torch.cat([ctx_vis, blk_vis], dim=-1)[:, None]
        for l, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kvs[l][0], kvs[l][1], mask)
        return self.norm(x).view(B, M, S, -1)
