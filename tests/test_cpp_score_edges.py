"""C++ ``score_edges`` (``taps_kernels._C``) against the PyTorch reference (``reference/score.py``, the spec).

Float outputs follow flash-attention's rule (``helpers.assert_within_torch_error``): against the same math in
float64 (:func:`score_edges_float64`), the C++ error is at most twice that of the float32 reference (the C++
projections, LayerNorm moments and fc1 sum in a different order from torch's, and exp is a polynomial on the
AVX-512 path). The -inf pattern, the root values (edge 0, reach 0) and the exact 0 of a childless node's
``other_logq`` must be identical. The marginal model (no scorer) does no matmul, so its ``edge_logq`` and
``log_reach`` must be bit-identical.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import taps_kernels as tk
from taps_kernels import ScorerWeights
from taps_kernels import backend as bk
from taps_kernels.layout import CandidatePool, Tree
from taps_kernels.reference.score import score_edges_reference
from taps_kernels.scorer_weights import OTHER_MASS_FLOOR

from helpers import assert_within_torch_error

CPU = torch.device("cpu")
_WHY = bk.unavailable_reason("cpp", CPU)  # the extension only: a missing registration must fail, not skip
pytestmark = pytest.mark.skipif(bool(_WHY), reason=f"C++ backend unavailable: {_WHY}")
if not _WHY:
    from taps_kernels import _C

OUTPUTS = ("edge_logq", "other_logq", "log_reach")

V, E, H = 97, 59, 45  # E and H not multiples of 16: masked tails in the projections

# name: (B, D, top_k, pool_size, real nodes kept per row or None)
POOLS = {
    "n129": (1, 15, 64, 128, None),          # the decoder's shape (D = 15, K = 64, 128 nodes + root)
    "mixed": (3, 7, 5, 40, [41, 17, 1]),    # rows padded to different lengths, one root-only row
    "lattice": (2, 2, 3, 20, None),         # the 3 + 9 lattice cannot fill 20 nodes: padding at the end
    "n1": (1, 1, 1, 1, None),
    "n258": (2, 5, 33, 257, [258, 100]),
}


def truncate(pool: CandidatePool, keep) -> CandidatePool:
    """Turn every node from ``keep[b]`` on into padding (pop order is topological, so the rest is a tree)."""
    t = pool.tree
    tokens, parents, depth = t.tokens.clone(), t.parents.clone(), t.depth.clone()
    logq, step, rank = pool.logq.clone(), pool.step_logq.clone(), pool.rank.clone()
    for b, n in enumerate(keep):
        tokens[b, n:], parents[b, n:], depth[b, n:], rank[b, n:] = 0, -1, 0, -1
        logq[b, n:] = step[b, n:] = float("-inf")
    num_nodes = torch.minimum(t.num_nodes, torch.tensor(keep, dtype=torch.int32))
    return CandidatePool(Tree(tokens, parents, depth, num_nodes), logq, step, rank, pool.topk_logp, pool.topk_ids,
                         pool.entropy, pool.margin, pool.topk_mass)


def score_edges_float64(pool, weights, token_embeddings, drafter_hidden):
    """:func:`score_edges_reference`'s math (``reference/score.py``) in float64, step for step; the reference
    itself computes in float32 whatever its inputs are. The float64 side of the tolerance rule."""
    tree = pool.tree
    B, N = tree.tokens.shape
    D = pool.topk_logp.shape[1]
    f64 = dict(dtype=torch.float64)
    parents, depth = tree.parents.long(), tree.depth.long()
    real = (torch.arange(N)[None, :] == 0) | (parents >= 0)
    edge_valid = parents >= 0
    parent = parents.clamp(min=0)
    neg_inf = torch.full((B, N), float("-inf"), **f64)
    zero = torch.zeros(B, N, **f64)
    if weights is None:
        step = pool.step_logq.double()
        edge_logq = torch.where(edge_valid, step, neg_inf)
        edge_logq[:, 0] = 0.0
        child_mass = zero.scatter_add(1, parent, torch.where(edge_valid, step.exp(), zero))
        other_logq = torch.where(real, torch.log(torch.clamp(1 - child_mass, min=0.0)), neg_inf)
    else:
        def at(stat, pos):
            return stat.double().gather(1, pos.clamp(0, D - 1))

        d = depth.clamp(min=1).double()
        pos = depth - 1
        logq = torch.where(edge_valid, pool.logq.double(), zero)
        step = torch.where(edge_valid, pool.step_logq.double(), zero)
        edge_f = torch.stack([step, at(pool.entropy, pos), at(pool.margin, pos), at(pool.topk_mass, pos), d / D, logq,
                              logq / d], dim=-1)
        d_o, pos_o = (depth + 1).double(), depth
        mass_o = at(pool.topk_mass, pos_o)
        logq_u = torch.where(real, pool.logq.double(), zero)
        other_f = torch.stack([torch.log(torch.clamp(1 - mass_o, min=OTHER_MASS_FLOOR)), at(pool.entropy, pos_o),
                               at(pool.margin, pos_o), mass_o, d_o / D, logq_u, logq_u / d_o], dim=-1)
        w = weights.to(dtype=torch.float64)
        if weights.full:
            tok = token_embeddings.double()[tree.tokens] @ w.token_proj_weight.T + w.token_proj_bias
            par = tok.gather(1, parent[..., None].expand_as(tok))
            hid = drafter_hidden.double() @ w.hidden_proj_weight.T + w.hidden_proj_bias
            Ph = hid.shape[-1]
            hid_e = hid.gather(1, pos.clamp(0, D - 1)[..., None].expand(B, N, Ph))
            hid_o = hid.gather(1, pos_o.clamp(0, D - 1)[..., None].expand(B, N, Ph))
            rows = w.depth_embedding.shape[0]
            edge_f = torch.cat([tok, par, w.depth_embedding[depth.clamp(0, rows - 1)], hid_e, edge_f], dim=-1)
            other_f = torch.cat([torch.zeros_like(tok), tok, w.depth_embedding[(depth + 1).clamp(0, rows - 1)], hid_o,
                                 other_f], dim=-1)

        def mlp(x, head):
            p = {k: getattr(w, f"{head}_{k}") for k in ("ln_weight", "ln_bias", "fc1_weight", "fc1_bias", "fc2_weight",
                                                        "fc2_bias")}
            x = F.layer_norm(x, (x.shape[-1],), p["ln_weight"], p["ln_bias"], w.ln_eps)
            return (F.silu(x @ p["fc1_weight"].T + p["fc1_bias"]) @ p["fc2_weight"].T + p["fc2_bias"])[..., 0]

        el = torch.where(edge_valid, mlp(edge_f, "edge"), neg_inf)
        ol = torch.where(real & (depth < D), mlp(other_f, "other"), zero)
        ol = torch.where(real, ol, neg_inf)
        seg_max = ol.clone().scatter_reduce(1, parent, el, reduce="amax", include_self=True)
        seg_max = torch.where(real, seg_max, zero)
        total = torch.exp(ol - seg_max).scatter_add(
            1, parent, torch.where(edge_valid, torch.exp(el - seg_max.gather(1, parent)), zero))
        log_z = seg_max + torch.log(total)
        edge_logq = torch.where(edge_valid, el - log_z.gather(1, parent), neg_inf)
        edge_logq[:, 0] = 0.0
        other_logq = torch.where(real, ol - log_z, neg_inf)
    log_reach = neg_inf.clone()
    log_reach[:, 0] = 0.0
    for _ in range(N):  # after k sweeps every node at depth <= k is final
        new = torch.where(edge_valid, log_reach.gather(1, parent) + edge_logq, log_reach)
        new[:, 0] = 0.0
        if torch.equal(new, log_reach):
            break
        log_reach = new
    return edge_logq, other_logq, log_reach


def make_case(name, seed=0, vocab=V, embed=E, hidden=H):
    B, D, top_k, pool_size, keep = POOLS[name]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, D, vocab, generator=g) * 3
    pool = tk.candidate_pool(logits, torch.randint(0, vocab, (B,), generator=g), top_k, pool_size,
                             backend="reference", pool_backend="reference")
    if keep is not None:
        pool = truncate(pool, keep)
    emb = torch.randn(vocab, embed, generator=g)
    hid = torch.randn(B, D, hidden, generator=g)
    return pool, emb, hid


def make_weights(kind, D, seed=1, embed=E, hidden=H, **dims):
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(seed)
    return ScorerWeights.random(embed, hidden, max_depth=D + 2, tiny=(kind == "tiny"), generator=g, **dims)


def references(pool, weights, token_embeddings, drafter_hidden):
    """``(score_edges_reference(...), score_edges_float64(...))``: PyTorch's float32 result and the float64 one."""
    return (score_edges_reference(pool, weights, token_embeddings, drafter_hidden),
            score_edges_float64(pool, weights, token_embeddings, drafter_hidden))


