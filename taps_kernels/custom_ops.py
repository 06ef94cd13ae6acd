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

What each op checks and what it trusts:

* METADATA (dtypes, ranks, shapes of every tensor, bit words, V against K, batch sizes, path length, memory
  overlap of the caches) is checked in the op itself, eagerly and in its fake (meta) implementation, so a
  traced graph rejects bad shapes at compile time. This never reads tensor data.
* VALUES (tree structure, prefix and path bounds) are checked only on CPU tensors, where that is cheap and
  needs no device synchronisation: a bad value is a clean ``ValueError`` there, on every backend. On CUDA
  tensors the values are TRUSTED, because reading them would synchronise the stream and break CUDA graphs;
  the GPU kernels clamp every index they compute, so an out-of-contract value gives unspecified output
  but never an out-of-bounds access. Validate once with the public op (``validate="full"``) or
  :meth:`Tree.validate` (``deep=True``) where inputs come from outside, and use these ops in the hot loop.

Each op has a fake (meta) implementation so tracing needs no data, and ``compact_kv`` declares that it
mutates ``keys`` and ``values``.

The wrappers at the bottom (:func:`tree_mask`, :func:`accept_greedy`, :func:`compact_kv`,
:func:`tree_attention`) take the same arguments as the public ops, minus host-side defaults
(``accept_greedy`` needs an explicit ``max_depth``); they also refuse cache tensors that require grad.
"""
import math
from typing import List, Optional, Sequence, Tuple

import torch

from ._checks import (MAX_COUNT, FLOAT_DTYPES, check_float, check_int, check_not_grad_tracked, check_output_size,
                      check_prefix_lens, check_tensor)
from .backend import resolve
from .layout import Tree, validate_tree
from .ops.attention import check_tree_attention_args
from .ops.kv import check_compact_kv_args
from .ops.mask import check_positions_fit

Tensor = torch.Tensor


def _impl(op: str, device: torch.device):
    return resolve(op, None, device)[1]


def _on_cpu(t: Tensor) -> bool:
    """Value checks run on CPU tensors only (see the module docstring); a non-tensor fails its metadata check."""
    return isinstance(t, Tensor) and t.device.type == "cpu"


def _check_tree_tensors(tokens: Optional[Tensor], parents: Tensor, depth: Optional[Tensor], num_nodes: Tensor,
                        check_values: bool) -> Tuple[int, int]:
    """Metadata of the raw tree tensors (and, with ``check_values``, the structure); -> ``(B, N)``."""
    check_tensor("parents", parents, dtypes=(torch.int32,), ndim=2)
    B, N = parents.shape
    if N < 1:
        raise ValueError(f"parents: expected at least one node (the root), received shape {(B, N)}")
    if tokens is not None:
        check_tensor("tokens", tokens, dtypes=(torch.int64,), shape=(B, N), device=parents.device)
    if depth is not None:
        check_tensor("depth", depth, dtypes=(torch.int32,), shape=(B, N), device=parents.device)
    check_tensor("num_nodes", num_nodes, dtypes=(torch.int32,), shape=(B,), device=parents.device)
    if check_values:
        if depth is not None:
            validate_tree(Tree(torch.zeros(B, N, dtype=torch.int64), parents, depth, num_nodes), "tree", deep=True)
        else:
            _check_walk_structure(parents, num_nodes)
    return B, N


def _check_walk_structure(parents: Tensor, num_nodes: Tensor) -> None:
    """What the acceptance walk indexes with (it reads no depth): num_nodes in [1, N], real parents before children."""
    B, N = parents.shape
    nn = num_nodes.long()
    bad = (nn < 1) | (nn > N)
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise ValueError(f"tree.num_nodes[{b}]: expected a value in [1, {N}], received {int(nn[b])}")
    idx = torch.arange(N)
    nonroot = (idx[None, :] < nn[:, None]) & (idx[None, :] > 0)
    bad = nonroot & ((parents < 0) | (parents >= idx[None, :]))
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"tree.parents[{b},{i}]: parent index {int(parents[b, i])} is out of range or not smaller "
                         f"than the child's index; expected 0 <= parent < {i}")


# --- taps::tree_mask ----------------------------------------------------------------------------------------------

def _check_tree_mask(parents, depth, num_nodes, prefix_lens, check_values: bool) -> Tuple[int, int]:
    check_tensor("depth", depth, dtypes=(torch.int32,), ndim=2)
    B, N = _check_tree_tensors(None, parents, depth, num_nodes, check_values)
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64,), shape=(B,), device=parents.device)
    if check_values:
        check_prefix_lens(prefix_lens, B, parents.device)
        check_positions_fit(prefix_lens, depth)
    return B, N


@torch.library.custom_op("taps::tree_mask", mutates_args=())
def tree_mask_op(parents: Tensor, depth: Tensor, num_nodes: Tensor, prefix_lens: Tensor) -> Tuple[Tensor, Tensor]:
    """``parents/depth [B,N] int32``, ``num_nodes [B] int32``, ``prefix_lens [B] int64`` ->
    ``(position_ids [B,N] int64, ancestor_bits [B,N,ceil(N/32)] int32)``.

    Checks shapes/dtypes always; on CPU also the tree structure, ``prefix_lens >= 0`` and that
    ``prefix_lens + depth`` fits in int64. Trusts those values on CUDA (kernels clamp parent indices)."""
    _check_tree_mask(parents, depth, num_nodes, prefix_lens, _on_cpu(parents))
    pos, bits = _impl("tree_mask", parents.device)(parents, depth, num_nodes, prefix_lens)
    return pos, bits


@tree_mask_op.register_fake
def _tree_mask_fake(parents, depth, num_nodes, prefix_lens):
    B, N = _check_tree_mask(parents, depth, num_nodes, prefix_lens, False)
    return (parents.new_empty((B, N), dtype=torch.int64),
            parents.new_empty((B, N, (N + 31) // 32), dtype=torch.int32))


# --- taps::accept_greedy ------------------------------------------------------------------------------------------

def _check_accept(tokens, parents, num_nodes, target_tokens, path_len, check_values: bool) -> int:
    check_tensor("tokens", tokens, dtypes=(torch.int64,), ndim=2)
    B, N = _check_tree_tensors(tokens, parents, None, num_nodes, check_values)
    check_tensor("target_tokens", target_tokens, dtypes=(torch.int64,), shape=(B, N), device=parents.device)
    check_int("path_len", path_len, minimum=1, maximum=MAX_COUNT)
    check_output_size("path_len", path_len, B * path_len * 8, parents.device)
    return B


@torch.library.custom_op("taps::accept_greedy", mutates_args=())
def accept_greedy_op(tokens: Tensor, parents: Tensor, num_nodes: Tensor, target_tokens: Tensor,
                     path_len: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``tokens/target_tokens [B,N] int64``, ``parents [B,N] int32``, ``num_nodes [B] int32``,
    ``path_len`` in ``[1, 2**31 - 2]`` -> ``(path [B,path_len] int64, accept_len [B] int64, next_token [B] int64)``.

    Checks shapes/dtypes and ``path_len`` always; on CPU also the tree structure (num_nodes range, parents
    before children). Trusts it on CUDA (the walk stays inside ``[0, num_nodes)`` clamped to N)."""
    _check_accept(tokens, parents, num_nodes, target_tokens, path_len, _on_cpu(parents))
    path, accept_len, next_token = _impl("accept_greedy", tokens.device)(tokens, parents, num_nodes, target_tokens,
                                                                         path_len)
    return path, accept_len, next_token


