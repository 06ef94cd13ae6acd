"""Edge scorer: reference properties, an independent per-edge oracle built from nn modules, Triton parity."""
import os

import pytest
import torch
from torch import nn

import taps_kernels
from taps_kernels import CandidatePool, ScorerWeights, Tree, candidate_pool, score_edges
from taps_kernels.reference.reach import propagate_reach_reference
from taps_kernels.reference.score import score_edges_reference

try:
    import triton  # noqa: F401
    from taps_kernels.triton.edge_score import score_edges_triton
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

if not HAVE_TRITON:
    DEVICES = [pytest.param("cpu", marks=pytest.mark.skip(reason="triton is not installed"))]
elif torch.cuda.is_available():
    DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)]
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICES = ["cpu"]
else:
    DEVICES = [pytest.param("cpu", marks=pytest.mark.skip(reason="no CUDA and TRITON_INTERPRET is not 1"))]

V, E, H = 50, 40, 24  # E, H not powers of two: the projections' K loop is ragged
TOL = (3e-5, 1e-5)    # (atol, rtol) for every log output; -inf positions must match exactly

POOLS = {
    # name: (B, D, top_k, pool_size); "padded" cannot fill its pool (2 + 4 nodes exist)
    "n31": (2, 5, 4, 30),
    "n71": (2, 5, 4, 70),
    "padded": (2, 2, 2, 10),
    "n1": (1, 3, 3, 1),
    "n129": (1, 6, 8, 128),   # the shipped policy's pool: 129 rows, two 128-node tiles in the propagation kernel
}


def make_pool(name, seed=0):
    B, D, top_k, pool_size = POOLS[name]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, D, V, generator=g) * 2
    roots = torch.randint(0, V, (B,), generator=g)
    pool = candidate_pool(logits, roots, top_k, pool_size, backend="reference", pool_backend="reference")
    emb = torch.randn(V, E, generator=g)
    hidden = torch.randn(B, D, H, generator=g)
    return pool, emb, hidden


