"""TAPS scorer module: ScorerWeights round trip, forward against an independent float64 scorer written here
from the feature table (no shared feature code), forward == taps_kernels.score_edges reference, save/load."""
import math

import pytest
import torch

from taps_kernels import ScorerWeights, candidate_pool, score_edges
from taps.scoring.io import load_scorer, load_scorer_weights, save_scorer
from taps.scoring.model import TapsScorer, count_parameters

V, E, H = 50, 40, 24
TOL = dict(atol=3e-5, rtol=1e-5)

POOLS = {"n31": (2, 5, 4, 30), "padded": (2, 2, 2, 10), "n1": (1, 3, 3, 1)}


def make_pool(name, seed=0, with_logits=False):
    B, D, top_k, pool_size = POOLS[name]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, D, V, generator=g) * 2
    pool = candidate_pool(logits, torch.randint(0, V, (B,), generator=g), top_k,
                          pool_size, backend="reference", pool_backend="reference")
    out = (pool, torch.randn(V, E, generator=g), torch.randn(B, D, H, generator=g))
    return out + (logits, top_k) if with_logits else out


def independent_scorer(w, logits, top_k, tokens, parents, depth, n_nodes, emb, hid):
    """Edge/other/reach log-probs of one pool row, node by node in float64, from the draft logits ``[D, V]``
    and the feature table of ``taps_kernels/reference/score.py`` (statistics recomputed here)."""
    d64 = {k: v.double() for k, v in w.tensors().items()}
    D = logits.shape[0]
    logp = torch.log_softmax(logits.double(), -1)
    top = logp.sort(descending=True).values
    ent = [float(-(logp[p].exp() * logp[p]).sum()) for p in range(D)]
    margin = [float(top[p, 0] - top[p, 1]) for p in range(D)]
    mass = [float(top[p, :top_k].exp().sum()) for p in range(D)]
    full = w.full

    def tok(t):
        return d64["token_proj_weight"] @ emb[t].double() + d64["token_proj_bias"]

    def hidp(p):
        return d64["hidden_proj_weight"] @ hid[p].double() + d64["hidden_proj_bias"]

    def head(name, x):
        mu, var = x.mean(), ((x - x.mean()) ** 2).mean()
        y = (x - mu) / math.sqrt(var + w.ln_eps) * d64[f"{name}_ln_weight"] + d64[f"{name}_ln_bias"]
        h = d64[f"{name}_fc1_weight"] @ y + d64[f"{name}_fc1_bias"]
        h = h * torch.sigmoid(h)
        return float(d64[f"{name}_fc2_weight"] @ h + d64[f"{name}_fc2_bias"])

    def feats(child, parent, d, step, cum):
        p = d - 1
        scal = torch.tensor([step, ent[p], margin[p], mass[p], d / D, cum, cum / d], dtype=torch.float64)
        if not full:
            return scal
        pt = d64["token_proj_weight"].shape[0]
        ctok = tok(child) if child is not None else torch.zeros(pt, dtype=torch.float64)
        return torch.cat([ctok, tok(parent), d64["depth_embedding"][d], hidp(p), scal])

    cum = [0.0] * n_nodes
    for v in range(1, n_nodes):
        cum[v] = cum[parents[v]] + float(logp[depth[v] - 1, tokens[v]])
    children = {u: [v for v in range(1, n_nodes) if parents[v] == u] for u in range(n_nodes)}
    edge, other, reach = [0.0] * n_nodes, [0.0] * n_nodes, [0.0] * n_nodes
    for u in range(n_nodes):
        kids = children[u]
        if not kids:
            continue
        du = depth[u]
        l_other = head("other", feats(None, tokens[u], du + 1, math.log(max(1 - mass[du], 1e-6)), cum[u]))
        l_kids = [head("edge", feats(tokens[v], tokens[u], depth[v], float(logp[depth[v] - 1, tokens[v]]), cum[v]))
                  for v in kids]
        z = torch.logsumexp(torch.tensor([l_other] + l_kids, dtype=torch.float64), 0).item()
        other[u] = l_other - z
        for v, lv in zip(kids, l_kids):
            edge[v] = lv - z
    for v in range(1, n_nodes):
        reach[v] = reach[parents[v]] + edge[v]
    return edge, other, reach


