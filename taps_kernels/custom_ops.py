"""``torch.library`` registration of the tree ops under the ``taps::`` namespace.

Importing this module defines four custom ops, usable inside ``torch.compile(fullgraph=True)``
graphs and CUDA-graph captures:

==========================  ==================================================================
``taps::tree_mask``         ``(parents, depth, num_nodes, prefix_lens) -> (position_ids, ancestor_bits)``
``taps::accept_greedy``     ``(tokens, parents, num_nodes, target_tokens, path_len) -> (path, accept_len, next_token)``
``taps::compact_kv``        ``(keys[] (mutated), values[] (mutated), prefix_lens, path) -> new_lens``
``taps::tree_attention``    ``(q, k, v, ancestor_bits, prefix_lens, scale) -> (out, lse)``
==========================  ==================================================================

Shapes, dtypes and node order are those of the public ops (``docs/DESIGN.md``,
:mod:`taps_kernels.layout`); ``prefix_lens`` is ``[B] int64``. Each op runs the default backend of
its tensors' device (:func:`taps_kernels.backend.resolve`): on CUDA the ``cuda``/``triton`` kernels,
on CPU the ``cpp`` extension or the reference.

Unlike the public ops, these do NOT validate tensor values (tree structure, path order, prefix
bounds): that needs the values on the host, i.e. a device synchronisation, which would break CUDA
graphs and split compiled graphs. Validate once with the public op (or :meth:`Tree.validate`) where
inputs come from outside, and use these inside the hot loop. Only metadata (shapes, dtypes, devices)
is checked. Each op has a fake (meta) implementation so tracing needs no data, and ``compact_kv``
declares that it mutates ``keys`` and ``values``.

The wrappers at the bottom (:func:`tree_mask`, :func:`accept_greedy`, :func:`compact_kv`,
:func:`tree_attention`) take the same arguments as the public ops, minus host-side defaults
(``accept_greedy`` needs an explicit ``max_depth``).
"""
import math
from typing import List, Optional, Sequence, Tuple

import torch

from ._checks import FLOAT_DTYPES, check_tensor
from .backend import resolve
from .layout import Tree

Tensor = torch.Tensor


def _impl(op: str, device: torch.device):
    return resolve(op, None, device)[1]


# --- taps::tree_mask ----------------------------------------------------------------------------------------------

@torch.library.custom_op("taps::tree_mask", mutates_args=())
def tree_mask_op(parents: Tensor, depth: Tensor, num_nodes: Tensor, prefix_lens: Tensor) -> Tuple[Tensor, Tensor]:
    """``parents/depth [B,N] int32``, ``num_nodes [B] int32``, ``prefix_lens [B] int64`` ->
    ``(position_ids [B,N] int64, ancestor_bits [B,N,ceil(N/32)] int32)``."""
    pos, bits = _impl("tree_mask", parents.device)(parents, depth, num_nodes, prefix_lens)
    return pos, bits


