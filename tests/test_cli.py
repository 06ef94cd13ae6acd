"""The ``taps`` CLI end to end on tiny random models saved to disk (no downloads): JSON output, bench
summary (recomputed from its own records), the rotation protocol, demo check, report, and one-line errors
with exit code 2 for bad input."""
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from taps.cli.main import main

from helpers import tiny_drafter, tiny_target

WORDS = [f"w{i}" for i in range(50)] + ["user", "assistant", "system"]
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def save_tiny_target(path, ctx=1024, seed=0):
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = TEMPLATE
    model = tiny_target(seed, vocab=len(vocab), ctx=ctx)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model, tok = save_tiny_target(root / "target")
    V = model.config.vocab_size
    tiny_drafter(0, vocab=V).save_pretrained(root / "drafter", dtype=None)
    bad = tiny_drafter(0, vocab=V + 1)
    bad.save_pretrained(root / "bad_drafter", dtype=None)
    save_tiny_target(root / "short", ctx=16)
    (root / "no_weights").mkdir()
    model.config.save_pretrained(root / "no_weights")
    prompts = root / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2 w3 w4"}) + "\n" + json.dumps({"turns": ["w5 w6", "w7 w8 w9"]}) + "\n")
    return root


def run_cli(capsys, *argv):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def common(assets, drafter="drafter", target="target"):
    return ["--target", assets / target, "--drafter", assets / drafter, "--device", "cpu"]


def test_generate_json_equals_ar(assets, capsys):
    outs = {}
    # ddtree:2 drafts a 3-row block by default and the trained one with --no-short-blocks (the drafter's proposals
    # change, the output may not)
    for policy, extra in (("ar", ()), ("dflash", ()), ("ddtree:4", ()), ("ddtree:2", ()),
                          ("ddtree:2-trained-block", ("--no-short-blocks",))):
        rc, out, err = run_cli(capsys, "generate", "--policy", policy.split("-")[0], "--prompt", "w1 w2 w3",
                               "--json", "--max-new-tokens", 14, *extra, *common(assets))
        assert rc == 0, err
        rec = json.loads(out)
        assert {"token_ids", "text", "tau", "rounds"} <= set(rec)
        assert isinstance(rec["text"], str) and 1 <= len(rec["token_ids"]) <= 14
        outs[policy] = rec["token_ids"]
    assert all(ids == outs["ar"] for ids in outs.values())


def test_short_blocks_flag_reaches_the_drafter(assets, capsys, monkeypatch):
    """No flag: the library's default (short blocks on); --no-short-blocks / --short-blocks set it."""
    from taps.models import drafter as drafter_module

    seen, load = [], drafter_module.load_decoding_drafter

    def spy(*args, **kwargs):
        drafter = load(*args, **kwargs)
        seen.append(drafter.short_blocks)
        return drafter

    monkeypatch.setattr(drafter_module, "load_decoding_drafter", spy)
    for extra in ((), ("--no-short-blocks",), ("--short-blocks",)):
        rc, _, err = run_cli(capsys, "generate", "--policy", "ddtree:2", "--prompt", "w1 w2", "--json",
                             "--max-new-tokens", 4, *extra, *common(assets))
        assert rc == 0, err
    assert seen == [True, False, True]


