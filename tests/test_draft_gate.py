"""Draft gating (taps.decode.policies.gate): the backoff schedule, and in the decode loop: skipped rounds
run no drafter, verify the root alone, keep the output identical to HF generate, and carry the estimate from one
generation to the next."""
import math
import random

import pytest
import torch

import taps_kernels

from taps.decode import SpeculativeDecoder, make_policy
from taps.decode.policies.ddtree_cost import cost_aware_ddtree_policy
from taps.decode.policies.gate import DraftGate
from taps.decode.policies.taps import taps_policy

from helpers import V, hf_greedy, random_scorer, tiny_drafter, tiny_target


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


def decide(pol, reaches, overhead=0.0):
    """One drafted tree of the policy's rule over a star pool, and the gate's record of it (as the loop does
    after the round's read). Returns the kept tokens."""
    tree, log_reach = star(reaches)
    _, built = pol.size.select(tree, log_reach, None)
    pol.size.overhead.value = overhead
    pol.observe(built.expected.tolist(), built.sizes.tolist(), {})
    n = int(built.tree.num_nodes[0])
    return built.tree.tokens[0, :n].tolist(), built


def test_verdict_uses_the_latency_table():
    """A tree wins iff expected tokens / (t0 + overhead + latency[n]) >= 1 / latency[0] (a plain round keeps its
    context features: the drafted round's t0 pays their projection)."""
    pol = make("taps", True, slope=0.01)  # latency[n] = 0.05 + 0.01 n, t0 0.022, context 0.002
    pol.bind(tiny_target(0), tiny_drafter(0), torch.device("cpu"))
    # plain round 0.05 s; both nodes are kept (reach > 0.01 / 0.05); the gate keeps smoothing x log(ratio)
    for reaches, overhead in (([0.6, 0.5], 0.0), ([0.4, 0.3], 0.0), ([0.6, 0.5], 0.03)):
        pol.gate.reset()
        kept, built = decide(pol, reaches, overhead)
        assert len(kept) == 3 and built.expected.item() == pytest.approx(1 + sum(reaches), rel=1e-6)
        ratio = (1 + sum(reaches)) * 0.05 / (0.022 + overhead + 0.07)
        assert pol.gate.log_ratio == pytest.approx(pol.gate.smoothing * math.log(ratio), rel=1e-5)


def test_verdict_weighs_the_lookup_round_of_a_policy_that_looks_up():
    """taps-lookup's gated rounds verify the chain and its sibling alone: its drafted trees are weighed against the
    best of those rounds (the first k of the chain nodes, reach ``q_n ** (j + 1)``, and the sibling, reach ``s_n``),
    not against a plain round."""
    from taps.decode.policies.lookup import taps_lookup_policy

    latency = {"latency": [0.05 + 0.01 * n for n in range(65)], "t0": 0.022,
               "t0_parts": {"draft": 0.02, "context": 0.002}}
    pol = taps_lookup_policy(8, scorer=random_scorer(False).to_weights(), top_k=8, latency=latency, sibling=True)
    pol.bind(tiny_target(0), tiny_drafter(0), torch.device("cpu"))
    acc = pol.lookup.acceptance
    acc.success[2], acc.failure[2] = 9.0, 1.0  # q_2 = 0.9
    pol.lookup.sibling_acceptance.success[2], pol.lookup.sibling_acceptance.failure[2] = 7.0, 3.0  # s_2 = 0.7
    K = pol.lookup.num_tokens

    def best(reach):  # the best first k of the undrafted round's nodes by reach
        reach = sorted(reach, reverse=True)
        return max((1 + sum(reach[:k])) / (0.05 + 0.01 * k) for k in range(len(reach) + 1))

    drafted = (1 + 0.6 + 0.5) / (0.022 + 0.07)
    chain4 = [0.9 ** (j + 1) for j in range(4)]
    for aux, undrafted in (([0, 0, 0, -1, 0] + [0] * K, 1 / 0.05),  # no match: the plain round is the alternative
                           ([2, 4, 0, -1, 0] + [5, 6, 7, 8] + [0] * (K - 4), best(chain4)),  # 4 tokens, 2-token match
                           ([2, 4, 0, 9, 0] + [5, 6, 7, 8] + [0] * (K - 4), best(chain4 + [0.7]))):  # and a sibling
        pol.gate.reset()
        pol.observe_rows({0: None}, {0: aux})
        kept, _ = decide(pol, [0.6, 0.5])
        assert len(kept) == 3
        assert pol.gate.log_ratio == pytest.approx(pol.gate.smoothing * math.log(drafted / undrafted), rel=1e-5)
    assert best(chain4 + [0.7]) > best(chain4)  # the sibling counts
    assert drafted * 0.05 > 1 > drafted / undrafted  # wins against a plain round, loses to the chain alone


