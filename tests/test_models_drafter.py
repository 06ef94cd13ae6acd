"""Fast CPU tests of the DFlash drafter (tiny random configs, no real target)."""
import json

import pytest
import torch
import torch.nn as nn

from taps.models.drafter import (DFlashConfig, DFlashDrafter, check_compatible, default_target_layer_ids,
                                 extract_context_features, load_drafter)

PUBLISHED_NAMES = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
    f"layers.{{i}}.{n}" for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]


def tiny_cfg(**kw):
    d = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
             num_hidden_layers=2, vocab_size=97, block_size=5, num_target_layers=8, target_layer_ids=[1, 3, 5],
             mask_token_id=96, rope_theta=10000.0)
    d.update(kw)
    return DFlashConfig(**d)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = tiny_cfg(**kw)
    m = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    return m, emb, head


def test_layer_id_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    ids = default_target_layer_ids(28, 3)
    assert ids[0] == 1 and ids[-1] == 25 and ids == sorted(ids)
    assert default_target_layer_ids(30, 1) == [15]
    with pytest.raises(ValueError):
        default_target_layer_ids(30, 0)


def test_extract_context_features():
    hs = [torch.full((1, 3, 4), float(i)) for i in range(9)]
    f = extract_context_features(hs, [1, 5])
    assert f.shape == (1, 3, 8)
    assert f[0, 0, :4].eq(2).all() and f[0, 0, 4:].eq(6).all()
    with pytest.raises(ValueError):
        extract_context_features(hs, [8])


def test_config_and_weight_roundtrip(tmp_path):
    m, emb, head = make()
    names = set(m.state_dict().keys())
    expect = {n.format(i=i) for n in PUBLISHED_NAMES for i in range(m.config.num_hidden_layers)}
    assert names == expect
    m.save_pretrained(tmp_path, dtype=torch.float32)
    d = json.loads((tmp_path / "config.json").read_text())
    for k in ("block_size", "num_target_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size", "num_hidden_layers"):
        assert k in d
    assert d["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": 96}
    m2 = load_drafter(tmp_path)
    assert m2.config.target_layer_ids == [1, 3, 5] and m2.config.mask_token_id == 96
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k])


