"""Compile every Triton kernel configuration for real GPUs on a machine without one.

The interpreter accepts shapes a GPU rejects (``tl.dot`` dims under 16, oversized shared memory);
this catches them on CPU-only CI. Every module of ``taps_kernels.triton`` lists the configurations
its launcher can choose in ``aot_configs()`` (format in ``bench/aot_resources.py``, which does the
work); each is compiled with Triton's NVIDIA backend (Triton -> PTX -> bundled ptxas -> cubin) and
its shared memory is checked against the per-block limit of the target.

Targets: sm_80 and sm_90 for every configuration; sm_89 (99 KB of shared memory instead of 163 KB)
only for the configurations whose launch choice differs from sm_80's or whose sm_80 shared memory
exceeds the sm_89 limit: the rest compile exactly as on sm_80 and fit. All three in full take about
twice as long as this (``python bench/aot_resources.py`` does them all and writes the table).
One subprocess runs every compile, because kernels imported under ``TRITON_INTERPRET=1`` (set by
conftest) are interpreter objects. Takes ~2-4 minutes on two cores.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_every_kernel_configuration_compiles_for_sm80_sm89_sm90():
    pytest.importorskip("triton")
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception as exc:
        pytest.skip(f"triton has no NVIDIA backend here: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "aot_resources.py"), "--arch", "80", "89", "90",
                           "--sm89", "limited", "--no-write"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"ahead-of-time compile failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    compiled = [ln for ln in lines if ln.startswith("ok ")]
    modules = {ln.split()[2].split(".")[0] for ln in compiled}
    assert {"tree_attention", "edge_score", "topk_stats"} <= modules, modules
    for arch in ("sm_80", "sm_89", "sm_90"):
        assert any(f" {arch} " in ln for ln in compiled), f"nothing compiled for {arch}"
