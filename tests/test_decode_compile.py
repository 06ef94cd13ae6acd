"""The round's device-side pieces trace into one graph (``torch.compile(fullgraph=True)``), as CUDA graphs need.

What compiles: the public ops the loop calls (tree mask, tree attention, accept walk, KV compaction), the
tree-building ones (top-K statistics, best-first pool, edge scoring, subtree selection and re-indexing), each a
``taps::`` library op in the graph, with ``validate="none"`` as the round calls them; the loop's own
device-side tree edits and size rule (depth cap, top-n per row, joint batch sizes, committed-token packing), and
prompt lookup (history append, n-gram match, graft into the pool).
"""
import torch

import taps_kernels
import taps_kernels as tk
from taps_kernels import Tree
from taps.decode.policies.gate import batch_table
from taps.decode.tree_ops import chain_tree, keep_top, truncate_depth

from helpers import random_tree


def _tail(tokens, parents, depth, num_nodes, log_reach, caps, sizes, prefix_lens, q, keys, values, target, table):
    """Per-row top-n + depth cap, mask, attention, acceptance, compaction, packed result."""
    pool = Tree(tokens, parents, depth, num_nodes)
    tree = keep_top(pool, log_reach, sizes, caps, levels=8)
    _, bits = tk.tree_mask(tree, prefix_lens, validate="none")
    N = tree.tokens.shape[1]
    out = tk.tree_attention(q[:, :, :N], keys[0], values[0], bits, prefix_lens, validate="none")
    path, acc, nxt = tk.accept_greedy(tree, target[:, :N], max_depth=N - 1, validate="none")
    new_lens = tk.compact_kv(keys, values, prefix_lens, path, validate="none")
    joint = tk.select_subtree(pool, log_reach, 8, rule=tk.ThroughputRule(table, 0.05, tokens.shape[0]), validate="none")
    return (torch.cat([acc[:, None], nxt[:, None], new_lens[:, None], joint.num_selected[:, None].long(), path], 1), out,
            joint.expected, joint.pool_index)


def _inputs(seed):
    import random

    rng = random.Random(seed)
    tree = random_tree(rng, 3, 12, vocab=40)
    g = torch.Generator().manual_seed(seed)
    B, N = tree.tokens.shape
    log_reach = -torch.rand(B, N, generator=g).cumsum(1)
    log_reach[:, 0] = 0
    log_reach = torch.where(torch.arange(N)[None] < tree.num_nodes[:, None], log_reach, torch.tensor(float("-inf")))
    H, Dh, L = 2, 8, 40
    prefix = torch.tensor([5, 17, 0])
    keys = [torch.randn(B, H, L, Dh, generator=g) for _ in range(2)]
    values = [torch.randn(B, H, L, Dh, generator=g) for _ in range(2)]
    q = torch.randn(B, 4, N, Dh, generator=g)
    target = tree.tokens.clone()
    target[:, ::2] = 0  # the walk accepts some nodes and stops at others
    table = batch_table({"latency": [0.05 + 0.004 * n for n in range(9)]}, B, 24)
    return (tree.tokens, tree.parents, tree.depth, tree.num_nodes, log_reach, torch.tensor([3, 1, 0]),
            torch.tensor([6, 4, 9]), prefix, q, keys, values, target, table)


def test_round_tail_compiles_fullgraph_and_equals_eager():
    eager_in, comp_in = _inputs(0), _inputs(0)
    want = _tail(*eager_in)
    got = torch.compile(_tail, fullgraph=True, backend="aot_eager")(*comp_in)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for a, b in zip(comp_in[9] + comp_in[10], eager_in[9] + eager_in[10]):  # the compaction mutated both alike
        assert torch.equal(a, b)


def test_policy_chain_and_depth_cap_compile():
    def dflash(bonus, logits, caps):
        return truncate_depth(chain_tree(bonus, logits.argmax(-1)), caps).tokens

    bonus, logits, caps = torch.tensor([1, 2]), torch.randn(2, 5, 30), torch.tensor([2, 5])
    got = torch.compile(dflash, fullgraph=True, backend="aot_eager")(bonus, logits, caps)
    assert torch.equal(got, dflash(bonus, logits, caps))


