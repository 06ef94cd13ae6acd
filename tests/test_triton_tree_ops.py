"""Triton tree ops (best_first_pool, propagate_reach, select_subtree, reindex_subtree) against the references.

Every integer output must be equal and every float output bit-identical (the references define the order of
the float32 additions). Runs compiled on CUDA when present, else under the Triton interpreter (conftest sets
it); sizes stay small because the interpreter runs each lane in NumPy.
"""
import os
import subprocess
import sys

import pytest
import torch

import taps_kernels as tk
from helpers import random_tree
from taps_kernels.layout import Tree
from taps_kernels.reference.pool import best_first_pool_reference, topk_stats_reference
from taps_kernels.reference.reach import propagate_reach_reference
from taps_kernels.reference.select import reindex_subtree_reference, select_subtree_reference

triton = pytest.importorskip("triton")
from taps_kernels.triton.best_first_pool import MAX_POOL_SIZE, best_first_pool_triton  # noqa: E402
from taps_kernels.triton.propagate_reach import propagate_reach_triton  # noqa: E402
from taps_kernels.triton.select_subtree import reindex_subtree_triton, select_subtree_triton  # noqa: E402

if torch.cuda.is_available():
    DEVICE = "cuda"
    pytestmark = pytest.mark.gpu
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytestmark = pytest.mark.skip(reason="no CUDA and TRITON_INTERPRET is not 1")
    DEVICE = "cpu"

POOL_NAMES = ("tokens", "parents", "depth", "num_nodes", "logq", "step_logq", "rank")


def assert_identical(got, want, name):
    """Equal dtype and shape; integers equal; floats equal bit for bit (so -0.0 != +0.0, NaN == same NaN)."""
    got = got.cpu()
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.dtype.is_floating_point:
        got, want = got.view(torch.int32), want.view(torch.int32)
    bad = got != want
    assert not bad.any(), f"{name}: first mismatch at {bad.nonzero()[0].tolist()}: {got[bad][:4]} vs {want[bad][:4]}"