def test_generate_sampled_is_seeded(assets, capsys):
    """Sampling: the same --seed gives the same tokens; across seeds the tokens vary; text decodes the ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "target")
    runs = {}
    for seed in (3, 3, 4, 5, 6):
        rc, out, err = run_cli(capsys, "generate", "--policy", "ddtree:4", "--prompt", "w1 w2", "--raw", "--json",
                               "--temperature", 0.9, "--top-p", 0.8, "--seed", seed, "--max-new-tokens", 8,
                               *common(assets))
        assert rc == 0, err
        rec = json.loads(out)
        assert rec["text"] == tok.decode(rec["token_ids"], skip_special_tokens=True)
        runs.setdefault(seed, []).append(rec["token_ids"])
    assert runs[3][0] == runs[3][1]
    assert len({tuple(r[0]) for r in runs.values()}) > 1


def per_token(recs):
    return sum(r["seconds"] for r in recs) / sum(r["new_tokens"] for r in recs)


def test_bench_summary_recomputed_from_records(assets, capsys, tmp_path):
    out_json = tmp_path / "s.json"
    rc, out, err = run_cli(capsys, "bench", "--prompts", assets / "p.jsonl", "--policies", "dflash,ddtree:4,ddtree:2",
                           "--max-new-tokens", 8, "--warmup", 0, "--hf-baseline", "--out", out_json,
                           "--scorer", tmp_path / "own_scorer", *common(assets))
    assert rc == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    # Protocol: per prompt AR first, then the other policies rotated by one, then HF.
    order = [r["policy"] for r in records]
    assert order == ["ar", "dflash", "ddtree:4", "ddtree:2", "hf", "ar", "ddtree:4", "ddtree:2", "dflash", "hf"]
    assert all(r["identical_to_ar"] for r in records)
    data = json.loads(out_json.read_text())
    assert data["config"]["scorer"].endswith("own_scorer")  # the record names the scorer asked for
    assert data["config"]["prefix_reuse"] is False  # the transformers target prefills every prompt whole
    (run,) = data["runs"]
    assert run["temperature"] == 0.0 and run["prompts"] == 2 and not run["partial"]
    summary = run["policies"]
    assert set(summary) == {"ar", "dflash", "ddtree:4", "ddtree:2", "hf"}
    by = {s: [r for r in records if r["policy"] == s] for s in summary}
    for spec, s in summary.items():
        recs = by[spec]
        assert s["identical_to_ar"] == 2 and s["new_tokens"] == sum(r["new_tokens"] for r in recs)
        assert s["speedup"] == pytest.approx(per_token(by["ar"]) / per_token(recs), rel=1e-9)
        if spec != "hf":
            rounds = sum(r["rounds"] for r in recs)
            assert s["rounds"] == rounds
            assert s["tau"] == pytest.approx(sum(r["tau"] * r["rounds"] for r in recs) / rounds, rel=1e-9)
            assert {"draft", "verify", "accept", "context"} <= set(s["time_split_s"])
    assert summary["ar"]["speedup"] == 1.0 and summary["ar"]["nodes_per_round"] == 1.0
    assert [p["prompt_tokens"] for p in summary["ar"]["per_prompt"]] == [sum(t["prompt_len"] for t in r["turns"])
                                                                          for r in by["ar"]]
    assert all(p["prefix_reused"] == 0 for p in summary["ar"]["per_prompt"])
    assert summary["ar"]["tau"] == 1.0 and summary["dflash"]["tau"] >= 1.0
    assert f"{1 / summary['hf']['speedup']:.3f}" in err  # the HF line prints the summary's own ratio


def test_demo_checks_outputs(assets, capsys):
    rc, out, err = run_cli(capsys, "demo", "--humaneval", 1, "--mtbench", 1, "--max-new-tokens", 6, *common(assets))
    assert rc == 0, err
    assert "OK: all" in out and "ddtree:16" in out


@pytest.mark.parametrize("argv,msg", [
    (["generate", "--policy", "ar", "--prompt", "   "], "--prompt: expected a non-empty prompt"),
    (["generate", "--policy", "nope", "--prompt", "w1"], "unknown policy 'nope'"),
    (["generate", "--policy", "ddtree:0", "--prompt", "w1"], "budget >= 1"),
    (["generate", "--policy", "ar", "--prompt", "w1", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "--policy", "ar", "--prompt", "w1", "--temperature", "-1"], "temperature"),
    (["bench", "--policies", "ar,bogus"], "unknown policy 'bogus'"),
    (["bench", "--prompts", "/nonexistent/p.jsonl"], "no such file"),
])
def test_bad_input(assets, capsys, argv, msg):
    rc, out, err = run_cli(capsys, *argv, *common(assets))
    assert rc == 2 and msg in err and "Traceback" not in err


@pytest.mark.parametrize("target,drafter,policy,msg", [
    ("missing_dir", "drafter", "ar", "--target"),
    ("no_weights", "drafter", "ar", "missing: weights"),
    ("target", "missing_drafter", "dflash", "no such directory"),
    ("target", "bad_drafter", "ddtree:4", "does not fit"),
    ("short", "drafter", "ar", "do not fit the target's context of 16"),
])
def test_bad_models(assets, capsys, target, drafter, policy, msg):
    prompt = " ".join(f"w{i % 50}" for i in range(40))
    rc, out, err = run_cli(capsys, "generate", "--policy", policy, "--prompt", prompt,
                           *common(assets, drafter=drafter, target=target))
    assert rc == 2 and msg in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_stop_tokens_include_template_end(assets):
    from transformers import AutoTokenizer

    from taps.data import encode_prompt, stop_token_ids

    tok = AutoTokenizer.from_pretrained(assets / "target")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tok) == [end]
    ids = encode_prompt(tok, "w1 w2", history=[{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}])
    toks = tok.convert_ids_to_tokens(ids)
    assert toks == ["<|im_start|>", "user", "w3", "<|im_end|>", "<|im_start|>", "assistant", "w4", "<|im_end|>",
                    "<|im_start|>", "user", "w1", "w2", "<|im_end|>", "<|im_start|>", "assistant"]
    assert encode_prompt(tok, "w1 w2", raw=True) == tok("w1 w2", add_special_tokens=False)["input_ids"]


def test_bench_suite_alias_and_report(assets, capsys, tmp_path):
    from taps.bench.run_report import write_report

    out_json = tmp_path / "suite.json"
    rc, out, err = run_cli(capsys, "bench-suite", "--datasets", "humaneval", "--limit", 2, "--budgets", "2,4",
                           "--policies", "ddtree:3", "--t1-policies", "dflash,ddtree-best", "--t1-limit", 1,
                           "--hf-baseline", "--max-new-tokens", 6, "--warmup", 0, "--out", out_json, *common(assets))
    assert rc == 0, err
    assert "deprecated, use `taps bench`" in err
    data = json.loads(out_json.read_text())
    greedy, sampled = data["runs"]
    assert greedy["temperature"] == 0.0 and not greedy["partial"] and greedy["prompts"] == 2
    assert set(greedy["policies"]) == {"ar", "dflash", "ddtree:2", "ddtree:4", "ddtree:3", "hf"}
    assert all(s["identical_to_ar"] == 2 for s in greedy["policies"].values())
    fastest = max((k for k in greedy["policies"] if k.startswith("ddtree:")),
                  key=lambda k: greedy["policies"][k]["tokens_per_s_median"])
    assert greedy["best_ddtree"] == fastest
    assert set(sampled["policies"]) == {"ar", "dflash", fastest} and sampled["temperature"] == 1.0
    assert sampled["prompts"] == 1 and all(s["identical_to_ar"] == 0 for s in sampled["policies"].values())
    cmd = data["config"]["command"]
    assert cmd.startswith("taps bench-suite --datasets humaneval") and str(tmp_path) not in cmd  # portable paths
    write_report(str(out_json), tmp_path / "r.md", plot_prefix=str(tmp_path / "p"))
    text = (tmp_path / "r.md").read_text()
    assert "AR policy speed / HF generate speed" in text and "HF generate included | - | - | yes |" in text
    assert str(tmp_path) not in text.split("Commands:")[0]


def test_bench_and_alias_accept_each_others_flags(assets, capsys, tmp_path):
    """`taps bench` takes the suite's flags (--datasets, --budgets, --turns, --t1-*) and the report reads it."""
    from taps.bench.run_report import write_report

    out_json = tmp_path / "b.json"
    rc, out, err = run_cli(capsys, "bench", "--datasets", "humaneval", "--limit", 1, "--budgets", "3",
                           "--policies", "dflash", "--t1-policies", "", "--turns", 1, "--max-new-tokens", 5,
                           "--warmup", 0, "--out", out_json, *common(assets))
    assert rc == 0, err and "deprecated" not in err
    (run,) = json.loads(out_json.read_text())["runs"]
    assert list(run["policies"]) == ["ar", "ddtree:3", "dflash"] and run["dataset"] == "humaneval"
    paths = write_report(str(out_json), tmp_path / "b.md", plot_prefix="")
    assert "## humaneval, temperature 0, 1 prompts" in paths[0].read_text()


