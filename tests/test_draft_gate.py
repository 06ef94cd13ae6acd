"""Draft gating (taps.decode.policies.gate): the backoff schedule, and in the decode loop: skipped rounds
run no drafter, verify the root alone, keep the output identical to HF generate, and reset per generation."""
import math
import random

import pytest
import torch

from taps.decode import SpeculativeDecoder, make_policy
from taps.decode.policies.ddtree_cost import CostAwareDDTreePolicy
from taps.decode.policies.gate import DraftGate
from taps.decode.policies.taps import TapsPolicy

from test_policies_taps import V, hf_greedy, scorer, tiny_drafter, tiny_target


def test_backoff_doubles_on_losing_rounds_and_resets_on_a_win():
    gate = DraftGate(max_skip=4, smoothing=1.0)  # no smoothing: each verdict is the last round's
    pattern = []

    def run_round(ratio):
        drafted = gate.wants_draft()
        pattern.append("D" if drafted else ".")
        if drafted:
            gate.record(ratio)

    run_round(0.5)  # skip 1
    run_round(2.0)
    run_round(0.5)  # the probe loses: skip 2
    run_round(2.0), run_round(2.0)
    run_round(0.5)  # skip 4
    for _ in range(4):
        run_round(2.0)
    run_round(0.5)  # capped at 4
    for _ in range(4):
        run_round(2.0)
    run_round(1.0)  # break-even counts as a win: backoff back to 1
    run_round(0.5)
    run_round(2.0)
    run_round(2.0)
    assert "".join(pattern) == "D.D..D....D....DD.D"
    gate.reset()
    assert gate.skip_left == 0 and gate.backoff == 1 and gate.log_ratio == 0.0 and gate.wants_draft()


def test_smoothing_keeps_one_bad_round_from_closing_the_gate():
    gate = DraftGate(smoothing=0.5)
    for _ in range(5):
        gate.record(1.5)
    gate.record(0.8)  # mean log ratio stays positive
    assert gate.wants_draft()
    gate.record(0.5)
    gate.record(0.5)
    assert not gate.wants_draft()


@pytest.mark.parametrize("kwargs, name", [(dict(max_skip=0), "max_skip"), (dict(smoothing=0.0), "smoothing"),
                                          (dict(smoothing=1.5), "smoothing")])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DraftGate(**kwargs)


def star(reaches):
    """Pool of a root and ``len(reaches)`` depth-1 children with those reaches: ``(tree, log_reach)``."""
    from taps_kernels import Tree

    n = len(reaches)
    tree = Tree(torch.arange(n + 1, dtype=torch.int64).view(1, -1), torch.tensor([[-1] + [0] * n], dtype=torch.int32),
                torch.tensor([[0] + [1] * n], dtype=torch.int32), torch.tensor([n + 1], dtype=torch.int32))
    return tree, torch.tensor([[0.0] + [math.log(r) for r in reaches]])


def test_verdict_uses_the_latency_table():
    """A tree wins iff expected tokens / (t0 + overhead + latency[n]) >= 1 / (latency[0] + context)."""
    pol = make("taps", True, slope=0.01)  # latency[n] = 0.05 + 0.01 n, t0 0.022, context 0.002
    pol.bind(tiny_target(0), tiny_drafter(0), torch.device("cpu"))
    # plain round 0.052 s; both nodes are kept (reach > 0.01 / 0.052); the gate keeps smoothing x log(ratio)
    for reaches, overhead in (([0.6, 0.5], 0.0), ([0.4, 0.3], 0.0), ([0.6, 0.5], 0.03)):
        pol.gate.reset()
        assert pol._throughput_tree(*star(reaches), overhead).num_nodes.item() == 3
        ratio = (1 + sum(reaches)) * 0.052 / (0.022 + overhead + 0.07)
        assert pol.gate.log_ratio == pytest.approx(pol.gate.smoothing * math.log(ratio), rel=1e-5)


@pytest.mark.parametrize("slope, kept", [(0.001, [0, 1, 2, 3, 4]), (0.01, [0, 1, 2, 3]), (0.03, [0, 1]),
                                         (0.1, [0])])
