"""Tree attention as a Hugging Face transformers attention implementation (``"taps_tree"``).

Importing this module registers :func:`taps_tree_attention` with transformers' ``AttentionInterface``
under the name ``"taps_tree"`` (and the standard sdpa mask builder under the same name, so calls
without a tree behave exactly like ``"sdpa"``). Works with transformers >= 4.56 (including 5.x) for
models whose attention layers dispatch through ``AttentionInterface`` (Llama, Qwen2/Qwen3, Mistral, ...).

How to verify a tree with an HF target::

    import taps_kernels
    from taps_kernels.integrations.transformers import TreeAttentionMetadata, tree_forward_inputs

    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="taps_tree")
    # or: model.set_attn_implementation("taps_tree") on transformers 5.x
    # (transformers 5.x names the cache keyword `cache`; `past_key_values` still works there, with a warning)
    cache = DynamicCache()                      # holds prefix_len tokens for every row after the prefill
    model(input_ids=prompt, past_key_values=cache, use_cache=True)      # no tree: plain sdpa
    position_ids, meta = tree_forward_inputs(tree, prefix_lens)         # prefix_lens [B] int64 == cache length
    out = model(input_ids=tree.tokens, position_ids=position_ids, past_key_values=cache, use_cache=True,
                taps_tree=meta)                                         # logits [B, N, V] of every node
    # or, for models that do not forward extra kwargs to attention:
    with use_tree(meta):
        out = model(input_ids=tree.tokens, position_ids=position_ids, past_key_values=cache, use_cache=True)

Inside each attention layer the tree's N queries attend to the ``L = prefix_len + N`` keys that the
cache returns (the prefix, then the N tree rows just appended) through
:func:`taps_kernels.tree_attention` without value checks (the ``taps::tree_attention`` op: the Triton
kernel on CUDA, the cpp/reference backend on CPU; usable under ``torch.compile``): prefix keys are visible,
tree key j is visible to node i iff bit j of ``ancestor_bits[b, i]`` is set. Position ids must be
``prefix_lens + depth`` (:func:`tree_forward_inputs` returns them). After acceptance, crop/compact the
cache with :func:`taps_kernels.compact_kv` on the per-layer key/value tensors.

Padded batches: pass the 2-D ``attention_mask`` of the cached prefix as ``prefix_mask`` to
:func:`tree_forward_inputs`; the position ids then count real tokens only, and the padded keys are
hidden. That path builds a dense ``[B, 1, N, L]`` boolean mask and runs SDPA (the fused kernels have
no key-padding input); without padding the fused op runs.

Preallocated caches: ``key``/``value`` reach the kernel as the cache returned them (strided views of a
preallocated buffer are read in place, never copied); with ``prefix_lens`` per row, rows of different
lengths share one buffer (right-padded: row b's keys past ``prefix_lens[b] + N`` are ignored). Inside
:func:`use_tree` the mask builder returns no mask at all (the tree attention does not read one).

Limits: every row of the batch must have the same cache length when ``prefix_lens`` is omitted
(HF's ``DynamicCache`` appends the tree at the same offset for all rows); no sliding-window layers,
soft-capping or attention dropout while a tree is active (these raise).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from .._checks import check_tensor
from ..layout import Tree
from ..ops import attention

ATTN_IMPLEMENTATION = "taps_tree"
"""Name under which the tree attention is registered (``attn_implementation="taps_tree"``)."""

KWARG = "taps_tree"
"""Keyword of the model's forward that carries the :class:`TreeAttentionMetadata`."""


@dataclass
class TreeAttentionMetadata:
    """The tree that the next forward verifies.

    Attributes:
        ancestor_bits: ``[B, N, ceil(N/32)] int32`` from :func:`taps_kernels.tree_mask` (node order of the
            forward's ``input_ids``).
        prefix_mask: optional ``[B, P]`` bool/int (1 = real token, 0 = padding) over the ``P`` cached keys,
            i.e. HF's 2-D ``attention_mask`` of the prefix; padded keys are hidden from the tree.
        prefix_lens: optional ``[B] int64`` cached tokens before each tree; the tree of row b occupies keys
            ``prefix_lens[b] .. prefix_lens[b] + N - 1``. Default: ``L - N`` for every row, where ``L`` is the
            key length each layer sees (the cache length after appending the tree).
    """

    ancestor_bits: torch.Tensor
    prefix_lens: Optional[torch.Tensor] = None
    prefix_mask: Optional[torch.Tensor] = None

    def __post_init__(self):
        check_tensor("ancestor_bits", self.ancestor_bits, dtypes=(torch.int32,), ndim=3)
        B, N, W = self.ancestor_bits.shape
        if W != (N + 31) // 32:
            raise ValueError(f"ancestor_bits: expected {(N + 31) // 32} words per row for {N} nodes, received {W}")
        if self.prefix_lens is not None:
            check_tensor("prefix_lens", self.prefix_lens, dtypes=(torch.int64, torch.int32), shape=(B,),
                         device=self.ancestor_bits.device)
        if self.prefix_mask is not None:
            check_tensor("prefix_mask", self.prefix_mask, dtypes=(torch.bool, torch.int64, torch.int32), ndim=2,
                         device=self.ancestor_bits.device)
            if self.prefix_mask.shape[0] != B:
                raise ValueError(f"prefix_mask: expected {B} rows (one per tree), received shape "
                                 f"{tuple(self.prefix_mask.shape)}")


