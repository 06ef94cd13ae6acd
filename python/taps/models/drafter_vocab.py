"""The drafter's vocabulary projection: the optional reduced draft vocabulary and the LM head run in
:attr:`head_dtype` (a cached copy of the weight rows)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class DrafterVocabulary:
    """Draft vocabulary and vocabulary projection of :class:`taps.models.drafter.DFlashDrafter` (mixed into
    it): they read its ``config``, ``fc`` (device), the modes ``draft_vocab`` and ``head_dtype``, and keep the
    projection's cached weight copy in ``_head_copy``."""

    def set_draft_vocab(self, ids: Optional[torch.Tensor]) -> None:
        """Restrict draft proposals to ``ids`` (int64 ``[V_draft]``, distinct, inside ``[0, vocab_size)``;
        stored sorted), or lift the restriction with None. Lossless for decoding: the target verifies every
        proposal; tokens outside the set are never proposed."""
        if ids is None:
            self.draft_vocab, self.config.draft_vocab_size = None, None
            return
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
            raise ValueError(f"draft vocab: expected a non-empty 1-D int64 tensor, received "
                             f"{getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}")
        ids = ids.sort().values
        V = self.config.vocab_size
        if int(ids[0]) < 0 or int(ids[-1]) >= V or bool((ids[1:] == ids[:-1]).any()):
            raise ValueError(f"draft vocab: ids must be distinct and inside [0, {V})")
        self.draft_vocab = ids.to(self.fc.weight.device)
        self.config.draft_vocab_size = int(ids.numel())

    def _vocab_logits(self, hidden: torch.Tensor, lm_head, full_vocab: bool = True) -> torch.Tensor:
        """``lm_head(hidden)`` in float32, computed in :attr:`head_dtype` (a cached copy of the weight) over
        the draft vocabulary when one is set (``full_vocab``: the layout ``draft(full_vocab_logits=)`` describes)."""
        w = lm_head.weight
        dt = self.head_dtype or w.dtype
        ids = self.draft_vocab
        # 2-D rows: a strided 3-D input sends linear through a broadcast bmm, which copies the whole
        # [V, H] weight on every call for bf16.
        rows = hidden.reshape(-1, hidden.shape[-1]).to(torch.float32 if dt == torch.int8 else dt)
        bias = getattr(lm_head, "bias", None)
        if dt == w.dtype and ids is None:
            out = lm_head(rows)
        else:
            key = (w.data_ptr(), w._version, dt, None if ids is None else (ids.data_ptr(), ids.numel()))
            if self._head_copy is None or self._head_copy[0] != key:
                wc = w.detach() if ids is None else w.detach().index_select(0, ids.to(w.device))
                bc = None if bias is None else (bias.detach() if ids is None else bias.detach()[ids.to(w.device)])
                if dt == torch.int8:
                    from taps_kernels.integrations.int8_linear import Int8Linear

                    self._head_copy = (key, Int8Linear(wc, bc))
                else:
                    head = (wc.to(dt).contiguous(), None if bc is None else bc.to(dt))
                    self._head_copy = (key, lambda r: F.linear(r, *head))
            out = self._head_copy[1](rows)
        out = out.float()
        if ids is None or not full_vocab:
            return out.view(*hidden.shape[:-1], -1)
        full = out.new_full((out.shape[0], w.shape[0]), float("-inf"))
        full.index_copy_(1, ids.to(out.device), out)
        return full.view(*hidden.shape[:-1], -1)