def make_weights(kind, D, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    return ScorerWeights.random(E, H, max_depth=D + 2, tiny=(kind == "tiny"), generator=g)


def assert_log_close(got, want, name):
    got = got.cpu()
    assert got.dtype == torch.float32, f"{name}: dtype {got.dtype}"
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{name}: -inf pattern differs"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=TOL[0], rtol=TOL[1], msg=lambda m: f"{name}: {m}")


# --- the reference against its own definition ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["full", "tiny", "none"])
@pytest.mark.parametrize("pool_name", ["n71", "padded"])
def test_reference_normalisation_and_reach(kind, pool_name):
    pool, emb, hidden = make_pool(pool_name)
    edge, other, reach = score_edges_reference(pool, make_weights(kind, pool.topk_logp.shape[1]), emb, hidden)
    parents = pool.tree.parents.long()
    B, N = parents.shape
    real = (torch.arange(N)[None] == 0) | (parents >= 0)
    for b in range(B):
        for u in range(N):
            if not real[b, u]:
                assert edge[b, u] == -float("inf") and other[b, u] == -float("inf") and reach[b, u] == -float("inf")
                continue
            kids = (parents[b] == u).nonzero()[:, 0]
            total = other[b, u].exp() + edge[b, kids].exp().sum()
            if len(kids) == 0:
                assert other[b, u] == 0.0, f"childless node {u} must keep the whole mass in 'other'"
            elif kind != "none":
                assert abs(float(total) - 1.0) < 1e-5, f"row {b} parent {u}: q_cond sums to {float(total)}"
            else:
                assert float(total) <= 1.0 + 1e-5
    assert torch.equal(reach, propagate_reach_reference(pool.tree.parents, edge))
    assert (edge[:, 1:][real[:, 1:]] <= 0).all()  # so reach never grows along a path
    if kind == "none":
        assert torch.equal(reach, pool.logq) and torch.equal(edge[:, 1:], pool.step_logq[:, 1:])


def test_reference_matches_a_per_edge_oracle_built_from_nn_modules():
    """Rebuild the feature rows by hand from the docstring table with nn modules, edge by edge."""
    pool, emb, hidden = make_pool("n31", seed=3)
    D = pool.topk_logp.shape[1]
    w = make_weights("full", D, seed=4)
    tok = nn.Linear(E, 32)
    hid = nn.Linear(H, 32)
    dep = nn.Embedding(D + 3, 8)
    heads = {}
    for head in ("edge", "other"):
        heads[head] = nn.Sequential(nn.LayerNorm(111), nn.Linear(111, 64), nn.SiLU(), nn.Linear(64, 1))
    with torch.no_grad():
        tok.weight.copy_(w.token_proj_weight), tok.bias.copy_(w.token_proj_bias)
        hid.weight.copy_(w.hidden_proj_weight), hid.bias.copy_(w.hidden_proj_bias)
        dep.weight.copy_(w.depth_embedding)
        for head, seq in heads.items():
            seq[0].weight.copy_(getattr(w, f"{head}_ln_weight")), seq[0].bias.copy_(getattr(w, f"{head}_ln_bias"))
            seq[1].weight.copy_(getattr(w, f"{head}_fc1_weight")), seq[1].bias.copy_(getattr(w, f"{head}_fc1_bias"))
            seq[3].weight.copy_(getattr(w, f"{head}_fc2_weight")), seq[3].bias.copy_(getattr(w, f"{head}_fc2_bias"))
    edge_ref, other_ref, _ = score_edges_reference(pool, w, emb, hidden)
    t = pool.tree
    b = 1
    n = int(t.num_nodes[b])

    def stats(p):
        return [float(pool.entropy[b, p]), float(pool.margin[b, p]), float(pool.topk_mass[b, p])]

    with torch.no_grad():
        def edge_logit(v):
            u, d = int(t.parents[b, v]), int(t.depth[b, v])
            lq = float(pool.logq[b, v])
            scal = torch.tensor([float(pool.step_logq[b, v])] + stats(d - 1) + [d / D, lq, lq / d])
            x = torch.cat([tok(emb[t.tokens[b, v]]), tok(emb[t.tokens[b, u]]), dep.weight[d], hid(hidden[b, d - 1]),
                           scal])
            return heads["edge"](x)[0]

        def other_logit(u):
            du = int(t.depth[b, u])
            lq = float(pool.logq[b, u])
            mass = float(pool.topk_mass[b, du])
            scal = torch.tensor([float(torch.log(torch.tensor(max(1 - mass, 1e-6))))] + stats(du)
                                + [(du + 1) / D, lq, lq / (du + 1)])
            x = torch.cat([torch.zeros(32), tok(emb[t.tokens[b, u]]), dep.weight[du + 1], hid(hidden[b, du]), scal])
            return heads["other"](x)[0]

        checked = 0
        for u in range(n):
            kids = [v for v in range(n) if int(t.parents[b, v]) == u]
            if not kids:
                continue
            logits = torch.stack([other_logit(u)] + [edge_logit(v) for v in kids])
            logq = torch.log_softmax(logits, 0)
            torch.testing.assert_close(other_ref[b, u], logq[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(edge_ref[b, kids], logq[1:], atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked >= 3


def test_published_parameter_counts():
    tiny = ScorerWeights.random(tiny=True)
    assert tiny.num_parameters() == 2 * 303  # 303 per head (edge and other)
    assert ScorerWeights.random(E, H, 15).dims == (32, 8, 32, 111, 64)


def test_op_validation_names_the_argument():
    pool, emb, hidden = make_pool("n31")
    w = make_weights("full", 5)
    with pytest.raises(ValueError, match="depth_embedding"):
        score_edges(pool, ScorerWeights.random(E, H, max_depth=3), emb, hidden, backend="reference")
    with pytest.raises(TypeError, match="drafter_hidden"):
        score_edges(pool, w, emb, None, backend="reference")
    with pytest.raises(ValueError, match="token_proj_weight"):
        score_edges(pool, w, torch.randn(V, E + 1), hidden, backend="reference")
    bad = make_weights("full", 5)
    bad.edge_fc1_weight = bad.edge_fc1_weight[:, :-1]
    with pytest.raises(ValueError, match="edge_fc1_weight"):
        score_edges(pool, bad, emb, hidden, backend="reference")


# --- Triton against the reference ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["full", "tiny", "none"])
@pytest.mark.parametrize("pool_name", ["n31", "n71", "padded", "n1"])
def test_triton_matches_reference(device, kind, pool_name):
    pool, emb, hidden = make_pool(pool_name, seed=len(pool_name))
    w = make_weights(kind, pool.topk_logp.shape[1])
    want = score_edges_reference(pool, w, emb, hidden)
    dev_pool = type(pool)(pool.tree.to(device), *(getattr(pool, f).to(device) for f in
                                                  ("logq", "step_logq", "rank", "topk_logp", "topk_ids", "entropy",
                                                   "margin", "topk_mass")))
    got = score_edges(dev_pool, None if w is None else w.to(device), emb.to(device), hidden.to(device),
                      backend="triton")
    for name, g, r in zip(("edge_logq", "other_logq", "log_reach"), got, want):
        assert_log_close(g, r, name)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_low_precision_embeddings(device):
    pool, emb, hidden = make_pool("n31", seed=7)
    w = make_weights("full", 5)
    emb16, hid16 = emb.half(), hidden.half()
    want = score_edges_reference(pool, w, emb16, hid16)  # the reference also reads them as float32
    dev_pool = type(pool)(pool.tree.to(device), *(getattr(pool, f).to(device) for f in
                                                  ("logq", "step_logq", "rank", "topk_logp", "topk_ids", "entropy",
                                                   "margin", "topk_mass")))
    got = score_edges_triton(dev_pool, w.to(device), emb16.to(device), hid16.to(device))
    for name, g, r in zip(("edge_logq", "other_logq", "log_reach"), got, want):
        assert_log_close(g, r, name)


def test_registered_backends():
    cpu = torch.device("cpu")
    reasons = taps_kernels.available_backends("score_edges", cpu)
    assert reasons["reference"] == ""
    pool, _, _ = make_pool("n31")
    assert torch.equal(score_edges(pool, None)[2], pool.logq)  # default backend on CPU


def _to(pool, device):
    return type(pool)(pool.tree.to(device), *(getattr(pool, f).to(device) for f in
                                              ("logq", "step_logq", "rank", "topk_logp", "topk_ids", "entropy",
                                               "margin", "topk_mass")))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["full", "none"])
def test_triton_multi_tile_pools(device, kind):
    # more than one 16-node tile in the logits kernel and one 128-node tile in the propagation kernel
    for name in ("n129",):
        pool, emb, hidden = make_pool(name, seed=11)
        assert pool.tree.tokens.shape[1] > 128
        w = make_weights(kind, pool.topk_logp.shape[1])
        want = score_edges_reference(pool, w, emb, hidden)
        got = score_edges_triton(_to(pool, device), None if w is None else w.to(device), emb.to(device),
                                 hidden.to(device))
        for label, g, r in zip(("edge_logq", "other_logq", "log_reach"), got, want):
            assert_log_close(g, r, f"{name} {label}")


def chain_pool(n, D, seed=0):
    """A chain root -> 1 -> ... -> n-1, deeper than the D draft positions its statistics cover."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (1, n), generator=g)
    parents = torch.arange(-1, n - 1, dtype=torch.int32)[None]
    depth = torch.arange(n, dtype=torch.int32)[None]
    tree = Tree(tokens, parents, depth, torch.tensor([n], dtype=torch.int32))
    step = -torch.rand(1, n, generator=g)
    step[:, 0] = 0
    logq = step.cumsum(1)
    topk_logp = -torch.rand(1, D, 4, generator=g).sort(-1, descending=True).values
    pool = CandidatePool(tree, logq, step, torch.zeros(1, n, dtype=torch.int32), topk_logp,
                         torch.zeros(1, D, 4, dtype=torch.int64), torch.rand(1, D, generator=g),
                         torch.rand(1, D, generator=g), torch.rand(1, D, generator=g) * 0.9)
    return pool, torch.randn(V, E, generator=g), torch.randn(1, D, H, generator=g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["full", "tiny", "none"])
def test_tree_deeper_than_the_draft_positions(device, kind):
    # a 30-node chain over D = 2 positions: depths 3..29 read position D-1 = 1 and still get a finite reach
    pool, emb, hidden = chain_pool(30, 2, seed=5)
    w = None if kind == "none" else ScorerWeights.random(E, H, max_depth=40, tiny=kind == "tiny",
                                                         generator=torch.Generator().manual_seed(2))
    want = score_edges_reference(pool, w, emb, hidden)
    assert torch.isfinite(want[2]).all()
    backends = {"triton": lambda: score_edges_triton(_to(pool, device), None if w is None else w.to(device),
                                                     emb.to(device), hidden.to(device))}
    if taps_kernels.backend.has_impl("score_edges", "cpp") and not taps_kernels.backend.unavailable_reason(
            "cpp", torch.device("cpu")):
        cpp = taps_kernels.backend.resolve("score_edges", "cpp", torch.device("cpu"))[1]
        backends["cpp"] = lambda: cpp(pool, w, emb, hidden)
    for backend, fn in backends.items():
        for label, g, r in zip(("edge_logq", "other_logq", "log_reach"), fn(), want):
            assert_log_close(g, r, f"{backend} {label}")


@pytest.mark.parametrize("device", DEVICES)
def test_launcher_alone_with_zero_positions_and_wild_indices(device):
    pool, emb, hidden = make_pool("n31")
    w = make_weights("full", 5)
    empty = CandidatePool(pool.tree, pool.logq, pool.step_logq, pool.rank, pool.topk_logp[:, :0],
                          pool.topk_ids[:, :0], pool.entropy[:, :0], pool.margin[:, :0], pool.topk_mass[:, :0])
    with pytest.raises(ValueError, match="D >= 1"):
        score_edges_triton(_to(empty, device), w.to(device), emb.to(device), hidden[:, :0].to(device))
    # without a scorer no statistic is read: D = 0 behaves like the reference
    got = score_edges_triton(_to(empty, device), None, None, None)
    for label, g, r in zip(("edge_logq", "other_logq", "log_reach"), got,
                           score_edges_reference(empty, None, None, None)):
        assert_log_close(g, r, label)
    with pytest.raises(ValueError, match="entropy"):
        bad = CandidatePool(pool.tree, pool.logq, pool.step_logq, pool.rank, pool.topk_logp, pool.topk_ids,
                            pool.entropy[:, :2], pool.margin, pool.topk_mass)
        score_edges_triton(_to(bad, device), w.to(device), emb.to(device), hidden.to(device))
    # token ids past the vocabulary are clamped in the kernel (the op rejects them): no read outside the table
    wild = Tree(pool.tree.tokens + V, pool.tree.parents, pool.tree.depth, pool.tree.num_nodes)
    clamped = Tree(torch.full_like(pool.tree.tokens, V - 1), pool.tree.parents, pool.tree.depth, pool.tree.num_nodes)
    got = score_edges_triton(_to(CandidatePool(wild, *[getattr(pool, f) for f in (
        "logq", "step_logq", "rank", "topk_logp", "topk_ids", "entropy", "margin", "topk_mass")]), device),
        w.to(device), emb.to(device), hidden.to(device))
    want = score_edges_reference(CandidatePool(clamped, *[getattr(pool, f) for f in (
        "logq", "step_logq", "rank", "topk_logp", "topk_ids", "entropy", "margin", "topk_mass")]), w, emb, hidden)
    for label, g, r in zip(("edge_logq", "other_logq", "log_reach"), got, want):
        assert_log_close(g, r, label)
