"""TAPS scorer module: ScorerWeights round trip, forward == taps_kernels.score_edges reference, save/load."""
import pytest
import torch

from taps_kernels import ScorerWeights, candidate_pool, score_edges
from taps.scoring.io import load_scorer, load_scorer_weights, save_scorer
from taps.scoring.model import TapsScorer, count_parameters

V, E, H = 50, 40, 24
TOL = dict(atol=3e-5, rtol=1e-5)

POOLS = {"n31": (2, 5, 4, 30), "padded": (2, 2, 2, 10), "n1": (1, 3, 3, 1)}


def make_pool(name, seed=0):
    B, D, top_k, pool_size = POOLS[name]
    g = torch.Generator().manual_seed(seed)
    pool = candidate_pool(torch.randn(B, D, V, generator=g) * 2, torch.randint(0, V, (B,), generator=g), top_k,
                          pool_size, backend="reference", pool_backend="reference")
    return pool, torch.randn(V, E, generator=g), torch.randn(B, D, H, generator=g)


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
