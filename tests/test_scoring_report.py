"""taps report: the "must show" checks and the markdown/plots from a synthetic bench-suite JSON."""
import json

import pytest

from taps.bench.run_report import _drafted, check_targets, coverage, merge_bench, projected_tps, write_report
from taps.bench.summary import decode_speedup, format_table, summarize


def pol(tau, nodes, tps, same=2, prompts=2):
    return {"tau": tau, "nodes_per_round": nodes, "tokens_per_s_median": tps, "speedup": tps / 10, "rounds": 10,
            "identical_to_ar": same, "prompts": prompts, "time_split_frac": {"verify": 0.5},
            "selection_overhead_ms_per_round": 1.0, "accept_len_hist": {"1": 3, "2": 7}}


def run(temp=0.0, same=2):
    p = {"ar": pol(1, 1, 10), "dflash": pol(3, 16, 20), "ddtree:8": pol(3.0, 9, 24), "ddtree:16": pol(3.2, 17, 22),
         "taps-fixed:8": pol(3.3, 9, 25), "taps": pol(3.4, 6, 30, same=same)}
    return {"dataset": "humaneval", "temperature": temp, "prompts": 2, "policies": p, "best_ddtree": "ddtree:8"}


def test_check_targets_values():
    checks = {c["name"]: c for c in check_targets(run())}
    c = next(v for k, v in checks.items() if k.startswith("TAPS tau / DDTree tau at 8"))
    assert c["value"] == pytest.approx(1.1) and c["met"]
    c = checks["TAPS / DFlash, median tok/s"]
    assert c["value"] == pytest.approx(1.5) and c["met"]
    c = checks["TAPS / best fixed-budget DDTree (ddtree:8), median tok/s"]
    assert c["value"] == pytest.approx(1.25) and c["met"]
    assert checks["TAPS / best fixed-budget DDTree (ddtree:8), aggregate tok/s"]["value"] == pytest.approx(1.25)
    # the aggregate statistic is checked on its own: a fast median does not hide a slow total
    r = run()
    r["policies"]["taps"]["speedup"] = 2.6
    agg = {c["name"]: c for c in check_targets(r)}["TAPS / best fixed-budget DDTree (ddtree:8), aggregate tok/s"]
    assert agg["value"] == pytest.approx(2.6 / 2.4) and not agg["met"]
    assert checks["TAPS / AR, median tok/s"]["value"] == pytest.approx(3.0) and checks["TAPS / AR, median tok/s"]["met"]
    assert checks["TAPS / AR, aggregate tok/s"]["target"] == 1.4  # humaneval's; mtbench asks 1.15
    assert "TAPS draft ms per drafted round (one thread)" not in checks  # no time split in this run
    r = run()
    r["policies"]["taps"].update(stage_ms_per_round={"draft": 4.5}, drafted_frac=0.5)
    c = {c["name"]: c for c in check_targets(r)}["TAPS draft ms per drafted round (one thread)"]
    assert c["value"] == pytest.approx(9.0) and c["cmp"] == "<=" and not c["met"]
    assert checks["lossless: every output identical to AR (temperature 0)"]["met"]
    bad = {c["name"]: c for c in check_targets(run(same=1))}
    assert not bad["lossless: every output identical to AR (temperature 0)"]["met"]


def test_check_targets_for_taps_with_prompt_lookup():
    r = run()
    r["policies"]["taps-lookup"] = pol(4.0, 7, 36)
    r["policies"]["lookup"] = pol(2.0, 5, 18)
    checks = {c["name"]: c for c in check_targets(r)}
    c = checks["TAPS with prompt lookup (taps-lookup) / best fixed-budget DDTree (ddtree:8), median tok/s"]
    assert c["value"] == pytest.approx(1.5) and c["met"]
    assert checks["TAPS with prompt lookup (taps-lookup) / AR, aggregate tok/s"]["value"] == pytest.approx(3.6)
    assert not any("decode-only" in k for k in checks)  # no decode-only figures in this run: no check
    r["policies"]["ar"]["decode_tokens_per_s"], r["policies"]["taps-lookup"]["decode_tokens_per_s"] = 150.0, 195.0
    c = {c["name"]: c for c in check_targets(r)}["TAPS with prompt lookup (taps-lookup) / AR, decode-only tok/s"]
    assert c["value"] == pytest.approx(1.3) and c["target"] == 1.4 and not c["met"]
    assert checks["TAPS / AR, median tok/s"]["value"] == pytest.approx(3.0)  # plain TAPS still checked on its own
    assert not any(k.startswith("lookup") for k in checks)  # the no-drafter baseline has no targets


def test_check_targets_hf_baseline():
    r = run()
    r["policies"]["hf"] = pol(None, None, 8)  # speedup 0.8: AR's time per token is 0.8x HF's
    checks = {c["name"]: c for c in check_targets(r)}
    c = checks["AR policy speed / HF generate speed (time per token, same prompts)"]
    assert c["value"] == pytest.approx(1.25) and c["met"]
    assert checks["lossless: every output identical to AR (temperature 0), HF generate included"]["met"]
    r["policies"]["hf"] = pol(None, None, 12, same=1)
    checks = {c["name"]: c for c in check_targets(r)}
    assert not checks["AR policy speed / HF generate speed (time per token, same prompts)"]["met"]
    assert not checks["lossless: every output identical to AR (temperature 0), HF generate included"]["met"]


