"""Batched data generation over the GGUF target (``taps.data.gguf_generation``): a row's tokens, features and
top-k log-probabilities in a batch of many (rows admitted as others finish, prefilled in padded groups) are the
bits of the same row generated alone; greedy tokens equal the independent reference decoder's, features and
log-probabilities its values to float32 rounding (with the float32 cache: see ``test_gguf_forward.py`` for why
the reference is an exact oracle of tokens with that cache only; the float16 cache, the format's model, runs
every exact test of a batch against its rows alone and against one forward over the whole sequence)."""
import dataclasses
import random

import pytest
import torch

import taps_kernels

from gguf_models import write_tiny_gguf

_C = pytest.importorskip("taps_kernels._C")
pytestmark = pytest.mark.skipif(not _C.gguf_forward_available(), reason="the GGUF forward needs AVX-512 or AVX2")

from taps.data.gguf_generation import GGUFGenerator  # noqa: E402
from taps.models.gguf_target import load_gguf_target  # noqa: E402
from taps_kernels.reference.gguf_forward import (decoder_reference, greedy_reference,  # noqa: E402
                                                 reference_weights_from_gguf)

VOCAB, LAYERS = 80, 3
FEATURES = [0, 1]
TOPK = 8


def _tiny(tmp_path_factory, arch: str, kv_dtype: torch.dtype):
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"tiny_{arch}.gguf", arch=arch, vocab=VOCAB,
                           layers=LAYERS)
    return (load_gguf_target(path, kv_dtype=kv_dtype),
            dataclasses.replace(reference_weights_from_gguf(path), kv_dtype=kv_dtype))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    """The format's model (float16 cache)."""
    return _tiny(tmp_path_factory, request.param, torch.float16)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_f32(request, tmp_path_factory):
    return _tiny(tmp_path_factory, request.param, torch.float32)


def _prompts(n=11, seed=0, shared=0):
    """``n`` random prompts of awkward lengths, all starting with the same ``shared`` tokens (a chat template's
    system turn: prefilled once and copied into each row)."""
    rng = random.Random(seed)
    lengths = [1, 37, 5, 12, 3, 29, 8, 2, 19, 33, 6, 14, 40, 4][:n]
    head = [rng.randrange(VOCAB) for _ in range(shared)]
    return [head + [rng.randrange(VOCAB) for _ in range(m)] for m in lengths]


def _bits(t):
    return t.contiguous().view(torch.int16 if t.dtype == torch.float16 else torch.int32)


def _same(a, b):
    """Exact equality of two results (tokens, features' bits, top-k ids and log-probabilities' bits)."""
    assert a.tokens == b.tokens and a.prompt_len == b.prompt_len
    assert torch.equal(_bits(a.feats), _bits(b.feats))
    assert torch.equal(a.topk_ids, b.topk_ids)
    assert torch.equal(_bits(a.topk_logp), _bits(b.topk_logp))


