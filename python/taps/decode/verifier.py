"""The target side of a round, batched: a preallocated per-row KV cache, prefill of one row, one tree
verification over every row, and one compaction call.

Cache layout (right-padded, one row per request slot): every layer owns ``keys``/``values`` buffers
``[max_batch, H_kv, capacity, Dh]`` allocated once. Row ``b`` holds its committed tokens (prompt plus every
token the target has run and kept) at positions ``[0, lengths[b])``; positions past that are scratch. A
verify writes row b's tree node ``j`` at ``lengths[b] + j`` (a scatter, no host read), and attention reads
the buffers in place as strided views ``[:B, :, :L]`` with ``L = max(lengths) + N``; row b sees its own
``lengths[b]`` prefix keys plus its tree (``taps_kernels.tree_attention``'s ``prefix_lens``), so rows of
different lengths share one forward without padding tokens. :meth:`CacheVerifier.commit_round` chooses the
target's tokens, accepts, keeps only the accepted rows of every layer and every row and advances ``lengths`` on
the device, in ONE :func:`taps_kernels.commit_round` call (:meth:`CacheVerifier.commit_batch`: the compaction alone,
for a path accepted elsewhere). Undoing a failed round only needs the old ``lengths`` (rows below a length are
never written by a later round).

``lengths [max_batch] int64`` lives on the model's device (the truth); ``host_lengths`` is its host mirror,
updated by the decode loop from the one read per round (never by reading the device).

Attention (``attention=``): ``"taps_tree"`` runs :func:`taps_kernels.tree_attention` in every layer through
the ``"taps_tree"`` transformers attention implementation (:mod:`taps_kernels.integrations.transformers`;
the model is switched to it, which is exactly sdpa for calls without a tree); ``"sdpa"`` is the fallback:
a dense ``[B, 1, N, L]`` float mask built on the device and HF's sdpa attention. ``"auto"``: taps_tree on
GPUs; on CPU :data:`CPU_DEFAULT_ATTENTION` (measured, see there).
"""
from __future__ import annotations

import inspect
from typing import List, Optional, Sequence, Tuple

import torch

import taps_kernels
from taps_kernels import Tree
from taps_kernels.integrations import transformers as taps_hf
from taps_kernels.reference.attention import tree_visibility

from .tree_ops import IN_ROUND

try:
    from transformers.cache_utils import DynamicLayer as _DynamicLayer
except ImportError:  # pragma: no cover - transformers without per-layer cache objects
    _DynamicLayer = None

ATTENTIONS = ("auto", "taps_tree", "sdpa")

#: The CPU default of ``attention="auto"``, from bench/bench_verify_attention.py on SmolLM2 verify shapes
#: (1-17 nodes, prefix 100-600, fp32, 1 thread; bench/results/verify_attention_cpu.json): the dense-mask
#: sdpa forward was faster in all 15 cells, median 1.39x (taps_tree/sdpa time). On CPU the tree-attention
#: op is the PyTorch reference (there is no C++ kernel): it expands K/V per query head and rebuilds the
#: visibility mask in every layer, where sdpa gets one mask per forward.
CPU_DEFAULT_ATTENTION = "sdpa"


