"""Microbenchmark of the device-side prompt lookup (``taps.decode.token_history``): the n-gram match over each row's
committed tokens (``lookup_chain``) and the graft of the matched chain into a candidate pool (``graft_chain``),
the two stages ``taps-lookup`` adds to a round (the ``lookup`` column of the benchmark's time split).

Grid: batch B in {1, 4, 8}, history length C in {256, 1024, 4096} tokens, chain K = 10, max n-gram 3, pool
of 129 nodes (the ``taps`` pool). Histories repeat a 37-token pattern with noise, so every row matches.
Median of timed blocks, per call, in microseconds.

Usage: ``python bench/bench_lookup.py [--device cpu|cuda] [--threads 1] [--quick] [--out bench/results/lookup_cpu.json]``.
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
sys.path[:0] = [ROOT, os.path.join(ROOT, "python")]

import taps_kernels as tk  # noqa: E402
from taps_kernels import graft_chain, lookup_chain  # noqa: E402

K, MAX_NGRAM, POOL = 10, 3, 128


def timed(fn, device, blocks: int, calls: int) -> float:
    """Median microseconds per call over ``blocks`` blocks of ``calls`` calls."""
    fn()
    out = []
    for _ in range(blocks):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(out)


def random_pool(B: int, device, gen: torch.Generator):
    """A ``taps``-sized candidate pool (8 positions, top-64, 128 nodes) of random draft logits, and its log mass."""
    logits = torch.randn(B, 8, 49152, generator=gen) * 3
    pool = tk.candidate_pool(logits.to(device), torch.zeros(B, dtype=torch.int64, device=device), 64, POOL)
    return pool.tree, pool.logq


def histories(B: int, C: int, device, gen: torch.Generator):
    pattern = torch.randint(0, 49152, (37,), generator=gen)
    rows = pattern.repeat(C // 37 + 1)[:C].repeat(B, 1)
    noise = torch.rand(B, C, generator=gen) < 0.05
    rows = torch.where(noise, torch.randint(0, 49152, (B, C), generator=gen), rows)
    return rows.to(device), torch.full((B,), C, dtype=torch.int64, device=device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="fewer blocks (a smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    blocks, calls = (3, 5) if args.quick else (7, 50)
    rows = []
    for B in (1, 4, 8):
        tree, log_reach = random_pool(B, device, gen)
        for C in (256, 1024, 4096):
            tokens, lengths = histories(B, C, device, gen)
            chain, chain_len, ngram, _ = lookup_chain(tokens, lengths, K, MAX_NGRAM)
            chain_reach = torch.log(torch.full((B, K), 0.5, device=device)).cumsum(1)
            match_us = timed(lambda: lookup_chain(tokens, lengths, K, MAX_NGRAM), device, blocks, calls)
            graft_us = timed(lambda: graft_chain(tree, log_reach, chain, chain_len, chain_reach), device, blocks, calls)
            rows.append({"batch": B, "history": C, "match_us": match_us, "graft_us": graft_us,
                         "matched_rows": int((ngram > 0).sum()), "chain_len_mean": float(chain_len.float().mean())})
    print(f"{'B':>3}{'history':>9}{'match us':>10}{'graft us':>10}{'total us':>10}")
    for r in rows:
        print(f"{r['batch']:>3}{r['history']:>9}{r['match_us']:>10.0f}{r['graft_us']:>10.0f}"
              f"{r['match_us'] + r['graft_us']:>10.0f}")
    if args.out:
        meta = {"device": str(device), "threads": args.threads, "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__, "chain_tokens": K, "max_ngram": MAX_NGRAM, "pool_nodes": POOL + 1,
                "command": "python bench/bench_lookup.py " + " ".join(sys.argv[1:])}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
