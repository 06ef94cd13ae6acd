"""The GGUF target: loader checks, the C++ forward against the independent reference forward, row invariance
of whole forwards (a tree node = the same token decoded alone, bit for bit; a batch row = the row alone;
prefill = token-by-token decoding), and lossless decoding through the loop against the reference decoder.

Both cache dtypes run: float16 (the format's model) and float32. The reference forward is an exact oracle of
greedy tokens with the float32 cache only: its float32 rounding differs from the C++ forward's in the last bits,
and a last-bit difference that moves a key or value across a float16 rounding step changes it by a float16 ulp,
which int8 activation quantisation downstream can amplify on a random tiny model. With the float16 cache the
oracle of lossless decoding is plain greedy decoding over the target's one forward (no decode loop, no tree),
and the cache's rounding itself is checked bit for bit against torch's. The ``gguf-a16`` format's two activation
digits run as one more case of the same tests (``llama-f32-a16``), against the reference forward with two digits.
"""
import dataclasses
import random

import pytest
import torch

from gguf_models import write_tiny_gguf
from helpers import random_tree, tiny_drafter

_C = pytest.importorskip("taps_kernels._C")
pytestmark = pytest.mark.skipif(not _C.gguf_forward_available(), reason="the GGUF forward needs AVX-512 or AVX2")

from taps.decode.loop import BatchDecoder, SpeculativeDecoder  # noqa: E402
from taps.decode.policies import make_policy  # noqa: E402
from taps.decode.verifier import make_verifier  # noqa: E402
from taps.models.gguf_target import GGUFFormatError, load_gguf_target  # noqa: E402
from taps_kernels import Tree  # noqa: E402
from taps_kernels.reference.gguf_forward import (decoder_reference, greedy_reference,  # noqa: E402
                                                 reference_weights_from_gguf)

VOCAB, LAYERS = 80, 3
FEATURES = [0, 2]  # a middle layer and the last (the final-normed state, as transformers' hidden_states[-1])


KV_DTYPES = {"f16": torch.float16, "f32": torch.float32}


