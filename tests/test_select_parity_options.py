"""The utility rule's parity options (docs/DESIGN.md, "Upstream parity"): max_leaves, fill_below_threshold,
max_children, min_nodes of select_subtree's UtilityRule, and UtilityRule.paper().

Expected sets come from `expected_kept`, the greedy procedure written again from its definition with plain
sets (ancestor paths, sibling positions counted by scanning); it never calls the reference. Defaults are
checked against the C++ backend (which predates the options) and against option values that cannot bind."""
import math
import random

import pytest
import torch

import taps_kernels as tk
from helpers import make_tree, random_tree
from taps_kernels import backend
from taps_kernels.backend import BackendUnavailable

torch.set_num_threads(1)
CPU = torch.device("cpu")
HAVE_CPP = not backend.unavailable_reason("cpp", CPU, "select_subtree")
HAVE_TRITON = not backend.unavailable_reason("triton", CPU, "select_subtree")
OPTIONS = ("max_leaves", "fill_below_threshold", "max_children", "min_nodes")
NON_DEFAULT = dict(max_leaves=2, fill_below_threshold=True, max_children=1, min_nodes=1)


def utilities(par, lr_row, lambda_node=1.0, lambda_depth=0.002):
    """u(v) = exp(log_reach(v)) / (lambda_node + lambda_depth * depth(v)), float64 from the float32 reach."""
    u = {}
    for v in range(1, len(par)):
        d, a = 0, v
        while a > 0:
            d, a = d + 1, par[a]
        u[v] = math.exp(float(lr_row[v])) / (lambda_node + lambda_depth * d)
    return u


def expected_kept(par, u, max_nodes, min_utility=0.0, max_leaves=None, fill_below_threshold=False,
                  max_children=None, min_nodes=0):
    def path(v):  # v and its non-root ancestors
        out = set()
        while v > 0:
            out.add(v)
            v = par[v]
        return out

    def sibling_position(v):
        return sum(1 for w in range(1, v) if par[w] == par[v])

    ranked = sorted((v for v in range(1, len(par)) if max_children is None or sibling_position(v) < max_children),
                    key=lambda v: (-u[v], v))
    stop = next((k for k, v in enumerate(ranked) if u[v] < min_utility), len(ranked))
    main = ranked[:stop] if stop or not fill_below_threshold else ranked
    kept, leaves = set(), 0
    for v in main:
        if len(kept) == max_nodes or (max_leaves is not None and leaves == max_leaves):
            break
        grown = kept | path(v)
        if len(kept) < len(grown) <= max_nodes:
            kept, leaves = grown, leaves + 1
    for v in ranked:
        if len(kept) >= min(min_nodes, max_nodes):
            break
        grown = kept | path(v)
        if len(grown) <= max_nodes:
            kept = grown
    return sorted(kept)


def rows_of(tree):
    return [[int(p) for p in tree.parents[b, :int(tree.num_nodes[b])]] for b in range(tree.parents.shape[0])]


PAPER = dict(max_leaves=64, fill_below_threshold=True, max_children=16, min_nodes=4)


def check_selection(tree, lr, max_nodes, backend_name=None, lambda_node=1.0, lambda_depth=0.002, paper=False, **kw):
    """select_subtree against expected_kept on every row; returns the Selection. ``paper``: the rule is
    ``UtilityRule.paper(**kw)`` (its four values, explicit ones winning), else ``UtilityRule(**kw)``."""
    make = tk.UtilityRule.paper if paper else tk.UtilityRule
    sel = tk.select_subtree(tree, lr, max_nodes, rule=make(lambda_node=lambda_node, lambda_depth=lambda_depth, **kw),
                            backend=backend_name)
    opts = {k: v for k, v in kw.items() if k in OPTIONS}
    if paper:
        opts = {**PAPER, **opts}
    for b, par in enumerate(rows_of(tree)):
        want = expected_kept(par, utilities(par, lr[b], lambda_node, lambda_depth), max_nodes,
                             kw.get("min_utility", 0.0), **opts)
        n = int(sel.num_selected[b])
        assert sel.pool_index[b, 1:1 + n].tolist() == want, (b, par, kw)
        assert int(sel.pool_index[b, 0]) == 0 and (sel.pool_index[b, 1 + n:] == -1).all()
        # the re-indexed tree is the kept pool nodes, prefix-closed, in pool order
        for r in range(1, n + 1):
            p = int(sel.tree.parents[b, r])
            assert 0 <= p < r and int(sel.pool_index[b, p]) == par[want[r - 1]]
    return sel


