"""The tree-building ``taps::`` library ops (pool, scoring, selection) and the public ops that call them:
unchecked calls equal checked ones, opcheck (schema, fake against real), torch.compile(fullgraph=True), Triton
dispatch, argument errors without value checks.

Equality is exact (floats bitwise): on one device both paths run the same backend implementation.
"""
import pytest
import torch

import taps_kernels
from taps_kernels import ScorerWeights, _registry
from taps_kernels.ops.score import WEIGHT_FIELDS

POOL_FIELDS = ("logq", "step_logq", "rank", "topk_logp", "topk_ids", "entropy", "margin", "topk_mass")
TREE_FIELDS = ("tokens", "parents", "depth", "num_nodes")
B, D, V, TOP_K, POOL, E, H = 3, 5, 37, 4, 13, 6, 10  # odd sizes: no power of two anywhere


def _case(seed, top_k=TOP_K, vocab=V):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, D, vocab, generator=g) * 3
    logits[1, 2, 5:] = float("-inf")  # a position with few possible tokens: -inf lattice entries
    logits[2, 0, 1:] = float("-inf")  # one possible token: no runner-up, the margin rule (0, not inf)
    root = torch.randint(vocab, (B,), generator=g)
    full = ScorerWeights.random(embed_dim=E, hidden_dim=H, max_depth=D, token_dim=5, depth_dim=3, hidden_proj_dim=4,
                                mlp_dim=9, generator=g)
    tiny = ScorerWeights.random(tiny=True, mlp_dim=7, generator=g)
    emb, hidden = torch.randn(vocab, E, generator=g), torch.randn(B, D, H, generator=g)
    latency = torch.tensor([0.03 + 0.002 * n + 0.0001 * n * n for n in range(9)], dtype=torch.float64)
    return logits, root, full, tiny, emb, hidden, latency


def _assert_pool_equal(got, want):
    for f in POOL_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    for f in TREE_FIELDS:
        assert torch.equal(getattr(got.tree, f), getattr(want.tree, f)), f


def _assert_selection_equal(got, want):
    assert torch.equal(got.pool_index, want.pool_index) and torch.equal(got.num_selected, want.num_selected)
    for f in TREE_FIELDS:
        assert torch.equal(getattr(got.tree, f), getattr(want.tree, f)), f


@pytest.mark.parametrize("seed,top_k,vocab", [(0, TOP_K, V), (1, 9, 7)])  # second: top_k > V (K clamped)
def test_unchecked_ops_equal_checked_ops(seed, top_k, vocab):
    logits, root, full, tiny, emb, hidden, latency = _case(seed, top_k, vocab)
    pool = taps_kernels.candidate_pool(logits, root, top_k, POOL, validate="none")
    want_pool = taps_kernels.candidate_pool(logits, root, top_k, POOL)
    _assert_pool_equal(pool, want_pool)
    assert pool.topk_logp.shape == (B, D, min(top_k, vocab))
    for weights in (None, tiny, full):
        args = (emb, hidden) if weights is full else ()
        got = taps_kernels.score_edges(pool, weights, *args, validate="none")
        want = taps_kernels.score_edges(want_pool, weights, *args)
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and torch.equal(g, w)
    log_reach = want[2]
    assert torch.isfinite(log_reach).sum() > B, "the case must score real nodes"
    for kw in (dict(), dict(rule=taps_kernels.ReachRule(latency, t0=0.01)),
               dict(rule=taps_kernels.ReachRule(latency.tolist())),
               dict(rule=taps_kernels.UtilityRule(lambda_node=0.7, lambda_depth=0.05, min_utility=-4.0))):
        for max_nodes in (1, 6, POOL + 3):
            got = taps_kernels.select_subtree(pool.tree, log_reach, max_nodes, **kw, validate="none")
            _assert_selection_equal(got, taps_kernels.select_subtree(want_pool.tree, log_reach, max_nodes, **kw))


