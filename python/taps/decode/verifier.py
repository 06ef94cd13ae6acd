"""The target side of a round: prefill, tree verification on an HF ``DynamicCache``, and KV compaction.

Cache discipline: ``length`` rows of the cache are committed (prompt plus every
token the target has run and kept). A verify call appends the tree's rows
after them; :meth:`TargetVerifier.commit` keeps only the accepted rows
(moved to contiguous positions with :func:`taps_kernels.compact_kv`) and
crops the rest; :meth:`TargetVerifier.crop` restores any earlier length (used
to undo a failed round).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import inspect

import torch

import taps_kernels
from taps_kernels import Tree


try:
    from transformers.cache_utils import DynamicLayer as _DynamicLayer
except ImportError:  # transformers without per-layer cache objects: plain DynamicCache rows
    _DynamicLayer = None


if _DynamicLayer is not None:
    class PreallocatedLayer(_DynamicLayer):
        """A ``DynamicLayer`` whose rows live in a buffer allocated once per generation.

        HF's ``DynamicLayer`` concatenates (copies the whole layer) at every forward; here a forward
        writes only its new rows, cropping is O(1), and ``keys``/``values`` are views ``[B, H, n, Dh]``
        of the buffer, so :func:`taps_kernels.compact_kv` moves rows in place. The buffer doubles when
        full.
        """

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = max(int(capacity), 1)
            self._k = self._v = None
            self._n = 0
            self.is_initialized = False  # older transformers releases do not set it

        def lazy_initialization(self, key_states, value_states, *args, **kwargs):
            B, H, _, Dh = key_states.shape
            self._k = key_states.new_empty(B, H, self.capacity, Dh)
            self._v = value_states.new_empty(B, H, self.capacity, value_states.shape[-1])
            self.device, self.dtype = key_states.device, key_states.dtype
            self.is_initialized = True
            self.set_length(0)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, t = self._n, key_states.shape[-2]
            if n + t > self._k.shape[-2]:
                cap = max(2 * self._k.shape[-2], n + t)
                k, v = self._k, self._v
                self._k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
                self._v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
                self._k[:, :, :n] = k[:, :, :n]
                self._v[:, :, :n] = v[:, :, :n]
            self._k[:, :, n:n + t] = key_states
            self._v[:, :, n:n + t] = value_states
            self.set_length(n + t)
            return self.keys, self.values

        def set_length(self, n: int) -> None:
            self._n = n
            self.keys = self._k[:, :, :n]
            self.values = self._v[:, :, :n]

        def get_seq_length(self, *args, **kwargs) -> int:
            return self._n

        def crop(self, length: int) -> None:
            # negative: rows to drop (transformers 5); otherwise the length to keep (transformers 4)
            if self.is_initialized:
                self.set_length(max(self._n + length, 0) if length < 0 else min(length, self._n))
else:
    PreallocatedLayer = None


def _slice_tree(tree: Tree, n: int) -> Tree:
    if tree.tokens.shape[1] == n:
        return tree
    return Tree(tree.tokens[:, :n], tree.parents[:, :n], tree.depth[:, :n], tree.num_nodes)


def _is_chain(tree: Tree) -> bool:
    # A chain's tree mask is the ordinary causal one, which HF builds itself.
    n = tree.tokens.shape[1]
    return bool((tree.parents[0, 1:] == torch.arange(n - 1, device=tree.device, dtype=torch.int32)).all())


class TargetVerifier:
    """Owns the target's KV cache for one sequence (batch 1).

    Args:
        model: an HF causal LM (Llama/Qwen-style: ``model(input_ids, position_ids, attention_mask,
            past_key_values, output_hidden_states, logits_to_keep)``).
        feature_layer_ids: target layer ids whose outputs the drafter reads (``hidden_states[id + 1]``,
            concatenated on the last dim), or None when no drafter runs (hidden states are then never requested).
    """

    def __init__(self, model, feature_layer_ids: Optional[Sequence[int]] = None):
        self.model = model
        self.feature_layer_ids = list(feature_layer_ids) if feature_layer_ids is not None else None
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = None
        self.length = 0
        # transformers 5.x renamed the forward's cache argument; older releases only know the first name.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # --- cache bookkeeping ------------------------------------------------------------------------------------

    def _layers(self):
        return self.cache.layers

    def _cache_rows(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cache rows of every layer (``0 <= length <= rows present``)."""
        if self.cache is None:
            self.length = 0
            return
        rows = self._cache_rows()
        if not 0 <= length <= rows:
            raise ValueError(f"length: expected 0 <= length <= {rows} cached rows, received {length}")
        if length < rows:
            self._truncate(length)
        self.length = length

    def _truncate(self, length: int) -> None:
        for layer in self._layers():
            if hasattr(layer, "set_length"):
                layer.set_length(length)
            else:
                layer.keys = layer.keys[:, :, :length]
                layer.values = layer.values[:, :, :length]

    def reset(self, capacity: int = 0) -> None:
        """Start an empty cache with room for ``capacity`` rows per layer (it grows if needed)."""
        from transformers import DynamicCache

        cfg = self.model.config
        plain = (PreallocatedLayer is None or getattr(cfg, "sliding_window", None)
                 or getattr(cfg, "layer_types", None) and any(t != "full_attention" for t in cfg.layer_types))
        if plain:  # sliding-window layers keep HF's own cache classes
            self.cache = DynamicCache(config=cfg)
        else:
            self.cache = DynamicCache()
            self.cache.layers = [PreallocatedLayer(capacity) for _ in range(cfg.num_hidden_layers)]
        self.length = 0

    def features(self, hidden_states, rows: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Drafter context features ``[1, T, n*H]`` from a forward's ``hidden_states`` tuple, rows
        ``rows [T] int64`` (default: all)."""
        if self.feature_layer_ids is None:
            return None
        picked = [hidden_states[i + 1] for i in self.feature_layer_ids]
        if rows is not None:
            picked = [h.index_select(1, rows) for h in picked]
        return torch.cat(picked, dim=-1)

    # --- forwards ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor, capacity: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run the prompt into a fresh cache.

        Args:
            prompt_ids: ``[1, T] int64``.
            capacity: expected cache rows (prompt + output + one tree) to preallocate.
        Returns:
            ``(logits [V], features [1, T, n*H] or None)``: the target's logits after the last prompt token,
            and the drafter's context features of every prompt token.
        """
        self.reset(max(capacity, prompt_ids.shape[1]))
        want_hidden = self.feature_layer_ids is not None
        out = self.model(input_ids=prompt_ids.to(self.device), use_cache=True, **{self._cache_kw: self.cache},
                         output_hidden_states=want_hidden, logits_to_keep=1)
        self.length = prompt_ids.shape[1]
        feats = self.features(out.hidden_states) if want_hidden else None
        return out.logits[0, -1], feats

    @torch.inference_mode()
    def verify(self, tree: Tree) -> Tuple[torch.Tensor, Optional[tuple], Tree]:
        """One target forward over the tree's real nodes on top of the committed cache.

        Node ``i`` gets position ``length + depth[i]`` and sees the whole committed cache plus its own
        ancestors and itself (float additive mask from :func:`taps_kernels.ancestor_bits_to_additive_mask`).
        Args:
            tree: batch-1 :class:`Tree`; only its first ``num_nodes[0]`` rows run.
        Returns:
            ``(logits [n, V], hidden_states or None, tree sliced to n rows)``; the cache then holds
            ``length + n`` rows until :meth:`commit` or :meth:`crop`.
        """
        n = int(tree.num_nodes[0])
        tree = _slice_tree(tree, n)
        want_hidden = self.feature_layer_ids is not None
        ids = tree.tokens.to(self.device)
        if n == 1 or _is_chain(tree):
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_kw: self.cache},
                             output_hidden_states=want_hidden)
        else:
            prefix = torch.tensor([self.length], dtype=torch.int64, device=tree.device)
            position_ids, bits = taps_kernels.tree_mask(tree, prefix)
            mask = taps_kernels.ancestor_bits_to_additive_mask(bits, prefix, self.length + n, dtype=self.dtype)
            out = self.model(input_ids=ids, position_ids=position_ids.to(self.device),
                             attention_mask=mask.to(self.device), use_cache=True, **{self._cache_kw: self.cache},
                             output_hidden_states=want_hidden)
        return out.logits[0], (out.hidden_states if want_hidden else None), tree

    @torch.inference_mode()
    def commit(self, path: torch.Tensor, accept_len: int) -> None:
        """Keep the accepted tree rows after the committed prefix and crop the rest.

        Args:
            path: ``[1, P] int64`` accepted node indices from :func:`taps_kernels.accept_greedy` (root first).
            accept_len: accepted nodes (root included).
        """
        nodes = path[0, :accept_len]
        if accept_len > 1 and not bool((nodes == torch.arange(accept_len, device=nodes.device)).all()):
            layers = self._layers()
            prefix = torch.tensor([self.length], dtype=torch.int64, device=self.device)
            taps_kernels.compact_kv([layer.keys for layer in layers], [layer.values for layer in layers], prefix,
                                    path.to(self.device))
        rows = self._cache_rows()
        self.length += accept_len
        if self.length < rows:
            self._truncate(self.length)
