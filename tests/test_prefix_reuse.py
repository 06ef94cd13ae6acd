"""Prefix reuse in the decode loop (``taps.decode.loop``, "Prefix reuse"): a prompt admitted to a row that still
holds an earlier request's tokens runs only what follows their common prefix. Lossless against the independent
decoders of ``test_gguf_forward`` (a conversation's second turn, prompts sharing a system turn, continuous batching),
and the reuse itself checked: how many tokens were kept, and none where the row was written over in between or the
verifier's rows are not a prefill's bits."""
import random

import pytest
import torch

from helpers import tiny_target

_C = pytest.importorskip("taps_kernels._C")
pytestmark = pytest.mark.skipif(not _C.gguf_forward_available(), reason="the GGUF forward needs AVX-512 or AVX2")

from taps.decode.loop import BatchDecoder, Request, SpeculativeDecoder  # noqa: E402
from taps.decode.policies import make_policy  # noqa: E402
from taps.decode.verifier import make_verifier  # noqa: E402

from test_gguf_forward import VOCAB, _greedy, _tiny, _tiny_drafter  # noqa: E402


@pytest.fixture(scope="module", params=["llama-f16", "qwen3-f32"])
def tiny(request, tmp_path_factory):
    return _tiny(tmp_path_factory, *request.param.split("-"))


def _tokens(rng, n):
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.mark.parametrize("spec", ["ar", "lookup", "dflash", "ddtree:6"])
def test_second_turn_runs_on_the_first_turns_rows(tiny, spec):
    target, _ = tiny
    rng = random.Random(3)
    policy = make_policy(spec)
    dec = SpeculativeDecoder(target, policy, drafter=_tiny_drafter(target) if policy.uses_drafter else None)
    first = _tokens(rng, 9)
    one = dec.generate(first, 12)
    assert one.token_ids == _greedy(tiny, first, 12) and one.stats.prefix_reused == 0
    # the next turn: the conversation so far (every generated token; the last one's rows were never written) + more
    second = first + one.token_ids + _tokens(rng, 4)
    two = dec.generate(second, 12)
    assert two.token_ids == _greedy(tiny, second, 12)
    assert two.stats.prefix_reused == len(first) + len(one.token_ids) - 1


def test_prompts_sharing_a_system_turn(tiny):
    target, _ = tiny
    rng = random.Random(4)
    system = _tokens(rng, 7)
    dec = SpeculativeDecoder(target, make_policy("ddtree:6"), drafter=_tiny_drafter(target))
    for k, tail in enumerate(([1, 2, 3], [4, 5], [6], [6, 7, 8, 9])):
        prompt = system + tail
        res = dec.generate(prompt, 10)
        assert res.token_ids == _greedy(tiny, prompt, 10)
        # the last prompt starts as the one before ([6]) and ran one token past it; the others only share the system
        assert res.stats.prefix_reused == (0 if k == 0 else len(system) + (1 if k == 3 else 0))


def test_a_whole_prompt_already_held_still_runs_its_last_token(tiny):
    target, _ = tiny
    prompt = [5, 9, 13, 2, 7, 11]
    dec = SpeculativeDecoder(target, make_policy("ar"))
    dec.generate(prompt, 6)
    again = dec.generate(prompt, 6)  # its logits choose the first token
    assert again.stats.prefix_reused == len(prompt) - 1
    assert again.token_ids == _greedy(tiny, prompt, 6)


def test_continuous_batching_reuses_freed_rows_losslessly(tiny):
    target, _ = tiny
    rng = random.Random(5)
    system = _tokens(rng, 6)
    prompts = [system + _tokens(rng, rng.randint(1, 5)) for _ in range(6)]
    drafter = _tiny_drafter(target)
    dec = BatchDecoder(target, make_policy("ddtree:6"), drafter=drafter, max_batch=2)
    got = dec.generate_batch(prompts, 8)
    assert [r.token_ids for r in got] == [_greedy(tiny, p, 8) for p in prompts]
    reused = [r.stats.prefix_reused for r in got]
    assert reused[:2] == [0, 0] and all(n >= len(system) for n in reused[2:]), reused


