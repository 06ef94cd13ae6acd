"""Engine layout conversions (taps_kernels.integrations) against oracles written from each engine's definition.

* SGLang: the linked lists are rebuilt the way ``build_tree_efficient`` (sgl-kernel) builds them (nodes from
  the last to the first, each pushed in front of its parent's child list), the ``QLEN_ONLY`` rows by walking
  parents up from each node as that kernel does, and the greedy walk of ``verify_tree_greedy`` over the
  result must accept the same path as our ``accept_greedy``.
* llama.cpp: a query sees a cell iff the cell holds the query's first sequence id and its position is not
  after the query's (``set_input_kq_mask``); that must reproduce the tree's ancestor relation, and every
  sequence must be a root-to-leaf path with gap-free positions.
Neither engine's own function imports without a GPU or a C++ build here (sgl-kernel needs CUDA; llama.cpp
has no Python), so the oracles stand in for them.
"""
from __future__ import annotations

import random

import pytest
import torch

from helpers import make_tree, random_tree
from taps_kernels import accept_greedy, tree_mask
from taps_kernels.integrations import (LLAMA_MAX_SEQ, batch_entries, pack_qlen_only, to_eagle_topology,
                                       to_sequence_sets)


def _trees():
    rng = random.Random(7)
    out = [make_tree([([-1], [5])]),                                   # root only
           make_tree([([-1, 0, 1, 0, 3, 3, 0], [1, 2, 3, 4, 5, 6, 7])]),  # the layout docstring's kind of tree
           make_tree([([-1] + list(range(0, 39)), list(range(40)))]),    # a 40-deep chain (two words)
           make_tree([([-1, 0, 0, 0, 1, 1, 2], [1, 2, 3, 4, 5, 6, 7]), ([-1, 0], [3, 4])], N=9)]  # ragged + padding
    out += [random_tree(rng, B=3, N=n, vocab=6) for n in (2, 5, 17, 33, 70)]
    return out


TREES = _trees()


# ----------------------------------------------------------------------------------------------- SGLang oracle

def sglang_lists_oracle(parents, n, N):
    """build_tree_efficient's rule: for i = N-1 .. 1, i becomes its parent's first child and the old first child
    becomes i's next sibling."""
    nxt, sib = [-1] * N, [-1] * N
    for i in range(n - 1, 0, -1):
        p = parents[i]
        if nxt[p] != -1:
            sib[i] = nxt[p]
        nxt[p] = i
    return nxt, sib


def sglang_mask_row_oracle(parents, i, N):
    """build_tree_efficient's QLEN_ONLY row: the root column, then the node and each ancestor walking up."""
    row = [False] * N
    row[0] = True
    j = i
    while j > 0:
        row[j] = True
        j = parents[j]
    return row


def sglang_greedy_walk(cand, nxt, sib, target, b, N, max_steps):
    """verify_tree_greedy for request b over flattened rows (retrive_index = b*N + i)."""
    path, cur, last = [0], 0, b * N
    for _ in range(max_steps):
        cur = nxt[cur]
        while cur != -1:
            if cand[cur] == target[last]:
                path.append(cur)
                last = b * N + cur
                break
            cur = sib[cur]
        if cur == -1:
            break
    return path


@pytest.mark.parametrize("t", range(len(TREES)))
def test_sglang_topology_matches_engine_definition(t):
    tree = TREES[t]
    B, N = tree.tokens.shape
    prefix = torch.arange(B, dtype=torch.int64) * 11 + 3
    pos, bits = tree_mask(tree, prefix)
    topo = to_eagle_topology(tree.tokens, bits, tree.num_nodes, prefix)
    assert topo.retrive_index.tolist() == [[b * N + i for i in range(N)] for b in range(B)]
    assert torch.equal(topo.positions, pos.reshape(-1))
    assert torch.equal(topo.candidates, tree.tokens)
    mask = topo.tree_mask.view(B, N, N)
    for b in range(B):
        n = int(tree.num_nodes[b])
        par = tree.parents[b].tolist()
        nxt, sib = sglang_lists_oracle(par, n, N)
        assert topo.retrive_next_token[b].tolist() == nxt
        assert topo.retrive_next_sibling[b].tolist() == sib
        for i in range(N):
            want = sglang_mask_row_oracle(par, i, N) if i < n else [j == i for j in range(N)]
            assert mask[b, i].tolist() == want, (b, i)


@pytest.mark.parametrize("t", range(len(TREES)))
def test_sglang_greedy_walk_accepts_our_path(t):
    tree = TREES[t]
    B, N = tree.tokens.shape
    _, bits = tree_mask(tree, torch.zeros(B, dtype=torch.int64))
    topo = to_eagle_topology(tree.tokens, bits, tree.num_nodes, torch.zeros(B, dtype=torch.int64))
    g = torch.Generator().manual_seed(t)
    for trial in range(20):
        # targets that often match a child: draw from the tree's own tokens
        target = tree.tokens.view(-1)[torch.randint(0, B * N, (B, N), generator=g)]
        path, acc, nxt_tok = accept_greedy(tree, target)
        flat_target = target.reshape(-1).tolist()
        for b in range(B):
            walk = sglang_greedy_walk(topo.candidates[b].tolist(), topo.retrive_next_token[b].tolist(),
                                      topo.retrive_next_sibling[b].tolist(), flat_target, b, N, N)
            ours = [int(x) for x in path[b, :int(acc[b])]]
            assert walk == ours, (trial, b)
            assert flat_target[b * N + walk[-1]] == int(nxt_tok[b])


