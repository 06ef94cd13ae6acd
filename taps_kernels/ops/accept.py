"""Acceptance walk of a verified tree (greedy, or sampled when the target tokens are target samples), and a decode
round's acceptance built on it."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._checks import (MAX_COUNT, check_data_device, check_int, check_nonempty, check_nonnegative, check_output_size,
                       check_tensor, check_tree_tensors, first_index, values_checked)
from .._library import backend_for, define, fresh, values_asked
from ..backend import resolve
from ..layout import Tree, validate_tree


def _accept_meta(tokens, parents, num_nodes, target_tokens, path_len) -> int:
    check_tensor("tokens", tokens, dtypes=(torch.int64,), ndim=2)
    B, N = check_tree_tensors(tokens, parents, None, num_nodes)
    check_tensor("target_tokens", target_tokens, dtypes=(torch.int64,), shape=(B, N), device=parents.device)
    check_int("path_len", path_len, minimum=1, maximum=MAX_COUNT)
    check_output_size("path_len", path_len, B * path_len * 8, parents.device)
    return B


def _check_walk_structure(parents: torch.Tensor, num_nodes: torch.Tensor) -> None:
    """What the walk indexes with (it reads no depth): ``num_nodes`` in ``[1, N]``, real parents before children."""
    B, N = parents.shape
    nn = num_nodes.long()
    bad = (nn < 1) | (nn > N)
    if bool(bad.any()):
        (b,) = first_index(bad)
        raise ValueError(f"tree.num_nodes[{b}]: expected a value in [1, {N}], received {int(nn[b])}")
    idx = torch.arange(N, device=parents.device)
    nonroot = (idx[None, :] < nn[:, None]) & (idx[None, :] > 0)
    bad = nonroot & ((parents < 0) | (parents >= idx[None, :]))
    if bool(bad.any()):
        b, i = first_index(bad)
        raise ValueError(f"tree.parents[{b},{i}]: parent index {int(parents[b, i])} is out of range or not smaller "
                         f"than the child's index; expected 0 <= parent < {i}")


def _accept_kernel(tokens, parents, num_nodes, target_tokens, path_len, backend=None, validate=None):
    args = (tokens, parents, num_nodes, target_tokens, path_len)
    check = values_asked(validate, parents)
    name, fn = backend_for("accept_greedy", backend, parents, _accept_meta, args, check)
    if check:
        _check_walk_structure(parents, num_nodes)
    return fresh(fn(*args), args[:4], name)


def _accept_fake(tokens, parents, num_nodes, target_tokens, path_len, backend=None, validate=None):
    B = _accept_meta(tokens, parents, num_nodes, target_tokens, path_len)
    return tokens.new_empty((B, path_len)), tokens.new_empty((B,)), tokens.new_empty((B,))


accept_greedy_op = define("accept_greedy(Tensor tokens, Tensor parents, Tensor num_nodes, Tensor target_tokens, "
                          "int path_len, str? backend=None, str? validate=None) -> (Tensor, Tensor, Tensor)",
                          _accept_kernel, _accept_fake)
"""``taps::accept_greedy``: ``tokens/target_tokens [B,N] int64``, ``parents [B,N] int32``, ``num_nodes [B] int32``,
``path_len`` in ``[1, 2**31 - 2]`` -> ``(path [B,path_len], accept_len [B], next_token [B])`` int64; checks
metadata, then the structure the walk reads (``num_nodes`` range, parents before children) as ``validate`` says."""


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
    # The whole tree's structure here (the op sees no depth and checks only what the walk reads); then the op runs
    # without checking it again.
    validate_tree(tree, "tree", validate=validate)
    check_data_device("tree.tokens", tree.tokens)
    check_nonempty("tree.tokens", tree.tokens, [(0, "tree (batch row)")])
    B, N = tree.tokens.shape
    check_tensor("target_tokens", target_tokens, dtypes=(torch.int64,), shape=(B, N), device=tree.device)
    if max_depth is None:
        max_depth = int(tree.depth.max())
    max_depth = check_int("max_depth", max_depth, minimum=0, maximum=MAX_COUNT - 1)
    check_output_size("max_depth", max_depth, B * (max_depth + 1) * 8, tree.device)
    return accept_greedy_op(tree.tokens.contiguous(), tree.parents.contiguous(), tree.num_nodes.contiguous(),
                            target_tokens.contiguous(), max_depth + 1, backend, "none")


def _round_meta(tokens, parents, num_nodes, target_tokens, active, path_len, history_tokens, history_lengths) -> int:
    B = _accept_meta(tokens, parents, num_nodes, target_tokens, path_len)
    check_tensor("active", active, dtypes=(torch.bool,), shape=(B,), device=parents.device)
    if (history_tokens is None) != (history_lengths is None):
        raise ValueError("history: expected (tokens, lengths) or None, received one of them as None")
    if history_tokens is not None:
        check_tensor("history_tokens", history_tokens, dtypes=(torch.int64,), shape=(B, None), device=parents.device)
        check_tensor("history_lengths", history_lengths, dtypes=(torch.int64,), shape=(B,), device=parents.device)
        for name, t in (("history_tokens", history_tokens), ("history_lengths", history_lengths)):
            if not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor (it is written in place), received strides "
                                 f"{tuple(t.stride())}")
        check_nonempty("history_tokens", history_tokens, [(1, "column (the write sink)")])
    return B


def _round_kernel(tokens, parents, num_nodes, target_tokens, active, path_len, history_tokens=None,
                  history_lengths=None, backend=None, validate=None):
    args = (tokens, parents, num_nodes, target_tokens, active, path_len, history_tokens, history_lengths)
    check = values_asked(validate, parents)
    name, fn = backend_for("accept_round", backend, parents, _round_meta, args, check)
    if check:
        _check_walk_structure(parents, num_nodes)
        check_nonnegative("history_lengths", history_lengths)  # a row's tokens are written from there
    return fresh(fn(*args), args[:5] + args[6:], name)


def _round_fake(tokens, parents, num_nodes, target_tokens, active, path_len, history_tokens=None,
                history_lengths=None, backend=None, validate=None):
    B = _round_meta(tokens, parents, num_nodes, target_tokens, active, path_len, history_tokens, history_lengths)
    return (tokens.new_empty((B, path_len)), tokens.new_empty((B,)), tokens.new_empty((B,)),
            tokens.new_empty((B, path_len)))


accept_round_op = define("accept_round(Tensor tokens, Tensor parents, Tensor num_nodes, Tensor target_tokens, "
                         "Tensor active, int path_len, Tensor(a!)? history_tokens=None, "
                         "Tensor(b!)? history_lengths=None, str? backend=None, str? validate=None) -> "
                         "(Tensor, Tensor, Tensor, Tensor)", _round_kernel, _round_fake)
"""``taps::accept_round``: :func:`accept_greedy`'s tensors plus ``active [B] bool`` and the optional history
``tokens [B, C+1] int64`` / ``lengths [B] int64`` (written in place) -> ``(path, accept_len, next_token, committed)``
int64; checks metadata, then the walk's structure as ``validate`` says."""


