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
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


#: file beside ``config.json`` holding the reduced draft vocabulary (``ids``: sorted int64)
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def default_target_layer_ids(num_target_layers: int, n: int) -> List[int]:
    """``n`` target layer ids spread evenly from 1 to ``L-3`` (published rule),
    rounded to the nearest integer. ``n == 1`` gives ``[L // 2]``.

    >>> default_target_layer_ids(36, 5)
    [1, 9, 17, 25, 33]
    """
    if n < 1:
        raise ValueError("need at least one target layer")
    if num_target_layers < 4 and n > 1:
        raise ValueError(f"target has {num_target_layers} layers: too few to spread {n} layer ids over 1..L-3")
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]


def extract_context_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate ``hidden_states[id+1]`` for ``id`` in ``layer_ids`` (index 0
    of an HF ``output_hidden_states`` tuple is the embedding output).
    Returns ``[B, T, n*H]``."""
    n = len(hidden_states)
    for i in layer_ids:
        if not 0 <= i + 1 < n:
            raise ValueError(f"target layer id {i} out of range for {n - 1} target layers")
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


# --------------------------------------------------------------------------- config


@dataclass
class DFlashConfig:
    hidden_size: int = 576
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    num_hidden_layers: int = 3
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    vocab_size: int = 49152
    block_size: int = 16
    num_target_layers: int = 30
    target_layer_ids: List[int] = field(default_factory=lambda: [1, 8, 14, 20, 27])
    mask_token_id: Optional[int] = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    #: size of the reduced draft vocabulary stored beside the weights (``draft_vocab.safetensors``), or None
    draft_vocab_size: Optional[int] = None
    extra: dict = field(default_factory=dict)

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def num_draft_positions(self) -> int:
        return self.block_size - 1

    def to_dict(self) -> dict:
        d = dict(self.extra)
        d.update({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
        })
        if self.draft_vocab_size is not None:
            d["draft_vocab_size"] = int(self.draft_vocab_size)
            d["draft_vocab_file"] = DRAFT_VOCAB_FILE
        else:
            d.pop("draft_vocab_size", None)
            d.pop("draft_vocab_file", None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        d = dict(d)
        dfc = dict(d.pop("dflash_config", None) or {})
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kw = {}
        for k in list(d):
            if k in known:
                kw[k] = d.pop(k)
        if "target_layer_ids" in dfc:
            kw["target_layer_ids"] = dfc.pop("target_layer_ids")
        if "mask_token_id" in dfc:
            kw["mask_token_id"] = dfc.pop("mask_token_id")
        if "rope_theta" not in kw:
            rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
            if isinstance(rp, dict) and "rope_theta" in rp:
                kw["rope_theta"] = rp["rope_theta"]
        if "head_dim" not in kw and "hidden_size" in kw and "num_attention_heads" in kw:
            kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
        if "target_layer_ids" not in kw:
            kw["target_layer_ids"] = default_target_layer_ids(kw.get("num_target_layers", 30),
                                                              kw.get("num_hidden_layers", 3))
        kw["target_layer_ids"] = [int(x) for x in kw["target_layer_ids"]]
        for k in ("architectures", "model_type", "tie_word_embeddings"):
            d.pop(k, None)
        if dfc:
            d["dflash_config_extra"] = dfc
        return cls(**kw, extra=d)

    @classmethod
    def from_pretrained(cls, path) -> "DFlashConfig":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"drafter config not found: {p} (a drafter dir holds config.json + model.safetensors)")
        return cls.from_dict(json.loads(p.read_text()))

    def save(self, path) -> None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        (p / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _target_field(tc, name, default=None):
    if isinstance(tc, dict):
        v = tc.get(name, default)
    else:
        v = getattr(tc, name, default)
    return v


def check_compatible(drafter_config: DFlashConfig, target_config) -> None:
    """Raise ``ValueError`` naming the offending field when the drafter cannot
    run on this target (``target_config``: HF config or dict)."""
    dc = drafter_config
    th = _target_field(target_config, "hidden_size")
    tv = _target_field(target_config, "vocab_size")
    tl = _target_field(target_config, "num_hidden_layers")
    if th is not None and dc.hidden_size != th:
        raise ValueError(f"incompatible drafter: hidden_size {dc.hidden_size} != target hidden_size {th} "
                         f"(the drafter borrows the target's embeddings and LM head)")
    if tv is not None and dc.vocab_size != tv:
        raise ValueError(f"incompatible drafter: vocab_size {dc.vocab_size} != target vocab_size {tv}")
    if tl is not None:
        if dc.num_target_layers != tl:
            raise ValueError(f"incompatible drafter: num_target_layers {dc.num_target_layers} != target "
                             f"num_hidden_layers {tl}")
        bad = [i for i in dc.target_layer_ids if not 0 <= i < tl]
        if bad:
            raise ValueError(f"incompatible drafter: target_layer_ids {bad} out of range [0, {tl}) of the target")
    if not dc.target_layer_ids:
        raise ValueError("incompatible drafter: target_layer_ids is empty")
    if dc.mask_token_id is None:
        raise ValueError("incompatible drafter: mask_token_id is missing (dflash_config.mask_token_id)")
    vv = tv if tv is not None else dc.vocab_size
    if not 0 <= int(dc.mask_token_id) < vv:
        raise ValueError(f"incompatible drafter: mask_token_id {dc.mask_token_id} outside the vocabulary [0, {vv})")
    if dc.block_size < 2:
        raise ValueError(f"incompatible drafter: block_size {dc.block_size} < 2")
    if dc.num_attention_heads % dc.num_key_value_heads:
        raise ValueError(f"incompatible drafter: num_attention_heads {dc.num_attention_heads} not a multiple of "
                         f"num_key_value_heads {dc.num_key_value_heads}")


# --------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt) if self.weight.dtype == dt else (self.weight.float() * xf).to(dt)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """positions ``[B, L]`` int -> cos, sin ``[B, 1, L, head_dim]``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.to(torch.float32)[..., None] * inv  # [B,L,hd/2]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)


