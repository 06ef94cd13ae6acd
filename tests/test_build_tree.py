"""``taps_kernels.build_tree``: one round's pool, reach, lookup graft and throughput rule in one call.

* The C++ call equals the chain of public ops it replaces (candidate_pool -> score_edges -> lookup_chain ->
  graft_chain -> depth cap -> select_subtree(ThroughputRule)) exactly: trees, pool indices, sizes, expected tokens
  (bit for bit) and the chain columns, on awkward shapes with and without each part.
* The reference (the reference ops chained) gives the same trees and the same expected tokens within float32
  tolerance (its top-K statistics and scorer sum in another order).
* A composed policy builds the same trees in one call as through its parts.
* Bad input is refused with the argument named, before anything runs.
"""
import itertools

import pytest
import torch

import taps_kernels as tk
from taps_kernels import DraftProposal, LookupProposal, ScorerWeights, ThroughputRule

pytestmark = pytest.mark.skipif("cpp" not in tk.available_backends("build_tree", "cpu"),
                                reason="needs the C++ extension")

H, E, VT = 12, 10, 90  # drafter hidden width, target embedding width, target vocabulary


def case(seed, B, D, V, pool_size, top_k, scorer_kind, with_lookup, with_cap, with_vocab, K=6, C=30):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, D, V, generator=g) * 3
    if V > 3:
        logits[0, 0, 1] = float("-inf")  # an impossible token
    vocab_ids = torch.sort(torch.randperm(VT, generator=g)[:V]).values if with_vocab else None
    hidden = torch.randn(B, D, H, generator=g)
    scorer = {"none": None,
              "tiny": ScorerWeights.random(tiny=True, mlp_dim=5, generator=g),
              "full": ScorerWeights.random(embed_dim=E, hidden_dim=H, max_depth=D + 1, token_dim=5, depth_dim=3,
                                           hidden_proj_dim=4, mlp_dim=6, generator=g)}[scorer_kind]
    emb = torch.randn(VT, E, generator=g)
    roots = torch.randint(0, V if vocab_ids is None else VT, (B,), generator=g)
    draft = DraftProposal(logits, top_k, pool_size, hidden if scorer_kind == "full" else None, vocab_ids)
    lookup = None
    if with_lookup:
        # short alphabet: repeats, so chains exist; one row's history is empty
        history = torch.randint(0, 5, (B, C), generator=g)
        lengths = torch.randint(0, C + 1, (B,), generator=g)
        lengths[-1] = 0
        log_q = torch.tensor([0.0, -0.3, -0.9, float("-inf")])
        log_s = torch.tensor([0.0, -0.5, -0.2, -2.0]) if seed != 2 else None  # seed 2: no sibling grafted
        lookup = LookupProposal(history, lengths, K, 3, log_q, log_s)
    cap = torch.randint(0, D + 2, (B,), generator=g) if with_cap else None
    table = torch.cumsum(torch.rand(B * (pool_size + K + 1) + 3, generator=g, dtype=torch.float64) * 1e-3, 0) + 5e-3
    rule = ThroughputRule(table, 6e-3, B)
    return dict(draft=draft, scorer=scorer, token_embeddings=emb if scorer_kind == "full" else None, lookup=lookup,
                depth_cap=cap), roots, rule


def by_parts(roots, max_nodes, rule, draft, scorer, token_embeddings, lookup, depth_cap):
    """The chain of public ops build_tree replaces (what ComposedPolicy's parts run)."""
    if draft is not None:
        pool = tk.candidate_pool(draft.logits, roots, draft.top_k, draft.pool_size, vocab_ids=draft.vocab_ids)
        tree = pool.tree
        log_reach = pool.logq if scorer is None else tk.score_edges(pool, scorer, token_embeddings, draft.hidden)[2]
    else:
        B = roots.shape[0]
        tree = tk.Tree(roots.view(B, 1).clone(), torch.full((B, 1), -1, dtype=torch.int32),
                       torch.zeros(B, 1, dtype=torch.int32), torch.ones(B, dtype=torch.int32))
        log_reach = torch.zeros(B, 1)
    chain_cols = None
    if lookup is not None:
        chain, chain_len, ngram, sibling = tk.lookup_chain(lookup.history, lookup.lengths, lookup.num_tokens,
                                                           lookup.max_ngram)
        depth = torch.arange(1, lookup.num_tokens + 1, dtype=torch.float32)
        tree, log_reach, nodes = tk.graft_chain(tree, log_reach, chain, chain_len,
                                                lookup.log_q[ngram][:, None] * depth[None, :])
        sibling_node = torch.full((tree.tokens.shape[0], 1), -1)
        if lookup.log_s is not None:
            tree, log_reach, sibling_node = tk.graft_chain(tree, log_reach, sibling.clamp(min=0)[:, None],
                                                           (sibling >= 0).long(), lookup.log_s[ngram][:, None])
    if depth_cap is not None:
        log_reach = log_reach.masked_fill(tree.depth.long() > depth_cap[:, None], float("-inf"))
    sel = tk.select_subtree(tree, log_reach, max_nodes, rule=rule)
    if lookup is not None:
        def kept(n):
            return ((n[:, :, None] == sel.pool_index[:, None, :]).any(-1) & (n >= 0)).sum(1, keepdim=True)

        chain_cols = torch.cat([ngram[:, None], chain_len[:, None], kept(nodes), sibling[:, None], kept(sibling_node),
                                chain], 1)
    return sel, chain_cols


