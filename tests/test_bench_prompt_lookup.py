"""``taps bench --hf-prompt-lookup N``: HF prompt-lookup decoding as a baseline row ``hf-pld:N`` on the tiny
saved models of test_cli: its tokens equal our AR's (greedy: lossless), it drafts for real, its summary row and
speedup are recomputed from its records, it runs with or without --hf-baseline and stays out of the batch
table, and N < 1 is refused with one line."""
import json

import pytest

from test_cli import assets, common, run_cli  # noqa: F401  (module fixture: tiny target/drafter on disk)

# Repeated n-grams give prompt lookup something to match; the multi-turn item checks the turn history.
PROMPTS = [{"prompt": "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"}, {"prompt": "w9 w8 w7"},
           {"turns": ["w5 w6 w5 w6 w5", "w7 w8 w9 w7 w8"]}]


@pytest.fixture(scope="module")
def pld_prompts(assets):  # noqa: F811
    p = assets / "pld.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    return p


def per_token(recs):
    return sum(r["seconds"] for r in recs) / sum(r["new_tokens"] for r in recs)


def test_pld_row_equals_ar_with_hf_baseline_and_report(assets, pld_prompts, capsys, tmp_path):  # noqa: F811
    from taps.bench.run_report import write_report

    out_json = tmp_path / "pld.json"
    rc, out, err = run_cli(capsys, "bench", "--prompts", pld_prompts, "--policies", "ar", "--hf-baseline",
                           "--hf-prompt-lookup", 3, "--max-new-tokens", 16, "--warmup", 1, "--quiet",
                           "--out", out_json, *common(assets))
    assert rc == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["policy"] for r in records] == ["ar", "hf", "hf-pld:3"] * len(PROMPTS)
    ar = {r["id"]: [t["token_ids"] for t in r["turns"]] for r in records if r["policy"] == "ar"}
    pld = [r for r in records if r["policy"] == "hf-pld:3"]
    assert [len(r["turns"]) for r in pld] == [1, 1, 2]
    for r in pld:
        assert [t["token_ids"] for t in r["turns"]] == ar[r["id"]] and r["identical_to_ar"] is True
    data = json.loads(out_json.read_text())
    assert data["config"]["hf_prompt_lookup"] == 3 and data["config"]["hf_baseline"] is True
    (run,) = data["runs"]
    summary = run["policies"]
    assert list(summary) == ["ar", "hf", "hf-pld:3"] and not run["partial"]
    s = summary["hf-pld:3"]
    assert s["prompts"] == len(PROMPTS) and s["identical_to_ar"] == len(PROMPTS)
    assert s["new_tokens"] == sum(r["new_tokens"] for r in pld) == sum(len(t) for v in ar.values() for t in v)
    ar_recs = [r for r in records if r["policy"] == "ar"]
    assert s["speedup"] == pytest.approx(per_token(ar_recs) / per_token(pld), rel=1e-9)
    assert s["tau"] is None and s["rounds"] == 0
    assert "HF prompt lookup (hf-pld:3)" in err and f"{s['speedup']:.3f}x" in err
    text = write_report(str(out_json), tmp_path / "r.md", plot_prefix="")[0].read_text()
    assert f"| hf-pld:3 | - | - | - | {s['tokens_per_s_median']:.2f} | {s['speedup']:.2f}x |" in text
    assert "HF generate included | - | - | yes |" in text


