"""Tree verification through transformers' attention registry (``attn_implementation="taps_tree"``).

Tiny random Llama and Qwen3 models are built here (no downloads). A random batch of trees is
verified in one forward over the cached prompt, and the logits of every node must equal
(a) the dense additive-mask path (``ancestor_bits_to_additive_mask`` with sdpa and eager), and
(b) the structural oracle: the node's root-to-node path replayed as an ordinary causal sequence.
"""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import taps_kernels  # noqa: E402
from taps_kernels.integrations import transformers as taps_hf  # noqa: E402
from helpers import random_tree  # noqa: E402
from taps_kernels.layout import Tree  # noqa: E402

VOCAB, PROMPT = 61, 7
# fp32 models on CPU: tree vs dense/path logits differ only by summation order.
LOGIT_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5)}


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

    def dense(meta):
        mask = taps_kernels.ancestor_bits_to_additive_mask(meta.ancestor_bits, meta.prefix_lens, PROMPT + N)
        return {"attention_mask": mask}

    want = _verify(_model(arch, dense_impl), prompt, tree, tree_kwargs=dense)
    torch.testing.assert_close(got, want, **LOGIT_TOL[torch.float32])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_matches_path_replay(arch):
    """Each real node's logits equal a plain causal forward over prompt + its root-to-node path."""
    B, N = 2, 11
    prompt, tree = _prompt(B, 3), _random_trees(B, N, 4)
    model = _model(arch, "taps_tree")
    got = _verify(model, prompt, tree, tree_kwargs=lambda meta: {taps_hf.KWARG: meta})
    differs_from_chain = False
    with torch.no_grad():
        chain = model(input_ids=torch.cat([prompt, tree.tokens], 1)).logits[:, PROMPT:]
        for b in range(B):
            for i in range(int(tree.num_nodes[b])):
                path = [i]
                while path[-1] != 0:
                    path.append(int(tree.parents[b, path[-1]]))
                seq = torch.cat([prompt[b], tree.tokens[b, path[::-1]]])[None]
                want = model(input_ids=seq).logits[0, -1]
                torch.testing.assert_close(got[b, i], want, **LOGIT_TOL[torch.float32])
                differs_from_chain |= not torch.allclose(chain[b, i], want, **LOGIT_TOL[torch.float32])
    # The oracle must be able to tell a tree from a plain causal chain, else this test proves nothing.
    assert differs_from_chain


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
    for b in range(B):
        row = Tree(*(t[b:b + 1] for t in (tree.tokens, tree.parents, tree.depth, tree.num_nodes)))
        alone = _verify(model, prompt[b:b + 1, int(PROMPT - am[b].sum()):], row,
                        tree_kwargs=lambda meta: {taps_hf.KWARG: meta})
        n = int(tree.num_nodes[b])
        torch.testing.assert_close(got[b, :n], alone[0, :n], **LOGIT_TOL[torch.float32])
    # Without the mask the padded row sees its pad keys: the check above can fail.
    _, unmasked = taps_hf.tree_forward_inputs(tree, torch.full((B,), PROMPT, dtype=torch.int64))
    with torch.no_grad():
        cache = transformers.DynamicCache()
        model(input_ids=prompt, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0), use_cache=True,
              **{ck: cache})
        leaky = model(input_ids=tree.tokens, position_ids=position_ids, use_cache=True, **{ck: cache},
                      **{taps_hf.KWARG: unmasked}).logits
    assert not torch.allclose(leaky[1], got[1], **LOGIT_TOL[torch.float32])


def test_context_manager_equals_kwarg_and_tree_path_is_taken(monkeypatch):
    B, N = 2, 9
    prompt, tree = _prompt(B, 5), _random_trees(B, N, 6)
    model = _model("llama", "taps_tree")
    calls = []
    real = taps_hf.custom_ops.tree_attention
    monkeypatch.setattr(taps_hf.custom_ops, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
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
    torch.testing.assert_close(got, eager, **LOGIT_TOL[torch.float32])
