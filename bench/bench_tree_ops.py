"""CPU microbenchmark of candidate_pool (top-K pass and best-first search timed apart), select_subtree and
select_throughput (the policies' batch size rule): PyTorch reference vs the C++ backend.

Three kinds of numbers, kept apart on purpose:

* ``ref_op_us`` / ``cpp_op_us``: per call through the public Python op (argument checks, tree validation,
  backend dispatch, output tensors; for select_subtree also the re-indexing of the kept subtree, which
  is PyTorch code in taps_kernels/ops/select.py). Median of several timed blocks.
* ``cpp_raw_wall_us`` (median block), ``cpp_raw_wall_min_us`` (fastest block), ``cpp_raw_cpu_us``:
  the C++ kernel alone, looped inside C++
  (``_C.time_best_first_pool`` / ``_C.time_select_subtree``: outputs allocated once, no Python, no
  validation); wall-clock and the calling thread's CPU time per call. On a loaded machine wall > CPU: the
  difference is time spent waiting for a core.
* The top-K pass (``topk_stats``: log-softmax, top-K, entropy over the whole vocabulary) has no raw
  column: most of it is ATen's log-softmax, and the targets exclude it.
* ``select_throughput`` has no public op: its ``*_op_us`` columns call the registered implementations directly
  (the reference, and the C++ wrapper with its argument checks), on 64-node pools of 1, 4 and 16 rows.

Usage: ``python bench/bench_tree_ops.py [--quick] [--threads 1] [--out bench/results/tree_ops_cpu.json]``.
Grid: D=15, K in {8, 64}, V in {49152, 151936}, pool in {64, 256, 768, 1024}, batch 1; select_throughput:
K=8, V=49152, pool 64, batch in {1, 4, 16}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import taps_kernels as tk  # noqa: E402
from taps_kernels import backend as bk  # noqa: E402

TARGET_SELECT_US = 50.0   # select_subtree on a 1024-node pool
TARGET_POOL_US = 100.0    # best-first search of a 1024-node pool, top-K pass excluded


def per_call_us(fn, iters: int, blocks: int) -> float:
    """Median over ``blocks`` of the mean per-call microseconds of ``iters`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(times)


def raw_us(timer, blocks: int, block_us: float):
    """(median wall, min wall, median CPU) microseconds per call of a C++-looped timer ``timer(iters)``.

    Blocks are sized to about ``block_us`` so that a block rarely spans a scheduler preemption on a
    loaded machine (a long block's wall time would count the time other processes ran).
    """
    estimate_us = timer(5)[1] * 1e6
    iters = int(min(5000, max(5, block_us / max(estimate_us, 1e-3))))
    pairs = [timer(iters) for _ in range(blocks)]
    walls = [p[0] * 1e6 for p in pairs]
    return statistics.median(walls), min(walls), statistics.median(p[1] * 1e6 for p in pairs)


def run(args):
    why = bk.unavailable_reason("cpp", torch.device("cpu"))
    if why:
        raise SystemExit(f"the C++ backend is unavailable: {why}")
    from taps_kernels import _C

    torch.manual_seed(0)
    D = 15
    Ks = [8, 64]
    Vs = [49152, 151936]
    pools = [64, 256, 768, 1024]
    if args.quick:
        Vs, pools = [49152], [64, 1024]
    rows = []
    load_before = os.getloadavg()
    for K in Ks:
        for V in Vs:
            # Peaked like a drafter's marginals (a few plausible tokens per position), fixed seed.
            logits = torch.randn(1, D, V) * 4.0
            roots = torch.tensor([1])
            ref_topk = per_call_us(lambda: tk.topk_stats(logits, K, backend="reference"), 1, args.ref_blocks)
            cpp_topk = per_call_us(lambda: tk.topk_stats(logits, K, backend="cpp"), 3, args.blocks)
            rows.append(dict(op="topk_stats", K=K, V=V, pool=None, ref_op_us=ref_topk, cpp_op_us=cpp_topk))
            stats = tk.topk_stats(logits, K, backend="cpp")
            for pool in pools:
                ref_bf = per_call_us(lambda: tk.best_first_pool(stats, roots, pool, backend="reference"), 1,
                                     args.ref_blocks)
                cpp_bf = per_call_us(lambda: tk.best_first_pool(stats, roots, pool, backend="cpp"), args.iters,
                                     args.blocks)
                wall, wall_min, cpu = raw_us(lambda n: _C.time_best_first_pool(stats.topk_logp, stats.topk_ids, roots,
                                                                               pool, n), args.blocks, args.block_us)
                rows.append(dict(op="best_first_pool", K=K, V=V, pool=pool, ref_op_us=ref_bf, cpp_op_us=cpp_bf,
                                 cpp_raw_wall_us=wall, cpp_raw_wall_min_us=wall_min, cpp_raw_cpu_us=cpu))
                cand = tk.candidate_pool(logits, roots, K, pool, backend="cpp", pool_backend="cpp")
                tree, log_reach = cand.tree, cand.logq
                max_nodes = min(64, pool // 2)
                latency = torch.tensor([0.01 + 0.0002 * n for n in range(pool + 1)], dtype=torch.float64)
                # each row: the public op's rule, and the same rule as the C++ kernel's arguments
                rules = {
                    "reach": (tk.ReachRule(), dict(rule="reach")),
                    "throughput": (tk.ReachRule(latency, t0=0.005), dict(rule="reach", latency=latency, t0=0.005)),
                    "utility": (tk.UtilityRule(min_utility=1e-4), dict(rule="utility", min_utility=1e-4)),
                }
                for name, (rule, raw_kw) in rules.items():
                    ref_sel = per_call_us(lambda: tk.select_subtree(tree, log_reach, max_nodes, rule=rule,
                                                                    backend="reference"), 1, args.ref_blocks)
                    cpp_sel = per_call_us(lambda: tk.select_subtree(tree, log_reach, max_nodes, rule=rule,
                                                                    backend="cpp"), args.iters, args.blocks)
                    wall, wall_min, cpu = raw_us(lambda n: _C.time_select_subtree(
                        tree.parents, tree.depth, tree.num_nodes, log_reach, max_nodes, iters=n, **raw_kw),
                        args.blocks, args.block_us)
                    rows.append(dict(op=f"select_subtree[{name}]", K=K, V=V, pool=pool, max_nodes=max_nodes,
                                     ref_op_us=ref_sel, cpp_op_us=cpp_sel, cpp_raw_wall_us=wall,
                                     cpp_raw_wall_min_us=wall_min, cpp_raw_cpu_us=cpu))
            print(f"done K={K} V={V}", file=sys.stderr)
    rows += throughput_rows(args, _C, D)
    return rows, load_before, os.getloadavg()


def throughput_rows(args, _C, D: int, K: int = 8, V: int = 49152, pool: int = 64):
    """``select_subtree(rule=ThroughputRule)`` rows: one joint size rule over ``B`` pools of ``pool`` nodes (the
    policies' default budget), pool log-masses as the reach, a linear batch table; raw: the C++ kernel alone."""
    out = []
    for B in (1, 4, 16):
        logits = torch.randn(B, D, V) * 4.0
        cand = tk.candidate_pool(logits, torch.ones(B, dtype=torch.int64), K, pool, backend="cpp", pool_backend="cpp")
        tree = cand.tree
        table = torch.tensor([0.01 + 0.0002 * n for n in range(B * pool + 1)], dtype=torch.float64)
        call = (tree.parents, tree.depth, tree.num_nodes, cand.logq, pool, table, 0.012, B)
        rule = tk.ThroughputRule(table, 0.012, B)
        # the public op (selection + re-index) as the policies call it, on each backend
        ref_us = per_call_us(lambda: tk.select_subtree(tree, cand.logq, pool, rule=rule, backend="reference",
                                                       validate="none"), 1, args.ref_blocks)
        cpp_us = per_call_us(lambda: tk.select_subtree(tree, cand.logq, pool, rule=rule, backend="cpp",
                                                       validate="none"), args.iters, args.blocks)
        wall, wall_min, cpu = raw_us(lambda n: _C.time_select_throughput(*call, iters=n), args.blocks, args.block_us)
        out.append(dict(op=f"select_throughput[B={B}]", K=K, V=V, pool=pool, batch=B, max_nodes=pool, ref_op_us=ref_us,
                        cpp_op_us=cpp_us, cpp_raw_wall_us=wall, cpp_raw_wall_min_us=wall_min, cpp_raw_cpu_us=cpu))
    print("done select_throughput", file=sys.stderr)
    return out


def print_table(rows):
    head = f"{'op':26s} {'K':>3s} {'V':>7s} {'pool':>5s} {'ref op us':>11s} {'cpp op us':>10s} " \
           f"{'raw wall us':>11s} {'raw min us':>10s} {'raw cpu us':>10s} {'op speedup':>10s}"
    print(head)
    print("-" * len(head))
    for r in rows:
        def f(key):
            v = r.get(key)
            return f"{v:.1f}" if isinstance(v, float) else "-"
        print(f"{r['op']:26s} {r['K']:3d} {r['V']:7d} {str(r['pool'] or '-'):>5s} {f('ref_op_us'):>11s} "
              f"{f('cpp_op_us'):>10s} {f('cpp_raw_wall_us'):>11s} {f('cpp_raw_wall_min_us'):>10s} {f('cpp_raw_cpu_us'):>10s} "
              f"{r['ref_op_us'] / r['cpp_op_us']:9.1f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="V=49152 and pools 64/1024 only")
    ap.add_argument("--iters", type=int, default=50, help="calls per timed block through the Python op (cpp)")
    ap.add_argument("--block-us", type=float, default=500.0,
                    help="target length of one C++-looped block (short blocks: fewer preemptions on a shared machine)")
    ap.add_argument("--blocks", type=int, default=7, help="timed blocks per measurement (median reported)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared 2-core machine more threads mostly wait)")
    ap.add_argument("--ref-blocks", type=int, default=3, help="single-call blocks for the slow references")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "tree_ops_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, load_before, load_after = run(args)
    print_table(rows)
    at_1024 = [r for r in rows if r["pool"] == 1024]
    summary = {
        "best_first_pool_1024_raw_cpu_us_max": max(r["cpp_raw_cpu_us"] for r in at_1024 if r["op"] == "best_first_pool"),
        "best_first_pool_1024_raw_wall_us_max": max(r["cpp_raw_wall_us"] for r in at_1024
                                                    if r["op"] == "best_first_pool"),
        "select_subtree_1024_raw_cpu_us_max": max(r["cpp_raw_cpu_us"] for r in at_1024
                                                  if r["op"].startswith("select_subtree")),
        "select_subtree_1024_raw_wall_us_max": max(r["cpp_raw_wall_us"] for r in at_1024
                                                   if r["op"].startswith("select_subtree")),
        "select_throughput_pool64_raw_cpu_us": {r["batch"]: r["cpp_raw_cpu_us"] for r in rows
                                                if r["op"].startswith("select_throughput")},
        "target_best_first_pool_us": TARGET_POOL_US,
        "target_select_subtree_us": TARGET_SELECT_US,
    }
    print("\nraw kernel maxima at pool=1024 (us): " + ", ".join(f"{k}={v:.1f}" for k, v in summary.items()
                                                              if k.endswith("_max")))
    print("select_throughput raw CPU us per call by batch (pool 64): "
          + ", ".join(f"B={b}: {v:.1f}" for b, v in summary["select_throughput_pool64_raw_cpu_us"].items()))
    result = {
        "benchmark": "tree_ops_cpu",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "settings": {"D": 15, "batch": "1 (select_throughput: 1, 4, 16)",
                     "iters": args.iters, "raw_block_us": args.block_us, "blocks": args.blocks,
                     "ref_blocks": args.ref_blocks, "quick": args.quick,
                     "select_max_nodes": "min(64, pool // 2)", "log_reach": "pool logq (marginal products)"},
        "columns": {"ref_op_us": "reference through the public op (validation included); select_throughput: "
                                 "the registered reference (no public op)",
                    "cpp_op_us": "C++ backend through the public op (validation, dispatch, outputs; select: "
                                 "PyTorch re-indexing included); select_throughput: the registered C++ wrapper "
                                 "(binding checks, outputs)",
                    "cpp_raw_wall_us": "C++ kernel looped in C++, wall clock per call (median of blocks)",
                    "cpp_raw_wall_min_us": "same, fastest block",
                    "cpp_raw_cpu_us": "C++ kernel looped in C++, calling-thread CPU time per call"},
        "summary": summary,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