def make_model(tiny, seed=1, D=5):
    torch.manual_seed(seed)
    m = TapsScorer(embed_dim=E, hidden_dim=H, max_depth=D, tiny=tiny)
    with torch.no_grad():  # non-trivial LayerNorm affine and depth rows, so every slot matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def assert_log_equal(got, want):
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], **TOL)


@pytest.mark.parametrize("tiny", [False, True])
def test_to_weights_round_trip(tiny):
    m = make_model(tiny)
    w = m.to_weights()
    assert isinstance(w, ScorerWeights) and w.full == (not tiny)
    w.validate(embed_dim=None if tiny else E, hidden_dim=None if tiny else H, num_positions=5)
    assert w.num_parameters() == count_parameters(m)
    if tiny:
        assert w.num_parameters() == 2 * 303
    m2 = TapsScorer.from_weights(w)
    w2 = m2.to_weights()
    for k, t in w.tensors().items():
        assert torch.equal(t, w2.tensors()[k]), k
    # copies, not views of the parameters
    with torch.no_grad():
        m.edge_head[1].weight.add_(1.0)
    assert not torch.equal(w.edge_fc1_weight, m.edge_head[1].weight)


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("pool_name", list(POOLS))
def test_forward_matches_score_edges_reference(tiny, pool_name):
    pool, emb, hid = make_pool(pool_name)
    D = pool.topk_logp.shape[1]
    m = make_model(tiny, D=D)
    got = m(pool, None if tiny else emb, None if tiny else hid)
    want = score_edges(pool, m.to_weights(), None if tiny else emb, None if tiny else hid, backend="reference")
    for g, w in zip(got, want):
        assert_log_equal(g.detach(), w)


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("pool_name", ["n31", "padded"])
def test_forward_matches_an_independent_float64_scorer(tiny, pool_name):
    pool, emb, hid, logits, top_k = make_pool(pool_name, with_logits=True)
    D = pool.topk_logp.shape[1]
    m = make_model(tiny, D=D)
    with torch.no_grad():
        got = m(pool, None if tiny else emb, None if tiny else hid)
    tr = pool.tree
    for b in range(tr.tokens.shape[0]):
        n = int(tr.num_nodes[b])
        want = independent_scorer(m.to_weights(), logits[b], top_k, tr.tokens[b].tolist(), tr.parents[b].tolist(),
                                  tr.depth[b].tolist(), n, emb, hid[b])
        for g, w_ in zip(got, want):
            assert torch.equal(g[b, n:], torch.full_like(g[b, n:], float("-inf")))  # padding rows
            # float32 against float64 over ~100-wide LayerNorm/MLP sums of O(1) values: ~1e-6 relative each
            torch.testing.assert_close(g[b, :n].double(), torch.tensor(w_, dtype=torch.float64), atol=1e-4, rtol=1e-4)
        assert got[0][b, 0] == 0 and got[2][b, 0] == 0  # the root's edge and reach


def test_forward_is_differentiable_without_nan():
    pool, emb, hid = make_pool("padded")
    m = make_model(False, D=2)
    e, o, r = m(pool, emb, hid)
    loss = torch.where(torch.isfinite(r), r, torch.zeros_like(r)).sum() + torch.where(torch.isfinite(o), o, 0 * o).sum()
    loss.backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("tiny", [False, True])
def test_save_load_dir(tmp_path, tiny):
    m = make_model(tiny)
    save_scorer(tmp_path / "s", m, meta={"drafter": {"sha256": "abc"}}, readme="# x\n")
    w, cfg = load_scorer_weights(tmp_path / "s")
    assert cfg["meta"]["drafter"]["sha256"] == "abc" and cfg["model"]["tiny"] == tiny
    for k, t in m.to_weights().tensors().items():
        assert torch.equal(t, w.tensors()[k]), k
    m2, _ = load_scorer(tmp_path / "s")
    assert m2.config() == m.config()


def test_load_missing_dir_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_scorer_weights(tmp_path)
