"""TAPS: target-aware prefix tree selection (METHOD.md section 4).

Per round: a best-first candidate pool (top-``K`` per position, ``K`` = the scorer's training top-K),
path-conditioned reach from the learned scorer through :func:`taps_kernels.score_edges` (fused
Triton kernel on a GPU, reference/C++ on CPU), then one of two selection rules:

* ``taps[:N]`` (default TAPS): the throughput rule. Because reach never grows along a path, the top-``n``
  nodes by reach are prefix-closed; the size ``n*`` maximises long-run expected tokens per second with
  the measured latency table of this machine and model (:mod:`taps.decode.latency`): a node is kept
  while its reach exceeds the plain-decoding tokens its verify time would have bought (the rule and why
  not the per-round ratio: :class:`.gate.GatedPolicy`); ``N`` caps the nodes (default 64), depth is capped
  at :data:`DEFAULT_MAX_DEPTH` draft positions (the only ones projected onto the vocabulary). With draft
  gating (:mod:`.gate`): after rounds whose best tree was predicted to lose to a plain root-only round
  (fixed round time plus this policy's own measured pool/score/select time), the drafter is skipped for
  a backoff number of rounds.
* ``taps-nogate[:N]``: the same throughput rule drafting every round (ablation of the gate).
* ``taps-paper[:N]``: the published utility rule ``u(v) = r(v) / (lambda_node + lambda_depth * depth)``
  (1.0, 0.002), nodes taken in utility order with their ancestors until the cap ``N`` (default 64, as
  published), stopping at the first node with utility below ``min_utility``.
* ``taps-tiny[:N]``: the throughput rule with the 7-scalar scorer (ablation).
* ``taps-fixed:N``: exactly the top-``N`` nodes by reach, no latency table: TAPS at the same node
  budget as ``ddtree:N`` (the equal-budget tau comparison).

Options (``make_policy("taps", scorer=..., pool_size=...)``; CLI ``--scorer`` and ``--pool-size``): the scorer
directory (default: the shipped ``smollm2-taps-scorer``, ``-tiny`` for the tiny variant, found by
:mod:`taps.paths`) and the pool size (default :data:`DEFAULT_POOL_SIZE`, chosen by measured CPU cost: the
published 768-node pool would cost more to score on these CPUs than it could save).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

import taps_kernels

from ..latency import get_table
from ..tree_ops import truncate_depth
from .base import IN_ROUND, NO_TIMER, BuiltTree, PolicyError, parse_budget, register_policy
from .gate import GatedPolicy, OverheadTracker  # noqa: F401  (OverheadTracker: re-exported)
from .scorer_io import load_scorer_weights

DEFAULT_POOL_SIZE = 128
DEFAULT_CAP = 64
LAMBDA_NODE = 1.0
LAMBDA_DEPTH = 0.002
DEFAULT_MIN_UTILITY = 0.01
#: Deepest draft position the throughput-rule variants use: on the full HumanEval / MT-Bench sets no TAPS
#: round accepted more than 8 drafted tokens (2 of 4,865 HumanEval rounds accepted exactly 8), so the
#: vocabulary head runs for 8 positions instead of 15 (about 1 ms of a ~9-11 ms draft on one CPU thread).
#: The hidden states of positions 1..8 are the same either way (the block keeps its trained length).
DEFAULT_MAX_DEPTH = 8


def scorer_dir(tiny: bool = False) -> Path:
    """The shipped scorer's directory (``tiny``: the 7-scalar variant)."""
    from taps import paths  # $TAPS_HOME, then package data, then the source checkout

    name = paths.SCORER_TINY if tiny else paths.SCORER
    try:
        return paths.checkpoint_dir(name)
    except FileNotFoundError:
        return paths.checkpoint_candidates(name)[-1]  # the loader names the missing directory


