"""The input contract (docs/DESIGN.md, "Input contract"): one named regression test per audit finding, the
validation modes, and the guarantee that value checks never read device data by default off the CPU.

Cases that once crashed the process (Triton under the interpreter) run in a child process, so a regression
fails the test instead of killing the run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import taps_kernels as tk
from taps_kernels import _checks, backend as bk
from taps_kernels.layout import TopKStats, Tree

from helpers import assert_topk_stats_close

INT64_MAX = 2 ** 63 - 1
HAVE_CPP = not bk.unavailable_reason("cpp", torch.device("cpu"))
HAVE_TRITON = not bk.unavailable_reason("triton", torch.device("cpu"))
CPU_BACKENDS = ["reference"] + (["cpp"] if HAVE_CPP else [])
needs_cpp = pytest.mark.skipif(not HAVE_CPP, reason="C++ backend unavailable")
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="Triton (interpreter) unavailable")


def chain(n: int, B: int = 1) -> Tree:
    parents = torch.arange(-1, n - 1, dtype=torch.int32).repeat(B, 1)
    depth = torch.arange(n, dtype=torch.int32).repeat(B, 1)
    return Tree(torch.zeros(B, n, dtype=torch.int64), parents, depth, torch.full((B,), n, dtype=torch.int32))


def in_child(code: str, timeout: float = 300):
    """Run ``code`` in a fresh interpreter (TRITON_INTERPRET=1); -> (returncode, stdout, stderr)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("TAPS_BACKEND", None)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
                       env=env)
    return r.returncode, r.stdout, r.stderr


# --------------------------------------------------------------------------------------- finding 1
@needs_triton
def test_finding01_score_edges_zero_positions_refused_before_any_backend():
    rc, out, err = in_child("""
        import torch, taps_kernels as tk
        pool = tk.candidate_pool(torch.randn(1, 2, 5), torch.tensor([0]), 2, 3, backend="reference",
                                 pool_backend="reference")
        for f in ("topk_logp", "topk_ids", "entropy", "margin", "topk_mass"):
            setattr(pool, f, getattr(pool, f)[:, :0])
        w = tk.ScorerWeights.random(tiny=True)
        for b in ("reference", "cpp", "triton"):
            try:
                tk.score_edges(pool, w, backend=b)
                print(b, "accepted")
            except ValueError as e:
                print(b, "ValueError", e)
    """)
    assert rc == 0, f"child died with {rc}: {err[-500:]}"
    lines = out.strip().splitlines()
    assert len(lines) == 3 and all("ValueError" in l and "draft position" in l for l in lines), out


# --------------------------------------------------------------------------------------- finding 2
@needs_triton
def test_finding02_tree_attention_bad_prefix_and_shapes_on_triton():
    rc, out, err = in_child("""
        import os, torch, taps_kernels as tk
        os.environ["TAPS_BACKEND"] = "triton"
        g = torch.Generator().manual_seed(0)
        tree = tk.Tree(torch.zeros(2, 5, dtype=torch.int64), torch.tensor([[-1, 0, 1, 2, 3]] * 2, dtype=torch.int32),
                       torch.tensor([[0, 1, 2, 3, 4]] * 2, dtype=torch.int32), torch.tensor([5, 5], dtype=torch.int32))
        _, bits = tk.tree_mask(tree, torch.tensor([3, 0]))
        q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
        plen = torch.tensor([3, 0])
        cases = {
            "prefix past the cache": (q, k, v, bits, torch.tensor([3, 100])),
            "prefix int64 max": (q, k, v, bits, torch.tensor([3, 2 ** 63 - 1])),
            "too few bit words": (q, k, v, bits[..., :0], plen),
            "v shorter than k": (q, k, v[:, :, :6], bits, plen),
            "k batch mismatch": (q, k[:1], v[:1], bits, plen),
            "int64 bits": (q, k, v, bits.long(), plen),
        }
        for name, args in cases.items():
            for through, call in (("op", lambda: torch.ops.taps.tree_attention(*args, None)),
                                  ("public", lambda: tk.tree_attention(*args))):
                try:
                    out = call()
                    print(name, through, "| accepted", bool(torch.isfinite(out[0] if through == "op" else out).all()))
                except (ValueError, TypeError) as e:
                    print(name, through, "|", type(e).__name__, str(e).split(":")[0])
    """)
    assert rc == 0, f"child died with {rc}: {err[-500:]}"
    got = dict(l.split(" | ") for l in out.strip().splitlines())
    shapes = {"too few bit words": "ValueError ancestor_bits", "v shorter than k": "ValueError v",
              "k batch mismatch": "ValueError k", "int64 bits": "TypeError ancestor_bits"}
    # Refused by the op itself (on CPU its default value checks run) and by the public op, with the same message.
    shapes.update({name: "ValueError prefix_lens[1]" for name in ("prefix past the cache", "prefix int64 max")})
    want = {f"{name} {through}": why for name, why in shapes.items() for through in ("op", "public")}
    assert got == want, out