def apply_rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


def _attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d) [masked]) v with fp32 softmax. Plain matmuls: for the
    small query/key counts here this is several times faster on CPU than SDPA with
    a boolean mask. mask: bool, True = attend (broadcast to [B,H,Lq,Lk])."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(H, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, H, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def project_kv(self, x, cos, sin):
        """x ``[B,L,H]`` -> k, v ``[B,nkv,L,hd]`` (k normed and rotated)."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, L, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask=None):
        """Training path. x: block rows ``[B,Lq,H]``; k_ctx/v_ctx ``[B,nkv,T,hd]`` (context rows,
        already rotated); mask: bool ``[B,1,Lq,T+Lq]`` (True = attend) or None (all)."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.nh, self.hd)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_b, v_b = self.project_kv(x, cos, sin)
        k = torch.cat([k_ctx.to(k_b.dtype), k_b], dim=2)
        v = torch.cat([v_ctx.to(v_b.dtype), v_b], dim=2)
        rep = self.nh // self.nkv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = _attention(q, k, v, mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, self.nh * self.hd))

    def forward_cached(self, x, cos, sin, k_buf, v_buf, write_index, kv_len: int, key_mask=None):
        """Inference path: the block's K/V rows are written into the context buffers right after each row's
        context, and one fused SDPA call attends over ``[context | block]`` of the buffer in place.

        x: block rows ``[B,S,H]``; k_buf/v_buf ``[B,nkv,C,hd]`` (context rows ``< lengths[b]``);
        write_index ``[B,nkv,S,hd] int64`` = ``lengths[b] + s`` broadcast; kv_len: keys read (host int,
        ``>= max(lengths) + S``); key_mask: None when every row's keys ``[0, kv_len)`` are all visible
        (equal context), else bool ``[B,1,1,kv_len]`` (True = visible: ``k < lengths[b] + S``).
        """
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.nh, self.hd)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_b, v_b = self.project_kv(x, cos, sin)
        k_buf.scatter_(2, write_index, k_b.to(k_buf.dtype))
        v_buf.scatter_(2, write_index, v_b.to(v_buf.dtype))
        k = k_buf[:, :, :kv_len]
        v = v_buf[:, :, :kv_len]
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, enable_gqa=self.nh != self.nkv)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, self.nh * self.hd))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, cos, sin, k_buf, v_buf, write_index, kv_len, key_mask=None):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, k_buf, v_buf, write_index, kv_len,
                                              key_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashState:
    """Drafter KV cache of CONTEXT rows, one row per request, preallocated.

    ``k_buf[l]``, ``v_buf[l]``: ``[B, num_key_value_heads, capacity, head_dim]`` per layer (keys already
    k-normed and rotated at their true positions). Row ``b`` holds its context in ``[0, lengths[b])``
    (right-padded layout; rows may differ in length); rows past a length are scratch (a draft pass writes
    its block there). ``lengths [B] int64`` lives on the buffers' device and is the truth; ``host_lengths``
    is its host mirror (a list of ints) when known, or None after an update with device-side counts, until
    the owner reports the new lengths with :meth:`set_host_lengths` (the decode loop does, from its one read
    per round). ``bound`` is a host-side upper bound of ``max(lengths)`` that is always valid.
    """

    def __init__(self, k_buf: List[torch.Tensor], v_buf: List[torch.Tensor], lengths: torch.Tensor,
                 host_lengths: Optional[List[int]] = None):
        self.k_buf, self.v_buf, self.lengths = k_buf, v_buf, lengths
        self.host_lengths = list(host_lengths) if host_lengths is not None else None
        self.bound = max(self.host_lengths) if self.host_lengths else 0

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k_buf[0].shape[2] if self.k_buf else 0

    def set_host_lengths(self, lengths: Sequence[int]) -> None:
        """Report the device lengths on the host (no transfer: the caller already knows them)."""
        self.host_lengths = [int(x) for x in lengths]
        self.bound = max(self.host_lengths) if self.host_lengths else 0

    @property
    def length(self) -> int:
        """The common context length of all rows (host side); raises when rows differ or it is not known."""
        if self.host_lengths is None:
            raise ValueError("state.length: the lengths were updated on the device; call set_host_lengths first")
        if len(set(self.host_lengths)) > 1:
            raise ValueError(f"state.length: rows have different lengths {self.host_lengths}; use host_lengths")
        return self.host_lengths[0] if self.host_lengths else 0

    @property
    def k(self) -> List[torch.Tensor]:
        """Per-layer key views ``[B, nkv, bound, hd]`` of the buffers (rows past each length are scratch)."""
        return [k[:, :, :self.bound] for k in self.k_buf]

    @property
    def v(self) -> List[torch.Tensor]:
        return [v[:, :, :self.bound] for v in self.v_buf]

    def snapshot(self):
        """What a failed round must restore: ``(lengths copy, host lengths, bound)``."""
        return self.lengths.clone(), None if self.host_lengths is None else list(self.host_lengths), self.bound

    def restore(self, snap) -> None:
        lengths, host, bound = snap
        self.lengths.copy_(lengths)
        self.host_lengths, self.bound = (list(host) if host is not None else None), bound