def check_against_reference(got, want, exact64, exact=(), factor=2.0):
    """``got``/``want``/``exact64``: (edge_logq, other_logq, log_reach) of the C++, the float32 reference and
    :func:`score_edges_float64`; ``factor``: the tolerance rule's. Returns the max abs error per output against
    ``exact64``."""
    errors = {}
    for name, g, w, r in zip(OUTPUTS, got, want, exact64):
        assert g.dtype == torch.float32 and g.shape == w.shape, f"{name}: {g.dtype}{tuple(g.shape)}"
        inf = torch.isinf(w)
        where = (torch.isinf(g) != inf).nonzero()[:5].tolist()
        assert torch.equal(torch.isinf(g), inf), f"{name}: -inf pattern differs at {where}"
        assert torch.equal(g[inf], w[inf]), f"{name}: an infinity has the wrong sign"
        assert not g.isnan().any(), f"{name}: NaN"
        if name in exact:
            assert torch.equal(g, w), f"{name}: expected bit-identical values"
        fin = ~inf
        assert torch.equal(torch.isinf(r), inf), f"{name}: the float64 run has another -inf pattern"
        if fin.any():
            assert_within_torch_error(g[fin], w[fin], r[fin], factor=factor, what=name)
        errors[name] = float((g[fin].double() - r[fin]).abs().max()) if fin.any() else 0.0
    edge, other, reach = got
    assert torch.equal(edge[:, 0], torch.zeros_like(edge[:, 0])), "root edge_logq must be exactly 0"
    assert torch.equal(reach[:, 0], torch.zeros_like(reach[:, 0])), "root log_reach must be exactly 0"
    zero = want[1] == 0  # childless real nodes (with a scorer: exactly 0 by construction)
    assert torch.equal(other[zero], want[1][zero]), "other_logq must be exactly 0 where the reference's is"
    return errors