@pytest.mark.parametrize("slope, kept", [(0.001, [0, 1, 2, 3, 4]), (0.01, [0, 1, 2, 3]), (0.03, [0, 1]),
                                         (0.1, [0])])
def test_size_keeps_nodes_whose_reach_pays_for_their_verify_time(slope, kept):
    """Long-run rule: node i is kept iff its reach >= (latency[i] - latency[i-1]) / plain round (0.05 s)."""
    pol = make("ddtree-cost", False, slope=slope)
    pol.bind(tiny_target(0), tiny_drafter(0), torch.device("cpu"))
    reaches = [0.9, 0.45, 0.25, 0.03]  # thresholds 0.02 (slope 0.001), 0.2 (0.01), 0.6 (0.03), 2 (0.1)
    tokens, built = decide(pol, reaches)
    assert tokens == kept and built.tree.parents[0, 0].item() == -1
    assert built.tree.tokens.shape[1] == 9  # static width: max_nodes + 1


def _joint(lr, table, plain_s, rows, max_nodes):
    """The library's joint rule on star trees (every node a child of the root: any reach is prefix-closed)."""
    B, N = lr.shape
    parents = torch.zeros(B, N, dtype=torch.int32)
    parents[:, 0] = -1
    depth = torch.ones(B, N, dtype=torch.int32)
    depth[:, 0] = 0
    tree = taps_kernels.Tree(torch.zeros(B, N, dtype=torch.int64), parents, depth, torch.full((B,), N, dtype=torch.int32))
    sel = taps_kernels.select_subtree(tree, lr, max_nodes, rule=taps_kernels.ThroughputRule(table, plain_s, rows))
    return sel.num_selected.long(), sel.expected, int(sel.num_selected.sum())


def test_joint_rule_gives_nodes_to_the_row_whose_reach_pays():
    """Two rows decided together: nodes are taken across rows in order of reach while each pays for the
    verify time it adds at the batch's total node count (plain-round rate of 2 rows)."""
    from taps.decode.policies.gate import batch_table

    latency = {"latency": [0.05 + 0.01 * n for n in range(9)], "t0_parts": {"context": 0.0}}
    table = batch_table(latency, 2, 16)  # no measured 2-row table: latency[1 + n], extended linearly
    assert table[0].item() == pytest.approx(0.06) and table[16].item() == pytest.approx(0.05 + 0.01 * 17)
    # threshold per node: 2 rows * 0.01 s / 0.06 s = 0.333
    lr = torch.log(torch.tensor([[1.0, 0.9, 0.5, 0.3, 0.1], [1.0, 0.6, 0.35, 0.2, 0.0]]))
    sizes, expected, total = _joint(lr, table, 0.06, rows=2, max_nodes=8)
    assert sizes.tolist() == [2, 2] and total == 4
    assert expected.tolist() == pytest.approx([2.4, 1.95])
    # with one row the joint rule is the one-row rule: argmax_n sum of the n best reaches - (T[n] - T[0]) / t_plain
    one = batch_table(latency, 1, 8)
    sizes1, _, _ = _joint(lr[:1], one, 0.05, rows=1, max_nodes=8)
    r = lr[0, 1:].exp().double().sort(descending=True).values
    gain = torch.cat([torch.zeros(1, dtype=torch.float64), r.cumsum(0)]) - (one[:5] - one[0]) / 0.05
    assert sizes1.tolist() == [int(gain.argmax())] == [3]  # 0.9, 0.5, 0.3 pay for 0.01 s / 0.05 s = 0.2 each


