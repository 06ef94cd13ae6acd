"""Tree verification through transformers' attention registry (``attn_implementation="taps_tree"``).

Tiny random Llama and Qwen3 models are built here (no downloads). A random batch of trees is
verified in one forward over the cached prompt, and the logits of every node must equal
(a) the dense additive-mask path (``ancestor_bits_to_additive_mask`` with sdpa and eager), and
(b) the structural oracle: the node's root-to-node path replayed as an ordinary causal sequence.
"Equal" is flash-attention's rule (``helpers.assert_within_torch_error``): against the same model run in
float64, the error of the tree logits is at most twice that of PyTorch's own float32 forward.
"""
import copy
import inspect
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import taps_kernels  # noqa: E402
from taps_kernels.integrations import transformers as taps_hf  # noqa: E402
from helpers import assert_within_torch_error, random_tree  # noqa: E402
from taps_kernels.layout import Tree  # noqa: E402

VOCAB, PROMPT = 61, 7


def _config(arch):
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                  # large weights: outputs depend strongly on which keys are visible, so a mask bug shows
                  initializer_range=0.3)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen3Config(head_dim=8, **common)


_MODELS = {}


def _model(arch, impl):
    """The same random weights (those of the taps_tree model) under attention implementation ``impl``."""
    key = (arch, impl)
    if key not in _MODELS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(arch), attn_implementation=impl)
        if impl != "taps_tree":
            model.load_state_dict(_model(arch, "taps_tree").state_dict())
        _MODELS[key] = model.eval()
    return _MODELS[key]


def _float64_rms_norm(self, hidden_states):
    # transformers' RMSNorm computes in float32 whatever its input; the same formula in the input's float64
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _model64(arch):
    """The tolerance rule's reference: the same weights in float64, under sdpa (eager's softmax is float32), with
    RMSNorm in float64. The rotary cos/sin keep their float32 values, which the float32 models use too."""
    key = (arch, "float64")
    if key not in _MODELS:
        model = copy.deepcopy(_model(arch, "sdpa")).double()
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.forward = types.MethodType(_float64_rms_norm, module)
        _MODELS[key] = model
    return _MODELS[key]


def _dense(dtype=torch.float32):
    """``tree_kwargs`` of :func:`_verify` for the dense path: the tree as an additive mask of ``dtype``."""
    def kwargs(meta):
        kv_len = int(meta.prefix_lens.max()) + meta.ancestor_bits.shape[1]
        return {"attention_mask": taps_kernels.ancestor_bits_to_additive_mask(meta.ancestor_bits, meta.prefix_lens,
                                                                              kv_len, dtype=dtype)}
    return kwargs


def _within_torch_error(got, torch_out, reference):
    """:func:`assert_within_torch_error` as a predicate (for checks that a wrong answer is told apart)."""
    try:
        assert_within_torch_error(got, torch_out, reference)
    except AssertionError:
        return False
    return True


def _cache_kwarg(model):
    # transformers 5.x renamed the forward's past_key_values to cache (the old name still works, with a warning).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _random_trees(B, N, seed):
    """Deep as well as wide trees (parents among the 3 latest nodes); the last row padded to cover padding rows."""
    return random_tree(seed, B, N, vocab=VOCAB, num_nodes=[N] * (B - 1) + [max(2, N - 4)], parents="recent")


