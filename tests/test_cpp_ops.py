"""The C++ backend (``taps_kernels._C``) against the PyTorch references, against structural oracles that
share no code with either (brute-force enumeration, a plain Python walk), and on bad input.

Discrete outputs must be equal and float outputs bit-identical (compared as bytes, so -0.0 != +0.0), except
``topk_stats``' floats (one fused pass whose sums run in another order): within twice PyTorch's own float32 error
against float64, with the same ids in the same order.
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
import random
import sys
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import taps_kernels as tk
from taps_kernels import backend as bk
from taps_kernels.layout import TopKStats, Tree, validate_tree

from helpers import assert_topk_stats_close, make_tree, random_tree, tree_rows

CPU = torch.device("cpu")
_WHY = bk.unavailable_reason("cpp", CPU)
pytestmark = pytest.mark.skipif(bool(_WHY), reason=f"C++ backend unavailable: {_WHY}")
if not _WHY:
    from taps_kernels import _C

HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------- helpers
def assert_same(a: torch.Tensor, b: torch.Tensor, what: str = ""):
    """Same dtype, shape and bytes."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.numel() == 0:
        return
    ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(ab, bb):
        diff = (a != b) | (a.isnan() != b.isnan()) if a.is_floating_point() else a != b
        first = diff.nonzero()[:3].tolist() if diff.any() else "sign of zero"
        raise AssertionError(f"{what}: first differences at {first}")


def assert_all_same(xs, ys, what=""):
    assert len(xs) == len(ys)
    for k, (x, y) in enumerate(zip(xs, ys)):
        assert_same(x, y, f"{what}[{k}]")


@st.composite
def trees(draw, max_b=3, max_n=40, vocab=4):
    B = draw(st.integers(1, max_b))
    N = draw(st.integers(1, max_n))
    rows = []
    for _ in range(B):
        n = draw(st.integers(1, N))
        par = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
        tok = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
        rows.append((par, tok))
    return make_tree(rows, N)


def both(op, *args, **kwargs):
    return op(*args, backend="reference", **kwargs), op(*args, backend="cpp", **kwargs)


# ------------------------------------------------------------------------------------------ candidate pool
POOL_FIELDS = ("logq", "step_logq", "rank")


def assert_pool_is_its_lattice_search(pool, roots, pool_size):
    """The pool's search is exact: the reference search over the pool's own top-K lattice gives the same bytes
    (the lattice itself is compared with :func:`assert_topk_stats_close`)."""
    stats = TopKStats(pool.topk_logp, pool.topk_ids, pool.entropy, pool.margin, pool.topk_mass)
    tree, logq, step_logq, rank = tk.best_first_pool(stats, roots, pool_size, backend="reference")
    for f, want in zip(POOL_FIELDS, (logq, step_logq, rank)):
        assert_same(getattr(pool, f), want, f)
    for f in ("tokens", "parents", "depth", "num_nodes"):
        assert_same(getattr(pool.tree, f), getattr(tree, f), f"tree.{f}")


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("pool_size", [1, 30, 31, 32, 256])  # N = pool_size + 1 = 2, 31, 32, 33, 257
@pytest.mark.parametrize("top_k,ties", [(1, False), (5, True), (64, False)])
def test_candidate_pool_matches_reference(B, pool_size, top_k, ties):
    g = torch.Generator().manual_seed(1000 * B + pool_size + top_k)
    D, V = 7, 1001  # vocabulary not a power of two
    if ties:  # integer-valued logits: many equal log-probs inside and across positions
        logits = torch.randint(-3, 3, (B, D, V), generator=g).float()
    else:
        logits = torch.randn(B, D, V, generator=g) * 3
    roots = torch.randint(0, V, (B,), generator=g)
    pool = tk.candidate_pool(logits, roots, top_k, pool_size, backend="cpp", pool_backend="cpp")
    assert_topk_stats_close(pool, logits, top_k)
    assert_pool_is_its_lattice_search(pool, roots, pool_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_candidate_pool_half_logits(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 5, 333, generator=g) * 4).to(dtype)
    roots = torch.tensor([1, 2])
    pool = tk.candidate_pool(logits, roots, 8, 40, backend="cpp", pool_backend="cpp")
    assert_topk_stats_close(pool, logits, 8)
    assert_pool_is_its_lattice_search(pool, roots, 40)


