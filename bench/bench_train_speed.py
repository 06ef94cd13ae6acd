"""Drafter training speed, fp32 against bf16 autocast, side by side on the same data and model.

Runs ``train_drafter`` for ``--steps`` steps twice (same seed, same data, same drafter shape), once in float32
and once with ``bf16=True`` (``torch.autocast`` on the CPU: oneDNN's bf16 GEMMs, AMX where the CPU has it), and
reports training rows (draft positions with a loss) per second and block-tokens per second from each run's
``train_summary.json``. Prints a table and writes ``bench/results/train_speed_cpu.json``.

    python bench/bench_train_speed.py --data DATA_DIR [--steps 30] [--threads 1]

``DATA_DIR`` is a ``taps build-data`` directory (a few shards are enough).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))


def _run(data: str, steps: int, bf16: bool, threads: int, layers: int, block: int, batch: int) -> dict:
    from taps.training.train_drafter import TrainConfig, train_drafter

    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(data=data, out=out, steps=steps, bf16=bf16, threads=threads, num_layers=layers,
                          block_size=block, batch_size=batch, warmup=min(10, steps), save_every=10 ** 9,
                          holdout_shards="0", log_every=max(1, steps // 5))
        t0 = time.perf_counter()
        train_drafter(cfg)
        wall = time.perf_counter() - t0
        summary = json.loads((Path(out) / "train_summary.json").read_text())
    secs = float(summary["train_seconds"])
    return {"bf16": bf16, "steps": summary["step"], "train_seconds": secs, "wall_s": round(wall, 2),
            "rows_seen": summary["rows_seen"], "blocks_seen": summary["blocks_seen"],
            "rows_per_s": summary["rows_seen"] / secs if secs > 0 else None,
            "blocks_per_s": summary["blocks_seen"] / secs if secs > 0 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench/results/train_speed_cpu.json"))
    args = ap.parse_args()

    import torch

    from taps.decode.latency import cpu_name
    from taps_kernels.backend import cpu_flags

    runs = [_run(args.data, args.steps, bf16, args.threads, args.layers, args.block_size, args.batch_size)
            for bf16 in (False, True)]
    fp32, bf16 = runs
    ratio = bf16["rows_per_s"] / fp32["rows_per_s"] if fp32["rows_per_s"] and bf16["rows_per_s"] else None
    rec = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "amx": "amx_bf16" in cpu_flags(),
           "avx512_bf16": "avx512_bf16" in cpu_flags(), "layers": args.layers, "block_size": args.block_size,
           "batch_size": args.batch_size, "steps": args.steps, "runs": runs, "bf16_over_fp32": ratio,
           "command": "python bench/bench_train_speed.py --data <build-data dir> --steps "
                      f"{args.steps} --threads {args.threads}"}
    print(f"# {rec['cpu']}, {rec['threads']} thread(s), AMX {rec['amx']}, AVX512-BF16 {rec['avx512_bf16']}: "
          f"{args.layers}-layer drafter, block {args.block_size}, batch {args.batch_size}, {args.steps} steps")
    print(f"{'mode':>6} {'rows/s':>9} {'blocks/s':>9} {'train s':>8}")
    for r in runs:
        print(f"{'bf16' if r['bf16'] else 'fp32':>6} {r['rows_per_s']:9.1f} {r['blocks_per_s']:9.2f} "
              f"{r['train_seconds']:8.1f}")
    if ratio:
        print(f"bf16 / fp32: {ratio:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