def test_measured_batch_table_is_used():
    from taps.decode.policies.gate import batch_table

    latency = {"latency": [0.05, 0.06, 0.07], "batch_latency": {"2": [0.08, 0.085, 0.09]}}
    assert batch_table(latency, 2, 4).tolist() == pytest.approx([0.08, 0.085, 0.09, 0.095, 0.1])
    assert batch_table(latency, 3, 1).tolist() == pytest.approx([0.07, 0.08])  # fallback: total rows


def test_extension_past_the_table_uses_its_mean_slope():
    # A measured table that ends flat must not make the nodes past its end free: 16 rows of 64 low-reach
    # nodes were all kept when the extension reused the last (zero) step.
    from taps.decode.policies.gate import batch_table

    latency = {"latency": [0.05 + 0.004 * n for n in range(64)] + [0.05 + 0.004 * 63]}
    table = batch_table(latency, 16, 16 * 64)
    assert table[200].item() == pytest.approx(0.05 + 0.004 * 63 + (200 + 15 - 64) * (0.004 * 63 / 64))
    lr = torch.full((16, 65), float(torch.log(torch.tensor(0.05))))
    lr[:, 0] = 0.0
    sizes, _, total = _joint(lr, table, 0.05 + 0.004 * 15, rows=16, max_nodes=64)
    assert total < 16 * 64 and sizes.max().item() < 64


