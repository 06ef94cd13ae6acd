"""Verify forward on CPU: tree attention (``taps_tree``: ``taps_kernels.tree_attention`` in every layer) against
the dense-mask fallback (``sdpa``: one ``[B, 1, N, L]`` float mask, HF's sdpa attention), on SmolLM2 verify
shapes (1-17 tree nodes, prefix 100-600 tokens), through the decode loop's own verifier
(:class:`taps.decode.verifier.TargetVerifier`, preallocated cache, hidden states for the drafter).

The two paths run interleaved per repeat (order alternating) so that machine load hits both alike; the
median per cell is reported. Prints a table and writes JSON (default
``bench/results/verify_attention_cpu.json``); ``taps.decode.verifier.CPU_DEFAULT_ATTENTION`` is set from it.
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch

PATHS = ("taps_tree", "sdpa")


def random_tree(n, vocab, gen):
    from taps.decode.latency import random_tree as rt

    return rt(n, vocab, gen)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prefixes", default="100,300,600")
    ap.add_argument("--nodes", default="1,4,8,12,17", help="tree rows (root included)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/verify_attention_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from taps.decode.verifier import TargetVerifier
    from taps.models.target import load_target

    model, _ = load_target("smollm2")
    layer_ids = [1, 8, 14, 20, 27]  # the shipped drafter's feature layers: hidden states are requested as in decoding
    verifiers = {p: TargetVerifier(model, layer_ids, attention=p) for p in PATHS}
    gen = torch.Generator().manual_seed(0)
    V = int(model.config.vocab_size)
    rows = []
    print(f"{'prefix':>6} {'nodes':>5} " + " ".join(f"{p + ' ms':>12}" for p in PATHS) + "  faster")
    for prefix in [int(x) for x in args.prefixes.split(",")]:
        prompt = torch.randint(0, V, (prefix,), generator=gen).tolist()
        for ver in verifiers.values():
            ver.reset(1, prefix + 64)
            ver.prefill_row(0, prompt)
        for n in [int(x) for x in args.nodes.split(",")]:
            tree = random_tree(n - 1, V, gen)
            times = {p: [] for p in PATHS}
            for rep in range(args.repeats + 1):
                for p in (PATHS if rep % 2 == 0 else PATHS[::-1]):
                    t = time.perf_counter()
                    verifiers[p].verify_batch(tree, 1)
                    dt = time.perf_counter() - t
                    if rep:
                        times[p].append(dt)
            med = {p: 1e3 * statistics.median(v) for p, v in times.items()}
            best = min(med, key=med.get)
            rows.append({"prefix": prefix, "nodes": n, **{f"{p}_ms": med[p] for p in PATHS}, "faster": best})
            print(f"{prefix:>6} {n:>5} " + " ".join(f"{med[p]:>12.2f}" for p in PATHS) + f"  {best}")
    wins = {p: sum(r["faster"] == p for r in rows) for p in PATHS}
    ratio = statistics.median(r["taps_tree_ms"] / r["sdpa_ms"] for r in rows)
    print(f"faster in {wins}; median taps_tree / sdpa time {ratio:.3f}")
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
           "load_1min": os.getloadavg()[0], "model": "smollm2-135m fp32", "repeats": args.repeats, "rows": rows,
           "wins": wins, "median_ratio_taps_tree_over_sdpa": ratio,
           "tree_attention_backend_cpu": __import__("taps_kernels").backend.resolve("tree_attention", None,
                                                                                    torch.device("cpu"))[0]}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