@pytest.mark.parametrize("V,top_k", [(1, 1), (1, 4), (2, 1), (2, 8), (3, 3)])
def test_topk_stats_tiny_vocab(V, top_k):
    logits = torch.tensor([[[0.5, 0.5, -1.0][:V], [2.0, -3.0, 2.0][:V]]])
    assert_topk_stats_close(tk.topk_stats(logits, top_k, backend="cpp"), logits, top_k)


def test_topk_stats_infinite_logits():
    logits = torch.full((1, 2, 9), float("-inf"))
    logits[0, 0, 4] = 1.0
    logits[0, 1, 2:5] = 0.0
    stats = tk.topk_stats(logits, 6, backend="cpp")
    assert_topk_stats_close(stats, logits, 6)
    assert float(stats.entropy[0, 0]) == 0.0 and float(stats.margin[0, 0]) == 0.0  # one possible token


def test_topk_stats_check_catches_small_errors():
    # the comparison itself: a few ulps off in one log-prob, or two tied ids swapped, fail it
    g = torch.Generator().manual_seed(9)
    logits = torch.randint(-2, 2, (1, 2, 300), generator=g).float()
    stats = tk.topk_stats(logits, 8, backend="cpp")
    assert_topk_stats_close(stats, logits, 8)
    off = stats.topk_logp.clone()
    off[0, 1, 3] = torch.nextafter(torch.nextafter(torch.nextafter(off[0, 1, 3], off.new_tensor(0.0)),
                                                   off.new_tensor(0.0)), off.new_tensor(0.0))
    with pytest.raises(AssertionError, match="topk_logp"):
        assert_topk_stats_close(dataclasses.replace(stats, topk_logp=off), logits, 8)
    swapped = stats.topk_ids.clone()
    swapped[0, 0, [0, 1]] = swapped[0, 0, [1, 0]]  # integer logits: the first two are tied
    with pytest.raises(AssertionError, match="topk_ids"):
        assert_topk_stats_close(dataclasses.replace(stats, topk_ids=swapped), logits, 8)