@tree_mask_op.register_fake
def _tree_mask_fake(parents, depth, num_nodes, prefix_lens):
    B, N = parents.shape
    return (parents.new_empty((B, N), dtype=torch.int64),
            parents.new_empty((B, N, (N + 31) // 32), dtype=torch.int32))


# --- taps::accept_greedy ------------------------------------------------------------------------------------------

@torch.library.custom_op("taps::accept_greedy", mutates_args=())
def accept_greedy_op(tokens: Tensor, parents: Tensor, num_nodes: Tensor, target_tokens: Tensor,
                     path_len: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``tokens/target_tokens [B,N] int64``, ``parents [B,N] int32``, ``num_nodes [B] int32`` ->
    ``(path [B,path_len] int64, accept_len [B] int64, next_token [B] int64)``."""
    path, accept_len, next_token = _impl("accept_greedy", tokens.device)(tokens, parents, num_nodes, target_tokens,
                                                                         path_len)
    return path, accept_len, next_token


@accept_greedy_op.register_fake
def _accept_greedy_fake(tokens, parents, num_nodes, target_tokens, path_len):
    B = tokens.shape[0]
    return (tokens.new_empty((B, path_len)), tokens.new_empty((B,)), tokens.new_empty((B,)))


# --- taps::compact_kv ---------------------------------------------------------------------------------------------

@torch.library.custom_op("taps::compact_kv", mutates_args=("keys", "values"))
def compact_kv_op(keys: List[Tensor], values: List[Tensor], prefix_lens: Tensor, path: Tensor) -> Tensor:
    """In place on every ``[B,H,L,Dh]`` tensor of ``keys``/``values``; ``prefix_lens [B] int64``,
    ``path [B,P] int64`` -> ``new_lens [B] int64``."""
    return _impl("compact_kv", path.device)(list(keys), list(values), prefix_lens, path)


@compact_kv_op.register_fake
def _compact_kv_fake(keys, values, prefix_lens, path):
    return path.new_empty((path.shape[0],))


# --- taps::tree_attention -----------------------------------------------------------------------------------------

@torch.library.custom_op("taps::tree_attention", mutates_args=())
def tree_attention_op(q: Tensor, k: Tensor, v: Tensor, ancestor_bits: Tensor, prefix_lens: Tensor,
                      scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """``q [B,Hq,N,Dh]``, ``k/v [B,Hkv,L,Dh]``, ``ancestor_bits [B,N,W] int32``, ``prefix_lens [B] int64`` ->
    ``(out [B,Hq,N,Dh] q.dtype, lse [B,Hq,N] float32)``."""
    out, lse = _impl("tree_attention", q.device)(q, k, v, ancestor_bits, prefix_lens, scale)
    return out, lse


@tree_attention_op.register_fake
def _tree_attention_fake(q, k, v, ancestor_bits, prefix_lens, scale=None):
    B, Hq, N, _ = q.shape
    return q.new_empty(q.shape).contiguous(), q.new_empty((B, Hq, N), dtype=torch.float32)


# --- wrappers with the public ops' arguments (metadata checks only: no host synchronisation) -----------------------

def _check_tree_meta(tree: Tree) -> Tuple[int, int]:
    if not isinstance(tree, Tree):
        raise TypeError(f"tree: expected a taps_kernels.Tree, received {type(tree).__name__}")
    tree.validate("tree", deep=False)
    return tree.tokens.shape


def tree_mask(tree: Tree, prefix_lens: Tensor) -> Tuple[Tensor, Tensor]:
    """Graph-safe :func:`taps_kernels.tree_mask`: ``(position_ids [B,N] int64, ancestor_bits [B,N,W] int32)``."""
    B, _ = _check_tree_meta(tree)
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64, torch.int32), shape=(B,), device=tree.device)
    return torch.ops.taps.tree_mask(tree.parents.contiguous(), tree.depth.contiguous(), tree.num_nodes.contiguous(),
                                    prefix_lens.long().contiguous())


def accept_greedy(tree: Tree, target_tokens: Tensor, max_depth: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Graph-safe :func:`taps_kernels.accept_greedy`; ``max_depth`` is required (the default would read the
    tree's depth on the host). Returns ``(path [B,max_depth+1], accept_len [B], next_token [B])``, int64."""
    B, N = _check_tree_meta(tree)
    check_tensor("target_tokens", target_tokens, dtypes=(torch.int64,), shape=(B, N), device=tree.device)
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth: expected an int >= 0, received {max_depth!r}")
    return torch.ops.taps.accept_greedy(tree.tokens.contiguous(), tree.parents.contiguous(),
                                        tree.num_nodes.contiguous(), target_tokens.contiguous(), max_depth + 1)


def compact_kv(keys: Sequence[Tensor], values: Sequence[Tensor], prefix_lens: Tensor, path: Tensor) -> Tensor:
    """Graph-safe :func:`taps_kernels.compact_kv` (in place, all layers); returns ``new_lens [B] int64``.

    The path is trusted: root first, strictly increasing, -1 padded, every row inside the cache."""
    if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)) or not keys \
            or len(keys) != len(values):
        raise ValueError("keys/values: expected two equally long, non-empty lists of [B,H,L,Dh] tensors")
    B, _, L, _ = check_tensor("keys[0]", keys[0], dtypes=FLOAT_DTYPES, ndim=4).shape
    for name, group in (("keys", keys), ("values", values)):
        for i, t in enumerate(group):
            check_tensor(f"{name}[{i}]", t, dtypes=FLOAT_DTYPES, shape=(B, None, L, None), device=keys[0].device)
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64, torch.int32), shape=(B,), device=keys[0].device)
    check_tensor("path", path, dtypes=(torch.int64,), shape=(B, None), device=keys[0].device)
    return torch.ops.taps.compact_kv(list(keys), list(values), prefix_lens.long().contiguous(), path.contiguous())


def tree_attention(q: Tensor, k: Tensor, v: Tensor, ancestor_bits: Tensor, prefix_lens: Tensor,
                   scale: Optional[float] = None, return_lse: bool = False):
    """Graph-safe :func:`taps_kernels.tree_attention`: ``out [B,Hq,N,Dh]`` (and ``lse [B,Hq,N] f32``).

    ``prefix_lens[b] + N <= L`` is trusted, not checked."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4)
    B, Hq, N, Dh = q.shape
    check_tensor("k", k, dtypes=(q.dtype,), shape=(B, None, None, Dh), device=q.device)
    check_tensor("v", v, dtypes=(q.dtype,), shape=tuple(k.shape), device=q.device)
    if k.shape[1] < 1 or Hq % k.shape[1] != 0:
        raise ValueError(f"k: expected a number of kv heads dividing Hq={Hq}, received {k.shape[1]}")
    check_tensor("ancestor_bits", ancestor_bits, dtypes=(torch.int32,), shape=(B, N, (N + 31) // 32), device=q.device)
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64, torch.int32), shape=(B,), device=q.device)
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    out, lse = torch.ops.taps.tree_attention(q, k, v, ancestor_bits.contiguous(), prefix_lens.long().contiguous(),
                                             scale)
    return (out, lse) if return_lse else out
