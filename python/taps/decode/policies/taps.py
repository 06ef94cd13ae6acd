"""TAPS: target-aware prefix tree selection (METHOD.md section 4).

Per round: a best-first candidate pool (top-``K`` per position, ``K`` = the scorer's training top-K),
path-conditioned reach from the learned scorer through :func:`taps_kernels.score_edges` (fused
Triton kernel on a GPU, reference/C++ on CPU), then one of two selection rules:

* ``taps[:N]`` (default TAPS): the throughput rule. Because reach never grows along a path, the top-``n``
  nodes by reach are prefix-closed; the size ``n*`` maximises long-run expected tokens per second with
  the measured latency table of this machine and model (:mod:`taps.decode.latency`): a node is kept
  while its reach exceeds the plain-decoding tokens its verify time would have bought (the rule and why
  not the per-round ratio: :class:`.sizing.ThroughputSize`); ``N`` caps the nodes (default 64), depth is capped
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

Options (``make_policy("taps", scorer=..., pool_size=..., top_k=..., latency=...)``; CLI ``--scorer`` and
``--pool-size``): the scorer directory (default: the shipped ``smollm2-taps-scorer``, ``-tiny`` for the tiny
variant, found by :mod:`taps.paths`) and the pool size (default :data:`DEFAULT_POOL_SIZE`, chosen by measured CPU
cost: the published 768-node pool would cost more to score on these CPUs than it could save); a harness may also
hand in the pool's top-K and a latency table it measured itself.
"""
from __future__ import annotations

from typing import Optional

from .base import PolicyError, parse_budget, register_policy
from .composed import ComposedPolicy
from .reach import ScorerReach, scorer_dir  # noqa: F401  (scorer_dir: the CLI names the default scorer by it)
from .sizing import DEFAULT_MIN_UTILITY, ThroughputSize, TopReach, UtilitySize
from .sources import DraftPool

DEFAULT_POOL_SIZE = 128
DEFAULT_CAP = 64
#: Deepest draft position the throughput-rule variants use: on the full HumanEval / MT-Bench sets no TAPS
#: round accepted more than 8 drafted tokens (2 of 4,865 HumanEval rounds accepted exactly 8), so the
#: vocabulary head runs for 8 positions instead of 15 (about 1 ms of a ~9-11 ms draft on one CPU thread).
#: The hidden states of positions 1..8 are the same either way (the block keeps its trained length).
DEFAULT_MAX_DEPTH = 8
RULES = ("reach", "fixed", "utility")


def taps_size_rule(rule: str, max_nodes: int, latency=None, min_utility: float = DEFAULT_MIN_UTILITY):
    """The size rule of a TAPS variant: ``"reach"`` the throughput rule (with ``latency``), ``"fixed"`` the top
    ``max_nodes`` by reach, ``"utility"`` the published utility rule."""
    if rule == "reach":
        return ThroughputSize(max_nodes, latency)
    if rule == "fixed":
        return TopReach(max_nodes)
    if rule == "utility":
        return UtilitySize(max_nodes, min_utility)
    raise PolicyError(f"policy taps: rule expected one of {RULES}, received {rule!r}")


def scorer_pool(max_nodes: int, pool_size: Optional[int] = None, tiny: bool = False, scorer=None, top_k=None,
                max_depth: Optional[int] = None, follow_trees: bool = False):
    """``(DraftPool, ScorerReach)`` of the TAPS variants: a pool of ``pool_size`` (default
    :data:`DEFAULT_POOL_SIZE`, at least ``max_nodes``) scored by the learned scorer; ``follow_trees``: the
    throughput rule's variants project only as deep as their recent trees (:class:`.sources.DraftPool`)."""
    pool = DraftPool(max(pool_size or DEFAULT_POOL_SIZE, max_nodes), top_k=None, max_depth=max_depth,
                     follow_trees=follow_trees)
    return pool, ScorerReach(scorer, tiny=tiny, top_k=top_k)