# --------------------------------------------------------------------------------------- finding 3
@needs_cpp
@pytest.mark.parametrize("through", ["op-cpp", "op-reference", "custom-op", "extension"])
def test_finding03_compact_kv_overflowing_path_refused_cache_untouched(through):
    from taps_kernels import _C
    k = torch.arange(2 * 1 * 6 * 2, dtype=torch.float32).reshape(2, 1, 6, 2)
    v = k.clone() + 100
    before = (k.clone(), v.clone())
    prefix, path = torch.tensor([3, 5]), torch.tensor([[0, 2 ** 63 - 2], [0, -1]])
    with pytest.raises(ValueError, match=r"path\[0,1\]"):
        if through.startswith("op"):
            tk.compact_kv([k], [v], prefix, path, backend=through[3:])
        elif through == "custom-op":
            torch.ops.taps.compact_kv([k], [v], prefix, path)
        else:
            _C.compact_kv([k], [v], prefix, path)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


# --------------------------------------------------------------------------------------- finding 4
def _deep_pool(n=30, D=2):
    """A 30-node chain under a D = 2 pool: nodes deeper than D read position D - 1 (clamped) everywhere."""
    pool = tk.candidate_pool(torch.randn(1, D, 5, generator=torch.Generator().manual_seed(4)), torch.tensor([0]), 2, 2,
                             backend="reference", pool_backend="reference")
    pool.tree = chain(n)
    pool.logq = -0.1 * torch.arange(n, dtype=torch.float32)[None]
    pool.step_logq = torch.full((1, n), -0.1)
    pool.step_logq[0, 0] = 0.0
    pool.rank = torch.zeros(1, n, dtype=torch.int32)
    return pool


@pytest.mark.parametrize("scorer", [None, "tiny"])
def test_finding04_score_edges_tree_deeper_than_positions_agrees(scorer):
    pool = _deep_pool()
    w = None if scorer is None else tk.ScorerWeights.random(tiny=True, generator=torch.Generator().manual_seed(1))
    want = tk.score_edges(pool, w, backend="reference")
    for b in CPU_BACKENDS[1:]:
        for x, y in zip(tk.score_edges(pool, w, backend=b), want):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("scorer", [None, "tiny"])
