"""CPU cost of one ``score_edges`` call as the decoder makes it: reference (PyTorch) vs C++, one thread.

The call: B = 1, a pool of 128 nodes + root from ``candidate_pool`` on random draft logits [1, 15, 49152]
(SmolLM2's vocabulary) with top_k 64, the trained scorer ``checkpoints/smollm2-taps-scorer`` (random full
weights of the same shapes when it is absent), token embeddings [49152, 576] and drafter hidden [1, 15, 576].
Reports the median wall time and the median thread CPU time per call (the CPU time leaves out time spent
waiting for a core, so it is the better number on a shared machine), for float32 and bfloat16 tables,
for the implementations alone and through the public op (argument checks included).

Usage: ``OMP_NUM_THREADS=1 python bench/bench_score_edges_cpu.py [--calls 2000]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "python"))

import taps_kernels as tk  # noqa: E402
from taps_kernels import ScorerWeights  # noqa: E402
from taps_kernels import backend as bk  # noqa: E402

V, E, H, D, TOP_K, POOL = 49152, 576, 576, 15, 64, 128


def median_us(fn, calls):
    fn()
    wall, cpu = [], []
    for _ in range(calls):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return 1e6 * statistics.median(wall), 1e6 * statistics.median(cpu)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="timed calls of the C++ paths (reference: a quarter)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ckpt = os.path.join(ROOT, "checkpoints", "smollm2-taps-scorer")
    try:
        from taps.scoring.io import load_scorer_weights
        weights, _ = load_scorer_weights(ckpt)
        source = ckpt
    except Exception as exc:  # no safetensors, or no checkpoint: the cost depends only on the shapes
        weights, source = ScorerWeights.random(E, H, D, generator=g), f"random weights ({exc})"
    pool = tk.candidate_pool(torch.randn(1, D, V, generator=g) * 3, torch.tensor([5]), TOP_K, POOL)
    emb = torch.randn(V, E, generator=g) * 0.05
    hidden = torch.randn(1, D, H, generator=g)
    print(f"scorer: {source}; pool N = {pool.tree.tokens.shape[1]}; torch threads {torch.get_num_threads()}")
    reference = bk.resolve("score_edges", "reference", pool.tree.device)[1]
    cpp = bk.resolve("score_edges", "cpp", pool.tree.device)[1]
    for dtype in (torch.float32, torch.bfloat16):
        table = emb.to(dtype)
        runs = {
            "reference": (lambda: reference(pool, weights, table, hidden), max(1, args.calls // 4)),
            "cpp": (lambda: cpp(pool, weights, table, hidden), args.calls),
            "op, reference": (lambda: tk.score_edges(pool, weights, table, hidden, backend="reference"),
                              max(1, args.calls // 4)),
            "op, cpp (default)": (lambda: tk.score_edges(pool, weights, table, hidden), args.calls),
        }
        for name, (fn, calls) in runs.items():
            if dtype != torch.float32 and "reference" in name:
                calls = max(1, calls // 20)  # the reference converts the whole table on every call
            wall, cpu = median_us(fn, calls)
            print(f"  {str(dtype).replace('torch.', ''):8s} {name:18s} wall {wall:9.1f} us   thread CPU {cpu:9.1f} us"
                  f"   ({calls} calls)")


if __name__ == "__main__":
    main()
