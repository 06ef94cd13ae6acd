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
            for layer in self._layers():
                layer.keys = layer.keys[:, :, :length]
                layer.values = layer.values[:, :, :length]
        self.length = length

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
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
    def prefill(self, prompt_ids: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run the prompt into a fresh cache.

        Args:
            prompt_ids: ``[1, T] int64``.
        Returns:
            ``(logits [V], features [1, T, n*H] or None)``: the target's logits after the last prompt token,
            and the drafter's context features of every prompt token.
        """
        self.reset()
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
        if not bool((nodes == torch.arange(accept_len, device=nodes.device)).all()):
            layers = self._layers()
            prefix = torch.tensor([self.length], dtype=torch.int64, device=self.device)
            taps_kernels.compact_kv([layer.keys for layer in layers], [layer.values for layer in layers], prefix,
                                    path.to(self.device))
        rows = self._cache_rows()
        self.length += accept_len
        if self.length < rows:
            for layer in self._layers():
                layer.keys = layer.keys[:, :, :self.length]
                layer.values = layer.values[:, :, :self.length]
