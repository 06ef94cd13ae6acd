"""Prompt lookup: the n-gram match of each row's last tokens against its own history, and the graft of the
matched continuation into a candidate tree (the ``taps-lookup`` and ``lookup`` policies)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._checks import (check_data_device, check_int, check_no_grad, check_output_size, check_tensor, first_index,
                       values_checked)
from ..backend import resolve
from ..layout import Tree, validate_tree

#: Longest suffix matched by default (then shorter ones, down to 1 token).
DEFAULT_MAX_NGRAM = 3


def check_length_values(lengths: torch.Tensor, C: int, name: str = "lengths") -> None:
    """Every history length is in ``[0, C]`` (``C`` columns of tokens)."""
    bad = (lengths < 0) | (lengths > C)
    if bool(bad.any()):
        b = first_index(bad)[0]
        raise ValueError(f"{name}[{b}]: expected a history length in [0, {C}] (the history has {C} columns), "
                         f"received {int(lengths[b])}")


def lookup_chain(tokens: torch.Tensor, lengths: torch.Tensor, num_tokens: int, max_ngram: int = DEFAULT_MAX_NGRAM,
                 backend: Optional[str] = None, validate: Optional[str] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompt-lookup continuation of every row, and the sibling of its first token.

    For ``n = min(max_ngram, C - 1) .. 1`` (the longest that matches wins), the row's last ``n`` tokens are
    searched in its earlier tokens; of the occurrences (each with at least one token after it) the latest is
    used, and the chain is the up to ``num_tokens`` tokens that followed it (fewer when the history ends first).
    The sibling is the token after the latest occurrence (of the same ``n`` tokens) whose next token differs from
    the chain's first: a second guess for the first token, worth a node where the history went two ways.

    Args:
        tokens: ``[B, C] int64``; row b's history is ``tokens[b, :lengths[b]]`` (any token values).
        lengths: ``[B] int64`` in ``[0, C]`` (checked on CPU tensors, or everywhere with ``validate="full"``).
        num_tokens: ``K >= 0``, the longest chain.
        max_ngram: longest suffix matched, ``>= 1``.
        validate: value checks: ``"auto"`` (default, or ``TAPS_VALIDATE``) on CPU tensors only, ``"full"``
            on any device, ``"none"`` never (:mod:`taps_kernels._checks`).
    Returns:
        ``chain [B, K] int64`` (0 past the end), ``chain_len [B] int64``, ``ngram [B] int64``: the matched suffix
        length, 0 when nothing matched (then ``chain_len`` is 0), ``sibling [B] int64``: -1 when there is none (a
        history of token ids, which are never negative, keeps this unambiguous). The sibling does not depend on
        ``num_tokens``.
    """
    tokens = check_tensor("tokens", tokens, dtypes=(torch.int64,), ndim=2)
    dev = check_data_device("tokens", tokens)
    B, C = tokens.shape
    check_tensor("lengths", lengths, dtypes=(torch.int64,), shape=(B,), device=dev)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    check_output_size("num_tokens", num_tokens, B * num_tokens * 8, dev)
    max_ngram = check_int("max_ngram", max_ngram, minimum=1)
    if values_checked(validate, dev) and B:
        check_length_values(lengths, C)
    _, fn = resolve("lookup_chain", backend, dev)
    return fn(tokens, lengths, num_tokens, max_ngram)


def graft_chain(tree: Tree, log_reach: torch.Tensor, chain: torch.Tensor, chain_len: torch.Tensor,
                chain_log_reach: torch.Tensor, backend: Optional[str] = None, validate: Optional[str] = None
                ) -> Tuple[Tree, torch.Tensor, torch.Tensor]:
    """Merge each row's chain ``root -> chain[b, 0] -> chain[b, 1] -> ...`` into its tree.

    A chain node that the tree already has (same parent, same token: the first such node) is reused and its
    log reach becomes the larger of the two estimates (NaN if either is NaN); the others are appended after the
    row's real nodes, so node order stays topological. Along the chain both estimates are non-increasing, so the
    merged log reach stays non-increasing along every path (the throughput rule's top-``n`` stays prefix-closed).
    No backward: a ``log_reach`` or ``chain_log_reach`` that requires grad (grad mode on) is refused.

    Args:
        tree: ``[B, N]`` :class:`Tree` (siblings carry distinct tokens, as pools and selected subtrees do).
        log_reach: ``[B, N] float32``, padding ``-inf``.
        chain: ``[B, K] int64``; ``chain_len [B] int64`` real tokens per row (values past ``K`` count as ``K``).
        chain_log_reach: ``[B, K] float32`` log reach of the chain node at depth ``k + 1``, non-increasing in k.
        validate: tree structure checks, as :func:`lookup_chain`'s.
    Returns:
        ``(tree [B, N + K], log_reach [B, N + K] float32, chain_nodes [B, K] int64)``: the merged trees (padding:
        token 0, parent -1, depth 0, reach ``-inf``), their log reach, and the node index of each chain token
        (-1 past ``chain_len``).
    """
    validate_tree(tree, "tree", validate=validate)
    dev = check_data_device("tree.tokens", tree.tokens)
    B, N = tree.tokens.shape
    check_tensor("log_reach", log_reach, dtypes=(torch.float32,), shape=(B, N), device=dev)
    chain = check_tensor("chain", chain, dtypes=(torch.int64,), ndim=2, device=dev)
    if chain.shape[0] != B:
        raise ValueError(f"chain: expected {B} rows (one per tree), received shape {tuple(chain.shape)}")
    K = chain.shape[1]
    check_tensor("chain_len", chain_len, dtypes=(torch.int64,), shape=(B,), device=dev)
    check_tensor("chain_log_reach", chain_log_reach, dtypes=(torch.float32,), shape=(B, K), device=dev)
    check_no_grad("graft_chain", [("log_reach", log_reach), ("chain_log_reach", chain_log_reach)])
    _, fn = resolve("graft_chain", backend, dev)
    return fn(tree, log_reach, chain, chain_len, chain_log_reach)