def resolve_attention(attention: str, device: torch.device) -> str:
    """``"taps_tree"`` or ``"sdpa"`` for ``attention`` in :data:`ATTENTIONS` on ``device``."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention: expected one of {ATTENTIONS}, received {attention!r}")
    if attention != "auto":
        return attention
    return "taps_tree" if torch.device(device).type == "cuda" else CPU_DEFAULT_ATTENTION


if _DynamicLayer is not None:
    class _RowLayer(_DynamicLayer):
        """One layer's view of the shared buffers, in whatever mode the verifier set for this forward."""

        def __init__(self, owner: "TargetVerifier", index: int):
            super().__init__()
            self.owner, self.index = owner, index
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states, *args, **kwargs):
            pass  # buffers are preallocated by the verifier

        def update(self, key_states, value_states, *args, **kwargs):
            o = self.owner
            K, V = o.keys[self.index], o.values[self.index]
            if o._mode == "prefill":
                s, T = o._slot, key_states.shape[2]
                K[s:s + 1, :, :T] = key_states
                V[s:s + 1, :, :T] = value_states
                k, v = K[s:s + 1, :, :T], V[s:s + 1, :, :T]
            else:
                B = o._rows
                K[:B].scatter_(2, o._write_index, key_states)
                V[:B].scatter_(2, o._write_index, value_states)
                k, v = K[:B, :, :o._kv_len], V[:B, :, :o._kv_len]
            self.keys, self.values = k, v
            return k, v

        def get_seq_length(self, *args, **kwargs) -> int:
            return self.owner._past

        def get_mask_sizes(self, query_length: int, *args, **kwargs):
            return self.owner._past + query_length, 0

        def get_max_length(self) -> int:
            return -1
else:  # pragma: no cover
    _RowLayer = None


