"""The drafter's building blocks: RMSNorm, RoPE, attention over ``[context | block]`` (a training path with
an explicit mask and an inference path over the context cache in place), SwiGLU MLP, decoder layer."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .drafter_config import DFlashConfig


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
    """softmax(q k^T / sqrt(d) [masked]) v with fp32 softmax. q ``[B,H,Lq,d]``, k/v ``[B,Hkv,Lk,d]`` (H a
    multiple of Hkv: query head h reads KV head h // (H/Hkv)); mask: bool, True = attend, broadcast to
    ``[B,1,Lq,Lk]``. Plain matmuls: for the small query/key counts here this is several times faster on CPU
    than SDPA with a boolean mask (whose backward was also slower); the query heads of a KV head are one
    matmul, so K/V are never repeated per query head."""
    B, H, L, d = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv * L, d)
    s = torch.matmul(qg, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(d))
    s = s.view(B, Hkv, H // Hkv, L, -1)
    if mask is not None:
        s = s.masked_fill(~mask[:, :, None], float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype).view(B, Hkv, H // Hkv * L, -1)
    return torch.matmul(p, v).view(B, H, L, d)


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
