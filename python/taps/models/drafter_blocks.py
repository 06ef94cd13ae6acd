"""The DFlash drafter's draft pass through the GGUF block forward (``csrc/gguf_forward.h``): its layers in
Q8_0 blocks (weights quantised per 32-block, activations per row and 32-block), the target's embedding rows
and the draft vocabulary's head rows in Q8_0 or Q4_1 (a GGUF target's own blocks where it has them; else its
float rows quantised), the whole pass one C++ call.

A drafter layer is a Qwen3 decoder layer (q/k norms, RoPE, GQA, SwiGLU) whose block rows attend to the row's
context K/V and to each other (bidirectionally): exactly the forward's visibility with the context as the
prefix and every block node visible to every other. The context rows' K/V are written by
:meth:`BlockDraft.project_context` (called when :class:`taps.models.drafter.DFlashDrafter` projects its context)
through ``fc``, the norm and the same packed projections, k-norm and RoPE as the block rows, one C++
call for all of it (:func:`enable_block_draft` also swaps the layers' linear modules for
:class:`BlockLinear`, whose packed weights both read).

Draft logits only propose tokens; the target verifies them, so none of this changes a generated token.
"""
from __future__ import annotations

import torch

from taps_kernels.integrations.block_linear import BlockLinear, use_block_linear
from taps_kernels.integrations.rows_linear import store_bf16_if_exact, use_rows_linear
from taps_kernels.reference.gguf import (Q4_1, Q8_0, dequantize_blocks_reference, quantize_q4_1_reference,
                                        quantize_q8_0_reference)

#: Block formats of the draft head (:func:`enable_block_draft`) and their quantisers.
HEAD_FORMATS = {"q8_0": Q8_0, "q4_1": Q4_1}
QUANTIZE = {Q8_0: quantize_q8_0_reference, Q4_1: quantize_q4_1_reference}


def block_draft_available() -> bool:
    """Whether the block forward runs here with vector int8 kernels (AVX-512 VNNI or AVX2: the plain loops would
    be slower than torch)."""
    try:
        from taps_kernels import _C
    except ImportError:
        return False
    return bool(_C.gguf_forward_available() and _C.gguf_kernel_path() != "scalar")


def block_draft_unsupported(config) -> str:
    """Why a drafter of ``config`` cannot run the block forward ("" when it can): its shapes must be whole
    blocks (hidden, heads x head_dim and intermediate sizes multiples of 32), head_dim a multiple of 16 up to
    128, at most 8 query heads per KV head."""
    c = config
    if c.hidden_size % 32 or c.intermediate_size % 32 or (c.num_attention_heads * c.head_dim) % 32:
        return "hidden, intermediate and heads x head_dim sizes must be multiples of 32"
    if c.head_dim % 16 or c.head_dim > 128:
        return f"head_dim {c.head_dim}: expected a multiple of 16, at most 128"
    if c.num_attention_heads % c.num_key_value_heads or c.num_attention_heads // c.num_key_value_heads > 8:
        return "query heads must be a multiple of the KV heads, at most 8x"
    if getattr(c, "attention_bias", False):
        return "attention biases are not supported"
    return ""


def _packed(m: BlockLinear):
    return (m.packed, Q8_0, m.out_features, m.in_features)