@pytest.mark.parametrize("V", [16, 17, 24000])
@pytest.mark.parametrize("top_k", [1, 64, 300])
def test_topk_stats_vector_filter_matches_reference(V, top_k):
    # the vector path's threshold filter: its buffer (max(4K, 256) entries) fills and is cut many times over a
    # draft-vocabulary row, late winners arrive after cuts, -inf entries and ties straddle the cuts
    g = torch.Generator().manual_seed(V + top_k)
    logits = torch.randn(2, 3, V, generator=g) * 3
    logits[0, 0] = torch.arange(V, dtype=torch.float32) / V  # ascending: every entry beats the last cut
    logits[0, 1] = torch.randint(-2, 2, (V,), generator=g).float()  # a few values shared by many ids
    logits[1, 0, V // 3:] = float("-inf")
    logits[1, 1, 1:] = float("-inf")
    assert_topk_stats_close(tk.topk_stats(logits, top_k, backend="cpp"), logits, top_k)


@pytest.mark.parametrize("bad,match", [(float("nan"), "NaN logit"), (float("inf"), r"\+inf logit")])
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_topk_stats_nan_or_posinf_logit_rejected(bad, match, backend):
    # The input contract: NaN / +inf logits are refused on every backend (they made whole rows NaN before).
    logits = torch.randn(1, 3, 11)
    logits[0, 1, 4] = bad
    with pytest.raises(ValueError, match=r"draft_logits\[0,1,4\]: " + match):
        tk.topk_stats(logits, 4, backend=backend)


def test_topk_stats_extension_rejects_nan_rows():
    # The binding's own check (the top entry of a NaN row is NaN), for callers that skip the op.
    logits = torch.randn(1, 3, 11)
    logits[0, 2, :] = float("-inf")
    with pytest.raises(ValueError, match=r"draft_logits\[0,2\]"):
        _C.topk_stats(logits, 4)


@pytest.mark.parametrize("top_k", [1, 7, 40])
def test_topk_stats_ties_and_neg_inf_across_chunks(top_k):
    # The C++ scan tests 32 entries at a time: ties, -inf and late winners on both sides of chunk edges
    # (NaN rows are refused by the op and the binding; topk_row's NaN order is covered by the ctest).
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randint(-4, 4, (2, 3, 301), generator=g).float()
    logits[0, 1, [31, 32, 200, 300]] = 3.0
    logits[0, 2, 20:290] = float("-inf")
    logits[1, 0, 299] = 50.0  # the best entry sits in the tail after the last full chunk
    logits[1, 2, 64] = float("-inf")
    b = tk.topk_stats(logits, top_k, backend="cpp")
    assert_topk_stats_close(b, logits, top_k)
    assert int(b.topk_ids[1, 0, 0]) == 299


def _oracle_prefixes(logits: torch.Tensor, K: int):
    """Every prefix over the top-K tokens of each position with its log mass (float64 numpy, no taps code)."""
    x = logits.double().numpy()
    logp = x - x.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    D = x.shape[0]
    top = [np.argsort(-logp[d], kind="stable")[:K] for d in range(D)]
    out = []
    for length in range(1, D + 1):
        for combo in itertools.product(*(top[d] for d in range(length))):
            out.append((sum(logp[d, t] for d, t in enumerate(combo)), tuple(int(t) for t in combo)))
    out.sort(key=lambda m: -m[0])
    return out


@pytest.mark.parametrize("D,K", [(1, 3), (2, 2), (3, 3), (3, 1), (4, 2)])
def test_candidate_pool_brute_force_oracle(D, K):
    g = torch.Generator().manual_seed(10 * D + K)
    V = 7
    logits = torch.randn(1, D, V, generator=g) * 2
    prefixes = _oracle_prefixes(logits[0], K)
    total = len(prefixes)
    for pool_size in range(1, total + 3):
        pool = tk.candidate_pool(logits, torch.tensor([0]), K, pool_size, backend="cpp", pool_backend="cpp")
        m = min(pool_size, total)
        assert int(pool.tree.num_nodes[0]) == m + 1
        if m < total and prefixes[m - 1][0] - prefixes[m][0] < 1e-4:
            continue  # a (near) tie at the boundary: either prefix is a correct answer
        par = pool.tree.parents[0].tolist()
        tok = pool.tree.tokens[0].tolist()
        got = set()
        for i in range(1, m + 1):
            path, j = [], i
            while j > 0:
                path.append(tok[j])
                j = par[j]
            got.add(tuple(reversed(path)))
        assert got == {p for _, p in prefixes[:m]}, f"pool_size={pool_size}"


def test_best_first_pool_direct_ties_and_lattice_edges():
    # All log-probs equal: pop order falls to (parent, rank); K larger than useful, D = 1.
    lp = torch.zeros(2, 1, 4)
    ids = torch.arange(8, dtype=torch.int64).view(2, 1, 4)
    roots = torch.tensor([9, 9])
    stats = tk.TopKStats(lp, ids, torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1))
    a, b = both(tk.best_first_pool, stats, roots, 6)
    assert_all_same(a[1:], b[1:], "logq/step_logq/rank")
    for f in ("tokens", "parents", "depth", "num_nodes"):
        assert_same(getattr(a[0], f), getattr(b[0], f), f"tree.{f}")
    assert b[0].num_nodes.tolist() == [5, 5]  # the lattice holds only 4 prefixes
    assert b[0].parents[0].tolist() == [-1, 0, 0, 0, 0, -1, -1] and b[3][0].tolist() == [-1, 0, 1, 2, 3, -1, -1]


