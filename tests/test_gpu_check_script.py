"""bench/gpu_check.sh and bench/bench_decode_gpu.py, checked where no GPU is: the shell script parses (and
passes shellcheck when it is installed), and the decode check's ``--device cpu --quick`` run completes, writes
its JSON with every policy identical to ``ar`` (recomputed here from the recorded tokens), ``ar`` identical to
Hugging Face greedy decoding of the same seeded target, and the host reads of every round counted (the
loop's one read among them)."""
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
DECODE = ROOT / "bench" / "bench_decode_gpu.py"


def test_gpu_check_sh_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_gpu_check_sh_shellcheck():
    out = subprocess.run(["shellcheck", "-S", "warning", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_committed_inputs_fit():
    """The committed config is SmolLM2-135M's shape, the prompts are token ids inside its vocabulary, and the
    shipped drafter fits that config (what the GPU run loads)."""
    sys.path.insert(0, str(DECODE.parent))
    bd = importlib.import_module("bench_decode_gpu")
    cfg = bd.target_config(quick=False)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (576, 30, 49152)
    ids, prompts = bd.load_prompts(4)
    assert len(ids) == 4 and all(0 <= t < cfg.vocab_size for p in prompts for t in p)
    from taps.models.drafter import DFlashConfig, check_compatible

    check_compatible(DFlashConfig.from_pretrained(bd.DRAFTER_DIR), cfg)


def test_host_read_counter_counts_reads():
    sys.path.insert(0, str(DECODE.parent))
    from host_reads import HostReadCounter

    x = torch.arange(4)
    with HostReadCounter() as c:
        x.sum().item()  # not counting yet
        with c.counting() as reads:
            x.sum().item()
            x.tolist()
            bool(x[0])
            x.to(torch.float32)  # a dtype change reads nothing
        x.tolist()
    assert len(reads) == 3 and c.count == 3, reads
    assert x.tolist() == [0, 1, 2, 3]  # the wrappers are gone


def test_decode_check_quick_cpu(tmp_path):
    env = dict(os.environ, OUT="", PYTHONUNBUFFERED="1")
    # bfloat16 timing + float32 exactness, as on a GPU: two copies of the same weights
    out = subprocess.run([sys.executable, str(DECODE), "--device", "cpu", "--quick", "--dtype", "bfloat16",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "PROJECTION (not a measurement)" in out.stdout and "tau ~ 1" in out.stdout
    rec = json.loads((tmp_path / "decode_gpu_cpu_quick.json").read_text())
    specs = rec["meta"]["policies"]
    assert specs == ["ar", "dflash", "ddtree:16", "ddtree:64", "taps", "taps-lookup", "lookup"]
    max_new = rec["meta"]["max_new_tokens"]
    assert rec["meta"]["dtype"] == "torch.bfloat16" and rec["meta"]["check_dtype"] == "torch.float32"
    for phase in ("timed_b1", "exact_batched", "exact_b1", "timed_batched"):
        runs = rec["runs"][phase]
        assert sorted(runs) == sorted(specs), phase
        ar = runs["ar"]["tokens"]
        assert len(ar) == 2 and all(len(t) == max_new for t in ar)
        for spec in specs:
            same = runs[spec]["tokens"] == ar
            assert runs[spec]["identical_to_ar"] == same, (phase, spec)
            if phase.startswith("exact"):  # float32 decides; bfloat16 differences are reported, not judged
                assert same, (phase, spec)
            else:
                assert same or runs[spec]["divergences"], (phase, spec)
    # the reference for ar itself: Hugging Face greedy decoding of the same seeded target
    sys.path.insert(0, str(DECODE.parent))
    bd = importlib.import_module("bench_decode_gpu")
    target = bd.build_target(bd.target_config(quick=True), rec["meta"]["seed"])  # float32
    _, prompts = bd.load_prompts(2)
    from helpers import hf_greedy

    assert [hf_greedy(target, p, max_new) for p in prompts] == rec["runs"]["exact_b1"]["ar"]["tokens"]
    # host reads: counted every round; the round readout's packed read exactly once per round; any other read on CPU
    # comes from the PyTorch reference ops (the GPU path has none)
    for spec in specs:
        r = rec["runs"]["exact_batched"][spec]
        reads = r["host_reads_per_round"]
        assert reads and all(n >= 1 for n in reads), spec
        sites = r["read_sites"]
        loop = sum(n for k, n in sites.items() if k.startswith("tolist at taps/decode/readout.py"))
        assert loop == len(reads), (spec, sites)
        assert sum(sites.values()) == sum(reads)
        assert all(k.startswith("tolist at taps/decode/readout.py") or "taps_kernels/reference/" in k for k in sites), sites
    assert all(row["lossless"] for row in rec["summary"]) and rec["ok"]
    assert rec["verify_latency"]["points"] and rec["projection"]["rows"]
    assert rec["one_line"].startswith(f"ok: {len(specs)}/{len(specs)} policies identical to ar")