# --------------------------------------------------------------------------------------- against the reference
@pytest.mark.parametrize("kind", ["full", "tiny", "none"])
@pytest.mark.parametrize("pool_name", list(POOLS))
def test_matches_reference(kind, pool_name):
    pool, emb, hid = make_case(pool_name, seed=len(pool_name))
    w = make_weights(kind, pool.topk_logp.shape[1])
    got = tk.score_edges(pool, w, emb, hid, backend="cpp")
    check_against_reference(got, *references(pool, w, emb, hid),
                            exact=("edge_logq", "log_reach") if kind == "none" else ())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_embeddings_and_hidden(dtype):
    pool, emb, hid = make_case("mixed", seed=5)
    w = make_weights("full", pool.topk_logp.shape[1])
    emb16, hid16 = emb.to(dtype), hid.to(dtype)
    want = references(pool, w, emb16, hid16)  # both upcast the 16-bit inputs exactly, as the C++ does
    check_against_reference(tk.score_edges(pool, w, emb16, hid16, backend="cpp"), *want)


@pytest.mark.parametrize("layout", ["transposed", "broadcast_rows", "sliced_columns"])
def test_strided_embedding_table(layout):
    # The table is read in place, through its strides, never made contiguous.
    pool, emb, hid = make_case("mixed", seed=6)
    w = make_weights("full", pool.topk_logp.shape[1])
    if layout == "transposed":
        table = emb.t().contiguous().t()
    elif layout == "broadcast_rows":
        table = emb[:1].expand(V, E)  # row stride 0
    else:
        table = torch.cat([emb, torch.randn(V, 3)], dim=1)[:, :E]
    assert not table.is_contiguous()
    check_against_reference(tk.score_edges(pool, w, table, hid, backend="cpp"), *references(pool, w, table, hid))