def quantised_reach(rng, tree, levels=(0.0, -0.5, -1.0, -2.0, float("-inf")), monotone=False):
    """Few distinct log-reach values: forced utility ties (same value, same depth); -inf ties at u = 0."""
    B, N = tree.parents.shape
    lr = torch.full((B, N), float("-inf"))
    for b, par in enumerate(rows_of(tree)):
        lr[b, 0] = 0.0
        for v in range(1, len(par)):
            x = rng.choice(levels)
            lr[b, v] = min(x, float(lr[b, par[v]])) if monotone else x
    return lr


def random_options(rng, n):
    """One option set: each option on or off at random, values that bind on trees of ``n`` nodes."""
    kw = {}
    if rng.random() < 0.5:
        kw["max_leaves"] = rng.randint(1, 4)
    if rng.random() < 0.5:
        kw["fill_below_threshold"] = True
    if rng.random() < 0.5:
        kw["max_children"] = rng.randint(1, 3)
    if rng.random() < 0.5:
        kw["min_nodes"] = rng.randint(0, n + 1)
    return kw


def pick_threshold(rng, u):
    """A threshold below every utility, inside their range (some pass), or above all (none pass: fill's case)."""
    vals = sorted(u.values()) or [0.0]
    return rng.choice([-math.inf, 0.0, rng.choice(vals), max(vals) * 1.5 + 1e-3])


# --------------------------------------------------------------------------------------- hand-made cases
# 0 -> 1 -> 3, 0 -> 1 -> 4, 0 -> 2 -> 5, 0 -> 2 -> 6 (node 6 is 2's second child)
PAR = [-1, 0, 0, 1, 1, 2, 2]


def _hand(log_reach, max_nodes, **kw):
    tree = make_tree([(PAR, list(range(7)))], 7)
    lr = torch.tensor([log_reach], dtype=torch.float32)
    return check_selection(tree, lr, max_nodes, **kw).pool_index[0, 1:].tolist()


def test_max_leaves_counts_taken_candidates_not_final_leaves():
    lr = [0.0, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6]  # utility order 1, 2, 3, 4, 5, 6: parents first
    # two candidates taken (1, 2): two nodes, although max_nodes allows 6 and the tree has two leaves
    assert _hand(lr, 6, max_leaves=2)[:2] == [1, 2]
    assert tk.select_subtree(make_tree([(PAR, list(range(7)))], 7), torch.tensor([lr]), 6,
                             rule=tk.UtilityRule(max_leaves=2)).num_selected.tolist() == [2]
    # node 1 taken first stays counted after node 3 makes it an inner node: 1, 3 -> two leaves used, tree of 2
    lr2 = [0.0, -0.1, -0.9, -0.2, -0.8, -0.95, -0.99]
    assert _hand(lr2, 6, max_leaves=2)[:2] == [1, 3]
    # a deep first candidate brings its ancestor and counts once: 5 (with 2), then 1
    lr3 = [0.0, -0.3, -0.9, -0.5, -0.6, -0.1, -0.7]
    assert _hand(lr3, 6, max_leaves=2)[:3] == [1, 2, 5]
    # without the cap the same reach fills the budget
    assert _hand(lr3, 6)[:6] == [1, 2, 3, 4, 5, 6]