def assert_same(got, want_sel, want_chain, exact=True):
    sel = got.selection
    for f in ("tokens", "parents", "depth", "num_nodes"):
        assert torch.equal(getattr(sel.tree, f), getattr(want_sel.tree, f)), f
    assert torch.equal(sel.pool_index, want_sel.pool_index)
    assert torch.equal(sel.num_selected, want_sel.num_selected)
    if exact:
        assert torch.equal(sel.expected, want_sel.expected)
    else:
        torch.testing.assert_close(sel.expected, want_sel.expected, rtol=1e-4, atol=1e-5)
    assert (got.chain is None) == (want_chain is None)
    if want_chain is not None:
        assert torch.equal(got.chain, want_chain)


CASES = list(itertools.product([(1, 1, 7, 3, 2), (3, 5, 50, 23, 8), (2, 4, 13, 40, 13)],
                               ["none", "tiny", "full"], [False, True], [False, True]))


@pytest.mark.parametrize("shape,scorer_kind,with_lookup,with_cap", CASES)
def test_equals_the_chain_of_ops(shape, scorer_kind, with_lookup, with_cap):
    B, D, V, pool_size, top_k = shape
    for seed, with_vocab, max_nodes in ((0, False, 5), (1, True, 17), (2, False, 1)):
        kw, roots, rule = case(seed, B, D, V, pool_size, top_k, scorer_kind, with_lookup, with_cap, with_vocab)
        got = tk.build_tree(roots, max_nodes, rule, **kw)
        assert set(got.seconds) == {"pool", "scoring", "lookup", "selection"}
        assert all(s >= 0 for s in got.seconds.values())
        assert_same(got, *by_parts(roots, max_nodes, rule, **kw))


@pytest.mark.parametrize("with_cap", [False, True])
def test_undrafted_round_is_the_root_and_the_chain(with_cap):
    kw, roots, rule = case(4, 3, 4, 20, 10, 4, "none", True, with_cap, False)
    kw["draft"] = None
    got = tk.build_tree(roots, 6, rule, **kw)
    assert_same(got, *by_parts(roots, 6, rule, **kw))
    assert torch.equal(got.selection.tree.tokens[:, 0], roots)


@pytest.mark.parametrize("scorer_kind", ["none", "tiny", "full"])
def test_reference_gives_the_same_trees(scorer_kind):
    for seed in range(3):
        kw, roots, rule = case(10 + seed, 2, 4, 30, 15, 6, scorer_kind, True, seed == 1, seed == 2)
        got = tk.build_tree(roots, 9, rule, **kw)
        ref = tk.build_tree(roots, 9, rule, backend="reference", **kw)
        assert ref.seconds == {}
        assert_same(got, ref.selection, ref.chain, exact=False)


