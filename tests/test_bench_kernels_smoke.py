"""bench/bench_kernels.py --quick runs on a CPU and writes the rows the GPU run reports (PyTorch paths only here)."""
import importlib.util
import json
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_kernels_quick_runs_on_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        import pytest
        pytest.skip("the GPU run is bench/gpu_check.sh's job")
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(ROOT, "bench", "bench_kernels.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
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
