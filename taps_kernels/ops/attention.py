"""Tree attention: the verifier's attention over a cached prefix plus a draft tree."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import FLOAT_DTYPES, check_tensor
from ..backend import resolve


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor,
                   prefix_lens: torch.Tensor, scale: Optional[float] = None, return_lse: bool = False,
                   backend: Optional[str] = None):
    """Attention of tree-node queries over ``[cached prefix | tree nodes]`` keys.

    Args:
        q: ``[B, Hq, N, Dh]`` queries of the N tree nodes.
        k, v: ``[B, Hkv, L, Dh]``; for row b, keys ``[0, prefix_lens[b])`` are the cached prefix (always
            visible) and keys ``prefix_lens[b] + j`` (``j < N``) are tree node j (visible by ancestor bits).
            ``Hq`` must be a multiple of ``Hkv`` (GQA: query head h reads kv head ``h // (Hq // Hkv)``).
        ancestor_bits: ``[B, N, ceil(N/32)] int32`` from :func:`tree_mask`.
        prefix_lens: ``[B] int64``, with ``prefix_lens[b] + N <= L``.
        scale: softmax scale, default ``Dh ** -0.5``.
    Returns:
        ``out [B, Hq, N, Dh]`` in q's dtype; with ``return_lse`` also ``lse [B, Hq, N] float32``.
    """
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4)
    B, Hq, N, Dh = q.shape
    check_tensor("k", k, dtypes=(q.dtype,), shape=(B, None, None, Dh), device=q.device)
    Hkv, L = k.shape[1], k.shape[2]
    check_tensor("v", v, dtypes=(q.dtype,), shape=(B, Hkv, L, Dh), device=q.device)
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"k: expected a number of kv heads dividing Hq={Hq}, received {Hkv}")
    check_tensor("ancestor_bits", ancestor_bits, dtypes=(torch.int32,), shape=(B, N, (N + 31) // 32), device=q.device)
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64, torch.int32), shape=(B,), device=q.device)
    if (prefix_lens < 0).any() or (prefix_lens + N > L).any():
        b = int(((prefix_lens < 0) | (prefix_lens + N > L)).nonzero()[0])
        raise ValueError(f"prefix_lens[{b}]: expected 0 <= prefix_len <= L - N = {L - N}, received {int(prefix_lens[b])}")
    _, fn = resolve("tree_attention", backend, q.device)
    out, lse = fn(q, k, v, ancestor_bits.contiguous(), prefix_lens.long().contiguous(), scale)
    return (out, lse) if return_lse else out
