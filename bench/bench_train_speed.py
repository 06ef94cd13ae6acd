"""Drafter training speed: float32, bf16 autocast, bf16 with the forward compiled, and that with length-bucketed
batches, side by side.

Runs ``train_drafter`` for ``--steps`` steps once per mode (same seed, data and drafter shape): float32; ``bf16``
(``torch.autocast`` on the CPU: oneDNN's bf16 GEMMs, AMX where the CPU has it); ``bf16+compile``
(``TrainConfig.compile``: the forward up to the logits through ``torch.compile``); ``bf16+compile+bucket``
(``TrainConfig.bucket_by_length``: batches of sequences of similar length). Speed is training rows (draft positions
with a loss) and blocks per second over the steps after the first ``--warmup-steps`` (the compile happens in the
first step; its time is reported on its own), read from each run's ``train_log.jsonl``. Prints a table and writes
``bench/results/train_speed_cpu.json``.

    python bench/bench_train_speed.py --data DATA_DIR [--steps 30] [--threads 1]

``DATA_DIR`` is a ``taps build-data`` directory (a few shards are enough).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

MODES = {"fp32": dict(bf16=False), "bf16": dict(bf16=True), "bf16+compile": dict(bf16=True, compile=True),
         "bf16+compile+bucket": dict(bf16=True, compile=True, bucket_by_length=True)}


def _run(mode: str, data: str, steps: int, warmup_steps: int, threads: int, layers: int, block: int,
         batch: int) -> dict:
    from taps.training.train_drafter import TrainConfig, train_drafter

    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(data=data, out=out, steps=steps, threads=threads, num_layers=layers, block_size=block,
                          batch_size=batch, warmup=min(10, steps), save_every=10 ** 9, holdout_shards="0",
                          log_every=1, **MODES[mode])
        train_drafter(cfg)
        log = [json.loads(line) for line in (Path(out) / "train_log.jsonl").read_text().splitlines()]
    first, last = log[warmup_steps - 1], log[-1]
    secs = last["train_seconds"] - first["train_seconds"]
    return {"mode": mode, "steps": last["step"], "measured_steps": last["step"] - first["step"],
            "first_steps_seconds": round(first["train_seconds"], 2), "measured_seconds": round(secs, 2),
            "rows_per_s": (last["rows_seen"] - first["rows_seen"]) / secs,
            "blocks_per_s": (last["blocks_seen"] - first["blocks_seen"]) / secs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup-steps", type=int, default=3, help="steps left out of the speed (compile, caches)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {sorted(MODES)}")
    ap.add_argument("--out", default=str(ROOT / "bench/results/train_speed_cpu.json"))
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}, expected some of {sorted(MODES)}")
    if not 1 <= args.warmup_steps < args.steps:
        ap.error(f"--warmup-steps: expected 1 <= it < --steps ({args.steps}), received {args.warmup_steps}")

    import torch

    from taps.decode.latency import cpu_name
    from taps_kernels.backend import cpu_flags

    runs = [_run(m, args.data, args.steps, args.warmup_steps, args.threads, args.layers, args.block_size,
                 args.batch_size) for m in modes]
    base = next((r["rows_per_s"] for r in runs if r["mode"] == "fp32"), None)
    for r in runs:
        r["over_fp32"] = r["rows_per_s"] / base if base else None
    rec = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "amx": "amx_bf16" in cpu_flags(),
           "avx512_bf16": "avx512_bf16" in cpu_flags(), "torch": torch.__version__, "layers": args.layers,
           "block_size": args.block_size, "batch_size": args.batch_size, "steps": args.steps,
           "warmup_steps": args.warmup_steps, "runs": runs,
           "command": "python bench/bench_train_speed.py --data <build-data dir> --steps "
                      f"{args.steps} --threads {args.threads} --modes {','.join(modes)}"}
    print(f"# {rec['cpu']}, {rec['threads']} thread(s), AMX {rec['amx']}, AVX512-BF16 {rec['avx512_bf16']}: "
          f"{args.layers}-layer drafter, block {args.block_size}, batch {args.batch_size}, steps "
          f"{args.warmup_steps + 1}..{args.steps} timed")
    print(f"{'mode':>20} {'rows/s':>9} {'blocks/s':>9} {'x fp32':>7} {'first steps s':>14}")
    for r in runs:
        x = f"{r['over_fp32']:.2f}" if r["over_fp32"] else "-"
        print(f"{r['mode']:>20} {r['rows_per_s']:9.1f} {r['blocks_per_s']:9.2f} {x:>7} "
              f"{r['first_steps_seconds']:14.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