def test_trace_config_rejects_unknown_options():
    from taps.scoring.traces import TraceConfig

    with pytest.raises(TypeError, match="unknown option.*pool_sise"):
        TraceConfig.from_options(pool_sise=8)
    with pytest.raises(ValueError, match="TraceConfig.top_k"):
        TraceConfig(top_k=0)
    assert TraceConfig.from_options(pool_size=8).pool_size == 8


@pytest.fixture(scope="module")
def batch_prompts(assets):
    """Seven requests of ragged lengths (one with two turns): more than the largest batch, so rows are refilled."""
    p = assets / "batch.jsonl"
    lines = [{"prompt": " ".join(f"w{(7 * i + j) % 50}" for j in range(2 + 5 * i))} for i in range(6)]
    lines.insert(2, {"turns": ["w5 w6", "w7 w8 w9"]})
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def test_bench_batch_sizes_rows_recomputed_from_records(assets, batch_prompts, capsys, tmp_path):
    """--batch-sizes 1,2,3: a row per (policy, B) whose totals, tau, tokens/s and speedup are recomputed from the
    records, and every request's tokens equal its B = 1 AR tokens."""
    import statistics

    from taps.bench.sweep_report import batch_tables, crossover

    out_json = tmp_path / "batch.json"
    policies = ("ar", "dflash", "ddtree:3")
    rc, out, err = run_cli(capsys, "bench", "--prompts", batch_prompts, "--policies", "dflash,ddtree:3",
                           "--batch-sizes", "3,1,2", "--max-new-tokens", 9, "--warmup", 0, "--quiet",
                           "--out", out_json, *common(assets))
    assert rc == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    data = json.loads(out_json.read_text())
    assert data["config"]["batch_sizes"] == [1, 2, 3]
    (run,) = data["runs"]  # B = 1 keeps the single-request protocol: rotation per prompt
    assert [r["policy"] for r in records if r["batch_size"] == 1][:6] == ["ar", "dflash", "ddtree:3",
                                                                          "ar", "ddtree:3", "dflash"]
    (sweep,) = data["batch"]
    rows = sweep["rows"]
    assert not sweep["partial"] and sweep["prompts"] == 7
    assert [(r["batch_size"], r["policy"]) for r in rows] == [(b, p) for b in (1, 2, 3) for p in policies]
    ar1 = {r["id"]: [t["token_ids"] for t in r["turns"]] for r in records if r["policy"] == "ar" and r["batch_size"] == 1}
    assert len(ar1) == 7
    total = {}
    for row in rows:
        B = row["batch_size"]
        recs = [r for r in records if r["policy"] == row["policy"] and r["batch_size"] == B]
        assert len(recs) == row["requests"] == 7
        assert all([t["token_ids"] for t in r["turns"]] == ar1[r["id"]] for r in recs)
        assert row["identical_to_ar"] == 7
        assert row["new_tokens"] == sum(r["new_tokens"] for r in recs) == sum(
            len(t["token_ids"]) for r in recs for t in r["turns"])
        if B == 1:
            wall = sum(r["seconds"] for r in recs)
        else:
            wall = recs[0]["batch_wall_s"]
            assert all(r["batch_wall_s"] == wall for r in recs) and wall >= max(r["seconds"] for r in recs)
        assert row["wall_s"] == pytest.approx(wall, rel=1e-9)
        total[row["policy"], B] = row["new_tokens"] / wall
        assert row["total_tokens_per_s"] == pytest.approx(total[row["policy"], B], rel=1e-9)
        prefill = sum(r["time_split"]["prefill"] for r in recs)
        assert 0 < prefill < wall and row["prefill_s"] == pytest.approx(prefill, rel=1e-9)
        assert row["decode_tokens_per_s"] == pytest.approx(row["new_tokens"] / (wall - prefill), rel=1e-9)
        assert row["per_request_tokens_per_s_median"] == pytest.approx(
            statistics.median(r["new_tokens"] / r["seconds"] for r in recs), rel=1e-9)
        rounds = sum(r["rounds"] for r in recs)
        assert row["tau"] == pytest.approx(sum(r["tau"] * r["rounds"] for r in recs) / rounds, rel=1e-9)
    for row in rows:
        assert row["speedup"] == pytest.approx(total[row["policy"], row["batch_size"]] / total["ar", row["batch_size"]],
                                               rel=1e-9)
    assert all(r["tau"] == 1.0 and r["nodes_per_round"] == 1.0 for r in rows if r["policy"] == "ar")
    assert all(r["stage_ms_per_round"]["verify"] > 0 for r in rows)
    assert all(r["stage_ms_per_round"]["draft"] > 0 for r in rows if r["policy"] == "dflash")
    # the B = 1 row is the single-request run's own summary
    assert rows[1]["speedup"] == pytest.approx(run["policies"]["dflash"]["speedup"], rel=1e-9)
    # report: one line per B in each table, the crossover consistent with the speedups
    text = "\n".join(batch_tables(sweep))
    for b in (1, 2, 3):
        assert text.count(f"\n| {b} | ") == 6  # tok/s, decode tok/s, speedup, per request, nodes, stage times
    for p in ("dflash", "ddtree:3"):
        sp = {r["batch_size"]: r["speedup"] for r in rows if r["policy"] == p}
        c = crossover(rows, p)
        assert (c is None) == (sp[3] >= 1.0)
        if c is not None:
            assert all(sp[b] < 1.0 for b in sp if b >= c) and (c == 1 or sp[max(b for b in sp if b < c)] >= 1.0)