def cpu_has_native_bf16() -> bool:
    """True where the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16, Linux flags)."""
    from taps_kernels.backend import cpu_flags

    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def fast_body_dtype(device) -> Optional[torch.dtype]:
    """The dtype the drafter's layers should run in on ``device`` (``None``: the target's).

    bf16 on CPUs with native bf16 dot products (held-out tau unchanged, ~2.7 ms less per draft on this
    project's CPU, ``checkpoints/smollm2-dflash/README.md``); elsewhere bf16 is emulated and slower. The
    layers stay in floating point: int8 layers cost 2.4% held-out tau for ~1.5 ms.
    """
    dev = torch.device(device)
    return torch.bfloat16 if dev.type == "cpu" and cpu_has_native_bf16() else None


def fast_head_dtype(device) -> Optional[torch.dtype]:
    """The dtype :meth:`DFlashDrafter.draft` should project onto the vocabulary with on ``device``
    (``None``: the LM head's own dtype; ``torch.int8``: :class:`taps_kernels.integrations.int8_linear.Int8Linear`).

    On a CPU the ``D x V`` vocabulary projection is a third or more of a draft pass. The draft logits only
    propose tokens that the target then verifies, so a lower-precision head changes no generated token, at
    most a proposal. int8 where fbgemm runs (``taps_kernels.backend.int8_linear_backend``: 0.4 ms against
    2.3 ms in bf16 for 7 rows x 16K ids here; held-out tau -0.01, tokens per second up on both benchmark
    sets, ``checkpoints/smollm2-dflash/README.md``), else bf16 where the CPU has native bf16 dot products.
    On CUDA the head is used as loaded.
    """
    from taps_kernels.backend import int8_linear_backend

    dev = torch.device(device)
    if dev.type != "cpu":
        return None
    if int8_linear_backend(dev)[0] == "fbgemm":
        return torch.int8
    return torch.bfloat16 if cpu_has_native_bf16() else None