class TapsPolicy(GatedPolicy):
    """Scorer reach + throughput rule (``rule="reach"``) or published utility rule (``rule="utility"``).

    Args:
        max_nodes: node cap ``N`` (non-root nodes per row).
        rule: ``"reach"`` (with the latency table), ``"fixed"`` (top ``max_nodes`` by reach) or ``"utility"``.
        pool_size: candidate pool size (non-root nodes).
        tiny: use the 7-scalar scorer.
        min_utility: the utility rule's stopping threshold.
        scorer: a scorer directory (default: :func:`scorer_dir`), or already loaded ScorerWeights.
        latency: optional latency table dict (``{"latency": [...], "t0": s}``, optionally ``"batch_latency"``);
            default: measured/cached for the bound target in :meth:`bind`.
        gate: skip the drafter after rounds predicted to lose to plain decoding (:mod:`.gate`); throughput
            rule only.
        max_depth: deepest draft position the trees may use (None: every position). The registered
            throughput-rule policies (``taps``, ``taps-nogate``, ``taps-tiny``) pass :data:`DEFAULT_MAX_DEPTH`;
            ``taps-fixed`` and ``taps-paper`` keep every position (equal-budget comparisons).
    """

    handles_draft_vocab = True

    def __init__(self, max_nodes: int = DEFAULT_CAP, rule: str = "reach", pool_size: Optional[int] = None,
                 tiny: bool = False, min_utility: float = DEFAULT_MIN_UTILITY, scorer=None, latency=None, top_k=None,
                 gate: bool = True, max_depth: Optional[int] = None):
        super().__init__(gate=gate and rule == "reach")
        self.max_nodes = max_nodes
        self.rule = rule
        if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1):
            raise PolicyError(f"policy taps: max_depth expected an integer >= 1 or None, received {max_depth!r}")
        self.max_depth = max_depth
        self.pool_size = max(pool_size or DEFAULT_POOL_SIZE, max_nodes)
        self.tiny = tiny
        self.min_utility = min_utility
        self.scorer = scorer
        self.latency = latency
        self.top_k = top_k
        self.weights = None
        self.emb = None

    def draft_positions(self, num_positions: int) -> int:
        return num_positions if self.max_depth is None else min(self.max_depth, num_positions)

    def bind(self, target_model, drafter, device) -> None:
        if self.weights is None:
            if isinstance(self.scorer, taps_kernels.ScorerWeights):
                w, cfg = self.scorer, {}
            else:
                d = Path(self.scorer) if self.scorer is not None else scorer_dir(self.tiny)
                if not d.is_dir():
                    raise FileNotFoundError(f"policy {self.name}: scorer directory {d} not found (train one with "
                                            f"`taps train-scorer`, or pass scorer=/--scorer)")
                w, cfg = load_scorer_weights(d)
            self.top_k = self.top_k or int(cfg.get("model", {}).get("top_k", 64))
            self.weights = w
        self.weights = self.weights.to(device=device, dtype=torch.float32)
        # A scorer is trained for one target/drafter pair: refuse one whose widths cannot fit before any round runs.
        embed_dim = target_model.get_input_embeddings().weight.shape[1]
        hidden_dim = getattr(getattr(drafter, "config", None), "hidden_size", None)
        try:
            self.weights.validate(embed_dim=embed_dim if self.weights.full else None,
                                  hidden_dim=hidden_dim if self.weights.full else None)
        except ValueError as e:
            raise PolicyError(f"policy {self.name}: the scorer does not fit this target/drafter ({e})") from None
        if self.weights.full:
            self.emb = target_model.get_input_embeddings().weight.detach()
            if self.emb.dtype != torch.float32:
                self.emb = self.emb.float()
        if self.rule == "reach" and self.latency is None:
            self.latency = get_table(target_model, drafter, n_max=self.max_nodes)
        if self.rule == "reach":
            positions = self.draft_positions(drafter.config.block_size - 1) if drafter is not None else None
            self._bind_throughput(self.latency, self.max_nodes, positions)

    def _scored_pool(self, draft_logits, draft_hidden, bonus, timer):
        """The candidate pool ``tree [B, pool_size + 1]`` and its scorer log reach ``[B, pool_size + 1]``."""
        if self.weights is None:
            raise RuntimeError(f"policy {self.name}: bind() was not called (the decoder calls it)")
        V = draft_logits.shape[-1]
        with timer("pool"):
            pool = taps_kernels.candidate_pool(draft_logits.float(), bonus.long(), validate=IN_ROUND,
                                               vocab_ids=self.vocab_ids,
                                               top_k=min(self.top_k or 64, V), pool_size=self.pool_size)
        with timer("scoring"):
            hid = draft_hidden.float() if self.weights.full else None
            _, _, log_reach = taps_kernels.score_edges(pool, self.weights, self.emb if self.weights.full else None, hid,
                                                      validate=IN_ROUND)
        return pool.tree, log_reach

    def build(self, draft_logits, draft_hidden, bonus, depth_cap=None, timer=None, rows=None):
        timer = timer or NO_TIMER
        pool_tree, log_reach = self._scored_pool(draft_logits, draft_hidden, bonus, timer)
        with timer("selection"):
            if self.rule == "reach":
                return self._throughput_build(pool_tree, log_reach, depth_cap, rows)
            if self.rule == "fixed":
                tree = taps_kernels.select_subtree(pool_tree, log_reach, self.max_nodes, rule="reach",
                                                   validate=IN_ROUND).tree
            else:
                tree = taps_kernels.select_subtree(pool_tree, log_reach, self.max_nodes, rule="utility",
                                                   validate=IN_ROUND, lambda_node=LAMBDA_NODE,
                                                   lambda_depth=LAMBDA_DEPTH, min_utility=self.min_utility).tree
            if depth_cap is not None:
                tree = truncate_depth(tree, depth_cap)
        return BuiltTree(tree)


