"""One round's tree in one call: the drafter's candidate pool, the scorer's reach, the prompt-lookup chain grafted
in, the batch throughput rule and the re-index of the kept subtree (what a TAPS policy builds each round).

Each stage is the op of the same name (:func:`candidate_pool`, :func:`score_edges`, :func:`lookup_chain` +
:func:`graft_chain`, :func:`select_subtree` with a :class:`ThroughputRule`); on a CPU the C++ backend runs them in
one call, through the same routines as those ops, so the tree is theirs bit for bit, without their per-call Python
(argument checks, dispatch and the small tensor ops between stages cost about as much as the kernels in a decode
round). The reference (:func:`taps_kernels.reference.build.build_tree_reference`) chains the reference ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from .._checks import (check_data_device, check_float, check_int, check_output_size, check_tensor, first_index,
                       values_checked)
from ..backend import resolve
from ..layout import Selection
from ..scorer_weights import ScorerWeights
from .lookup import check_length_values
from .pool import _check_vocab_ids, check_root_values
from .select import ThroughputRule, check_throughput_table

#: Stage names of :attr:`BuiltRound.seconds`, in order.
STAGES = ("pool", "scoring", "lookup", "selection")
#: The leading columns of :attr:`BuiltRound.chain`, per row; the chain follows them.
CHAIN_HEADER = ("ngram", "chain_len", "chain_kept", "sibling", "sibling_kept")
#: Bytes of the round's arrays per pool or output node and row (token, pool index, reach, parent, depth, ...): what
#: a node cap or a chain length would allocate, checked against the device's memory before the call.
_ROW_BYTES = 8 + 8 + 4 + 4 + 4 + 4


@dataclass(frozen=True)
class DraftProposal:
    """The drafter's side of a round.

    Fields:
        logits: ``[B, D, V] float32`` draft logits (position ``i`` predicts depth ``i + 1``).
        top_k: tokens per position in the pool (``>= 1``, capped at ``V``).
        pool_size: non-root pool nodes per row (``>= 1``).
        hidden: ``[B, D, H] float32`` drafter hidden states (read by the full scorer only), or None.
        vocab_ids: ``[V] int64`` token id of each logit column (a reduced draft vocabulary), or None.
    """

    logits: torch.Tensor
    top_k: int
    pool_size: int
    hidden: Optional[torch.Tensor] = None
    vocab_ids: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class LookupProposal:
    """The prompt-lookup side of a round (:func:`lookup_chain`): the chain, and with ``log_s`` its sibling.

    Fields:
        history: ``[B, C] int64`` committed tokens; row ``b``'s are ``history[b, :lengths[b]]``.
        lengths: ``[B] int64`` in ``[0, C]``.
        num_tokens: longest chain ``K`` (``>= 0``).
        max_ngram: longest suffix matched (``>= 1``).
        log_q: ``[max_ngram + 1] float32`` log rates (``<= 0`` or ``-inf``): chain token ``k`` of a row matched on
            ``n`` tokens has log reach ``(k + 1) * log_q[n]`` (entry 0, no match, is not read for a chain: such
            rows have none).
        log_s: ``[max_ngram + 1] float32`` log rates or None: the sibling of a row matched on ``n`` tokens is
            grafted under the root with log reach ``log_s[n]``; None: no sibling is grafted.
    """

    history: torch.Tensor
    lengths: torch.Tensor
    num_tokens: int
    max_ngram: int
    log_q: torch.Tensor
    log_s: Optional[torch.Tensor] = None


@dataclass
class BuiltRound:
    """What :func:`build_tree` returns.

    Fields:
        selection: the tree to verify (``[B, max_nodes + 1]``, pool order kept, root first), ``pool_index``,
            ``num_selected`` and ``expected`` as :func:`select_subtree` with a :class:`ThroughputRule` gives them
            (pool indices refer to the pool with the chain grafted in).
        chain: ``[B, 5 + K] int64`` per row (:data:`CHAIN_HEADER`): the match length, the chain's length, how many
            chain nodes the selection kept, the sibling (-1: none; reported even when not grafted), whether the
            selection kept it (0 / 1), then the chain (0 past its end); None without a lookup.
        seconds: wall seconds per stage (:data:`STAGES`; 0 for a stage that did not run); the reference leaves it
            empty.
    """

    selection: Selection
    chain: Optional[torch.Tensor]
    seconds: Dict[str, float] = field(default_factory=dict)


def build_tree(root_tokens: torch.Tensor, max_nodes: int, rule: ThroughputRule,
               draft: Optional[DraftProposal] = None, scorer: Optional[ScorerWeights] = None,
               token_embeddings: Optional[torch.Tensor] = None, lookup: Optional[LookupProposal] = None,
               depth_cap: Optional[torch.Tensor] = None, backend: Optional[str] = None,
               validate: Optional[str] = None) -> BuiltRound:
    """One round's tree for every row.

    Args:
        root_tokens: ``[B] int64`` bonus tokens (node 0 of each tree).
        max_nodes: node cap per row (non-root nodes, ``>= 1``).
        rule: the :class:`ThroughputRule` that sizes the batch's trees.
        draft: the drafter's proposal, or None (the pool is the root alone, log reach 0).
        scorer: :class:`ScorerWeights` (full or tiny) for the pool's reach, or None (the pool's own log-mass).
        token_embeddings: ``[V, E]`` float target input embeddings (full scorer only).
        lookup: the prompt-lookup proposal, or None.
        depth_cap: ``[B] int64``: nodes deeper than ``depth_cap[b]`` are never kept; None: no cap.
        backend: None (the dispatcher's choice) or ``"cpp"`` / ``"reference"``.
        validate: value checks (root tokens, history lengths, non-finite logits, the rule's table: finite,
            positive, non-decreasing; the lookup's log rates: ``<= 0``), as in :func:`candidate_pool`.
    Returns:
        :class:`BuiltRound`.
    """
    check_tensor("root_tokens", root_tokens, dtypes=(torch.int64,), ndim=1)
    dev = check_data_device("root_tokens", root_tokens)
    B = root_tokens.shape[0]
    if B < 1:
        raise ValueError("root_tokens: expected at least one row, received shape (0,)")
    max_nodes = check_int("max_nodes", max_nodes)
    check_output_size("max_nodes", max_nodes, B * (max_nodes + 1) * _ROW_BYTES, dev)
    if not isinstance(rule, ThroughputRule):
        raise TypeError(f"rule: expected a ThroughputRule, received {type(rule).__name__}")
    check_tensor("rule.latency", rule.latency, dtypes=(torch.float64,), ndim=1, device=dev)
    plain = check_float("rule.plain_seconds", rule.plain_seconds, above=0.0)
    rows = B if rule.rows is None else check_int("rule.rows", rule.rows)
    if depth_cap is not None:
        check_tensor("depth_cap", depth_cap, dtypes=(torch.int64,), shape=(B,), device=dev)
    if draft is not None:
        _check_draft(draft, B, dev, scorer, token_embeddings, validate)
    if lookup is not None:
        _check_lookup(lookup, B, dev)
    if values_checked(validate, dev):
        _check_values(root_tokens, rule, draft, lookup)
    _, fn = resolve("build_tree", backend, dev)
    selection, chain, seconds = fn(root_tokens, depth_cap, draft, scorer, token_embeddings, lookup, max_nodes,
                                   rule.latency, plain, rows)
    return BuiltRound(selection, chain, seconds)


def _check_draft(draft: DraftProposal, B: int, dev: torch.device, scorer, token_embeddings,
                 validate: Optional[str]) -> None:
    if not isinstance(draft, DraftProposal):
        raise TypeError(f"draft: expected a DraftProposal or None, received {type(draft).__name__}")
    check_tensor("draft.logits", draft.logits, dtypes=(torch.float32,), ndim=3, device=dev)
    if draft.logits.shape[0] != B:
        raise ValueError(f"draft.logits: expected {B} rows (root_tokens has {B}), received shape "
                         f"{tuple(draft.logits.shape)}")
    _, D, V = draft.logits.shape
    if D < 1 or V < 1:
        raise ValueError(f"draft.logits: expected at least one draft position and one column, received shape "
                         f"{tuple(draft.logits.shape)}")
    check_int("draft.top_k", draft.top_k)
    check_int("draft.pool_size", draft.pool_size)
    if draft.vocab_ids is not None:
        _check_vocab_ids(draft.vocab_ids, draft.logits, validate)
    if scorer is not None:
        if not isinstance(scorer, ScorerWeights):
            raise TypeError(f"scorer: expected ScorerWeights or None, received {type(scorer).__name__}")
        if scorer.full:
            if token_embeddings is None or draft.hidden is None:
                raise TypeError("scorer: the full scorer needs token_embeddings [V, E] and draft.hidden [B, D, H]")
            check_tensor("draft.hidden", draft.hidden, dtypes=(torch.float32,), ndim=3, device=dev)
            if tuple(draft.hidden.shape[:2]) != (B, D):
                raise ValueError(f"draft.hidden: expected shape ({B}, {D}, H), received {tuple(draft.hidden.shape)}")


def _check_lookup(lookup: LookupProposal, B: int, dev: torch.device) -> None:
    if not isinstance(lookup, LookupProposal):
        raise TypeError(f"lookup: expected a LookupProposal or None, received {type(lookup).__name__}")
    check_tensor("lookup.history", lookup.history, dtypes=(torch.int64,), ndim=2, device=dev)
    if lookup.history.shape[0] != B:
        raise ValueError(f"lookup.history: expected {B} rows, received shape {tuple(lookup.history.shape)}")
    check_tensor("lookup.lengths", lookup.lengths, dtypes=(torch.int64,), shape=(B,), device=dev)
    k = check_int("lookup.num_tokens", lookup.num_tokens, minimum=0)
    check_output_size("lookup.num_tokens", k, B * (k + 1) * _ROW_BYTES, dev)  # the chain widens the pool by k
    n = check_int("lookup.max_ngram", lookup.max_ngram)
    check_tensor("lookup.log_q", lookup.log_q, dtypes=(torch.float32,), shape=(n + 1,), device=dev)
    if lookup.log_s is not None:
        check_tensor("lookup.log_s", lookup.log_s, dtypes=(torch.float32,), shape=(n + 1,), device=dev)


def _check_values(root_tokens: torch.Tensor, rule: ThroughputRule, draft: Optional[DraftProposal],
                  lookup: Optional[LookupProposal]) -> None:
    token_columns = draft is not None and draft.vocab_ids is None
    check_root_values(root_tokens, draft.logits.shape[2] if token_columns else None)
    check_throughput_table(rule.latency, "rule.latency")
    if lookup is not None:
        check_length_values(lookup.lengths, lookup.history.shape[1], "lookup.lengths")
        # log rates: a positive one would make reach grow along the chain (the kept trees would not be
        # prefix-closed), a NaN one would be ranked differently by each backend
        for name, rates in (("lookup.log_q", lookup.log_q), ("lookup.log_s", lookup.log_s)):
            bad = None if rates is None else ~(rates <= 0)
            if bad is not None and bool(bad.any()):
                (i,) = first_index(bad)
                raise ValueError(f"{name}[{i}]: expected a log rate (<= 0, or -inf), received {float(rates[i])}")