def _stop_token(target, prompts, n):
    """A token some rows emit early (those rows end and free their cache row for the next prompt)."""
    free = GGUFGenerator(target, batch_size=len(prompts)).generate(prompts, n, eos_id=-1)
    counts = {}
    for r in free:
        for t in r.tokens[r.prompt_len:r.prompt_len + n // 2]:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=lambda t: (counts[t], -t))


@pytest.mark.parametrize("batch_size,prefill_tokens,shared", [(4, 4096, 0), (16, 4096, 0), (3, 40, 0), (5, 4096, 21),
                                                              (16, 4096, 9)])
def test_rows_in_a_batch_equal_rows_alone(tiny, batch_size, prefill_tokens, shared):
    """Rows of different prompt lengths, some ending early at the stop token and replaced by queued prompts
    (batch 3 to 5), all in one batch (16), prefill groups of one row (40 padded tokens), a common prefix
    prefilled once and copied (21 and 9 tokens): every row's tokens, features and top-k are the bits of that
    row generated alone (batch 1: its prompt but the last token is then the shared prefix)."""
    target, _ = tiny
    prompts, n = _prompts(shared=shared), 14
    eos = _stop_token(target, prompts, n)
    gen = GGUFGenerator(target, FEATURES, batch_size=batch_size, prefill_tokens=prefill_tokens)
    res = gen.generate(prompts, n, eos_id=eos, topk=TOPK)
    ended = [r for r in res if len(r.tokens) - r.prompt_len < n]
    assert ended and len(ended) < len(res)  # both kinds of rows are present
    assert all(r.tokens[-1] == eos for r in ended)
    if batch_size < len(prompts):
        assert gen.last_stats["decode_calls"] < n * len(prompts) / batch_size  # rows were refilled, not waited for
    if shared:
        assert gen.last_stats["prefill_rows"] < sum(map(len, prompts))  # the prefix ran once
    alone = GGUFGenerator(target, FEATURES, batch_size=1)
    unshared = GGUFGenerator(target, FEATURES, batch_size=1, min_shared_prefix=0)
    for p, r in zip(prompts, res):
        _same(r, alone.generate([p], n, eos_id=eos, topk=TOPK)[0])
        _same(r, unshared.generate([p], n, eos_id=eos, topk=TOPK)[0])


def test_greedy_equals_the_reference_decoder(tiny_f32):
    """Tokens equal :func:`greedy_reference` exactly (an oracle sharing no code with the C++ forward). Features
    and top-k log-probabilities match the reference forward over prompt + response to float32 rounding (and
    the fp16 of the stored features), except in a row where that rounding moved an activation across an int8
    quantisation step (its later positions then differ by a code's worth): at most 1 row in 3."""
    target, ref = tiny_f32
    prompts, n = _prompts(6, seed=2), 12
    res = GGUFGenerator(target, FEATURES, batch_size=4).generate(prompts, n, eos_id=-1, topk=TOPK)
    far = 0
    for p, r in zip(prompts, res):
        assert r.tokens[len(p):] == greedy_reference(ref, p, n)
        logits, feats = decoder_reference(ref, r.tokens, FEATURES)
        m = len(r.tokens) - 1
        assert r.feats.shape == (len(r.tokens), len(FEATURES) * target.config.hidden_size)
        assert r.feats.dtype == torch.float16 and not r.feats[m].any()  # the last token is never fed
        assert torch.allclose(r.feats[:m].float(), feats[:m], rtol=2e-3, atol=2e-3 * feats.abs().max())
        lp = torch.log_softmax(logits[len(p) - 1:m], -1)
        assert r.topk_ids.shape == (n, TOPK) and r.topk_ids.dtype == torch.int64
        assert torch.equal(r.topk_ids[:, 0], torch.tensor(r.tokens[len(p):]))
        err = (r.topk_logp - lp.gather(1, r.topk_ids)).abs().amax(-1)
        far += int(bool((err > 1e-4).any()))
        assert float(err.max()) < 0.5
    assert far * 3 <= len(res), far


def test_generation_equals_one_forward_over_the_whole_sequence(tiny):
    """Structural oracle, exact: the features and log-probabilities a row collected step by step are the bits
    of ONE forward of the C++ target over its prompt + response as a chain (a prefill equals token-by-token
    decoding, so the step-by-step cache is the prefill's)."""
    from taps.decode.gguf_verifier import chain_bits

    target, _ = tiny
    prompts, n = _prompts(7, seed=5) + _prompts(7, seed=6, shared=13), 10
    res = GGUFGenerator(target, FEATURES, batch_size=3).generate(prompts[:7], n, eos_id=-1, topk=TOPK)
    res += GGUFGenerator(target, FEATURES, batch_size=3).generate(prompts[7:], n, eos_id=-1, topk=TOPK)
    for r in res:
        T = len(r.tokens) - 1  # the last token is never fed
        keys, values = target.new_cache(1, T)
        zero = torch.zeros(1, dtype=torch.int64)
        logits, feats = target.forward_rows(torch.tensor([r.tokens[:T]]), torch.arange(T)[None], zero, zero,
                                            chain_bits(T), keys, values, torch.tensor(FEATURES),
                                            torch.arange(r.prompt_len - 1, T))
        assert torch.equal(_bits(r.feats[:T]), _bits(feats[0].half()))
        want = taps_kernels.topk_stats(logits[:, None], TOPK)  # the generator's top-k, on the one forward's logits
        assert torch.equal(r.topk_ids, want.topk_ids[:, 0])
        assert torch.equal(_bits(r.topk_logp), _bits(want.topk_logp[:, 0]))


def test_outputs_without_features_or_topk_and_with_stop_ids(tiny):
    target, _ = tiny
    prompts = _prompts(5, seed=3)
    full = GGUFGenerator(target, FEATURES, batch_size=2).generate(prompts, 9, eos_id=-1, topk=TOPK)
    bare = GGUFGenerator(target, batch_size=2).generate(prompts, 9, eos_id=-1)
    assert [r.tokens for r in bare] == [r.tokens for r in full]
    assert all(r.feats is None and r.topk_ids is None and r.topk_logp is None for r in bare)
    nofeat = GGUFGenerator(target, FEATURES, batch_size=5).generate(prompts, 9, eos_id=-1, capture=False)
    assert [r.tokens for r in nofeat] == [r.tokens for r in full] and nofeat[0].feats is None
    stop = full[0].tokens[full[0].prompt_len + 2]  # row 0's third response token ends every row that emits it
    stopped = GGUFGenerator(target, batch_size=3).generate(prompts, 9, eos_id=-1, stop_ids=[stop])
    for f, s in zip(full, stopped):
        resp = f.tokens[f.prompt_len:]
        want = resp[:resp.index(stop) + 1] if stop in resp else resp
        assert s.tokens == f.tokens[:f.prompt_len] + want
    assert len(stopped[0].tokens) == stopped[0].prompt_len + 3
    one = GGUFGenerator(target, FEATURES, batch_size=2).generate(prompts, 1, eos_id=-1, topk=TOPK)  # prefill only
    for f, o in zip(full, one):
        assert o.tokens == f.tokens[:f.prompt_len + 1] and torch.equal(o.topk_ids, f.topk_ids[:1])
        assert torch.equal(_bits(o.feats[:-1]), _bits(f.feats[:f.prompt_len])) and not o.feats[-1].any()


def test_sampling_is_seeded(tiny):
    target, _ = tiny
    gen = GGUFGenerator(target, batch_size=4)
    p = [[5, 6, 7]] * 6
    a = gen.generate(p, 10, eos_id=-1, temperature=1.0, generator=torch.Generator().manual_seed(4), capture=False)
    b = gen.generate(p, 10, eos_id=-1, temperature=1.0, generator=torch.Generator().manual_seed(4), capture=False)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert len({tuple(r.tokens) for r in a}) > 1  # rows draw independently


def test_bad_inputs_name_the_argument(tiny):
    target, _ = tiny
    gen = GGUFGenerator(target, FEATURES)
    for kw, name in (({"prompts": [[1], []]}, "prompts"), ({"prompts": []}, "prompts"),
                     ({"prompts": [[1, VOCAB]]}, "prompts"), ({"max_new_tokens": 0}, "max_new_tokens"),
                     ({"topk": VOCAB + 1}, "topk"), ({"temperature": -1.0}, "temperature"),
                     ({"prompts": [[1] * 500]}, "prompts")):  # past the 512-position context
        args = dict({"prompts": [[1, 2]], "max_new_tokens": 20, "eos_id": 0}, **kw)
        with pytest.raises(ValueError, match=name):
            gen.generate(**args)
    with pytest.raises(ValueError, match="layer_ids"):
        GGUFGenerator(target, [LAYERS])
    with pytest.raises(ValueError, match="batch_size"):
        GGUFGenerator(target, batch_size=0)
    with pytest.raises(TypeError, match="target"):
        GGUFGenerator(torch.nn.Linear(2, 2))
