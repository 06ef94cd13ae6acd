"""The vector rows of ``topk_stats`` and ``greedy_tokens`` (``csrc/topk_stats.cpp``) against each other: one process
runs one set (``_C.topk_rows_path()``), and ``TAPS_GGUF_KERNELS`` asks a child process for a slower one. The AVX2
rows are built to give the AVX-512 rows' bits (the same float64 lanes and reduction order), so on an AVX-512 CPU
every output of the two must be equal bit for bit; the plain loops sum in another order, so against them the
top-K ids and the argmax must be equal and the floats within float32 rounding."""
import os
import subprocess
import sys

import pytest
import torch

_C = pytest.importorskip("taps_kernels._C")

NAMES = ("topk_logp", "topk_ids", "entropy", "margin", "topk_mass")

# What the child runs: the same inputs (seeded) through the extension, saved for the parent to compare.
CHILD = r"""
import sys, torch
from taps_kernels import _C
sys.path.insert(0, sys.argv[2])
from test_topk_rows import inputs
logits, draft = inputs()
torch.save({"path": _C.topk_rows_path(), "argmax": _C.argmax_rows(logits),
            "stats": _C.topk_stats(draft, 33)}, sys.argv[1])
"""


def inputs():
    """Argmax rows ``[9, 49157]`` and draft logits ``[2, 5, 24001]``: awkward widths (tails of every length mod 16),
    many ties, ``-inf`` entries and a row of ``-inf`` but one, values spread as real logits."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 49157, generator=g) * 4
    logits[1] = torch.randint(-2, 2, (49157,), generator=g).float()  # ties: the first index must win
    logits[2, :49150] = float("-inf")
    logits[3, ::7] = float("-inf")
    for r, V in enumerate((1, 2, 15, 16, 17)):
        logits[4 + r, V:] = logits[4 + r, :V].min() - 1  # the largest within the first V entries
    draft = torch.randn(2, 5, 24001, generator=g) * 3
    draft[0, 1] = torch.randint(-3, 3, (24001,), generator=g).float()
    draft[0, 2, 5:] = float("-inf")  # five possible tokens
    draft[1, 3, ::3] = float("-inf")
    draft[1, 4] = draft[1, 4].half().float()  # coarse values: many exact ties among the top 33
    return logits, draft


def _run_child(kernels, tmp_path):
    out = tmp_path / f"{kernels}.pt"
    env = dict(os.environ, TAPS_GGUF_KERNELS=kernels)
    run = subprocess.run([sys.executable, "-c", CHILD, str(out), os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


def _here():
    logits, draft = inputs()
    return {"path": _C.topk_rows_path(), "argmax": _C.argmax_rows(logits), "stats": _C.topk_stats(draft, 33)}


def test_avx2_rows_give_the_avx512_rows_bits(tmp_path):
    if _C.topk_rows_path() != "avx512":
        pytest.skip(f"this CPU runs the {_C.topk_rows_path()} rows; the comparison needs an AVX-512 CPU")
    here, child = _here(), _run_child("avx2", tmp_path)
    assert child["path"] == "avx2"
    assert torch.equal(here["argmax"], child["argmax"])
    for name, a, b in zip(NAMES, here["stats"], child["stats"]):
        assert torch.equal(a, b), name


def test_plain_loops_agree_with_the_vector_rows(tmp_path):
    if _C.topk_rows_path() == "scalar":
        pytest.skip("this CPU runs the plain loops already")
    here, child = _here(), _run_child("scalar", tmp_path)
    assert child["path"] == "scalar"
    assert torch.equal(here["argmax"], child["argmax"])
    assert torch.equal(here["argmax"], inputs()[0].argmax(-1))
    for name, a, b in zip(NAMES, here["stats"], child["stats"]):
        if name == "topk_ids":
            assert torch.equal(a, b), name
            continue
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b)), name
        torch.testing.assert_close(a[finite], b[finite], rtol=4e-6, atol=4e-6, msg=name)