def accept_round(tree: Tree, target_tokens: torch.Tensor, active: torch.Tensor, max_depth: int,
                 history: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, backend: Optional[str] = None,
                 validate: Optional[str] = None):
    """A verified round's acceptance as a decode loop needs it: :func:`accept_greedy` on every row, rows that are
    not ``active`` accepting nothing, the tokens each row commits, and their append to a committed-token history.

    Args:
        tree: the verified :class:`Tree` (``B`` rows of ``N`` nodes).
        target_tokens: ``[B, N] int64``, the target's token after each node.
        active: ``[B] bool``; an idle row gets ``accept_len`` 0, ``path`` ``[0, -1, ...]`` and no committed token.
        max_depth: deepest node that can be accepted (an int ``>= 0``): ``P = max_depth + 1`` columns.
        history: optional ``(tokens [B, C + 1] int64, lengths [B] int64 >= 0)``, contiguous: row ``b``'s committed
            tokens are written at ``tokens[b, lengths[b] ...]`` and ``lengths += accept_len``, in place. Column
            ``C`` is a write sink that is never read: tokens that do not fit below it are dropped (callers reserve
            room).
        validate: as in :func:`accept_greedy`.
    Returns:
        ``path [B, P]`` (root first, -1 padded), ``accept_len [B]`` (root counted), ``next_token [B]`` (the
        target's token at the last accepted node; also for idle rows), ``committed [B, P]`` (the accepted
        tokens after the root, then ``next_token``, -1 after; all -1 for idle rows), each int64.
    """
    validate_tree(tree, "tree", validate=validate)
    check_data_device("tree.tokens", tree.tokens)
    check_nonempty("tree.tokens", tree.tokens, [(0, "tree (batch row)")])
    B, N = tree.tokens.shape
    check_tensor("target_tokens", target_tokens, dtypes=(torch.int64,), shape=(B, N), device=tree.device)
    check_tensor("active", active, dtypes=(torch.bool,), shape=(B,), device=tree.device)
    max_depth = check_int("max_depth", max_depth, minimum=0, maximum=MAX_COUNT - 1)
    check_output_size("max_depth", max_depth, 2 * B * (max_depth + 1) * 8, tree.device)
    h_tokens, h_lengths = (None, None) if history is None else history
    if values_checked(validate, tree.device):
        _round_meta(tree.tokens, tree.parents, tree.num_nodes, target_tokens, active, max_depth + 1, h_tokens,
                    h_lengths)  # the history's metadata before its values are read
        check_nonnegative("history_lengths", h_lengths)
    return accept_round_op(tree.tokens.contiguous(), tree.parents.contiguous(), tree.num_nodes.contiguous(),
                           target_tokens.contiguous(), active.contiguous(), max_depth + 1, h_tokens, h_lengths,
                           backend, "none")