def test_bench_batch_size_alone_and_report(assets, batch_prompts, capsys, tmp_path):
    """--batch-size 2 without B = 1: AR at B = 2 is the reference; `taps report` renders the batch table; the
    flags refuse bad values with one line."""
    out_json = tmp_path / "b2.json"
    rc, out, err = run_cli(capsys, "bench", "--prompts", batch_prompts, "--limit", 3, "--policies", "ddtree:2",
                           "--batch-size", 2, "--max-new-tokens", 5, "--warmup", 0, "--out", out_json, *common(assets))
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    assert data["runs"] == [] and [(r["batch_size"], r["policy"]) for r in data["batch"][0]["rows"]] == [
        (2, "ar"), (2, "ddtree:2")]
    assert all(r["identical_to_ar"] == 3 for r in data["batch"][0]["rows"])
    rc, out, err = run_cli(capsys, "report", out_json, "--out-md", tmp_path / "b2.md", "--plots", "")
    assert rc == 0, err
    text = (tmp_path / "b2.md").read_text()
    assert "## Batch sweep: jsonl:" in text and "| B | ar | ddtree:2 |" in text and "\n| 2 | " in text
    for argv, msg in ((["--batch-size", 2, "--batch-sizes", "1,2"], "give one of them"),
                      (["--batch-sizes", "1,x"], "--batch-sizes: expected"), (["--batch-sizes", "0,2"], ">= 1")):
        rc, out, err = run_cli(capsys, "bench", "--prompts", batch_prompts, *argv, *common(assets))
        assert rc == 2 and msg in err and "Traceback" not in err, err