def test_finding04_score_edges_deeper_than_positions_triton_clamps(scorer):
    scorer = str(scorer)
    rc, out, err = in_child(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import taps_kernels as tk
        from test_validation import _deep_pool
        pool = _deep_pool()
        w = None if {scorer!r} == "None" else tk.ScorerWeights.random(tiny=True, generator=torch.Generator().manual_seed(1))
        for x, y in zip(tk.score_edges(pool, w, backend="triton"), tk.score_edges(pool, w, backend="reference")):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        print("same")
    """)
    assert rc == 0 and out.strip() == "same", f"rc={rc}: {err[-800:]}"


# --------------------------------------------------------------------------------------- finding 5
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_finding05_nan_and_posinf_refused_on_every_backend(bad):
    x = torch.randn(2, 3, 17)
    x[1, 2, 5] = bad
    for b in CPU_BACKENDS + (["triton"] if HAVE_TRITON else []):
        with pytest.raises(ValueError, match=r"draft_logits\[1,2,5\]"):
            tk.candidate_pool(x, torch.tensor([0, 1]), 4, 9, backend=b,
                              pool_backend="reference" if b == "triton" else b)
    stats = tk.topk_stats(torch.randn(1, 2, 7), 3, backend="reference")
    lp = stats.topk_logp.clone()
    lp[0, 1, 2] = bad
    for b in CPU_BACKENDS:
        with pytest.raises(ValueError, match=r"stats\.topk_logp\[0,1,2\]"):
            tk.best_first_pool(TopKStats(lp, stats.topk_ids, stats.entropy, stats.margin, stats.topk_mass),
                               torch.tensor([0]), 5, backend=b)
    tree = chain(6)
    lr = -torch.arange(6, dtype=torch.float32)[None] * 0.3
    lr[0, 3] = bad
    for rule in (tk.ReachRule(), tk.UtilityRule()):
        for b in CPU_BACKENDS:
            with pytest.raises(ValueError, match=r"log_reach\[0,3\]"):
                tk.select_subtree(tree, lr, 3, rule=rule, backend=b)


def test_finding05_neg_inf_is_an_impossible_token_identically_everywhere():
    x = torch.randn(2, 3, 9, generator=torch.Generator().manual_seed(5))
    x[:, :, 2:] = float("-inf")
    x[0, 1, 0] = float("-inf")
    pools = [tk.candidate_pool(x, torch.tensor([0, 1]), 5, 12, backend=b, pool_backend=b) for b in CPU_BACKENDS]
    for p in pools:  # the same ids and -inf entries everywhere; finite floats within float32 rounding
        assert_topk_stats_close(p, x, 5)
    for p in pools[1:]:
        assert torch.equal(p.rank, pools[0].rank) and torch.equal(torch.isinf(p.logq), torch.isinf(pools[0].logq))
        assert torch.equal(p.tree.parents, pools[0].tree.parents) and torch.equal(p.tree.tokens, pools[0].tree.tokens)
    all_impossible = x.clone()
    all_impossible[1, 2, :] = float("-inf")
    for b in CPU_BACKENDS:
        with pytest.raises(ValueError, match=r"draft_logits\[1,2\]: every logit of this position is -inf"):
            tk.candidate_pool(all_impossible, torch.tensor([0, 1]), 5, 12, backend=b)
    lr = torch.tensor([[0.0, -1.0, float("-inf"), -0.5, float("-inf")]])
    sels = [tk.select_subtree(chain(5), lr, 3, rule=r, backend=b) for r in (tk.ReachRule(), tk.UtilityRule())
            for b in CPU_BACKENDS]
    for s in sels[1:len(CPU_BACKENDS)]:
        assert torch.equal(s.pool_index, sels[0].pool_index)


# --------------------------------------------------------------------------------------- finding 6
@needs_triton
def test_finding06_tree_attention_nonfinite_contract_on_every_backend():
    rc, out, err = in_child("""
        import torch, taps_kernels as tk
        g = torch.Generator().manual_seed(6)
        tree = tk.Tree(torch.zeros(1, 4, dtype=torch.int64), torch.tensor([[-1, 0, 1, 0]], dtype=torch.int32),
                       torch.tensor([[0, 1, 2, 1]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32))
        _, bits = tk.tree_mask(tree, torch.tensor([0]))
        q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
        res = {}
        for b in ("reference", "triton"):
            kk = k.clone(); kk[0, 0, 2, 0] = float("nan")        # key of node 2: rows 2 see it, rows 0, 1, 3 do not
            out, lse = tk.tree_attention(q, kk, v, bits, torch.tensor([0]), return_lse=True, backend=b)
            nan_rows = out[0, 0].isnan().any(-1).tolist()
            zero = bits.clone(); zero[0, 1] = 0                   # row 1 sees no key at all
            o2, l2 = tk.tree_attention(q, k, v, zero, torch.tensor([0]), return_lse=True, backend=b)
            above = bits | torch.tensor([[[0b1110], [0b1100], [0b1000], [0]]], dtype=torch.int32)  # every j > i
            o3 = tk.tree_attention(q, k, v, above, torch.tensor([0]), backend=b)
            o4 = tk.tree_attention(q, k, v, bits, torch.tensor([0]), backend=b)
            res[b] = (nan_rows, bool((o2[0, :, 1] == 0).all()), bool(torch.isneginf(l2[0, :, 1]).all()),
                      bool(torch.allclose(o3, o4, atol=1e-5)))
        print(res)
    """)
    assert rc == 0, f"child died with {rc}: {err[-500:]}"
    want = ([False, False, True, False], True, True, True)
    got = eval(out.strip().splitlines()[-1])  # a dict of tuples printed by the child
    assert got == {"reference": want, "triton": want}, out


# --------------------------------------------------------------------------------------- finding 7
@pytest.mark.parametrize("through", CPU_BACKENDS + ["custom-op"])
def test_finding07_position_ids_never_wrap(through):
    tree = chain(3)
    prefix = torch.tensor([INT64_MAX - 1])  # + depth 2 would wrap to a negative position
    with pytest.raises(ValueError, match=r"prefix_lens\[0\]: expected <= 2\*\*63 - 1 - \(deepest node's depth\)"):
        if through == "custom-op":
            torch.ops.taps.tree_mask(tree.parents, tree.depth, tree.num_nodes, prefix)
        else:
            tk.tree_mask(tree, prefix, backend=through)
    pos, _ = tk.tree_mask(tree, torch.tensor([INT64_MAX - 2]), backend=CPU_BACKENDS[-1])
    assert int(pos[0, 2]) == INT64_MAX  # the largest prefix that fits is accepted


# --------------------------------------------------------------------------------------- finding 8
def _alias(kind):
    base = torch.randn(160)
    if kind == "partial":
        return base[:72].view(2, 2, 6, 3), base[2:74].view(2, 2, 6, 3)
    if kind == "interleaved":
        kv = base[:144].view(2, 2, 6, 2, 3)
        return kv[..., 0, :], kv[..., 1, :]
    return base[:36].view(1, 2, 6, 3).expand(2, 2, 6, 3), torch.randn(2, 2, 6, 3)  # stride-0 batch


@pytest.mark.parametrize("kind,match", [("partial", "memory overlaps"), ("interleaved", "memory overlaps"),
                                        ("broadcast", "must not overlap itself")])
@pytest.mark.parametrize("through", CPU_BACKENDS + ["custom-op"] + (["extension"] if HAVE_CPP else []))
def test_finding08_compact_kv_refuses_overlapping_and_broadcast_caches(kind, match, through):
    k, v = _alias(kind)
    before = (k.clone(), v.clone())
    args = ([k], [v], torch.tensor([0, 1]), torch.tensor([[0, 2], [0, 3]]))
    with pytest.raises(ValueError, match=match):
        if through == "custom-op":
            torch.ops.taps.compact_kv(*args)
        elif through == "extension":
            from taps_kernels import _C
            _C.compact_kv(*args)
        else:
            tk.compact_kv(*args, backend=through)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


# --------------------------------------------------------------------------------------- finding 9
def test_finding09_gradients_are_never_dropped_silently():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4)
    y = tk.rows_linear(x, w)  # default: the reference, which has a backward
    assert y.requires_grad
    y.sum().backward()
    assert x.grad is not None
    if HAVE_CPP:
        with pytest.raises(ValueError, match=r"x: requires grad, but the 'cpp' backend of rows_linear has no backward"):
            tk.rows_linear(x, w, backend="cpp")
        with torch.no_grad():
            assert not tk.rows_linear(x, w, backend="cpp").requires_grad  # no grad mode: nothing is dropped
    q, k, v = torch.randn(1, 2, 3, 4, requires_grad=True), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    _, bits = tk.tree_mask(chain(3), torch.tensor([2]))
    assert tk.tree_attention(q, k, v, bits, torch.tensor([2])).requires_grad
    if HAVE_TRITON:
        with pytest.raises(ValueError, match=r"q: requires grad, but the 'triton' backend of tree_attention"):
            tk.tree_attention(q, k, v, bits, torch.tensor([2]), backend="triton")
    keys = [torch.randn(1, 1, 6, 2, requires_grad=True)]
    for b in CPU_BACKENDS:
        with pytest.raises(ValueError, match=r"keys\[0\]: requires grad, but compact_kv writes it in place"):
            tk.compact_kv(keys, [torch.randn(1, 1, 6, 2)], torch.tensor([1]), torch.tensor([[0, 2]]), backend=b)
    with pytest.raises(ValueError, match=r"draft_logits: requires grad, but candidate_pool has no backward"):
        tk.candidate_pool(torch.randn(1, 2, 5, requires_grad=True), torch.tensor([0]), 2, 3)


# --------------------------------------------------------------------------------------- finding 10
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_finding10_messages_name_the_argument_and_value(backend):
    tree = chain(3)
    with pytest.raises(ValueError, match=r"^max_depth: expected an int in \[0, 2\*\*31 - 3\], received 2147483648$"):
        tk.accept_greedy(tree, torch.zeros(1, 3, dtype=torch.int64), max_depth=2 ** 31, backend=backend)
    with pytest.raises(ValueError, match=r"draft_logits: expected at least one batch row"):
        tk.candidate_pool(torch.randn(0, 3, 5), torch.zeros(0, dtype=torch.int64), 2, 3, backend=backend)
    with pytest.raises(ValueError, match=r"tree\.tokens: expected at least one tree"):
        tk.accept_greedy(Tree(*(t[:0] for t in (tree.tokens, tree.parents, tree.depth, tree.num_nodes))),
                         torch.zeros(0, 3, dtype=torch.int64), backend=backend)
    pool = tk.candidate_pool(torch.randn(1, 3, 5), torch.tensor([0]), 2, np.int64(3), backend=backend,
                             pool_backend=backend)  # numpy integers are ints
    assert pool.tree.max_nodes == 4
    with pytest.raises(TypeError, match=r"pool_size: expected an int, received float 3\.0"):
        tk.candidate_pool(torch.randn(1, 3, 5), torch.tensor([0]), 2, 3.0, backend=backend)
    with pytest.raises(ValueError, match=r"q: expected a head dim >= 1"):
        tk.tree_attention(torch.randn(1, 1, 3, 0), torch.randn(1, 1, 3, 0), torch.randn(1, 1, 3, 0),
                          torch.zeros(1, 3, 1, dtype=torch.int32), torch.tensor([0]), backend=backend)
    with pytest.raises(ValueError, match=r"rule\.lambda_depth: expected a float >= 0\.0, received -1\.0"):
        tk.select_subtree(tree, torch.zeros(1, 3), 1, rule=tk.UtilityRule(lambda_depth=-1.0), backend=backend)
    with pytest.raises(ValueError, match=r"tree\.tokens: expected a tensor on cpu or cuda, received one on meta"):
        tk.accept_greedy(tree.to("meta"), torch.zeros(1, 3, dtype=torch.int64, device="meta"), 2, backend=backend)
    with pytest.raises(ValueError, match=r"pool_size: \d+ would need .* of outputs, more than the"):
        tk.candidate_pool(torch.randn(1, 3, 5), torch.tensor([0]), 2, 2 ** 31 - 2, backend=backend)
    with pytest.raises(ValueError, match=r"pool_size: expected an int in \[1, 2\*\*31 - 2\], received 1099511627776"):
        tk.candidate_pool(torch.randn(1, 3, 5), torch.tensor([0]), 2, 2 ** 40, backend=backend)


@needs_cpp
def test_finding10_extension_names_max_depth_and_refuses_negative_lambda():
    from taps_kernels import _C
    t = chain(3)
    with pytest.raises(ValueError, match=r"path_len: .*\(max_depth \+ 1.*received 2147483649 \(max_depth 2147483648\)"):
        _C.accept_greedy(t.tokens, t.parents, t.num_nodes, torch.zeros(1, 3, dtype=torch.int64), 2 ** 31 + 1)
    with pytest.raises(ValueError, match=r"lambda_depth: expected a float >= 0"):
        _C.select_subtree(t.parents, t.depth, t.num_nodes, torch.zeros(1, 3), 1, None, 0.0, "utility", 1.0, -1.0, 0.0)
    with pytest.raises(ValueError, match=r"lambda_node: expected a float > 0"):
        _C.select_subtree(t.parents, t.depth, t.num_nodes, torch.zeros(1, 3), 1, None, 0.0, "utility", 0.0, 0.0, 0.0)


# ---------------------------------------------------------------------------------- validation modes
def test_validate_modes_and_environment(monkeypatch):
    bad = chain(4)
    bad.parents[0, 2] = 3  # a parent after its child
    with pytest.raises(ValueError, match=r"tree\.parents\[0,2\]"):
        tk.tree_mask(bad, torch.tensor([0]), backend="reference")
    with pytest.raises(ValueError, match=r"tree\.parents\[0,2\]"):
        bad.validate()
    bad.validate(deep=False)  # metadata only
    bad.validate(validate="none")
    monkeypatch.setenv("TAPS_VALIDATE", "none")
    bad.validate()  # the environment switch
    with pytest.raises(ValueError, match=r"tree\.parents\[0,2\]"):
        bad.validate(validate="full")
    monkeypatch.setenv("TAPS_VALIDATE", "sometimes")
    with pytest.raises(ValueError, match=r"TAPS_VALIDATE: expected one of"):
        bad.validate()
    monkeypatch.delenv("TAPS_VALIDATE")
    with pytest.raises(ValueError, match=r"validate: expected one of"):
        tk.tree_mask(chain(3), torch.tensor([0]), validate="always")


def _valid_calls():
    """One valid call of every public op (CPU tensors), with every default that would read the host given."""
    g = torch.Generator().manual_seed(3)
    tree = chain(5, B=2)
    logits = torch.randn(2, 3, 11, generator=g)
    stats = tk.topk_stats(logits, 4, backend="reference")
    pool = tk.candidate_pool(logits, torch.tensor([0, 1]), 4, 6, backend="reference", pool_backend="reference")
    _, bits = tk.tree_mask(tree, torch.tensor([1, 0]), backend="reference")
    keys, values = [torch.randn(2, 1, 8, 2)], [torch.randn(2, 1, 8, 2)]
    lr = -torch.rand(2, 5, generator=g)
    return {
        "topk_stats": lambda: tk.topk_stats(logits, 4),
        "candidate_pool": lambda: tk.candidate_pool(logits, torch.tensor([0, 1]), 4, 6),
        "best_first_pool": lambda: tk.best_first_pool(stats, torch.tensor([0, 1]), 6),
        "propagate_reach": lambda: tk.propagate_reach(tree.parents, lr),
        "score_edges": lambda: tk.score_edges(pool, tk.ScorerWeights.random(tiny=True)),
        "select_subtree": lambda: tk.select_subtree(tree, lr, 3,
                                                    rule=tk.ReachRule(torch.tensor([0.1, 0.2, 0.3]), t0=0.01)),
        "tree_mask": lambda: tk.tree_mask(tree, torch.tensor([1, 0])),
        "additive_mask": lambda: tk.ancestor_bits_to_additive_mask(bits, torch.tensor([1, 0]), 9),
        "tree_attention": lambda: tk.tree_attention(torch.randn(2, 2, 5, 4), torch.randn(2, 1, 7, 4),
                                                    torch.randn(2, 1, 7, 4), bits, torch.tensor([1, 0])),
        "accept_greedy": lambda: tk.accept_greedy(tree, torch.zeros(2, 5, dtype=torch.int64), 4),
        "compact_kv": lambda: tk.compact_kv(keys, values, torch.tensor([1, 0]), torch.tensor([[0, 2], [0, 1]])),
        "rows_linear": lambda: tk.rows_linear(torch.randn(2, 3), torch.randn(4, 3)),
    }


class _HostRead(AssertionError):
    pass


def _forbid_host_reads(monkeypatch):
    def boom(*args, **kwargs):
        raise _HostRead("a value check read tensor data")
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    if HAVE_CPP:  # the C++ structural check reads CPU tensors directly
        monkeypatch.setattr(bk.load_extension("_C")[0], "validate_tree", boom)


def _stub_backends(monkeypatch, seen):
    """Every backend replaced by a stub that records the call and returns placeholders (no data read)."""
    import taps_kernels.ops as ops_pkg
    outputs = {"topk_stats": 5, "best_first_pool": 7, "propagate_reach": 0, "select_subtree": 2, "reindex_subtree": 4,
               "tree_mask": 2, "tree_attention": 2, "accept_greedy": 3, "compact_kv": 0, "score_edges": 3,
               "rows_linear": 0}

    def resolve(op, backend, device, **hints):  # hints: size arguments some dispatch lines pass
        def stub(*args, **kwargs):
            seen.append(op)
            n = outputs[op]
            if op == "rows_linear":
                return torch.zeros(args[0].shape[0], args[1].shape[0])
            if op == "topk_stats":  # shaped placeholders: candidate_pool checks them on the way to the pool
                B, D, _ = args[0].shape
                z = torch.zeros(B, D)
                return torch.zeros(B, D, args[1]), torch.zeros(B, D, args[1], dtype=torch.int64), z, z, z
            if op == "select_subtree":  # the re-index op checks the selection's metadata
                B = args[0].shape[0]
                return torch.zeros(B, args[4] + 1, dtype=torch.int64), torch.zeros(B, dtype=torch.int32)
            return torch.zeros(1) if n == 0 else tuple(torch.zeros(1) for _ in range(n))
        return backend or "stub", stub
    import taps_kernels._library as library
    for mod in ("pool", "accept", "attention", "kv", "linear", "mask", "reach", "score", "select"):
        monkeypatch.setattr(getattr(ops_pkg, mod), "resolve", resolve)
    monkeypatch.setattr(library, "resolve", resolve)  # the library ops' kernels choose through it


def test_value_checks_never_read_device_data_by_default_off_cpu(monkeypatch):
    """Pretend the CPU is a GPU (``values_by_default`` is the device rule): every op must then reach its backend
    without one host read (``.item()``, ``bool()``, ``.tolist()``, ``.cpu()``, ...), as on CUDA."""
    calls = _valid_calls()
    seen = []
    _stub_backends(monkeypatch, seen)
    monkeypatch.setattr(_checks, "values_by_default", lambda device: False)
    _forbid_host_reads(monkeypatch)
    for name, call in calls.items():
        call()
    assert {"topk_stats", "best_first_pool", "propagate_reach", "score_edges", "select_subtree", "tree_mask",
            "tree_attention", "accept_greedy", "compact_kv", "rows_linear"} <= set(seen)


def test_the_host_read_detector_catches_value_checks(monkeypatch):
    """The previous test can fail: with the value checks on (validate='full', or the real CPU rule), each op that
    has value checks trips the detector."""
    calls = _valid_calls()
    _stub_backends(monkeypatch, [])
    _forbid_host_reads(monkeypatch)
    tripped = []
    for name, call in calls.items():
        try:
            call()
        except _HostRead:
            tripped.append(name)
    assert set(tripped) >= {"topk_stats", "candidate_pool", "best_first_pool", "propagate_reach", "score_edges",
                            "select_subtree", "tree_mask", "additive_mask", "tree_attention", "accept_greedy",
                            "compact_kv"}, tripped


def test_meta_tensors_refused_by_public_ops_traced_by_library_ops():
    tree = chain(4).to("meta")
    with pytest.raises(ValueError, match="meta"):
        tk.tree_mask(tree, torch.zeros(1, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="meta"):
        tk.topk_stats(torch.randn(1, 2, 3, device="meta"), 2)
    pos, bits = torch.ops.taps.tree_mask(tree.parents, tree.depth, tree.num_nodes,
                                         torch.zeros(1, dtype=torch.int64, device="meta"))
    assert pos.device.type == "meta" and bits.shape == (1, 4, 1)
    with pytest.raises(ValueError, match="ancestor_bits"):  # shapes are checked while tracing too
        torch.ops.taps.tree_attention(*(torch.empty(1, 1, 4, 8, device="meta") for _ in range(3)),
                                      torch.empty(1, 4, 2, dtype=torch.int32, device="meta"),
                                      torch.zeros(1, dtype=torch.int64, device="meta"), None)