#: Drafter body modes of :func:`prepare_drafter`: ``blocks`` = the GGUF block forward
#: (:mod:`taps.models.drafter_blocks`), or a float dtype for the PyTorch layers.
DRAFT_BODIES = ("auto", "blocks", "float32", "bfloat16", "float16")
DRAFT_HEADS = ("auto", "float32", "bfloat16", "float16", "int8")


def prepare_drafter(drafter: "DFlashDrafter", device, body: str = "auto", head: str = "auto",
                    short_blocks: bool = False) -> "DFlashDrafter":
    """The one place that readies a loaded drafter for decoding on ``device`` (proposals only: no choice here
    changes a generated token).

    ``body``: ``auto`` = ``blocks`` on CPUs where the block forward runs (AVX-512 VNNI: the whole draft pass in
    one C++ call, ~2 ms against ~6 ms for bf16 layers here), else :func:`fast_body_dtype` (or the drafter's
    float32); ``head`` (PyTorch layers only): ``auto`` = :func:`fast_head_dtype`, or a dtype name / ``int8``.
    """
    from .drafter_blocks import block_draft_available, block_draft_unsupported, enable_block_draft

    if body not in DRAFT_BODIES:
        raise ValueError(f"body: expected one of {DRAFT_BODIES}, received {body!r}")
    if head not in DRAFT_HEADS:
        raise ValueError(f"head: expected one of {DRAFT_HEADS}, received {head!r}")
    dev = torch.device(device)
    if body == "auto":
        blocks = dev.type == "cpu" and block_draft_available() and not block_draft_unsupported(drafter.config)
        body = "blocks" if blocks else \
            str(fast_body_dtype(dev) or torch.float32).replace("torch.", "")
    drafter = drafter.to(device=dev, dtype=torch.float32 if body == "blocks" else getattr(torch, body)).eval()
    drafter.short_blocks = bool(short_blocks)
    if body == "blocks":
        enable_block_draft(drafter)
    else:
        drafter.head_dtype = fast_head_dtype(dev) if head == "auto" else \
            (torch.int8 if head == "int8" else getattr(torch, head))
    return drafter


def load_decoding_drafter(path, target, body: str = "auto", head: str = "auto",
                          short_blocks: bool = False) -> "DFlashDrafter":
    """The one way to load a drafter for decoding with ``target``: :func:`load_drafter` checked against the
    target's config, then :func:`prepare_drafter` on the device of the target's embedding (``body`` ``auto``
    there, or a dtype name; see :func:`prepare_drafter`). Used by the CLI, the transformers entry, scorer
    traces and the benchmarks."""
    drafter = load_drafter(str(path), target_config=target.config)
    emb = target.get_input_embeddings().weight
    return prepare_drafter(drafter, emb.device, body=body, head=head, short_blocks=short_blocks)


