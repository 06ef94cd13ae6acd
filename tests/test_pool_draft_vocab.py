"""Pools over a reduced draft vocabulary (``vocab_ids``) equal pools over the full vocabulary with ``-inf``
outside it: the same trees and token ids (exact), the same statistics (float tolerance: the log-softmax sums
run over fewer columns)."""
import pytest
import torch

import taps_kernels as tk
from taps_kernels import backend as bk

CPU = torch.device("cpu")
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(bool(bk.unavailable_reason(b, CPU, "topk_stats")),
                                                     reason=bk.unavailable_reason(b, CPU, "topk_stats") or "-"))
            for b in ("reference", "cpp", "triton")]
FLOATS = ("logq", "step_logq", "topk_logp", "entropy", "margin", "topk_mass")
EXACT = ("rank", "topk_ids")


def _sub_and_full(B, D, V_full, V_draft, ties, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V_full, generator=g)[:V_draft].sort().values
    if ties:  # integer logits: equal log-probs, ranked by token id in both layouts
        sub = torch.randint(-3, 3, (B, D, V_draft), generator=g).float()
    else:
        sub = torch.randn(B, D, V_draft, generator=g) * 3
    full = torch.full((B, D, V_full), float("-inf"))
    full[..., ids] = sub
    return sub, full, ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,D,V_full,V_draft,top_k,pool_size,ties", [
    (1, 7, 1001, 257, 64, 128, False), (3, 5, 333, 40, 8, 31, True), (2, 1, 97, 3, 5, 4, False),
    (1, 15, 500, 499, 1, 1, True)])
def test_candidate_pool_over_draft_vocab_equals_full(backend, B, D, V_full, V_draft, top_k, pool_size, ties):
    sub, full, ids = _sub_and_full(B, D, V_full, V_draft, ties, seed=B * 100 + D + V_draft)
    roots = torch.arange(B, dtype=torch.int64) * 7 + V_full - B * 7  # ids beyond V_draft: fine for roots
    a = tk.candidate_pool(full, roots, min(top_k, V_draft), pool_size, backend=backend)
    b = tk.candidate_pool(sub, roots, top_k, pool_size, backend=backend, vocab_ids=ids)
    for f in ("tokens", "parents", "depth", "num_nodes"):
        assert torch.equal(getattr(a.tree, f), getattr(b.tree, f)), f
    for f in EXACT:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for f in FLOATS:
        torch.testing.assert_close(getattr(b, f), getattr(a, f), atol=2e-5, rtol=1e-5, msg=f)
    assert bool(torch.isin(b.topk_ids, ids).all())


@pytest.mark.parametrize("bad,match", [
    (lambda ids: ids.flip(0), r"vocab_ids\[1\]: expected strictly increasing"),
    (lambda ids: torch.cat([ids[:1], ids[:-1]]), r"vocab_ids\[1\]: expected strictly increasing"),
    (lambda ids: ids - ids[0] - 1, r"vocab_ids\[0\]: expected token ids >= 0"),
    (lambda ids: ids[:-1], r"vocab_ids: expected shape \(6,\)"),
    (lambda ids: ids.int(), "vocab_ids: expected dtype")])
def test_vocab_ids_checked(bad, match):
    sub, _, ids = _sub_and_full(1, 2, 50, 6, False, seed=1)
    with pytest.raises((ValueError, TypeError), match=match):
        tk.candidate_pool(sub, torch.tensor([3]), 4, 8, vocab_ids=bad(ids))
    with pytest.raises((ValueError, TypeError), match=match):
        tk.topk_stats(sub, 4, vocab_ids=bad(ids))


def test_roots_may_lie_outside_the_draft_vocab_but_not_below_zero():
    sub, _, ids = _sub_and_full(1, 2, 50, 6, False, seed=1)
    assert int(tk.candidate_pool(sub, torch.tensor([49]), 4, 8, vocab_ids=ids).tree.tokens[0, 0]) == 49
    with pytest.raises(ValueError, match=r"root_tokens\[0\]: token -2 is negative"):
        tk.candidate_pool(sub, torch.tensor([-2]), 4, 8, vocab_ids=ids)