def test_loads_published_layout_with_prefix(tmp_path):
    """A published-style dir: config with dflash_config, bf16 weights, optional 'model.' prefix."""
    from safetensors.torch import save_file
    m, _, _ = make()
    cfg = m.config.to_dict()
    cfg["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model." + k: v.to(torch.bfloat16).contiguous() for k, v in m.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    m2 = load_drafter(tmp_path)
    assert m2.fc.weight.dtype == torch.float32
    torch.testing.assert_close(m2.fc.weight, m.fc.weight.to(torch.bfloat16).float())


def test_incremental_draft_matches_training_forward():
    m, emb, head = make()
    cfg = m.config
    B, T, S = 2, 13, cfg.block_size
    torch.manual_seed(1)
    feats = torch.randn(B, T, cfg.num_context_features)
    tokens = torch.randint(0, 90, (B, T))
    anchors = torch.tensor([[3, 7, 11], [5, 9, 12]])
    blocks = torch.full((B, 3, S), cfg.mask_token_id)
    blocks[:, :, 0] = torch.gather(tokens, 1, anchors)
    with torch.no_grad():
        h = m.forward_blocks(feats, blocks, anchors, emb)
        ref_logits = head(h[:, :, 1:])
    for b in range(B):
        for j in range(3):
            a = int(anchors[b, j])
            st = m.new_state(1)
            # append context in two chunks to exercise positions continuing from state length
            m.append_context(st, feats[b:b + 1, : a // 2])
            m.append_context(st, feats[b:b + 1, a // 2: a])
            assert st.length == a
            logits, hid = m.draft(st, tokens[b:b + 1, a], emb, head)
            assert logits.shape == (1, S - 1, cfg.vocab_size) and logits.dtype == torch.float32
            assert hid.shape == (1, S - 1, cfg.hidden_size)
            torch.testing.assert_close(logits[0], ref_logits[b, j], atol=1e-4, rtol=1e-4)
            assert st.length == a  # draft does not modify the state


def test_rollback():
    m, emb, head = make()
    feats = torch.randn(1, 10, m.config.num_context_features)
    st = m.new_state(1)
    m.append_context(st, feats)
    m.rollback(st, 6)
    assert st.length == 6 and st.k[0].shape[2] == 6
    st2 = m.new_state(1)
    m.append_context(st2, feats[:, :6])
    b = torch.tensor([5])
    torch.testing.assert_close(m.draft(st, b, emb, head)[0], m.draft(st2, b, emb, head)[0])
    with pytest.raises(ValueError):
        m.rollback(st, 7)


def test_block_isolation_and_bidirectionality():
    m, emb, head = make()
    cfg = m.config
    T, S = 16, cfg.block_size
    torch.manual_seed(2)
    feats = torch.randn(1, T, cfg.num_context_features)
    anchors = torch.tensor([[4, 10]])
    blocks = torch.randint(0, 90, (1, 2, S))
    with torch.no_grad():
        h0 = m.forward_blocks(feats, blocks, anchors, emb)
        # change the later block's tokens: earlier block unchanged
        b2 = blocks.clone(); b2[0, 1] = (b2[0, 1] + 7) % 90
        h1 = m.forward_blocks(feats, b2, anchors, emb)
        torch.testing.assert_close(h0[0, 0], h1[0, 0])
        assert not torch.allclose(h0[0, 1], h1[0, 1])
        # context after the anchor is invisible to that block
        f2 = feats.clone(); f2[0, 4:] += 5.0
        h2 = m.forward_blocks(f2, blocks, anchors, emb)
        torch.testing.assert_close(h0[0, 0], h2[0, 0])
        assert not torch.allclose(h0[0, 1], h2[0, 1])
        # bidirectional: changing the LAST token of a block changes its FIRST row
        b3 = blocks.clone(); b3[0, 0, S - 1] = (b3[0, 0, S - 1] + 3) % 90
        h3 = m.forward_blocks(feats, b3, anchors, emb)
        assert not torch.allclose(h0[0, 0, 0], h3[0, 0, 0])
        # an earlier block's tokens do not leak into a later one either
        b4 = blocks.clone(); b4[0, 0] = (b4[0, 0] + 1) % 90
        h4 = m.forward_blocks(feats, b4, anchors, emb)
        torch.testing.assert_close(h0[0, 1], h4[0, 1])


def test_check_compatible_errors():
    cfg = tiny_cfg()
    tgt = {"hidden_size": 32, "vocab_size": 97, "num_hidden_layers": 8}
    check_compatible(cfg, tgt)
    with pytest.raises(ValueError, match="hidden_size"):
        check_compatible(cfg, dict(tgt, hidden_size=64))
    with pytest.raises(ValueError, match="vocab_size"):
        check_compatible(cfg, dict(tgt, vocab_size=100))
    with pytest.raises(ValueError, match="target_layer_ids"):
        check_compatible(tiny_cfg(target_layer_ids=[1, 3, 9]), tgt)
    with pytest.raises(ValueError, match="num_target_layers"):
        check_compatible(cfg, dict(tgt, num_hidden_layers=12))
    with pytest.raises(ValueError, match="mask_token_id"):
        check_compatible(tiny_cfg(mask_token_id=None), tgt)
    with pytest.raises(ValueError, match="mask_token_id"):
        check_compatible(tiny_cfg(mask_token_id=500), tgt)


def test_context_feature_width_checked():
    m, emb, head = make()
    st = m.new_state(1)
    with pytest.raises(ValueError, match="channels"):
        m.append_context(st, torch.randn(1, 3, 10))


def test_missing_drafter_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path)


def test_feature_scale_folds_into_fc(tmp_path):
    m, emb, head = make()
    feats = torch.randn(1, 9, m.config.num_context_features)
    scale = torch.rand(m.config.num_context_features) + 0.5
    m.set_feature_scale(scale)
    st = m.new_state(1)
    m.append_context(st, feats)
    ref = m.draft(st, torch.tensor([3]), emb, head)[0]
    m.save_pretrained(tmp_path, dtype=torch.float32)
    m2 = load_drafter(tmp_path)
    assert m2.feature_scale is None
    st2 = m2.new_state(1)
    m2.append_context(st2, feats)
    torch.testing.assert_close(m2.draft(st2, torch.tensor([3]), emb, head)[0], ref, atol=1e-4, rtol=1e-4)


def test_head_dtype_projects_with_a_cached_low_precision_copy():
    m, emb, head = make()
    st = m.new_state(1)
    m.append_context(st, torch.randn(1, 9, m.config.num_context_features))
    exact = m.draft(st, torch.tensor([3]), emb, head)[0]
    m.head_dtype = torch.bfloat16
    low = m.draft(st, torch.tensor([3]), emb, head)[0]
    assert low.dtype == torch.float32 and not torch.equal(low, exact)
    want = nn.functional.linear(m.draft(st, torch.tensor([3]), emb, head)[1].bfloat16(), head.weight.bfloat16()).float()
    torch.testing.assert_close(low, want, atol=0, rtol=0)
    torch.testing.assert_close(low, exact, atol=0.05 * exact.abs().max().item(), rtol=0)
    with torch.no_grad():  # an in-place update of the head must not leave a stale copy behind
        head.weight.mul_(2)
    torch.testing.assert_close(m.draft(st, torch.tensor([3]), emb, head)[0], 2 * low, atol=1e-2, rtol=1e-2)
    m.head_dtype = None
    torch.testing.assert_close(m.draft(st, torch.tensor([3]), emb, head)[0], 2 * exact, atol=1e-5, rtol=1e-5)


def test_fast_head_dtype_changes_proposals_not_generated_tokens():
    """What the CLI's head dtype may change: the draft logits (a few argmax proposals at most), never the
    generated tokens, whichever dtype this machine picks; off the CPU the LM head's own dtype is kept."""
    from helpers import hf_greedy, tiny_drafter, tiny_target
    from taps.decode import SpeculativeDecoder, make_policy
    from taps.models.drafter import fast_head_dtype

    picked = fast_head_dtype("cpu")
    assert picked in (None, torch.bfloat16, torch.int8) and fast_head_dtype("meta") is None
    target, drafter = tiny_target(0), tiny_drafter(0)
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    st = drafter.new_state(1)
    drafter.append_context(st, torch.randn(1, 7, drafter.config.num_context_features))
    with torch.no_grad():
        exact = drafter.draft(st, torch.tensor([3]), emb, head)[0]
        drafter.head_dtype = torch.bfloat16
        low = drafter.draft(st, torch.tensor([3]), emb, head)[0]
    assert not torch.equal(low, exact)
    assert (low.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.75
    prompt = [5, 9, 17, 3, 44, 2]
    ref = hf_greedy(target, prompt, 20)
    for dtype in dict.fromkeys([picked, torch.bfloat16, torch.int8, None]):
        drafter.head_dtype = dtype
        dec = SpeculativeDecoder(target, make_policy("ddtree:6"), drafter=drafter)
        assert dec.generate(prompt, 20).token_ids == ref, dtype


def _drafter_with_context(seed=0):
    m, emb, head = make(seed)
    st = m.new_state(1)
    m.append_context(st, torch.randn(1, 9, m.config.num_context_features))
    return m, emb, head, st


def test_num_positions_projects_only_the_first_positions():
    m, emb, head, st = _drafter_with_context()
    D = m.config.block_size - 1
    full, hid = m.draft(st, torch.tensor([3]), emb, head)
    for P in (1, 2, D):
        lo, h = m.draft(st, torch.tensor([3]), emb, head, num_positions=P)
        assert lo.shape == (1, P, m.config.vocab_size) and h.shape == (1, P, m.config.hidden_size)
        torch.testing.assert_close(lo, full[:, :P], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(h, hid[:, :P], atol=1e-6, rtol=1e-6)
    for bad in (0, D + 1):
        with pytest.raises(ValueError, match="num_positions"):
            m.draft(st, torch.tensor([3]), emb, head, num_positions=bad)


def test_short_blocks_draft_equals_the_training_forward_of_the_short_block():
    """``short_blocks``: draft(num_positions=P) is the training forward over ``[bonus, MASK x P]``; at P = D it
    is the full block; below D it differs from the full block's first P positions (the later MASK rows are
    gone from the bidirectional attention)."""
    m, emb, head = make(3)
    D = m.config.block_size - 1
    feats = torch.randn(1, 9, m.config.num_context_features)
    st = m.new_state(1)
    m.append_context(st, feats)
    full, _ = m.draft(st, torch.tensor([3]), emb, head)
    m.short_blocks = True
    for P in (1, 2, D):
        lo, h = m.draft(st, torch.tensor([3]), emb, head, num_positions=P)
        assert lo.shape == (1, P, m.config.vocab_size) and h.shape == (1, P, m.config.hidden_size)
        block = torch.full((1, 1, P + 1), m.mask_token_id)
        block[0, 0, 0] = 3
        with torch.no_grad():
            ref = head(m.forward_blocks(feats, block, torch.tensor([[9]]), emb)[:, 0, 1:])
        torch.testing.assert_close(lo, ref, atol=1e-4, rtol=1e-4)
        if P == D:
            torch.testing.assert_close(lo, full, atol=1e-5, rtol=1e-5)
        else:
            assert not torch.allclose(lo, full[:, :P], atol=1e-4)
    assert st.length == 9  # the state is not modified


@pytest.mark.parametrize("head_dtype,tol", [(None, 1e-6), (torch.bfloat16, 1e-2), (torch.int8, 5e-2)])
def test_draft_vocab_logits_are_the_full_logits_restricted(head_dtype, tol):
    """Full-size layout: the draft-vocabulary columns equal the full projection (same dtype, up to the
    rounding of a GEMM of another shape: tolerance relative to the largest logit), every other
    column is -inf; sub layout: the same numbers, column j = token ids[j]; top-k through the id map is the
    full-size top-k exactly."""
    m, emb, head, st = _drafter_with_context(1)
    m.head_dtype = head_dtype
    V = m.config.vocab_size
    ref = m.draft(st, torch.tensor([3]), emb, head)[0]
    ids = torch.tensor([90, 2, 7, 40, 11, 63, 5, 33, 71, 18, 26], dtype=torch.int64)
    m.set_draft_vocab(ids)
    sids = ids.sort().values
    assert torch.equal(m.draft_vocab, sids) and m.config.draft_vocab_size == len(ids)
    full = m.draft(st, torch.tensor([3]), emb, head, num_positions=3)[0]
    assert full.shape == (1, 3, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[sids] = False
    assert torch.isneginf(full[..., outside]).all()
    torch.testing.assert_close(full[..., sids], ref[:, :3, sids], atol=tol * ref.abs().max().item(), rtol=0)
    sub = m.draft(st, torch.tensor([3]), emb, head, num_positions=3, full_vocab_logits=False)[0]
    assert sub.shape == (1, 3, len(ids))
    torch.testing.assert_close(sub, full[..., sids], atol=0, rtol=0)
    k = 4
    assert torch.equal(sids[sub.topk(k, -1).indices], full.topk(k, -1).indices)
    # the layout is the call's alone: the next call's default is full-size again
    again = m.draft(st, torch.tensor([3]), emb, head, num_positions=3)[0]
    assert torch.equal(again, full) and not hasattr(m, "full_vocab_logits")
    m.set_draft_vocab(None)
    torch.testing.assert_close(m.draft(st, torch.tensor([3]), emb, head)[0], ref, atol=0, rtol=0)


def test_draft_vocab_saved_beside_the_weights(tmp_path):
    from taps.models.drafter import DRAFT_VOCAB_FILE

    m, emb, head, st = _drafter_with_context(2)
    ids = torch.tensor([1, 4, 9, 16, 25, 36, 49, 64, 81], dtype=torch.int64)
    m.set_draft_vocab(ids)
    m.save_pretrained(tmp_path, dtype=None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 9 and cfg["draft_vocab_file"] == DRAFT_VOCAB_FILE
    m2 = load_drafter(tmp_path)
    assert torch.equal(m2.draft_vocab, ids) and m2.config.draft_vocab_size == 9
    st2 = m2.new_state(1)
    feats = torch.randn(1, 6, m.config.num_context_features)
    st = m.new_state(1)
    m.append_context(st, feats)
    m2.append_context(st2, feats)
    torch.testing.assert_close(m2.draft(st2, torch.tensor([3]), emb, head)[0],
                               m.draft(st, torch.tensor([3]), emb, head)[0], atol=1e-5, rtol=1e-5)
    (tmp_path / DRAFT_VOCAB_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="draft_vocab_size 9"):
        load_drafter(tmp_path)
    m.set_draft_vocab(None)  # saving without a vocabulary drops the declaration
    m.save_pretrained(tmp_path, dtype=None)
    assert "draft_vocab_size" not in json.loads((tmp_path / "config.json").read_text())
    assert load_drafter(tmp_path).draft_vocab is None


@pytest.mark.parametrize("bad", [torch.tensor([1, 1, 2]), torch.tensor([-1, 3]), torch.tensor([5, 97]),
                                 torch.tensor([1.0, 2.0]), torch.zeros(0, dtype=torch.int64)])
def test_draft_vocab_rejects_bad_ids(bad):
    m, _, _ = make()
    with pytest.raises(ValueError, match="draft vocab"):
        m.set_draft_vocab(bad)
    assert m.draft_vocab is None and m.config.draft_vocab_size is None


def test_draft_modes_belong_to_each_drafter():
    """The draft pass's modes are set per drafter by its constructor (defaults below); none lives on the class,
    so one drafter's setting never shows through another."""
    defaults = {"head_dtype": None, "short_blocks": False, "block_draft": None, "draft_vocab": None}
    a, b = make(0)[0], make(1)[0]
    for name, value in defaults.items():
        assert not hasattr(DFlashDrafter, name), name
        assert name in vars(a) and getattr(a, name) == value, name
    a.short_blocks, a.head_dtype = True, torch.bfloat16
    assert (b.short_blocks, b.head_dtype) == (False, None)