def lattice(B, D, K, V, seed, quantised):
    """``topk_stats`` of random logits; ``quantised`` rounds logits to halves, so equal scores are common."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, D, V, generator=g) * 2
    if quantised:
        logits = (logits * 2).round() / 2
    logp, ids, *_ = topk_stats_reference(logits, K)
    roots = torch.randint(0, V, (B,), generator=g)
    return logp, ids, roots


def pool_tree(B, D, K, V, pool_size, seed, quantised=False):
    tokens, parents, depth, num, logq, *_ = best_first_pool_reference(*lattice(B, D, K, V, seed, quantised),
                                                                      pool_size)
    return Tree(tokens, parents, depth, num), logq


def to_dev(*ts):
    return tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts)


# --- best_first_pool -----------------------------------------------------------------------------------------

POOL_CASES = [
    # (B, D, K, V, pool_size, quantised)
    (1, 1, 1, 5, 1, False),       # one node, the lattice holds exactly one
    (2, 2, 3, 9, 2, True),
    (3, 5, 7, 40, 17, True),
    (2, 15, 3, 20, 129, True),    # deep lattice, many ties
    (1, 5, 64, 100, 129, False),  # wide lattice
    (1, 2, 64, 70, 300, True),
    (3, 2, 3, 10, 17, False),     # the lattice holds 3 + 9 = 12 prefixes: padded rows
    (2, 1, 7, 7, 17, True),       # depth 1 only, K = V
]


@pytest.mark.parametrize("B,D,K,V,pool_size,quantised", POOL_CASES)
def test_best_first_pool_matches_reference(B, D, K, V, pool_size, quantised):
    logp, ids, roots = lattice(B, D, K, V, seed=B * 1000 + D * 10 + K + pool_size, quantised=quantised)
    want = best_first_pool_reference(logp, ids, roots, pool_size)
    got = best_first_pool_triton(*to_dev(logp, ids, roots), pool_size)
    for name, g, w in zip(POOL_NAMES, got, want):
        assert_identical(g, w, name)


def test_best_first_pool_exact_ties_and_infinities():
    """Hand-made lattice: equal log-probs across ranks and depths (parent, then rank decides), -inf entries
    (popped last, still real nodes), -0.0 equal to +0.0."""
    logp = torch.tensor([[[-0.0, 0.0, -1.0, float("-inf")],
                          [-1.0, -1.0, -1.0, float("-inf")],
                          [-0.5, -1.0, float("-inf"), float("-inf")]]])
    ids = torch.arange(12).reshape(1, 3, 4)
    roots = torch.tensor([3])
    for pool_size in (1, 5, 20, 63):
        want = best_first_pool_reference(logp, ids, roots, pool_size)
        got = best_first_pool_triton(*to_dev(logp, ids, roots), pool_size)
        for name, g, w in zip(POOL_NAMES, got, want):
            assert_identical(g, w, f"pool_size={pool_size} {name}")


def test_best_first_pool_public_op_and_limit():
    logp, ids, roots = lattice(2, 3, 4, 30, seed=5, quantised=True)
    stats = tk.layout.TopKStats(*to_dev(logp, ids, torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)))
    tree, logq, step, rank = tk.best_first_pool(stats, roots.to(DEVICE), 20, backend="triton")
    want = best_first_pool_reference(logp, ids, roots, 20)
    for name, g, w in zip(POOL_NAMES, (tree.tokens, tree.parents, tree.depth, tree.num_nodes, logq, step, rank), want):
        assert_identical(g, w, name)
    with pytest.raises(ValueError, match="pool_size"):
        best_first_pool_triton(*to_dev(logp, ids, roots), MAX_POOL_SIZE + 1)


# --- propagate_reach -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("B,N,seed", [(1, 1, 0), (2, 2, 1), (3, 17, 2), (2, 129, 3), (1, 300, 4)])
def test_propagate_reach_random_trees(B, N, seed):
    tree = random_tree(seed, B, N, vocab=100, window=1)  # parent i-1 or any earlier node, even odds
    g = torch.Generator().manual_seed(seed)
    edge = -torch.rand(B, N, generator=g) * 3
    edge[torch.rand(B, N, generator=g) < 0.1] = float("-inf")
    edge[torch.rand(B, N, generator=g) < 0.1] = -0.0
    want = propagate_reach_reference(tree.parents, edge)
    got = propagate_reach_triton(*to_dev(tree.parents, edge))
    assert_identical(got, want, "log_reach")


@pytest.mark.parametrize("B,D,K,pool_size", [(2, 5, 7, 17), (3, 15, 3, 129)])
def test_propagate_reach_pool_trees_and_public_op(B, D, K, pool_size):
    tree, logq = pool_tree(B, D, K, 30, pool_size, seed=pool_size)
    edge = -torch.rand(logq.shape, generator=torch.Generator().manual_seed(1)) * 2
    want = propagate_reach_reference(tree.parents, edge)
    assert_identical(tk.propagate_reach(*to_dev(tree.parents, edge), backend="triton"), want, "log_reach")
    # a half-precision edge tensor is read as float32, like the reference
    e16 = edge.to(torch.float16)
    assert_identical(propagate_reach_triton(*to_dev(tree.parents, e16)),
                     propagate_reach_reference(tree.parents, e16), "log_reach fp16")


# --- select_subtree / reindex_subtree -----------------------------------------------------------------------------

def _compare_selection(tree, log_reach, max_nodes, **kw):
    want = select_subtree_reference(tree.parents, tree.depth, tree.num_nodes, log_reach, max_nodes, **kw)
    dev_kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = select_subtree_triton(*to_dev(tree.parents, tree.depth, tree.num_nodes, log_reach), max_nodes, **dev_kw)
    assert_identical(got[0], want[0], f"pool_index {kw}")
    assert_identical(got[1], want[1], f"num_selected {kw}")
    t = (tree.tokens, tree.parents, tree.depth, tree.num_nodes)
    ref_tree = reindex_subtree_reference(*t, *want)
    dev_tree = reindex_subtree_triton(*to_dev(*t, *want))
    for name, g, w in zip(("tokens", "parents", "depth", "num_nodes"), dev_tree, ref_tree):
        assert_identical(g, w, f"reindexed {name} {kw}")
    return want


def _noisy_reach(tree, logq, seed, quantised):
    """log_reach that is NOT monotone along paths (exercises e = min(...) and ancestor closure)."""
    g = torch.Generator().manual_seed(seed)
    lr = logq + torch.randn(logq.shape, generator=g) * 0.7
    if quantised:
        lr = (lr * 2).round() / 2
    lr = torch.where(tree.parents >= 0, lr, torch.full_like(lr, float("-inf")))
    lr[:, 0] = 0.0
    return lr


SELECT_TREES = [
    # (kind, B, N-or-pool, seed, quantised)
    ("pool", 1, 1, 0, False),
    ("pool", 2, 2, 1, True),
    ("pool", 3, 17, 2, True),
    ("pool", 2, 129, 3, False),
    ("pool", 1, 300, 4, True),
    ("random", 3, 40, 5, True),
    ("random", 2, 129, 6, False),
]


def _select_tree(kind, B, n, seed, quantised):
    if kind == "pool":
        tree, logq = pool_tree(B, 5, 7, 40, n, seed, quantised)
    else:
        tree = random_tree(seed, B, n, vocab=100, window=1)  # parent i-1 or any earlier node, even odds
        logq = -torch.rand(B, n, generator=torch.Generator().manual_seed(seed)).cumsum(1)
    return tree, _noisy_reach(tree, logq, seed, quantised)


@pytest.mark.parametrize("kind,B,n,seed,quantised", SELECT_TREES)
def test_select_reach_rule(kind, B, n, seed, quantised):
    tree, lr = _select_tree(kind, B, n, seed, quantised)
    for max_nodes in (1, 7, n + 5):
        _compare_selection(tree, lr, max_nodes)


@pytest.mark.parametrize("kind,B,n,seed,quantised", SELECT_TREES)
def test_select_throughput_rule(kind, B, n, seed, quantised):
    tree, lr = _select_tree(kind, B, n, seed, quantised)
    L = n + 3
    latency = 0.05 + 0.004 * torch.arange(L, dtype=torch.float64) ** 1.2
    seen = set()
    for max_nodes, lat, t0 in ((64, latency, 0.02), (n + 5, latency, 0.0), (64, latency[:4], 0.1),
                               (3, latency.float(), 0.0)):
        _, num_sel = _compare_selection(tree, lr, max_nodes, latency=lat, t0=t0)
        seen.update(num_sel.tolist())
    if n >= 17:
        assert len(seen) > 1, "every latency table chose the same size: the test does not exercise n*"


@pytest.mark.parametrize("kind,B,n,seed,quantised", SELECT_TREES)
def test_select_utility_rule(kind, B, n, seed, quantised):
    tree, lr = _select_tree(kind, B, n, seed, quantised)
    for max_nodes, kw in ((1, {}), (7, {}), (7, dict(lambda_depth=0.3)), (n + 5, dict(min_utility=0.05)),
                          (5, dict(lambda_node=0.5, lambda_depth=-0.01, min_utility=0.2))):
        _compare_selection(tree, lr, max_nodes, rule="utility", **kw)


def test_select_public_op_root_only_and_latency_on_device():
    tree = Tree(torch.tensor([[5, 0, 0]]), torch.tensor([[-1, -1, -1]], dtype=torch.int32),
                torch.zeros(1, 3, dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
    lr = torch.tensor([[0.0, float("-inf"), float("-inf")]])
    for rule in (tk.ReachRule(), tk.ReachRule(torch.tensor([0.1, 0.2], dtype=torch.float64, device=DEVICE)),
                 tk.UtilityRule()):
        sel = tk.select_subtree(tree.to(DEVICE), lr.to(DEVICE), 4, rule=rule, backend="triton")
        assert sel.num_selected.tolist() == [0]
        assert sel.pool_index.tolist() == [[0, -1, -1, -1, -1]]
        assert sel.tree.num_nodes.tolist() == [1] and sel.tree.parents.tolist() == [[-1] * 5]
    # a pool tree through the public op, latency as a device tensor
    tree, lr = _select_tree("pool", 2, 17, 7, True)
    lat = (0.05 + 0.01 * torch.arange(20, dtype=torch.float64)).to(DEVICE)
    sel = tk.select_subtree(tree.to(DEVICE), lr.to(DEVICE), 10, rule=tk.ReachRule(lat, t0=0.01), backend="triton")
    want = select_subtree_reference(tree.parents, tree.depth, tree.num_nodes, lr, 10, latency=lat.cpu(), t0=0.01)
    assert_identical(sel.pool_index, want[0], "pool_index")
    assert_identical(sel.num_selected, want[1], "num_selected")


# --- ahead-of-time compile for real GPUs ----------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from taps_kernels.triton import best_first_pool, propagate_reach, select_subtree
limits = {80: 163 * 1024, 90: 227 * 1024}  # per-block shared memory (bytes) on sm_80 / sm_90
fails = 0
for mod in (best_first_pool, propagate_reach, select_subtree):
    for kernel, ptr_types, constexprs, floats, warps in mod.aot_configs():
        sig = {}
        for name in kernel.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = ptr_types.get(name, "*fp32")
            else:
                sig[name] = "fp32" if name in floats else "i32"
        for cc, limit in limits.items():
            try:
                k = triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", cc, 32),
                                   options={"num_warps": warps})
                ok = k.metadata.shared <= limit
                print("ok" if ok else "FAIL shared", cc, kernel.__name__, constexprs, k.metadata.shared, flush=True)
                fails += not ok
            except Exception as exc:
                fails += 1
                print("FAIL", cc, kernel.__name__, constexprs, type(exc).__name__, str(exc)[:1000], flush=True)
sys.exit(1 if fails else 0)
"""


def test_tree_op_kernels_compile_for_sm80_and_sm90():
    """Every launch configuration of the three modules compiles to a cubin for sm_80 and sm_90 (ptxas included)
    within the per-block shared memory. A subprocess without TRITON_INTERPRET: kernels imported here are
    interpreter objects."""
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception as exc:
        pytest.skip(f"triton has no NVIDIA backend here: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"AOT compile failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.count("ok ") >= 2 * 10, proc.stdout
