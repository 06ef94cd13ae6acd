"""Definitions where this project differs from the upstream reference code on purpose (docs/DESIGN.md,
"Upstream parity"): the pool never holds two siblings with the same token, even under tied logits, and
accept_greedy on a tree that does hold duplicate siblings is well defined: it follows the smaller index."""
import random

import pytest
import torch

import taps_kernels as tk
from helpers import make_tree, random_tree, tree_rows
from taps_kernels import backend

CPU = torch.device("cpu")
ACCEPT_BACKENDS = [b for b in ("reference", "cpp") if not backend.available_backends("accept_greedy", CPU)[b]]
POOL_BACKENDS = [b for b in ("reference", "cpp") if not backend.available_backends("best_first_pool", CPU).get(b, "x")]


def sibling_tokens(tree, b):
    n = int(tree.num_nodes[b])
    kids = {}
    for v in range(1, n):
        kids.setdefault(int(tree.parents[b, v]), []).append(int(tree.tokens[b, v]))
    return kids


@pytest.mark.parametrize("pool_backend", POOL_BACKENDS or [None])
@pytest.mark.parametrize("seed", range(4))
def test_pool_never_creates_duplicate_siblings(seed, pool_backend):
    """Tied logits (few distinct values) are the case where a rank-based search could emit one token twice."""
    g = torch.Generator().manual_seed(seed)
    B, D, V = 3, 6, 23
    levels = torch.tensor([0.0, 0.0, 1.0, -1.0, 2.5])  # many exact ties within a position
    logits = levels[torch.randint(0, len(levels), (B, D, V), generator=g)]
    if seed % 2:
        logits[1] = 0.0  # a position where every token ties
    pool = tk.candidate_pool(logits, torch.randint(0, V, (B,), generator=g), top_k=7, pool_size=60,
                             pool_backend=pool_backend)
    for b in range(B):
        for parent, toks in sibling_tokens(pool.tree, b).items():
            assert len(toks) == len(set(toks)), (b, parent, toks)
        # ties at a position are broken by the smaller token id: ranks follow (-logit, id)
        for v in range(1, int(pool.tree.num_nodes[b])):
            d, r = int(pool.tree.depth[b, v]), int(pool.rank[b, v])
            order = sorted(range(V), key=lambda t: (-float(logits[b, d - 1, t]), t))
            assert int(pool.tree.tokens[b, v]) == order[r]


@pytest.mark.parametrize("be", ACCEPT_BACKENDS)
def test_accept_greedy_follows_the_smaller_index_among_duplicate_siblings(be):
    # 0 -> 1 (tok 5), 0 -> 2 (tok 5, duplicate), 1 -> 3 (tok 7), 2 -> 4 (tok 8), 2 -> 5 (tok 7)
    tree = make_tree([([-1, 0, 0, 1, 2, 2], [9, 5, 5, 7, 8, 7])], 6)
    target = torch.tensor([[5, 7, 8, 1, 1, 1]])
    path, n, nxt = tk.accept_greedy(tree, target, backend=be)
    assert path[0, :n[0]].tolist() == [0, 1, 3] and int(n[0]) == 3 and int(nxt[0]) == 1
    # the later duplicate (2) is never entered, even where its subtree would have accepted more
    target = torch.tensor([[5, 3, 8, 1, 2, 1]])
    path, n, nxt = tk.accept_greedy(tree, target, backend=be)
    assert path[0, :n[0]].tolist() == [0, 1] and int(nxt[0]) == 3


@pytest.mark.parametrize("be", ACCEPT_BACKENDS)
def test_accept_greedy_on_random_trees_with_duplicates_matches_a_first_match_walk(be):
    rng = random.Random(4)
    for _ in range(40):
        n = rng.randint(1, 14)
        tree = random_tree(rng, 1, n, vocab=3, parents="uniform")  # 3 tokens: duplicate siblings are common
        par, tok = tree_rows(tree)
        target = torch.tensor([[rng.randrange(3) for _ in range(n)]])
        cur, want = 0, [0]
        while True:
            kids = [v for v in range(cur + 1, n) if par[v] == cur and tok[v] == int(target[0, cur])]
            if not kids:
                break
            cur = min(kids)
            want.append(cur)
        path, acc, nxt = tk.accept_greedy(tree, target, backend=be)
        assert path[0, :acc[0]].tolist() == want and int(nxt[0]) == int(target[0, cur])
