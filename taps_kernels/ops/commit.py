"""A verified decode round's commit in one call: the target's greedy tokens (or given target tokens), the acceptance
walk and its history append (:func:`accept_round`), KV compaction (:func:`compact_kv`) and the cache lengths.

Each step is the op of the same name; on a CPU the C++ backend runs them in one call through the same routines, so
the results are theirs bit for bit, without their per-call Python: after a target step the interpreter's caches are
cold, and the chain of ops and small tensor updates cost ~0.26 ms of a 4.6 ms AR round and ~0.6 ms of an 8 ms tree
round on this project's CPU. The reference (:func:`taps_kernels.reference.commit.commit_round_reference`) chains
the reference ops.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .._checks import (FLOAT_DTYPES, MAX_COUNT, check_data_device, check_int, check_nonempty, check_nonnegative,
                       check_not_grad_tracked, check_tensor, check_writable_disjoint, first_index, values_checked)
from ..backend import resolve
from ..layout import Tree, validate_tree
from .accept import _round_meta


def _check_commit_args(tree: Tree, active, max_depth, keys, values, lengths, logits, target_tokens, history,
                       moves, validate) -> None:
    """Every check of :func:`commit_round` (the C++ entry repeats the metadata ones itself)."""
    validate_tree(tree, "tree", validate=validate)
    dev = check_data_device("tree.tokens", tree.tokens)
    check_nonempty("tree.tokens", tree.tokens, [(0, "tree (batch row)")])
    B, N = tree.tokens.shape
    if (logits is None) == (target_tokens is None):
        raise ValueError("logits/target_tokens: expected exactly one of them (logits: the greedy tokens are their "
                         f"argmax), received {'neither' if logits is None else 'both'}")
    if logits is not None:
        check_tensor("logits", logits, dtypes=FLOAT_DTYPES, shape=(B, N, None), device=dev)
        check_nonempty("logits", logits, [(2, "vocabulary column")])
    h_tokens, h_lengths = (None, None) if history is None else history
    _round_meta(tree.tokens, tree.parents, tree.num_nodes, target_tokens if target_tokens is not None else tree.tokens,
                active, max_depth + 1, h_tokens, h_lengths)
    check_tensor("lengths", lengths, dtypes=(torch.int64,), shape=(B,), device=dev)
    if not lengths.is_contiguous():
        raise ValueError(f"lengths: expected a contiguous tensor (it is written in place), received strides "
                         f"{tuple(lengths.stride())}")
    if values_checked(validate, dev):
        check_nonnegative("history_lengths", h_lengths)
        check_nonnegative("lengths", lengths)
    if not moves:
        return
    if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)) or not keys \
            or len(keys) != len(values):
        raise ValueError("keys/values: expected equally long non-empty lists of tensors, received "
                         f"{type(keys).__name__}/{type(values).__name__}")
    ref = check_tensor("keys[0]", keys[0], dtypes=FLOAT_DTYPES, ndim=4, device=dev)
    R, _, L, _ = ref.shape
    if R < B:
        raise ValueError(f"keys[0]: expected at least {B} batch rows (the tree's), received shape {tuple(ref.shape)}")
    named = [(f"{n}[{i}]", t) for n, group in (("keys", keys), ("values", values)) for i, t in enumerate(group)]
    for name, t in named:
        check_tensor(name, t, dtypes=FLOAT_DTYPES, shape=(R, None, L, None), device=dev)
    check_writable_disjoint(named + [("lengths", lengths)])
    check_not_grad_tracked(named, "commit_round")
    if values_checked(validate, dev):
        bad = lengths > L - N
        if bool(bad.any()):
            (b,) = first_index(bad)
            raise ValueError(f"lengths[{b}]: expected a value in [0, L - N] = [0, {L - N}] (cache length L = {L}, "
                             f"tree nodes N = {N}), received {int(lengths[b])}")


def commit_round(tree: Tree, active: torch.Tensor, max_depth: int, keys: Sequence[torch.Tensor],
                 values: Sequence[torch.Tensor], lengths: torch.Tensor, logits: Optional[torch.Tensor] = None,
                 target_tokens: Optional[torch.Tensor] = None,
                 history: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, moves: bool = True,
                 backend: Optional[str] = None, validate: Optional[str] = None):
    """Commit a verified round of ``B`` rows: choose the target's tokens, accept, compact the cache, advance.

    Args:
        tree: the verified :class:`Tree` (``B`` rows of ``N`` nodes), node ``j`` of row ``b`` cached at row
            ``lengths[b] + j``.
        active: ``[B] bool``; an idle row accepts nothing (as in :func:`accept_round`).
        max_depth: deepest node that can be accepted (an int ``>= 0``): ``P = max_depth + 1`` path columns.
        keys, values: one ``[R, H, L, Dh]`` cache tensor per layer (float32/float16/bfloat16, ``R >= B``; rows
            ``[0, B)`` are the tree's); the accepted nodes' rows move to ``lengths[b] + j`` in place when ``moves``
            (without it they are neither read nor written).
        lengths: ``[B] int64`` committed rows per cache row, ``>= 0`` and with ``moves`` at most ``L - N``;
            ``+= accept_len`` in place.
        logits: ``[B, N, V]`` float: the target tokens are their argmax (:func:`greedy_tokens`); or
        target_tokens: ``[B, N] int64`` (a target sample per node). Exactly one of the two.
        history: optional ``(tokens [B, C + 1] int64, lengths [B] int64 >= 0)``, appended to in place as in
            :func:`accept_round`.
        moves: False when no row can need a move (chains: accepted nodes are already contiguous).
        validate: value checks (tree structure, ``lengths`` range): ``"auto"`` (default, or ``TAPS_VALIDATE``) on
            CPU tensors only, ``"full"`` on any device, ``"none"`` never (:mod:`taps_kernels._checks`). The C++
            backend checks the metadata and ``lengths`` itself.
    Returns:
        ``(path [B, P], accept_len [B], next_token [B], committed [B, P])`` int64, as :func:`accept_round`.
    Everything is checked before the first write, so a rejected call leaves every tensor untouched.
    """
    check_tensor("tree.tokens", tree.tokens, dtypes=(torch.int64,), ndim=2)  # its device picks the backend
    max_depth = check_int("max_depth", max_depth, minimum=0, maximum=MAX_COUNT - 1)
    moves = bool(moves)
    name, fn = resolve("commit_round", backend, tree.tokens.device)
    if name != "cpp" or values_checked(validate, tree.tokens.device):
        _check_commit_args(tree, active, max_depth, keys, values, lengths, logits, target_tokens, history, moves,
                           validate)
    h_tokens, h_lengths = (None, None) if history is None else history
    return fn(tree.tokens, tree.parents, tree.num_nodes, active, max_depth + 1, list(keys) if moves else [],
              list(values) if moves else [], lengths, logits, target_tokens, h_tokens, h_lengths, moves)