def _prompt(B, seed):
    return torch.randint(VOCAB, (B, PROMPT), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _verify(model, prompt, tree, tree_kwargs):
    """Prefill the prompt, then run the tree over the cache with ``tree_kwargs(meta)`` added to the forward;
    return the tree logits ``[B, N, V]``."""
    ck = _cache_kwarg(model)
    cache = transformers.DynamicCache()
    model(input_ids=prompt, use_cache=True, **{ck: cache})
    prefix_lens = torch.full((prompt.shape[0],), prompt.shape[1], dtype=torch.int64)
    position_ids, meta = taps_hf.tree_forward_inputs(tree, prefix_lens)
    return model(input_ids=tree.tokens, position_ids=position_ids, use_cache=True, **{ck: cache},
                 **tree_kwargs(meta)).logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dense_impl", ["sdpa", "eager"])
def test_tree_matches_dense_additive_mask(arch, dense_impl):
    B, N = 2, 13
    prompt, tree = _prompt(B, 1), _random_trees(B, N, 2)
    tree_model = _model(arch, "taps_tree")
    got = _verify(tree_model, prompt, tree, tree_kwargs=lambda meta: {taps_hf.KWARG: meta})
    want = _verify(_model(arch, dense_impl), prompt, tree, tree_kwargs=_dense())
    exact = _verify(_model64(arch), prompt, tree, tree_kwargs=_dense(torch.float64))
    assert_within_torch_error(got, want, exact, what=f"{arch} tree vs dense {dense_impl}")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_matches_path_replay(arch):
    """Each real node's logits equal a plain causal forward over prompt + its root-to-node path."""
    B, N = 2, 11
    prompt, tree = _prompt(B, 3), _random_trees(B, N, 4)
    model = _model(arch, "taps_tree")
    got = _verify(model, prompt, tree, tree_kwargs=lambda meta: {taps_hf.KWARG: meta})
    real = [(b, i) for b in range(B) for i in range(int(tree.num_nodes[b]))]
    want, exact = [], []  # each real node's path replay, float32 and float64
    with torch.no_grad():
        chain = model(input_ids=torch.cat([prompt, tree.tokens], 1)).logits[:, PROMPT:]
        for b, i in real:
            path = [i]
            while path[-1] != 0:
                path.append(int(tree.parents[b, path[-1]]))
            seq = torch.cat([prompt[b], tree.tokens[b, path[::-1]]])[None]
            want.append(model(input_ids=seq).logits[0, -1])
            exact.append(_model64(arch)(input_ids=seq).logits[0, -1])
    want, exact = torch.stack(want), torch.stack(exact)
    rows, cols = torch.tensor(real).T
    # the rule on all real nodes at once (one node's 61 logits are too few for a stable largest error)
    worst = real[int((got[rows, cols].double() - exact).abs().amax(dim=1).argmax())]
    assert_within_torch_error(got[rows, cols], want, exact, what=f"path replay (largest error: row, node {worst})")
    # The oracle must be able to tell a tree from a plain causal chain, else this test proves nothing.
    assert not _within_torch_error(chain[rows, cols], want, exact)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_left_padded_batch_equals_each_row_alone(arch):
    """prefix_mask: a left-padded batch gives every row the logits it gets verified alone, unpadded."""
    B, N, pad = 2, 10, 3
    prompt, tree = _prompt(B, 12), _random_trees(B, N, 13)
    prompt[1, :pad] = 0
    am = torch.ones(B, PROMPT, dtype=torch.int64)
    am[1, :pad] = 0
    model = _model(arch, "taps_tree")
    ck = _cache_kwarg(model)
    with torch.no_grad():
        cache = transformers.DynamicCache()
        model(input_ids=prompt, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0), use_cache=True,
              **{ck: cache})
        position_ids, meta = taps_hf.tree_forward_inputs(tree, torch.full((B,), PROMPT, dtype=torch.int64), am)
        got = model(input_ids=tree.tokens, position_ids=position_ids, use_cache=True, **{ck: cache},
                    **{taps_hf.KWARG: meta}).logits
    assert position_ids[1, 0] == PROMPT - pad and position_ids[0, 0] == PROMPT
    alone_refs = []
    for b in range(B):
        row = Tree(*(t[b:b + 1] for t in (tree.tokens, tree.parents, tree.depth, tree.num_nodes)))
        unpadded = prompt[b:b + 1, int(PROMPT - am[b].sum()):]
        alone = _verify(model, unpadded, row, tree_kwargs=lambda meta: {taps_hf.KWARG: meta})
        n = int(tree.num_nodes[b])
        # the row alone, unpadded: PyTorch's float32 dense forward and the float64 one. PyTorch's own error is that
        # of the worse of its two float32 attentions (sdpa, eager): one of them alone was 1.8x apart from the other
        # on this 9-token row on a Sapphire Rapids core, while both are PyTorch at float32.
        exact = _verify(_model64(arch), unpadded, row, tree_kwargs=_dense(torch.float64))[0, :n]
        outs = [_verify(_model(arch, impl), unpadded, row, tree_kwargs=_dense())[0, :n] for impl in ("sdpa", "eager")]
        want = max(outs, key=lambda out: float((out.double() - exact.double()).abs().max()))
        alone_refs.append((want, exact))
        assert_within_torch_error(got[b, :n], want, exact, what=f"row {b} in the padded batch")
        assert_within_torch_error(alone[0, :n], want, exact, what=f"row {b} alone")
    # Without the mask the padded row sees its pad keys: the check above can fail.
    _, unmasked = taps_hf.tree_forward_inputs(tree, torch.full((B,), PROMPT, dtype=torch.int64))
    with torch.no_grad():
        cache = transformers.DynamicCache()
        model(input_ids=prompt, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0), use_cache=True,
              **{ck: cache})
        leaky = model(input_ids=tree.tokens, position_ids=position_ids, use_cache=True, **{ck: cache},
                      **{taps_hf.KWARG: unmasked}).logits
    assert not _within_torch_error(leaky[1, :int(tree.num_nodes[1])], *alone_refs[1])


