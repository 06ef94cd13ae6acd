"""The drafter at inference: the context cache (:class:`DFlashState`) and the passes over it: append the
committed tokens' context rows, roll back, draft one block per row."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


class DFlashState:
    """Drafter KV cache of CONTEXT rows, one row per request, preallocated.

    ``k_buf[l]``, ``v_buf[l]``: ``[B, num_key_value_heads, capacity, head_dim]`` per layer (keys already
    k-normed and rotated at their true positions). Row ``b`` holds its context in ``[0, lengths[b])``
    (right-padded layout; rows may differ in length); rows past a length are scratch (a draft pass writes
    its block there). ``lengths [B] int64`` lives on the buffers' device and is the truth; ``host_lengths``
    is its host mirror (a list of ints) when known, or None after an update with device-side counts, until
    the owner reports the new lengths with :meth:`set_host_lengths` (the decode loop does, from its one read
    per round). ``bound`` is a host-side upper bound of ``max(lengths)`` that is always valid.

    Lazy context: the last ``pending[b]`` (``[B] int64``, device) of row b's context rows are target features not
    yet projected, held in ``pending_features [B, LAZY_ROWS, n*H]`` (rows ``0 .. pending[b]-1``): a round that
    does not draft pays a copy instead of the projection, and a draft projects every row's pending features in
    one call (:meth:`DrafterInference.flush_context`). So ``k_buf``/``v_buf`` hold row b's context in
    ``[0, lengths[b] - pending[b])``. ``pending_bound`` is a host-side upper bound of ``max(pending)``.
    """

    #: Unprojected context rows a row holds at most (a longer append projects at once).
    LAZY_ROWS = 64

    def __init__(self, k_buf: List[torch.Tensor], v_buf: List[torch.Tensor], lengths: torch.Tensor,
                 host_lengths: Optional[List[int]] = None):
        self.k_buf, self.v_buf, self.lengths = k_buf, v_buf, lengths
        self.host_lengths = list(host_lengths) if host_lengths is not None else None
        self.bound = max(self.host_lengths) if self.host_lengths else 0
        self.pending = torch.zeros_like(lengths)
        self.pending_bound = 0
        self.pending_features: Optional[torch.Tensor] = None  # allocated by the first lazy append

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k_buf[0].shape[2] if self.k_buf else 0

    def set_host_lengths(self, lengths: Sequence[int]) -> None:
        """Report the device lengths on the host (no transfer: the caller already knows them)."""
        self.host_lengths = [int(x) for x in lengths]
        self.bound = max(self.host_lengths) if self.host_lengths else 0

    @property
    def length(self) -> int:
        """The common context length of all rows (host side); raises when rows differ or it is not known."""
        if self.host_lengths is None:
            raise ValueError("state.length: the lengths were updated on the device; call set_host_lengths first")
        if len(set(self.host_lengths)) > 1:
            raise ValueError(f"state.length: rows have different lengths {self.host_lengths}; use host_lengths")
        return self.host_lengths[0] if self.host_lengths else 0

    @property
    def k(self) -> List[torch.Tensor]:
        """Per-layer key views ``[B, nkv, bound, hd]`` of the buffers (rows past each ``lengths - pending`` are
        scratch; :meth:`DrafterInference.flush_context` projects the pending ones)."""
        return [k[:, :, :self.bound] for k in self.k_buf]

    @property
    def v(self) -> List[torch.Tensor]:
        return [v[:, :, :self.bound] for v in self.v_buf]

    def snapshot(self):
        """What a failed round must restore: the lengths (device and host), their bound and the pending counts
        (a round writes features and keys only past them)."""
        return (self.lengths.clone(), None if self.host_lengths is None else list(self.host_lengths), self.bound,
                self.pending.clone(), self.pending_bound)

    def restore(self, snap) -> None:
        lengths, host, bound, pending, pending_bound = snap
        self.lengths.copy_(lengths)
        self.host_lengths, self.bound = (list(host) if host is not None else None), bound
        self.pending.copy_(pending)
        self.pending_bound = pending_bound


def _on_path(ctx_features: torch.Tensor, path: Optional[torch.Tensor]) -> torch.Tensor:
    """``ctx_features [R, N, F]`` at ``path [R, T]`` (-1 pads read row 0), or all of them when ``path`` is None."""
    if path is None:
        return ctx_features
    return ctx_features.gather(1, path.clamp(min=0)[:, :, None].expand(-1, -1, ctx_features.shape[2]))


class DrafterInference:
    """The inference passes of :class:`taps.models.drafter.DFlashDrafter` (mixed into it): they read its
    ``config``, ``fc``, ``layers``, ``norm``, the modes ``short_blocks`` and ``block_draft``, and its context
    projection, RoPE, embedding and vocabulary projection."""

    #: context rows a fresh state holds before its buffers grow (doubling)
    INITIAL_CAPACITY = 256

    def new_state(self, batch_size: int = 1, capacity: Optional[int] = None) -> DFlashState:
        """Empty context cache for ``batch_size`` rows, room for ``capacity`` context rows each (it grows)."""
        c = self.config
        dev, dt = self.fc.weight.device, self._dtype()
        cap = max(int(capacity or self.INITIAL_CAPACITY), 1) + c.block_size
        z = lambda: torch.zeros(batch_size, c.num_key_value_heads, cap, c.head_dim, device=dev, dtype=dt)  # noqa: E731
        return DFlashState([z() for _ in self.layers], [z() for _ in self.layers],
                           torch.zeros(batch_size, dtype=torch.int64, device=dev), [0] * batch_size)

    def _reserve(self, state: DFlashState, rows: int) -> None:
        """Grow the buffers (doubling, rows kept) so that every row has room for ``rows`` rows."""
        need = rows + self.config.block_size
        if need <= state.capacity:
            return
        cap = max(need, 2 * state.capacity)
        for group in (state.k_buf, state.v_buf):
            for l, t in enumerate(group):
                new = t.new_zeros(t.shape[0], t.shape[1], cap, t.shape[3])
                new[:, :, :t.shape[2]] = t
                group[l] = new

    @staticmethod
    def _rows(state: DFlashState, rows: Optional[slice], n: int, name: str) -> slice:
        rows = slice(0, n) if rows is None else rows
        start, stop = rows.start or 0, rows.stop
        if rows.step not in (None, 1) or stop is None or not 0 <= start < stop <= state.batch_size \
                or stop - start != n:
            raise ValueError(f"{name}: expected {n} rows = state rows {rows} (a contiguous range inside "
                             f"[0, {state.batch_size})), received {n}")
        return slice(start, stop)

    @torch.no_grad()
    def append_context(self, state: DFlashState, ctx_features: torch.Tensor, counts: Optional[torch.Tensor] = None,
                       rows: Optional[slice] = None, path: Optional[torch.Tensor] = None) -> DFlashState:
        """Append target features of newly committed tokens to rows' context.

        Args:
            ctx_features: ``[R, T, n*H]``; feature row r feeds state row ``rows.start + r`` (default: rows
                ``0 .. R-1``), at positions ``lengths[row] .. lengths[row] + counts[r] - 1``.
            counts: ``[R] int64`` on the state's device: how many of the T feature rows are real (the rest is
                scratch). None: all T, and the host lengths stay known; with device counts the host mirror
                becomes unknown (:meth:`DFlashState.set_host_lengths`).
            rows: a contiguous ``slice`` of state rows (default ``slice(0, R)``).
            path: ``[R, T'] int64``: the feature rows to take, ``ctx_features[r, path[r, j]]`` for j < T' (-1 pads
                read row 0; ``counts`` then counts path entries): a verify's accepted nodes, without gathering
                them first (default: every row in order).
        The features are kept as they are (a copy) and projected by the next :meth:`draft` or
        :meth:`flush_context`; an append that would leave more than ``DFlashState.LAZY_ROWS`` rows pending
        projects the kept ones first, and one longer than that projects its own at once. Either way a draft sees
        the same keys and values. Returns the same ``state``; nothing is read back to the host.
        """
        R = ctx_features.shape[0]
        sl = self._rows(state, rows, R, "ctx_features")
        self.check_context_features(ctx_features)
        if path is not None and (path.dim() != 2 or path.shape[0] != R or path.dtype != torch.int64):
            raise ValueError(f"path: expected [{R}, T] int64, received {tuple(path.shape)} {path.dtype}")
        T = ctx_features.shape[1] if path is None else path.shape[1]
        if T == 0:
            return state
        self._reserve(state, state.bound + T)
        if state.pending_bound + T > state.LAZY_ROWS:
            self.flush_context(state)
        added = T if counts is None else counts.to(torch.int64)
        if T > state.LAZY_ROWS:
            self._project(state, sl, _on_path(ctx_features, path), counts, state.lengths[sl])
            state.lengths[sl] += added
        else:
            self._keep(state, sl, ctx_features, added, path)
        if counts is None and state.host_lengths is not None:
            host = list(state.host_lengths)
            for b in range(sl.start, sl.stop):
                host[b] += T
            state.set_host_lengths(host)
        else:
            state.host_lengths = None
            state.bound += T
        return state

    def _keep(self, state: DFlashState, sl: slice, ctx_features: torch.Tensor, added, path: Optional[torch.Tensor]):
        """The lazy half of :meth:`append_context`: copy the rows (``path``'s, or all) after each state row's kept
        ones and advance ``pending`` and ``lengths`` by ``added`` (an int, or ``[R] int64``)."""
        R, N, F = ctx_features.shape
        T = N if path is None else path.shape[1]
        kept = state.pending_features
        if kept is None or kept.dtype != ctx_features.dtype:
            self.flush_context(state)
            # zeros: the torch path projects every kept row up to the longest pending run, and a scratch
            # row must stay finite (a masked key's NaN value would still reach the attention's sum)
            kept = state.pending_features = ctx_features.new_zeros(state.batch_size, state.LAZY_ROWS, F)
        stash = self._native_stash(kept, ctx_features)
        if stash is not None:  # gather, copy and counters in one call: ~0.13 ms of torch ops a round otherwise
            if path is None:
                path = torch.arange(T, dtype=torch.int64).expand(R, T)
            if not torch.is_tensor(added):
                added = torch.full((R,), T, dtype=torch.int64)
            stash(ctx_features.contiguous(), path.contiguous(), added.contiguous(), kept, state.pending, state.lengths,
                  sl.start)
        else:
            ctx_features = _on_path(ctx_features, path)
            # whole feature rows by flat index (a scatter along dim 1 took ~4x longer here)
            dev = ctx_features.device
            first = torch.arange(sl.start, sl.stop, device=dev) * state.LAZY_ROWS + state.pending[sl]
            slots = (first[:, None] + torch.arange(T, device=dev)).reshape(-1)
            kept.view(-1, F).index_copy_(0, slots, ctx_features.reshape(R * T, F))
            state.pending[sl] += added
            state.lengths[sl] += added
        state.pending_bound += T

    @staticmethod
    def _native_stash(kept: torch.Tensor, ctx_features: torch.Tensor):
        """``_C.stash_rows`` where it applies (CPU float32 features and kept rows), else None (the torch path)."""
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (kept, ctx_features)):
            return None
        try:
            from taps_kernels import _C
        except ImportError:
            return None
        return _C.stash_rows

    @torch.no_grad()
    def flush_context(self, state: DFlashState) -> DFlashState:
        """Project every row's pending context features (:class:`DFlashState`) into its keys and values, in one
        call; a no-op when none are pending."""
        if state.pending_bound == 0:
            return state
        rows = slice(0, state.batch_size)
        T = min(state.pending_bound, state.LAZY_ROWS)
        self._reserve(state, state.bound + T)  # the torch path writes T slots per row
        self._project(state, rows, state.pending_features[:, :T], state.pending, state.lengths - state.pending)
        state.pending.zero_()
        state.pending_bound = 0
        return state

    def _project(self, state: DFlashState, sl: slice, ctx_features: torch.Tensor, counts: Optional[torch.Tensor],
                 start: torch.Tensor) -> None:
        """Keys and values of ``ctx_features [R, T, n*H]`` (the first ``counts[r]`` rows of each, or all) into
        state rows ``sl`` at slots ``start[r] ..`` of every layer."""
        R, T, _ = ctx_features.shape
        if self.block_draft is not None:
            j = torch.arange(T, device=ctx_features.device)
            real = None if counts is None else j[None, :] < counts.to(torch.int64)[:, None]
            slots, rows = start[:, None] + j, torch.arange(sl.start, sl.stop)[:, None].expand(R, T)
            if real is None:
                feats, slots, rows = ctx_features.reshape(R * T, -1), slots.reshape(-1), rows.reshape(-1)
            else:  # only the real rows: each is its own one-row context piece
                feats, slots, rows = ctx_features[real], slots[real], rows[real]
            self.block_draft.project_context(state, feats, slots, rows)
            return
        h = self.project_context(ctx_features)
        pos = start[:, None] + torch.arange(T, device=h.device)
        c = self.config
        index = pos[:, None, :, None].expand(R, c.num_key_value_heads, T, c.head_dim)
        for l, (k, v) in enumerate(self._context_kv(h, pos)):
            state.k_buf[l][sl].scatter_(2, index, k.to(state.k_buf[l].dtype))
            state.v_buf[l][sl].scatter_(2, index, v.to(state.v_buf[l].dtype))

    def rollback(self, state: DFlashState, length) -> DFlashState:
        """Crop the context cache: ``length`` an int (every row) or a host list of per-row lengths, each
        within ``[0, current length]``."""
        cur = state.host_lengths
        want = [int(length)] * state.batch_size if isinstance(length, int) else [int(x) for x in length]
        if len(want) != state.batch_size:
            raise ValueError(f"rollback length: expected {state.batch_size} per-row lengths, received {len(want)}")
        for b, n in enumerate(want):
            if n < 0 or (cur is not None and n > cur[b]) or (cur is None and n > state.bound):
                have = cur[b] if cur is not None else f"<= {state.bound}"
                raise ValueError(f"rollback length {n} of row {b} outside [0, {have}]")
        want_t = torch.tensor(want, dtype=torch.int64, device=state.lengths.device)
        state.pending.sub_((state.lengths - want_t).clamp(min=0)).clamp_(min=0)  # the cropped rows were the last
        state.lengths.copy_(want_t)
        state.set_host_lengths(want)
        return state

    def reset_row(self, state: DFlashState, row: int, keep: int = 0) -> None:
        """Empty one row (a request left; the next one starts from no context), or keep its first ``keep``
        context rows (the caller knows they are the next request's: a prompt that starts as the last one did).
        Pending context is projected first, so the rows a later ``keep`` names hold their keys and values."""
        self.flush_context(state)
        state.lengths[row] = int(keep)
        if state.host_lengths is not None:
            host = list(state.host_lengths)
            host[row] = int(keep)
            state.set_host_lengths(host)

    @torch.no_grad()
    def draft(self, state: DFlashState, bonus_tokens: torch.Tensor, embed_tokens, lm_head,
              rows: Optional[slice] = None, num_positions: Optional[int] = None,
              full_vocab_logits: bool = True):
        """One draft pass for rows of the state (default: rows ``0 .. B-1``, one per bonus token).

        bonus_tokens ``[B] int64``: row b's block is ``[bonus, MASK x D]`` at positions
        ``lengths[b] .. lengths[b]+D`` (``D = block_size-1``), attending to its own context rows and
        bidirectionally inside the block. Attention is one fused SDPA call per layer over the buffer in
        place: without a mask when all rows have the same (host-known) context length, else with a boolean
        key-padding mask. ``rows``: a contiguous ``slice`` of state rows.
        ``num_positions`` P (default D): only block positions ``1..P`` are normed and projected onto the
        vocabulary (a policy that never uses deeper positions passes its depth cap); with
        :attr:`short_blocks` the block itself is ``[bonus, MASK x P]``.
        Returns ``(logits [B,P,V] float32, hidden [B,P,H])`` for block positions ``1..P``. With a draft
        vocabulary, ``full_vocab_logits`` True gives full-size logits with ``-inf`` outside it, False the
        ``[B,P,V_draft]`` sub-vocabulary logits, whose column ``j`` is token ``draft_vocab[j]`` (callers map top-k
        ids back through it). The state's lengths and context rows are not modified (the block's K/V go to
        scratch rows past each length).
        """
        c = self.config
        B = bonus_tokens.shape[0]
        sl = self._rows(state, rows, B, "bonus_tokens")
        D = c.block_size - 1
        P = D if num_positions is None else int(num_positions)
        if not 1 <= P <= D:
            raise ValueError(f"num_positions: expected 1..{D} (block_size-1), received {num_positions}")
        S = P + 1 if self.short_blocks else c.block_size
        dev = self.fc.weight.device
        self._reserve(state, state.bound)
        self.flush_context(state)
        if self.block_draft is not None:  # the whole pass in one C++ call (taps.models.drafter_blocks)
            return self.block_draft.draft(state, sl, bonus_tokens, embed_tokens, lm_head, P, S,
                                          bool(full_vocab_logits))
        ids = torch.full((B, S), self.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = bonus_tokens.to(dev)
        x = self._embed(embed_tokens, ids)
        lengths = state.lengths[sl]
        pos = lengths[:, None] + torch.arange(S, device=dev)
        cos, sin = self._rope(pos, x.dtype)
        index = pos[:, None, :, None].expand(B, c.num_key_value_heads, S, c.head_dim)
        host = None if state.host_lengths is None else state.host_lengths[sl]
        if host is not None and len(set(host)) <= 1:
            kv_len, key_mask = (host[0] if host else 0) + S, None
        else:
            kv_len = (max(host) if host is not None else state.bound) + S
            key_mask = (torch.arange(kv_len, device=dev)[None, :] < (lengths + S)[:, None])[:, None, None, :]
        for l, layer in enumerate(self.layers):
            x = layer.forward_cached(x, cos, sin, state.k_buf[l][sl], state.v_buf[l][sl], index, kv_len, key_mask)
        # only the positions the caller can use go through the final norm and the vocabulary head
        hidden = self.norm(x[:, 1:1 + P])
        return self._vocab_logits(hidden, lm_head, bool(full_vocab_logits)), hidden
