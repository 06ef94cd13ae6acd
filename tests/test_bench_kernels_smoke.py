"""bench/bench_kernels.py --quick runs on a CPU and writes the rows the GPU run reports (PyTorch paths only here)."""
import json

import torch

from helpers import load_bench_script


def test_bench_kernels_quick_runs_on_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        import pytest
        pytest.skip("the GPU run is bench/gpu_check.sh's job")
    bench = load_bench_script("bench_kernels")
    bench.main(["--quick", "--iters", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "kernels_cpu.json").read_text())
    rows = data["results"]
    att = {(r["shape"], r["impl"]) for r in rows if r["kernel"] == "tree_attention"}
    for shape, *_ in bench.SHAPES:
        assert {(shape, "reference"), (shape, "sdpa_mask"), (shape, "sdpa_causal")} <= att, att
    assert {r["impl"] for r in rows if r["kernel"] == "topk_stats"} >= {"reference", "torch.topk"}
    assert any(r["kernel"] == "score_edges_full" for r in rows)
    assert all(r["ms"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "ratio to sdpa_causal" in out and "ratio to torch.topk" in out
