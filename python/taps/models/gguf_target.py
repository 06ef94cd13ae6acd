"""The target as shipped: a GGUF file's Q4_1 / Q8_0 blocks read in place by the C++ forward
(``csrc/gguf_forward.h``), no dequantised copy of the layers.

``load_gguf_target(path)`` reads a Llama or Qwen3 GGUF file, checks every tensor (type, shape, whole blocks),
repacks each matrix once into the kernel's layout (``csrc/gguf_linear.h``) and returns a
:class:`GGUFTarget`. The model it defines is the file's blocks with activations quantised per row and
32-block (int8) inside every matrix product, and keys and values cached in float16 (as llama.cpp caches them by
default: half the bytes every attention row streams); the fp32 format (``taps.models.target.load_target``) is the
same blocks dequantised and multiplied in float32. ``taps eval-target-format`` measures how far apart
the two are on held-out text.

The object offers what the decode loop, the policies and the drafter read from a target (``config``,
``get_input_embeddings()``, ``get_output_embeddings()``, ``parameters()`` for the device and dtype) and
:meth:`GGUFTarget.forward_rows`, the one forward the verifier (:mod:`taps.decode.gguf_verifier`) calls.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from taps_kernels.reference.gguf import BLOCK, BLOCK_BYTES, Q4_1, Q8_0, TYPE_NAMES

from .gguf_file import GGUFFile, GGUFFormatError, GGUFTensor

#: GGUF architectures the forward runs (decoder layers: RMSNorm, RoPE, GQA, SwiGLU; Qwen3 adds q/k norms).
ARCHITECTURES = ("llama", "qwen3")
MATRICES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
            "down": "ffn_down"}


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k row permutation (GGUF row ``h*2d + 2j + a`` holds transformers'
    row ``h*2d + a*d + j``), so the rotate-half RoPE of transformers applies."""
    d = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, d, 2).swapaxes(1, 2).reshape(-1)


