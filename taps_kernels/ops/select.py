"""Subtree selection: keep a prefix-closed subtree of the pool, by reach, throughput or published utility."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .._checks import (FLOAT_DTYPES, check_data_device, check_float, check_int, check_log_values, check_nonempty,
                       check_output_size, check_tensor, first_index, values_checked)
from ..backend import has_impl, resolve
from ..layout import Selection, Tree, validate_tree

RULES = ("reach", "utility")


def select_subtree(tree: Tree, log_reach: torch.Tensor, max_nodes: int,
                   latency: Optional[Union[torch.Tensor, Sequence[float]]] = None, t0: float = 0.0,
                   rule: str = "reach", lambda_node: float = 1.0, lambda_depth: float = 0.002,
                   min_utility: float = 0.0, backend: Optional[str] = None,
                   validate: Optional[str] = None) -> Selection:
    """Choose the subtree to verify.

    Args:
        tree: the pool (:class:`Tree`, ``N`` rows).
        log_reach: ``[B, N]`` float log reach of each node (root 0).
        max_nodes: most non-root nodes kept (``>= 1``).
        latency: optional ``[L]`` seconds to verify root + n nodes, ``n = 0..L-1``; with it (rule
            ``"reach"``) the size is ``n* = argmax (1 + sum of the top-n reaches) / (t0 + latency[n])``.
        t0: fixed per-round seconds (draft, pool, selection) added to every latency entry.
        rule: ``"reach"`` (top nodes by prefix-closed reach, parent-first ties) or ``"utility"``
            (published rule ``r / (lambda_node + lambda_depth * depth)`` with ancestor closure,
            stopping below ``min_utility``).
        lambda_node, lambda_depth: finite, ``lambda_node > 0`` and ``lambda_depth >= 0`` (checked for either rule).
        min_utility: a float, not NaN (``-inf`` keeps going to ``max_nodes``).
        validate: value checks (tree structure, non-finite reach, latency table): ``"auto"`` (default, or
            ``TAPS_VALIDATE``) on CPU tensors only, ``"full"`` on any device, ``"none"`` never
            (:mod:`taps_kernels._checks`).
    Non-finite values: ``log_reach`` of real non-root nodes is finite or ``-inf`` (unreachable: ranked last, ties
    by node index, identical on every backend); NaN and ``+inf`` are refused. ``latency`` entries must be finite
    with ``t0 + latency[n] > 0``; ``t0`` finite.
    Returns:
        :class:`Selection`: ``tree`` with ``max_nodes + 1`` rows (pool order kept, root first),
        ``pool_index [B, max_nodes+1] int64`` and ``num_selected [B] int32``.
    """
    validate_tree(tree, "tree", validate=validate)
    dev = check_data_device("tree.tokens", tree.tokens)
    check_nonempty("tree.tokens", tree.tokens, [(0, "tree (batch row)")])
    max_nodes = check_int("max_nodes", max_nodes)
    B, N = tree.tokens.shape
    check_output_size("max_nodes", max_nodes, B * (max_nodes + 1) * (8 + 8 + 4 + 4), dev)
    check_tensor("log_reach", log_reach, dtypes=FLOAT_DTYPES, shape=(B, N), device=dev)
    if rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES}, received {rule!r}")
    t0 = check_float("t0", t0)
    lambda_node = check_float("lambda_node", lambda_node, above=0.0)
    lambda_depth = check_float("lambda_depth", lambda_depth, at_least=0.0)
    min_utility = check_float("min_utility", min_utility, finite=False)
    check = values_checked(validate, dev)
    if check:
        check_log_values("log_reach", torch.where(tree.parents >= 0, log_reach, torch.zeros_like(log_reach)),
                         what="log reach")
    if latency is not None:
        if not isinstance(latency, torch.Tensor):
            try:
                latency = torch.as_tensor(latency, dtype=torch.float64)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TypeError(f"latency: expected a 1-D table of seconds (tensor or sequence of floats), received "
                                f"{type(latency).__name__} ({exc})") from None
        check_tensor("latency", latency, dtypes=FLOAT_DTYPES + (torch.float64,), ndim=1)
        if latency.numel() < 1:
            raise ValueError("latency: expected a non-empty 1-D table of seconds, received shape (0,)")
        if rule != "reach":
            raise ValueError("latency: the throughput rule needs rule='reach'")
        latency = latency.to(torch.float64)
        if values_checked(validate, latency.device):
            bad = ~torch.isfinite(latency) | (latency + t0 <= 0)
            if bool(bad.any()):
                (n,) = first_index(bad)
                raise ValueError(f"latency[{n}]: expected finite seconds with t0 + latency[n] > 0, received "
                                 f"{float(latency[n])} (t0={t0})")
    name, fn = resolve("select_subtree", backend, tree.device)
    pool_index, num_selected = fn(tree.parents.contiguous(), tree.depth.contiguous(), tree.num_nodes.contiguous(),
                                  log_reach.float().contiguous(), max_nodes, latency, float(t0), rule,
                                  float(lambda_node), float(lambda_depth), float(min_utility))
    # Re-index with the same backend when it has a re-indexer (cpp, triton); else the torch version (any device).
    _, reindex = resolve("reindex_subtree", name if has_impl("reindex_subtree", name) else "reference", tree.device)
    tokens, parents, depth, num_nodes = reindex(tree.tokens.contiguous(), tree.parents.contiguous(),
                                                tree.depth.contiguous(), tree.num_nodes.contiguous(), pool_index,
                                                num_selected)
    return Selection(Tree(tokens, parents, depth, num_nodes), pool_index, num_selected)