@pytest.mark.parametrize("dims", [
    dict(token_dim=7, depth_dim=3, hidden_proj_dim=5, mlp_dim=37),   # F = 29, M not a multiple of 16
    dict(token_dim=1, depth_dim=1, hidden_proj_dim=1, mlp_dim=1),
    dict(mlp_dim=70),                                                # fc1 columns in two blocks (64 + 6)
    dict(token_dim=40, depth_dim=16, hidden_proj_dim=0, mlp_dim=16),
], ids=["odd", "ones", "m70", "no_hidden_proj"])
def test_awkward_scorer_shapes(dims):
    pool, emb, hid = make_case("mixed", seed=7)
    w = make_weights("full", pool.topk_logp.shape[1], **dims)
    check_against_reference(tk.score_edges(pool, w, emb, hid, backend="cpp"), *references(pool, w, emb, hid))


def test_tiny_scorer_odd_width():
    pool, emb, hid = make_case("n258", seed=8)
    w = make_weights("tiny", pool.topk_logp.shape[1], mlp_dim=19)
    check_against_reference(tk.score_edges(pool, w, None, None, backend="cpp"), *references(pool, w, None, None))


def test_extreme_logits_stay_finite():
    # Large fc2 weights push the SiLU inputs far into exp's overflow and underflow ranges.
    pool, emb, hid = make_case("mixed", seed=9)
    w = make_weights("full", pool.topk_logp.shape[1])
    for head in ("edge", "other"):
        getattr(w, f"{head}_fc1_weight").mul_(60.0)
        getattr(w, f"{head}_fc2_weight").mul_(0.2)
    want, exact64 = references(pool, w, emb, hid)
    got = tk.score_edges(pool, w, emb, hid, backend="cpp")
    # The logits themselves reach ~1e2 here: the rule's bound grows with the float32 reference's own error.
    for name, g, r, x in zip(OUTPUTS, got, want, exact64):
        assert torch.equal(torch.isinf(g), torch.isinf(r)), name
        fin = torch.isfinite(r)
        assert torch.equal(torch.isfinite(x), fin), f"{name}: the float64 run has another -inf pattern"
        assert_within_torch_error(g[fin], r[fin], x[fin], what=name)


def test_batch_rows_are_independent():
    pool, emb, hid = make_case("mixed", seed=10)
    w = make_weights("full", pool.topk_logp.shape[1])
    whole = tk.score_edges(pool, w, emb, hid, backend="cpp")
    for b in range(pool.tree.tokens.shape[0]):
        row = CandidatePool(Tree(*(x[b:b + 1] for x in (pool.tree.tokens, pool.tree.parents, pool.tree.depth,
                                                          pool.tree.num_nodes))),
                            *(getattr(pool, f)[b:b + 1] for f in ("logq", "step_logq", "rank", "topk_logp", "topk_ids",
                                                                  "entropy", "margin", "topk_mass")))
        one = tk.score_edges(row, w, emb, hid[b:b + 1], backend="cpp")
        for name, x, y in zip(OUTPUTS, whole, one):
            assert torch.equal(x[b:b + 1], y), f"{name}: row {b} depends on the other rows"


