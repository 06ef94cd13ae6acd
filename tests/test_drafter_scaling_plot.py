"""bench/plot_drafter_scaling.py on the committed held-out evaluations: its fits are least-squares lines in
log2(minutes) and its predictions are where those lines reach the goals."""
import json
import math
import shutil
from pathlib import Path

import numpy as np

from helpers import load_bench_script

ROOT = Path(__file__).resolve().parents[1]


def test_scaling_fit_and_prediction(tmp_path):
    shutil.copy(ROOT / "checkpoints/smollm2-dflash/eval_heldout_v2.json", tmp_path)
    load_bench_script("plot_drafter_scaling").main(["--drafter", str(tmp_path)])
    out = json.loads((tmp_path / "scaling.json").read_text())
    assert (tmp_path / "scaling.png").stat().st_size > 0
    x = np.log2([p["minutes"] for p in out["points"]])
    for kind, f in out["fits"].items():
        y = np.array([p[kind] for p in out["points"]])
        slope, intercept = np.polyfit(x, y, 1)
        assert math.isclose(f["tau_per_doubling"], slope, rel_tol=1e-9)
        assert math.isclose(f["tau_at_1_min"], intercept, rel_tol=1e-9)
        assert f["best"] == y.max() and math.isclose(f["missed_by"], f["goal"] - y.max())
        reached = f["tau_at_1_min"] + f["tau_per_doubling"] * math.log2(f["predicted_minutes_for_goal"])
        assert math.isclose(reached, f["goal"], rel_tol=1e-9)
