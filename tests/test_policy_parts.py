"""Policies composed from parts (taps.decode.policies.composed): what the loop asks of each registered policy
follows from its parts, no policy class sits deeper than one level under TreePolicy, and a new combination of
parts is a policy without a new class."""
import pytest
import torch

from helpers import V
from taps.decode import make_policy
from taps.decode.policies import TreePolicy, available_policies, policy_params
from taps.decode.policies.composed import ComposedPolicy
from taps.decode.policies.reach import MarginalReach
from taps.decode.policies.sizing import ThroughputSize, TopReach, UtilitySize
from taps.decode.policies.sources import DraftPool, LookupChain

# spec: (uses_drafter, handles_draft_vocab, wants_history, chain_trees, max_tree_depth, tree_width), with a
# 15-position drafter for the policies that draft and none for the others
CAPABILITIES = {
    "ar": (False, False, False, True, 0, 1),
    "dflash": (True, True, False, True, 15, 16),
    "ddtree:4": (True, True, False, False, 15, 5),
    "ddtree-cost:16": (True, True, False, False, 15, 17),
    "ddtree-cost-nogate": (True, True, False, False, 15, 65),
    "lookup:5": (False, False, True, True, 5, 6),
    "lookup-cost:5": (False, False, True, True, 5, 6),
    "lookup-cost-sibling:5": (False, False, True, False, 5, 7),  # the chain and its sibling: trees, K + 1 nodes
    "taps:16": (True, True, False, False, 8, 17),
    "taps-nogate": (True, True, False, False, 8, 65),
    "taps-tiny:12": (True, True, False, False, 8, 13),
    "taps-fixed:8": (True, True, False, False, 15, 9),
    "taps-paper": (True, True, False, False, 15, 65),
    "taps-lookup:16": (True, True, True, False, 10, 17),
    "taps-lookup-sibling:16": (True, True, True, False, 10, 17),
}


@pytest.mark.parametrize("spec", sorted(CAPABILITIES))
def test_capabilities_follow_from_the_parts(spec):
    p = make_policy(spec)
    positions = 15 if p.uses_drafter else 0
    got = (p.uses_drafter, p.handles_draft_vocab, p.wants_history, p.chain_trees, p.max_tree_depth(positions),
           p.tree_width(positions))
    assert got == CAPABILITIES[spec]


def test_every_registered_name_is_covered_and_shallow():
    covered = {s.partition(":")[0] for s in CAPABILITIES}
    for name, params in policy_params().items():
        assert name in covered, name
        p = make_policy(name + (":4" if params == "N" else ""))
        # the class itself, TreePolicy, object: parts instead of a chain of base classes
        assert type(p).__mro__[1:] == (TreePolicy, object), (name, type(p).__mro__)
    assert set(available_policies()) == set(policy_params())


def test_the_parts_of_the_costed_policies():
    taps = make_policy("taps")
    assert isinstance(taps.size, ThroughputSize) and taps.use_gate and taps.lookup is None
    assert taps.draft.max_depth == 8 and type(taps.reach).__name__ == "ScorerReach"
    cost = make_policy("ddtree-cost:16")
    assert isinstance(cost.reach, MarginalReach) and cost.draft.top_k == 16 and cost.draft.pool_size == 16
    lookup = make_policy("lookup-cost")
    assert lookup.draft is None and isinstance(lookup.lookup, LookupChain) and not lookup.use_gate
    assert isinstance(make_policy("taps-paper").size, UtilitySize)
    assert type(make_policy("taps-fixed:4").size) is TopReach


def test_a_new_combination_needs_no_new_class():
    """The whole pool of a DDTree budget, as parts (pool of B nodes, top-B by marginal reach), is ``ddtree:B``."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, V, generator=g) * 2
    bonus = torch.tensor([5, 6, 7])
    parts = ComposedPolicy(TopReach(6), draft=DraftPool(6, top_k=6))
    parts.bind(None, None, torch.device("cpu"))
    for cap in (None, torch.tensor([4, 1, 0])):
        got = parts.build(logits, None, bonus, depth_cap=cap).tree
        want = make_policy("ddtree:6").build(logits, None, bonus, depth_cap=cap).tree
        for f in ("tokens", "parents", "depth", "num_nodes"):
            assert torch.equal(getattr(got, f), getattr(want, f)), f


def test_the_gate_needs_the_throughput_rule():
    with pytest.raises(ValueError, match="gate"):
        ComposedPolicy(TopReach(4), draft=DraftPool(4), gate=True)
    with pytest.raises(RuntimeError, match="bind"):
        ComposedPolicy(TopReach(4), draft=DraftPool(4)).build(torch.zeros(1, 2, V), None, torch.tensor([1]))


@pytest.mark.parametrize("spec,follows", [("taps", True), ("taps-nogate", True), ("taps-tiny", True),
                                          ("taps-lookup", True), ("taps-fixed:4", False), ("taps-paper", False),
                                          ("ddtree-cost", False)])
def test_the_throughput_rule_pools_follow_their_trees(spec, follows):
    assert make_policy(spec).draft.follow_trees == follows


def test_round_positions_follow_the_last_drafted_round():
    """The largest tree of the last drafted round (selected nodes: a bound of its depth) plus the headroom,
    within the pool's cap (no running rows: unchanged); a pool that does not follow its trees projects its cap."""
    from taps.decode.policies.sources import DEPTH_HEADROOM

    pool = DraftPool(16, max_depth=8, follow_trees=True)
    assert pool.round_positions(7) == 7 and pool.round_positions(12) == 8
    for sizes, want in (([1, 3], 3 + DEPTH_HEADROOM), ([0], DEPTH_HEADROOM), ([9, 0], 7), ([], 7)):
        pool.observe_sizes(sizes)
        assert pool.round_positions(7) == want
    pool.reset()
    assert pool.round_positions(7) == 7
    fixed = DraftPool(16, max_depth=8)
    fixed.observe_sizes([1])
    assert fixed.round_positions(7) == 7