def taps_policy(max_nodes: int = DEFAULT_CAP, rule: str = "reach", pool_size: Optional[int] = None,
                tiny: bool = False, min_utility: float = DEFAULT_MIN_UTILITY, scorer=None, latency=None, top_k=None,
                gate: bool = True, max_depth: Optional[int] = None) -> ComposedPolicy:
    """Scorer reach over the drafter's pool, sized by ``rule``.

    Args:
        max_nodes: node cap ``N`` (non-root nodes per row).
        rule: ``"reach"`` (the throughput rule with the latency table), ``"fixed"`` (top ``max_nodes`` by reach)
            or ``"utility"``.
        pool_size: candidate pool size (non-root nodes).
        tiny: use the 7-scalar scorer.
        min_utility: the utility rule's stopping threshold.
        scorer: a scorer directory (default: :func:`.reach.scorer_dir`), or already loaded ScorerWeights.
        latency: optional latency table dict (``{"latency": [...], "t0": s}``, optionally ``"batch_latency"``);
            default: measured/cached for the bound target.
        top_k: the pool's top-K (default: the scorer's training top-K).
        gate: skip the drafter after rounds predicted to lose to plain decoding (:mod:`.gate`); throughput
            rule only.
        max_depth: deepest draft position the trees may use (None: every position). The registered
            throughput-rule policies (``taps``, ``taps-nogate``, ``taps-tiny``) pass :data:`DEFAULT_MAX_DEPTH`;
            ``taps-fixed`` and ``taps-paper`` keep every position (equal-budget comparisons).
    """
    pool, reach = scorer_pool(max_nodes, pool_size, tiny, scorer, top_k, max_depth, follow_trees=rule == "reach")
    return ComposedPolicy(taps_size_rule(rule, max_nodes, latency, min_utility), draft=pool, reach=reach,
                          gate=gate and rule == "reach")


#: Keyword options every TAPS variant accepts in make_policy: the CLI's --scorer and --pool-size, and for harnesses
#: that measure their own, the pool's top-K and the latency table (see :func:`taps_policy`).
OPTIONS = ("scorer", "pool_size", "top_k", "latency")


@register_policy("taps", "TAPS: throughput rule on scorer reach with the measured latency table and draft gating; "
                         "N caps nodes per row (default 64)", params="[N]", options=OPTIONS)
def _make(arg, **options):
    return taps_policy(parse_budget("taps", arg, DEFAULT_CAP), rule="reach", max_depth=DEFAULT_MAX_DEPTH, **options)


@register_policy("taps-nogate", "TAPS throughput rule without draft gating (drafts every round; ablation); "
                                "N caps nodes", params="[N]", options=OPTIONS)
def _make_nogate(arg, **options):
    return taps_policy(parse_budget("taps-nogate", arg, DEFAULT_CAP), rule="reach", gate=False,
                       max_depth=DEFAULT_MAX_DEPTH, **options)


@register_policy("taps-paper", "TAPS, published utility rule (lambda 1.0/0.002, threshold); N caps nodes (default 64)",
                 params="[N]", options=OPTIONS)
def _make_paper(arg, **options):
    return taps_policy(parse_budget("taps-paper", arg, DEFAULT_CAP), rule="utility", **options)


@register_policy("taps-tiny", "TAPS throughput rule with the 7-scalar scorer (ablation); N caps nodes", params="[N]",
                 options=OPTIONS)
def _make_tiny(arg, **options):
    return taps_policy(parse_budget("taps-tiny", arg, DEFAULT_CAP), rule="reach", tiny=True,
                       max_depth=DEFAULT_MAX_DEPTH, **options)


@register_policy("taps-fixed", "TAPS at a fixed node budget: the top-N nodes by scorer reach", params="N",
                 options=OPTIONS)
def _make_fixed(arg, **options):
    return taps_policy(parse_budget("taps-fixed", arg), rule="fixed", **options)