class GGUFTarget(torch.nn.Module):
    """A decoder LM over packed GGUF blocks. Build it with :func:`load_gguf_target`.

    Attributes:
        config: a transformers config of the same architecture (sizes, vocabulary, context length).
        format: ``"gguf"``: the kind of target (the block forward); records name the format through
            :func:`taps.models.target.target_format_of` (``"gguf"`` or ``"gguf-a16"``).
        activation_digits: 1 (int8 activations per row and 32-block) or 2 (two int8 digits of each: ~15 bits,
            the fp32 format's next tokens; ``csrc/gguf_linear.h``).
        kv_dtype: the dtype of the KV cache the forward reads and writes; every cache of this target (the
            verifier's, the data generator's) has it. ``torch.float16`` is the model the format defines;
            ``torch.float32`` keeps keys and values unrounded (the reference decoder's exact oracle tests).
        path: the GGUF file.
    """

    format = "gguf"

    def __init__(self, config, model, norms: Dict[str, torch.Tensor], embed_raw: Tuple[torch.Tensor, int],
                 path: Path, kv_dtype: torch.dtype = torch.float16, activation_digits: int = 1):
        super().__init__()
        self.config = config
        self.path = Path(path)
        self.kv_dtype = kv_dtype
        self.activation_digits = activation_digits
        self._model = model  # taps_kernels._C.GGUFModel (holds the packed blocks)
        # the norm weights are the model's real float32 parameters (they also give parameters() a device/dtype)
        self.norms = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(v, requires_grad=False)
                                             for k, v in norms.items()})
        self._embed_raw = embed_raw
        self._embed_module: Optional[torch.nn.Embedding] = None
        self._head_module: Optional[torch.nn.Linear] = None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def get_input_embeddings(self) -> torch.nn.Embedding:
        """The token embedding dequantised to float32 (exact; made on first use: the drafter and the TAPS
        scorer read it, plain decoding does not)."""
        if self._embed_module is None:
            from taps_kernels import _C

            raw, ggml_type = self._embed_raw
            w = _C.gguf_dequantize(raw, ggml_type, int(self.config.hidden_size), "token_embd.weight")
            self._embed_module = torch.nn.Embedding.from_pretrained(w, freeze=True)
            # the blocks themselves, for block kernels that read this table (the drafter's block forward)
            self._embed_module.gguf_blocks = self._embed_raw
        return self._embed_module

    def get_output_embeddings(self) -> torch.nn.Linear:
        """The LM head in float32 (the embedding's weight when tied, as in the file)."""
        if self._head_module is None:
            emb = self.get_input_embeddings()
            head = torch.nn.Linear(emb.weight.shape[1], emb.weight.shape[0], bias=False)
            head.weight = emb.weight
            self._head_module = head
        return self._head_module

    def new_cache(self, rows: int, capacity: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Zeroed ``(keys, values)``: one ``[rows, kv_heads, capacity, head_dim]`` :attr:`kv_dtype` buffer per layer
        each, the cache :meth:`forward_rows` reads and writes."""
        c = self.config
        shape = (int(rows), int(c.num_key_value_heads), int(capacity), int(c.head_dim))
        L = int(c.num_hidden_layers)
        return ([torch.zeros(shape, dtype=self.kv_dtype) for _ in range(L)],
                [torch.zeros(shape, dtype=self.kv_dtype) for _ in range(L)])

    def forward_rows(self, tokens: torch.Tensor, position_ids: torch.Tensor, prefix_lens: torch.Tensor,
                     cache_rows: torch.Tensor, ancestor_bits: torch.Tensor, keys: List[torch.Tensor],
                     values: List[torch.Tensor], feature_layers: torch.Tensor, logit_rows: torch.Tensor):
        """One forward over ``tokens [B, N] int64`` (C++; see ``csrc/gguf_forward.h``).

        ``position_ids [B, N] int64``; ``prefix_lens [B] int64`` committed keys of each row (node j's K/V are
        written at ``prefix + j`` of cache row ``cache_rows[b]``); ``ancestor_bits [B, N, ceil(N/32)] int32``
        (node j visible to node i: bit ``j % 32`` of word ``j // 32``, self included); ``keys``/``values``:
        one ``[R, kv_heads, capacity, head_dim]`` buffer of :attr:`kv_dtype` per layer; ``feature_layers [F] int64``;
        ``logit_rows [n] int64`` flat query rows (``b * N + j``) whose logits are computed.
        Returns ``(logits [n, vocab] float32, features [B, N, F * hidden] float32)``.
        """
        return self._model.forward(tokens, position_ids, prefix_lens, cache_rows, ancestor_bits, keys, values,
                                   feature_layers, logit_rows)


def _config_from_gguf(reader: GGUFFile, arch: str, vocab: int, tied: bool):
    from transformers import LlamaConfig, Qwen3Config

    def need(key):
        v = reader.field(f"{arch}.{key}")
        if v is None:
            raise GGUFFormatError(f"GGUF metadata: missing {arch}.{key}")
        return v

    if reader.field(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise GGUFFormatError(f"GGUF metadata: {arch}.rope.scaling.type="
                              f"{reader.field(f'{arch}.rope.scaling.type')!r} is not supported (plain RoPE only)")
    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    head_dim = int(reader.field(f"{arch}.attention.key_length", hidden // heads))
    kw = dict(hidden_size=hidden, intermediate_size=int(need("feed_forward_length")),
              num_hidden_layers=int(need("block_count")), num_attention_heads=heads,
              num_key_value_heads=int(reader.field(f"{arch}.attention.head_count_kv", heads)), head_dim=head_dim,
              rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
              rope_theta=float(reader.field(f"{arch}.rope.freq_base", 10000.0)),
              max_position_embeddings=int(need("context_length")), vocab_size=vocab, tie_word_embeddings=tied,
              bos_token_id=reader.field("tokenizer.ggml.bos_token_id"),
              eos_token_id=reader.field("tokenizer.ggml.eos_token_id"),
              pad_token_id=reader.field("tokenizer.ggml.padding_token_id"))
    cfg = (LlamaConfig if arch == "llama" else Qwen3Config)(**kw)
    cfg.rope_theta = kw["rope_theta"]
    name = reader.field("general.name")
    cfg._name_or_path = str(name).replace(" ", "-") if name else arch
    return cfg


def _tensor_rows(t: GGUFTensor, name: str) -> Tuple[torch.Tensor, int, int, int]:
    """``(raw uint8 [N, row_bytes], ggml type, N, K)`` of a quantised matrix, checked."""
    ggml_type = t.ggml_type
    if ggml_type not in BLOCK_BYTES:
        raise GGUFFormatError(f"{name}: GGML type {t.type_name} is not supported by the GGUF forward; "
                              f"expected one of {', '.join(TYPE_NAMES.values())}")
    if len(t.shape) > 2:
        raise GGUFFormatError(f"{name}: expected a matrix, found {len(t.shape)} dimensions {t.shape}")
    K, N = int(t.shape[0]), int(t.shape[1]) if len(t.shape) > 1 else 1
    if K % BLOCK:
        raise GGUFFormatError(f"{name}: {K} columns is not a whole number of {BLOCK}-element blocks")
    row_bytes = K // BLOCK * BLOCK_BYTES[ggml_type]
    return torch.from_numpy(t.data.reshape(N, row_bytes).copy()), ggml_type, N, K


def _vector(t: GGUFTensor, name: str, n: int) -> torch.Tensor:
    if t.type_name != "F32":
        raise GGUFFormatError(f"{name}: expected an F32 vector, found {t.type_name}")
    if math.prod(t.shape) != n:
        raise GGUFFormatError(f"{name}: expected {n} values, found {math.prod(t.shape)}")
    return torch.from_numpy(t.data.view("<f4").astype(np.float32))


def load_gguf_target(path, kv_dtype: torch.dtype = torch.float16, activation_digits: int = 1) -> GGUFTarget:
    """Read a Llama / Qwen3 GGUF file into a :class:`GGUFTarget` whose KV cache holds ``kv_dtype``
    (``torch.float16``, the format's model, or ``torch.float32``) and whose matrix products take
    ``activation_digits`` int8 digits of each activation (1, the ``gguf`` format, or 2, ``gguf-a16``). The header
    is read by :class:`taps.models.gguf_file.GGUFFile` and each matrix repacked once (~0.2 s for SmolLM2 with
    transformers already imported; 2.6 s through gguf-py's reader).

    Raises :class:`GGUFFormatError` naming the tensor for unsupported types, wrong shapes and truncated data,
    and RuntimeError when this CPU cannot run the forward (it needs AVX-512 or AVX2; ``taps_kernels.explain()``).
    """
    from taps_kernels import _C

    if kv_dtype not in (torch.float16, torch.float32):
        raise ValueError(f"kv_dtype: expected torch.float16 or torch.float32, received {kv_dtype}")
    if activation_digits not in (1, 2):
        raise ValueError(f"activation_digits: expected 1 or 2, received {activation_digits!r}")
    if not _C.gguf_forward_available():
        raise RuntimeError("the GGUF target needs a CPU with AVX-512, or AVX2 with FMA and F16C (this one lacks "
                           "them): use --target-format fp32")
    path = Path(path)
    reader = GGUFFile(path)
    arch = reader.field("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFFormatError(f"general.architecture: {arch!r} is not supported; expected one of {ARCHITECTURES}")
    tensors = reader.tensors

    def get(name):
        if name not in tensors:
            raise GGUFFormatError(f"{name}: missing from {path.name}")
        return tensors[name]

    embed_raw, embed_type, vocab, hidden = _tensor_rows(get("token_embd.weight"), "token_embd.weight")
    tied = "output.weight" not in tensors
    cfg = _config_from_gguf(reader, arch, vocab, tied)
    if cfg.hidden_size != hidden:
        raise GGUFFormatError(f"token_embd.weight: {hidden} columns, metadata says hidden size {cfg.hidden_size}")

    def packed(name, rows_order=None):
        raw, ggml_type, n, k = _tensor_rows(get(name), name)
        if rows_order is not None:
            raw = raw[torch.from_numpy(rows_order)].contiguous()
        return (_C.gguf_pack(raw, ggml_type, k, name), ggml_type, n, k)

    norms: Dict[str, torch.Tensor] = {}
    layers = []
    H, D = cfg.hidden_size, cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"blk.{i}."
        layer = {}
        for key, gname in MATRICES.items():
            order = None
            if arch == "llama" and key in ("q", "k"):  # llama.cpp permutes q/k rows of Llama models only
                order = _unpermute_rows(int(get(p + gname + ".weight").shape[1]),
                                        cfg.num_attention_heads if key == "q" else cfg.num_key_value_heads)
            layer[key] = packed(p + gname + ".weight", order)
        for key, gname, n in (("attn_norm", "attn_norm", H), ("ffn_norm", "ffn_norm", H),
                              ("q_norm", "attn_q_norm", D), ("k_norm", "attn_k_norm", D)):
            name = p + gname + ".weight"
            if name in tensors:
                norms[name] = layer[key] = _vector(tensors[name], name, n)
            elif key in ("attn_norm", "ffn_norm") or arch == "qwen3":
                raise GGUFFormatError(f"{name}: missing from {path.name}")
            else:
                layer[key] = None
        layers.append(layer)
    norms["output_norm.weight"] = final_norm = _vector(get("output_norm.weight"), "output_norm.weight", H)
    embed = (_C.gguf_pack(embed_raw, embed_type, hidden, "token_embd.weight"), embed_type, vocab, hidden)
    head = embed if tied else packed("output.weight")
    model = _C.GGUFModel({"hidden": H, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                          "head_dim": D, "ffn": cfg.intermediate_size, "vocab": vocab, "rms_eps": cfg.rms_norm_eps,
                          "rope_base": cfg.rope_theta, "activation_digits": activation_digits},
                         layers, embed, final_norm, head)
    return GGUFTarget(cfg, model, norms, (embed_raw, embed_type), path, kv_dtype, activation_digits)
