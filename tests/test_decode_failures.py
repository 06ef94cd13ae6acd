"""A round that raises leaves the target cache and the drafter state exactly as before the round, and
decoding can continue afterwards to the same output as HF ``generate``."""
import pytest
import torch

import taps_kernels
from taps.decode import BatchDecoder, SpeculativeDecoder, make_policy

from helpers import hf_greedy, tiny_drafter, tiny_target


def snapshot(dec):
    """Every row's committed cache rows, lengths (device and host), drafter context (the projected rows' keys,
    the pending rows' features) and pending tree."""
    ver, st = dec.verifier, dec._state
    n = list(ver.host_lengths)
    rows = [([k[b, :, :n[b]].clone() for k in ver.keys], [v[b, :, :n[b]].clone() for v in ver.values])
            for b in range(len(n))]
    wait = st.pending.tolist()
    drows = [([k[b, :, :n[b] - wait[b]].clone() for k in st.k_buf],
              None if st.pending_features is None else st.pending_features[b, :wait[b]].clone())
             for b in range(len(n))]
    pend = [t.clone() for t in (dec._pending.tokens, dec._pending.parents, dec._pending.num_nodes)]
    gen = [list(r.generated) if r is not None else None for r in dec._rows]
    return (n, ver.lengths.clone(), rows, st.lengths.clone(), list(st.host_lengths), (wait, st.pending_bound),
            drows, pend, gen)


def assert_same(dec, snap):
    n, lengths, rows, dlengths, dhost, (wait, wait_bound), drows, pend, gen = snap
    ver, st = dec.verifier, dec._state
    assert ver.host_lengths == n and torch.equal(ver.lengths, lengths)
    assert torch.equal(st.lengths, dlengths) and st.host_lengths == dhost
    assert st.pending.tolist() == wait and st.pending_bound == wait_bound
    for b in range(len(n)):
        keys, values = rows[b]
        assert all(torch.equal(k[b, :, :n[b]], want) for k, want in zip(ver.keys, keys))
        assert all(torch.equal(v[b, :, :n[b]], want) for v, want in zip(ver.values, values))
        dkeys, feats = drows[b]
        assert all(torch.equal(k[b, :, :n[b] - wait[b]], want) for k, want in zip(st.k_buf, dkeys))
        assert feats is None or torch.equal(st.pending_features[b, :wait[b]], feats)
    assert all(torch.equal(a, b) for a, b in zip((dec._pending.tokens, dec._pending.parents, dec._pending.num_nodes),
                                                 pend))
    assert [list(r.generated) if r is not None else None for r in dec._rows] == gen


class Boom(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise Boom("injected failure")


def _inject(m, dec, drafter, where):
    if where == "verify":  # right after the verify forward wrote every row's tree into the cache
        dec.round_hook = _raise
    elif where == "commit":  # after the one commit call moved rows in every layer and advanced the lengths
        real = taps_kernels.commit_round

        def commit_then_raise(*args, **kwargs):
            real(*args, **kwargs)
            raise Boom("injected failure after the commit")

        m.setattr(taps_kernels, "commit_round", commit_then_raise)
    elif where == "context":  # after the commit advanced the lengths
        m.setattr(drafter, "append_context", _raise)
    elif where == "draft":  # after the context rows kept since the last draft were projected
        m.setattr(drafter, "draft", _raise)
    else:  # after everything else: the next trees
        m.setattr(dec.policy, "build", _raise)


@pytest.mark.parametrize("where", ["verify", "commit", "context", "draft", "policy"])
@pytest.mark.parametrize("undrafted", [False, True])
def test_failed_round_restores_cache(monkeypatch, where, undrafted):
    """``undrafted``: the rounds before the failing one did not draft, so it starts with context rows pending."""
    target, drafter = tiny_target(11), tiny_drafter(11)
    prompt, max_new = [5, 9, 2, 44, 17, 3], 20
    ref = hf_greedy(target, prompt, max_new)
    dec = SpeculativeDecoder(target, make_policy("ddtree:8"), drafter=drafter)
    dec.start(prompt, max_new)
    with monkeypatch.context() as m:
        if undrafted:
            m.setattr(dec.policy, "wants_draft", lambda: False)
        dec.step()
        dec.step()
    assert (dec._state.pending_bound > 0) == undrafted
    snap = snapshot(dec)
    with monkeypatch.context() as m:
        _inject(m, dec, drafter, where)
        with pytest.raises(Boom):
            dec.step()
        assert_same(dec, snap)
    dec.round_hook = None
    while not dec.done:
        dec.step()
    assert dec.generated == ref


@pytest.mark.parametrize("where", ["verify", "commit", "context"])
def test_failed_batched_round_restores_every_row(monkeypatch, where):
    """Rows of different lengths in one batch: a failed round restores all of them, and decoding goes on to
    each row's own greedy output."""
    target, drafter = tiny_target(11), tiny_drafter(11)
    prompts = [[5, 9, 2, 44, 17, 3], [8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    refs = [hf_greedy(target, p, 16) for p in prompts]
    dec = BatchDecoder(target, make_policy("ddtree:8"), drafter=drafter, max_batch=3)
    ids = [dec.submit(p, 16) for p in prompts]
    dec.admit()
    dec.step()
    snap = snapshot(dec)
    with monkeypatch.context() as m:
        _inject(m, dec, drafter, where)
        with pytest.raises(Boom):
            dec.step()
        assert_same(dec, snap)
    dec.round_hook = None
    results = dec.run()
    assert [results[i].token_ids for i in ids] == refs
