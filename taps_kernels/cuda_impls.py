"""The ``"cuda"`` backend: ``tree_mask``, ``accept_greedy`` (and ``accept_round`` on it) and ``compact_kv`` on the
plain-CUDA kernels.

Importing this module registers the backend with :mod:`taps_kernels.backend`; it raises ImportError
when the extension ``taps_kernels._C_cuda`` is missing (a CPU torch, or a build without nvcc), and
:mod:`taps_kernels.impls` then leaves the backend unregistered. Call signatures equal the references
in :mod:`taps_kernels.reference`, so the public ops pass the same arguments to either.

Nothing here reads tensor values on the host: every call only enqueues work on the current CUDA
stream (no synchronisation), so the calls can be captured in CUDA graphs once warmed up (see
:func:`compact_kv_cuda` for the one table it caches).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import torch

from .backend import load_extension, register
from .reference.accept import accept_round_from_walk
from .reference.commit import commit_round_with
from .reference.greedy import greedy_tokens_reference

_C_cuda, _why = load_extension("_C_cuda")
if _C_cuda is None:
    raise ImportError(_why)


@register("tree_mask", "cuda")
def tree_mask_cuda(parents: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor, prefix_lens: torch.Tensor):
    """``parents/depth [B,N] int32``, ``num_nodes [B] int32``, ``prefix_lens [B] int64`` (CUDA) ->
    ``(position_ids [B,N] int64, ancestor_bits [B,N,ceil(N/32)] int32)``, equal to the reference."""
    return _C_cuda.tree_mask(parents.contiguous(), depth.contiguous(), num_nodes.contiguous(),
                             prefix_lens.long().contiguous())


@register("accept_greedy", "cuda")
def accept_greedy_cuda(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                       target_tokens: torch.Tensor, path_len: int):
    """``tokens/target_tokens [B,N] int64``, ``parents [B,N] int32``, ``num_nodes [B] int32`` (CUDA) ->
    ``(path [B,path_len] int64, accept_len [B] int64, next_token [B] int64)``; one block per request,
    smallest matching child index wins (bit-identical to the reference)."""
    return _C_cuda.accept_greedy(tokens.contiguous(), parents.contiguous(), num_nodes.contiguous(),
                                 target_tokens.contiguous(), int(path_len))


@register("accept_round", "cuda")
def accept_round_cuda(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                      target_tokens: torch.Tensor, active: torch.Tensor, path_len: int,
                      history_tokens: Optional[torch.Tensor] = None, history_lengths: Optional[torch.Tensor] = None):
    """:func:`taps_kernels.accept_round` with the CUDA walk and device ops (no host read)."""
    return accept_round_from_walk(accept_greedy_cuda, tokens, parents, num_nodes, target_tokens, active, path_len,
                                  history_tokens, history_lengths)


# --- compaction table ------------------------------------------------------------------------------------------

_FIELDS = ("ptr", "heads", "row_units", "stride_b", "stride_h", "stride_l")  # taps::cuda::CompactField order
if getattr(_C_cuda, "COMPACT_NUM_FIELDS", None) != len(_FIELDS):
    raise ImportError(f"taps_kernels._C_cuda is stale: its compaction table has "
                      f"{getattr(_C_cuda, 'COMPACT_NUM_FIELDS', None)} fields, this module writes {len(_FIELDS)}; rebuild it")
_TABLE_CACHE_SIZE = 64
# key -> (host table, device table). The host copy is kept alive too: a CUDA graph that captured the
# upload replays it from that host address.
_TABLES: "OrderedDict[tuple, Tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()


def _describe(name: str, t: torch.Tensor) -> Tuple[int, ...]:
    """``(ptr, H, Dh, stride_b, stride_h, stride_l, element_size)`` of one cache tensor, strides in elements."""
    if t.stride(3) != 1 and t.shape[3] > 1:
        raise ValueError(f"{name}: expected unit stride along the head dimension, received strides {tuple(t.stride())}")
    return (t.data_ptr(), t.shape[1], t.shape[3], t.stride(0), t.stride(1), t.stride(2), t.element_size())


def _widest_unit(descs: Sequence[Tuple[int, ...]]) -> int:
    """Largest of 16/8/4/2 bytes dividing every address, stride and row length (so rows move in wide words)."""
    unit = 16
    for ptr, _, dh, sb, sh, sl, esize in descs:
        for nbytes in (ptr, dh * esize, sb * esize, sh * esize, sl * esize):
            while unit > 2 and nbytes % unit:
                unit //= 2
    return unit


def _table(descs: List[Tuple[int, ...]], unit: int, device: torch.device) -> torch.Tensor:
    key = (device.index, unit, tuple(descs))
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit[1]
    # Everything is measured in bytes first, then in units; _widest_unit guarantees exact division.
    rows = [[ptr, heads, dh * esize // unit, sb * esize // unit, sh * esize // unit, sl * esize // unit]
            for ptr, heads, dh, sb, sh, sl, esize in descs]
    host = torch.tensor(rows, dtype=torch.int64).pin_memory()
    dev = host.to(device, non_blocking=True)
    _TABLES[key] = (host, dev)
    while len(_TABLES) > _TABLE_CACHE_SIZE:
        _TABLES.popitem(last=False)
    return dev


@register("compact_kv", "cuda")
def compact_kv_cuda(keys: List[torch.Tensor], values: List[torch.Tensor], prefix_lens: torch.Tensor,
                    path: torch.Tensor) -> torch.Tensor:
    """In-place compaction of every ``[B,H,L,Dh]`` cache tensor in ``keys + values``, all in ONE launch.

    ``prefix_lens [B] int64``, ``path [B,P] int64`` (root first, increasing, -1 padded); returns
    ``new_lens [B] int64 = prefix_lens + accept_len``. The per-tensor table (address, heads, strides)
    is uploaded once per distinct set of cache tensors and cached, so a steady-state decode loop (or a
    CUDA-graph replay) uploads nothing; call once before capturing a graph. Tensors that share the same
    storage and layout are moved once; partially overlapping views of one storage are not supported.
    """
    device = path.device
    descs: List[Tuple[int, ...]] = []
    seen = set()
    for name, group in (("keys", keys), ("values", values)):
        for i, t in enumerate(group):
            if t.device != device:
                raise ValueError(f"{name}[{i}]: expected a tensor on {device}, received one on {t.device}")
            if t.numel() == 0:
                continue
            d = _describe(f"{name}[{i}]", t)
            if d not in seen:  # the same tensor twice would be moved twice, racing with itself
                seen.add(d)
                descs.append(d)
    B = path.shape[0]
    L = keys[0].shape[2]
    prefix_lens = prefix_lens.long().contiguous()
    path = path.contiguous()
    if descs:
        unit = _widest_unit(descs)
        table = _table(descs, unit, device)
        max_heads = max(d[1] for d in descs)
        max_row_units = max(d[2] * d[6] // unit for d in descs)
        _C_cuda.compact_kv(table, B, L, max_heads, max_row_units, unit, prefix_lens, path)
    return prefix_lens + (path >= 0).sum(1)


@register("commit_round", "cuda")
def commit_round_cuda(*args, **kwargs):
    """:func:`taps_kernels.commit_round` with torch's argmax, the CUDA walk and the CUDA compaction (no host read)."""
    return commit_round_with(greedy_tokens_reference, accept_round_cuda, compact_kv_cuda, *args, **kwargs)
