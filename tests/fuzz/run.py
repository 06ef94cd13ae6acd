"""Run the whole fuzz catalogue on every CPU backend and print the outcome counts per op.

    python tests/fuzz/run.py [--workers 2] [--hypothesis-blocks 1] [--out bench/results/fuzz_counts.json]

Writes the counts (and every failing case with its detail) to the JSON file; exits 1 when a case crashed, hung,
disagreed across backends or raised an unclean error. The pytest entry point is tests/fuzz/test_fuzz_ops.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("TRITON_INTERPRET", "1")

import cases  # noqa: E402
import runner  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hypothesis-blocks", type=int, default=1)
    ap.add_argument("--case-timeout", type=float, default=60.0)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "..", "bench", "results", "fuzz_counts.json"))
    args = ap.parse_args(argv)
    ids = cases.all_case_ids(args.hypothesis_blocks)
    start = time.monotonic()
    results = runner.run_cases(ids, workers=args.workers, case_timeout=args.case_timeout)
    seconds = time.monotonic() - start
    counts = runner.counts_by_op(results)
    print(runner.format_counts(counts))
    fails = runner.failures(results)
    for outcome, cid, detail in fails:
        print(f"{outcome:<9} {cid}: {detail}")
    print(f"{len(ids)} cases in {seconds:.0f} s with {args.workers} workers")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cases": len(ids), "seconds": round(seconds, 1), "workers": args.workers,
                   "machine": platform.machine(), "cpus": os.cpu_count(), "counts": counts,
                   "failures": [{"outcome": o, "case": c, "detail": d} for o, c, d in fails]}, f, indent=1)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