class CountingDrafter:
    """Wraps a drafter and counts draft() calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def draft(self, *args, **kwargs):
        self.calls += 1
        return self.inner.draft(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make(kind, gate, slope, context=0.002, t0=None, step=0.05):
    # A steep table makes most trees lose to a plain round; a costly plain round makes every tree win.
    latency = {"latency": [step + slope * n for n in range(65)], "t0": 0.02 + context if t0 is None else t0,
               "t0_parts": {"draft": 0.02, "context": context}}
    if kind == "taps":
        return taps_policy(8, rule="reach", pool_size=24, scorer=random_scorer(False).to_weights(), top_k=8, latency=latency,
                           gate=gate)
    return cost_aware_ddtree_policy(8, latency=latency, gate=gate)


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
            # every drafted tree is verified, except the one built in the round that ended the generation
            assert drafter.calls - sum(r.drafted for r in rounds) in (0, 1)
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


def test_gate_estimate_carries_across_generations():
    target, drafter = tiny_target(0), tiny_drafter(0)
    pol = make("taps", True, slope=1.0)
    dec = SpeculativeDecoder(target, pol, drafter=drafter)
    dec.generate([1, 2, 3], 20)
    backoff, estimate = pol.gate.backoff, pol.gate.log_ratio
    assert backoff >= 4 and estimate < 0
    res = dec.generate([4, 5, 6], 8)
    rounds = res.stats.rounds
    # the first round probes; its loss skips the carried backoff (a fresh gate would have probed again at round 2)
    assert rounds[0].drafted and not any(r.drafted for r in rounds[1:4])
    assert res.token_ids == hf_greedy(target, [4, 5, 6], 8)
    gate = DraftGate()
    gate.backoff, gate.log_ratio, gate.skip_left = 8, -1.0, 3
    gate.restart()
    assert (gate.skip_left, gate.backoff, gate.log_ratio) == (0, 8, -1.0) and gate.wants_draft()


def test_winning_trees_never_gate():
    target, drafter = tiny_target(0), tiny_drafter(0)
    # a tree costs 1 s + its overhead, a plain round 1 s: every tree with some reach wins
    pol = make("taps", True, slope=0.0, t0=0.0, step=1.0)
    res = SpeculativeDecoder(target, pol, drafter=drafter).generate([7, 8, 9], 20)
    assert all(r.drafted for r in res.stats.rounds[:-1])


def test_registry_names():
    assert make_policy("taps").gate is None  # made in bind(), from the latency table
    assert make_policy("taps").use_gate and not make_policy("taps-nogate").use_gate
    assert make_policy("ddtree-cost").use_gate and not make_policy("ddtree-cost-nogate").use_gate
    assert not make_policy("taps-fixed:8").use_gate and not make_policy("taps-paper").use_gate


#: A table of a 4-position drafter with its draft time by positions.
POSITIONS_TABLE = {"latency": [0.05 + 0.01 * n for n in range(65)], "t0": 0.045,
                   "t0_parts": {"draft": 0.04, "context": 0.005, "draft_by_positions": [0.01, 0.02, 0.03, 0.04]}}


def test_round_cost_is_the_draft_at_the_policy_depth():
    """A depth-capped TAPS policy costs a drafted round at the positions it projects; DDTree-cost at all."""
    target, drafter = tiny_target(0), tiny_drafter(0)  # block 5: 4 draft positions
    latency = POSITIONS_TABLE
    capped = taps_policy(8, rule="reach", pool_size=24, scorer=random_scorer(False).to_weights(), top_k=8,
                         latency=latency, max_depth=2)
    capped.bind(target, drafter, "cpu")
    assert capped.size.t0 == pytest.approx(0.02 + 0.005)
    full = cost_aware_ddtree_policy(8, latency=latency)
    full.bind(target, drafter, "cpu")
    assert full.size.t0 == pytest.approx(0.045)
    old = {k: v for k, v in latency.items() if k != "t0_parts"}  # a table without per-position times: its t0
    capped = taps_policy(8, rule="reach", pool_size=24, scorer=random_scorer(False).to_weights(), top_k=8,
                         latency=old, max_depth=2)
    capped.bind(target, drafter, "cpu")
    assert capped.size.t0 == pytest.approx(0.045)


def test_round_cost_follows_the_positions_each_round_projects():
    """A pool that follows its trees projects fewer positions after small trees, and the gate weighs that round's
    draft at those positions."""
    target, drafter = tiny_target(0), tiny_drafter(0)  # block 5: 4 draft positions
    latency = POSITIONS_TABLE
    pol = taps_policy(8, rule="reach", pool_size=24, scorer=random_scorer(False).to_weights(), top_k=8,
                      latency=latency, max_depth=8)
    pol.bind(target, drafter, "cpu")
    assert pol.draft_positions(4) == 4 and pol.size.t0 == pytest.approx(0.04 + 0.005)
    pol.observe([1.5], [0], {})  # a root-only tree: the next draft projects the headroom's 2 positions
    assert pol.draft_positions(4) == 2 and pol.size.t0 == pytest.approx(0.02 + 0.005)
    pol.reset()
    assert pol.draft_positions(4) == 4


def test_the_loop_drafts_the_positions_the_policy_asks_for(monkeypatch):
    """Each draft after the first projects the previous drafted tree's size plus the headroom (nodes verified
    minus the root), capped at the drafter's positions; the output is the target's own."""
    from taps.decode.policies.sources import DEPTH_HEADROOM

    target, drafter = tiny_target(3), tiny_drafter(3)
    asked = []
    real = drafter.draft

    def recording(*args, num_positions=None, **kwargs):
        asked.append(num_positions)
        return real(*args, num_positions=num_positions, **kwargs)

    monkeypatch.setattr(drafter, "draft", recording)
    pol = make("taps", False, slope=0.03)  # dear nodes: trees of 0-2 nodes, drafts of 2-4 positions
    prompt = [5, 9, 2, 44, 17, 3, 5, 9, 2]
    res = SpeculativeDecoder(target, pol, drafter=drafter).generate(prompt, 40)
    assert res.token_ids == hf_greedy(target, prompt, 40)
    D = drafter.config.block_size - 1
    nodes = [r.nodes for r in res.stats.rounds]
    # the first draft (admission) projects every position; draft k builds round k's tree after round k-1 verified
    # one of nodes[k-1] (no gate: every round drafts; the first half of the rounds, far from the length limit,
    # whose depth cap would cut a tree below its selected size)
    half = len(nodes) // 2
    assert asked[0] == D and all(r.drafted for r in res.stats.rounds[:half])
    assert asked[1:half + 1] == [min(D, n - 1 + DEPTH_HEADROOM) for n in nodes[:half]]
    assert len(set(asked)) > 1