def test_progress_plain_line_without_tqdm(monkeypatch):
    """Without tqdm the progress is one self-overwriting stderr line; log lines stay whole; --quiet: no bar."""
    import io
    import sys

    from taps.bench.progress import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails as if not installed
    s = io.StringIO()
    bar = Progress(5, "he B=2 ar", "tok", enabled=True, stream=s)
    bar.update(2)
    bar.write("a log line")
    bar.close()
    text = s.getvalue()
    assert "\rhe B=2 ar: 2/5 tok" in text and "a log line\n" in text
    s = io.StringIO()
    quiet = Progress(5, "he", enabled=False, stream=s)
    quiet.update(3)
    quiet.write("only this")
    quiet.close()
    assert s.getvalue() == "only this\n"


def test_report_says_what_prefix_reuse_skipped():
    from taps.bench.run_report import prefix_reuse_note

    runs = [{"policies": {"ar": {"per_prompt": [{"prompt_tokens": 1000, "prefix_reused": 400}]},
                          "taps": {"per_prompt": [{"prompt_tokens": 1000, "prefix_reused": 9}]}}},
            {"policies": {"ar": {"per_prompt": [{"prompt_tokens": 500, "prefix_reused": 0}]}}}]
    assert prefix_reuse_note({"prefix_reuse": True}, runs).startswith(
        "Prefix reuse: on: 400 of AR's 1,500 prompt tokens ran on cache rows an earlier prompt left")
    assert prefix_reuse_note({}, runs) == "Prefix reuse: off (every prompt prefilled whole)."