# --------------------------------------------------------------------------------------- propagate reach
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("N", [1, 31, 32, 33, 257])
def test_propagate_reach_matches_reference(B, N):
    rng = random.Random(N * 7 + B)
    tree = random_tree(rng, B, N)
    edge = torch.tensor([[rng.uniform(-6, 0.5) for _ in range(N)] for _ in range(B)], dtype=torch.float32)
    edge[0, N // 2] = float("-inf")
    a, b = both(tk.propagate_reach, tree.parents, edge)
    assert_same(a, b)
    a16, b16 = both(tk.propagate_reach, tree, edge.half())
    assert_same(a16, b16)


@HYP
@given(tree=trees(), seed=st.integers(0, 2 ** 16))
def test_propagate_reach_property(tree, seed):
    g = torch.Generator().manual_seed(seed)
    edge = -torch.rand(tree.tokens.shape, generator=g) * 5
    a, b = both(tk.propagate_reach, tree.parents, edge)
    assert_same(a, b)


# --------------------------------------------------------------------------------------- select subtree
def _selection_same(a, b):
    assert_same(a.pool_index, b.pool_index, "pool_index")
    assert_same(a.num_selected, b.num_selected, "num_selected")
    for f in ("tokens", "parents", "depth", "num_nodes"):
        assert_same(getattr(a.tree, f), getattr(b.tree, f), f"tree.{f}")


def _log_reach(rng: random.Random, tree: Tree, kind: str) -> torch.Tensor:
    B, N = tree.tokens.shape
    if kind == "monotone":
        edge = torch.tensor([[math.log(rng.uniform(0.01, 1.0)) for _ in range(N)] for _ in range(B)])
        return tk.propagate_reach(tree.parents, edge, backend="reference")
    if kind == "ties":  # integer values: many equal reaches, non-monotone
        return torch.tensor([[-float(rng.randrange(3)) for _ in range(N)] for _ in range(B)])
    return torch.tensor([[rng.gauss(-2, 1.5) for _ in range(N)] for _ in range(B)])  # non-monotone


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("N", [1, 31, 32, 33, 257])
@pytest.mark.parametrize("kind", ["monotone", "ties", "noisy"])
def test_select_subtree_matches_reference(B, N, kind):
    # a stable seed: hash() of a str is randomised per process (PYTHONHASHSEED)
    rng = random.Random(zlib.crc32(f"{B},{N},{kind}".encode()))
    tree = random_tree(rng, B, N)
    lr = _log_reach(rng, tree, kind)
    for max_nodes in sorted({1, 7, max(1, N - 1), N + 3}):
        _selection_same(*both(tk.select_subtree, tree, lr, max_nodes))
        lat = sorted(rng.uniform(0.01, 0.2) for _ in range(rng.randint(1, N + 5)))
        _selection_same(*both(tk.select_subtree, tree, lr, max_nodes,
                              rule=tk.ReachRule(lat, t0=rng.uniform(0, 0.1))))
        _selection_same(*both(tk.select_subtree, tree, lr, max_nodes, rule=tk.UtilityRule(min_utility=0.0)))
        _selection_same(*both(tk.select_subtree, tree, lr, max_nodes,
                              rule=tk.UtilityRule(lambda_depth=0.05, min_utility=0.05)))


def _is_prefix_closed(parents, kept):
    s = set(kept)
    return all(parents[i] == 0 or parents[i] in s for i in kept)


@HYP
@given(tree=trees(max_n=30), seed=st.integers(0, 2 ** 16), max_nodes=st.integers(1, 35),
       rule=st.sampled_from(["reach", "throughput", "utility"]))
def test_select_subtree_property(tree, seed, max_nodes, rule):
    rng = random.Random(seed)
    lr = _log_reach(rng, tree, rng.choice(["monotone", "ties", "noisy"]))
    kwargs = {}
    if rule == "throughput":
        kwargs = dict(rule=tk.ReachRule([rng.uniform(0.5, 2.0) for _ in range(rng.randint(1, 35))], t0=0.1))
    elif rule == "utility":
        kwargs = dict(rule=tk.UtilityRule(min_utility=rng.choice([0.0, 0.1])))
    a, b = both(tk.select_subtree, tree, lr, max_nodes, **kwargs)
    _selection_same(a, b)
    for row in range(tree.batch_size):
        kept = [i for i in b.pool_index[row].tolist()[1:] if i >= 0]
        assert kept == sorted(kept) and _is_prefix_closed(tree.parents[row].tolist(), kept)
        if rule == "reach":
            assert len(kept) == min(max_nodes, int(tree.num_nodes[row]) - 1)


@HYP
@given(tree=trees(max_n=30), seed=st.integers(0, 2 ** 16), max_nodes=st.integers(1, 35))
def test_reindex_subtree_extension_matches_python(tree, seed, max_nodes):
    # _C.reindex_subtree is the C++ twin of the torch re-indexer that select_subtree uses off the cpp backend.
    from taps_kernels.reference.select import reindex_subtree_reference
    rng = random.Random(seed)
    sel = tk.select_subtree(tree, _log_reach(rng, tree, "noisy"), max_nodes, backend="cpp")
    # Also an arbitrary ascending subset (not prefix-closed): orphans get parent -1 in both.
    rows = []
    for b in range(tree.batch_size):
        keep = sorted(rng.sample(range(int(tree.num_nodes[b])), min(max_nodes, int(tree.num_nodes[b]))))
        rows.append(keep + [-1] * (max_nodes - len(keep)))
    subset = torch.tensor(rows, dtype=torch.int64)
    for pool_index, num_selected in ((sel.pool_index, sel.num_selected),
                                     (subset, ((subset >= 0).sum(1) - 1).to(torch.int32))):
        args = (tree.tokens, tree.parents, tree.depth, tree.num_nodes, pool_index, num_selected)
        want = reindex_subtree_reference(*args)
        got = _C.reindex_subtree(*args)
        for f, w, g in zip(("tokens", "parents", "depth", "num_nodes"), want, got):
            assert_same(w, g, f)


def _closed_subsets(parents, n_real, size):
    """All prefix-closed sets of ``size`` non-root nodes (brute force over subsets)."""
    nodes = range(1, n_real)
    for combo in itertools.combinations(nodes, size):
        if _is_prefix_closed(parents, combo):
            yield combo


@pytest.mark.parametrize("seed", range(12))
def test_select_subtree_brute_force_oracle(seed):
    rng = random.Random(seed)
    n_real = rng.randint(2, 10)
    tree = random_tree(rng, 1, n_real, vocab=1, parents="uniform")
    par = tree_rows(tree)[0]
    # Monotone reach from edge probabilities, accumulated here (not by propagate_reach).
    logr = [0.0] * n_real
    for i in range(1, n_real):
        logr[i] = logr[par[i]] + math.log(rng.uniform(0.05, 1.0))
    lr = torch.tensor([logr], dtype=torch.float32)
    reach = [math.exp(float(v)) for v in lr[0]]
    best = {0: 0.0}
    for size in range(1, n_real):
        best[size] = max(sum(reach[i] for i in c) for c in _closed_subsets(par, n_real, size))
    for max_nodes in range(1, n_real + 1):
        sel = tk.select_subtree(tree, lr, max_nodes, backend="cpp")
        kept = [i for i in sel.pool_index[0].tolist()[1:] if i >= 0]
        n = min(max_nodes, n_real - 1)
        assert len(kept) == n and _is_prefix_closed(par, kept)
        assert sum(reach[i] for i in kept) >= best[n] - 1e-9
    # Throughput rule: the chosen size maximises (1 + best total of n nodes) / (t0 + latency[n]).
    latency = [rng.uniform(0.5, 1.0) * (1 + 0.3 * k) for k in range(n_real)]
    t0 = rng.uniform(0.0, 0.5)
    sel = tk.select_subtree(tree, lr, n_real, rule=tk.ReachRule(latency, t0=t0), backend="cpp")
    n_star = int(sel.num_selected[0])
    values = [(1 + best[k]) / (t0 + latency[k]) for k in range(n_real)]
    assert values[n_star] >= max(values) * (1 - 1e-9)


# -------------------------------------------------------------------------------------------- tree mask
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("N", [1, 31, 32, 33, 257])
def test_tree_mask_matches_reference(B, N):
    rng = random.Random(N + 100 * B)
    tree = random_tree(rng, B, N)
    prefix = torch.tensor([rng.randrange(50) for _ in range(B)])
    assert_all_same(*both(tk.tree_mask, tree, prefix))
    assert_all_same(*both(tk.tree_mask, tree, prefix.int()))


@HYP
@given(tree=trees(max_n=70))
def test_tree_mask_property(tree):
    prefix = torch.arange(tree.batch_size) * 3
    assert_all_same(*both(tk.tree_mask, tree, prefix))


# -------------------------------------------------------------------------------------------- accept walk
def _walk(parents, tokens, n_real, target, path_len):
    """Plain walk: children in index order, first token match wins."""
    children = {}
    for i in range(1, n_real):
        children.setdefault(parents[i], []).append(i)
    path = [0]
    while len(path) < path_len:
        nxt = [c for c in children.get(path[-1], []) if tokens[c] == target[path[-1]]]
        if not nxt:
            break
        path.append(nxt[0])
    return path, target[path[-1]]


def _check_against_walk(tree, target, path, accept_len, next_token, path_len):
    for b in range(tree.batch_size):
        want, nxt = _walk(tree.parents[b].tolist(), tree.tokens[b].tolist(), int(tree.num_nodes[b]),
                          target[b].tolist(), path_len)
        assert path[b].tolist() == want + [-1] * (path_len - len(want))
        assert int(accept_len[b]) == len(want) and int(next_token[b]) == nxt


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("N", [1, 31, 32, 33, 257])
def test_accept_greedy_matches_reference_and_walk(B, N):
    rng = random.Random(N * 3 + B)
    tree = random_tree(rng, B, N, vocab=3)  # small vocabulary: siblings share tokens
    target = torch.randint(0, 3, (B, N), generator=torch.Generator().manual_seed(N))
    for max_depth in (None, 0, 2):
        out = both(tk.accept_greedy, tree, target, max_depth=max_depth)
        assert_all_same(*out)
        path_len = out[1][0].shape[1]
        _check_against_walk(tree, target, *out[1], path_len)


@HYP
@given(tree=trees(max_n=40, vocab=3), seed=st.integers(0, 2 ** 16))
def test_accept_greedy_property(tree, seed):
    target = torch.randint(0, 3, tree.tokens.shape, generator=torch.Generator().manual_seed(seed))
    path, accept_len, next_token = tk.accept_greedy(tree, target, backend="cpp")
    _check_against_walk(tree, target, path, accept_len, next_token, path.shape[1])
    assert_all_same(tk.accept_greedy(tree, target, backend="reference"), (path, accept_len, next_token))


# --------------------------------------------------------------------------------------------- KV compaction
def _caches(seed, B, L, dtype, layers=2):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, 2 + layer, L, 3 + 2 * layer) for layer in range(layers)]  # H and Dh differ per layer
    keys = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    values = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    return keys, values


