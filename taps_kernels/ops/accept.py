"""Acceptance walk of a verified tree (greedy, or sampled when the target tokens are target samples)."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import MAX_COUNT, check_data_device, check_int, check_nonempty, check_output_size, check_tensor
from ..backend import resolve
from ..layout import Tree, validate_tree


def accept_greedy(tree: Tree, target_tokens: torch.Tensor, max_depth: Optional[int] = None,
                  backend: Optional[str] = None, validate: Optional[str] = None):
    """Walk from the root while a child carries the target's token.

    Args:
        tree: the verified :class:`Tree` (``N`` rows).
        target_tokens: ``[B, N] int64``, the target's token after each node (argmax, or a target sample).
        max_depth: deepest node that can be accepted, an int in ``[0, 2**31 - 3]``; the path has ``max_depth + 1``
            columns (default: the tree's deepest node, read on the host: pass it on a GPU to avoid the sync).
        validate: tree structure checks: ``"auto"`` (default, or ``TAPS_VALIDATE``) on CPU trees only,
            ``"full"`` on any device, ``"none"`` never (:mod:`taps_kernels._checks`).
    Any ``target_tokens`` value is accepted (it is only compared). ``B >= 1``.
    Returns:
        ``path [B, max_depth+1] int64`` accepted node indices (root first, -1 padded),
        ``accept_len [B] int64`` accepted nodes, root counted (tokens committed this round: tau),
        ``next_token [B] int64`` the target's token at the last accepted node (the next round's bonus).
    """
    validate_tree(tree, "tree", validate=validate)
    check_data_device("tree.tokens", tree.tokens)
    check_nonempty("tree.tokens", tree.tokens, [(0, "tree (batch row)")])
    B, N = tree.tokens.shape
    check_tensor("target_tokens", target_tokens, dtypes=(torch.int64,), shape=(B, N), device=tree.device)
    if max_depth is None:
        max_depth = int(tree.depth.max())
    max_depth = check_int("max_depth", max_depth, minimum=0, maximum=MAX_COUNT - 1)
    check_output_size("max_depth", max_depth, B * (max_depth + 1) * 8, tree.device)
    _, fn = resolve("accept_greedy", backend, tree.device)
    return fn(tree.tokens.contiguous(), tree.parents.contiguous(), tree.num_nodes.contiguous(),
              target_tokens.contiguous(), max_depth + 1)