def tree_forward_inputs(tree: Tree, prefix_lens: torch.Tensor, prefix_mask: Optional[torch.Tensor] = None
                        ) -> Tuple[torch.Tensor, TreeAttentionMetadata]:
    """``(position_ids [B,N] int64, TreeAttentionMetadata)`` for a forward over ``tree.tokens``.

    Builds (and validates) the mask with :func:`taps_kernels.tree_mask`; ``prefix_lens [B] int64``
    must equal the number of tokens already in the cache for each row. ``prefix_mask [B, P]``
    (left-padded batches: HF's 2-D attention mask of the cached tokens, ``P = max(prefix_lens)``):
    position ids count only real tokens, and padded keys are hidden from the tree.
    """
    from ..ops import tree_mask

    position_ids, bits = tree_mask(tree, prefix_lens)
    if prefix_mask is not None:
        P = int(prefix_lens.max())
        check_tensor("prefix_mask", prefix_mask, dtypes=(torch.bool, torch.int64, torch.int32),
                     shape=(tree.tokens.shape[0], P), device=tree.tokens.device)
        pads = prefix_lens.long() - prefix_mask.long().sum(1)
        position_ids = position_ids - pads[:, None]
    return position_ids, TreeAttentionMetadata(bits, prefix_lens.long(), prefix_mask)


def _tree_attention_padded(query, key, value, ancestor_bits, prefix_lens, prefix_mask, scale):
    """Dense-mask SDPA over the tree plus a key-padding mask of the prefix: ``[B, N, Hq, Dh]``."""
    from ..reference.attention import tree_visibility

    B, Hq, N, _ = query.shape
    L = key.shape[2]
    P = prefix_mask.shape[1]
    if P > L - N:
        raise ValueError(f"{KWARG}.prefix_mask: expected at most {L - N} prefix keys (cache length before the tree), "
                         f"received shape {tuple(prefix_mask.shape)}")
    keep = torch.ones(B, L, dtype=torch.bool, device=query.device)
    keep[:, :P] = prefix_mask.bool()
    visible = tree_visibility(ancestor_bits, prefix_lens, L) & keep[:, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=visible[:, None], scale=scale,
                                                           enable_gqa=Hq != key.shape[1])
    return out.transpose(1, 2).contiguous()


_ACTIVE: contextvars.ContextVar[Optional[TreeAttentionMetadata]] = contextvars.ContextVar("taps_tree", default=None)


@contextlib.contextmanager
def use_tree(meta: TreeAttentionMetadata) -> Iterator[TreeAttentionMetadata]:
    """Make ``meta`` the tree of every ``"taps_tree"`` attention call inside the block (when no
    ``taps_tree=`` keyword reaches the layer). Eager mode only: torch.compile does not trace context vars."""
    if not isinstance(meta, TreeAttentionMetadata):
        raise TypeError(f"meta: expected a TreeAttentionMetadata, received {type(meta).__name__}")
    token = _ACTIVE.set(meta)
    try:
        yield meta
    finally:
        _ACTIVE.reset(token)


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def taps_tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                        dropout: float = 0.0, **kwargs):
    """transformers attention function: tree attention when a tree is given, sdpa otherwise.

    Args (transformers' attention-function convention):
        query: ``[B, Hq, N, Dh]``; key/value: ``[B, Hkv, L, Dh]`` (cache + this forward's N rows).
        attention_mask: ignored when a tree is given (the tree's visibility comes from the metadata).
        scaling: softmax scale (the module's ``scaling``).
        kwargs: ``taps_tree=TreeAttentionMetadata`` selects the tree path; the rest goes to sdpa.
    Returns:
        ``(attn_output [B, N, Hq, Dh], None)``.
    """
    meta = kwargs.pop(KWARG, None)
    if meta is None:
        meta = _ACTIVE.get()
    if meta is None:
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if not isinstance(meta, TreeAttentionMetadata):
        raise TypeError(f"{KWARG}: expected a TreeAttentionMetadata, received {type(meta).__name__}")
    if dropout:
        raise ValueError(f"dropout: tree attention runs without attention dropout, received {dropout}")
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name}: tree attention does not support it, received {kwargs[name]}")
    B, _, N, _ = query.shape
    if tuple(meta.ancestor_bits.shape[:2]) != (B, N):
        raise ValueError(f"{KWARG}.ancestor_bits: expected {B} trees of {N} nodes (the forward's queries), received "
                         f"shape {tuple(meta.ancestor_bits.shape)}")
    prefix_lens = meta.prefix_lens
    if prefix_lens is None:
        prefix_lens = torch.full((B,), key.shape[2] - N, dtype=torch.int64, device=query.device)
    if meta.prefix_mask is not None:
        return _tree_attention_padded(query, key, value, meta.ancestor_bits, prefix_lens, meta.prefix_mask,
                                      scaling), None
    # key/value are what the cache returned: with a preallocated cache, strided views of its buffers. The
    # kernels read them in place through their strides (copying a layer's cache here would cost more than
    # the attention itself).
    out = attention.tree_attention(query, key, value, meta.ancestor_bits, prefix_lens, scale=scaling, validate="none")
    return out.transpose(1, 2).contiguous(), None


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register :func:`taps_tree_attention` as attention implementation ``name`` (idempotent); return ``name``."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, taps_tree_attention)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # older transformers build the mask from the config's implementation name elsewhere
        return name
    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def tree_or_sdpa_mask(*args, **kwargs):
        # Inside use_tree() the tree attention ignores the mask: building the dense [B, 1, N, L] causal
        # mask would be wasted work. Calls without a tree (prefill, plain decoding) get exactly sdpa's mask.
        # (torch.compile cannot trace a context variable; use_tree is eager-only anyway.)
        if not torch.compiler.is_compiling() and _ACTIVE.get() is not None:
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionMaskInterface.register(name, tree_or_sdpa_mask)
    return name


register()