@pytest.mark.parametrize("spec", ["taps-lookup", "ddtree-cost"])
def test_composed_policy_builds_the_same_tree_in_one_call(spec):
    from taps.decode.policies.ddtree_cost import cost_aware_ddtree_policy
    from taps.decode.policies.lookup import taps_lookup_policy
    from taps.decode.timing import StageTimer

    B = 2
    kw, roots, rule = case(7, B, 5, 40, 30, 8, "full" if spec == "taps-lookup" else "none", spec == "taps-lookup",
                           True, True)
    latency = {"latency": rule.latency.tolist(), "t0": 1e-3}
    if spec == "taps-lookup":
        policy = taps_lookup_policy(max_nodes=12, pool_size=30, latency=latency)
        # a bound ScorerReach's state, without a model to bind it to
        policy.reach.weights, policy.reach.emb, policy.reach.top_k = kw["scorer"], kw["token_embeddings"], 8
        policy.lookup.acceptance.record(2, 3, True)  # rates away from the prior
    else:
        policy = cost_aware_ddtree_policy(12, latency=latency)
    policy.vocab_ids = kw["draft"].vocab_ids
    policy.size.bind(latency)
    policy._bound = True
    history = (kw["lookup"].history, kw["lookup"].lengths) if kw["lookup"] is not None else None
    for drafted in (True, False):
        if not drafted and policy.lookup is None:
            continue
        args = (kw["draft"].logits, kw["draft"].hidden, roots) if drafted else (None, None, roots)
        timer = StageTimer()
        fused = policy.build(*args, kw["depth_cap"], timer, B, history)
        parts = policy._build_by_parts(*args, kw["depth_cap"], StageTimer(), B, history)
        assert "selection" in timer.seconds() and (not drafted or "pool" in timer.seconds())
        for f in ("tokens", "parents", "depth", "num_nodes"):
            assert torch.equal(getattr(fused.tree, f), getattr(parts.tree, f)), f
        assert torch.equal(fused.expected, parts.expected)
        assert torch.equal(fused.sizes, parts.sizes)
        assert (fused.aux is None) == (parts.aux is None)
        assert fused.aux is None or torch.equal(fused.aux, parts.aux)


@pytest.mark.parametrize("mutate,match", [
    (lambda kw, roots: kw.update(draft=DraftProposal(kw["draft"].logits.double(), 4, 10)),
     "draft.logits: expected dtype float32"),
    (lambda kw, roots: kw.update(draft=DraftProposal(kw["draft"].logits[:1], 4, 10)), "draft.logits: expected 3 rows"),
    (lambda kw, roots: kw.update(depth_cap=torch.zeros(2, dtype=torch.int64)), r"depth_cap: expected shape \(3,\)"),
    (lambda kw, roots: kw.update(lookup=LookupProposal(kw["lookup"].history, kw["lookup"].lengths, 6, 3,
                                                       torch.zeros(3))), r"lookup.log_q: expected shape \(4,\)"),
    (lambda kw, roots: kw.update(lookup=LookupProposal(kw["lookup"].history, kw["lookup"].lengths, 6, 3,
                                                       torch.zeros(4), torch.zeros(4, dtype=torch.float64))),
     "lookup.log_s: expected dtype float32"),
    (lambda kw, roots: kw["lookup"].lengths.__setitem__(0, 99), r"lookup.lengths\[0\]: expected a history length"),
    (lambda kw, roots: kw.update(lookup=LookupProposal(kw["lookup"].history, kw["lookup"].lengths, 6, 3,
                                                       torch.tensor([0.0, 0.1, -1.0, -2.0]))),
     r"lookup.log_q\[1\]: expected a log rate \(<= 0, or -inf\), received 0.1"),
    (lambda kw, roots: kw.update(lookup=LookupProposal(kw["lookup"].history, kw["lookup"].lengths, 6, 3, torch.zeros(4),
                                                       torch.tensor([0.0, -1.0, float("nan"), -2.0]))),
     r"lookup.log_s\[2\]: expected a log rate"),
    (lambda kw, roots: kw.update(lookup=LookupProposal(kw["lookup"].history, kw["lookup"].lengths, 2 ** 31 - 3, 3,
                                                       torch.zeros(4))), "lookup.num_tokens: .* of outputs"),
    (lambda kw, roots: roots.__setitem__(1, 10 ** 6), r"root_tokens\[1\]: token 1000000 is outside"),
    (lambda kw, roots: kw["draft"].logits.__setitem__((2, 1, 3), float("nan")), r"draft_logits\[2,1\]: a NaN"),
])
def test_bad_input_is_named(mutate, match):
    kw, roots, rule = case(5, 3, 4, 20, 10, 4, "tiny", True, True, False)
    mutate(kw, roots)
    with pytest.raises((ValueError, TypeError), match=match):
        tk.build_tree(roots, 6, rule, **kw)


def test_bad_rule_and_roots_are_named():
    kw, roots, rule = case(5, 3, 4, 20, 10, 4, "tiny", True, True, False)
    table = rule.latency.clone()
    table[2] = float("nan")
    with pytest.raises(ValueError, match=r"rule.latency\[2\]: expected finite seconds > 0, received nan"):
        tk.build_tree(roots, 6, ThroughputRule(table, rule.plain_seconds, rule.rows), **kw)
    with pytest.raises(ValueError, match=r"max_nodes: .* of outputs"):
        tk.build_tree(roots, 2 ** 31 - 3, rule, **kw)
    with pytest.raises(TypeError, match="root_tokens"):
        tk.build_tree(roots.tolist(), 6, rule, **kw)
