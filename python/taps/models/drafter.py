"""DFlash block-diffusion drafter (METHOD.md section 2), checkpoint-compatible
with the published drafters.

Architecture
------------
* Qwen3-style decoder layers (RMSNorm pre-norm, GQA attention with per-head
  ``q_norm``/``k_norm``, RoPE, SwiGLU MLP), a final ``norm``; NO embedding and
  NO LM head: the target's ``embed_tokens`` and ``lm_head`` are passed in.
* Target conditioning by KV injection: the hidden states of the target layers
  ``target_layer_ids`` (``hidden_states[id+1]``) are concatenated
  (``n*H`` features), projected by ``fc`` (``n*H -> H``, no bias) and
  normalised by ``hidden_norm``. In every layer this context goes through that
  layer's own ``k_proj``/``v_proj`` (+ ``k_norm`` and RoPE at the context rows'
  true positions) and is placed IN FRONT of the block's keys/values. Queries
  come only from the block. Inside a block attention is bidirectional.
* A block is ``[bonus, MASK x (S-1)]`` at positions ``start .. start+S-1``
  where ``start`` = number of context rows; outputs at block positions
  ``1..S-1`` are the ``D = S-1`` draft marginals.

Weight names (published): ``fc.weight``, ``hidden_norm.weight``,
``norm.weight``, ``layers.N.self_attn.{q,k,v,o}_proj.weight``,
``layers.N.self_attn.{q,k}_norm.weight``,
``layers.N.{input,post_attention}_layernorm.weight``,
``layers.N.mlp.{gate,up,down}_proj.weight``.

Where each part lives: the configuration and its checks in :mod:`.drafter_config`, the layers in
:mod:`.drafter_layers`, the context cache and the inference passes in :mod:`.drafter_state`, the draft
vocabulary and vocabulary projection in :mod:`.drafter_vocab`, the training forward in
:mod:`.drafter_training`, the files in :mod:`.drafter_io`, the body/head choice for decoding in
:mod:`.drafter_prepare`, the GGUF block forward in :mod:`.drafter_blocks`. Their public names are importable
from here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from .drafter_config import (DRAFT_VOCAB_FILE, DFlashConfig, check_compatible,  # noqa: F401
                             default_target_layer_ids, extract_context_features)
from .drafter_io import read_draft_vocab, read_weights, write_drafter
from .drafter_layers import DFlashLayer, RMSNorm, rope_cos_sin
from .drafter_prepare import cpu_has_native_bf16, fast_head_dtype, prepare_drafter  # noqa: F401
from .drafter_state import DFlashState, DrafterInference  # noqa: F401
from .drafter_training import DrafterTraining
from .drafter_vocab import DrafterVocabulary


class DFlashDrafter(DrafterInference, DrafterVocabulary, DrafterTraining, nn.Module):
    """The drafter's weights and the helpers its passes share (context projection, context K/V, embedding,
    RoPE); the passes come from :class:`~.drafter_state.DrafterInference` (``new_state``, ``append_context``,
    ``rollback``, ``reset_row``, ``draft``), :class:`~.drafter_vocab.DrafterVocabulary` (``set_draft_vocab``)
    and :class:`~.drafter_training.DrafterTraining` (``forward_blocks``)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self._head_copy = None  # (key: weight identity/version, dtype, draft vocab), projection of rows
        self.fc = nn.Linear(cfg.num_context_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # optional fixed per-channel scale of the context features (a training aid:
        # the target's features span very different scales). Not a weight of the
        # published format: save_pretrained folds it into fc.weight.
        self.register_buffer("feature_scale", None, persistent=False)
        # Modes of the draft pass, per drafter (prepare_drafter sets them for decoding; a measurement may
        # change one and restore it). None of them changes a generated token, at most a proposal.
        #: dtype of the vocabulary projection in :meth:`draft` (``None``: the LM head's own dtype; ``torch.int8``:
        #: int8 weights and activations, see :func:`fast_head_dtype`). Training and :meth:`forward_blocks` never use it.
        self.head_dtype: Optional[torch.dtype] = None
        #: True: ``draft(num_positions=P)`` runs the block ``[bonus, MASK x P]`` (P + 1 rows) instead of the trained
        #: ``block_size`` rows: fewer rows through the layers (on a CPU, where the layers stream their weights once
        #: either way, 1.1 ms less at P = 8 and 2.2 ms at P = 4 for the shipped drafter). The proposals can differ
        #: from the full block's (its later MASK rows are absent from the block's bidirectional attention;
        #: ``eval-drafter --block-positions P --short-blocks`` measures the acceptance); decoding stays lossless.
        self.short_blocks: bool = False
        #: :class:`taps.models.drafter_blocks.BlockDraft` once :func:`taps.models.drafter_blocks.enable_block_draft`
        #: switched this drafter to the GGUF block forward, else None (the PyTorch layers)
        self.block_draft = None
        #: reduced draft vocabulary (sorted int64 ids, see :meth:`set_draft_vocab`), or None (full vocabulary)
        self.draft_vocab: Optional[torch.Tensor] = None

    def set_feature_scale(self, scale: Optional[torch.Tensor]) -> None:
        """Multiply context features channel-wise by ``scale [n*H]`` before ``fc``."""
        if scale is not None:
            if scale.shape != (self.config.num_context_features,):
                raise ValueError(f"feature scale must have shape ({self.config.num_context_features},)")
            scale = scale.to(device=self.fc.weight.device, dtype=torch.float32)
        self.feature_scale = scale

    def folded_state_dict(self) -> dict:
        """State dict in the published format (feature scale folded into ``fc.weight``)."""
        sd = {k: v.detach().clone() for k, v in self.state_dict().items()}
        if self.feature_scale is not None:
            sd["fc.weight"] = (sd["fc.weight"].float() * self.feature_scale[None, :]).to(sd["fc.weight"].dtype)
        return sd

    # ----------------------------------------------------------------- helpers
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        if self.config.mask_token_id is None:
            raise ValueError("drafter config has no mask_token_id (dflash_config.mask_token_id)")
        return int(self.config.mask_token_id)

    def _dtype(self):
        """The layers' compute dtype (``fc`` may store its weights narrower: :func:`enable_block_draft`)."""
        return self.hidden_norm.weight.dtype

    def _rope(self, positions, dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def project_context(self, ctx_features: torch.Tensor) -> torch.Tensor:
        """``[B,T,n*H]`` target features -> ``hidden_norm(fc(.))`` ``[B,T,H]``."""
        self.check_context_features(ctx_features)
        x = ctx_features
        if self.feature_scale is not None:
            x = x.float() * self.feature_scale
        return self.hidden_norm(self.fc(x.to(self._dtype())))

    def check_context_features(self, ctx_features: torch.Tensor) -> None:
        if ctx_features.shape[-1] != self.config.num_context_features:
            raise ValueError(f"context features have {ctx_features.shape[-1]} channels, drafter expects "
                             f"{self.config.num_context_features} = {len(self.config.target_layer_ids)} layers x "
                             f"{self.config.hidden_size}")

    def _context_kv(self, ctx_h, positions):
        cos, sin = self._rope(positions, ctx_h.dtype)
        return [layer.self_attn.project_kv(ctx_h, cos, sin) for layer in self.layers]

    def _embed(self, embed_tokens, ids):
        return embed_tokens(ids).to(self._dtype())

    def save_pretrained(self, path, dtype: Optional[torch.dtype] = torch.bfloat16) -> None:
        """Write the drafter directory :func:`load_drafter` reads (weights in ``dtype``; None: as they are; the
        feature scale folded into ``fc.weight``)."""
        write_drafter(path, self.config, self.folded_state_dict(), self.draft_vocab, dtype)


def load_drafter(path, dtype: torch.dtype = torch.float32, device: str = "cpu", target_config=None) -> DFlashDrafter:
    """Load a drafter directory (``config.json`` + ``model.safetensors``), e.g. a
    published DFlash checkpoint. Weights may carry a ``model.`` prefix. With
    ``target_config`` the drafter is checked by :func:`check_compatible`."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"drafter directory not found: {p}")
    cfg = DFlashConfig.from_pretrained(p)
    if target_config is not None:
        check_compatible(cfg, target_config)
    sd = read_weights(p)
    model = DFlashDrafter(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter weights in {p} do not match its config: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    model = model.to(device=device, dtype=dtype).eval()
    ids = read_draft_vocab(p, cfg)
    if ids is not None:
        model.set_draft_vocab(ids)
    return model


def load_decoding_drafter(path, target, body: str = "auto", head: str = "auto",
                          short_blocks: bool = True) -> "DFlashDrafter":
    """The one way to load a drafter for decoding with ``target``: :func:`load_drafter` checked against the
    target's config, then :func:`prepare_drafter` on the device of the target's embedding (``body`` ``auto``
    there, or a dtype name; see :func:`prepare_drafter`). Used by the CLI, the transformers entry, scorer
    traces and the benchmarks. ``short_blocks`` (default on): a draft of P positions runs the block
    ``[bonus, MASK x P]``; a policy that projects every position drafts the trained block either way."""
    drafter = load_drafter(str(path), target_config=target.config)
    emb = target.get_input_embeddings().weight
    return prepare_drafter(drafter, emb.device, body=body, head=head, short_blocks=short_blocks)
