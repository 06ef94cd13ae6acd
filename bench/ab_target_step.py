"""The GGUF target's verify step of two builds side by side: this checkout against another built one (a
``git worktree`` of an earlier commit after ``python setup.py build_ext --inplace``), each in processes of its
own, alternated (A B, B A, ...), since this machine's memory speed drifts by 10-40% over minutes.

Each process loads the shipped target, prefills ``--prefix`` random tokens and times ``verify`` of one tree per
node count (the trees of ``bench_gguf_target.py``: a chain up to 2 nodes, a bushy tree above), one thread. The
two builds must give the same logits bit for bit (a change of speed, not of numerics): the script compares a
checksum of every tree's logits and exits 1 when they differ. Prints a table and writes JSON.

Usage: ``python bench/ab_target_step.py --baseline ../old-checkout [--nodes 1,4,8,16,64] [--rounds 3]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(nodes, prefix, repeats):
    """Runs in a child process of one build: ``{nodes: [ms, checksum]}`` as JSON on stdout."""
    import random
    import time

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gguf_target import FEATURE_LAYERS, _tree  # noqa: E402
    from taps.decode.verifier import make_verifier
    from taps.models.target import load_target

    torch.set_num_threads(1)
    v = make_verifier(load_target("smollm2", target_format="gguf")[0], FEATURE_LAYERS)
    rng = random.Random(0)
    v.prefill(torch.tensor([[rng.randrange(49152) for _ in range(prefix)]]), prefix + max(nodes) + 1)
    out = {}
    for n in nodes:
        tree = _tree(rng, n, n <= 2)
        logits = v.verify(tree)[0]
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            v.verify(tree)
            ts.append(time.perf_counter() - t0)
        out[n] = [1e3 * statistics.median(ts), float(logits.double().sum())]
    print(json.dumps(out))


def _run(checkout: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), str(checkout / "python")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--nodes", args.nodes,
           "--prefix", str(args.prefix), "--repeats", str(args.repeats)]
    res = subprocess.run(cmd, env=env, cwd=str(checkout), capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="another checkout with its extension built in place")
    ap.add_argument("--nodes", default="1,2,4,8,16,32,64")
    ap.add_argument("--prefix", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two builds")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench/results/ab_target_step.json")
    args = ap.parse_args()
    nodes = [int(x) for x in args.nodes.split(",")]
    if args.child:
        return _child(nodes, args.prefix, args.repeats)
    if not args.baseline:
        ap.error("--baseline: the other checkout is required")
    from taps.decode.latency import cpu_name

    builds = {"this": ROOT, "baseline": Path(args.baseline).resolve()}
    runs = {name: [] for name in builds}
    for r in range(args.rounds):
        for name in (("this", "baseline") if r % 2 == 0 else ("baseline", "this")):
            runs[name].append(_run(builds[name], args))
    rows, same = [], True
    for n in nodes:
        ms = {name: statistics.median(run[n][0] for run in runs[name]) for name in builds}
        sums = {name: {run[n][1] for run in runs[name]} for name in builds}
        equal = len(sums["this"] | sums["baseline"]) == 1
        same = same and equal
        rows.append({"nodes": n, "this_ms": ms["this"], "baseline_ms": ms["baseline"],
                     "speedup": ms["baseline"] / ms["this"], "same_logits": equal})
    print(f"{'nodes':>5} {'this ms':>9} {'baseline ms':>12} {'speedup':>8}  same logits")
    for r in rows:
        print(f"{r['nodes']:>5} {r['this_ms']:>9.2f} {r['baseline_ms']:>12.2f} {r['speedup']:>7.3f}x  {r['same_logits']}")
    rec = {"cpu": cpu_name(), "threads": 1, "prefix": args.prefix, "rounds": args.rounds, "repeats": args.repeats,
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=1))
    print(f"wrote {args.out}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