def _compact_both(keys, values, prefix, path):
    k_ref, v_ref = [t.clone() for t in keys], [t.clone() for t in values]
    lens_ref = tk.compact_kv(k_ref, v_ref, prefix, path, backend="reference")
    lens_cpp = tk.compact_kv(keys, values, prefix, path, backend="cpp")
    assert_same(lens_ref, lens_cpp, "new_lens")
    assert_all_same(k_ref, keys, "keys")
    assert_all_same(v_ref, values, "values")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,N", [(1, 1), (1, 33), (3, 32), (3, 257)])
def test_compact_kv_matches_reference(dtype, B, N):
    rng = random.Random(N + B)
    tree = random_tree(rng, B, N, vocab=2)
    target = torch.randint(0, 2, (B, N), generator=torch.Generator().manual_seed(5))
    path, _, _ = tk.accept_greedy(tree, target, backend="reference")
    prefix = torch.tensor([rng.randrange(20) for _ in range(B)])
    L = int(prefix.max()) + N + 4
    keys, values = _caches(N, B, L, dtype)
    _compact_both(keys, values, prefix, path)


def test_compact_kv_strided_cache():
    # A view of a larger preallocated cache: not contiguous across heads and batch rows.
    big_k = torch.randn(2, 3, 40, 8)
    big_v = torch.randn(2, 3, 40, 8)
    keys, values = [big_k[:, :, :30]], [big_v[:, :, :30]]
    path = torch.tensor([[0, 2, 5, 9, -1], [0, 1, 2, -1, -1]])
    prefix = torch.tensor([4, 10])
    _compact_both(keys, values, prefix, path)
    assert torch.equal(big_k[:, :, 30:], big_k.clone()[:, :, 30:])