def test_pool_over_draft_vocab_equals_public_op():
    """``vocab_ids`` (a sorted reduced vocabulary; ties in the logits, roots outside it): the public op's pool."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randperm(3 * V, generator=g)[:V].sort().values
    logits = torch.randint(-2, 2, (B, D, V), generator=g).float()  # integer logits: ties ranked by token id
    root = torch.tensor([3 * V - 1, 0, 5])
    got = taps_kernels.candidate_pool(logits, root, TOP_K, POOL, vocab_ids=ids, validate="none")
    _assert_pool_equal(got, taps_kernels.candidate_pool(logits, root, TOP_K, POOL, vocab_ids=ids))
    assert bool(torch.isin(got.topk_ids, ids).all())
    torch._dynamo.reset()
    compiled = torch.compile(taps_kernels.candidate_pool, fullgraph=True, backend="aot_eager")
    _assert_pool_equal(compiled(logits, root, TOP_K, POOL, vocab_ids=ids), got)


def test_opcheck_all_ops():
    """Schema, fake (meta) against real outputs, autograd registration and AOT dispatch of each op."""
    logits, root, full, tiny, emb, hidden, latency = _case(2)
    pool = taps_kernels.candidate_pool(logits, root, TOP_K, POOL, validate="none")
    t = pool.tree
    base = (t.tokens, t.parents, t.depth, t.num_nodes, pool.logq, pool.step_logq, pool.topk_logp, pool.entropy,
            pool.margin, pool.topk_mass)
    flat_full = [getattr(full, n) for n in WEIGHT_FIELDS]
    flat_tiny = [getattr(tiny, n) for n in WEIGHT_FIELDS]
    _, _, log_reach = taps_kernels.score_edges(pool, full, emb, hidden, validate="none")
    pool_index, num_selected = torch.ops.taps.select_subtree(t.parents, t.depth, t.num_nodes, log_reach, 5, latency,
                                                             0.0, "reach", 1.0, 0.002, 0.0)
    checks = [
        (torch.ops.taps.topk_stats, (logits, TOP_K)),
        (torch.ops.taps.topk_stats, (logits.half(), 50)),
        (torch.ops.taps.best_first_pool, (pool.topk_logp, pool.topk_ids, root, POOL)),
        (torch.ops.taps.score_edges, base + ([], 1e-5, None, None)),
        (torch.ops.taps.score_edges, base + (flat_tiny, 1e-5, None, None)),
        (torch.ops.taps.score_edges, base + (flat_full, 1e-5, emb, hidden)),
        (torch.ops.taps.select_subtree, (t.parents, t.depth, t.num_nodes, log_reach, 5, latency, 0.0, "reach", 1.0,
                                         0.002, 0.0)),
        (torch.ops.taps.select_subtree, (t.parents, t.depth, t.num_nodes, log_reach, 7, None, 0.0, "utility", 1.0,
                                         0.1, -3.0)),
        (torch.ops.taps.reindex_subtree, (t.tokens, t.parents, t.depth, t.num_nodes, pool_index, num_selected)),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args)


def test_fake_checks_reject_bad_shapes_at_trace_time():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(2, 3, 11)
        logp, ids, entropy, _, _ = torch.ops.taps.topk_stats(logits, 20)
        assert logp.shape == (2, 3, 11) and ids.dtype == torch.int64 and entropy.shape == (2, 3)
        out = torch.ops.taps.best_first_pool(logp, ids, torch.empty(2, dtype=torch.int64), 6)
        assert [tuple(o.shape) for o in out] == [(2, 7)] * 3 + [(2,)] + [(2, 7)] * 3
        with pytest.raises(ValueError, match="root_tokens"):
            torch.ops.taps.best_first_pool(logp, ids, torch.empty(3, dtype=torch.int64), 6)
        parents, depth = out[1], out[2]
        with pytest.raises(ValueError, match="log_reach"):
            torch.ops.taps.select_subtree(parents, depth, out[3], torch.empty(2, 6), 4, None, 0.0, "reach", 1.0,
                                          0.002, 0.0)


def _build(logits, root, weights, emb, hidden, latency):
    """pool -> score -> select through the public ops as a round calls them; tensors out (the parts a round reads)."""
    pool = taps_kernels.candidate_pool(logits, root, TOP_K, POOL, validate="none")
    edge_logq, other_logq, log_reach = taps_kernels.score_edges(pool, weights, emb, hidden, validate="none")
    by_reach = taps_kernels.select_subtree(pool.tree, log_reach, 6, rule=taps_kernels.ReachRule(latency, t0=0.002),
                                           validate="none")
    by_utility = taps_kernels.select_subtree(pool.tree, log_reach, 5, rule=taps_kernels.UtilityRule(lambda_depth=0.05),
                                             validate="none")
    return (pool.tree.tokens, pool.logq, edge_logq, other_logq, log_reach, by_reach.tree.tokens,
            by_reach.tree.parents, by_reach.pool_index, by_reach.num_selected, by_utility.tree.depth,
            by_utility.pool_index)


def _assert_all_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_compile_fullgraph_equals_eager():
    logits, root, full, _, emb, hidden, latency = _case(3)
    want = _build(logits, root, full, emb, hidden, latency)
    torch._dynamo.reset()
    got = torch.compile(_build, fullgraph=True, backend="aot_eager")(logits, root, full, emb, hidden, latency)
    _assert_all_equal(got, want)


@pytest.mark.slow
def test_compile_fullgraph_inductor():
    """The same build through Inductor (C++ codegen on CPU: slower to compile, hence slow)."""
    logits, root, _, tiny, _, _, latency = _case(4)
    want = _build(logits, root, tiny, None, None, latency)
    torch._dynamo.reset()
    got = torch.compile(_build, fullgraph=True)(logits, root, tiny, None, None, latency)
    _assert_all_equal(got, want)


@pytest.mark.skipif(torch.cuda.is_available() or not taps_kernels.backend.triton_interpreting(),
                    reason="CPU Triton dispatch needs the interpreter (TRITON_INTERPRET=1, set by conftest)")
def test_triton_dispatch_under_taps_backend(monkeypatch):
    """With TAPS_BACKEND=triton every op runs its Triton kernel (counted), checked or not."""
    pytest.importorskip("triton")
    ops = ("topk_stats", "best_first_pool", "score_edges", "select_subtree", "reindex_subtree")
    calls = {op: 0 for op in ops}
    for op in ops:
        def counted(*args, _op=op, _fn=_registry.IMPLS[(op, "triton")], **kw):
            calls[_op] += 1
            return _fn(*args, **kw)
        monkeypatch.setitem(_registry.IMPLS, (op, "triton"), counted)
    monkeypatch.setenv("TAPS_BACKEND", "triton")
    g = torch.Generator().manual_seed(5)
    logits, root = torch.randn(2, 3, 19, generator=g), torch.tensor([4, 7])
    tiny = ScorerWeights.random(tiny=True, mlp_dim=5, generator=g)
    pool = taps_kernels.candidate_pool(logits, root, 3, 7, validate="none")
    scores = taps_kernels.score_edges(pool, tiny, validate="none")
    sel = taps_kernels.select_subtree(pool.tree, scores[2], 4, validate="none")
    assert calls == {op: 1 for op in ops}
    want_pool = taps_kernels.candidate_pool(logits, root, 3, 7)
    want_scores = taps_kernels.score_edges(want_pool, tiny)
    _assert_pool_equal(pool, want_pool)
    _assert_all_equal(scores, want_scores)
    _assert_selection_equal(sel, taps_kernels.select_subtree(want_pool.tree, want_scores[2], 4))
    assert calls == {op: 2 for op in ops}, "the checked calls must have run the same Triton kernels"


def test_metadata_errors_name_the_argument_without_value_checks():
    logits, root, full, tiny, emb, hidden, _ = _case(6)
    with pytest.raises(ValueError, match="pool_size"):
        taps_kernels.candidate_pool(logits, root, TOP_K, 0, validate="none")
    with pytest.raises(TypeError, match="root_tokens"):
        taps_kernels.candidate_pool(logits, root.int(), TOP_K, 5, validate="none")
    with pytest.raises(ValueError, match="draft_logits"):
        taps_kernels.candidate_pool(logits.requires_grad_(), root, TOP_K, 5, validate="none")
    logits.requires_grad_(False)
    with pytest.raises(ValueError, match=r"vocab_ids: expected shape"):
        taps_kernels.candidate_pool(logits, root, TOP_K, 5, vocab_ids=torch.arange(V - 1), validate="none")
    with pytest.raises(TypeError, match="vocab_ids: expected dtype"):
        taps_kernels.candidate_pool(logits, root, TOP_K, 5, vocab_ids=torch.arange(V, dtype=torch.int32), validate="none")
    pool = taps_kernels.candidate_pool(logits, root, TOP_K, 5, validate="none")
    with pytest.raises(ValueError, match="token_embeddings"):
        taps_kernels.score_edges(pool, full, emb[:, :3], hidden, validate="none")
    with pytest.raises(ValueError, match="drafter_hidden"):
        taps_kernels.score_edges(pool, full, emb, hidden[:, :2], validate="none")
    with pytest.raises(TypeError, match="weights"):
        taps_kernels.score_edges(pool, {"edge_ln_weight": tiny.edge_ln_weight}, validate="none")
    _, _, log_reach = taps_kernels.score_edges(pool, tiny, validate="none")
    with pytest.raises(ValueError, match="max_nodes"):
        taps_kernels.select_subtree(pool.tree, log_reach, 0, validate="none")
    with pytest.raises(TypeError, match="rule: expected a ReachRule, UtilityRule or ThroughputRule, received str"):
        taps_kernels.select_subtree(pool.tree, log_reach, 3, rule="best", validate="none")
    with pytest.raises(ValueError, match=r"rule\.lambda_node: expected a float > 0\.0, received 0\.0"):
        taps_kernels.select_subtree(pool.tree, log_reach, 3, rule=taps_kernels.UtilityRule(lambda_node=0.0),
                                    validate="none")
    with pytest.raises(TypeError, match="latency"):  # the table belongs to the reach rule
        taps_kernels.UtilityRule(latency=torch.ones(4))
    with pytest.raises(ValueError, match=r"rule\.latency: expected a non-empty 1-D table"):
        taps_kernels.select_subtree(pool.tree, log_reach, 3, rule=taps_kernels.ReachRule(torch.ones(0)),
                                    validate="none")
    with pytest.raises(ValueError, match="log_reach"):
        taps_kernels.select_subtree(pool.tree, log_reach[:, :-1], 3, validate="none")