def test_pld_drafts_and_stays_lossless_in_process(assets):  # noqa: F811
    """Called directly: hf_generate_item with prompt lookup gives HF greedy's tokens in fewer target forwards
    (so the lookup path really ran), and run_suite's hf-pld row alone matches AR."""
    from taps.bench.suite import build_decoders, hf_generate_item, run_suite
    from taps.data import PromptItem, stop_token_ids
    from taps.decode import SamplingConfig
    from taps.models.target import load_target

    model, tok = load_target(str(assets / "target"), linear_kernel="torch")
    stops = stop_token_ids(tok, model)
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    saved = []
    try:
        for p in PROMPTS[:1]:
            item = PromptItem("p", "t", [p["prompt"]])
            plain = hf_generate_item(model, tok, item, 24, stops, ["x"])
            n_plain = len(calls)
            lookup = hf_generate_item(model, tok, item, 24, stops, ["x"], prompt_lookup_num_tokens=4)
            saved.append(len(calls) - n_plain)
            assert lookup["turns"][0]["token_ids"] == plain["turns"][0]["token_ids"]
            assert n_plain == len(plain["turns"][0]["token_ids"])  # one forward per token without lookup
    finally:
        hook.remove()
    assert saved[0] < len(plain["turns"][0]["token_ids"])  # accepted drafts: fewer forwards than tokens
    items = [PromptItem(f"p{i}", "t", p["turns"] if "turns" in p else [p["prompt"]]) for i, p in enumerate(PROMPTS)]
    res = run_suite(model, tok, build_decoders(model, tok, None, ["ar"], SamplingConfig()), items, 12, warmup=0,
                    hf_prompt_lookup=5)
    assert set(res) == {"ar", "hf-pld:5"}
    for a, h in zip(res["ar"], res["hf-pld:5"]):
        assert [t["token_ids"] for t in h["turns"]] == [t["token_ids"] for t in a["turns"]] and h["identical_to_ar"]


def test_pld_alone_and_in_batch_mode(assets, pld_prompts, capsys, tmp_path):  # noqa: F811
    """Without --hf-baseline; with --batch-sizes 1,2 the row stays in the B = 1 run, out of the batch rows;
    without B = 1 it is skipped with a note."""
    out_json = tmp_path / "b.json"
    rc, out, err = run_cli(capsys, "bench", "--prompts", pld_prompts, "--limit", 2, "--policies", "ar",
                           "--hf-prompt-lookup", 2, "--batch-sizes", "1,2", "--max-new-tokens", 6, "--warmup", 0,
                           "--quiet", "--out", out_json, *common(assets))
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    (run,) = data["runs"]
    assert list(run["policies"]) == ["ar", "hf-pld:2"] and run["policies"]["hf-pld:2"]["identical_to_ar"] == 2
    assert [(r["batch_size"], r["policy"]) for r in data["batch"][0]["rows"]] == [(1, "ar"), (2, "ar")]
    rc, out, err = run_cli(capsys, "bench", "--prompts", pld_prompts, "--limit", 1, "--policies", "ar",
                           "--hf-prompt-lookup", 2, "--batch-size", 2, "--max-new-tokens", 4, "--warmup", 0,
                           "--quiet", "--out", out_json, *common(assets))
    assert rc == 0, err
    assert "single-request baselines" in err
    assert not any(r["policy"].startswith("hf") for r in map(json.loads, out.splitlines()))


@pytest.mark.parametrize("value", ["0", "-3"])
def test_pld_below_one_is_refused(assets, pld_prompts, capsys, value):  # noqa: F811
    rc, out, err = run_cli(capsys, "bench", "--prompts", pld_prompts, "--policies", "ar", "--hf-prompt-lookup", value,
                           *common(assets))
    assert rc == 2 and "--hf-prompt-lookup" in err and f"expected an integer >= 1, received {value}" in err
    assert out == "" and "Traceback" not in err


def test_pld_below_one_is_refused_in_process():
    from taps.bench.suite import hf_generate_item, run_suite

    with pytest.raises(ValueError, match=r"hf_prompt_lookup: expected an integer >= 1 \(or None\), received 0"):
        run_suite(None, None, {}, [], 4, hf_prompt_lookup=0)
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens: expected an integer >= 1.*received -1"):
        hf_generate_item(None, None, None, 4, [], [], prompt_lookup_num_tokens=-1)