def test_context_manager_equals_kwarg_and_tree_path_is_taken(monkeypatch):
    B, N = 2, 9
    prompt, tree = _prompt(B, 5), _random_trees(B, N, 6)
    model = _model("llama", "taps_tree")
    calls = []
    real = taps_hf.attention.tree_attention
    monkeypatch.setattr(taps_hf.attention, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    by_kwarg = _verify(model, prompt, tree, tree_kwargs=lambda meta: {taps_hf.KWARG: meta})
    assert len(calls) == model.config.num_hidden_layers  # one per layer; the prefill used sdpa

    def by_context(meta):
        stack.enter_context(taps_hf.use_tree(meta))
        return {}

    import contextlib
    with contextlib.ExitStack() as stack:
        via_context = _verify(model, prompt, tree, tree_kwargs=by_context)
    assert len(calls) == 2 * model.config.num_hidden_layers
    torch.testing.assert_close(via_context, by_kwarg, atol=0, rtol=0)


def test_without_tree_equals_sdpa():
    prompt = _prompt(2, 7)
    with torch.no_grad():
        got = _model("qwen3", "taps_tree")(input_ids=prompt).logits
        want = _model("qwen3", "sdpa")(input_ids=prompt).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_metadata_errors_name_the_argument():
    with pytest.raises(TypeError, match="ancestor_bits"):
        taps_hf.TreeAttentionMetadata(torch.zeros(2, 5, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="ancestor_bits"):
        taps_hf.TreeAttentionMetadata(torch.zeros(2, 5, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="prefix_lens"):
        taps_hf.TreeAttentionMetadata(torch.zeros(2, 5, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="prefix_mask"):
        taps_hf.TreeAttentionMetadata(torch.zeros(2, 5, 1, dtype=torch.int32), prefix_mask=torch.ones(3, 4, dtype=torch.bool))
    prompt, tree = _prompt(2, 8), _random_trees(2, 6, 9)
    wrong = taps_hf.TreeAttentionMetadata(torch.zeros(2, 5, 1, dtype=torch.int32))  # 5 nodes, forward has 6
    with pytest.raises(ValueError, match="taps_tree.ancestor_bits"):
        _verify(_model("llama", "taps_tree"), prompt, tree, tree_kwargs=lambda meta: {taps_hf.KWARG: wrong})


@pytest.mark.slow
def test_tree_forward_compiles_fullgraph():
    """The whole model forward over a tree (DynamicCache, taps::tree_attention in every layer) traces into
    one graph, and gives the eager logits."""
    B, N = 2, 9
    prompt, tree = _prompt(B, 10), _random_trees(B, N, 11)
    model = _model("llama", "taps_tree")
    ck = _cache_kwarg(model)
    eager = _verify(model, prompt, tree, tree_kwargs=lambda meta: {taps_hf.KWARG: meta})

    def forward(ids, position_ids, cache, meta):
        return model(input_ids=ids, position_ids=position_ids, use_cache=True, **{ck: cache, taps_hf.KWARG: meta}).logits

    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        cache = transformers.DynamicCache()
        model(input_ids=prompt, use_cache=True, **{ck: cache})
        position_ids, meta = taps_hf.tree_forward_inputs(tree, torch.full((B,), PROMPT, dtype=torch.int64))
        got = compiled(tree.tokens, position_ids, cache, meta)
    want = _verify(_model("llama", "sdpa"), prompt, tree, tree_kwargs=_dense())
    exact = _verify(_model64("llama"), prompt, tree, tree_kwargs=_dense(torch.float64))
    assert_within_torch_error(eager, want, exact, what="eager")
    assert_within_torch_error(got, want, exact, what="compiled")
