"""Tree attention: the verifier's attention over a cached prefix plus a draft tree."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import (FLOAT_DTYPES, check_data_device, check_float, check_prefix_lens, check_tensor,
                       differentiable_backend, grad_needed, values_checked)
from .._library import define, fresh
from ..backend import resolve


def check_tree_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor,
                              prefix_lens: torch.Tensor, check_values: bool):
    """Metadata checks of :func:`tree_attention` (and, with ``check_values``, the prefix bounds); -> ``(B, Hq, N, Dh, L)``.

    Shared with the ``taps::tree_attention`` op, which runs it (metadata only) inside its kernel call.
    """
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4)
    B, Hq, N, Dh = q.shape
    if Hq < 1:
        raise ValueError(f"q: expected at least one query head, received shape {tuple(q.shape)}")
    if Dh < 1:
        raise ValueError(f"q: expected a head dim >= 1, received shape {tuple(q.shape)}")
    check_tensor("k", k, dtypes=(q.dtype,), shape=(B, None, None, Dh), device=q.device)
    Hkv, L = k.shape[1], k.shape[2]
    check_tensor("v", v, dtypes=(q.dtype,), shape=(B, Hkv, L, Dh), device=q.device)
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"k: expected a number of kv heads dividing Hq={Hq}, received {Hkv}")
    if L < N:
        raise ValueError(f"k: expected at least N = {N} keys (the tree's own), received shape {tuple(k.shape)}")
    check_tensor("ancestor_bits", ancestor_bits, dtypes=(torch.int32,), shape=(B, N, (N + 31) // 32), device=q.device)
    check_prefix_lens(prefix_lens, B, q.device, check_values=check_values and B > 0,
                      upper=(L - N, "L - N"))
    return B, Hq, N, Dh, L


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor,
                   prefix_lens: torch.Tensor, scale: Optional[float] = None, return_lse: bool = False,
                   backend: Optional[str] = None, validate: Optional[str] = None):
    """Attention of tree-node queries over ``[cached prefix | tree nodes]`` keys.

    Args:
        q: ``[B, Hq, N, Dh]`` queries of the N tree nodes (``Hq, Dh >= 1``; ``B = 0`` or ``N = 0`` give empty outputs).
        k, v: ``[B, Hkv, L, Dh]`` (same shape, q's dtype, ``L >= N``); for row b, keys ``[0, prefix_lens[b])`` are the
            cached prefix (always visible) and keys ``prefix_lens[b] + j`` (``j < N``) are tree node j (visible by
            ancestor bits). ``Hq`` must be a multiple of ``Hkv`` (GQA: query head h reads kv head ``h // (Hq // Hkv)``).
        ancestor_bits: ``[B, N, ceil(N/32)] int32`` from :func:`tree_mask`; bits above the diagonal (``j > i``) are
            ignored.
        prefix_lens: ``[B] int64``, with ``0 <= prefix_lens[b] <= L - N`` (a value check, see ``validate``; on a GPU
            without it, the kernels clamp).
        scale: softmax scale, a finite float, default ``Dh ** -0.5``.
        validate: value checks: ``"auto"`` (default, or ``TAPS_VALIDATE``) on CPU tensors only, ``"full"`` on any
            device, ``"none"`` never (:mod:`taps_kernels._checks`).
    Non-finite values: NaN in q/k/v propagates to the rows that see it; a row with no visible key gives
    output 0 and lse ``-inf``, on every backend.
    Returns:
        ``out [B, Hq, N, Dh]`` in q's dtype; with ``return_lse`` also ``lse [B, Hq, N] float32``.
    Differentiable through the reference backend only: when q, k or v requires grad, ``backend=None`` runs the
    reference and another explicit backend is refused.
    """
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4)
    check_data_device("q", q)
    B, Hq, N, Dh, L = check_tree_attention_args(q, k, v, ancestor_bits, prefix_lens, check_values=False)
    if scale is not None:
        scale = check_float("scale", scale)
    backend = differentiable_backend("tree_attention", backend, [("q", q), ("k", k), ("v", v)])
    if B == 0 or N == 0:
        out, lse = torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, Hq, N), dtype=torch.float32)
        return (out, lse) if return_lse else out
    args = (q, k, v, ancestor_bits.contiguous(), prefix_lens.long().contiguous(), scale)
    if grad_needed((q, k, v)) is not None:  # autograd runs through the reference's torch ops (the op has no backward)
        check_tree_attention_args(*args[:5], check_values=values_checked(validate, q.device))
        out, lse = resolve("tree_attention", backend, q.device)[1](*args)
    else:
        out, lse = tree_attention_op(*args, backend, validate)
    return (out, lse) if return_lse else out


def _tree_attention_kernel(q, k, v, ancestor_bits, prefix_lens, scale=None, backend=None, validate=None):
    check_tree_attention_args(q, k, v, ancestor_bits, prefix_lens,
                              check_values=isinstance(q, torch.Tensor) and values_checked(validate, q.device))
    ancestor_bits, prefix_lens = ancestor_bits.contiguous(), prefix_lens.contiguous()  # the kernels read them flat
    out = resolve("tree_attention", backend, q.device)[1](q, k, v, ancestor_bits, prefix_lens, scale)
    return fresh(out, (q, k, v, ancestor_bits, prefix_lens))


def _tree_attention_fake(q, k, v, ancestor_bits, prefix_lens, scale=None, backend=None, validate=None):
    B, Hq, N, _, _ = check_tree_attention_args(q, k, v, ancestor_bits, prefix_lens, check_values=False)
    return q.new_empty(q.shape).contiguous(), q.new_empty((B, Hq, N), dtype=torch.float32)


tree_attention_op = define("tree_attention(Tensor q, Tensor k, Tensor v, Tensor ancestor_bits, Tensor prefix_lens, "
                           "float? scale=None, str? backend=None, str? validate=None) -> (Tensor, Tensor)", _tree_attention_kernel,
                           _tree_attention_fake)
"""``taps::tree_attention``: ``q [B,Hq,N,Dh]``, ``k/v [B,Hkv,L,Dh]``, ``ancestor_bits [B,N,W] int32``,
``prefix_lens [B] int64`` (``N >= 1``) -> ``(out [B,Hq,N,Dh] q.dtype, lse [B,Hq,N] float32)``; checks metadata,
then ``prefix_lens`` bounds as ``validate`` says (without them, on CUDA, the kernel clamps key positions). No
backward."""