def test_a_row_left_idle_through_a_round_is_not_reused(tiny):
    target, _ = tiny
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    dec = BatchDecoder(target, make_policy("ar"), max_batch=2)
    # row 0 ends after its first round while row 1 runs on: rounds then verify a root in idle row 0 over what it held
    first = dec.generate_batch([Request(prompt, 2), Request([7, 7, 7], 6)])
    assert [len(r.token_ids) for r in first] == [2, 6]
    ids = [dec.submit(Request(prompt, 5))]
    res = dec.run()[ids[0]]
    assert res.stats.prefix_reused == 0
    assert res.token_ids == _greedy(tiny, prompt, 5)
    # without an idle round in between, the same sequence is reused
    dec.generate_batch([Request(prompt, 1)])
    ids = [dec.submit(Request(prompt, 5))]
    res = dec.run()[ids[0]]
    assert res.stats.prefix_reused == len(prompt) - 1 and res.token_ids == _greedy(tiny, prompt, 5)


def test_turned_off_or_buffers_made_anew(tiny):
    target, _ = tiny
    prompt = [8, 6, 7, 5, 3, 0, 9]
    off = SpeculativeDecoder(target, make_policy("ar"), prefix_reuse=False)
    off.generate(prompt, 4)
    assert off.generate(prompt, 4).stats.prefix_reused == 0
    on = SpeculativeDecoder(target, make_policy("ar"))
    on.generate(prompt, 4)
    on.verifier.reset(1, on.verifier.capacity * 4)  # new buffers: what the row held is gone
    res = on.generate(prompt, 4)
    assert res.stats.prefix_reused == 0 and res.token_ids == _greedy(tiny, prompt, 4)


def test_prefill_start_is_checked(tiny):
    target, _ = tiny
    ver = make_verifier(target, None)
    for bad in (-1, 3, 4):
        with pytest.raises(ValueError, match="start: expected 0 <= start < 3"):
            ver.prefill_row(0, [1, 2, 3], start=bad)


def test_verifiers_without_exact_rows_never_reuse():
    model = tiny_target(seed=0)
    dec = SpeculativeDecoder(model, make_policy("ar"))
    assert not dec.verifier.exact_prefix_reuse
    prompt = [5, 6, 7, 8, 9]
    dec.generate(prompt, 4)
    assert dec.generate(prompt, 4).stats.prefix_reused == 0
    with pytest.raises(ValueError, match="start: this verifier runs whole prompts"):
        dec.verifier.prefill_row(0, prompt, start=2)


@pytest.mark.parametrize("spec", ["ar", "ddtree:6"])
def test_kept_rows_are_the_rows_a_whole_prefill_leaves(tiny, spec):
    """The claim itself, bit for bit: after a second turn on the first turn's rows, the cache holds what a decoder
    that prefilled the second prompt whole holds (the same tokens, so the same rows to the last one)."""
    target, _ = tiny
    rng = random.Random(6)
    policy = make_policy(spec)
    drafter = _tiny_drafter(target) if policy.uses_drafter else None
    first = _tokens(rng, 8)
    reuse = SpeculativeDecoder(target, policy, drafter=drafter)
    second = first + reuse.generate(first, 10).token_ids + _tokens(rng, 3)
    got = reuse.generate(second, 10)
    whole = SpeculativeDecoder(target, make_policy(spec), drafter=drafter, prefix_reuse=False)
    want = whole.generate(second, 10)
    assert got.token_ids == want.token_ids and got.stats.prefix_reused > len(first)
    n = len(second) + len(got.token_ids) - 1  # every token but the last went through the cache
    for kept, fresh in zip(reuse.verifier.keys + reuse.verifier.values, whole.verifier.keys + whole.verifier.values):
        assert torch.equal(kept[0, :, :n].view(torch.int16 if kept.dtype == torch.float16 else torch.int32),
                           fresh[0, :, :n].view(torch.int16 if fresh.dtype == torch.float16 else torch.int32))
