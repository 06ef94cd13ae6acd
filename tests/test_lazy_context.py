"""The drafter keeps appended context features unprojected until a draft needs them
(:meth:`DrafterInference.append_context`, :meth:`flush_context`): a draft sees the keys and values it would have
seen with every append projected at once, crops and row resets keep the right rows, and a decode whose rounds never
draft never projects."""
import random

import pytest
import torch

from taps.decode import BatchDecoder, make_policy
from taps.models.drafter import DFlashConfig, DFlashDrafter, prepare_drafter
from taps.models.drafter_state import DFlashState

from helpers import hf_greedy, tiny_drafter, tiny_target

V, F = 96, 2 * 64


def _drafter(body):
    torch.manual_seed(5)
    cfg = DFlashConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                       num_hidden_layers=2, vocab_size=V, block_size=5, num_target_layers=4, target_layer_ids=[1, 2],
                       mask_token_id=V - 1, rope_theta=10000.0)
    d = DFlashDrafter(cfg).eval()
    if body == "blocks":
        from taps.models.drafter_blocks import block_draft_available

        if not block_draft_available():
            pytest.skip("the block forward needs vector int8 kernels on this CPU")
        prepare_drafter(d, "cpu", body="blocks")
    return d


def _run(d, pieces, eager, batch=3):
    """Appends ``pieces`` ([(features [B, T, F], counts or None)]) and drafts; ``eager`` projects after each append.
    Returns the draft's logits and hidden rows and each row's projected keys and values."""
    st = d.new_state(batch)
    for feats, counts in pieces:
        d.append_context(st, feats, counts=counts)
        if eager:
            d.flush_context(st)
        assert st.pending_bound == (0 if eager else st.pending_bound)
    emb, head = torch.nn.Embedding(V, 64), torch.nn.Linear(64, V, bias=False)
    torch.manual_seed(0)
    torch.nn.init.normal_(emb.weight), torch.nn.init.normal_(head.weight)
    logits, hidden = d.draft(st, torch.tensor([3, 9, 1][:batch]), emb, head, num_positions=3)
    n = st.lengths.tolist()
    kv = [[t[b, :, :n[b]] for t in st.k_buf + st.v_buf] for b in range(batch)]
    return logits, hidden, kv, n


