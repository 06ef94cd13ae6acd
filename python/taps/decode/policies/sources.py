"""Proposal sources: where a composed policy's candidate nodes come from.

* :class:`DraftPool`: the drafter's best-first candidate pool (:func:`taps_kernels.candidate_pool`).
* :class:`LookupChain`: the prompt-lookup chain of each row's committed tokens
  (:func:`taps_kernels.lookup_chain`), grafted into the pool (:func:`taps_kernels.graft_chain`) with reach
  ``q_n ** (k + 1)`` for chain node ``k`` from its measured acceptance (:class:`ChainAcceptance`), the sibling
  of its first token with reach ``s_n`` (how often the target's next token was the sibling), and what it learns
  from the target's verdicts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import taps_kernels
from taps_kernels import CandidatePool, DraftProposal, LookupProposal, Selection, Tree, graft_chain, lookup_chain
from taps_kernels.ops.build import CHAIN_HEADER
from taps_kernels.ops.lookup import DEFAULT_MAX_NGRAM
from taps_kernels.reference.lookup import count_kept

from ..token_history import accepted_prefix
from ..tree_ops import IN_ROUND
from .base import PolicyError

#: Chain length: as HF's prompt-lookup examples (10 tokens).
DEFAULT_LOOKUP_TOKENS = 10
#: Weight of the newest observation's counts (older ones decay by this factor per observation).
ACCEPTANCE_DECAY = 0.9
#: Starting successes / failures of every match length (a chain token is first believed right one time in
#: three). They decay like observations: a prior that stayed would hold the rate above the price of a node
#: (~0.07 tokens on these CPUs) in text where lookup is never right.
PRIOR = (1.0, 2.0)
#: The pool's top-K when neither the pool nor the reach model names one.
DEFAULT_TOP_K = 64
#: Positions a pool that follows its trees projects beyond the largest tree of the last drafted round: a tree
#: can grow by this many levels from one round to the next.
DEPTH_HEADROOM = 2


class DraftPool:
    """Best-first candidate pool of ``pool_size`` non-root nodes from the draft's top-``top_k`` tokens per position.

    Args:
        pool_size: non-root nodes per row.
        top_k: tokens per position (None: the reach model's, e.g. the scorer's training top-K); capped at the
            logits' width.
        max_depth: deepest draft position the pool may use (None: every position the drafter has); the loop
            projects only those positions onto the vocabulary.
        follow_trees: project only as deep as the last drafted round's largest tree (its selected nodes: a bound
            of its depth) plus :data:`DEPTH_HEADROOM`, within ``max_depth`` (:meth:`round_positions`). On a CPU
            each position's vocabulary head costs ~0.15 ms of a ~3-4 ms draft while most trees hold 1-3 nodes,
            so the positions past them are paid for and never read.
    """

    def __init__(self, pool_size: int, top_k: Optional[int] = None, max_depth: Optional[int] = None,
                 follow_trees: bool = False):
        if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1):
            raise PolicyError(f"draft pool: max_depth expected an integer >= 1 or None, received {max_depth!r}")
        self.pool_size = int(pool_size)
        self.top_k = top_k
        self.max_depth = max_depth
        self.follow_trees = bool(follow_trees)
        self._depth: Optional[int] = None  # positions the next draft projects when following trees (None: all)

    def positions(self, num_positions: int) -> int:
        """Draft positions the pool may read of the drafter's ``num_positions`` (the deepest its trees reach)."""
        return num_positions if self.max_depth is None else min(self.max_depth, num_positions)

    def round_positions(self, num_positions: int) -> int:
        """Draft positions the coming round projects: :meth:`positions`, or fewer when following trees."""
        every = self.positions(num_positions)
        return every if self._depth is None else min(every, self._depth)

    def observe_sizes(self, sizes: Sequence[int]) -> None:
        """A drafted round's selected node counts per running row (host ints)."""
        if self.follow_trees and sizes:
            self._depth = max(sizes) + DEPTH_HEADROOM

    def reset(self) -> None:
        """A new batch starts projecting every position."""
        self._depth = None

    def build(self, draft_logits: torch.Tensor, bonus: torch.Tensor, vocab_ids: Optional[torch.Tensor],
              top_k: Optional[int] = None) -> CandidatePool:
        """The pool of ``draft_logits [B, D, V]`` (columns mapped through ``vocab_ids`` when given) under the
        roots ``bonus [B]``; ``top_k`` stands in for an unset :attr:`top_k`."""
        k = self.top_k or top_k or DEFAULT_TOP_K
        return taps_kernels.candidate_pool(draft_logits.float(), bonus.long(), validate=IN_ROUND, vocab_ids=vocab_ids,
                                           top_k=min(k, draft_logits.shape[-1]), pool_size=self.pool_size)

    def proposal(self, draft_logits: torch.Tensor, draft_hidden: Optional[torch.Tensor],
                 vocab_ids: Optional[torch.Tensor], top_k: Optional[int] = None) -> DraftProposal:
        """This round's draft as :func:`taps_kernels.build_tree` takes it (arguments as :meth:`build`)."""
        k = self.top_k or top_k or DEFAULT_TOP_K
        hidden = None if draft_hidden is None else draft_hidden.float()
        return DraftProposal(draft_logits.float(), min(k, draft_logits.shape[-1]), self.pool_size, hidden, vocab_ids)


