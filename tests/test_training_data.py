"""Training-data generation (batched Llama generator), draft vocabulary, batches with top-k, configs."""
import random

import pytest
import torch
from helpers import hf_greedy, tiny_drafter, tiny_target

from taps.data.generation import LlamaGenerator
from taps.data.magpie import clean_turn
from taps.training.data import BuildDataConfig
from taps.training.draft_vocab import select_draft_vocab, vocab_coverage
from taps.models.drafter import DFlashConfig, DFlashDrafter
from taps.training.train_drafter import TrainConfig, block_loss, keep_layers, make_batch


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 40, (n,), generator=g).tolist() for n in (7, 2, 13, 5)]


def test_generator_matches_hf_greedy_features_and_topk():
    """Left-padded batch, rows leaving the batch at their end token: tokens equal HF generate row by row,
    captured features equal output_hidden_states[id+1] (not the last layer: HF norms that one), top-k equals
    log_softmax of HF logits."""
    torch.manual_seed(0)
    model = tiny_target(0)
    prompts = _prompts()
    n = 12
    free = [hf_greedy(model, p, n) for p in prompts]
    eos = free[0][4]  # a token some rows emit: those rows stop early and the batch is compacted
    gen = LlamaGenerator(model, layer_ids=[0, 2, 4])
    res = gen.generate(prompts, n, eos_id=eos, topk=5, compact_frac=0.2)
    for p, f, r in zip(prompts, free, res):
        want = f[: f.index(eos) + 1] if eos in f else f
        assert r.tokens == p + want and r.prompt_len == len(p)
        with torch.no_grad():
            out = model(torch.tensor([r.tokens]), output_hidden_states=True)
        ref = torch.cat([out.hidden_states[i + 1] for i in (0, 2, 4)], -1)[0]
        m = len(r.tokens) - 1
        torch.testing.assert_close(r.feats[:m].float(), ref[:m], atol=2e-3 * ref.abs().max().item(), rtol=1e-3)
        assert torch.equal(r.feats[m], torch.zeros_like(r.feats[m]))
        lp = torch.log_softmax(out.logits[0, r.prompt_len - 1:-1], -1)
        assert r.topk_ids.shape == (len(want), 5)
        assert torch.equal(r.topk_ids[:, 0], torch.tensor(want))
        torch.testing.assert_close(r.topk_logp, lp.gather(1, r.topk_ids), atol=1e-4, rtol=1e-4)