def test_projection_interpolates_the_table():
    table = {"latency": [0.01, 0.02, 0.03], "t0": 0.01}
    assert projected_tps({"tau": 2.0, "nodes_per_round": 2.5}, table) == pytest.approx(2.0 / (0.01 + 0.025))


def test_write_report(tmp_path):
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"config": {"command": "taps bench-suite", "note": "SUBSET"}, "runs": [run(), run(1.0)]}))
    paths = write_report(str(b), tmp_path / "r.md", plot_prefix=str(tmp_path / "p"))
    text = (tmp_path / "r.md").read_text()
    assert "humaneval: SUBSET, 2 of 164 prompts" in text
    assert "ddtree:8 (oracle best DDTree)" in text and "n/a (sampled)" in text
    assert len(paths) == 4 and all(p.exists() for p in paths)


def test_coverage_labels_full_sets():
    full = dict(run(), prompts=164)
    assert coverage([full, run(1.0)]) == "humaneval: FULL SET, 164 of 164 prompts"
    assert coverage([dict(run(), dataset="mtbench", prompts=80)]) == "mtbench: FULL SET, 80 of 80 prompts"


def test_merged_report_takes_mtbench_turns_from_the_mtbench_file(tmp_path):
    he, mt = tmp_path / "he.json", tmp_path / "mt.json"
    he.write_text(json.dumps({"config": {"command": "a", "datasets": ["humaneval"], "mtbench_turns": 2},
                              "runs": [run()]}))
    mt.write_text(json.dumps({"config": {"command": "b", "datasets": ["mtbench"], "mtbench_turns": 1},
                              "runs": [dict(run(), dataset="mtbench")]}))
    merged = merge_bench([he, mt])
    assert merged["config"]["mtbench_turns"] == 1 and merged["config"]["command"] == "a\nb"
    assert [r["dataset"] for r in merged["runs"]] == ["humaneval", "mtbench"]


def test_merged_report_names_the_run_of_a_set_run_twice(tmp_path):
    """A baseline-only run of the same set (e.g. the prompt-lookup row) gets its own, labelled section."""
    main, extra = tmp_path / "main.json", tmp_path / "extra.json"
    main.write_text(json.dumps({"config": {"command": "a"}, "runs": [run()]}))
    baseline = {"ar": pol(1, 1, 10), "hf-pld:10": pol(1, 1, 12)}
    extra.write_text(json.dumps({"config": {"command": "b"},
                                 "runs": [dict(run(), policies=baseline, best_ddtree=None)]}))
    runs = merge_bench([main, extra])["runs"]
    assert [r["source"] for r in runs] == [0, 1]
    assert [_drafted(r) for r in runs] == [True, False]  # only the first is plotted
    plots = write_report([str(main), str(extra)], tmp_path / "r.md", plot_prefix=str(tmp_path / "p"))[1:]
    assert len(plots) == 3 and all(p.exists() for p in plots)
    text = (tmp_path / "r.md").read_text()
    assert text.count("humaneval: SUBSET, 2 of 164 prompts") == 1
    assert "## humaneval, temperature 0, 2 prompts (command 1 above)" in text
    assert "## humaneval, temperature 0, 2 prompts (command 2 above)" in text
    assert "| hf-pld:10 |" in text


def test_report_shows_the_llamacpp_peer_rows(tmp_path):
    r = run()
    r["policies"]["ar"]["decode_tokens_per_s"] = 150.0
    peers = {"humaneval": [{"name": "llamacpp-decode (llama-bench)", "tok_s": 75.0, "prompt_tok_s": None,
                            "llamacpp_commit": "0c1e570", "cpu": "CPU X"}]}
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"config": {"command": "taps bench"}, "runs": [r], "peers": peers}))
    write_report(str(b), tmp_path / "r.md", plot_prefix="")
    text = (tmp_path / "r.md").read_text()
    assert "| humaneval | llamacpp-decode (llama-bench) (llama.cpp 0c1e570, CPU X) | 75.00 | - | 2.00x |" in text
    assert "| humaneval | ours: ar | 150.00 | - | - |" in text


def test_decode_only_speedup_leaves_the_prefills_out():
    def rec(seconds, prefill, tokens, turns=1):
        return {"new_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "turns": [{}] * turns, "time_split": {"prefill": prefill, "verify": seconds - prefill}}

    # AR: 2 prompts, 0.4 s of prefill, 1.0 s for 48 decoded tokens (50 new, the prefills gave 2)
    # policy: the same prefills, 0.5 s for the same 48 decoded tokens: 2x decode-only, 1.4 / 0.9 overall
    s = summarize({"ar": [rec(0.7, 0.2, 25), rec(0.7, 0.2, 25)], "taps-lookup": [rec(0.45, 0.2, 25)] * 2})
    assert decode_speedup(s, "ar") == pytest.approx(1.0)
    assert decode_speedup(s, "taps-lookup") == pytest.approx(2.0)
    assert s["taps-lookup"]["speedup"] == pytest.approx(1.4 / 0.9)
    assert s["taps-lookup"]["decode_tokens_per_s"] == pytest.approx(48 / 0.5)
    table = format_table(s).splitlines()
    assert table[0].split()[7] == "decode" and table[3].split()[5] == "2.00x"
    # a record without a prefill time (a baseline timed as a whole) has no decode-only figures
    s = summarize({"ar": [rec(0.7, 0.2, 25)], "hf": [{"new_tokens": 25, "seconds": 0.5, "tokens_per_s": 50.0}]})
    assert decode_speedup(s, "hf") is None and format_table(s).splitlines()[3].split()[5] == "-"