@accept_greedy_op.register_fake
def _accept_greedy_fake(tokens, parents, num_nodes, target_tokens, path_len):
    B = _check_accept(tokens, parents, num_nodes, target_tokens, path_len, False)
    return (tokens.new_empty((B, path_len)), tokens.new_empty((B,)), tokens.new_empty((B,)))


# --- taps::compact_kv ---------------------------------------------------------------------------------------------

@torch.library.custom_op("taps::compact_kv", mutates_args=("keys", "values"))
def compact_kv_op(keys: List[Tensor], values: List[Tensor], prefix_lens: Tensor, path: Tensor) -> Tensor:
    """In place on every ``[B,H,L,Dh]`` tensor of ``keys``/``values``; ``prefix_lens [B] int64``,
    ``path [B,P] int64`` -> ``new_lens [B] int64``.

    Checks shapes/dtypes/devices and that no two cache tensors share memory (nor one with itself: stride-0
    dims) always; on CPU also ``0 <= prefix_lens <= L`` and the path (strictly increasing, trailing -1,
    ``path <= L - 1 - prefix_lens``), before any write. Trusts the path on CUDA (kernels clamp rows)."""
    check_compact_kv_args(keys, values, prefix_lens, path, validate=_on_cpu(path))
    return _impl("compact_kv", path.device)(list(keys), list(values), prefix_lens, path)


@compact_kv_op.register_fake
def _compact_kv_fake(keys, values, prefix_lens, path):
    check_compact_kv_args(keys, values, prefix_lens, path, validate=False, storage=False)
    return path.new_empty((path.shape[0],))


# --- taps::tree_attention -----------------------------------------------------------------------------------------