@HYP
@given(tree=trees(max_n=30, vocab=2), seed=st.integers(0, 2 ** 16))
def test_compact_kv_property(tree, seed):
    target = torch.randint(0, 2, tree.tokens.shape, generator=torch.Generator().manual_seed(seed))
    path, _, _ = tk.accept_greedy(tree, target, backend="reference")
    prefix = torch.tensor([seed % 7 + b for b in range(tree.batch_size)])
    keys, values = _caches(seed, tree.batch_size, int(prefix.max()) + tree.max_nodes, torch.float32, layers=1)
    _compact_both(keys, values, prefix, path)


# ------------------------------------------------------------------------------------------------ bad input
def _small_tree():
    return make_tree([([-1, 0, 0, 1, 2], [5, 6, 7, 8, 9]), ([-1, 0, 1], [1, 2, 3])], N=5)


def _corrupt(field, b, i, value):
    t = _small_tree()
    getattr(t, field)[b, i] = value
    return t


def _bad_num_nodes():
    t = _small_tree()
    t.num_nodes[1] = 9
    return t


LR = torch.zeros(2, 5)
BAD_TREES = [
    ("parent not smaller than child", _corrupt("parents", 0, 2, 2), r"tree\.parents\[0,2\]: parent index 2 is not smaller"),
    ("parent out of range (high)", _corrupt("parents", 0, 3, 99), r"tree\.parents\[0,3\]: parent index 99 is out of range"),
    ("parent out of range (negative)", _corrupt("parents", 1, 1, -4), r"tree\.parents\[1,1\]: parent index -4 is out of range"),
    ("depth inconsistent", _corrupt("depth", 0, 4, 5), r"tree\.depth\[0,4\]: depth inconsistent"),
    ("num_nodes out of range", _bad_num_nodes(), r"tree\.num_nodes\[1\]: expected a value in \[1, 5\]"),
]