def test_generator_sampling_is_seeded_and_checks_inputs():
    model = tiny_target(1)
    gen = LlamaGenerator(model)
    p = [[5, 6, 7]] * 3
    a = gen.generate(p, 8, eos_id=0, temperature=1.0, generator=torch.Generator().manual_seed(4), capture=False)
    b = gen.generate(p, 8, eos_id=0, temperature=1.0, generator=torch.Generator().manual_seed(4), capture=False)
    assert [r.tokens for r in a] == [r.tokens for r in b] and a[0].feats is None
    assert len({tuple(r.tokens) for r in a}) > 1  # rows sample independently
    with pytest.raises(ValueError, match="prompts"):
        gen.generate([[1], []], 4, eos_id=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate([[1]], 0, eos_id=0)
    with pytest.raises(ValueError, match="layer_ids"):
        LlamaGenerator(model, layer_ids=[6])


def test_select_draft_vocab():
    counts = torch.tensor([0, 5, 9, 5, 1, 0, 30, 5], dtype=torch.int64)
    # ties (id 1, 3, 7 with 5) broken by id
    assert select_draft_vocab(counts, size=3).tolist() == [1, 2, 6]
    assert select_draft_vocab(counts, size=3, always=[0]).tolist() == [0, 1, 2, 6]
    ids = select_draft_vocab(counts, coverage=0.9, min_size=1)
    assert ids.tolist() == [1, 2, 3, 6, 7] and vocab_coverage(ids, counts) >= 0.9
    assert vocab_coverage(select_draft_vocab(counts, coverage=0.9, min_size=1)[:-1], counts) < 0.9
    with pytest.raises(ValueError, match="size"):
        select_draft_vocab(counts, size=9)
    with pytest.raises(ValueError, match="all zero"):
        select_draft_vocab(torch.zeros(4, dtype=torch.int64))


def test_make_batch_aligns_topk_with_labels_and_kl_term():
    """Row j of a sequence's top-k is the distribution of response token j: with greedy data its top-1 is
    the label at every valid position; the KL term is the top-k-renormalised KL of the student."""
    L, pl, F, k, S = 30, 8, 6, 3, 5
    toks = torch.randint(10, 40, (L,))  # + 2 stays inside the 64-wide toy vocabulary
    ids = torch.stack([toks[pl:], toks[pl:] + 1, toks[pl:] + 2], 1)
    lp = torch.log_softmax(torch.randn(L - pl, k), -1).sort(-1, descending=True).values
    sample = (toks, torch.randn(L, F), pl)
    out = make_batch([sample, sample], S, 4, 99, random.Random(0), topk=[(ids, lp), (ids, lp)])
    feats, blocks, anchors, labels, sid, slp = out
    valid = labels >= 0
    assert valid.any() and torch.equal(sid[..., 0][valid], labels[valid])
    assert (sid[~valid] == -1).all()

    class Head(torch.nn.Module):  # logits = the identity of a 64-wide hidden (vocab 64)
        weight = torch.eye(64)

        def __call__(self, h):
            return h @ self.weight.T

    class Drafter:
        def forward_blocks(self, feats, block_ids, anchors, embed):
            torch.manual_seed(1)
            return torch.randn(*block_ids.shape, 64)

    w = torch.ones(S - 1)
    base, st0 = block_loss(Drafter(), Head(), None, (feats, blocks, anchors, labels), w, False)
    tot, st1 = block_loss(Drafter(), Head(), None, out, w, False, kl_weight=0.5)
    h = Drafter().forward_blocks(None, blocks, None, None)[:, :, 1:][valid]
    ls = torch.log_softmax(h, -1).gather(1, sid[valid])
    q = torch.softmax(slp[valid], -1)
    kl = (q * (q.log() - ls)).sum(-1).mean()
    torch.testing.assert_close(torch.tensor(st1["kl"]), kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tot, base + 0.5 * kl, atol=1e-5, rtol=1e-5)


def test_configs_reject_unknown_and_bad_options(tmp_path):
    with pytest.raises(TypeError):
        TrainConfig(data="d", out="o", anchors=3)  # a typo is an error, not silently ignored
    with pytest.raises(ValueError, match="train_vocab"):
        TrainConfig(data="d", out="o", train_vocab="some")
    with pytest.raises(ValueError, match="init_from"):
        TrainConfig(data="d", out="o", init_from=str(tmp_path))
    with pytest.raises(TypeError):
        BuildDataConfig(out="o", num_prompt=3)
    with pytest.raises(ValueError, match="chat_fraction"):
        BuildDataConfig(out="o", chat_fraction=1.5)
    with pytest.raises(ValueError, match="part"):
        BuildDataConfig(out="o", part=2, num_parts=2)
    with pytest.raises(ValueError, match="target_format"):
        BuildDataConfig(out="o", target_format="q4")


def test_keep_layers_renumbers_the_kept_layers():
    d3 = tiny_drafter(layers=3)
    sd = keep_layers(d3.state_dict(), [0, 2], 3)
    cfg = DFlashConfig.from_dict(d3.config.to_dict())
    cfg.num_hidden_layers = 2
    d2 = DFlashDrafter(cfg)
    d2.load_state_dict(sd)  # strict: exactly the 2-layer names
    torch.testing.assert_close(d2.layers[1].mlp.up_proj.weight, d3.layers[2].mlp.up_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(d2.fc.weight, d3.fc.weight, rtol=0, atol=0)
    for bad in ([], [3], [-1]):
        with pytest.raises(ValueError, match="init_layers"):
            keep_layers(d3.state_dict(), bad, 3)
    with pytest.raises(ValueError, match="init_layers"):
        TrainConfig(data="d", out="o", init_layers="0,2")


def test_keep_layers_repeat_adds_a_layer_that_starts_as_the_identity():
    torch.manual_seed(0)
    d2 = tiny_drafter(layers=2)
    for p in d2.parameters():  # a trained-looking drafter: no zero residual writes to begin with
        p.data.normal_(0, 0.05)
    cfg = DFlashConfig.from_dict(d2.config.to_dict())
    cfg.num_hidden_layers = 3
    d3 = DFlashDrafter(cfg)
    d3.load_state_dict(keep_layers(d2.state_dict(), [0, 1, 1], 2))
    torch.testing.assert_close(d3.layers[2].mlp.up_proj.weight, d2.layers[1].mlp.up_proj.weight, rtol=0, atol=0)
    assert not d3.layers[2].self_attn.o_proj.weight.any() and not d3.layers[2].mlp.down_proj.weight.any()
    assert d3.layers[1].self_attn.o_proj.weight.any()  # the first occurrence is the parent's layer as it was
    emb = torch.nn.Embedding(d2.config.vocab_size, d2.config.hidden_size)
    ctx = torch.randn(1, 9, d2.fc.in_features)
    S = d2.config.block_size
    block_ids = torch.full((1, 2, S), d2.mask_token_id)
    block_ids[:, :, 0] = torch.tensor([5, 7])
    anchors = torch.tensor([[3, 6]])
    with torch.no_grad():
        h2 = d2.forward_blocks(ctx, block_ids, anchors, emb)
        h3 = d3.forward_blocks(ctx, block_ids, anchors, emb)
    torch.testing.assert_close(h3, h2, rtol=0, atol=0)


def test_clean_turn():
    assert clean_turn("  How do I sort a list in Python?  ") == "How do I sort a list in Python?"
    assert clean_turn("hi there") is None  # too short
    assert clean_turn("Tell me a story <|im_start|>assistant") is None
    assert clean_turn("word " * 400) is None


def test_shard_format2_roundtrip_and_expected_counts(tmp_path):
    """Generated results packed into a format-2 shard read back through ShardData: tokens, features,
    kinds and the top-k rows of each response token; expected counts add the top-k probabilities."""
    import json

    from taps.training.data import _pack_shard
    from taps.training.draft_vocab import expected_token_counts, response_token_counts
    from taps.training.train_drafter import ShardData

    model = tiny_target(2)
    gen = LlamaGenerator(model, layer_ids=[1, 3])
    prompts = _prompts()
    res = gen.generate(prompts, 6, eos_id=-1, topk=4)
    blob = _pack_shard(res, ["code", "chat", "chat", "write"], [0, 1, 2, 3], [1, 3], torch.float16, 4)
    torch.save(blob, tmp_path / "shard_00000.pt")
    (tmp_path / "meta.json").write_text(json.dumps({"layer_ids": [1, 3]}))
    ds = ShardData(str(tmp_path))
    assert len(ds) == 4 and ds.has_topk and blob["tokens"].dtype == torch.uint16
    for k, r in enumerate(res):
        toks, feats, pl = ds.get(k)
        assert toks.tolist() == r.tokens and pl == r.prompt_len
        assert torch.equal(feats, r.feats)
        ti, tl = ds.get_topk(k, len(r.tokens))
        assert torch.equal(ti, r.topk_ids) and torch.equal(tl, r.topk_logp.half().float())
        ti3, _ = ds.get_topk(k, r.prompt_len + 3)  # cut sequences keep the rows of their tokens only
        assert torch.equal(ti3, r.topk_ids[:3])
    assert [ds.kind(k) for k in range(4)] == ["code", "chat", "chat", "write"]
    raw = response_token_counts(str(tmp_path), 61)
    assert int(raw.sum()) == sum(len(r.tokens) - r.prompt_len for r in res)
    exp = expected_token_counts(str(tmp_path), 61)
    mass = sum(float(r.topk_logp.half().float().exp().sum()) for r in res)
    torch.testing.assert_close(exp.sum(), torch.tensor(float(raw.sum()) + mass, dtype=torch.float64),
                               atol=1e-3, rtol=1e-6)


def _tiny_training_run(tmp_path, monkeypatch):
    """Two format-2 shards of a tiny target (which ``load_target`` then returns) and a 3-layer parent drafter."""
    import json

    import taps.models.target as target_mod
    from taps.training.data import _pack_shard

    target = tiny_target(2)
    monkeypatch.setattr(target_mod, "load_target", lambda name, **kw: (target, None))
    data = tmp_path / "data"
    data.mkdir()
    gen = LlamaGenerator(target, layer_ids=[0, 1])
    for s in range(2):
        res = gen.generate([[5 + s, 9, 11], [7, 3 + s]], 24, eos_id=-1, topk=4)
        torch.save(_pack_shard(res, ["code", "chat"], [2 * s, 2 * s + 1], [0, 1], torch.float16, 4),
                   data / f"shard_{s:05d}.pt")
    (data / "meta.json").write_text(json.dumps({"layer_ids": [0, 1]}))
    parent = tmp_path / "parent"
    tiny_drafter(layers=3, target_layers=6).save_pretrained(parent)
    return data, parent


def test_train_drafter_runs_from_the_cli(tmp_path, monkeypatch):
    """``taps train-drafter`` builds its TrainConfig from the parsed arguments (not the CLI's own entries)."""
    from taps.cli.main import main

    data, parent = _tiny_training_run(tmp_path, monkeypatch)
    argv = ["train-drafter", "--data", str(data), "--out", str(tmp_path / "cli"), "--init-from", str(parent),
            "--init-layers", "0,2", "--block-size", "5", "--anchors-per-seq", "2", "--batch-size", "2",
            "--max-seq-len", "64", "--warmup", "1", "--save-every", "1", "--holdout-shards", "0", "--kl-weight", "1",
            "--threads", "1", "--steps", "2"]
    assert main(argv) == 0
    ck = torch.load(tmp_path / "cli" / "ckpt.pt", weights_only=False)
    assert ck["step"] == 2


def test_train_drafter_resumes_from_its_checkpoint_without_the_parent(tmp_path, monkeypatch):
    """A run started from a parent's layers 0 and 2 resumes from ``ckpt.pt`` alone: architecture, weights and
    step come from the checkpoint even when the parent is gone and ``num_layers`` says otherwise."""
    from taps.training.train_drafter import train_drafter

    data, parent = _tiny_training_run(tmp_path, monkeypatch)
    base = dict(data=str(data), out=str(tmp_path / "run"), block_size=5, anchors_per_seq=2, batch_size=2,
                max_seq_len=64, warmup=1, save_every=1, holdout_shards="0", kl_weight=1.0, threads=1)
    first = train_drafter(TrainConfig(steps=2, init_from=str(parent), init_layers="0,2", **base))
    assert first.config.num_hidden_layers == 2
    ck = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    assert ck["step"] == 2
    import shutil

    shutil.rmtree(parent)
    resumed = train_drafter(TrainConfig(steps=3, **dict(base, block_size=4), num_layers=5))
    assert resumed.config.num_hidden_layers == 2 and resumed.config.block_size == 5
    ck = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    assert ck["step"] == 3
    # the parent's features were unscaled; a resumed run must not start scaling them halfway
    assert first.feature_scale is None and resumed.feature_scale is None and ck["feat_scale"] is None


def test_extend_prompts_keeps_the_written_ones_in_place(monkeypatch):
    import taps.training.prompts as prompts_mod
    from taps.training.prompts import EvalFilter, build_prompts, extend_prompts

    ef = EvalFilter()
    first = build_prompts(12, seed=4, eval_filter=ef)
    grown = extend_prompts(first, 30, seed=4, eval_filter=ef)
    assert grown[:12] == first and len(grown) == 30
    assert len({p["id"] for p in grown}) == 30
    assert extend_prompts(grown, 30, seed=4, eval_filter=ef) == grown
    monkeypatch.setattr(prompts_mod, "build_prompts", lambda n, **kw: grown)  # sources that hold 30 prompts
    with pytest.raises(ValueError, match="num_prompts: expected at most 30"):
        extend_prompts(first, 31, seed=4, eval_filter=ef)


def test_coverage_report_counts_the_asked_training_shards(tmp_path):
    """``draft-vocab --max-shard``: training coverage over the shards asked for only, held-out apart."""
    from taps.training.data import _pack_shard
    from taps.training.draft_vocab import coverage_report

    gen = LlamaGenerator(tiny_target(2), layer_ids=[1])
    for s, n in enumerate((4, 5, 6)):
        res = gen.generate(_prompts(), n, eos_id=-1)
        torch.save(_pack_shard(res, ["code"] * len(res), list(range(len(res))), [1], torch.float16, 0),
                   tmp_path / f"shard_{s:05d}.pt")
    resp = lambda n: n * len(_prompts())  # noqa: E731  (n response tokens per row: eos never comes)
    ids = torch.arange(61)
    every = coverage_report(str(tmp_path), ids, 61, holdout=[0])
    first = coverage_report(str(tmp_path), ids, 61, holdout=[0], shards=[1])
    assert every["train_tokens"] == resp(5) + resp(6) and first["train_tokens"] == resp(5)
    assert every["heldout_tokens"] == first["heldout_tokens"] == resp(4)
    assert first["train_coverage"] == every["heldout_coverage"] == 1.0


def test_eval_drafter_heads_and_vocabulary(tmp_path):
    """eval-drafter: the LM head by default; ``head_dtype`` runs draft()'s own projection (float32 gives the LM
    head's argmax exactly), int8 and a draft vocabulary as decoding drafts; the drafter's head dtype and draft
    vocabulary are put back afterwards."""
    import json

    from taps.training.data import _pack_shard
    from taps.training.eval_drafter import eval_drafter

    target = tiny_target(2)
    res = LlamaGenerator(target, layer_ids=[0, 1]).generate(_prompts(), 12, eos_id=-1)
    torch.save(_pack_shard(res, ["code", "chat", "chat", "write"], [0, 1, 2, 3], [0, 1], torch.float16, 0),
               tmp_path / "shard_00000.pt")
    (tmp_path / "meta.json").write_text(json.dumps({"layer_ids": [0, 1]}))
    drafter = tiny_drafter(0)
    vocab = torch.arange(0, drafter.config.vocab_size, 2)
    drafter.set_draft_vocab(vocab)
    drafter.head_dtype = torch.bfloat16

    def run(**kw):
        return eval_drafter("drafter", str(tmp_path), drafter=drafter, tmodel=target, **kw)

    base = run()
    assert base["blocks"] > 0 and base["head_dtype"] == "float32" and not base["draft_vocab"]
    same = run(head_dtype=torch.float32)
    assert (same["tau"], same["pos_acc"]) == (base["tau"], base["pos_acc"])
    for kw in ({"head_dtype": torch.int8}, {"head_dtype": torch.int8, "use_draft_vocab": True}):
        r = run(**kw)
        assert r["head_dtype"] == "int8" and r["blocks"] == base["blocks"] and r["tau"] >= 1.0
    assert drafter.head_dtype == torch.bfloat16 and torch.equal(drafter.draft_vocab, vocab)


class _CharTokenizer:
    """A character tokenizer with SmolLM2's chat template over an 80-token vocabulary (ids 0-2 special), for
    running ``build-data`` on a tiny GGUF target without downloads."""

    SPECIAL = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n.,:;!?()[]{}_-=+*/'\"#<>"[:77]
    chat_template = "chatml"
    eos_token_id = pad_token_id = 2
    eos_token = "<|im_end|>"

    def _ids(self, text):
        out, i = [], 0
        while i < len(text):
            for s, j in self.SPECIAL.items():
                if text.startswith(s, i):
                    out.append(j)
                    i += len(s)
                    break
            else:
                c = text[i]
                out.append(3 + (self.ALPHABET.index(c) if c in self.ALPHABET else 76))
                i += 1
        return out

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self._ids(text)}

    def apply_chat_template(self, msgs, add_generation_prompt=False, tokenize=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        return self._ids(text) if tokenize else text

    def convert_tokens_to_ids(self, s):
        return self.SPECIAL.get(s, -1)

    def decode(self, ids, skip_special_tokens=False):
        names = {j: s for s, j in self.SPECIAL.items()}
        return "".join(names.get(i, "") if i < 3 else self.ALPHABET[i - 3] for i in ids)


def test_build_data_gguf_shards_equal_rows_alone_and_resume(tmp_path, monkeypatch):
    """``build-data`` on a tiny GGUF target: each stored sequence (tokens, fp16 features, top-k) is the bits of
    its prompt generated alone; the manifest records the target format and the measured speed; a killed run
    (a shard missing) resumes by writing that shard alone, bit for bit; other options are refused."""
    import json

    from gguf_models import write_tiny_gguf

    import taps.training.data as data_mod
    from taps.data.gguf_generation import GGUFGenerator
    from taps.models.gguf_target import load_gguf_target
    from taps.models.target import apply_chat_template
    from taps.training.data import build_data
    from taps.training.train_drafter import ShardData

    _C = pytest.importorskip("taps_kernels._C")
    if not _C.gguf_forward_available() or _C.gguf_kernel_path() == "scalar":
        pytest.skip("the gguf target format needs AVX-512 VNNI or AVX2")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", vocab=80, layers=3)
    target, tok = load_gguf_target(path), _CharTokenizer()
    monkeypatch.setattr(data_mod, "load_target", lambda name, **kw: (target, tok))
    out = tmp_path / "data"
    cfg = BuildDataConfig(out=str(out), target=str(path), num_prompts=6, shard_size=3, batch_size=2, max_new_tokens=5,
                          max_prompt_tokens=20, layer_ids=[0, 1], chat_fraction=0.0, topk=4, target_format="gguf",
                          threads=1)
    build_data(cfg, command="taps build-data --target-format gguf")
    man = json.loads((out / "manifest.json").read_text())
    assert man["target_format"] == "gguf" and man["config"]["target_format"] == "gguf"
    g = man["generation"]
    assert g["shards"] == 2 and g["threads"] == [1] and g["batch_size"] == [2] and g["target_format"] == ["gguf"]
    assert g["response_tokens"] > 0 and g["response_tokens_per_s"] >= g["response_tokens_per_s_with_magpie"] > 0
    assert g["cpu"] and g["magpie_seconds"] == 0.0  # no chat prompts asked: no Magpie sampling
    assert json.loads((out / "meta.json").read_text())["target_format"] == "gguf"

    prompts = {r["idx"]: r for r in map(json.loads, (out / "prompts.jsonl").read_text().splitlines())}
    alone = GGUFGenerator(target, [0, 1], batch_size=1)
    ds = ShardData(str(out))
    seen = trainable = 0
    for s in range(2):
        blob = torch.load(out / f"shard_{s:05d}.pt", weights_only=True)
        for i, idx in enumerate(blob["prompt_idx"].tolist()):
            ids = apply_chat_template(tok, prompts[idx]["text"])[-20:]
            want = alone.generate([ids], 5, eos_id=tok.eos_token_id, topk=4)[0]
            o0, o1 = int(blob["offsets"][i]), int(blob["offsets"][i + 1])
            assert blob["tokens"][o0:o1].tolist() == want.tokens and int(blob["prompt_lens"][i]) == want.prompt_len
            assert torch.equal(blob["feats"][o0:o1].view(torch.int16), want.feats.view(torch.int16))
            t0, t1 = int(blob["topk_offsets"][i]), int(blob["topk_offsets"][i + 1])
            assert torch.equal(blob["topk_ids"][t0:t1].long(), want.topk_ids)
            assert torch.equal(blob["topk_logp"][t0:t1], want.topk_logp.half())
            seen += 1
            trainable += len(want.tokens) - want.prompt_len >= 2
    assert seen == 6 and len(ds) == trainable and ds.has_topk  # the trainer reads the shards

    first = (out / "shard_00000.pt").stat().st_mtime_ns
    kept = torch.load(out / "shard_00001.pt", weights_only=True)
    (out / "shard_00001.pt").unlink()
    build_data(cfg, command="taps build-data --target-format gguf")
    assert (out / "shard_00000.pt").stat().st_mtime_ns == first
    again = torch.load(out / "shard_00001.pt", weights_only=True)
    assert again.keys() == kept.keys()
    for k, v in kept.items():
        assert (torch.equal(v.view(torch.int16) if v.dtype == torch.float16 else v, again[k].view(torch.int16)
                            if v.dtype == torch.float16 else again[k]) if torch.is_tensor(v) else v == again[k]), k
    assert len((out / "stats.jsonl").read_text().splitlines()) == 3
    assert json.loads((out / "manifest.json").read_text())["generation"]["shards"] == 3
    with pytest.raises(ValueError, match="target_format"):
        build_data(BuildDataConfig(**dict(cfg.__dict__, target_format="fp32")))


def test_build_data_fp32_and_data_from_before_the_target_format(tmp_path, monkeypatch):
    """``target_format="fp32"`` answers through :class:`LlamaGenerator` (each shard's prompts sorted by length in
    one left-padded batch here); a directory whose manifest predates the option holds fp32 data: an fp32 run
    resumes it, a gguf run is refused naming the option."""
    import json

    import taps.training.data as data_mod
    from taps.models.target import apply_chat_template
    from taps.training.data import build_data

    target, tok = tiny_target(2, vocab=80), _CharTokenizer()
    monkeypatch.setattr(data_mod, "load_target", lambda name, **kw: (target, tok))
    out = tmp_path / "data"
    cfg = BuildDataConfig(out=str(out), target="tiny.gguf", num_prompts=4, shard_size=2, batch_size=2,
                          max_new_tokens=4, max_prompt_tokens=20, layer_ids=[0, 1], chat_fraction=0.0, topk=4,
                          target_format="fp32", threads=1)
    build_data(cfg)
    man = json.loads((out / "manifest.json").read_text())
    assert man["target_format"] == "fp32" and man["generation"]["target_format"] == ["fp32"]
    prompts = {r["idx"]: r for r in map(json.loads, (out / "prompts.jsonl").read_text().splitlines())}
    gen = LlamaGenerator(target, layer_ids=[0, 1])
    for s in range(2):
        blob = torch.load(out / f"shard_{s:05d}.pt", weights_only=True)
        idx = blob["prompt_idx"].tolist()
        ids = [apply_chat_template(tok, prompts[i]["text"])[-20:] for i in idx]
        order = sorted(range(len(ids)), key=lambda j: len(ids[j]))
        want = dict(zip(order, gen.generate([ids[j] for j in order], 4, eos_id=tok.eos_token_id, topk=4)))
        for i in range(len(idx)):
            o0, o1 = int(blob["offsets"][i]), int(blob["offsets"][i + 1])
            assert blob["tokens"][o0:o1].tolist() == want[i].tokens
    for key in ("target_format", "target_format_why"):
        man.pop(key)
    man["config"].pop("target_format")
    (out / "manifest.json").write_text(json.dumps(man))
    build_data(cfg)  # resumes: every shard is there
    assert len((out / "stats.jsonl").read_text().splitlines()) == 2
    _C = pytest.importorskip("taps_kernels._C")
    if _C.gguf_forward_available() and _C.gguf_kernel_path() != "scalar":
        with pytest.raises(ValueError, match="other options.*target_format"):
            build_data(BuildDataConfig(**dict(cfg.__dict__, target_format="gguf")))


def _loss_batch(S: int = 5):
    """A batch of two sequences with top-k rows for a tiny drafter (vocabulary 64, features 2 x 32)."""
    L, pl, k = 30, 8, 3
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(10, 40, (L,), generator=g)
    ids = torch.stack([toks[pl:], toks[pl:] + 1, toks[pl:] + 2], 1)
    lp = torch.log_softmax(torch.randn(L - pl, k, generator=g), -1).sort(-1, descending=True).values
    samples = [(toks, torch.randn(L, 64, generator=g), pl), (toks[:21], torch.randn(21, 64, generator=g), pl)]
    return make_batch(samples, S, 4, 63, random.Random(0), topk=[(ids, lp), (ids, lp)])


@pytest.mark.slow
def test_compiled_block_logits_match_eager():
    """TrainConfig.compile: block_logits through torch.compile gives the eager loss, statistics and gradients
    (float32, inductor's own reduction order: a tolerance of a few float32 ulps of the loss)."""
    from taps.training.train_drafter import block_logits

    drafter = tiny_drafter(0, vocab=64).train()
    head = torch.nn.Linear(32, 64, bias=False)
    embed = torch.nn.Embedding(64, 32)
    batch = _loss_batch()
    w = torch.exp(-torch.arange(4.0) / 7)
    subset = torch.arange(0, 64)
    compiled = torch.compile(block_logits, dynamic=True)
    out = []
    for logits_fn in (block_logits, compiled):
        drafter.zero_grad()
        loss, stats = block_loss(drafter, head, embed, batch, w, False, vocab_subset=subset, kl_weight=0.5,
                                 logits_fn=logits_fn)
        loss.backward()
        out.append((loss.detach(), stats, [p.grad.clone() for p in drafter.parameters()]))
    (l0, s0, g0), (l1, s1, g1) = out
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert s1["rows"] == s0["rows"] > 0 and s1["pos_acc"] == s0["pos_acc"] and s1["tau"] == s0["tau"]
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_block_loss_statistics_follow_the_argmax_chain():
    """pos_acc and tau: a position is a hit when its label has the row's largest logit; tau = 1 + the run of
    hits from position 1 of each real block; rows without a label count in neither."""
    drafter = tiny_drafter(0, vocab=64)
    head = torch.nn.Linear(32, 64, bias=False)
    embed = torch.nn.Embedding(64, 32)
    feats, blocks, anchors, labels = _loss_batch()[:4]
    w = torch.ones(4)
    with torch.no_grad():
        loss, st = block_loss(drafter, head, embed, (feats, blocks, anchors, labels), w, False)
        h = drafter.forward_blocks(feats, blocks, anchors, embed)[:, :, 1:]
        pred = head(h).argmax(-1)
    valid = labels >= 0
    hit = (pred == labels) & valid
    want_acc = (hit.float().sum((0, 1)) / valid.float().sum((0, 1)).clamp(min=1)).tolist()
    runs = torch.cumprod(hit.long(), -1).sum(-1)[anchors >= 0]
    assert st["pos_acc"] == pytest.approx(want_acc) and st["tau"] == pytest.approx(1 + runs.float().mean().item())
    ce = torch.nn.functional.cross_entropy(head(h)[valid], labels[valid])
    torch.testing.assert_close(loss, ce, rtol=1e-5, atol=1e-6)


def test_length_bucketed_batches_draw_neighbours_in_length():
    """TrainConfig.bucket_by_length: a batch's sequences lie within a window of 4 x batch_size neighbours in
    length order, every sequence is drawn over many batches, and without the option the draw is uniform (batches
    mix short and long sequences)."""
    from taps.training.train_drafter import _sample_batch

    class Data:
        def __init__(self):
            g = random.Random(3)
            self.lengths = [g.randrange(12, 300) for _ in range(100)]
            self.asked = []

        def __len__(self):
            return len(self.lengths)

        def by_length(self):
            return sorted(range(len(self.lengths)), key=self.lengths.__getitem__)

        def get(self, k, max_len):
            self.asked.append(k)
            L = min(self.lengths[k], max_len)
            return torch.arange(L) % 50, torch.zeros(L, 4), 4

    cfg = DFlashConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                       block_size=4, mask_token_id=63)
    spans = {}
    for bucket in (True, False):
        ds, rng = Data(), random.Random(0)
        rank = {k: r for r, k in enumerate(ds.by_length())}
        tc = TrainConfig(data="d", out="o", batch_size=8, anchors_per_seq=2, bucket_by_length=bucket)
        worst = 0
        for _ in range(300):
            ds.asked.clear()
            _sample_batch(tc, cfg, ds, rng)
            ranks = [rank[k] for k in ds.asked]
            assert len(ranks) == 8
            worst = max(worst, max(ranks) - min(ranks))
        spans[bucket] = worst
        assert len(set(ds.asked)) <= 8
    assert spans[True] < 32 <= spans[False]
    ds, rng = Data(), random.Random(1)
    tc = TrainConfig(data="d", out="o", batch_size=8, anchors_per_seq=2, bucket_by_length=True)
    for _ in range(200):
        _sample_batch(tc, cfg, ds, rng)
    assert set(ds.asked) == set(range(100))