# ------------------------------------------------------------------------------------------ trained checkpoint
CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


@pytest.mark.parametrize("name", ["smollm2-taps-scorer", "smollm2-taps-scorer-tiny"])
def test_trained_checkpoint(name):
    path = CHECKPOINTS / name
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"{path} is not present")
    pytest.importorskip("safetensors")
    from taps.scoring.io import load_scorer_weights

    w, cfg = load_scorer_weights(path)
    D, top_k, pool_size = cfg["model"]["max_depth"], cfg["model"]["top_k"], cfg["meta"]["pool_size"]
    g = torch.Generator().manual_seed(11)
    vocab = 1000
    logits = torch.randn(2, D, vocab, generator=g) * 3
    pool = tk.candidate_pool(logits, torch.tensor([3, 999]), top_k, pool_size, backend="reference",
                             pool_backend="reference")
    emb = torch.randn(vocab, cfg["model"]["embed_dim"], generator=g) * 0.05
    hid = torch.randn(2, D, cfg["model"]["hidden_dim"], generator=g)
    # factor 3: other_logq's largest error is one root's, 5 ulps from float64 where torch's float32 happens to be
    # 0.5 ulp (over all of other_logq's entries the C++ error is 1.5x torch's, rms)
    check_against_reference(tk.score_edges(pool, w, emb, hid, backend="cpp"), *references(pool, w, emb, hid),
                            factor=3.0)


# ------------------------------------------------------------------------------------------------- plumbing
def test_default_cpu_backend_is_cpp(monkeypatch):
    monkeypatch.delenv("TAPS_BACKEND", raising=False)
    assert bk.resolve("score_edges", None, CPU)[0] == "cpp"
    calls = []
    real = bk._IMPLS[("score_edges", "cpp")]
    monkeypatch.setitem(bk._IMPLS, ("score_edges", "cpp"),
                        lambda *a: calls.append(1) or real(*a))
    pool, emb, hid = make_case("n1")
    tk.score_edges(pool, make_weights("full", 1), emb, hid)
    assert calls == [1]


def _raw_args(pool):
    t = pool.tree
    return dict(tokens=t.tokens, parents=t.parents, depth=t.depth, logq=pool.logq, step_logq=pool.step_logq,
                entropy=pool.entropy, margin=pool.margin, topk_mass=pool.topk_mass)


def _raw(pool=None, weights="full", **over):
    """Calls the binding directly (no public-op checks in front), with one argument replaced."""
    pool = pool or make_case("mixed")[0]
    _, emb, hid = make_case("mixed")
    w = make_weights(weights, pool.topk_logp.shape[1]) if isinstance(weights, str) else weights
    kw = _raw_args(pool)
    kw.update(weights=None if w is None else {k: t.float() for k, t in w.tensors().items()}, ln_eps=1e-5,
              token_embeddings=emb, drafter_hidden=hid)
    for k, v in over.items():
        if k.startswith("w_"):
            field = k[2:]
            if v is None:
                del kw["weights"][field]
            else:
                kw["weights"][field] = v
        else:
            kw[k] = v
    return _C.score_edges(**kw)


def _bad_parent():
    pool = make_case("mixed")[0]
    pool.tree.parents[0, 2] = 5
    return pool


def _bad_token():
    pool = make_case("mixed")[0]
    pool.tree.tokens[0, 3] = V
    return pool


