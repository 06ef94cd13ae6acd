"""bench/drafter_study.py on a synthetic study: curve points take the blocks seen at their saved step from the
training log, the final evaluation closes the curve, and the per-doubling fit is the least-squares slope."""
import json

import numpy as np
import pytest

from helpers import load_bench_script


def _eval(code, chat):
    return {"tau": (code + chat) / 2, "blocks": 64, "pos_acc": [0.5],
            "family_tau": {"code": {"tau": code, "blocks": 32}, "chat": {"tau": chat, "blocks": 32}}}


@pytest.fixture
def study(tmp_path):
    work, evals = tmp_path / "run", tmp_path / "evals"
    work.mkdir()
    evals.mkdir()
    (work / "train_config.json").write_text(json.dumps({
        "params": 123, "init_from": "parent", "init_layers": "0,1,1",
        "drafter_config": {"num_hidden_layers": 3, "block_size": 8}}))
    (work / "train_summary.json").write_text(json.dumps(
        {"step": 600, "train_seconds": 60.0, "blocks_seen": 7000, "rows_seen": 9}))
    (work / "train_log.jsonl").write_text("resumed\n" + "\n".join(
        json.dumps({"step": s, "blocks_seen": 10 * s + (s > 250) * 500}) for s in (100, 200, 300, 400, 500, 600)))
    (evals / "run@200.json").write_text(json.dumps(_eval(1.5, 1.2)))
    (evals / "run@400.json").write_text(json.dumps(_eval(1.6, 1.3)))
    (evals / "run_fp32.json").write_text(json.dumps(_eval(1.8, 1.35)))
    (evals / "base.json").write_text(json.dumps(_eval(1.4, 1.1)))
    out = tmp_path / "study.json"
    load_bench_script("drafter_study").main(["--run", f"run={work}", "--evals", str(evals),
                                             "--baseline", f"start={evals / 'base.json'}", "--out", str(out)])
    return json.loads(out.read_text()), out


def test_curve_reads_blocks_at_the_saved_step_and_ends_at_the_final_drafter(study):
    data, out = study
    run = data["runs"]["run"]
    assert [(p["step"], p["blocks_seen"]) for p in run["curve"]] == [(200, 2000), (400, 4500), (600, 7000)]
    assert [p["code"] for p in run["curve"]] == [1.5, 1.6, 1.8]
    assert run["layers"] == 3 and run["block_size"] == 8 and run["init_layers"] == "0,1,1"
    assert data["baseline"]["start"]["chat"] == 1.1
    x = np.log2([2000, 4500, 7000])
    for kind, ys in (("code", [1.5, 1.6, 1.8]), ("chat", [1.2, 1.3, 1.35])):
        assert run["fit_per_doubling_of_blocks"][kind] == round(np.polyfit(x, ys, 1)[0], 4)
    assert out.with_suffix(".png").stat().st_size > 0


def test_blocks_between_log_records_are_interpolated():
    log = [{"step": 10, "blocks_seen": 100}, {"step": 20, "blocks_seen": 300}]
    blocks_at_step = load_bench_script("drafter_study").blocks_at_step
    assert blocks_at_step(log, 15) == 200
    assert blocks_at_step(log, 20) == 300
    assert blocks_at_step(log, 5) == 50  # before the first record: the same rate from step 0
    assert blocks_at_step(log, 30) == 300  # after the last record: the last count