def test_pool_score_select_compile_fullgraph():
    """Draft logits -> pool -> scorer -> selection -> tail of the round, one graph, equal to eager."""
    def build(logits, bonus, weights, latency, prefix_lens, target):
        pool = tk.candidate_pool(logits, bonus, top_k=4, pool_size=8, validate="none")
        _, _, log_reach = tk.score_edges(pool, weights, validate="none")
        sel = tk.select_subtree(pool.tree, log_reach, 4, rule=tk.ReachRule(latency, t0=0.001), validate="none")
        _, bits = tk.tree_mask(sel.tree, prefix_lens, validate="none")
        path, acc, nxt = tk.accept_greedy(sel.tree, target, max_depth=4, validate="none")
        return sel.tree.tokens, sel.tree.parents, sel.pool_index, log_reach, bits, path, acc, nxt

    g = torch.Generator().manual_seed(0)
    logits, bonus = torch.randn(2, 5, 30, generator=g) * 2, torch.tensor([1, 2])
    weights = taps_kernels.ScorerWeights.random(tiny=True, generator=g)
    latency = torch.tensor([0.02 + 0.003 * n for n in range(6)], dtype=torch.float64)
    prefix_lens, target = torch.tensor([7, 3]), torch.randint(30, (2, 5), generator=g)
    want = build(logits, bonus, weights, latency, prefix_lens, target)
    public = taps_kernels.select_subtree(taps_kernels.candidate_pool(logits, bonus, 4, 8).tree, want[3], 4,
                                         rule=taps_kernels.ReachRule(latency, t0=0.001))
    assert torch.equal(want[0], public.tree.tokens) and torch.equal(want[2], public.pool_index)
    got = torch.compile(build, fullgraph=True, backend="aot_eager")(logits, bonus, weights, latency, prefix_lens,
                                                                    target)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_prompt_lookup_compiles_fullgraph():
    """History append, n-gram match, graft into a pool and the lookup-only tree: one graph, equal to eager."""
    import random

    from taps.decode.token_history import TokenHistory, lookup_only_tree
    from taps_kernels.reference.accept import append_history_reference
    from taps_kernels.reference.lookup import graft_chain_reference as graft_chain
    from taps_kernels.reference.lookup import lookup_chain_reference as lookup_chain

    def lookup(history, committed, counts, tree_parts, log_reach, bonus, caps):
        append_history_reference(*history.buffers(3), committed, counts)
        tokens, lengths = history.rows(slice(0, 3))
        chain, chain_len, ngram, sibling = lookup_chain(tokens, lengths, 6, 3)
        reach = torch.log(torch.full(chain.shape, 0.5)).cumsum(1)
        tree, merged_reach, nodes = graft_chain(Tree(*tree_parts), log_reach, chain, chain_len, reach)
        only = lookup_only_tree(bonus, chain, chain_len, caps)
        return (tree.tokens, tree.parents, tree.num_nodes, merged_reach, nodes, ngram, sibling, only.tokens,
                only.num_nodes)

    def inputs():
        rng = random.Random(2)
        history = TokenHistory(3, "cpu")
        for b, n in enumerate((30, 12, 25)):
            history.set_row(b, [rng.randrange(5) for _ in range(n)])
        history.reserve(40)
        tree = random_tree(rng, 3, 9, vocab=5)
        g = torch.Generator().manual_seed(2)
        reach = torch.where(torch.arange(9)[None, :] < tree.num_nodes[:, None].long(), -torch.rand(3, 9, generator=g),
                            torch.tensor(float("-inf")))
        return (history, torch.randint(5, (3, 4), generator=g), torch.tensor([2, 4, 1]),
                (tree.tokens, tree.parents, tree.depth, tree.num_nodes), reach, torch.tensor([1, 2, 3]),
                torch.tensor([6, 2, 0]))

    eager_in, comp_in = inputs(), inputs()
    want = lookup(*eager_in)
    assert int((want[5] > 0).sum()) >= 2  # matches happened: the graft really added or reused chain nodes
    got = torch.compile(lookup, fullgraph=True, backend="aot_eager")(*comp_in)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(comp_in[0].tokens, eager_in[0].tokens) and torch.equal(comp_in[0].lengths, eager_in[0].lengths)