class BlockDraft:
    """The packed model of one drafter (built by :func:`enable_block_draft`); :meth:`draft` replaces the
    PyTorch layers of :meth:`DFlashDrafter.draft`."""

    def __init__(self, drafter, head_format: str = "q8_0"):
        from taps_kernels import _C

        if head_format not in HEAD_FORMATS:
            raise ValueError(f"head_format: expected one of {sorted(HEAD_FORMATS)}, received {head_format!r}")
        self._C = _C
        self.drafter = drafter
        self.head_format = head_format
        self.head_type = HEAD_FORMATS[head_format]
        c = drafter.config
        self.layers = []
        for layer in drafter.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append({"attn_norm": layer.input_layernorm.weight.detach().float().contiguous(),
                                "ffn_norm": layer.post_attention_layernorm.weight.detach().float().contiguous(),
                                "q_norm": a.q_norm.weight.detach().float().contiguous(),
                                "k_norm": a.k_norm.weight.detach().float().contiguous(),
                                "q": _packed(a.q_proj), "k": _packed(a.k_proj), "v": _packed(a.v_proj),
                                "o": _packed(a.o_proj), "gate": _packed(mlp.gate_proj), "up": _packed(mlp.up_proj),
                                "down": _packed(mlp.down_proj)})
        self.final_norm = drafter.norm.weight.detach().float().contiguous()
        self.config = {"hidden": c.hidden_size, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                       "head_dim": c.head_dim, "ffn": c.intermediate_size, "vocab": c.vocab_size,
                       "rms_eps": float(c.rms_norm_eps), "rope_base": float(c.rope_theta)}
        # the layers alone (no embedding, no head): the context rows' keys and values
        self._context = _C.GGUFModel(self.config, self.layers, None, self.final_norm, None)
        self._model = None
        self._key = None
        self._last = torch.tensor([len(self.layers) - 1], dtype=torch.int64)

    def _bind(self, embed_tokens, lm_head) -> None:
        """(Re)build the packed model for this embedding / head / draft vocabulary (cached by identity)."""
        ew, hw, ids = embed_tokens.weight, lm_head.weight, self.drafter.draft_vocab
        key = (ew.data_ptr(), ew._version, hw.data_ptr(), hw._version,
               None if ids is None else (ids.data_ptr(), ids.numel()))
        if key == self._key:
            return
        H = self.config["hidden"]
        blocks = getattr(embed_tokens, "gguf_blocks", None)  # a GGUF target's own blocks: used as they are
        raw, t = blocks if blocks is not None else (quantize_q8_0_reference(ew.detach().float()), Q8_0)
        ht = self.head_type
        if blocks is not None and hw is ew:  # tied head: the same blocks' rows (re-quantised if another format)
            head_raw = raw if ids is None else raw.index_select(0, ids.cpu()).contiguous()
            if t != ht:
                head_raw = QUANTIZE[ht](dequantize_blocks_reference(head_raw, t, H))
        else:
            rows = hw.detach().float() if ids is None else hw.detach().float().index_select(0, ids.to(hw.device))
            head_raw = QUANTIZE[ht](rows)
        embed = (self._C.gguf_pack(raw, t, H, "embed"), t, raw.shape[0], H)
        head = (self._C.gguf_pack(head_raw, ht, H, "head"), ht, head_raw.shape[0], H)
        self._model = self._C.GGUFModel(self.config, self.layers, embed, self.final_norm, head)
        self._key = key

    @torch.no_grad()
    def project_context(self, state, ctx_features: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Every layer's keys and values of the context rows ``ctx_features [M, n*H]`` (the target's features)
        into state row ``rows[i]`` at slot ``slots[i]`` (``[M] int64`` each), in one C++ call: ``fc`` (the
        few-row kernel, its bfloat16 weights as stored when they are), ``hidden_norm``, then the projections,
        k-norm and RoPE of the draft's own rows, each row alone (its bits do not depend on the others). Float32
        throughout (the norm sums in another order than the PyTorch module: proposals only)."""
        d = self.drafter
        x = ctx_features.float() if d.feature_scale is None else ctx_features.float() * d.feature_scale
        self._context.project_context_kv(x.contiguous()[:, None], d.fc.weight.detach(),
                                         d.hidden_norm.weight.detach().float(), float(d.hidden_norm.eps),
                                         slots.contiguous(), rows.contiguous(), state.k_buf, state.v_buf)

    @torch.no_grad()
    def draft(self, state, sl: slice, bonus_tokens: torch.Tensor, embed_tokens, lm_head, P: int, S: int,
              full: bool):
        """Same contract as :meth:`DFlashDrafter.draft` for state rows ``sl`` (``S`` block rows, ``P``
        projected positions)."""
        self._bind(embed_tokens, lm_head)
        d = self.drafter
        B = bonus_tokens.shape[0]
        ids = torch.full((B, S), d.mask_token_id, dtype=torch.int64)
        ids[:, 0] = bonus_tokens
        lengths = state.lengths[sl].contiguous()
        pos = lengths[:, None] + torch.arange(S)
        bits = torch.full((B, S, (S + 31) // 32), -1, dtype=torch.int32)  # every block row sees every other
        if S % 32:
            bits[..., -1] = (1 << (S % 32)) - 1
        logit_rows = (torch.arange(B)[:, None] * S + torch.arange(1, P + 1)[None, :]).reshape(-1)
        logits, feats = self._model.forward(ids, pos, lengths, torch.arange(sl.start, sl.start + B),
                                            bits, state.k_buf, state.v_buf, self._last, logit_rows)
        hidden = feats[:, 1:1 + P]
        logits = logits.view(B, P, -1)
        vocab = d.draft_vocab
        if vocab is None or not full:
            return logits, hidden
        out = logits.new_full((B, P, lm_head.weight.shape[0]), float("-inf"))
        out.index_copy_(2, vocab, logits)
        return out, hidden


def enable_block_draft(drafter, head_format: str = "q8_0") -> "BlockDraft":
    """Switch ``drafter`` (float32, on the CPU) to block drafting: its layers' linear modules become
    :class:`BlockLinear` (Q8_0) and :meth:`DFlashDrafter.draft` runs :class:`BlockDraft`. ``fc`` (the
    context features, whose outlier channels int8 activations would destroy) stays in float32, through the few-row
    kernel (:class:`taps_kernels.integrations.rows_linear.RowsLinear`).

    ``head_format``: the draft vocabulary's head rows as ``"q8_0"`` (a GGUF target's own blocks, or float rows
    quantised) or ``"q4_1"`` (re-quantised from those: 8.3 MB instead of 14.7 for SmolLM2's 24K draft rows,
    ~0.3 ms less per 7-position draft on this project's CPU, for tau -1.1% on HumanEval and -0.65% on MT-Bench
    with DDTree budget 4 over 60 prompts each; README "Results")."""
    if next(drafter.parameters()).dtype != torch.float32 or next(drafter.parameters()).device.type != "cpu":
        raise ValueError("drafter: block drafting needs a float32 drafter on the CPU")
    if not block_draft_available():
        raise RuntimeError("block drafting needs the block kernels' AVX-512 VNNI or AVX2 path on this CPU "
                           "(taps_kernels.explain() says which runs)")
    why = block_draft_unsupported(drafter.config)
    if why:
        raise ValueError(f"drafter: block drafting: {why}")
    use_block_linear(drafter.layers)
    # fc reads the few context rows of a round (1-8): the few-row kernel streams its weight once for all of them
    # (3 rows: 0.19 ms instead of sgemm's 0.32 here), from bfloat16 storage when that is exact (the shipped
    # checkpoint is bfloat16: 3.3 MB a round instead of 6.6, the same outputs)
    use_rows_linear(drafter.fc)
    store_bf16_if_exact(drafter.fc)
    drafter.block_draft = BlockDraft(drafter, head_format)
    return drafter.block_draft
