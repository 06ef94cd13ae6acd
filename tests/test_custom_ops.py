"""The ``taps::`` library ops: schema/fake/aot checks (opcheck), equality with the references, torch.compile of
the public ops (which call them).

Everything runs on CPU (the ops dispatch to the cpp or reference backend there); the CUDA-graph
capture of the same ops is in tests/test_cuda_kernels.py (marked gpu).
"""
import pytest
import torch

from helpers import random_tree
import taps_kernels as tk
from taps_kernels.reference import (accept_greedy_reference, compact_kv_reference, tree_attention_reference,
                                    tree_mask_reference)


@pytest.fixture
def case():
    """Two trees of 37 rows (two mask words, bit 31 used), the second padded after 20 nodes; a tiny
    vocabulary so that several children carry the target's token (the smallest-index tie rule matters)."""
    tree = random_tree(7, 2, 37, vocab=3, num_nodes=[37, 20], parents="uniform")
    prefix_lens = torch.tensor([5, 11], dtype=torch.int64)
    target = torch.randint(3, (2, 37), generator=torch.Generator().manual_seed(2))
    return tree, prefix_lens, target


def _ties_on_the_walk(tree, target) -> int:
    """Steps of the greedy walk where two or more children carry the target's token."""
    ties = 0
    for b in range(tree.batch_size):
        n, cur = int(tree.num_nodes[b]), 0
        while True:
            kids = [j for j in range(cur + 1, n) if int(tree.parents[b, j]) == cur
                    and int(tree.tokens[b, j]) == int(target[b, cur])]
            ties += len(kids) >= 2
            if not kids:
                break
            cur = kids[0]
    return ties


def _cache(B, H, L, Dh, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, L, Dh, generator=g)


def test_opcheck_all_ops(case):
    tree, prefix_lens, target = case
    _, bits = tree_mask_reference(tree.parents, tree.depth, tree.num_nodes, prefix_lens)
    L = 11 + 37 + 3
    path = torch.tensor([[0, 2, 7, -1], [0, 1, -1, -1]])
    q = _cache(2, 4, 37, 8, 3)
    checks = {
        torch.ops.taps.tree_mask: (tree.parents, tree.depth, tree.num_nodes, prefix_lens),
        torch.ops.taps.accept_greedy: (tree.tokens, tree.parents, tree.num_nodes, target, 6),
        torch.ops.taps.compact_kv: ([_cache(2, 2, L, 8, 4), _cache(2, 3, L, 4, 5)],
                                    [_cache(2, 2, L, 8, 6), _cache(2, 3, L, 4, 7)], prefix_lens, path),
        torch.ops.taps.tree_attention: (q, _cache(2, 2, L, 8, 8), _cache(2, 2, L, 8, 9), bits, prefix_lens, 0.3),
    }
    for op, args in checks.items():
        torch.library.opcheck(op, args)


def test_ops_equal_references(case):
    tree, prefix_lens, target = case
    pos, bits = tk.tree_mask(tree, prefix_lens)
    ref_pos, ref_bits = tree_mask_reference(tree.parents, tree.depth, tree.num_nodes, prefix_lens)
    assert torch.equal(pos, ref_pos) and torch.equal(bits, ref_bits)
    assert (bits < 0).any(), "the case must exercise bit 31 (the int32 sign bit)"
    assert _ties_on_the_walk(tree, target) >= 2, "the case must exercise the smallest-index rule"

    max_depth = int(tree.depth.max())
    got = tk.accept_greedy(tree, target, max_depth)
    want = accept_greedy_reference(tree.tokens, tree.parents, tree.num_nodes, target, max_depth + 1)
    for g, w in zip(got, want):
        assert torch.equal(g, w)

    L = 11 + 37
    path = torch.tensor([[0, 2, 7, 30], [0, 1, 3, -1]])
    keys, values = [_cache(2, 2, L, 8, 10)], [_cache(2, 2, L, 8, 11)]
    ref_k, ref_v = [keys[0].clone()], [values[0].clone()]
    new_lens = tk.compact_kv(keys, values, prefix_lens, path)
    ref_lens = compact_kv_reference(ref_k, ref_v, prefix_lens, path)
    assert torch.equal(new_lens, ref_lens) and torch.equal(keys[0], ref_k[0]) and torch.equal(values[0], ref_v[0])

    q, k, v = _cache(2, 4, 37, 8, 12), _cache(2, 2, L, 8, 13), _cache(2, 2, L, 8, 14)
    out, lse = tk.tree_attention(q, k, v, bits, prefix_lens, return_lse=True)
    ref_out, ref_lse = tree_attention_reference(q, k, v, bits, prefix_lens)
    # the CPU default of tree_attention is the reference itself, run inside the op: the same bits
    assert tk.backend.resolve("tree_attention", None, "cpu")[0] == "reference"
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def _round(tree, prefix_lens, q, keys, values, target, max_depth):
    """One verify round of public ops without value checks (as the decode loop calls them): mask -> attention ->
    accept -> compact."""
    pos, bits = tk.tree_mask(tree, prefix_lens, validate="none")
    out = tk.tree_attention(q, keys[0], values[0], bits, prefix_lens, validate="none")
    path, accept_len, next_token = tk.accept_greedy(tree, target, max_depth, validate="none")
    new_lens = tk.compact_kv(keys, values, prefix_lens, path, validate="none")
    return pos, bits, out, path, accept_len, next_token, new_lens