class DFlashDrafter(nn.Module):
    #: dtype of the vocabulary projection in :meth:`draft` (``None``: the LM head's own dtype; ``torch.int8``:
    #: int8 weights and activations, see :func:`fast_head_dtype`). Training and :meth:`forward_blocks` never use it.
    head_dtype: Optional[torch.dtype] = None

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
        return self.fc.weight.dtype

    def _rope(self, positions, dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def project_context(self, ctx_features: torch.Tensor) -> torch.Tensor:
        """``[B,T,n*H]`` target features -> ``hidden_norm(fc(.))`` ``[B,T,H]``."""
        if ctx_features.shape[-1] != self.config.num_context_features:
            raise ValueError(f"context features have {ctx_features.shape[-1]} channels, drafter expects "
                             f"{self.config.num_context_features} = {len(self.config.target_layer_ids)} layers x "
                             f"{self.config.hidden_size}")
        x = ctx_features
        if self.feature_scale is not None:
            x = x.float() * self.feature_scale
        return self.hidden_norm(self.fc(x.to(self._dtype())))

    def _context_kv(self, ctx_h, positions):
        cos, sin = self._rope(positions, ctx_h.dtype)
        return [layer.self_attn.project_kv(ctx_h, cos, sin) for layer in self.layers]

    def _embed(self, embed_tokens, ids):
        return embed_tokens(ids).to(self._dtype())

    # --------------------------------------------------------------- inference
    #: context rows a fresh state holds before its buffers grow (doubling)
    INITIAL_CAPACITY = 256

    def new_state(self, batch_size: int = 1, capacity: Optional[int] = None) -> DFlashState:
        """Empty context cache for ``batch_size`` rows, room for ``capacity`` context rows each (it grows)."""
        c = self.config
        dev, dt = self.fc.weight.device, self._dtype()
        cap = max(int(capacity or self.INITIAL_CAPACITY), 1) + c.block_size
        z = lambda: torch.zeros(batch_size, c.num_key_value_heads, cap, c.head_dim, device=dev, dtype=dt)  # noqa: E731
        return DFlashState([z() for _ in self.layers], [z() for _ in self.layers],
                           torch.zeros(batch_size, dtype=torch.int64, device=dev), [0] * batch_size)

    def _reserve(self, state: DFlashState, rows: int) -> None:
        """Grow the buffers (doubling, rows kept) so that every row has room for ``rows`` rows."""
        need = rows + self.config.block_size
        if need <= state.capacity:
            return
        cap = max(need, 2 * state.capacity)
        for group in (state.k_buf, state.v_buf):
            for l, t in enumerate(group):
                new = t.new_zeros(t.shape[0], t.shape[1], cap, t.shape[3])
                new[:, :, :t.shape[2]] = t
                group[l] = new

    @staticmethod
    def _rows(state: DFlashState, rows: Optional[slice], n: int, name: str) -> slice:
        rows = slice(0, n) if rows is None else rows
        start, stop = rows.start or 0, rows.stop
        if rows.step not in (None, 1) or stop is None or not 0 <= start < stop <= state.batch_size \
                or stop - start != n:
            raise ValueError(f"{name}: expected {n} rows = state rows {rows} (a contiguous range inside "
                             f"[0, {state.batch_size})), received {n}")
        return slice(start, stop)

    @torch.no_grad()
    def append_context(self, state: DFlashState, ctx_features: torch.Tensor, counts: Optional[torch.Tensor] = None,
                       rows: Optional[slice] = None) -> DFlashState:
        """Project target features of newly committed tokens and append their K/V rows to every layer.

        Args:
            ctx_features: ``[R, T, n*H]``; feature row r feeds state row ``rows.start + r`` (default: rows
                ``0 .. R-1``), at positions ``lengths[row] .. lengths[row] + counts[r] - 1``.
            counts: ``[R] int64`` on the state's device: how many of the T feature rows are real (the rest is
                written as scratch past the new length). None: all T, and the host lengths stay known; with
                device counts the host mirror becomes unknown (:meth:`DFlashState.set_host_lengths`).
            rows: a contiguous ``slice`` of state rows (default ``slice(0, R)``).
        Returns the same ``state``. Nothing is read back to the host.
        """
        R, T, _ = ctx_features.shape
        if T == 0:
            return state
        sl = self._rows(state, rows, R, "ctx_features")
        self._reserve(state, state.bound + T)
        h = self.project_context(ctx_features)
        lengths = state.lengths[sl]
        if self.block_draft is not None:
            self.block_draft.append_kv(state, sl, h)
        else:
            pos = lengths[:, None] + torch.arange(T, device=h.device)
            c = self.config
            index = pos[:, None, :, None].expand(R, c.num_key_value_heads, T, c.head_dim)
            for l, (k, v) in enumerate(self._context_kv(h, pos)):
                state.k_buf[l][sl].scatter_(2, index, k.to(state.k_buf[l].dtype))
                state.v_buf[l][sl].scatter_(2, index, v.to(state.v_buf[l].dtype))
        lengths += T if counts is None else counts.to(torch.int64)
        if counts is None and state.host_lengths is not None:
            host = list(state.host_lengths)
            for b in range(sl.start, sl.stop):
                host[b] += T
            state.set_host_lengths(host)
        else:
            state.host_lengths = None
            state.bound += T
        return state

    def rollback(self, state: DFlashState, length) -> DFlashState:
        """Crop the context cache: ``length`` an int (every row) or a host list of per-row lengths, each
        within ``[0, current length]``."""
        cur = state.host_lengths
        want = [int(length)] * state.batch_size if isinstance(length, int) else [int(x) for x in length]
        if len(want) != state.batch_size:
            raise ValueError(f"rollback length: expected {state.batch_size} per-row lengths, received {len(want)}")
        for b, n in enumerate(want):
            if n < 0 or (cur is not None and n > cur[b]) or (cur is None and n > state.bound):
                have = cur[b] if cur is not None else f"<= {state.bound}"
                raise ValueError(f"rollback length {n} of row {b} outside [0, {have}]")
        state.lengths.copy_(torch.tensor(want, dtype=torch.int64))
        state.set_host_lengths(want)
        return state

    def reset_row(self, state: DFlashState, row: int) -> None:
        """Empty one row (a request left; the next one starts from no context)."""
        state.lengths[row] = 0
        if state.host_lengths is not None:
            host = list(state.host_lengths)
            host[row] = 0
            state.set_host_lengths(host)

    @torch.no_grad()
    def draft(self, state: DFlashState, bonus_tokens: torch.Tensor, embed_tokens, lm_head,
              rows: Optional[slice] = None, num_positions: Optional[int] = None,
              full_vocab_logits: Optional[bool] = None):
        """One draft pass for rows of the state (default: rows ``0 .. B-1``, one per bonus token).

        bonus_tokens ``[B] int64``: row b's block is ``[bonus, MASK x D]`` at positions
        ``lengths[b] .. lengths[b]+D`` (``D = block_size-1``), attending to its own context rows and
        bidirectionally inside the block. Attention is one fused SDPA call per layer over the buffer in
        place: without a mask when all rows have the same (host-known) context length, else with a boolean
        key-padding mask. ``rows``: a contiguous ``slice`` of state rows.
        ``num_positions`` P (default D): only block positions ``1..P`` are normed and projected onto the
        vocabulary (a policy that never uses deeper positions passes its depth cap); with
        :attr:`short_blocks` the block itself is ``[bonus, MASK x P]``.
        Returns ``(logits [B,P,V] float32, hidden [B,P,H])`` for block positions ``1..P`` (with a draft
        vocabulary: ``-inf`` outside it, or ``[B,P,V_draft]`` when ``full_vocab_logits`` is False; None: the
        attribute :attr:`full_vocab_logits`). The state's
        lengths and context rows are not modified (the block's K/V go to scratch rows past each length).
        """
        c = self.config
        B = bonus_tokens.shape[0]
        sl = self._rows(state, rows, B, "bonus_tokens")
        D = c.block_size - 1
        P = D if num_positions is None else int(num_positions)
        if not 1 <= P <= D:
            raise ValueError(f"num_positions: expected 1..{D} (block_size-1), received {num_positions}")
        S = P + 1 if self.short_blocks else c.block_size
        dev = self.fc.weight.device
        self._reserve(state, state.bound)
        if self.block_draft is not None:  # the whole pass in one C++ call (taps.models.drafter_blocks)
            full = self.full_vocab_logits if full_vocab_logits is None else bool(full_vocab_logits)
            return self.block_draft.draft(state, sl, bonus_tokens, embed_tokens, lm_head, P, S, full)
        ids = torch.full((B, S), self.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = bonus_tokens.to(dev)
        x = self._embed(embed_tokens, ids)
        lengths = state.lengths[sl]
        pos = lengths[:, None] + torch.arange(S, device=dev)
        cos, sin = self._rope(pos, x.dtype)
        index = pos[:, None, :, None].expand(B, c.num_key_value_heads, S, c.head_dim)
        host = None if state.host_lengths is None else state.host_lengths[sl]
        if host is not None and len(set(host)) <= 1:
            kv_len, key_mask = (host[0] if host else 0) + S, None
        else:
            kv_len = (max(host) if host is not None else state.bound) + S
            key_mask = (torch.arange(kv_len, device=dev)[None, :] < (lengths + S)[:, None])[:, None, None, :]
        for l, layer in enumerate(self.layers):
            x = layer.forward_cached(x, cos, sin, state.k_buf[l][sl], state.v_buf[l][sl], index, kv_len, key_mask)
        # only the positions the caller can use go through the final norm and the vocabulary head
        hidden = self.norm(x[:, 1:1 + P])
        full = self.full_vocab_logits if full_vocab_logits is None else bool(full_vocab_logits)
        return self._vocab_logits(hidden, lm_head, full), hidden

    #: True: ``draft(num_positions=P)`` runs the block ``[bonus, MASK x P]`` (P + 1 rows) instead of the trained
    #: ``block_size`` rows: fewer rows through the layers (on a CPU, where the layers stream their weights once
    #: either way, 1.1 ms less at P = 8 and 2.2 ms at P = 4 for the shipped drafter). The proposals can differ
    #: from the full block's (its later MASK rows are absent from the block's bidirectional attention;
    #: ``eval-drafter --block-positions P --short-blocks`` measures the acceptance); decoding stays lossless.
    short_blocks: bool = False

    #: :class:`taps.models.drafter_blocks.BlockDraft` once :func:`taps.models.drafter_blocks.enable_block_draft`
    #: switched this drafter to the GGUF block forward, else None (the PyTorch layers)
    block_draft = None

    #: reduced draft vocabulary (sorted int64 ids, see :meth:`set_draft_vocab`), or None (full vocabulary)
    draft_vocab: Optional[torch.Tensor] = None
    #: with a draft vocabulary: True (default) = :meth:`draft` returns full-size ``[B,P,V]`` logits with
    #: ``-inf`` outside the draft vocabulary; False = the ``[B,P,V_draft]`` sub-vocabulary logits, whose
    #: column ``j`` is token ``draft_vocab[j]`` (callers map top-k ids back through it).
    full_vocab_logits: bool = True

    def set_draft_vocab(self, ids: Optional[torch.Tensor]) -> None:
        """Restrict draft proposals to ``ids`` (int64 ``[V_draft]``, distinct, inside ``[0, vocab_size)``;
        stored sorted), or lift the restriction with None. Lossless for decoding: the target verifies every
        proposal; tokens outside the set are never proposed."""
        if ids is None:
            self.draft_vocab, self.config.draft_vocab_size = None, None
            return
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
            raise ValueError(f"draft vocab: expected a non-empty 1-D int64 tensor, received "
                             f"{getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}")
        ids = ids.sort().values
        V = self.config.vocab_size
        if int(ids[0]) < 0 or int(ids[-1]) >= V or bool((ids[1:] == ids[:-1]).any()):
            raise ValueError(f"draft vocab: ids must be distinct and inside [0, {V})")
        self.draft_vocab = ids.to(self.fc.weight.device)
        self.config.draft_vocab_size = int(ids.numel())

    def _vocab_logits(self, hidden: torch.Tensor, lm_head, full_vocab: bool = True) -> torch.Tensor:
        """``lm_head(hidden)`` in float32, computed in :attr:`head_dtype` (a cached copy of the weight) over
        the draft vocabulary when one is set (``full_vocab``: the layout :attr:`full_vocab_logits` describes)."""
        w = lm_head.weight
        dt = self.head_dtype or w.dtype
        ids = self.draft_vocab
        # 2-D rows: a strided 3-D input sends linear through a broadcast bmm, which copies the whole
        # [V, H] weight on every call for bf16.
        rows = hidden.reshape(-1, hidden.shape[-1]).to(torch.float32 if dt == torch.int8 else dt)
        bias = getattr(lm_head, "bias", None)
        if dt == w.dtype and ids is None:
            out = lm_head(rows)
        else:
            key = (w.data_ptr(), w._version, dt, None if ids is None else (ids.data_ptr(), ids.numel()))
            if self._head_copy is None or self._head_copy[0] != key:
                wc = w.detach() if ids is None else w.detach().index_select(0, ids.to(w.device))
                bc = None if bias is None else (bias.detach() if ids is None else bias.detach()[ids.to(w.device)])
                if dt == torch.int8:
                    from taps_kernels.integrations.int8_linear import Int8Linear

                    self._head_copy = (key, Int8Linear(wc, bc))
                else:
                    head = (wc.to(dt).contiguous(), None if bc is None else bc.to(dt))
                    self._head_copy = (key, lambda r: F.linear(r, *head))
            out = self._head_copy[1](rows)
        out = out.float()
        if ids is None or not full_vocab:
            return out.view(*hidden.shape[:-1], -1)
        full = out.new_full((out.shape[0], w.shape[0]), float("-inf"))
        full.index_copy_(1, ids.to(out.device), out)
        return full.view(*hidden.shape[:-1], -1)

    # ---------------------------------------------------------------- training
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

    # -------------------------------------------------------------------- io
    def save_pretrained(self, path, dtype: Optional[torch.dtype] = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self.config.save(p)
        sd = {k: (v.to(dtype) if dtype is not None else v).contiguous().cpu()
              for k, v in self.folded_state_dict().items()}
        save_file(sd, str(p / "model.safetensors"), metadata={"format": "pt"})
        if self.draft_vocab is not None:
            save_file({"ids": self.draft_vocab.cpu().contiguous()}, str(p / DRAFT_VOCAB_FILE))
        elif (p / DRAFT_VOCAB_FILE).exists():
            (p / DRAFT_VOCAB_FILE).unlink()


def load_drafter(path, dtype: torch.dtype = torch.float32, device: str = "cpu", target_config=None) -> DFlashDrafter:
    """Load a drafter directory (``config.json`` + ``model.safetensors``), e.g. a
    published DFlash checkpoint. Weights may carry a ``model.`` prefix. With
    ``target_config`` the drafter is checked by :func:`check_compatible`."""
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"drafter directory not found: {p}")
    cfg = DFlashConfig.from_pretrained(p)
    if target_config is not None:
        check_compatible(cfg, target_config)
    files = [f for f in sorted(p.glob("*.safetensors")) if f.name != DRAFT_VOCAB_FILE]
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in drafter directory {p}")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    sd = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not (k.startswith("embed_tokens") or k.startswith("lm_head")
                                               or k.endswith("rotary_emb.inv_freq"))}
    model = DFlashDrafter(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter weights in {p} do not match its config: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    model = model.to(device=device, dtype=dtype).eval()
    if cfg.draft_vocab_size is not None:
        vf = p / DRAFT_VOCAB_FILE
        if not vf.is_file():
            raise FileNotFoundError(f"drafter config declares draft_vocab_size {cfg.draft_vocab_size} but {vf} "
                                    f"is missing")
        ids = load_file(str(vf))["ids"]
        if ids.numel() != cfg.draft_vocab_size:
            raise ValueError(f"{vf} holds {ids.numel()} ids, config declares draft_vocab_size "
                             f"{cfg.draft_vocab_size}")
        model.set_draft_vocab(ids.to(torch.int64))
    return model
