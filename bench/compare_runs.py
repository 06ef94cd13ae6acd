"""Two ``taps bench --jsonl`` runs of the same prompts side by side: are the token ids the same, and tokens/s.

For every ``(policy, prompt id, turn)`` present in both runs the generated token ids must be equal (a change
that keeps behaviour gives every policy the ids it gave before); per policy it prints the aggregate tokens/s
of each run (total new tokens over total seconds) and their ratio. Writes the summary as JSON.

Usage: ``python bench/compare_runs.py BEFORE.jsonl AFTER.jsonl [--out FILE.json]`` (``.jsonl.gz`` read too);
exits 1 when an id differs.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from typing import Dict, Tuple


def load(path: str) -> Dict[Tuple[str, str, int], dict]:
    """``{(policy, prompt id, turn): {"ids": [...], "tokens": n, "seconds": s}}`` of one JSONL run."""
    out = {}
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            for t, turn in enumerate(rec["turns"]):
                out[(rec["policy"], rec["id"], t)] = {"ids": turn["token_ids"], "tokens": len(turn["token_ids"]),
                                                     "seconds": turn["seconds"]}
    return out


def compare(before: Dict, after: Dict) -> dict:
    shared = sorted(set(before) & set(after))
    per = defaultdict(lambda: {"turns": 0, "different": 0, "tokens": [0, 0], "seconds": [0.0, 0.0]})
    for key in shared:
        p = per[key[0]]
        p["turns"] += 1
        p["different"] += before[key]["ids"] != after[key]["ids"]
        for i, run in enumerate((before, after)):
            p["tokens"][i] += run[key]["tokens"]
            p["seconds"][i] += run[key]["seconds"]
    policies = {}
    for name, p in per.items():
        tps = [p["tokens"][i] / p["seconds"][i] if p["seconds"][i] else 0.0 for i in (0, 1)]
        policies[name] = {"turns": p["turns"], "different_ids": p["different"], "tokens_per_s_before": tps[0],
                          "tokens_per_s_after": tps[1], "ratio": tps[1] / tps[0] if tps[0] else None}
    return {"shared_turns": len(shared), "only_before": len(set(before) - set(after)),
            "only_after": len(set(after) - set(before)), "policies": policies}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--out", default=None, help="write the summary JSON here")
    args = ap.parse_args(argv)
    summary = compare(load(args.before), load(args.after))
    print(f"{'policy':16s} {'turns':>6s} {'ids differ':>10s} {'tok/s before':>12s} {'tok/s after':>11s} {'ratio':>6s}")
    for name, p in summary["policies"].items():
        print(f"{name:16s} {p['turns']:6d} {p['different_ids']:10d} {p['tokens_per_s_before']:12.1f} "
              f"{p['tokens_per_s_after']:11.1f} {p['ratio']:6.3f}")
    print(f"shared turns {summary['shared_turns']}, only before {summary['only_before']}, "
          f"only after {summary['only_after']}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return 1 if any(p["different_ids"] for p in summary["policies"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