@pytest.mark.parametrize("call,exc,match", [
    (lambda: _raw(tokens=make_case("mixed")[0].tree.tokens.int()), TypeError,
     r"pool\.tree\.tokens: expected dtype int64"),
    (lambda: _raw(parents=make_case("mixed")[0].tree.parents[:, :5]), ValueError,
     r"pool\.tree\.parents: expected shape"),
    (lambda: _raw(pool=_bad_parent()), ValueError, r"pool\.tree\.parents\[0,2\]"),
    (lambda: _raw(pool=_bad_token()), ValueError, r"pool\.tree\.tokens\[0,3\]: token 97 is outside"),
    (lambda: _raw(logq=torch.zeros(3, 40)), ValueError, r"pool\.logq: expected shape \(3, 41\), received \(3, 40\)"),
    (lambda: _raw(entropy=torch.zeros(3, 7, dtype=torch.float64)), TypeError, r"pool\.entropy: expected dtype float32"),
    (lambda: _raw(topk_mass=torch.zeros(3, 6)), ValueError, r"pool\.topk_mass"),
    (lambda: _raw(entropy=torch.zeros(3, 0), margin=torch.zeros(3, 0), topk_mass=torch.zeros(3, 0)), ValueError,
     r"pool\.entropy: the scorer needs at least one draft position"),
    (lambda: _raw(w_other_fc2_bias=None), ValueError, r"weights\.other_fc2_bias: missing"),
    (lambda: _raw(w_edge_fc1_weight=torch.zeros(64, 110)), ValueError,
     r"weights\.edge_fc1_weight: expected shape \(\*, 111\)"),
    (lambda: _raw(w_other_fc1_weight=torch.zeros(63, 111)), ValueError,
     r"weights\.other_fc1_weight: expected shape \(64, 111\)"),
    (lambda: _raw(w_edge_ln_weight=torch.zeros(111, dtype=torch.float64)), TypeError,
     r"weights\.edge_ln_weight: expected dtype float32"),
    (lambda: _raw(w_edge_ln_weight=torch.zeros(110)), ValueError, r"weights\.edge_ln_weight: expected 111 features"),
    (lambda: _raw(w_bogus=torch.zeros(1)), ValueError, r"weights\.bogus: not a ScorerWeights tensor field"),
    (lambda: _raw(w_hidden_proj_bias=None), ValueError, r"weights\.hidden_proj_bias: missing"),
    (lambda: _raw(weights="tiny", w_depth_embedding=torch.zeros(9, 8)), ValueError,
     r"weights\.depth_embedding: the tiny"),
    (lambda: _raw(token_embeddings=None), TypeError, r"token_embeddings: the full scorer needs"),
    (lambda: _raw(token_embeddings=torch.zeros(V, E + 1)), ValueError, r"token_embeddings: expected shape \(\*, 59\)"),
    (lambda: _raw(token_embeddings=torch.zeros(V, E, dtype=torch.int64)), TypeError,
     r"token_embeddings: expected dtype"),
    (lambda: _raw(drafter_hidden=torch.zeros(3, 6, H)), ValueError, r"drafter_hidden: expected shape \(3, 7, 45\)"),
    (lambda: _raw(drafter_hidden=None), TypeError, r"drafter_hidden: the full scorer needs"),
    (lambda: _raw(tokens=torch.zeros(3, 0, dtype=torch.int64)), ValueError,
     r"pool\.tree\.tokens: expected at least one node"),
])
def test_extension_checks_its_own_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_unfaulted_raw_call_matches_reference():
    # The error table's calls minus their fault succeed: each error comes from its fault.
    got = _raw()
    pool, emb, hid = make_case("mixed")
    check_against_reference(tuple(got), *references(pool, make_weights("full", 7), emb, hid))
    assert len(_raw(weights=None, token_embeddings=None, drafter_hidden=None)) == 3


def test_public_op_errors_name_the_argument():
    pool, emb, hid = make_case("mixed")
    w = make_weights("full", 7)
    with pytest.raises(TypeError, match="drafter_hidden"):
        tk.score_edges(pool, w, emb, None, backend="cpp")
    with pytest.raises(ValueError, match=r"pool\.tree\.tokens\[0,3\]"):
        tk.score_edges(_bad_token(), w, emb, hid, backend="cpp")


def test_cpp_backend_listed_as_available():
    assert tk.available_backends("score_edges", CPU)["cpp"] == ""
