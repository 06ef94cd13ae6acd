"""``accept_round`` (a decode round's acceptance: the walk, idle rows, committed tokens, the history append): the C++
backend against the reference, both against a plain Python walk, and bad input refused before anything is written."""
import random

import pytest
import torch

import taps_kernels as tk
from taps_kernels import backend as bk

from helpers import random_root_path, random_tree, tree_rows

CPU = torch.device("cpu")
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(bool(bk.unavailable_reason(b, CPU, "accept_round")),
                                                     reason=bk.unavailable_reason(b, CPU, "accept_round") or "-"))
            for b in ("reference", "cpp")]


def _case(seed: int, B: int, N: int):
    """A random tree batch whose target tokens follow a random root path for a while (long acceptances), an active
    mask, and a history with rows close to full."""
    rng = random.Random(seed)
    tree = random_tree(rng, B, N, vocab=4, parents="recent")
    target = torch.randint(0, 4, (B, N), generator=torch.Generator().manual_seed(seed))
    for b in range(B):  # steer the target down one child at a time
        for node, token in random_root_path(rng, tree, b):
            target[b, node] = token
    active = torch.tensor([rng.random() < 0.75 for _ in range(B)])
    C = 12
    history = torch.randint(0, 9, (B, C + 1), generator=torch.Generator().manual_seed(seed + 1))
    lengths = torch.tensor([rng.choice([0, 3, C - 2, C]) for _ in range(B)])  # C - 2 / C: tokens past C dropped
    return tree, target, active, history, lengths


def _python_walk(tree, target, active, P):
    """Per row ``(path, committed)`` lists by a plain walk (first matching child, smallest index)."""
    out = []
    for b in range(tree.tokens.shape[0]):
        par, tok = tree_rows(tree, b)
        path = [0]
        while len(path) < P:
            want = int(target[b, path[-1]])
            kids = [v for v in range(path[-1] + 1, len(par)) if par[v] == path[-1] and tok[v] == want]
            if not kids:
                break
            path.append(kids[0])
        nxt = int(target[b, path[-1]])
        if not bool(active[b]):
            out.append(([0] + [-1] * (P - 1), [-1] * P))
            continue
        committed = [tok[v] for v in path[1:]] + [nxt]
        out.append((path + [-1] * (P - len(path)), committed + [-1] * (P - len(committed))))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed,B,N,max_depth", [(0, 1, 1, 0), (1, 3, 9, 4), (2, 5, 17, 16), (3, 4, 33, 2),
                                                (4, 2, 6, 7)])
def test_matches_a_python_walk_and_appends_the_history(backend, seed, B, N, max_depth):
    tree, target, active, history, lengths = _case(seed, B, N)
    h, n = history.clone(), lengths.clone()
    path, acc, nxt, committed = tk.accept_round(tree, target, active, max_depth, history=(h, n), backend=backend)
    want = _python_walk(tree, target, active, max_depth + 1)
    assert path.tolist() == [w[0] for w in want]
    assert committed.tolist() == [w[1] for w in want]
    assert acc.tolist() == [sum(c >= 0 for c in w[1]) for w in want]
    C = history.shape[1] - 1
    for b in range(B):
        k = int(acc[b])
        row = history[b, :C].tolist()
        for j, t in enumerate(committed[b, :k].tolist()):
            if lengths[b] + j < C:
                row[lengths[b] + j] = t
        assert h[b, :C].tolist() == row, b  # the sink column C is never read
        assert int(n[b]) == int(lengths[b]) + k
    path2, acc2, nxt2, committed2 = tk.accept_round(tree, target, active, max_depth, backend=backend)
    assert torch.equal(path, path2) and torch.equal(acc, acc2) and torch.equal(nxt, nxt2)
    assert torch.equal(committed, committed2)


def test_cpp_equals_the_reference_on_many_rounds():
    if bk.unavailable_reason("cpp", CPU, "accept_round"):
        pytest.skip("C++ backend unavailable")
    for seed in range(40):
        B, N = 1 + seed % 6, 1 + (seed * 7) % 40
        tree, target, active, history, lengths = _case(seed, B, N)
        outs = []
        for backend in ("reference", "cpp"):
            h, n = history.clone(), lengths.clone()
            res = tk.accept_round(tree, target, active, seed % 9, history=(h, n), backend=backend)
            outs.append((res, h[:, :-1], n))
        (a, ha, na), (b, hb, nb) = outs
        assert all(torch.equal(x, y) for x, y in zip(a, b)), seed
        assert torch.equal(ha, hb) and torch.equal(na, nb), seed


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad,exc,match", [
    (lambda a: dict(active=a["active"].int()), TypeError, "active: expected dtype"),
    (lambda a: dict(active=a["active"][:1]), ValueError, r"active: expected shape \(2,\)"),
    (lambda a: dict(history=(a["history"][0], None)), ValueError, "history"),
    (lambda a: dict(history=(a["history"][0][:, ::2], a["history"][1])), ValueError, "history_tokens.*contiguous"),
    (lambda a: dict(history=(a["history"][0].int(), a["history"][1])), TypeError, "history_tokens: expected dtype"),
    (lambda a: dict(max_depth=-1), ValueError, "max_depth"),
])
def test_bad_input_is_refused_before_anything_is_written(backend, bad, exc, match):
    tree, target, active, history, lengths = _case(5, 2, 8)
    h, n = history.clone(), lengths.clone()
    args = dict(tree=tree, target_tokens=target, active=active, max_depth=3, history=(h, n))
    args.update(bad(args))
    with pytest.raises(exc, match=match):
        tk.accept_round(**args, backend=backend)
    assert torch.equal(h, history) and torch.equal(n, lengths)