def test_fill_below_threshold_fills_only_when_nothing_passes():
    lr = [0.0, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    assert _hand(lr, 3, min_utility=2.0)[0] == -1  # nothing passes: root only (the rule as described)
    assert _hand(lr, 3, min_utility=2.0, fill_below_threshold=True)[:3] == [1, 2, 3]
    # one node passes: the threshold still stops the pass, fill does not apply
    assert _hand(lr, 3, min_utility=0.85, fill_below_threshold=True)[:2] == [1, -1]


def test_max_children_filters_candidates_but_not_ancestors():
    lr = [0.0, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    # one child per parent: candidates 1, 3, 5; node 2 (the root's second child) enters as 5's ancestor
    assert _hand(lr, 2, max_children=1)[:2] == [1, 3]
    assert _hand(lr, 6, max_children=1)[:5] == [1, 2, 3, 5, -1]
    # node 5 (2's first child) ranked high brings its ancestor 2 past the root's cap, as in the authors' code
    lr2 = [0.0, -0.3, -0.6, -0.4, -0.5, -0.1, -0.7]
    assert _hand(lr2, 6, max_children=1)[:4] == [1, 2, 3, 5]


def test_min_nodes_ignores_threshold_and_leaf_cap():
    lr = [0.0, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    assert _hand(lr, 6, min_utility=0.85)[:2] == [1, -1]
    assert _hand(lr, 6, min_utility=0.85, min_nodes=3)[:4] == [1, 2, 3, -1]
    assert _hand(lr, 6, max_leaves=1, min_nodes=4)[:5] == [1, 2, 3, 4, -1]
    # capped by max_nodes, and by the child cap (candidates 1, 3, 5 only; 2 enters as 5's ancestor)
    assert _hand(lr, 2, min_nodes=5)[:2] == [1, 2]
    assert _hand(lr, 6, max_children=1, min_utility=9.0, min_nodes=6)[:5] == [1, 2, 3, 5, -1]


def test_forced_ties_break_by_node_index():
    lr = [0.0, -0.5, -0.5, -0.5, -0.5, -0.5, -0.5]  # depth 1 ties, then depth 2 ties
    assert _hand(lr, 6, max_leaves=3)[:3] == [1, 2, 3]
    assert _hand(lr, 6, max_children=1, max_leaves=2)[:2] == [1, 3]


# --------------------------------------------------------------------------------------- random small pools
@pytest.mark.parametrize("seed", range(6))
def test_random_trees_every_option_alone_and_combined(seed):
    rng = random.Random(100 + seed)
    for _ in range(12):
        n = rng.randint(3, 12)
        tree = random_tree(rng, rng.randint(1, 3), n)
        lr = quantised_reach(rng, tree, monotone=rng.random() < 0.5)
        u0 = utilities(rows_of(tree)[0], lr[0])
        max_nodes = rng.randint(1, n + 1)
        thr = pick_threshold(rng, u0)
        for kw in ({}, dict(max_leaves=rng.randint(1, 3)), dict(fill_below_threshold=True),
                   dict(max_children=rng.randint(1, 2)), dict(min_nodes=rng.randint(1, n)), random_options(rng, n),
                   dict(max_leaves=2, fill_below_threshold=True, max_children=1, min_nodes=rng.randint(0, n))):
            check_selection(tree, lr, max_nodes, min_utility=thr, **kw)


@pytest.mark.parametrize("K,D", [(2, 2), (3, 4), (4, 3), (2, 4)])
def test_real_pools(K, D):
    rng = random.Random(K * 10 + D)
    g = torch.Generator().manual_seed(K * 10 + D)
    for trial in range(6):
        B, V = 2, 9
        pool_size = rng.randint(2, 11)
        logits = torch.randn(B, D, V, generator=g)
        if trial % 2:  # tied logits: tied pool scores, so tied reach and utility
            logits = torch.tensor([0.0, 0.0, 1.0, -1.0])[torch.randint(0, 4, (B, D, V), generator=g)]
        pool = tk.candidate_pool(logits, torch.randint(0, V, (B,), generator=g), top_k=K, pool_size=pool_size)
        u0 = utilities(rows_of(pool.tree)[0], pool.logq[0])
        for lr in (pool.logq, pool.logq + 0.3 * torch.randn(pool.logq.shape, generator=g)):
            lr = torch.where(pool.tree.parents >= 0, lr, pool.logq)  # keep padding -inf and root 0
            lr[:, 0] = 0.0
            for kw in (random_options(rng, pool_size + 1), dict(paper=True), dict(paper=True, max_leaves=2),
                       dict(max_children=1, min_nodes=pool_size)):
                check_selection(pool.tree, lr, rng.randint(1, pool_size + 1), min_utility=pick_threshold(rng, u0),
                                lambda_depth=rng.choice([0.002, 0.3]), **kw)


def test_leaf_bound_and_prefix_closure_properties():
    """Without min_nodes the tree has at most max_leaves leaves; every kept node's parent is kept."""
    rng = random.Random(7)
    for _ in range(40):
        n = rng.randint(3, 12)
        tree = random_tree(rng, 1, n)
        lr = quantised_reach(rng, tree)
        m, cap = rng.randint(1, n), rng.randint(1, 4)
        sel = tk.select_subtree(tree, lr, m, rule=tk.UtilityRule(max_leaves=cap, fill_below_threshold=True,
                                                                 min_utility=rng.choice([0.0, 0.5, 5.0])))
        k = int(sel.num_selected[0])
        par = sel.tree.parents[0, :k + 1].tolist()
        leaves = [r for r in range(1, k + 1) if r not in par]
        assert k <= m and len(leaves) <= cap and all(0 <= p < r for r, p in enumerate(par) if r > 0)


# --------------------------------------------------------------------------------------- defaults unchanged
@pytest.mark.parametrize("seed", range(3))
def test_defaults_and_non_binding_values_keep_the_rule(seed):
    """Default options, explicit defaults and values that cannot bind all give the rule as described; the C++
    backend (which has no options) agrees bit for bit."""
    rng = random.Random(seed)
    for _ in range(10):
        n = rng.randint(3, 12)
        tree = random_tree(rng, 3, n)
        lr = quantised_reach(rng, tree) if rng.random() < 0.5 else torch.where(
            tree.parents >= 0, -torch.rand(tree.parents.shape) * 3, torch.zeros(()))
        lr[:, 0] = 0.0
        m = rng.randint(1, n + 1)
        thr = rng.choice([-math.inf, 0.0, 0.5])
        base = check_selection(tree, lr, m, min_utility=thr)
        same = [dict(max_leaves=None, fill_below_threshold=False, max_children=None, min_nodes=0),
                dict(max_leaves=m), dict(max_children=n), dict(fill_below_threshold=thr <= 0.0)]
        for kw in same:
            sel = tk.select_subtree(tree, lr, m, rule=tk.UtilityRule(min_utility=thr, **kw), backend="reference")
            assert torch.equal(sel.pool_index, base.pool_index) and torch.equal(sel.num_selected, base.num_selected)
        if HAVE_CPP:
            c = tk.select_subtree(tree, lr, m, rule=tk.UtilityRule(min_utility=thr, **same[0]), backend="cpp")
            assert torch.equal(c.pool_index, base.pool_index) and torch.equal(c.num_selected, base.num_selected)


# --------------------------------------------------------------------------------------- the authors' values
def test_paper_values_and_explicit_override():
    assert tk.UtilityRule.paper() == tk.UtilityRule(**PAPER)
    rng = random.Random(3)
    tree = random_tree(rng, 2, 12)
    lr = quantised_reach(rng, tree)
    check_selection(tree, lr, 10, paper=True, min_utility=5.0)
    # explicit values win over the authors', defaults included
    check_selection(tree, lr, 10, paper=True, max_leaves=1, fill_below_threshold=False, min_utility=5.0)
    a = tk.select_subtree(tree, lr, 10, rule=tk.UtilityRule.paper(max_leaves=None, fill_below_threshold=False,
                                                                  max_children=None, min_nodes=0))
    b = tk.select_subtree(tree, lr, 10, rule=tk.UtilityRule())
    assert torch.equal(a.pool_index, b.pool_index)


# --------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("make,exc,words", [
    (lambda: tk.UtilityRule(max_leaves=0), ValueError, r"rule\.max_leaves: expected an int in \[1, .*received 0"),
    (lambda: tk.UtilityRule(max_leaves=2.0), TypeError, "max_leaves"),
    (lambda: tk.UtilityRule(max_leaves=True), TypeError, "max_leaves"),
    (lambda: tk.UtilityRule(max_children=0), ValueError, "max_children"),
    (lambda: tk.UtilityRule(max_children="2"), TypeError, "max_children"),
    (lambda: tk.UtilityRule(min_nodes=-1), ValueError, "min_nodes"),
    (lambda: tk.UtilityRule(min_nodes=1.5), TypeError, "min_nodes"),
    (lambda: tk.UtilityRule(fill_below_threshold=1), TypeError, "fill_below_threshold"),
    (lambda: tk.UtilityRule(fill_below_threshold="yes"), TypeError, "fill_below_threshold"),
    (lambda: tk.UtilityRule.paper(max_leaves=0), ValueError, "max_leaves"),
    (lambda: tk.UtilityRule.paper(maxleaves=3), TypeError, "maxleaves"),
    (lambda: tk.ReachRule(max_leaves=3), TypeError, "max_leaves"),
    (lambda: tk.ReachRule(fill_below_threshold=True), TypeError, "fill_below_threshold"),
    (lambda: tk.ReachRule(max_children=2), TypeError, "max_children"),
    (lambda: tk.ReachRule(min_nodes=2), TypeError, "min_nodes"),
    (lambda: "utility", TypeError, "rule: expected a ReachRule, UtilityRule or ThroughputRule, received str"),
])
def test_bad_options_are_refused_by_name(make, exc, words):
    tree = make_tree([(PAR, list(range(7)))], 7)
    with pytest.raises(exc, match=words):
        tk.select_subtree(tree, torch.zeros(1, 7), 3, rule=make())


def test_reach_rule_accepts_explicit_defaults():
    tree = make_tree([(PAR, list(range(7)))], 7)
    a = tk.select_subtree(tree, torch.zeros(1, 7), 3, rule=tk.ReachRule(latency=None, t0=0.0))
    assert a.num_selected.tolist() == [3]
    assert torch.equal(a.pool_index, tk.select_subtree(tree, torch.zeros(1, 7), 3).pool_index)


# --------------------------------------------------------------------------------------- backend declaration
@pytest.mark.parametrize("name", [n for n, ok in (("cpp", HAVE_CPP), ("triton", HAVE_TRITON)) if ok])
@pytest.mark.parametrize("option", OPTIONS)
def test_explicit_fast_backend_refuses_options_by_name(name, option):
    tree = make_tree([(PAR, list(range(7)))], 7)
    with pytest.raises(BackendUnavailable, match=f"{option}={NON_DEFAULT[option]!r}"):
        tk.select_subtree(tree, torch.zeros(1, 7), 3, rule=tk.UtilityRule(**{option: NON_DEFAULT[option]}),
                          backend=name)
    with pytest.raises(BackendUnavailable, match="max_leaves=64"):
        tk.select_subtree(tree, torch.zeros(1, 7), 3, rule=tk.UtilityRule.paper(), backend=name)
    # default options still run there
    tk.select_subtree(tree, torch.zeros(1, 7), 3, rule=tk.UtilityRule(min_nodes=0), backend=name)


@pytest.mark.skipif(not HAVE_CPP, reason="C++ extension not built")
def test_default_resolves_to_reference_with_the_reason_explained(monkeypatch):
    assert backend.resolve("select_subtree", None, CPU)[0] == "cpp"
    assert backend.resolve("select_subtree", None, CPU, min_nodes=0, max_leaves=None)[0] == "cpp"
    assert backend.resolve("select_subtree", None, CPU, max_leaves=64)[0] == "reference"
    # TAPS_BACKEND cannot force a backend onto a call it does not support
    monkeypatch.setenv("TAPS_BACKEND", "cpp")
    assert backend.resolve("select_subtree", None, CPU, max_children=16)[0] == "reference"
    monkeypatch.delenv("TAPS_BACKEND")
    # explain() evaluates a row at the call context it is given: with an option, the reason is listed
    assert backend.explain_dict("select_subtree")["select_subtree"]["backend"] == "cpp"
    entry = backend.explain_dict("select_subtree", max_leaves=64)["select_subtree"]
    assert entry["backend"] == "reference" and "max_leaves=64" in entry["why"]
    assert "max_leaves=64" in entry["unavailable"]["cpp"]
    text = backend.explain("select_subtree", max_leaves=64)
    assert "select_subtree: reference" in text and "default options only" in text


def test_public_op_runs_the_reference_for_options_on_cpu():
    rng = random.Random(11)
    tree = random_tree(rng, 2, 10)
    lr = quantised_reach(rng, tree)
    rule = tk.UtilityRule(max_leaves=2, min_nodes=3)
    a = tk.select_subtree(tree, lr, 6, rule=rule)
    b = tk.select_subtree(tree, lr, 6, rule=rule, backend="reference")
    assert torch.equal(a.pool_index, b.pool_index) and torch.equal(a.tree.parents, b.tree.parents)
