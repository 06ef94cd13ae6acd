"""Reference of the GGUF decoder forward (``csrc/gguf_forward.h``): plain PyTorch over the raw GGUF blocks
and :func:`gguf_linear_reference`, the whole sequence at once under a causal mask, no cache.

It shares no code with the C++ forward (its own block decoding, its own q/k row order handling, torch's
softmax, exp and RoPE), so it is the independent oracle of lossless decoding on tiny models: greedy decoding
through the speculative loop over the C++ forward must give the tokens :func:`greedy_reference` gives.
Its numerics agree with the C++ forward to float32 rounding (not bit for bit: exp, softmax and reduction
orders differ); the matrix products, where the int8 quantisation lives, are bit-identical, and keys and values
are rounded to the cache's dtype (``ReferenceWeights.kv_dtype``) exactly as the cache stores them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from .gguf import dequantize_blocks_reference, gguf_linear_reference


@dataclass
class ReferenceWeights:
    """Raw GGUF rows as the file stores them: ``matrices[name] = (raw uint8 [N, row_bytes], ggml_type)`` for
    ``blk.{i}.attn_q`` ... ``token_embd`` (and ``output`` when untied); ``vectors[name]`` float32 norms;
    ``kv_dtype``: what attention reads keys and values as (the GGUF format's cache: float16);
    ``activation_digits``: int8 digits per activation in the matrix products (1: ``gguf``, 2: ``gguf-a16``)."""

    arch: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    rms_eps: float
    rope_base: float
    matrices: Dict[str, tuple]
    vectors: Dict[str, torch.Tensor]
    kv_dtype: torch.dtype = torch.float16
    activation_digits: int = 1


def _permuted_to_hf(raw: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp stores Llama q/k rows pairwise interleaved per head; transformers' rotate-half wants halves
    d = raw.shape[0] // n_head // 2
    idx = torch.arange(raw.shape[0]).view(n_head, d, 2).transpose(1, 2).reshape(-1)
    return raw[idx]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    D = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    a, b = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def decoder_reference(w: ReferenceWeights, tokens: Sequence[int], feature_layers: Sequence[int] = ()):
    """``(logits [T, vocab] float32, features [T, len(feature_layers) * hidden])`` of ``tokens`` (positions
    0..T-1, causal)."""
    T = len(tokens)
    ids = torch.as_tensor(list(tokens), dtype=torch.int64)
    emb_raw, emb_type = w.matrices["token_embd"]
    x = dequantize_blocks_reference(emb_raw[ids], emb_type, w.hidden)
    pos = torch.arange(T)
    G = w.heads // w.kv_heads
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    feats: List[torch.Tensor] = []

    def lin(name, inp, n_head: Optional[int] = None):
        raw, t = w.matrices[name]
        if n_head is not None and w.arch == "llama":
            raw = _permuted_to_hf(raw, n_head)
        return gguf_linear_reference(inp.contiguous(), raw, t, w.activation_digits)

    for i in range(w.layers):
        p = f"blk.{i}."
        h = _rms(x, w.vectors[p + "attn_norm"], w.rms_eps)
        q = lin(p + "attn_q", h, w.heads).view(T, w.heads, w.head_dim)
        k = lin(p + "attn_k", h, w.kv_heads).view(T, w.kv_heads, w.head_dim)
        v = lin(p + "attn_v", h).view(T, w.kv_heads, w.head_dim)
        if p + "attn_q_norm" in w.vectors:
            q = _rms(q, w.vectors[p + "attn_q_norm"], w.rms_eps)
            k = _rms(k, w.vectors[p + "attn_k_norm"], w.rms_eps)
        q = _rope(q.transpose(0, 1), pos, w.rope_base)  # [heads, T, D]
        k = _rope(k.transpose(0, 1), pos, w.rope_base).to(w.kv_dtype).float().repeat_interleave(G, 0)
        v = v.transpose(0, 1).to(w.kv_dtype).float().repeat_interleave(G, 0)
        s = (q @ k.transpose(1, 2)) / (w.head_dim ** 0.5)
        s = s.masked_fill(~causal, float("-inf")).softmax(-1)
        att = (s @ v).transpose(0, 1).reshape(T, w.heads * w.head_dim)
        x = x + lin(p + "attn_output", att)
        h = _rms(x, w.vectors[p + "ffn_norm"], w.rms_eps)
        g, u = lin(p + "ffn_gate", h), lin(p + "ffn_up", h)
        x = x + lin(p + "ffn_down", torch.nn.functional.silu(g) * u)
        if i in feature_layers and i + 1 < w.layers:
            feats.append((i, x))
    final = _rms(x, w.vectors["output_norm"], w.rms_eps)
    if w.layers - 1 in feature_layers:
        feats.append((w.layers - 1, final))
    by_layer = dict(feats)
    features = torch.cat([by_layer[i] for i in feature_layers], -1) if feature_layers else x.new_zeros(T, 0)
    head = "output" if "output" in w.matrices else "token_embd"
    raw, t = w.matrices[head]
    return gguf_linear_reference(final, raw, t, w.activation_digits), features


def greedy_reference(w: ReferenceWeights, prompt: Sequence[int], max_new_tokens: int,
                     stop_token_ids: Sequence[int] = ()) -> List[int]:
    """Plain greedy decoding with :func:`decoder_reference` (the whole sequence recomputed every token)."""
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        logits, _ = decoder_reference(w, seq)
        t = int(logits[-1].argmax())
        out.append(t)
        seq.append(t)
        if t in stop_token_ids:
            break
    return out


def reference_weights_from_gguf(path) -> ReferenceWeights:
    """Read a GGUF file's tensors for :func:`decoder_reference` (through gguf-py, as stored)."""
    import numpy as np
    from gguf import GGUFReader

    r = GGUFReader(str(path))

    def field(key, default=None):
        f = r.fields.get(key)
        if f is None:
            return default
        part = f.parts[f.data[0]]
        return bytes(part).decode() if f.types[0].name == "STRING" else part.tolist()[0]

    arch = field("general.architecture")
    mats, vecs = {}, {}
    for t in r.tensors:
        name = t.name[:-len(".weight")] if t.name.endswith(".weight") else t.name
        if t.tensor_type.name == "F32":
            vecs[name] = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
        else:
            mats[name] = (torch.from_numpy(np.array(t.data)), int(t.tensor_type))
    hidden, heads = int(field(f"{arch}.embedding_length")), int(field(f"{arch}.attention.head_count"))
    return ReferenceWeights(arch=arch, hidden=hidden, heads=heads,
                            kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
                            head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
                            layers=int(field(f"{arch}.block_count")),
                            rms_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
                            rope_base=float(field(f"{arch}.rope.freq_base", 10000.0)), matrices=mats, vectors=vecs)
