"""A round that raises leaves the target cache and the drafter state exactly as before the round, and
decoding can continue afterwards to the same output as HF ``generate``."""
import pytest
import torch

import taps_kernels
from taps.decode import SpeculativeDecoder, make_policy

from test_decode_greedy import hf_greedy, tiny_drafter, tiny_target  # noqa: F401  (shared tiny models)


def snapshot(dec):
    layers = dec.verifier.cache.layers
    return ([l.keys.clone() for l in layers], [l.values.clone() for l in layers], dec.verifier.length,
            [k.clone() for k in dec._state.k], dec._state.length, list(dec.generated))


def assert_same(dec, snap):
    keys, values, length, dk, dlen, generated = snap
    layers = dec.verifier.cache.layers
    assert dec.verifier.length == length and dec.verifier.cache.get_seq_length() == length
    for a, b in zip([l.keys for l in layers] + [l.values for l in layers], keys + values):
        assert torch.equal(a, b)
    assert dec._state.length == dlen and all(torch.equal(a, b) for a, b in zip(dec._state.k, dk))
    assert dec.generated == generated


class Boom(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise Boom("injected failure")


@pytest.mark.parametrize("where", ["accept", "compact", "context", "policy"])
def test_failed_round_restores_cache(monkeypatch, where):
    target, drafter = tiny_target(11), tiny_drafter(11)
    prompt, max_new = [5, 9, 2, 44, 17, 3], 20
    ref = hf_greedy(target, prompt, max_new)
    dec = SpeculativeDecoder(target, make_policy("ddtree:8"), drafter=drafter)
    dec.start(prompt, max_new)
    dec.step()
    dec.step()
    snap = snapshot(dec)
    with monkeypatch.context() as m:
        if where == "accept":  # after the verify forward appended the tree rows
            m.setattr(taps_kernels, "accept_greedy", _raise)
        elif where == "compact":
            m.setattr(dec.verifier, "commit", _raise)
        elif where == "context":  # after compaction and the crop to the new length
            m.setattr(drafter, "append_context", _raise)
        else:
            m.setattr(dec.policy, "build", _raise)
        with pytest.raises(Boom):
            dec.step()
        assert_same(dec, snap)
    while not dec.done:
        dec.step()
    assert dec.generated == ref
