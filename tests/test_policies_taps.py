"""TAPS policies (taps, taps-paper, taps-fixed, taps-tiny, ddtree-cost): trees within budget and
prefix-closed, built through the registry, and lossless in the decode loop (greedy == HF generate)."""
import random

import pytest
import torch

from taps.decode import SpeculativeDecoder, make_policy
from taps.decode.policies import PolicyError, policy_options
from taps.decode.policies import available_policies
from taps.decode.timing import StageTimer
from taps.decode.policies.taps import taps_policy
from taps.scoring.io import save_scorer
from taps.decode.latency import save_table

from helpers import V, hf_greedy, random_scorer, tiny_drafter, tiny_target

HID = 32  # hidden width of the helpers' tiny drafter

SPECS = ["taps", "taps:8", "taps-nogate:8", "taps-paper", "taps-paper:6", "taps-fixed:5", "taps-tiny:8", "ddtree-cost",
         "ddtree-cost:8", "ddtree-cost-nogate"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Scorer dirs and a synthetic latency table (steep in n, like a CPU); scorers and pool size are passed to
    the policies as options (:func:`policy`), the latency table through the calibration cache's variable."""
    d = tmp_path_factory.mktemp("taps")
    save_scorer(d / "full", random_scorer(False), meta={})
    save_scorer(d / "tiny", random_scorer(True), meta={})
    table = {"latency": [0.05 + 0.004 * n for n in range(129)], "t0": 0.02, "machine": "test", "model": "test"}
    save_table(table, d / "lat.json")
    mp = pytest.MonkeyPatch()
    mp.setenv("TAPS_LATENCY", str(d / "lat.json"))
    yield d
    mp.undo()


def policy(spec, d):
    """``make_policy(spec)`` with the test scorer (full or tiny) and a 24-node pool for the taps* policies."""
    if "scorer" not in policy_options(spec):
        return make_policy(spec)
    return make_policy(spec, scorer=d / ("tiny" if spec.startswith("taps-tiny") else "full"), pool_size=24)


@pytest.fixture(scope="module")
def models():
    return tiny_target(0, layers=4), tiny_drafter(0, target_layers=4)


def test_registered():
    names = available_policies()
    for n in ("taps", "taps-paper", "taps-fixed", "taps-tiny", "ddtree-cost"):
        assert n in names


def check_tree(tree, cap, bonus, b=0):
    n = int(tree.num_nodes[b])
    assert 1 <= n <= cap + 1
    assert int(tree.tokens[b, 0]) == bonus
    par = tree.parents[b, :n].tolist()
    dep = tree.depth[b, :n].tolist()
    assert par[0] == -1 and dep[0] == 0
    for i in range(1, n):  # prefix-closed, topological, depths consistent
        assert 0 <= par[i] < i
        assert dep[i] == dep[par[i]] + 1
    # no duplicate (parent, token) pairs: the walk must be unambiguous
    pairs = [(par[i], int(tree.tokens[b, i])) for i in range(1, n)]
    assert len(pairs) == len(set(pairs))


@pytest.mark.parametrize("spec", SPECS)
def test_trees_within_budget_and_prefix_closed(env, models, spec):
    target, drafter = models
    pol = policy(spec, env)
    pol.bind(target, drafter, torch.device("cpu"))
    cap = int(spec.split(":")[1]) if ":" in spec else 64
    g = torch.Generator().manual_seed(0)
    for r in range(6):
        logits = torch.randn(1, 4, V, generator=g) * (1 + r)
        hidden = torch.randn(1, 4, HID, generator=g)
        bonus = int(torch.randint(0, V, (1,), generator=g))
        sw = StageTimer()
        tree = pol.build(logits, hidden, torch.tensor([bonus]), timer=sw).tree
        check_tree(tree, cap, bonus)
        if spec.startswith("taps-fixed"):
            assert int(tree.num_nodes[0]) == cap + 1
        assert set(sw.times) <= {"pool", "scoring", "selection"}
    # a batch of rows in one call, each row with its own depth cap
    B = 3
    logits = torch.randn(B, 4, V, generator=g) * 3
    hidden = torch.randn(B, 4, HID, generator=g)
    bonus = torch.randint(0, V, (B,), generator=g)
    caps = torch.tensor([4, 1, 0])
    tree = pol.build(logits, hidden, bonus, depth_cap=caps).tree
    tree.validate()
    for b in range(B):
        check_tree(tree, cap, int(bonus[b]), b)
        n = int(tree.num_nodes[b])
        assert int(tree.depth[b, :n].max()) <= int(caps[b])


def test_throughput_rule_shrinks_with_cost(models):
    """Same scorer, steeper latency table -> no more nodes; a flat table -> the cap."""
    target, drafter = models
    sizes = {}
    for name, slope in (("flat", 0.0), ("steep", 1.0)):
        pol = taps_policy(16, rule="reach", pool_size=24, scorer=random_scorer(False).to_weights(), top_k=8,
                          latency={"latency": [0.05 + slope * n for n in range(17)], "t0": 0.0})
        pol.bind(target, drafter, torch.device("cpu"))
        pol.size.overhead.update = lambda s: None  # keep t0 fixed: the test compares tables only
        g = torch.Generator().manual_seed(1)
        tree = pol.build(torch.randn(1, 4, V, generator=g), torch.randn(1, 4, HID, generator=g), torch.tensor([3])).tree
        sizes[name] = int(tree.num_nodes[0]) - 1
    assert sizes["flat"] == 16
    assert sizes["steep"] < sizes["flat"]


@pytest.mark.parametrize("spec", ["taps", "taps-paper", "taps-fixed:8", "taps-tiny", "ddtree-cost"])
def test_lossless_vs_hf_generate(env, models, spec):
    target, drafter = models
    rng = random.Random(5)
    dec = SpeculativeDecoder(target, policy(spec, env), drafter=drafter)
    for _ in range(3):
        prompt = [rng.randrange(V) for _ in range(rng.randint(2, 15))]
        max_new = rng.randint(5, 20)
        res = dec.generate(prompt, max_new)
        assert res.token_ids == hf_greedy(target, prompt, max_new), (spec, prompt)


def test_missing_scorer_dir_is_named(tmp_path, models, monkeypatch):
    missing = tmp_path / "nope"
    target, drafter = models
    with pytest.raises(FileNotFoundError, match="nope"):
        SpeculativeDecoder(target, make_policy("taps-paper", scorer=missing), drafter=drafter)


def test_policy_options_are_explicit():
    # The scorer and the pool size are arguments, not environment switches; policies refuse options they lack.
    assert policy_options("taps:8") == ("scorer", "pool_size", "top_k", "latency") and policy_options("ddtree:8") == ()
    assert make_policy("taps-fixed:4", pool_size=40).draft.pool_size == 40
    assert make_policy("taps-fixed:4").draft.pool_size == 128
    table = {"latency": [0.01, 0.012], "t0": 0.002}
    given = make_policy("taps-lookup:8", top_k=5, latency=table)
    assert given.reach.top_k == 5 and given.size.latency is table
    with pytest.raises(PolicyError, match="ddtree: unknown option.*scorer.*accepts: none"):
        make_policy("ddtree:8", scorer="x")
    with pytest.raises(PolicyError, match="unknown option.*pool_sizes"):
        make_policy("taps", pool_sizes=3)


def test_throughput_rule_drafts_only_its_depth_cap(env):
    """``taps`` projects at most DEFAULT_MAX_DEPTH positions of a 15-position drafter (all of them first, then as
    deep as its trees: ``DraftPool.follow_trees``), ``taps-fixed`` all 15 every time; output stays equal to HF
    generate."""
    from taps.decode.policies.taps import DEFAULT_MAX_DEPTH

    target, drafter = tiny_target(0, layers=4), tiny_drafter(0, target_layers=4, block_size=16)
    asked = []
    draft = drafter.draft

    def spy(*a, num_positions=None, **k):
        asked.append(num_positions)
        return draft(*a, num_positions=num_positions, **k)

    drafter.draft = spy
    rng = random.Random(7)
    scorer = random_scorer(False, max_depth=15).to_weights()
    for spec, want in (("taps", DEFAULT_MAX_DEPTH), ("taps-fixed:8", 15)):
        asked.clear()
        dec = SpeculativeDecoder(target, make_policy(spec, scorer=scorer, pool_size=24), drafter=drafter)
        prompt = [rng.randrange(V) for _ in range(9)]
        assert dec.generate(prompt, 24).token_ids == hf_greedy(target, prompt, 24), spec
        assert asked and asked[0] == want == max(asked), (spec, asked)
        assert (len(set(asked)) > 1) == (spec == "taps"), (spec, asked)
    assert taps_policy(8, max_depth=None).draft_positions(15) == 15
    with pytest.raises(PolicyError, match="max_depth.*received 0"):
        taps_policy(8, max_depth=0)