def _tiny(tmp_path_factory, arch: str, kv: str, digits: str = "a8"):
    """A random tiny ``arch`` GGUF target with a ``kv`` cache and one (``a8``) or two (``a16``) activation digits,
    and its reference weights (same cache dtype and digits)."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"tiny_{arch}.gguf", arch=arch, vocab=VOCAB,
                           layers=LAYERS)
    n = {"a8": 1, "a16": 2}[digits]
    return (load_gguf_target(path, kv_dtype=KV_DTYPES[kv], activation_digits=n),
            dataclasses.replace(reference_weights_from_gguf(path), kv_dtype=KV_DTYPES[kv], activation_digits=n))


@pytest.fixture(scope="module", params=["llama-f16", "qwen3-f16", "llama-f32", "qwen3-f32", "llama-f32-a16"])
def tiny(request, tmp_path_factory):
    return _tiny(tmp_path_factory, *request.param.split("-"))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_f32(request, tmp_path_factory):
    return _tiny(tmp_path_factory, request.param, "f32")


def _plain_greedy(target, prompt, n):
    """Greedy tokens of ``target`` one forward per token (no decode loop, no tree, no compaction)."""
    from taps.decode.gguf_verifier import chain_bits

    keys, values = target.new_cache(1, len(prompt) + n)
    zero, none = torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    logits, _ = target.forward_rows(torch.tensor([prompt]), torch.arange(len(prompt))[None], zero, zero,
                                    chain_bits(len(prompt)), keys, values, none, torch.tensor([len(prompt) - 1]))
    out = [int(logits[0].argmax())]
    while len(out) < n:
        at = len(prompt) + len(out) - 1
        logits, _ = target.forward_rows(torch.tensor([[out[-1]]]), torch.tensor([[at]]), torch.tensor([at]), zero,
                                        chain_bits(1), keys, values, none, zero)
        out.append(int(logits[0].argmax()))
    return out


def _greedy(tiny, prompt, n):
    """What lossless decoding must return: the reference decoder's tokens with the float32 cache, plain greedy
    decoding over the C++ forward with the float16 one (see the module docstring)."""
    target, ref = tiny
    return greedy_reference(ref, prompt, n) if target.kv_dtype == torch.float32 else _plain_greedy(target, prompt, n)


def _bits(t):
    return t.contiguous().view(torch.int32)


def _one(token: int) -> Tree:
    return Tree(torch.tensor([[token]]), torch.tensor([[-1]], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                torch.ones(1, dtype=torch.int32))


def _decode_alone(target, prompt, tokens):
    """Logits and features of the last of ``tokens`` decoded one by one after ``prompt`` (each committed)."""
    v = make_verifier(target, FEATURES)
    v.prefill(torch.tensor([prompt]), len(prompt) + len(tokens) + 2)
    for t in tokens[:-1]:
        v.verify(_one(t))
        v.commit(torch.zeros(1, 1, dtype=torch.int64), 1)
    logits, feats, _ = v.verify(_one(tokens[-1]))
    return logits[0], feats[0, 0]


def test_forward_matches_reference(tiny_f32):
    target, ref = tiny_f32
    prompt = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]
    v = make_verifier(target, FEATURES)
    logits, feats = v.prefill(torch.tensor([prompt]), 32)
    rl, rf = decoder_reference(ref, prompt, FEATURES)
    # float32 rounding apart (exp, softmax and reduction orders differ); the int8 products are bit-identical
    assert torch.allclose(logits, rl[-1], rtol=1e-4, atol=1e-4 * rl.abs().max())
    assert torch.allclose(feats[0], rf, rtol=1e-4, atol=1e-4 * rf.abs().max())
    assert int(logits.argmax()) == int(rl[-1].argmax())


def test_float16_cache_holds_the_float32_keys_and_values_rounded(tmp_path):
    # layer 0's keys and values are the same float32 numbers in both runs (nothing before them reads the cache):
    # the float16 cache must hold exactly torch's rounding of them (nearest even), for every slot and head
    path = write_tiny_gguf(tmp_path / "t.gguf", arch="qwen3", vocab=VOCAB, layers=LAYERS)
    prompt = [random.Random(3).randrange(VOCAB) for _ in range(29)]
    caches = []
    for dt in (torch.float32, torch.float16):
        v = make_verifier(load_gguf_target(path, kv_dtype=dt), FEATURES)
        v.prefill(torch.tensor([prompt]), 40)
        assert v.keys[0].dtype == dt and v.values[0].dtype == dt
        caches.append((v.keys[0][:, :, :len(prompt)], v.values[0][:, :, :len(prompt)]))
    (k32, v32), (k16, v16) = caches
    assert torch.equal(k16.view(torch.int16), k32.half().view(torch.int16))
    assert torch.equal(v16.view(torch.int16), v32.half().view(torch.int16))
    assert not torch.equal(k16.float(), k32)  # the rounding did happen


def test_prefill_equals_token_by_token(tiny):
    target, _ = tiny
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(37)]
    a = make_verifier(target, FEATURES)
    la, fa = a.prefill(torch.tensor([prompt]), 64)
    b = make_verifier(target, FEATURES)
    b.prefill(torch.tensor([prompt[:1]]), 64)
    for t in prompt[1:]:
        lb, fb, _ = b.verify(_one(t))
        b.commit(torch.zeros(1, 1, dtype=torch.int64), 1)
    assert torch.equal(_bits(la), _bits(lb[0]))
    assert torch.equal(_bits(fa[0, -1]), _bits(fb[0, 0]))
    for ka, kb in zip(a.keys + a.values, b.keys + b.values):
        assert torch.equal(_bits(ka[:, :, :len(prompt)]), _bits(kb[:, :, :len(prompt)]))


@pytest.mark.parametrize("threads", [1, 2])
def test_tree_node_equals_the_token_decoded_alone(tiny, threads):
    target, _ = tiny
    rng = random.Random(threads)
    prompt = [rng.randrange(VOCAB) for _ in range(21)]
    tree = random_tree(rng, 1, 19, vocab=VOCAB)
    torch.set_num_threads(threads)
    v = make_verifier(target, FEATURES)
    v.prefill(torch.tensor([prompt]), 64)
    logits, feats, tree = v.verify(tree)
    parents, tokens = tree.parents[0].tolist(), tree.tokens[0].tolist()
    for i in range(len(tokens)):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        alone_logits, alone_feats = _decode_alone(target, prompt, [tokens[j] for j in reversed(path)])
        assert torch.equal(_bits(logits[i]), _bits(alone_logits)), f"node {i}"
        assert torch.equal(_bits(feats[0, i]), _bits(alone_feats)), f"node {i}"


def test_batch_rows_equal_rows_alone(tiny):
    target, _ = tiny
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 30, 17)]
    tree = random_tree(rng, 3, 11, vocab=VOCAB)
    v = make_verifier(target, FEATURES, max_batch=3)
    v.reserve(64)
    for b, p in enumerate(prompts):
        v.prefill_row(b, p)
    logits, feats = v.verify_batch(tree)
    for b, p in enumerate(prompts):
        one = make_verifier(target, FEATURES)
        one.prefill(torch.tensor([p]), 64)
        n = int(tree.num_nodes[b])
        row = Tree(tree.tokens[b:b + 1, :n], tree.parents[b:b + 1, :n], tree.depth[b:b + 1, :n], tree.num_nodes[b:b + 1])
        lo, fo, _ = one.verify(row)
        assert torch.equal(_bits(logits[b, :n]), _bits(lo)), f"row {b}"
        assert torch.equal(_bits(feats[b, :n]), _bits(fo[0])), f"row {b}"


def _tiny_drafter(target):
    d = tiny_drafter(seed=1, vocab=VOCAB, block_size=5, target_layers=LAYERS, hidden=target.config.hidden_size)
    d.config.target_layer_ids = list(FEATURES)
    return d


@pytest.mark.parametrize("spec", ["ar", "lookup", "lookup:3", "dflash", "ddtree:6", "ddtree:16"])
def test_lossless_against_the_reference_decoder(tiny, spec):
    target, _ = tiny
    rng = random.Random(7)
    policy = make_policy(spec)
    drafter = _tiny_drafter(target) if policy.uses_drafter else None
    for _ in range(2):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))]
        want = _greedy(tiny, prompt, 24)
        got = SpeculativeDecoder(target, policy, drafter=drafter).generate(prompt, 24)
        assert got.token_ids == want


def test_batched_decoding_equals_batch_one(tiny):
    target, _ = tiny
    rng = random.Random(9)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 15))] for _ in range(5)]
    drafter = _tiny_drafter(target)
    one = [SpeculativeDecoder(target, make_policy("ddtree:6"), drafter=drafter).generate(p, 20).token_ids
           for p in prompts]
    batched = BatchDecoder(target, make_policy("ddtree:6"), drafter=drafter, max_batch=3).generate_batch(prompts, 20)
    assert [r.token_ids for r in batched] == one


def test_failed_round_leaves_the_cache_intact(tiny):
    target, _ = tiny
    prompt = [4, 8, 15, 16, 23, 42]
    dec = SpeculativeDecoder(target, make_policy("lookup"))
    dec.start(prompt, 20)
    calls = {"n": 0}

    def fail_once(_):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
    dec.round_hook = fail_once
    while not dec.done:
        try:
            dec.step()
        except RuntimeError:
            pass
    assert dec.generated == _greedy(tiny, prompt, 20)


def test_forward_rejects_bad_inputs(tiny):
    target, _ = tiny
    v = make_verifier(target, FEATURES)
    v.prefill(torch.tensor([[1, 2, 3]]), 8)
    with pytest.raises(ValueError, match="tokens: outside the vocabulary"):
        v.verify(_one(VOCAB))
    with pytest.raises(ValueError, match="feature_layer_ids"):
        make_verifier(target, [LAYERS])
    with pytest.raises(ValueError, match="position_ids: expected shape"):
        target.forward_rows(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 3, dtype=torch.int64),
                            torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                            torch.zeros(1, 2, 1, dtype=torch.int32), v.keys, v.values, torch.zeros(0, dtype=torch.int64),
                            torch.zeros(1, dtype=torch.int64))
    other = torch.float32 if target.kv_dtype == torch.float16 else torch.float16
    with pytest.raises(TypeError, match=r"values\[0\]: expected dtype"):
        target.forward_rows(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                            torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                            torch.ones(1, 1, 1, dtype=torch.int32), v.keys, [t.to(other) for t in v.values],
                            torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_dtype: expected torch.float16 or torch.float32"):
        load_gguf_target(target.path, kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="activation_digits: expected 1 or 2, received 3"):
        load_gguf_target(target.path, activation_digits=3)
    with pytest.raises(ValueError, match="keys/values: expected one cache tensor per layer"):
        target.forward_rows(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                            torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                            torch.ones(1, 1, 1, dtype=torch.int32), v.keys[:1], v.values[:1],
                            torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


def test_loader_names_what_it_cannot_run(tmp_path):
    with pytest.raises(GGUFFormatError, match=r"blk\.1\.ffn_up\.weight: GGML type F16 is not supported"):
        load_gguf_target(write_tiny_gguf(tmp_path / "f16.gguf", types={"blk.1.ffn_up.weight": 1}))
    with pytest.raises(GGUFFormatError, match=r"blk\.0\.attn_v\.weight: missing"):
        load_gguf_target(write_tiny_gguf(tmp_path / "missing.gguf", drop=("blk.0.attn_v.weight",)))
    good = write_tiny_gguf(tmp_path / "good.gguf")
    data = good.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 1000])
    with pytest.raises(GGUFFormatError, match="cut.gguf|truncated"):
        load_gguf_target(tmp_path / "cut.gguf")
    with pytest.raises(GGUFFormatError, match="general.architecture: 'gpt2'"):
        load_gguf_target(write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2"))


def test_tied_head_reads_the_embedding(tmp_path):
    path = write_tiny_gguf(tmp_path / "tied.gguf", tied=True)
    target = load_gguf_target(path, kv_dtype=torch.float32)
    assert target.config.tie_word_embeddings
    assert target.get_output_embeddings().weight is target.get_input_embeddings().weight
    ref = dataclasses.replace(reference_weights_from_gguf(path), kv_dtype=torch.float32)
    prompt = [5, 6, 7]
    assert SpeculativeDecoder(target, make_policy("ar")).generate(prompt, 8).token_ids == greedy_reference(ref, prompt, 8)


def _block_drafter(seed=2):
    from taps.models.drafter import DFlashConfig, DFlashDrafter

    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                       num_hidden_layers=2, vocab_size=VOCAB, block_size=5, num_target_layers=LAYERS,
                       target_layer_ids=list(FEATURES), mask_token_id=VOCAB - 1, rope_theta=10000.0)
    return DFlashDrafter(cfg).eval()


def test_latency_key_names_the_block_body_and_its_head():
    """A block-body drafter costs what its blocks cost, not what its torch dtype would: the latency table's drafter
    key says so (a cached t0 of the PyTorch layers is not reused for it, nor one head format's for the other)."""
    from taps.decode.latency import drafter_key
    from taps.models.drafter_blocks import enable_block_draft

    layers, q8, q4 = _block_drafter(), _block_drafter(), _block_drafter()
    enable_block_draft(q8)
    enable_block_draft(q4, "q4_1")
    keys = [drafter_key(d) for d in (layers, q8, q4)]
    assert keys[0].split("-")[3] == "float32" and "-blocks-headq8_0-" in keys[1] and "-blocks-headq4_1-" in keys[2]


def test_block_draft_equals_the_torch_layers_on_the_same_blocks(tiny_f32):
    import copy

    from taps.models.drafter_blocks import enable_block_draft
    from taps_kernels.integrations.block_linear import use_block_linear

    target, _ = tiny_f32
    torch_q8 = _block_drafter()
    blocks = copy.deepcopy(torch_q8)
    use_block_linear(torch_q8.layers)  # the same Q8_0 weights, run by the PyTorch layers
    enable_block_draft(blocks)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    feats = torch.randn(2, 9, 2 * 64)
    outs, states = [], []
    for d in (torch_q8, blocks):
        st = d.new_state(2)
        d.append_context(st, feats[:, :6])
        d.append_context(st, feats[1:, 6:], rows=slice(1, 2))  # rows of different context lengths
        states.append(st)
        outs.append(d.draft(st, torch.tensor([3, 9]), embed, head, num_positions=3))
    (lt, ht), (lb, hb) = outs
    # the context rows' keys and values (one C++ call on the block path): the same projections, k-norm and RoPE
    for bt, bb in zip(states[0].k_buf + states[0].v_buf, states[1].k_buf + states[1].v_buf):
        for row, n in ((0, 6), (1, 9)):
            ref, got = bt[row, :, :n], bb[row, :, :n]
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    assert torch.allclose(hb, ht, rtol=1e-4, atol=1e-4 * ht.abs().max())
    # the block path's head also quantises its activations: logits agree to that rounding
    assert torch.allclose(lb, lt, atol=0.02 * lt.abs().max())


@pytest.mark.parametrize("spec,head", [("dflash", "auto"), ("ddtree:6", "q8_0"), ("ddtree:6", "q4_1")])
def test_block_drafter_decodes_losslessly(tiny, spec, head):
    from taps.models.drafter import prepare_drafter
    from taps.models.drafter_blocks import HEAD_FORMATS

    target, _ = tiny
    drafter = prepare_drafter(_block_drafter(), "cpu", body="blocks", head=head)
    assert drafter.block_draft is not None
    assert drafter.block_draft.head_type == HEAD_FORMATS["q8_0" if head == "auto" else head]
    rng = random.Random(11)
    for _ in range(2):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))]
        got = SpeculativeDecoder(target, make_policy(spec), drafter=drafter).generate(prompt, 20)
        assert got.token_ids == _greedy(tiny, prompt, 20)


