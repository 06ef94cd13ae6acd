"""The verifier of a :class:`taps.models.gguf_target.GGUFTarget`: the same cache layout, lengths and
compaction as every verifier (:class:`taps.decode.verifier.CacheVerifier`), each forward ONE C++ call
(``csrc/gguf_forward.h``) over the packed GGUF blocks.

Exactness by construction: the C++ forward computes every row with arithmetic that does not depend on the
other rows, and attention reduces over a row's visible keys in cache order. A tree node therefore gets the
same logits, bit for bit, as the same token decoded alone after its path was committed, so the tokens the
loop accepts are the target's own greedy choices whatever tree was verified (tested with memcmp-exact
comparisons in ``tests/test_gguf_forward.py``). A prefill is the same forward over the prompt as a chain:
it leaves the cache that decoding the prompt token by token would, and so does a prefill in pieces (the loop runs
a prompt on top of the rows an earlier request left: ``exact_prefix_reuse``).

Hidden states: the forward returns the drafter's features directly (``[B, N, n*H]``, the outputs of
``feature_layer_ids``), so :meth:`GGUFVerifier.features` only picks rows.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

import taps_kernels
from taps_kernels import Tree

from .tree_ops import IN_ROUND
from .verifier import CacheVerifier


def chain_bits(T: int, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Ancestor bits ``[B, T, ceil(T/32)] int32`` of chains padded to ``T`` nodes: node i of row b sees nodes
    0..i while ``i < lengths[b]``, a padding node only itself (the layout's padding rows). ``lengths [B]``
    integer; None: one row, ``T`` real nodes."""
    words = (T + 31) // 32
    i = torch.arange(T, dtype=torch.int64)[:, None]
    lo = torch.arange(words, dtype=torch.int64)[None, :] * 32
    count = (i - lo + 1).clamp(0, 32)
    bits = ((torch.ones_like(count) << count) - 1)[None]  # int64, at most 2**32 - 1
    if lengths is not None:
        own = torch.where((i >= lo) & (i < lo + 32), torch.ones_like(i) << (i - lo).clamp(0, 31), 0)
        real = torch.arange(T)[None, :, None] < lengths.to(torch.int64)[:, None, None]
        bits = torch.where(real, bits, own[None])
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)


class GGUFVerifier(CacheVerifier):
    """Owns a :class:`GGUFTarget`'s KV cache (``[max_batch, H_kv, capacity, Dh]`` of ``target.kv_dtype`` per
    layer) for up to ``max_batch`` rows; see :class:`CacheVerifier` for the interface."""

    #: a prefill in pieces leaves the bits of a whole one, and a tree node's row those of plain decoding
    exact_prefix_reuse = True

    def __init__(self, target, feature_layer_ids: Optional[Sequence[int]] = None, max_batch: int = 1):
        cfg = target.config
        self.model = target
        self.attention = "gguf"
        L = int(cfg.num_hidden_layers)
        if feature_layer_ids is not None:
            bad = [i for i in feature_layer_ids if not 0 <= int(i) < L]
            if bad:
                raise ValueError(f"feature_layer_ids: {bad[0]} is not a layer of the {L}-layer target")
        self._init_cache(L, int(cfg.num_key_value_heads), int(cfg.head_dim), target.kv_dtype, "cpu",
                         feature_layer_ids, max_batch)
        self._feature_layers = torch.tensor(self.feature_layer_ids or [], dtype=torch.int64)

    def features(self, hidden_states, rows: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``hidden_states`` is already ``[B, T, n*H]``; ``rows [T'] int64`` picks node rows."""
        if self.feature_layer_ids is None:
            return None
        return hidden_states if rows is None else hidden_states.index_select(1, rows)

    def _forward(self, tokens, position_ids, prefix, cache_rows, bits, logit_rows):
        logits, feats = self.model.forward_rows(tokens, position_ids, prefix, cache_rows, bits, self.keys, self.values,
                                                self._feature_layers, logit_rows)
        return logits, (feats if self.feature_layer_ids is not None else None)

    @torch.inference_mode()
    def prefill_row(self, row: int, prompt_ids: Sequence[int], start: int = 0) -> Tuple[torch.Tensor,
                                                                                         Optional[torch.Tensor]]:
        T = len(prompt_ids)
        if not 0 <= start < T:
            raise ValueError(f"start: expected 0 <= start < {T} (the prompt's length), received {start}")
        ids = torch.as_tensor(list(prompt_ids[start:]), dtype=torch.int64).view(1, -1)
        n = T - start
        self.reserve(T + 1)
        as_one = lambda v: torch.tensor([int(v)], dtype=torch.int64)  # noqa: E731
        logits, feats = self._forward(ids, torch.arange(start, T, dtype=torch.int64)[None], as_one(start), as_one(row),
                                      chain_bits(n), as_one(n - 1))
        self.lengths[row] = T
        self.host_lengths[row] = T
        return logits[0], feats

    @torch.inference_mode()
    def verify_batch(self, tree: Tree, rows: Optional[int] = None, chain: bool = False):
        """See :meth:`CacheVerifier.verify_batch` (``chain`` changes nothing here: the mask costs ~us)."""
        B, N, _ = self._tree_rows(tree, rows)
        prefix = self.lengths[:B]
        position_ids, bits = taps_kernels.tree_mask(tree, prefix, validate=IN_ROUND)
        logits, feats = self._forward(tree.tokens.contiguous(), position_ids.contiguous(), prefix.contiguous(),
                                      torch.arange(B, dtype=torch.int64), bits.contiguous(),
                                      torch.arange(B * N, dtype=torch.int64))
        return logits.view(B, N, -1), feats
