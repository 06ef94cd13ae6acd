"""Few-row linear kernel (``taps_kernels.rows_linear``) against torch's linear (BLAS), on SmolLM2's shapes.

Two tables: (1) each weight shape of SmolLM2-135M for M = 1..64 rows; (2) a whole target forward of
``n`` new rows over a 256-token KV prefix (what a verify of an n-node tree costs; n = 1 is an AR
step) with the target's linear layers on torch's linear and on the kernel. Medians of repeated calls,
one thread by default. Writes JSON (default ``bench/results/rows_linear_cpu.json``).
"""
import argparse
import json
import platform
import statistics
import time

import torch


def _median_ms(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,2,4,5,8,16,32,64")
    ap.add_argument("--nodes", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/rows_linear_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import taps_kernels
    from taps_kernels.backend import ROWS_LINEAR_MAX_ROWS, load_extension
    from taps_kernels.integrations.rows_linear import restore_linear, use_rows_linear
    from taps.models.target import load_target

    ext = load_extension("_C")[0]
    if ext is None or not ext.rows_linear_vectorized():
        raise SystemExit("the C++ extension with its AVX-512 path is needed for this benchmark")
    rows = [int(r) for r in args.rows.split(",")]
    model, _ = load_target("smollm2", linear_kernel="torch")
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    counts = {s: sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear) and tuple(m.weight.shape) == s)
              for s in shapes}
    g = torch.Generator().manual_seed(0)
    layer_rows = []
    print(f"{'weight [N,K]':<14}{'calls':>6}" + "".join(f"{f'M={m}':>16}" for m in rows) + "   (torch / kernel ms)")
    for s in shapes:
        w = torch.randn(*s, generator=g)
        line = f"{str(list(s)):<14}{counts[s]:>6}"
        for m in rows:
            x = torch.randn(m, s[1], generator=g)
            t_torch = _median_ms(lambda: torch.nn.functional.linear(x, w), args.repeats)
            t_ours = _median_ms(lambda: taps_kernels.rows_linear(x, w, backend="cpp"), args.repeats)
            layer_rows.append({"weight": list(s), "calls_per_forward": counts[s], "rows": m,
                               "torch_ms": t_torch, "kernel_ms": t_ours})
            line += f"{t_torch:>8.3f}/{t_ours:<7.3f}"
        print(line, flush=True)

    prefix = torch.randint(0, model.config.vocab_size, (1, 256), generator=g)
    forward_rows = []
    print(f"\nwhole forward over a 256-token prefix (ms): nodes, torch linear, kernel (rows <= {ROWS_LINEAR_MAX_ROWS})")
    with torch.inference_mode():
        for n in [int(v) for v in args.nodes.split(",")]:
            new = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
            out = {}
            for label in ("torch", "kernel"):
                (use_rows_linear if label == "kernel" else restore_linear)(model)
                cache = model(prefix, use_cache=True).past_key_values

                def step():
                    model(new, past_key_values=cache, use_cache=True)
                    cache.crop(-n)  # drop the rows just appended: every call sees the same prefix

                out[label] = _median_ms(step, max(3, args.repeats // 3))
            forward_rows.append({"nodes": n, "torch_ms": out["torch"], "kernel_ms": out["kernel"]})
            print(f"  n={n:<4}{out['torch']:>9.1f}{out['kernel']:>9.1f}   x{out['torch'] / out['kernel']:.2f}", flush=True)
    res = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "repeats": args.repeats,
           "torch": torch.__version__, "max_rows_default": ROWS_LINEAR_MAX_ROWS, "layers": layer_rows,
           "forward": forward_rows}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