def test_size_keeps_nodes_whose_reach_pays_for_their_verify_time(slope, kept):
    """Long-run rule: node i is kept iff its reach >= (latency[i] - latency[i-1]) / plain round (0.05 + 0.002 s)."""
    pol = make("ddtree-cost", False, slope=slope)
    pol.bind(tiny_target(0), tiny_drafter(0), torch.device("cpu"))
    reaches = [0.9, 0.45, 0.25, 0.02]  # thresholds 0.0192 (slope 0.001), 0.192 (0.01), 0.577 (0.03), 1.92 (0.1)
    tree = pol._throughput_tree(*star(reaches), 0.0)
    assert tree.tokens[0].tolist() == kept and tree.parents[0, 0].item() == -1


class CountingDrafter:
    """Wraps a drafter and counts draft() calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def draft(self, *args, **kwargs):
        self.calls += 1
        return self.inner.draft(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make(kind, gate, slope, context=0.002, t0=None):
    # A steep table makes most trees lose to a plain round; a costly plain round makes every tree win.
    latency = {"latency": [0.05 + slope * n for n in range(65)], "t0": 0.02 + context if t0 is None else t0,
               "t0_parts": {"draft": 0.02, "context": context}}
    if kind == "taps":
        return TapsPolicy(8, rule="reach", pool_size=24, scorer=scorer(False).to_weights(), top_k=8, latency=latency,
                          gate=gate)
    return CostAwareDDTreePolicy(8, latency=latency, gate=gate)


@pytest.mark.parametrize("kind", ["taps", "ddtree-cost"])
def test_gated_rounds_skip_the_drafter_and_stay_lossless(kind):
    target, drafter = tiny_target(0), CountingDrafter(tiny_drafter(0))
    rng = random.Random(11)
    prompts = [([rng.randrange(V) for _ in range(rng.randint(2, 12))], rng.randint(12, 30)) for _ in range(3)]
    seen_plain = False
    for gate in (True, False):
        dec = SpeculativeDecoder(target, make(kind, gate, slope=1.0), drafter=drafter)
        for prompt, max_new in prompts:
            drafter.calls = 0
            res = dec.generate(prompt, max_new)
            assert res.token_ids == hf_greedy(target, prompt, max_new), (kind, gate, prompt)
            rounds = res.stats.rounds
            assert drafter.calls == sum(r.drafted for r in rounds)
            for r in rounds:
                if not r.drafted:
                    assert r.nodes == 1 and r.accept_len == 1 and "draft" not in r.times
            if gate:
                # every expected rate loses to a plain round under this table: after the first round it backs off
                assert not rounds[1].drafted
                seen_plain = True
            else:
                assert all(r.drafted for r in rounds[:-1])
    assert seen_plain


def test_gate_state_is_reset_between_generations():
    target, drafter = tiny_target(0), tiny_drafter(0)
    pol = make("taps", True, slope=1.0)
    dec = SpeculativeDecoder(target, pol, drafter=drafter)
    dec.generate([1, 2, 3], 20)
    assert pol.gate.backoff > 1
    res = dec.generate([4, 5, 6], 5)
    assert res.stats.rounds[0].drafted


def test_winning_trees_never_gate():
    target, drafter = tiny_target(0), tiny_drafter(0)
    pol = make("taps", True, slope=0.0, context=1.0, t0=0.0)  # a tree costs 0.05 s + overhead, a plain round 1.05
    res = SpeculativeDecoder(target, pol, drafter=drafter).generate([7, 8, 9], 20)
    assert all(r.drafted for r in res.stats.rounds[:-1])


def test_registry_names():
    assert make_policy("taps").gate is None  # made in bind(), from the latency table
    assert make_policy("taps").use_gate and not make_policy("taps-nogate").use_gate
    assert make_policy("ddtree-cost").use_gate and not make_policy("ddtree-cost-nogate").use_gate
    assert not make_policy("taps-fixed:8").use_gate and not make_policy("taps-paper").use_gate