def _assert_same(got, want):
    """Exact equality, floats included: a compiled graph calls the same opaque ops as eager does."""
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_compile_fullgraph(case):
    """The four ops trace into one graph (no breaks: fullgraph) and mutate the caches like eager does."""
    tree, prefix_lens, target = case
    max_depth = int(tree.depth.max())
    L = 11 + 37 + 2
    q = _cache(2, 4, 37, 8, 20)
    keys = [_cache(2, 2, L, 8, 21), _cache(2, 2, L, 8, 22)]
    values = [_cache(2, 2, L, 8, 23), _cache(2, 2, L, 8, 24)]
    # Use a target that walks deep, so the compaction really moves rows.
    walk = tree.tokens.clone()
    target = torch.zeros_like(tree.tokens)
    for b in range(2):
        for i in range(int(tree.num_nodes[b])):
            kids = [j for j in range(i + 1, int(tree.num_nodes[b])) if int(tree.parents[b, j]) == i]
            target[b, i] = walk[b, kids[-1]] if kids else 0

    eager_keys, eager_values = [t.clone() for t in keys], [t.clone() for t in values]
    want = _round(tree, prefix_lens, q, eager_keys, eager_values, target, max_depth)
    assert int(want[4].max()) >= 3, "the case must accept a few nodes"

    compiled = torch.compile(_round, fullgraph=True, backend="aot_eager")
    got = compiled(tree, prefix_lens, q, keys, values, target, max_depth)
    _assert_same(got, want)
    for g, w in zip(keys + values, eager_keys + eager_values):
        assert torch.equal(g, w)


@pytest.mark.slow
def test_compile_fullgraph_inductor(case):
    """Same round through Inductor (C++ codegen on CPU: slower to compile, hence slow)."""
    tree, prefix_lens, target = case
    max_depth = int(tree.depth.max())
    L = 11 + 37
    q, keys, values = _cache(2, 4, 37, 8, 30), [_cache(2, 2, L, 8, 31)], [_cache(2, 2, L, 8, 32)]
    eager_keys, eager_values = [keys[0].clone()], [values[0].clone()]
    want = _round(tree, prefix_lens, q, eager_keys, eager_values, target, max_depth)
    got = torch.compile(_round, fullgraph=True)(tree, prefix_lens, q, keys, values, target, max_depth)
    _assert_same(got, want)
    assert torch.equal(keys[0], eager_keys[0]) and torch.equal(values[0], eager_values[0])


def test_metadata_errors_name_the_argument_without_value_checks(case):
    tree, prefix_lens, target = case
    with pytest.raises(ValueError, match="path_len"):
        torch.ops.taps.accept_greedy(tree.tokens, tree.parents, tree.num_nodes, target, 0)
    with pytest.raises(ValueError, match="max_depth"):
        tk.accept_greedy(tree, target, -1, validate="none")
    with pytest.raises(TypeError, match="target_tokens"):
        tk.accept_greedy(tree, target.int(), 3, validate="none")
    with pytest.raises(ValueError, match="prefix_lens"):
        tk.tree_mask(tree, prefix_lens[:1], validate="none")
    with pytest.raises(ValueError, match="path"):
        tk.compact_kv([_cache(2, 1, 50, 4, 0)], [_cache(2, 1, 50, 4, 1)], prefix_lens, torch.zeros(3, 2).long(),
                      validate="none")


def test_eager_cpu_calls_skip_the_dispatcher_and_traced_calls_do_not():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from taps_kernels._library import TapsOp
    from taps_kernels.ops.mask import tree_mask_op

    calls = []
    recording = TapsOp(lambda *a, **k: calls.append("op") or tree_mask_op.op(*a, **k),
                       lambda *a, **k: calls.append("kernel") or tree_mask_op.kernel(*a, **k))
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
    depth = torch.tensor([[0, 1, 1]], dtype=torch.int32)
    args = (parents, depth, torch.tensor([3], dtype=torch.int32), torch.tensor([4]))
    eager = recording(*args, backend=None, validate="none")
    assert calls == ["kernel"]
    with FakeTensorMode() as mode:  # tracing: the registered op (its fake implementation)
        fake = recording(*(mode.from_tensor(t) for t in args), backend=None, validate="none")
    assert calls == ["kernel", "op"] and fake[1].shape == eager[1].shape
    recording(*(t.to("meta") for t in args))  # a device other than the CPU: the op
    assert calls == ["kernel", "op", "op"]