class ChainAcceptance:
    """Per match length ``n``, the rate ``q_n`` at which the target accepts the next chain token (a geometric
    model of how far a chain holds), from decayed counts that start at ``prior``: a verified chain whose first
    ``m`` tokens were in the tree adds ``a`` successes (its accepted prefix) and one failure when ``a < m``. The
    sibling's rate ``s_n`` is the same model over one token: a success when the target's next token was it."""

    def __init__(self, max_ngram: int, decay: float = ACCEPTANCE_DECAY, prior=PRIOR):
        self.decay = float(decay)
        self.success = [float(prior[0])] * (max_ngram + 1)
        self.failure = [float(prior[1])] * (max_ngram + 1)

    def record(self, ngram: int, accepted: int, failed: bool) -> None:
        self.success[ngram] = self.decay * self.success[ngram] + accepted
        self.failure[ngram] = self.decay * self.failure[ngram] + float(failed)

    def rate(self, ngram: int) -> float:
        s, f = self.success[ngram], self.failure[ngram]
        return s / (s + f) if s + f > 0 else 0.0

    def log_rates(self) -> List[float]:
        """``log q_n`` per match length ``n = 0 .. max_ngram`` (``n = 0``, no match: 0; ``-inf`` once the decayed
        successes underflow: reach 0, never worth a node)."""
        rates = [self.rate(n) for n in range(1, len(self.success))]
        return [0.0] + [math.log(q) if q > 0 else float("-inf") for q in rates]

    def log_rates_tensor(self, device: torch.device) -> torch.Tensor:
        """:meth:`log_rates` as ``[max_ngram + 1] float32`` on ``device``."""
        return torch.tensor(self.log_rates(), dtype=torch.float32, device=device)

    def log_reach(self, ngram: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[B, K] float32`` chain log reach ``(k + 1) * log q_n`` of rows whose match length is ``ngram [B]``
        (host floats enter as kernel scalars: nothing is copied to the device)."""
        log_q = torch.zeros(ngram.shape, dtype=torch.float32, device=ngram.device)
        for n, lq in enumerate(self.log_rates()[1:], 1):
            log_q = log_q.masked_fill(ngram == n, lq)
        depth = torch.arange(1, num_tokens + 1, dtype=torch.float32, device=ngram.device)
        return log_q[:, None] * depth[None, :]


def check_lookup_args(name: str, num_tokens: int, max_ngram: int) -> None:
    for arg, v in (("num_tokens", num_tokens), ("max_ngram", max_ngram)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PolicyError(f"policy {name}: {arg} expected an integer >= 1, received {v!r}")


def history_of(name: str, history):
    if history is None:
        raise RuntimeError(f"policy {name}: build() needs history= (the decoder passes it)")
    return history


@dataclass
class Graft:
    """One round's chains: ``ngram [B]`` match lengths, ``length [B]`` chain lengths, ``nodes [B, K]`` the pool
    node of each chain token (-1: none), ``chain [B, K]`` the proposed tokens, ``sibling [B]`` the sibling (-1:
    none), ``sibling_node [B, 1]`` its pool node (-1: none or not grafted)."""

    ngram: torch.Tensor
    length: torch.Tensor
    nodes: torch.Tensor
    chain: torch.Tensor
    sibling: torch.Tensor
    sibling_node: torch.Tensor


class LookupChain:
    """The prompt-lookup chain of each row as a proposal source with a learned reach.

    Args:
        num_tokens: longest chain ``K``.
        max_ngram: longest suffix matched (the latest earlier occurrence of the last ``max_ngram``, else
            fewer, tokens).
        sibling: also graft the sibling of the chain's first token (:func:`taps_kernels.lookup_chain`) under the
            root, with reach ``s_n``. Replayed on AR's greedy outputs (``bench/lookup_tree_study.py``), two root
            children from two occurrences accept more than a chain of two at the same node count on code; where a
            second verified row costs a quarter of a step (the Zen 3 of the README) the rule rarely keeps it and
            the branching trees' bookkeeping costs more than it gains (``bench/results/lookup_sibling_ab_*``), so
            the shipped policies leave it out and ``*-sibling`` opts in.
    """

    def __init__(self, num_tokens: int = DEFAULT_LOOKUP_TOKENS, max_ngram: int = DEFAULT_MAX_NGRAM,
                 sibling: bool = False):
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        self.sibling = bool(sibling)
        self.reset()

    def reset(self) -> None:
        self.acceptance = ChainAcceptance(self.max_ngram)
        self.sibling_acceptance = ChainAcceptance(self.max_ngram)
        self._chains: Dict[int, List[int]] = {}
        self._round: Dict[int, List[int]] = {}

    def graft(self, name: str, tree: Tree, log_reach: torch.Tensor, history) -> Tuple[Tree, torch.Tensor, Graft]:
        """The pool ``tree``/``log_reach`` with each row's chain grafted in (``history=(tokens [B, C], lengths
        [B])``, each row's committed tokens)."""
        tokens, lengths = history_of(name, history)
        chain, chain_len, ngram, sibling = lookup_chain(tokens, lengths, self.num_tokens, self.max_ngram,
                                                        validate=IN_ROUND)
        tree, log_reach, nodes = graft_chain(tree, log_reach, chain, chain_len,
                                             self.acceptance.log_reach(ngram, self.num_tokens), validate=IN_ROUND)
        sibling_node = torch.full_like(sibling[:, None], -1)
        if self.sibling:
            log_s = self.sibling_acceptance.log_rates_tensor(tokens.device)[ngram][:, None]
            tree, log_reach, sibling_node = graft_chain(tree, log_reach, sibling.clamp(min=0)[:, None],
                                                        (sibling >= 0).long(), log_s, validate=IN_ROUND)
        return tree, log_reach, Graft(ngram, chain_len, nodes, chain, sibling, sibling_node)

    def proposal(self, name: str, history) -> LookupProposal:
        """This round's lookup as :func:`taps_kernels.build_tree` takes it (``history`` as in :meth:`graft`)."""
        tokens, lengths = history_of(name, history)
        log_s = self.sibling_acceptance.log_rates_tensor(tokens.device) if self.sibling else None
        return LookupProposal(tokens, lengths, self.num_tokens, self.max_ngram,
                              self.acceptance.log_rates_tensor(tokens.device), log_s)

    @staticmethod
    def aux(graft: Graft, sel: Selection) -> torch.Tensor:
        """``[B, 5 + K] int64``, the columns :func:`taps_kernels.build_tree` reports (:data:`CHAIN_HEADER`, then the
        chain): what :meth:`observe_rows` and the draft gate need back from the round's read."""
        return torch.cat([graft.ngram[:, None], graft.length[:, None], count_kept(graft.nodes, sel.pool_index)[:, None],
                          graft.sibling[:, None], count_kept(graft.sibling_node, sel.pool_index)[:, None], graft.chain],
                         1)

    def observe_rows(self, accepted: Dict[int, Optional[List[int]]], aux: Dict[int, List[int]]) -> None:
        """Record how much of each row's previous chain the target accepted, and whether its next token was the
        sibling; keep the chains verified next. ``accepted[b]``: the tokens row b committed (its accepted nodes,
        then the target's next token), or None when the row just joined."""
        H = len(CHAIN_HEADER)
        for b, committed in accepted.items():
            prev = self._chains.get(b)
            if not committed or prev is None or prev[0] == 0:
                continue
            ngram, kept, sibling = prev[0], prev[2], prev[3]
            if kept > 0:
                a = accepted_prefix(committed, prev[H:H + kept])
                self.acceptance.record(ngram, a, a < kept)
            if self.sibling and sibling >= 0:  # the target's next token is known, the sibling verified or not
                hit = committed[0] == sibling
                self.sibling_acceptance.record(ngram, float(hit), not hit)
        self._chains.update(aux)
        self._round = aux

    def undrafted_reach(self) -> List[List[float]]:
        """Per row of the latest round (:meth:`observe_rows`'s ``aux``), the reach its proposals have in a round
        without the drafter: ``q_n ** (k + 1)`` for k below the chain's length, and ``s_n`` for the sibling when
        grafted (no match: none)."""
        out = []
        for row in self._round.values():
            if row[0] == 0:
                out.append([])
                continue
            q = self.acceptance.rate(row[0])
            reach = [q ** (k + 1) for k in range(row[1])] if q > 0 else []
            s = self.sibling_acceptance.rate(row[0])
            if self.sibling and row[3] >= 0 and s > 0:
                reach.append(s)
            out.append(reach)
        return out