def test_q4_1_head_logits_follow_the_q8_0_ones(tiny_f32):
    # the Q4_1 head re-quantises the Q8_0 rows: logits move by its rounding (half a 4-bit step per weight), and a
    # format the body does not take is refused
    from taps.models.drafter import prepare_drafter

    target, _ = tiny_f32
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    outs = []
    for fmt in ("q8_0", "q4_1"):
        d = prepare_drafter(_block_drafter(), "cpu", body="blocks", head=fmt)
        st = d.new_state(1)
        d.append_context(st, torch.randn(1, 5, 2 * 64, generator=torch.Generator().manual_seed(4)))
        outs.append(d.draft(st, torch.tensor([3]), embed, head, num_positions=3)[0])
    q8, q4 = outs
    assert not torch.equal(q8, q4) and torch.allclose(q4, q8, atol=0.15 * q8.abs().max())
    with pytest.raises(ValueError, match="head: 'bfloat16' does not fit the blocks body"):
        prepare_drafter(_block_drafter(), "cpu", body="blocks", head="bfloat16")
    with pytest.raises(ValueError, match="head: 'q4_1' does not fit the float32 body"):
        prepare_drafter(_block_drafter(), "cpu", body="float32", head="q4_1")


def test_block_context_refuses_features_of_another_width_before_writing():
    from taps.models.drafter import prepare_drafter

    d = prepare_drafter(_block_drafter(), "cpu", body="blocks")
    st = d.new_state(1)
    before = [t.clone() for t in st.k_buf]
    with pytest.raises(ValueError, match="context features have 100 channels, drafter expects 128"):
        d.append_context(st, torch.randn(1, 3, 100))
    assert all(torch.equal(a, b) for a, b in zip(before, st.k_buf)) and int(st.lengths[0]) == 0


