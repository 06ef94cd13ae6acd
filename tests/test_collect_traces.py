"""``collect_traces`` end to end on the tiny models: shards hold exactly the rounds :func:`trace_prompt` gives for
their prompts, ``meta.json`` records the run, a second run resumes without redoing a shard, a run with other
options is refused, and workers split the shards."""
import json

import pytest
import torch
from safetensors.torch import load_file

import taps.data
import taps.models.drafter
import taps.models.drafter_prepare
import taps.models.target
from helpers import tiny_drafter, tiny_target
from taps.scoring import traces as tr

V = 61
PROMPTS = ["def add(a, b):", "sort a list", "read a file line by line"]


class Tok:
    """A chat tokenizer stand-in: a conversation's ids are its characters' codes mod the vocabulary."""
    chat_template = "stub"
    eos_token_id = None

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        return [2 + ord(c) % (V - 3) for c in "<u>" + messages[0]["content"]]


@pytest.fixture
def setup(monkeypatch, tmp_path):
    target, drafter = tiny_target(seed=5, vocab=V), tiny_drafter(seed=5, vocab=V)
    monkeypatch.setattr(taps.models.target, "load_target", lambda name, target_format: (target, Tok()))
    monkeypatch.setattr(taps.models.drafter, "load_drafter", lambda path, target_config: drafter)
    monkeypatch.setattr(taps.models.drafter_prepare, "fast_head_dtype", lambda device: None)
    monkeypatch.setattr(taps.data, "stop_token_ids", lambda tok, model: [])
    drafter_dir = tmp_path / "drafter"
    drafter_dir.mkdir()
    (drafter_dir / "model.safetensors").write_bytes(b"weights")
    return target, drafter, drafter_dir


def _out(tmp_path, name):
    out = tmp_path / name
    out.mkdir()
    (out / "prompts.jsonl").write_text("".join(json.dumps({"id": str(i), "kind": "code", "text": t}) + "\n"
                                               for i, t in enumerate(PROMPTS)))
    return out


CONFIG = dict(num_prompts=3, prompts_per_shard=2, pool_size=12, top_k=5, lattice_k=3, max_new_tokens=8,
              max_prompt_tokens=10, draft_dtype="float32", target_format="fp32", progress=False)


def test_shards_hold_the_rounds_of_their_prompts(setup, tmp_path):
    target, drafter, drafter_dir = setup
    out = _out(tmp_path, "traces")
    summary = tr.collect_traces(out, drafter_dir, tr.TraceConfig(**CONFIG))
    shards = tr.list_shards(out)
    assert [p.name for p in shards] == ["traces_00000.safetensors", "traces_00001.safetensors"]
    want = []
    for i, text in enumerate(PROMPTS):
        ids = Tok().apply_chat_template([{"role": "user", "content": text}])[-10:]  # max_prompt_tokens
        want.append(tr.trace_prompt(target, drafter, ids, 8, 12, 5, 3, set(), prompt_index=i))
    for shard, prompts in zip(shards, ([0, 1], [2])):
        got = load_file(str(shard))
        expect = tr.stack_records([r for i in prompts for r in want[i]])
        assert set(got) == set(expect)
        for k in expect:
            assert torch.equal(got[k], expect[k]), (shard.name, k)
    rounds = sum(len(w) for w in want)
    assert summary["shards"] == 2 and summary["prompts"] == 3 and summary["rounds"] == rounds
    assert summary["tau_pool"] == pytest.approx(
        sum(float(r["accept_len"]) for w in want for r in w) / rounds, rel=1e-12)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["pool_size"] == 12 and meta["top_k"] == 5 and meta["num_draft_positions"] == 4
    assert meta["drafter"]["sha256"] == tr.file_digest(drafter_dir / "model.safetensors")
    assert meta["draft_dtype"] == "float32" and meta["decoding"] == "greedy" and meta["target_format"] == "fp32"

    # resume: finished shards are kept, nothing is traced again
    before = {p.name: p.stat().st_mtime_ns for p in shards}
    calls = []
    real = tr.trace_prompt
    tr.trace_prompt = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        again = tr.collect_traces(out, drafter_dir, tr.TraceConfig(**CONFIG))
    finally:
        tr.trace_prompt = real
    assert calls == [] and again == summary
    assert {p.name: p.stat().st_mtime_ns for p in tr.list_shards(out)} == before

    with pytest.raises(ValueError, match="pool_size=12.*16"):
        tr.collect_traces(out, drafter_dir, tr.TraceConfig(**{**CONFIG, "pool_size": 16}))
    # traces verified by another target format are another run's
    (out / "meta.json").write_text(json.dumps({**meta, "target_format": "gguf"}))
    with pytest.raises(ValueError, match="target_format='gguf'.*'fp32'"):
        tr.collect_traces(out, drafter_dir, tr.TraceConfig(**CONFIG))
    with pytest.raises(ValueError, match="TraceConfig.target_format: expected one of"):
        tr.TraceConfig(target_format="int4")


def test_workers_split_the_shards(setup, tmp_path):
    _, _, drafter_dir = setup
    out = _out(tmp_path, "split")
    summary = tr.collect_traces(out, drafter_dir, tr.TraceConfig(**CONFIG, worker=1, workers=2))
    assert [p.name for p in tr.list_shards(out)] == ["traces_00001.safetensors"]
    assert summary["prompts"] == 1
    assert not (out / "meta.json").exists()  # worker 0 writes it
    tr.collect_traces(out, drafter_dir, tr.TraceConfig(**CONFIG, worker=0, workers=2))
    assert len(tr.list_shards(out)) == 2 and (out / "meta.json").exists()