class CacheVerifier:
    """What every target's verifier shares: the per-row KV buffers ``[max_batch, H_kv, capacity, Dh]`` per
    layer, the device ``lengths`` and their host mirror, one-call compaction, and the batch-1 interface.
    Subclasses run the forwards (:meth:`prefill_row`, :meth:`verify_batch`) and say how a forward's hidden
    states become drafter features (:meth:`features`)."""

    #: Whether the cache rows a request leaves are the bits a prefill of the same tokens would write, so that a
    #: later prompt starting with those tokens may run only its rest (:meth:`prefill_row` ``start``). True only
    #: where every row's arithmetic is independent of how rows were batched (the GGUF forward).
    exact_prefix_reuse = False

    def _init_cache(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                    feature_layer_ids: Optional[Sequence[int]], max_batch: int) -> None:
        self.feature_layer_ids = list(feature_layer_ids) if feature_layer_ids is not None else None
        self.num_layers, self.kv_heads, self.head_dim = int(num_layers), int(kv_heads), int(head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_batch = 0
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.host_lengths: List[int] = []
        #: how many times the buffers were made anew (their rows lost): a kept prefix is valid within one
        self.buffers_made = 0
        self.reset(max_batch, 0)

    # --- buffers --------------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def reset(self, max_batch: int, capacity: int) -> None:
        """Empty cache of ``max_batch`` rows with room for ``capacity`` positions each (grows on demand; the
        buffers of an earlier run are kept when they fit)."""
        reuse = self.keys and self.max_batch == int(max_batch) and self.capacity >= int(capacity)
        self.max_batch = int(max_batch)
        if not reuse:  # else the old buffers serve: the lengths alone say what is valid
            self.buffers_made += 1
            shape = (self.max_batch, self.kv_heads, max(int(capacity), 1), self.head_dim)
            self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.lengths = torch.zeros(self.max_batch, dtype=torch.int64, device=self.device)
        self.host_lengths = [0] * self.max_batch

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` per row (between rounds: a copy of the buffers, doubling)."""
        if positions <= self.capacity:
            return
        cap = max(int(positions), 2 * self.capacity)
        for group in (self.keys, self.values):
            for i, t in enumerate(group):
                new = t.new_zeros(t.shape[0], t.shape[1], cap, t.shape[3])
                new[:, :, :t.shape[2]] = t
                group[i] = new

    def set_host_lengths(self, lengths: Sequence[int]) -> None:
        """Report the device lengths on the host (the caller knows them from its one read)."""
        self.host_lengths = [int(x) for x in lengths]

    def reset_row(self, row: int) -> None:
        """Empty one row (its request left)."""
        self.lengths[row] = 0
        self.host_lengths[row] = 0

    def features(self, hidden_states, rows: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Drafter context features ``[B, T, n*H]`` from a forward's hidden states; ``rows [T] int64`` picks
        node rows (all rows when None)."""
        raise NotImplementedError

    def prefill_row(self, row: int, prompt_ids: Sequence[int], start: int = 0) -> Tuple[torch.Tensor,
                                                                                         Optional[torch.Tensor]]:
        """Run one prompt alone into row ``row`` (other rows untouched, nothing recomputed).

        ``start``: the row's cache already holds ``prompt_ids[:start]`` at positions ``0 .. start-1`` (left by an
        earlier request); only the rest runs, on top of them. Only where :attr:`exact_prefix_reuse` (else 0).
        Returns ``(logits [V] after the last prompt token, features [1, T - start, n*H] or None)``.
        """
        raise NotImplementedError

    def verify_batch(self, tree: Tree, rows: Optional[int] = None, chain: bool = False):
        """One target forward over the trees of rows ``[0, B)`` on top of their committed prefixes.

        Node ``i`` of row ``b`` gets position ``lengths[b] + depth[b, i]`` and sees row b's prefix plus its own
        ancestors and itself. Padding nodes see only themselves (their outputs are never accepted).
        Args:
            tree: :class:`Tree` ``[B, N]`` on the model's device (every row, padded to the batch's largest).
            rows: ``B`` (default ``tree.batch_size``); the host must know ``max(lengths[:B])``.
            chain: every row's tree is a chain (node i at depth i; a root alone is one); a hint some forwards
                use to skip the tree mask.
        Returns:
            ``(logits [B, N, V], hidden states or None)`` (pass the hidden states to :meth:`features`). The
            cache lengths do not change: the tree rows sit past each length until :meth:`commit_round`.
        """
        raise NotImplementedError

    def _tree_rows(self, tree: Tree, rows: Optional[int]) -> Tuple[int, int, int]:
        """``(B, N, kv_len)`` of a verify, room reserved (host side: the host knows every length)."""
        B, N = tree.tokens.shape
        rows = B if rows is None else rows
        if rows != B:
            raise ValueError(f"tree: expected {rows} rows, received {B}")
        kv_len = max(self.host_lengths[:B]) + N
        self.reserve(kv_len)
        return B, N, kv_len

    @torch.inference_mode()
    def commit_round(self, tree: Tree, active: torch.Tensor, max_depth: int, logits: Optional[torch.Tensor] = None,
                     target_tokens: Optional[torch.Tensor] = None,
                     history: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, moves: bool = True):
        """Commit the verified ``tree`` of rows ``[0, B)`` (ONE :func:`taps_kernels.commit_round` call): the target's
        tokens (the argmax of ``logits [B, N, V]``, or ``target_tokens [B, N]``), the acceptance walk (``active [B]``
        bool; nodes down to ``max_depth``), the committed tokens' append to ``history``, the accepted rows kept after
        the prefixes in every layer, and ``lengths += accept_len`` on the device. ``moves`` as in
        :meth:`commit_batch`. Returns ``(path [B, P], accept_len [B], next_token [B], committed [B, P])`` int64."""
        B = tree.tokens.shape[0]
        return taps_kernels.commit_round(tree, active, max_depth, self.keys, self.values, self.lengths[:B],
                                         logits=logits, target_tokens=target_tokens, history=history, moves=moves,
                                         validate=IN_ROUND)

    @torch.inference_mode()
    def commit_batch(self, path: torch.Tensor, accept_len: torch.Tensor, moves: bool = True) -> None:
        """Keep the accepted tree rows of rows ``[0, B)`` after their prefixes (ONE compact_kv call over every
        layer and row) and advance ``lengths`` by ``accept_len`` on the device.

        Args:
            path: ``[B, P] int64`` accepted nodes (root first, -1 padded).
            accept_len: ``[B] int64`` tokens each row keeps (0 for rows that are not running: their path must
                then be the root alone, which moves nothing).
            moves: False when no row can need a move (chains: the accepted nodes are already contiguous).
        """
        B = path.shape[0]
        if moves:
            whole = B == self.keys[0].shape[0]  # no per-layer views to build (60 of them for SmolLM2)
            keys = self.keys if whole else [k[:B] for k in self.keys]
            values = self.values if whole else [v[:B] for v in self.values]
            taps_kernels.compact_kv(keys, values, self.lengths[:B], path, validate=IN_ROUND)
        self.lengths[:B] += accept_len

    # --- batch-1 interface (scorer traces, latency calibration) -------------------------------------------------

    @property
    def length(self) -> int:
        """Committed rows of row 0 (host side)."""
        return self.host_lengths[0]

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor, capacity: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Start a fresh one-row cache with ``prompt_ids [1, T]``; returns ``(logits [V], features or None)``."""
        self.reset(1, max(capacity, prompt_ids.shape[1]) + 1)
        return self.prefill_row(0, prompt_ids[0].tolist())

    @torch.inference_mode()
    def verify(self, tree: Tree) -> Tuple[torch.Tensor, Optional[tuple], Tree]:
        """Row 0 verifies a one-row ``tree`` (its first ``num_nodes[0]`` rows). Returns ``(logits [n, V],
        hidden states or None, tree sliced to n rows)``."""
        n = int(tree.num_nodes[0])
        if tree.tokens.shape[1] != n:
            tree = Tree(tree.tokens[:, :n], tree.parents[:, :n], tree.depth[:, :n], tree.num_nodes)
        tree = tree.to(self.device)
        logits, hs = self.verify_batch(tree, 1)
        return logits[0], hs, tree

    @torch.inference_mode()
    def commit(self, path: torch.Tensor, accept_len: int) -> None:
        """Row 0 keeps ``accept_len`` nodes of ``path [1, P]``."""
        self.commit_batch(path.to(self.device), torch.tensor([int(accept_len)], device=self.device))
        self.host_lengths[0] += int(accept_len)

    def crop(self, length: int) -> None:
        """Row 0 keeps its first ``length`` committed rows."""
        if not 0 <= length <= self.host_lengths[0]:
            raise ValueError(f"length: expected 0 <= length <= {self.host_lengths[0]} cached rows, received {length}")
        self.lengths[0] = length
        self.host_lengths[0] = length


class TargetVerifier(CacheVerifier):
    """The HF module target's verifier: owns the target's KV cache for up to ``max_batch`` rows.

    Args:
        model: an HF causal LM (Llama/Qwen-style, full attention in every layer).
        feature_layer_ids: target layer ids whose outputs the drafter reads (``hidden_states[id + 1]``,
            concatenated on the last dim), or None when no drafter runs.
        attention: ``"auto"``, ``"taps_tree"`` or ``"sdpa"`` (module docstring).
        max_batch: rows (request slots).
    """

    def __init__(self, model, feature_layer_ids: Optional[Sequence[int]] = None, attention: str = "auto",
                 max_batch: int = 1):
        if _RowLayer is None:
            raise ImportError("TargetVerifier needs transformers with per-layer cache objects (>= 4.56)")
        cfg = model.config
        if getattr(cfg, "sliding_window", None) or (getattr(cfg, "layer_types", None)
                                                    and any(t != "full_attention" for t in cfg.layer_types)):
            raise ValueError("model: sliding-window attention layers are not supported by the batched verifier")
        self.model = model
        param = next(model.parameters())
        self.attention = resolve_attention(attention, param.device)
        if self.attention == "taps_tree" and getattr(cfg, "_attn_implementation", None) != taps_hf.ATTN_IMPLEMENTATION:
            # Without a tree this implementation is exactly sdpa (same mask builder, same kernel).
            model.set_attn_implementation(taps_hf.ATTN_IMPLEMENTATION)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._mode, self._slot, self._rows, self._kv_len, self._past, self._write_index = "tree", 0, 0, 0, 0, None
        self._hf_cache = None
        self._init_cache(int(cfg.num_hidden_layers),
                         int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
                         int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
                         param.dtype, param.device, feature_layer_ids, max_batch)

    def reset(self, max_batch: int, capacity: int) -> None:
        from transformers import DynamicCache

        super().reset(max_batch, capacity)
        self._hf_cache = DynamicCache()
        self._hf_cache.layers = [_RowLayer(self, i) for i in range(self.num_layers)]

    def features(self, hidden_states, rows: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Drafter context features ``[B, T, n*H]`` from a forward's ``hidden_states`` (the HF tuple)."""
        if self.feature_layer_ids is None:
            return None
        picked = [hidden_states[i + 1] for i in self.feature_layer_ids]
        if rows is not None:
            picked = [h.index_select(1, rows) for h in picked]
        return torch.cat(picked, dim=-1)

    # --- forwards ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill_row(self, row: int, prompt_ids: Sequence[int], start: int = 0) -> Tuple[torch.Tensor,
                                                                                         Optional[torch.Tensor]]:
        if start:
            raise ValueError(f"start: this verifier runs whole prompts (no exact prefix reuse), received {start}")
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.int64).view(1, -1).to(self.device)
        T = ids.shape[1]
        self.reserve(T + 1)
        want_hidden = self.feature_layer_ids is not None
        self._mode, self._slot, self._past = "prefill", int(row), 0
        try:
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_kw: self._hf_cache},
                             output_hidden_states=want_hidden, logits_to_keep=1)
        finally:
            self._mode = "tree"
        self.lengths[row] = T
        self.host_lengths[row] = T
        feats = self.features(out.hidden_states) if want_hidden else None
        return out.logits[0, -1], feats

    @torch.inference_mode()
    def verify_batch(self, tree: Tree, rows: Optional[int] = None, chain: bool = False):
        """See :meth:`CacheVerifier.verify_batch`. ``chain``: on the sdpa path with equal row lengths the
        forward then needs no tree mask (HF's causal one is the tree's). Hidden states: the HF tuple."""
        B, N, kv_len = self._tree_rows(tree, rows)
        prefix = self.lengths[:B]
        causal = chain and self.attention == "sdpa" and len(set(self.host_lengths[:B])) == 1
        if causal:
            position_ids, bits = prefix[:, None] + torch.arange(N, device=self.device), None
        else:
            position_ids, bits = taps_kernels.tree_mask(tree, prefix, validate=IN_ROUND)
        self._rows, self._kv_len, self._past = B, kv_len, kv_len - N
        self._write_index = (prefix[:, None] + torch.arange(N, device=self.device))[:, None, :, None].expand(
            B, self.kv_heads, N, self.head_dim)
        want_hidden = self.feature_layer_ids is not None
        kwargs = dict(input_ids=tree.tokens, position_ids=position_ids, use_cache=True,
                      output_hidden_states=want_hidden, **{self._cache_kw: self._hf_cache})
        if self.attention == "taps_tree":
            meta = taps_hf.TreeAttentionMetadata(bits, prefix)
            with taps_hf.use_tree(meta):
                out = self.model(**kwargs)
        elif causal:
            out = self.model(**kwargs)
        else:
            visible = tree_visibility(bits, prefix, kv_len)[:, None]
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
            out = self.model(attention_mask=mask, **kwargs)
        return out.logits, (out.hidden_states if want_hidden else None)


def make_verifier(target, feature_layer_ids: Optional[Sequence[int]] = None, attention: str = "auto",
                  max_batch: int = 1) -> CacheVerifier:
    """The verifier of ``target``: a :class:`taps.models.gguf_target.GGUFTarget` gets the C++ forward's
    (:class:`taps.decode.gguf_verifier.GGUFVerifier`; ``attention`` does not apply), an HF module the
    :class:`TargetVerifier`. The loop, the policies and the drafter see only :class:`CacheVerifier`."""
    if getattr(target, "format", None) == "gguf":
        from .gguf_verifier import GGUFVerifier

        resolve_attention(attention, target.device)  # same argument checks for every target
        return GGUFVerifier(target, feature_layer_ids, max_batch=max_batch)
    return TargetVerifier(target, feature_layer_ids, attention=attention, max_batch=max_batch)