@pytest.mark.parametrize("name,tree,match", BAD_TREES, ids=[x[0] for x in BAD_TREES])
@pytest.mark.parametrize("op", ["select_subtree", "tree_mask", "accept_greedy", "validate"])
def test_invalid_tree_raises(name, tree, match, op):
    with pytest.raises(ValueError, match=match):
        if op == "select_subtree":
            tk.select_subtree(tree, LR, 2, backend="cpp")
        elif op == "tree_mask":
            tk.tree_mask(tree, torch.zeros(2, dtype=torch.int64), backend="cpp")
        elif op == "accept_greedy":
            tk.accept_greedy(tree, torch.zeros(2, 5, dtype=torch.int64), backend="cpp")
        else:
            tree.validate()


def test_tokens_outside_vocabulary():
    with pytest.raises(ValueError, match=r"tree\.tokens\[0,4\]: token 9 is outside the vocabulary \[0, 9\)"):
        _small_tree().validate(vocab_size=9)
    _small_tree().validate(vocab_size=10)
    with pytest.raises(ValueError, match=r"root_tokens\[1\]: token 50 is outside the vocabulary"):
        tk.candidate_pool(torch.randn(2, 3, 50), torch.tensor([0, 50]), 4, 8, backend="cpp", pool_backend="cpp")


@pytest.mark.parametrize("call,exc,match", [
    (lambda: tk.candidate_pool(torch.randn(1, 3, 50), torch.tensor([0]), 0, 8, backend="cpp"), ValueError, "top_k"),
    (lambda: tk.candidate_pool(torch.randn(1, 3, 50), torch.tensor([0]), 4, 0, backend="cpp"), ValueError, "pool_size"),
    (lambda: tk.select_subtree(_small_tree(), LR, 0, backend="cpp"), ValueError, "max_nodes"),
    (lambda: tk.candidate_pool(torch.randn(1, 3, 50).double(), torch.tensor([0]), 4, 8, backend="cpp"), TypeError,
     "draft_logits"),
    (lambda: tk.candidate_pool(torch.randn(1, 3, 50), torch.tensor([0]).int(), 4, 8, backend="cpp"), TypeError,
     "root_tokens"),
    (lambda: tk.select_subtree(_small_tree(), LR.long(), 2, backend="cpp"), TypeError, "log_reach"),
    (lambda: tk.select_subtree(_small_tree(), torch.zeros(2, 6), 2, backend="cpp"), ValueError, "log_reach"),
    (lambda: tk.select_subtree(Tree(*(x.long() if x.dtype == torch.int32 else x for x in (
        _small_tree().tokens, _small_tree().parents, _small_tree().depth, _small_tree().num_nodes))), LR, 2,
        backend="cpp"), TypeError, "tree.parents"),
    (lambda: tk.propagate_reach(_small_tree().parents, torch.zeros(2, 4), backend="cpp"), ValueError, "edge_logq"),
    (lambda: tk.tree_mask(_small_tree(), torch.zeros(3, dtype=torch.int64), backend="cpp"), ValueError, "prefix_lens"),
    (lambda: tk.accept_greedy(_small_tree(), torch.zeros(2, 5, dtype=torch.int32), backend="cpp"), TypeError,
     "target_tokens"),
])
def test_bad_arguments_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("call,exc,match", [
    (lambda: _C.topk_stats(torch.randn(1, 2, 5), 0), ValueError, "top_k"),
    (lambda: _C.topk_stats(torch.randn(2, 5), 3), ValueError, "draft_logits"),
    (lambda: _C.best_first_pool(torch.zeros(1, 2, 3).double(), torch.zeros(1, 2, 3, dtype=torch.int64),
                                torch.zeros(1, dtype=torch.int64), 4), TypeError, "topk_logp"),
    (lambda: _C.best_first_pool(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4, dtype=torch.int64),
                                torch.zeros(1, dtype=torch.int64), 4), ValueError, "topk_ids"),
    (lambda: _C.best_first_pool(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, dtype=torch.int64),
                                torch.zeros(1, dtype=torch.int64), 0), ValueError, "pool_size"),
    (lambda: _C.propagate_reach(torch.tensor([[-1, 1]], dtype=torch.int32), torch.zeros(1, 2)), ValueError,
     r"parents\[0,1\]"),
    (lambda: _C.select_subtree(_small_tree().parents, _small_tree().depth, _small_tree().num_nodes, LR, 0), ValueError,
     "max_nodes"),
    (lambda: _C.select_subtree(_small_tree().parents, _small_tree().depth, _small_tree().num_nodes, LR, 2,
                               rule="best"), ValueError, "rule"),
    (lambda: _C.tree_mask(_corrupt("parents", 0, 2, 3).parents, _small_tree().depth, _small_tree().num_nodes,
                          torch.zeros(2, dtype=torch.int64)), ValueError, r"tree\.parents\[0,2\]"),
    (lambda: _C.accept_greedy(_small_tree().tokens, _small_tree().parents, torch.tensor([5, 6], dtype=torch.int32),
                              torch.zeros(2, 5, dtype=torch.int64), 3), ValueError, r"tree\.num_nodes\[1\]"),
    (lambda: _C.compact_kv([LR.view(2, 1, 5, 1)], [LR.view(2, 1, 5, 1)], torch.zeros(2, dtype=torch.int64),
                           torch.zeros(2, 1, dtype=torch.int64)), ValueError, "same tensor appears more than once"),
])
def test_extension_checks_its_own_arguments(call, exc, match):
    # The bindings re-check what their memory accesses rely on, even when called without the public op.
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("bad_path,match", [
    ([[0, 2, 1, -1], [0, 1, -1, -1]], r"path\[0,2\]"),   # not increasing
    ([[0, 1, -1, 3], [0, 1, -1, -1]], r"path\[0,3\]"),   # node after padding
    ([[0, 1, 2, -1], [0, 1, 40, -1]], r"path\[1,2\]"),   # past the cache
    ([[0, -3, -1, -1], [0, 1, -1, -1]], r"path\[0,1\]"),  # not a node index
])
@pytest.mark.parametrize("through", ["op", "extension"])
def test_compact_kv_bad_path_leaves_cache_untouched(bad_path, match, through):
    keys, values = _caches(1, 2, 16, torch.float32)
    before = [t.clone() for t in keys + values]
    prefix = torch.tensor([2, 3])
    path = torch.tensor(bad_path)
    with pytest.raises(ValueError, match=match):
        if through == "op":
            tk.compact_kv(keys, values, prefix, path, backend="cpp")
        else:
            _C.compact_kv(keys, values, prefix, path)
    assert_all_same(before, keys + values, "cache after a rejected call")