@torch.library.custom_op("taps::tree_attention", mutates_args=())
def tree_attention_op(q: Tensor, k: Tensor, v: Tensor, ancestor_bits: Tensor, prefix_lens: Tensor,
                      scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """``q [B,Hq,N,Dh]``, ``k/v [B,Hkv,L,Dh]``, ``ancestor_bits [B,N,W] int32``, ``prefix_lens [B] int64`` ->
    ``(out [B,Hq,N,Dh] q.dtype, lse [B,Hq,N] float32)``.

    Checks every shape (v equal to k, ``W = ceil(N/32)`` bit words, batch, GQA heads, ``L >= N``) and dtype
    always; on CPU also ``0 <= prefix_lens <= L - N``. Trusts ``prefix_lens`` on CUDA (the kernel clamps
    key positions to the cache)."""
    B, Hq, N, Dh, L = check_tree_attention_args(q, k, v, ancestor_bits, prefix_lens, check_values=_on_cpu(q))
    if scale is not None:
        check_float("scale", scale)
    if B == 0 or N == 0:
        return q.new_empty(q.shape).contiguous(), q.new_empty((B, Hq, N), dtype=torch.float32)
    out, lse = _impl("tree_attention", q.device)(q, k, v, ancestor_bits.contiguous(), prefix_lens.contiguous(), scale)
    return out, lse


@tree_attention_op.register_fake
def _tree_attention_fake(q, k, v, ancestor_bits, prefix_lens, scale=None):
    B, Hq, N, _, _ = check_tree_attention_args(q, k, v, ancestor_bits, prefix_lens, check_values=False)
    return q.new_empty(q.shape).contiguous(), q.new_empty((B, Hq, N), dtype=torch.float32)


# --- wrappers with the public ops' arguments (metadata checks only: no host synchronisation) -----------------------

def _check_tree_meta(tree: Tree) -> Tuple[int, int]:
    validate_tree(tree, "tree", deep=False)
    return tree.tokens.shape


def tree_mask(tree: Tree, prefix_lens: Tensor) -> Tuple[Tensor, Tensor]:
    """Graph-safe :func:`taps_kernels.tree_mask`: ``(position_ids [B,N] int64, ancestor_bits [B,N,W] int32)``."""
    B, _ = _check_tree_meta(tree)
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64, torch.int32), shape=(B,), device=tree.device)
    return torch.ops.taps.tree_mask(tree.parents.contiguous(), tree.depth.contiguous(), tree.num_nodes.contiguous(),
                                    prefix_lens.long().contiguous())


def accept_greedy(tree: Tree, target_tokens: Tensor, max_depth: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Graph-safe :func:`taps_kernels.accept_greedy`; ``max_depth`` (an int in ``[0, 2**31 - 3]``) is required (the
    default would read the tree's depth on the host). Returns ``(path [B,max_depth+1], accept_len [B], next_token [B])``,
    int64."""
    B, N = _check_tree_meta(tree)
    check_tensor("target_tokens", target_tokens, dtypes=(torch.int64,), shape=(B, N), device=tree.device)
    max_depth = check_int("max_depth", max_depth, minimum=0, maximum=MAX_COUNT - 1)
    return torch.ops.taps.accept_greedy(tree.tokens.contiguous(), tree.parents.contiguous(),
                                        tree.num_nodes.contiguous(), target_tokens.contiguous(), max_depth + 1)


def compact_kv(keys: Sequence[Tensor], values: Sequence[Tensor], prefix_lens: Tensor, path: Tensor) -> Tensor:
    """Graph-safe :func:`taps_kernels.compact_kv` (in place, all layers); returns ``new_lens [B] int64``.

    On CUDA the path is trusted: root first, strictly increasing, -1 padded, every row inside the cache."""
    if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)) or not keys \
            or len(keys) != len(values):
        raise ValueError("keys/values: expected two equally long, non-empty lists of [B,H,L,Dh] tensors")
    B, _, L, _ = check_tensor("keys[0]", keys[0], dtypes=FLOAT_DTYPES, ndim=4).shape
    for name, group in (("keys", keys), ("values", values)):
        for i, t in enumerate(group):
            check_tensor(f"{name}[{i}]", t, dtypes=FLOAT_DTYPES, shape=(B, None, L, None), device=keys[0].device)
    check_not_grad_tracked([(f"{n}[{i}]", t) for n, g in (("keys", keys), ("values", values)) for i, t in enumerate(g)],
                           "compact_kv")
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64, torch.int32), shape=(B,), device=keys[0].device)
    check_tensor("path", path, dtypes=(torch.int64,), shape=(B, None), device=keys[0].device)
    return torch.ops.taps.compact_kv(list(keys), list(values), prefix_lens.long().contiguous(), path.contiguous())


def tree_attention(q: Tensor, k: Tensor, v: Tensor, ancestor_bits: Tensor, prefix_lens: Tensor,
                   scale: Optional[float] = None, return_lse: bool = False):
    """Graph-safe :func:`taps_kernels.tree_attention`: ``out [B,Hq,N,Dh]`` (and ``lse [B,Hq,N] f32``).

    ``0 <= prefix_lens[b] <= L - N`` is checked on CPU, trusted (clamped by the kernel) on CUDA. No backward."""
    check_tree_attention_args(q, k, v, ancestor_bits, prefix_lens, check_values=False)
    Dh = q.shape[-1]
    scale = 1.0 / math.sqrt(Dh) if scale is None else check_float("scale", scale)
    out, lse = torch.ops.taps.tree_attention(q, k, v, ancestor_bits.contiguous(), prefix_lens.long().contiguous(),
                                             scale)
    return (out, lse) if return_lse else out


from . import custom_ops_tree_build  # noqa: E402,F401  (registers the pool, scoring and selection ops)
