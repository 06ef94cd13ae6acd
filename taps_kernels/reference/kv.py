"""Reference KV compaction: move accepted tree rows to contiguous positions after the prefix, in place."""
from __future__ import annotations

from typing import List

import torch


def compact_kv_reference(keys: List[torch.Tensor], values: List[torch.Tensor], prefix_lens: torch.Tensor,
                         path: torch.Tensor) -> torch.Tensor:
    """Each cache tensor is ``[B,H,L,Dh]``; returns ``new_lens [B] int64 = prefix_lens + accept_len``.

    The source rows are gathered (copied) before the destination is written, so overlapping
    ranges are safe.
    """
    B = path.shape[0]
    accept_len = (path >= 0).sum(1)
    for b in range(B):
        n = int(accept_len[b])
        base = int(prefix_lens[b])
        src = base + path[b, :n].to(torch.long)
        dst = torch.arange(base, base + n, device=path.device)
        for cache in list(keys) + list(values):
            cache[b, :, dst] = cache[b, :, src.to(cache.device)].clone()
    return prefix_lens.long() + accept_len.to(prefix_lens.device)