def _pieces(seed, batch=3, rounds=7):
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(batch, 1 + seed % 9, F, generator=g), None)]
    for _ in range(rounds):
        T = int(torch.randint(1, 6, (1,), generator=g))
        out.append((torch.randn(batch, T, F, generator=g), torch.randint(0, T + 1, (batch,), generator=g)))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_block_drafts_equal_eager_projection_bit_for_bit(seed):
    # the block path projects each context row alone, so when and with which others it runs changes no bit
    d = _drafter("blocks")
    lazy, eager = _run(d, _pieces(seed), False), _run(d, _pieces(seed), True)
    assert lazy[3] == eager[3]
    assert torch.equal(lazy[0], eager[0]) and torch.equal(lazy[1], eager[1])
    for a, b in zip(lazy[2], eager[2]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("seed", range(2))
def test_torch_drafts_equal_eager_projection(seed):
    # the PyTorch layers project the kept rows in one matmul: float32 rounding of another row count at most
    d = _drafter("float32")
    lazy, eager = _run(d, _pieces(seed), False), _run(d, _pieces(seed), True)
    assert lazy[3] == eager[3]
    torch.testing.assert_close(lazy[0], eager[0], rtol=1e-5, atol=1e-4)
    for a, b in zip(lazy[2], eager[2]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("body", ["blocks", "float32"])
def test_long_appends_and_overflow_project_at_once(body):
    d = _drafter(body)
    g = torch.Generator().manual_seed(1)
    st = d.new_state(2)
    d.append_context(st, torch.randn(2, st.LAZY_ROWS + 3, F, generator=g))  # longer than a row keeps: projected
    assert st.pending_bound == 0 and st.pending.tolist() == [0, 0]
    for _ in range(st.LAZY_ROWS // 5):
        d.append_context(st, torch.randn(2, 5, F, generator=g), counts=torch.tensor([5, 2]))
    kept = st.pending.tolist()
    assert kept == [5 * (st.LAZY_ROWS // 5), 2 * (st.LAZY_ROWS // 5)] and st.pending_bound == 5 * (st.LAZY_ROWS // 5)
    d.append_context(st, torch.randn(2, 5, F, generator=g))  # would overflow the kept rows: they are projected first
    assert st.pending.tolist() == [5, 5] and st.pending_bound == 5
    want = [st.LAZY_ROWS + 3 + k + 5 for k in kept]
    assert st.lengths.tolist() == want


@pytest.mark.parametrize("body", ["blocks", "float32"])
def test_rollback_and_row_reset_keep_the_right_rows(body):
    """Crops into the kept rows and below them, and a row emptied then re-extended (prefix reuse), leave the state a
    fresh one of the same context would have."""
    d = _drafter(body)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2, 30, F, generator=g)

    def state_of(lengths_kept):
        st = d.new_state(2)
        for b, n in enumerate(lengths_kept):
            d.append_context(st, feats[b:b + 1, :n], rows=slice(b, b + 1))
        return st

    def agree(st, ref):
        emb, head = torch.nn.Embedding(V, 64), torch.nn.Linear(64, V, bias=False)
        got = d.draft(st, torch.tensor([4, 7]), emb, head, num_positions=2)[0]
        want = d.draft(ref, torch.tensor([4, 7]), emb, head, num_positions=2)[0]
        assert st.lengths.tolist() == ref.lengths.tolist()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)

    st = d.new_state(2)
    d.append_context(st, feats[:, :20])
    d.flush_context(st)
    d.append_context(st, feats[:, 20:30])  # rows 20..29 kept unprojected
    d.rollback(st, [25, 12])  # row 0 into the kept rows, row 1 below them
    assert st.pending.tolist() == [5, 0]
    agree(st, state_of([25, 12]))
    d.append_context(st, feats[:, 25:28], counts=torch.tensor([3, 0]))
    d.reset_row(st, 0)  # the request left; its rows are projected before the row is emptied
    d.reset_row(st, 0, keep=26)  # the next prompt starts as the last one did
    assert st.pending.tolist() == [0, 0]
    agree(st, state_of([26, 12]))


def test_rounds_without_a_draft_never_project(monkeypatch):
    """A gate that never opens: the rounds (each a root alone) keep every context row and project none; the
    output is the target's greedy output."""
    target, drafter = tiny_target(11), tiny_drafter(11)
    calls = {"project": 0}
    real = drafter._project

    def counting(*args, **kwargs):
        calls["project"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(drafter, "_project", counting)
    policy = make_policy("ddtree:4")
    monkeypatch.setattr(policy, "wants_draft", lambda: False)
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 60) for _ in range(rng.randint(3, 9))] * 2 for _ in range(3)]
    dec = BatchDecoder(target, policy, drafter=drafter, max_batch=2)
    ids = [dec.submit(p, 12) for p in prompts]
    res = dec.run()
    assert [res[i].token_ids for i in ids] == [hf_greedy(target, p, 12) for p in prompts]
    # only the rows of finished requests are projected (so that a next prompt may keep them), not each round's
    rounds = sum(len(res[i].stats.rounds) for i in ids)
    assert calls["project"] <= len(prompts) < rounds


def _state_tensors(st):
    return [st.pending_features.clone(), st.pending.clone(), st.lengths.clone()]


def _path_rounds(seed, batch=3, rounds=9, nodes=7):
    """Rounds of (verify rows [B, N, F], path [B, P] with -1 pads, counts [B]) as the decode loop hands them over."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rounds):
        P = int(torch.randint(1, 5, (1,), generator=g))
        counts = torch.randint(0, P + 1, (batch,), generator=g)
        path = torch.full((batch, P), -1, dtype=torch.int64)
        for b in range(batch):
            picked = sorted(random.Random(seed * 31 + b).sample(range(nodes), int(counts[b])))
            path[b, :len(picked)] = torch.tensor(picked, dtype=torch.int64)
        out.append((torch.randn(batch, nodes, F, generator=g), path, counts))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_stash_in_one_call_equals_the_torch_gather_and_copy(seed, monkeypatch):
    """A path's rows kept by ``_C.stash_rows`` leave the state (kept features, pending counts, lengths) and the
    draft that follows exactly as the torch gather and copy do."""
    from taps.models import drafter_state
    from taps_kernels import _C

    calls = []
    stash = _C.stash_rows
    monkeypatch.setattr(_C, "stash_rows", lambda *a: calls.append(1) or stash(*a))
    d = _drafter("float32")
    emb, head = torch.nn.Embedding(V, 64), torch.nn.Linear(64, V, bias=False)
    results = []
    for in_place in (True, False):
        if not in_place:
            monkeypatch.setattr(drafter_state.DrafterInference, "_native_stash", staticmethod(lambda *a: None))
        st = d.new_state(3)
        d.append_context(st, torch.randn(3, 4, F, generator=torch.Generator().manual_seed(9)))  # kept rows exist
        seen = []
        for feats, path, counts in _path_rounds(seed):
            d.append_context(st, feats, counts=counts, path=path)
            seen.append(_state_tensors(st) + [st.pending_bound, st.bound])
        logits, _ = d.draft(st, torch.tensor([3, 9, 1]), emb, head, num_positions=3)
        results.append((seen, logits))
    assert len(calls) == 10  # every append of the first pass ran the one call
    (a, la), (b, lb) = results
    for x, y in zip(a, b):
        assert all(torch.equal(u, v) for u, v in zip(x[:3], y[:3])) and x[3:] == y[3:]
    assert torch.equal(la, lb)


def test_stash_rejects_bad_input_and_leaves_the_state_as_it_was():
    from taps_kernels import _C

    d = _drafter("float32")
    st = d.new_state(2)
    d.append_context(st, torch.randn(2, 3, F))
    before = _state_tensors(st)
    feats, path, counts = torch.randn(2, 5, F), torch.tensor([[0, 2], [1, -1]]), torch.tensor([2, 1])
    bad = {
        "path[1][0]: expected a node in [0, 5)": dict(path=torch.tensor([[0, 2], [7, -1]])),
        "counts[0]: expected 0 <= count <= 2": dict(counts=torch.tensor([3, 1])),
        "ctx_features: expected dtype float32": dict(feats=feats.double()),
        "path: expected shape (2, *)": dict(path=torch.zeros(3, 2, dtype=torch.int64)),
        "rows: expected 2 state rows from row 1": dict(row0=1),
    }
    for message, change in bad.items():
        args = dict(feats=feats, path=path, counts=counts, row0=0) | change
        with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)").replace("*", r"\*")):
            _C.stash_rows(args["feats"], args["path"], args["counts"], st.pending_features, st.pending, st.lengths,
                          args["row0"])
        assert all(torch.equal(u, v) for u, v in zip(before, _state_tensors(st)))
    full = torch.full_like(st.pending, DFlashState.LAZY_ROWS - 1)
    with pytest.raises(ValueError, match=r"pending\[0\]: 63 kept rows \+ 2 new ones do not fit"):
        _C.stash_rows(feats, path, counts, st.pending_features, full, st.lengths, 0)
    assert all(torch.equal(u, v) for u, v in zip(before, _state_tensors(st)))
    with pytest.raises(ValueError, match=r"path: expected \[2, T\] int64"):
        d.append_context(st, feats, counts=counts, path=path.int())
