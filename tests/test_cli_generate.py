"""``taps generate`` flags (batched JSONL prompts, backend, attention, verbose) and ``taps policies``, on the
tiny saved models of test_cli."""
import json

import pytest

from test_cli import assets, common, run_cli  # noqa: F401  (module fixture: tiny target/drafter on disk)


def test_prompts_batched_print_one_line_per_prompt_in_order(assets, capsys, tmp_path):  # noqa: F811
    prompts = tmp_path / "q.jsonl"
    texts = ["w1 w2 w3 w4", "w5", "w6 w7 w8 w9 w10 w11 w12", "w13 w14"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    single = []
    for t in texts:
        rc, out, err = run_cli(capsys, "generate", "--policy", "ddtree:4", "--prompt", t, "--json",
                               "--max-new-tokens", 10, *common(assets))
        assert rc == 0, err
        single.append(json.loads(out)["token_ids"])
    for attention in ("taps_tree", "sdpa"):
        rc, out, err = run_cli(capsys, "generate", "--policy", "ddtree:4", "--prompts", prompts, "--batch-size", 3,
                               "--attention", attention, "--max-new-tokens", 10, *common(assets))
        assert rc == 0, err
        recs = [json.loads(line) for line in out.strip().splitlines()]
        assert len(recs) == len(texts)
        assert [r["token_ids"] for r in recs] == single
        assert all({"token_ids", "text", "tau", "rounds"} <= set(r) for r in recs)
        assert all(r["prefix_reused"] == 0 for r in recs)  # the transformers target prefills every prompt whole


def test_backend_and_verbose(assets, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TAPS_BACKEND", "")  # restored after the test: the CLI sets it for its run
    rc, out, err = run_cli(capsys, "generate", "--policy", "ar", "--prompt", "w1 w2", "--json", "--verbose",
                           "--backend", "reference", "--max-new-tokens", 4, *common(assets))
    assert rc == 0, err
    assert "tree_attention" in err and "TAPS_BACKEND=reference" in err and "verify attention" in err
    rc, out, err = run_cli(capsys, "generate", "--policy", "ar", "--prompt", "w1", "--backend", "cuda",
                           *common(assets))
    assert rc == 2 and "--backend cuda" in err


def test_defaults_and_errors(capsys):
    from taps.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.policy == "taps-lookup" and args.backend == "auto" and args.attention == "auto" and args.batch_size == 1
    rc, out, err = run_cli(capsys, "generate", "--prompt", "x", "--batch-size", 2)
    assert rc == 2 and "--batch-size" in err
    rc, out, err = run_cli(capsys, "generate", "--prompt", "x", "--attention", "flash")
    assert rc == 2


def test_policies_lists_every_policy(capsys):
    from taps.decode.policies import available_policies

    rc, out, err = run_cli(capsys, "policies")
    assert rc == 0
    lines = out.strip().splitlines()
    assert len(lines) == len(available_policies())
    assert any(line.startswith("ddtree[:B] ") and "default 8" in line for line in lines)
    assert any(line.startswith("taps-fixed:N ") for line in lines)
    assert any(line.startswith("ar ") for line in lines)


def test_calibrate_batch_sizes(assets, capsys, tmp_path):  # noqa: F811
    out = tmp_path / "lat.json"
    rc, _, err = run_cli(capsys, "calibrate", "--n-max", 2, "--prefix-len", 8, "--repeats", 1, "--batch-sizes", "2,3",
                         "--out", out, *common(assets))
    assert rc == 0, err
    table = json.loads(out.read_text())
    assert len(table["latency"]) == 3
    for rows in (2, 3):
        lat = table["batch_latency"][str(rows)]
        assert len(lat) == rows * 2 + 1 and all(b >= a for a, b in zip(lat, lat[1:])) and lat[0] > 0
