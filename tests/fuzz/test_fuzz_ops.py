"""The fuzz suite under pytest: every catalogue case (tests/fuzz/cases.py) on every CPU backend, in a pool of worker
subprocesses (tests/fuzz/runner.py). Zero crashes, hangs, cross-backend disagreements and unclean errors.

``pytest -s tests/fuzz`` prints the outcome counts per op; ``python tests/fuzz/run.py`` also writes them to
``bench/results/fuzz_counts.json``.

``KNOWN`` lists the cases that still fail inside kernel files this suite does not own, each with the reason;
the test fails on any other failure, and also when a listed case stops failing (so the list cannot go stale).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cases  # noqa: E402
import runner  # noqa: E402

KNOWN = {
}


def test_fuzz_every_op_every_backend():
    ids = cases.all_case_ids()
    results = runner.run_cases(ids, workers=min(2, os.cpu_count() or 1))
    print("\n" + runner.format_counts(runner.counts_by_op(results)))
    assert set(results) == set(ids), f"{len(set(ids) - set(results))} cases without an outcome"
    failing = {cid: (outcome, detail) for outcome, cid, detail in runner.failures(results)}
    for cid, (outcome, detail) in sorted(failing.items()):
        tag = "known" if cid in KNOWN else "NEW"
        print(f"{tag:<5} {outcome:<8} {cid}: {detail[:300]}")
    new = {cid: v for cid, v in failing.items() if cid not in KNOWN}
    fixed = sorted(cid for cid in KNOWN if cid in results and cid not in failing)
    assert not new, f"{len(new)} failing cases: " + "; ".join(f"{o} {c}: {d[:200]}" for c, (o, d) in new.items())
    assert not fixed, f"listed as known failures but passing now (remove them from KNOWN): {fixed}"
