"""The tree kernels as the decode loop calls them inside a round.

Everything a round hands to these kernels it built itself on the device (trees from the policies, paths
from the accept walk, lengths it maintains), so the value checks of the public ops have nothing to catch
there; on a GPU they are skipped anyway (they would synchronise). On CUDA the loop calls the ``taps::``
custom ops (graph-capturable, metadata checks only on CUDA); on CPU those ops re-check tree structure and
bounds in Python on every call (measured here ~0.3 ms per mask/accept call and ~2.6 ms per 30-layer
compaction under load, against 6 us / 0.17 ms for the kernels), so the loop calls the backend's kernel
directly, through the one dispatch (:func:`taps_kernels.backend.resolve`). The public ops (with checks)
remain the entry point for inputs that come from outside.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from taps_kernels import Tree, custom_ops
from taps_kernels.backend import resolve

def _direct(device: torch.device) -> bool:
    return device.type == "cpu" and not torch.compiler.is_compiling()


def tree_mask(tree: Tree, prefix_lens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids [B,N] int64, ancestor_bits [B,N,W] int32)``."""
    if _direct(tree.device):
        return tuple(resolve("tree_mask", None, tree.device)[1](tree.parents, tree.depth, tree.num_nodes,
                                                                prefix_lens.long()))
    return custom_ops.tree_mask(tree, prefix_lens)


def accept_greedy(tree: Tree, target_tokens: torch.Tensor, max_depth: int):
    """``(path [B,max_depth+1] int64, accept_len [B] int64, next_token [B] int64)``."""
    if _direct(tree.device):
        return tuple(resolve("accept_greedy", None, tree.device)[1](tree.tokens, tree.parents, tree.num_nodes,
                                                                    target_tokens.contiguous(), max_depth + 1))
    return custom_ops.accept_greedy(tree, target_tokens, max_depth=max_depth)


def compact_kv(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], prefix_lens: torch.Tensor,
               path: torch.Tensor) -> torch.Tensor:
    """In place on every layer's ``[B,H,L,Dh]`` cache; returns ``new_lens [B]``."""
    if _direct(path.device):
        return resolve("compact_kv", None, path.device)[1](list(keys), list(values), prefix_lens.long().contiguous(),
                                                           path.contiguous())
    return custom_ops.compact_kv(list(keys), list(values), prefix_lens, path)


__all__: List[str] = ["tree_mask", "accept_greedy", "compact_kv"]