def test_prepare_drafter_falls_back_where_blocks_do_not_fit():
    from taps.models.drafter import prepare_drafter

    d = prepare_drafter(tiny_drafter(vocab=VOCAB, target_layers=LAYERS), "cpu")  # intermediate 48: not whole blocks
    assert d.block_draft is None
    with pytest.raises(ValueError, match="block drafting: hidden, intermediate"):
        prepare_drafter(tiny_drafter(vocab=VOCAB, target_layers=LAYERS), "cpu", body="blocks")
    with pytest.raises(ValueError, match="body: expected one of"):
        prepare_drafter(tiny_drafter(vocab=VOCAB, target_layers=LAYERS), "cpu", body="int4")


@pytest.mark.parametrize("kernels", ["avx2", "amx-emulated"])
def test_other_kernels_in_a_child_process(kernels):
    # one process runs one set of kernels: another set this CPU can run (the AVX2 forward, block kernels and row
    # math, on an AVX-512 CPU; the AMX kernel with emulated tiles on a VNNI CPU) is asked for through
    # TAPS_GGUF_KERNELS in a child process, and must pass the row-invariance and lossless tests
    import os
    import subprocess
    import sys

    others = {"scalar": [], "avx2": [], "vnni": ["avx2", "amx-emulated"], "amx": ["avx2", "amx-emulated"]}
    if kernels not in others[_C.gguf_kernel_path()]:
        pytest.skip(f"this CPU runs the {_C.gguf_kernel_path()} kernels by default; {kernels} is that one or one "
                    f"it lacks")
    tests = ["test_forward_matches_reference", "test_float16_cache_holds_the_float32_keys_and_values_rounded",
             "test_prefill_equals_token_by_token",
             "test_tree_node_equals_the_token_decoded_alone", "test_batch_rows_equal_rows_alone",
             "test_lossless_against_the_reference_decoder"]
    env = dict(os.environ, TAPS_GGUF_KERNELS=kernels)
    probe = subprocess.run([sys.executable, "-c", "from taps_kernels import _C; print(_C.gguf_kernel_path())"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == kernels
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          " or ".join(tests)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def test_a16_format_is_named_in_records_and_keeps_its_own_cost_table(tmp_path):
    from taps.decode.latency import model_key
    from taps.models.target import resolve_target_format, target_format_of

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="llama", vocab=VOCAB, layers=LAYERS)
    assert resolve_target_format("gguf-a16", str(path)) == ("gguf-a16", "asked for")
    with pytest.raises(ValueError, match="target_format 'gguf-a16': .* not a GGUF file"):
        resolve_target_format("gguf-a16", str(tmp_path))
    one, two = load_gguf_target(path), load_gguf_target(path, activation_digits=2)
    assert (target_format_of(one), target_format_of(two)) == ("gguf", "gguf-a16")
    assert model_key(two) == model_key(one).replace("-gguf-", "-gguf-a16-")
    # two digits are another model: the same prompt's logits differ from one digit's
    prompt = torch.tensor([[3, 5, 7, 11, 13]])
    logits = [make_verifier(t, FEATURES).prefill(prompt, 8)[0] for t in (one, two)]
    assert not torch.equal(logits[0], logits[1])


def test_two_digits_bring_the_forward_to_float32_products(tmp_path, monkeypatch):
    # what gguf-a16 is for, on a whole forward: its logits sit far closer than gguf's to the same forward with exact
    # float32 products of the dequantised blocks (the reference forward with its matrix products swapped)
    import taps_kernels.reference.gguf_forward as reference_forward
    from taps_kernels.reference.gguf import dequantize_blocks_reference

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="qwen3", vocab=VOCAB, layers=LAYERS)
    ref = dataclasses.replace(reference_weights_from_gguf(path), kv_dtype=torch.float32)
    prompt = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]
    monkeypatch.setattr(reference_forward, "gguf_linear_reference",
                        lambda x, raw, t, digits=1: x @ dequantize_blocks_reference(raw, t, x.shape[1]).T)
    exact = decoder_reference(ref, prompt)[0][-1]
    gap = {}
    for digits in (1, 2):
        target = load_gguf_target(path, kv_dtype=torch.float32, activation_digits=digits)
        logits = make_verifier(target, FEATURES).prefill(torch.tensor([prompt]), 16)[0]
        gap[digits] = float((logits - exact).abs().max())
    assert gap[2] < gap[1] / 20, gap
