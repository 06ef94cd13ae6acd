"""Time of one drafter pass on CPU: positions projected x vocabulary x head dtype.

    python bench/bench_draft.py [--drafter checkpoints/smollm2-dflash] [--context 256] [--reps 40]

One thread. The drafter holds ``--context`` context rows (random target features); each configuration
runs ``--reps`` draft passes (after warm-up) and reports the median and minimum wall time and the median
thread CPU time in ms. Configurations:
P = 15, 8, 4 projected positions (``draft(num_positions=P)``; at most the drafter's ``block_size - 1``) x full vocabulary / the checkpoint's draft
vocabulary (``draft_vocab.safetensors``) x fp32 / bf16 / int8 head (``taps_kernels`` Int8Linear); for the draft vocabulary both output layouts
(full-size logits with -inf outside, and the sub-vocabulary logits). Writes
``bench/results/draft_time_cpu.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))


def _time(fn, reps: int):
    """(median wall ms, min wall ms, median thread-CPU ms): on a shared machine the CPU time of this thread
    is the figure that other processes disturb least."""
    for _ in range(5):
        fn()
    ts, cs = [], []
    for _ in range(reps):
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
        cs.append((time.thread_time() - c0) * 1e3)
    return statistics.median(ts), min(ts), statistics.median(cs)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default=str(ROOT / "checkpoints" / "smollm2-dflash"))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_time_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from taps.models.drafter import cpu_has_native_bf16, fast_head_dtype, load_drafter
    from taps.models.target import load_target
    from taps.paths import portable_path

    target, _ = load_target("smollm2")
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    drafter = load_drafter(args.drafter, target_config=target.config)
    vocab = drafter.draft_vocab
    if vocab is None:
        raise SystemExit(f"{args.drafter} has no draft vocabulary ({'draft_vocab.safetensors'}); nothing to compare")
    g = torch.Generator().manual_seed(0)
    state = drafter.new_state(1)
    feats = torch.randn(1, args.context, drafter.config.num_context_features, generator=g)
    drafter.append_context(state, feats)
    bonus = torch.tensor([42])
    D = drafter.config.block_size - 1
    positions = sorted({min(P, D) for P in (15, 8, 4)}, reverse=True)  # a shorter block drafts at most D
    rows = []
    for P in positions:
        for vname in ("full", "draft"):
            for hname, hdt in (("fp32", None), ("bf16", torch.bfloat16), ("int8", torch.int8)):
                layouts = ("full",) if vname == "full" else ("full", "sub")
                for layout in layouts:
                    drafter.set_draft_vocab(vocab if vname == "draft" else None)
                    drafter.head_dtype = hdt
                    med, mn, cpu = _time(lambda: drafter.draft(state, bonus, embed, head, num_positions=P,
                                                               full_vocab_logits=layout == "full"), args.reps)
                    r = {"positions": P, "vocab": vname, "vocab_size": int(vocab.numel()) if vname == "draft"
                         else drafter.config.vocab_size, "head_dtype": hname, "logits": layout,
                         "median_ms": round(med, 2), "min_ms": round(mn, 2), "cpu_ms": round(cpu, 2)}
                    rows.append(r)
                    print(f"P={P:2d} vocab={vname:5s}({r['vocab_size']:5d}) head={hname} logits={layout:4s} "
                          f"median {med:6.2f} ms  min {mn:6.2f} ms  cpu {cpu:6.2f} ms", flush=True)
    # the drafter body (its layers over the block) at the best head setting: fp32 weights with torch's linear,
    # fp32 with the few-row kernel (taps_kernels.rows_linear), bf16 weights (load_drafter(dtype=bf16))
    from taps_kernels.integrations.rows_linear import restore_linear, use_rows_linear

    body_rows = []
    head_name = {None: "lm_head", torch.bfloat16: "bf16", torch.int8: "int8"}[fast_head_dtype("cpu")]
    for bname in ("fp32", "fp32_rows_linear", "bf16"):
        d = load_drafter(args.drafter, target_config=target.config,
                         dtype=torch.bfloat16 if bname == "bf16" else torch.float32)
        if bname == "fp32_rows_linear":
            use_rows_linear(d)
        st = d.new_state(1)
        d.append_context(st, feats)
        d.head_dtype = fast_head_dtype("cpu")
        for P in positions:
            for layout, block in (("full", "full"), ("sub", "full"), ("sub", "short")):
                if block == "short" and P == D:
                    continue  # the short block of every position is the full block
                d.short_blocks = block == "short"
                med, mn, cpu = _time(lambda: d.draft(st, bonus, embed, head, num_positions=P,
                                                     full_vocab_logits=layout == "full"), args.reps)
                r = {"body": bname, "positions": P, "vocab": "draft", "vocab_size": int(vocab.numel()),
                     "head_dtype": head_name, "logits": layout, "block": block, "median_ms": round(med, 2),
                     "min_ms": round(mn, 2), "cpu_ms": round(cpu, 2)}
                body_rows.append(r)
                print(f"body={bname:16s} P={P:2d} draft vocab, {head_name} head, logits={layout:4s} block={block:5s} "
                      f"median {med:6.2f} ms  min {mn:6.2f} ms  cpu {cpu:6.2f} ms", flush=True)
        d.short_blocks = False
        if bname == "fp32_rows_linear":
            restore_linear(d)
    out = {"device": "cpu", "threads": 1, "cpu": platform.processor() or platform.machine(),
           "native_bf16": cpu_has_native_bf16(), "context_rows": args.context, "reps": args.reps,
           "drafter": portable_path(args.drafter), "num_layers": drafter.config.num_hidden_layers,
           "load_average_1m": round(os.getloadavg()[0], 2), "rows": rows, "body_rows": body_rows,
           "note": "shared 2-core machine: the load average says how busy it was; cpu_ms (thread CPU time) and "
                   "min_ms are the less noisy figures"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
