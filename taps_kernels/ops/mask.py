"""Tree mask: position ids and packed ancestor bits; expansion to the additive 4-D mask HF models take."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import (INT64_MAX, check_data_device, check_int, check_nonempty, check_output_size,
                       check_prefix_lens, check_tensor, check_tree_tensors, first_index, values_checked)
from .._library import backend_for, define, fresh, values_asked
from ..backend import resolve
from ..layout import Tree, validate_tree
from ..reference.attention import tree_visibility


def _tree_mask_meta(parents, depth, num_nodes, prefix_lens):
    check_tensor("depth", depth, dtypes=(torch.int32,), ndim=2)
    B, N = check_tree_tensors(None, parents, depth, num_nodes)
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64,), shape=(B,), device=parents.device)
    return B, N


def _tree_mask_kernel(parents, depth, num_nodes, prefix_lens, backend=None, validate=None):
    args = (parents, depth, num_nodes, prefix_lens)
    check = values_asked(validate, parents)
    name, fn = backend_for("tree_mask", backend, parents, _tree_mask_meta, args, check)
    if check:
        B, N = parents.shape
        validate_tree(Tree(parents.new_zeros((B, N), dtype=torch.int64), parents, depth, num_nodes), "tree", deep=True)
        check_prefix_lens(prefix_lens, B, parents.device)
        check_positions_fit(prefix_lens, depth)
    return fresh(fn(*args), args, name)


def _tree_mask_fake(parents, depth, num_nodes, prefix_lens, backend=None, validate=None):
    B, N = _tree_mask_meta(parents, depth, num_nodes, prefix_lens)
    return (parents.new_empty((B, N), dtype=torch.int64), parents.new_empty((B, N, (N + 31) // 32), dtype=torch.int32))


tree_mask_op = define("tree_mask(Tensor parents, Tensor depth, Tensor num_nodes, Tensor prefix_lens, str? backend=None, "
                      "str? validate=None) -> (Tensor, Tensor)", _tree_mask_kernel, _tree_mask_fake)
"""``taps::tree_mask``: ``parents/depth [B,N] int32``, ``num_nodes [B] int32``, ``prefix_lens [B] int64`` ->
``(position_ids [B,N] int64, ancestor_bits [B,N,ceil(N/32)] int32)``; checks metadata, then the tree's structure and
the prefix bounds as ``validate`` says."""


def check_positions_fit(prefix_lens: torch.Tensor, depth: torch.Tensor) -> None:
    """Value check: ``prefix_lens[b] + depth[b, i]`` fits in int64, compared without forming the (wrapping) sum."""
    if prefix_lens.numel() == 0 or depth.numel() == 0:
        return
    bound = INT64_MAX - depth.amax(1).long().clamp(min=0)
    bad = prefix_lens.long() > bound
    if bool(bad.any()):
        (b,) = first_index(bad)
        raise ValueError(f"prefix_lens[{b}]: expected <= 2**63 - 1 - (deepest node's depth) = {int(bound[b])} so "
                         f"that position ids fit in int64, received {int(prefix_lens[b])}")


def tree_mask(tree: Tree, prefix_lens: torch.Tensor, backend: Optional[str] = None, validate: Optional[str] = None):
    """Position ids and ancestor bits of a batch of trees.

    Args:
        tree: :class:`Tree` with ``N`` rows, ``B >= 1``.
        prefix_lens: ``[B] int64`` (or int32) cached tokens before each tree; ``0 <= prefix_lens[b]`` and
            ``prefix_lens[b] + depth <= 2**63 - 1`` (position ids never wrap).
        validate: value checks (tree structure, prefix bounds): ``"auto"`` (default, or ``TAPS_VALIDATE``) on CPU
            tensors only, ``"full"`` on any device, ``"none"`` never (:mod:`taps_kernels._checks`).
    Returns:
        ``position_ids [B,N] int64 = prefix_lens + depth`` and ``ancestor_bits [B,N,ceil(N/32)] int32``
        (bit ``j%32`` of word ``j//32`` of row ``i``: node j is an ancestor of i or i itself).
    """
    validate_tree(tree, "tree", deep=False)  # values: in the op, as validate says
    check_data_device("tree.tokens", tree.tokens)
    check_nonempty("tree.tokens", tree.tokens, [(0, "tree (batch row)")])
    B, N = tree.tokens.shape
    check_output_size("tree", f"{N} rows", B * N * (8 + 4 * ((N + 31) // 32)), tree.device)
    prefix_lens = check_prefix_lens(prefix_lens, B, tree.device, check_values=False)
    return tree_mask_op(tree.parents.contiguous(), tree.depth.contiguous(), tree.num_nodes.contiguous(),
                        prefix_lens.contiguous(), backend, validate)


def ancestor_bits_to_additive_mask(ancestor_bits: torch.Tensor, prefix_lens: torch.Tensor, kv_len: int,
                                   dtype: torch.dtype = torch.float32, validate: Optional[str] = None) -> torch.Tensor:
    """Expand ancestor bits into the additive float mask ``[B,1,N,kv_len]`` that HF attention takes.

    Key ``k < prefix_lens[b]`` is visible (0); key ``prefix_lens[b] + j`` is visible when bit j of the
    row is set; everything else gets ``torch.finfo(dtype).min``. A float mask, not a bool one: HF's
    eager path gives wrong results with bool tree masks.

    ``ancestor_bits [B,N,ceil(N/32)] int32`` with ``B, N >= 1``; ``kv_len`` an int with
    ``prefix_lens[b] <= kv_len - N`` (value check, see ``validate`` in :func:`tree_mask`); ``dtype`` a float dtype.
    """
    check_tensor("ancestor_bits", ancestor_bits, dtypes=(torch.int32,), ndim=3)
    check_data_device("ancestor_bits", ancestor_bits)
    check_nonempty("ancestor_bits", ancestor_bits, [(0, "tree (batch row)"), (1, "node")])
    B, N, W = ancestor_bits.shape
    if W != (N + 31) // 32:
        raise ValueError(f"ancestor_bits: expected {(N + 31) // 32} words per row for {N} nodes, received {W}")
    kv_len = check_int("kv_len", kv_len, minimum=N, maximum=None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, received {dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    check_output_size("kv_len", kv_len, B * N * kv_len * (itemsize + 2), ancestor_bits.device)
    prefix_lens = check_prefix_lens(prefix_lens, B, ancestor_bits.device,
                                    check_values=values_checked(validate, ancestor_bits.device),
                                    upper=(kv_len - N, "kv_len - N"))
    visible = tree_visibility(ancestor_bits, prefix_lens, kv_len)
    mask = torch.zeros(B, 1, N, kv_len, dtype=dtype, device=ancestor_bits.device)
    return mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