def test_sglang_bitpacking_is_little_endian_rows():
    tree = make_tree([([-1, 0, 1, 0, 3, 3, 0, 6, 7, 8], list(range(10)))])
    _, bits = tree_mask(tree, torch.zeros(1, dtype=torch.int64))
    topo = to_eagle_topology(tree.tokens, bits, tree.num_nodes, torch.zeros(1, dtype=torch.int64))
    packed = pack_qlen_only(topo.tree_mask, 1, 10)
    assert packed.shape == (10, 2) and packed.dtype == torch.uint8
    # node 9: ancestors 0, 6, 7, 8 and itself -> bits 0, 6, 7 in byte 0 (0b11000001), bits 8, 9 in byte 1
    assert packed[9].tolist() == [0b11000001, 0b11]
    # N <= 32: the packed row is the low bytes of our int32 word
    for i in range(10):
        assert int(packed[i, 0]) | (int(packed[i, 1]) << 8) == int(bits[0, i, 0])
    with pytest.raises(ValueError, match="num_draft_tokens: expected at most 32"):
        pack_qlen_only(torch.zeros(33 * 33, dtype=torch.bool), 1, 33)


# ----------------------------------------------------------------------------------------------- llama.cpp oracle

def llamacpp_visible(first_seq_q, pos_q, seqs_cell, pos_cell):
    """set_input_kq_mask's rule for one query and one (non-empty) cell."""
    return first_seq_q in seqs_cell and pos_cell <= pos_q


def ancestors_oracle(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@pytest.mark.parametrize("t", range(len(TREES)))
def test_llamacpp_sequence_sets_reproduce_tree_attention(t):
    tree = TREES[t]
    B, N = tree.tokens.shape
    prefix = torch.arange(B, dtype=torch.int64) + 4
    pos, bits = tree_mask(tree, prefix)
    sets = to_sequence_sets(bits, tree.num_nodes, prefix)
    assert torch.equal(sets.positions, pos)
    for b in range(B):
        n = int(tree.num_nodes[b])
        par = tree.parents[b].tolist()
        leaves = [i for i in range(n) if i not in par[1:n]]
        assert int(sets.num_seqs[b]) == len(leaves)
        assert sets.leaves[b, :len(leaves)].tolist() == leaves
        entries = batch_entries(tree.tokens, sets, b, seq_offset=100)
        assert len(entries) == n
        seqs = [set(s) for _, _, s in entries]
        for i in range(n):  # the cells each query sees, by llama.cpp's rule, over the tree's own cells
            tok, p, s = entries[i]
            assert tok == int(tree.tokens[b, i]) and s == sorted(s) and s[0] == int(sets.first_seq[b, i]) + 100
            seen = {j for j in range(n) if llamacpp_visible(s[0], p, seqs[j], entries[j][1])}
            assert seen == ancestors_oracle(par, i), (b, i)
        for k, leaf in enumerate(leaves):  # each sequence: one root-to-leaf path, positions without a gap
            members = [j for j in range(n) if 100 + k in seqs[j]]
            assert set(members) == ancestors_oracle(par, leaf)
            assert sorted(entries[j][1] for j in members) == list(range(int(prefix[b]), int(prefix[b]) + len(members)))
        assert sets.first_seq[b, n:].tolist() == [-1] * (N - n)


def test_llamacpp_too_many_leaves():
    n = LLAMA_MAX_SEQ + 1
    tree = make_tree([([-1] + [0] * n, list(range(n + 1)))])
    _, bits = tree_mask(tree, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"at most max_sequences = 256 leaves .* received 257"):
        to_sequence_sets(bits, tree.num_nodes, torch.zeros(1, dtype=torch.int64))
    small = make_tree([([-1, 0, 0, 0], [1, 2, 3, 4])])
    _, bits = tree_mask(small, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="max_sequences = 2 leaves"):
        to_sequence_sets(bits, small.num_nodes, torch.zeros(1, dtype=torch.int64), max_sequences=2)
    with pytest.raises(ValueError, match="max_sequences: expected an int in"):
        to_sequence_sets(bits, small.num_nodes, torch.zeros(1, dtype=torch.int64), max_sequences=0)


# ----------------------------------------------------------------------------------------------- bad input

def test_bad_bits_are_refused():
    tree = make_tree([([-1, 0, 1], [1, 2, 3])])
    _, bits = tree_mask(tree, torch.zeros(1, dtype=torch.int64))
    zero = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError, match="ancestor_bits"):
        to_sequence_sets(bits.long(), tree.num_nodes, zero)
    with pytest.raises(ValueError, match=r"num_nodes\[0\]: expected a value in \[1, 3\], received 4"):
        to_eagle_topology(tree.tokens, bits, torch.tensor([4], dtype=torch.int32), zero)
    above = bits.clone()
    above[0, 0, 0] |= 0b100
    with pytest.raises(ValueError, match="no bit above the diagonal"):
        to_eagle_topology(tree.tokens, above, tree.num_nodes, zero)
    four = make_tree([([-1, 0, 0, 2], [1, 2, 3, 4])])
    _, not_tree = tree_mask(four, zero)
    not_tree[0, 3, 0] = 0b1111  # node 3 under both 1 and 2: not a tree
    with pytest.raises(ValueError, match=r"ancestor_bits\[0, 3\]: expected the ancestors of node 3"):
        to_sequence_sets(not_tree, four.num_nodes, zero)
    no_self = bits.clone()
    no_self[0, 1, 0] = 0b1
    with pytest.raises(ValueError, match="own bit"):
        to_eagle_topology(tree.tokens, no_self, tree.num_nodes, zero)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]: expected >= 0, received -1"):
        to_eagle_topology(tree.tokens, bits, tree.num_nodes, torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"prefix_lens\[0\]: expected >= 0"):
        to_sequence_sets(bits, tree.num_nodes, torch.tensor([-2]))