#: Keyword options every TAPS variant accepts in make_policy (the CLI's --scorer and --pool-size).
OPTIONS = ("scorer", "pool_size")


@register_policy("taps", "TAPS: throughput rule on scorer reach with the measured latency table and draft gating; "
                         "N caps nodes per row (default 64)", params="[N]", options=OPTIONS)
def _make(arg, **options):
    return TapsPolicy(parse_budget("taps", arg, DEFAULT_CAP), rule="reach", max_depth=DEFAULT_MAX_DEPTH, **options)


@register_policy("taps-nogate", "TAPS throughput rule without draft gating (drafts every round; ablation); "
                                "N caps nodes", params="[N]", options=OPTIONS)
def _make_nogate(arg, **options):
    return TapsPolicy(parse_budget("taps-nogate", arg, DEFAULT_CAP), rule="reach", gate=False,
                      max_depth=DEFAULT_MAX_DEPTH, **options)


@register_policy("taps-paper", "TAPS, published utility rule (lambda 1.0/0.002, threshold); N caps nodes (default 64)",
                 params="[N]", options=OPTIONS)
def _make_paper(arg, **options):
    return TapsPolicy(parse_budget("taps-paper", arg, DEFAULT_CAP), rule="utility", **options)


@register_policy("taps-tiny", "TAPS throughput rule with the 7-scalar scorer (ablation); N caps nodes", params="[N]",
                 options=OPTIONS)
def _make_tiny(arg, **options):
    return TapsPolicy(parse_budget("taps-tiny", arg, DEFAULT_CAP), rule="reach", tiny=True,
                      max_depth=DEFAULT_MAX_DEPTH, **options)


@register_policy("taps-fixed", "TAPS at a fixed node budget: the top-N nodes by scorer reach", params="N",
                 options=OPTIONS)
def _make_fixed(arg, **options):
    return TapsPolicy(parse_budget("taps-fixed", arg), rule="fixed", **options)