# ------------------------------------------------------------------------------- validation fast path
FIELDS = ("parents", "depth", "num_nodes", "tokens")


@HYP
@given(tree=trees(max_n=12, vocab=6), field=st.sampled_from(FIELDS), data=st.data())
def test_validate_tree_fast_path_agrees_with_python(tree, field, data):
    t = getattr(tree, field)
    flat = t.view(-1)
    k = data.draw(st.integers(0, flat.numel() - 1))
    flat[k] = data.draw(st.integers(-3, 14))
    vocab = data.draw(st.sampled_from([None, 4, 6]))

    def message():
        try:
            validate_tree(tree, vocab_size=vocab)
        except ValueError as exc:
            return str(exc)
        return None

    fast = message()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bk, "load_extension", lambda name: (None, "disabled for this test"))
        slow = message()
    assert fast == slow
    code = int(_C.validate_tree(tree.tokens, tree.parents, tree.depth, tree.num_nodes, -1 if vocab is None else vocab)[0])
    assert (code == 0) == (slow is None)


# ------------------------------------------------------------------------------------------- plumbing
def test_default_cpu_backend_is_cpp(monkeypatch):
    monkeypatch.delenv("TAPS_BACKEND", raising=False)
    for op in ("best_first_pool", "propagate_reach", "select_subtree", "tree_mask", "accept_greedy", "compact_kv"):
        assert bk.resolve(op, None, CPU)[0] == "cpp", op


def test_timers_return_wall_and_cpu_seconds():
    pool = tk.candidate_pool(torch.randn(1, 4, 30), torch.tensor([0]), 4, 20, backend="cpp", pool_backend="cpp")
    wall, cpu = _C.time_best_first_pool(pool.topk_logp, pool.topk_ids, torch.tensor([0]), 20, 3)
    assert wall > 0 and cpu >= 0
    wall, cpu = _C.time_select_subtree(pool.tree.parents, pool.tree.depth, pool.tree.num_nodes, pool.logq, 5, iters=3)
    assert wall > 0 and cpu >= 0


def test_cpp_impls_import_fails_cleanly_without_extension(monkeypatch):
    # Hide the built extension: "from . import _C" then raises, and so must the backend module.
    monkeypatch.delitem(sys.modules, "taps_kernels.cpp_impls", raising=False)
    monkeypatch.setitem(sys.modules, "taps_kernels._C", None)
    monkeypatch.delattr(tk, "_C", raising=False)
    with pytest.raises(ImportError, match=r"taps_kernels\._C is not available"):
        importlib.import_module("taps_kernels.cpp_impls")
