"""Tree mask: position ids and packed ancestor bits; expansion to the additive 4-D mask HF models take."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import check_prefix_lens, check_tensor
from ..backend import resolve
from ..layout import Tree
from ..reference.attention import tree_visibility


def tree_mask(tree: Tree, prefix_lens: torch.Tensor, backend: Optional[str] = None):
    """Position ids and ancestor bits of a batch of trees.

    Args:
        tree: :class:`Tree` with ``N`` rows.
        prefix_lens: ``[B] int64`` cached tokens before each tree.
    Returns:
        ``position_ids [B,N] int64 = prefix_lens + depth`` and ``ancestor_bits [B,N,ceil(N/32)] int32``
        (bit ``j%32`` of word ``j//32`` of row ``i``: node j is an ancestor of i or i itself).
    """
    tree.validate("tree")
    prefix_lens = check_prefix_lens(prefix_lens, tree.batch_size, tree.device)
    _, fn = resolve("tree_mask", backend, tree.device)
    return fn(tree.parents.contiguous(), tree.depth.contiguous(), tree.num_nodes.contiguous(), prefix_lens.contiguous())


def ancestor_bits_to_additive_mask(ancestor_bits: torch.Tensor, prefix_lens: torch.Tensor, kv_len: int,
                                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expand ancestor bits into the additive float mask ``[B,1,N,kv_len]`` that HF attention takes.

    Key ``k < prefix_lens[b]`` is visible (0); key ``prefix_lens[b] + j`` is visible when bit j of the
    row is set; everything else gets ``torch.finfo(dtype).min``. A float mask, not a bool one: HF's
    eager path gives wrong results with bool tree masks.
    """
    check_tensor("ancestor_bits", ancestor_bits, dtypes=(torch.int32,), ndim=3)
    B, N, W = ancestor_bits.shape
    if W != (N + 31) // 32:
        raise ValueError(f"ancestor_bits: expected {(N + 31) // 32} words per row for {N} nodes, received {W}")
    prefix_lens = check_prefix_lens(prefix_lens, B, ancestor_bits.device)
    if int(prefix_lens.max()) + N > kv_len:
        raise ValueError(f"kv_len: expected >= max(prefix_lens) + N = {int(prefix_lens.max()) + N}, received {kv_len}")
    visible = tree_visibility(ancestor_bits, prefix_lens, kv_len)
    mask = torch.zeros(B, 1, N, kv_len, dtype=dtype, device=ancestor_bits.device)
    return mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
