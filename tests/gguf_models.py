"""Tiny GGUF models for the tests: random weights quantised with gguf-py (Q4_1 layers, a Q8_0 token embedding /
tied head, as SmolLM2's file) and written as real GGUF files, so the loader, the C++ forward and the
reference forward all read the format as a user's file holds it."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import numpy as np

from taps_kernels.reference.gguf import BLOCK_BYTES, Q4_1, Q8_0


def random_blocks(rng: np.random.Generator, rows: int, cols: int, ggml_type: int) -> np.ndarray:
    """GGUF rows ``[rows, cols/32 * block_bytes] uint8`` with random codes and fp16 scales (offsets)."""
    kb = cols // 32
    blk = np.zeros((rows, kb, BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    hi = 0.01 if ggml_type == Q8_0 else 0.03
    d = rng.uniform(hi / 8, hi, size=(rows, kb)).astype(np.float16)
    blk[..., 0:2] = d.view(np.uint8).reshape(rows, kb, 2)
    if ggml_type == Q4_1:
        m = (-8 * d.astype(np.float32) * rng.uniform(0.8, 1.2, size=(rows, kb))).astype(np.float16)
        blk[..., 2:4] = m.view(np.uint8).reshape(rows, kb, 2)
        blk[..., 4:] = rng.integers(0, 256, size=(rows, kb, 16), dtype=np.uint8)
    else:
        blk[..., 2:] = rng.integers(-127, 128, size=(rows, kb, 32), dtype=np.int8).view(np.uint8)
    return blk.reshape(rows, -1)


def write_tiny_gguf(path: Path, seed: int = 0, arch: str = "llama", vocab: int = 80, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, layers: int = 3, ffn: int = 96, ctx: int = 512,
                    types: Optional[Dict[str, int]] = None, drop: tuple = (), tied: bool = False) -> Path:
    """A random ``arch`` (llama / qwen3) GGUF file (an own Q8_0 head unless ``tied``: a random tied head mostly
    repeats its input token); ``types`` overrides a tensor's GGML type by name (raw bytes
    of another size are then written as that type's blocks would be), ``drop`` leaves tensors out."""
    import gguf

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    types = types or {}

    def mat(name, rows, cols, ggml_type=Q4_1):
        if name in drop:
            return
        t = types.get(name, ggml_type)
        if t in BLOCK_BYTES:
            data = random_blocks(rng, rows, cols, t)
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(t))
        else:  # a type the forward refuses: store real f16 data under that type
            w.add_tensor(name, rng.standard_normal((rows, cols)).astype(np.float16))

    def vec(name, n, scale=1.0):
        if name not in drop:
            w.add_tensor(name, (1.0 + scale * rng.standard_normal(n) * 0.1).astype(np.float32))

    mat("token_embd.weight", vocab, hidden, Q8_0)
    for i in range(layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", hidden)
        vec(p + "ffn_norm.weight", hidden)
        mat(p + "attn_q.weight", heads * head_dim, hidden)
        mat(p + "attn_k.weight", kv_heads * head_dim, hidden)
        mat(p + "attn_v.weight", kv_heads * head_dim, hidden)
        mat(p + "attn_output.weight", hidden, heads * head_dim)
        mat(p + "ffn_gate.weight", ffn, hidden)
        mat(p + "ffn_up.weight", ffn, hidden)
        mat(p + "ffn_down.weight", hidden, ffn)
        if arch == "qwen3":
            vec(p + "attn_q_norm.weight", head_dim)
            vec(p + "attn_k_norm.weight", head_dim)
    vec("output_norm.weight", hidden)
    if not tied:
        mat("output.weight", vocab, hidden, Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
