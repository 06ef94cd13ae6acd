"""The GGUF target on this CPU: (1) the block kernels over all of SmolLM2's 211 matrices at M rows, against
torch fp32 / bf16 / int8 (fbgemm dynamic) linear layers over the same matrices and the streaming floor, and the
same kernels with two activation digits (the ``gguf-a16`` format, timed alternating with ``gguf``);
(2) a target step (one thread, a prefix of ``--prefix`` tokens) of the GGUF forward in both formats against the
fp32 HF target: decode (1 node) and verifies of n-node trees (chains and bushy trees); (3) a batched decode step as data
generation runs it (``--batch`` rows, each its own prefix of random keys and values, one new token each) with
the float16 cache the format defines against a float32 one: ms per row at each prefix length; (4) the anatomy of
a decode step (``--anatomy-prefixes``): the forward of one token at each prefix with and without its logits, so
the head's share is the difference and attention's is the growth with the prefix (ms per 100 keys over the
smallest prefix), against the time of streaming the step's bytes (blocks + keys and values) once.

Prints the tables and writes JSON (default ``bench/results/gguf_target_cpu.json``); every record names the
CPU and the block-kernel path that ran (``kernel_path``); ``--compare-path`` adds a column for a slower path of
the same CPU (on an AMX CPU: ``--compare-path vnni``), the two timed in alternating order. Where the VNNI path
runs (or is compared), the kernel and step tables add the compute floors that this core's measured instruction
rates set (``cpu_units.py``): what no kernel with these numerics can beat here. Medians of repeated calls.
"""
import argparse
import json
import random
import statistics
import time

import torch
from bench_rows_linear import _median_ms  # run as `python bench/...`: its folder is on the path
from cpu_units import attention_floor_ms_per_row, block_kernel_floor_ms, unit_rates


FEATURE_LAYERS = [1, 8, 14, 20, 27]  # the shipped drafter's feature layers: a verify returns them too


def _stream_floor_ms(nbytes: int, repeats: int) -> float:
    """Time to read ``nbytes`` once (a uint8 sum over a buffer of that size: what streaming costs here)."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    return _median_ms(lambda: buf.sum(), repeats)


def _interleaved_median_ms(a, b, repeats):
    """Medians of ``a`` and ``b`` timed in alternating order (a b, b a, ...): this machine's speed drifts by 10-20%
    over seconds, which a side-by-side figure timed one after the other would carry."""
    a(), b()
    ts = ([], [])
    for i in range(2 * repeats):
        for j in ((0, 1) if i % 2 else (1, 0)):
            t0 = time.perf_counter()
            (a, b)[j]()
            ts[j].append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts[0]), 1e3 * statistics.median(ts[1])


def kernel_table(rows, repeats, compare_path=None, rates=None):
    from taps.models.gguf_file import GGUFFile
    from taps.models.target import find_smollm2_gguf
    from taps_kernels import _C

    mats, fp32 = [], []
    for t in GGUFFile(find_smollm2_gguf()).tensors.values():
        if t.ggml_type not in (3, 8):
            continue
        K, N = t.shape[0], t.shape[1]
        raw = torch.from_numpy(t.data.reshape(N, -1).copy())
        mats.append((_C.gguf_pack(raw, t.ggml_type, K), t.ggml_type, N, K))
        fp32.append(_C.gguf_dequantize(raw, t.ggml_type, K))
    nbytes = sum(m[0].numel() for m in mats)
    macs = sum(n * k for _, _, n, k in mats)
    bf16 = [w.bfloat16() for w in fp32]
    int8 = [torch.ao.nn.quantized.dynamic.Linear(w.shape[1], w.shape[0], bias_=False) for w in fp32]
    for mod, w in zip(int8, fp32):
        mod.set_weight_bias(torch.quantize_per_channel(w, (w.abs().amax(1) / 127).clamp(min=1e-8),
                                                       torch.zeros(w.shape[0], dtype=torch.int64), 0, torch.qint8), None)
    floor = _stream_floor_ms(nbytes, repeats)
    out = []
    for M in rows:
        xs = {K: torch.randn(M, K) for K in (576, 1536)}
        xb = {K: x.bfloat16() for K, x in xs.items()}
        own = lambda: [_C.gguf_linear(xs[k], p, t, n, k) for p, t, n, k in mats]  # noqa: E731
        # the gguf-a16 format's products: two activation digits, twice the rows through the same kernels
        a16 = lambda: [_C.gguf_linear(xs[k], p, t, n, k, "auto", 2) for p, t, n, k in mats]  # noqa: E731
        rec = {"rows": M}
        rec["gguf_ms"], rec["gguf_a16_ms"] = _interleaved_median_ms(own, a16, repeats)
        if compare_path:  # another block-kernel path of this CPU over the same matrices (same bits, other units)
            other = lambda: [_C.gguf_linear(xs[k], p, t, n, k, compare_path) for p, t, n, k in mats]  # noqa: E731
            _, rec[f"{compare_path}_ms"] = _interleaved_median_ms(own, other, repeats)
        rec["fp32_ms"] = _median_ms(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in fp32], repeats)
        rec["bf16_ms"] = _median_ms(lambda: [torch.nn.functional.linear(xb[w.shape[1]], w) for w in bf16], repeats)
        rec["int8_fbgemm_ms"] = _median_ms(lambda: [m(xs[m.in_features]) for m in int8], repeats)
        rec["gguf_GBps"] = nbytes / rec["gguf_ms"] / 1e6
        rec["gguf_GOPs"] = 2 * macs * M / rec["gguf_ms"] / 1e6
        if rates:
            rec["vnni_floor_ms"], rec["vnni_dots_only_floor_ms"] = block_kernel_floor_ms([m[1:] for m in mats], M,
                                                                                         rates)
        out.append(rec)
    return {"matrices": len(mats), "bytes": nbytes, "stream_floor_ms": floor, "rows": out}


def _tree(rng, n, chain):
    from taps_kernels import Tree

    parents = [-1] + [(i - 1 if chain else rng.randrange(max(0, i - 4), i)) for i in range(1, n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    return Tree(torch.tensor([[rng.randrange(49152) for _ in range(n)]]), torch.tensor([parents], dtype=torch.int32),
                torch.tensor([depth], dtype=torch.int32), torch.tensor([n], dtype=torch.int32))


def step_table(nodes, prefix, repeats, with_fp32, rates=None):
    from taps.decode.verifier import make_verifier
    from taps.models.target import load_target

    targets = {fmt: load_target("smollm2", target_format=fmt)[0] for fmt in ("gguf", "gguf-a16")}
    if with_fp32:
        targets["fp32"] = load_target("smollm2", target_format="fp32")[0]
    shapes = _matrix_shapes() if rates else None
    rng = random.Random(0)
    prompt = torch.tensor([[rng.randrange(49152) for _ in range(prefix)]])
    out = []
    for fmt, model in targets.items():
        v = make_verifier(model, FEATURE_LAYERS)
        v.prefill(prompt, prefix + max(nodes) + 1)
        for n in nodes:
            for shape in (("chain", "tree") if n > 2 else ("chain",)):
                tree = _tree(rng, n, shape == "chain")
                out.append({"format": fmt, "nodes": n, "shape": shape,
                            "ms": _median_ms(lambda: v.verify(tree), repeats)})
                if rates and fmt != "fp32":
                    out[-1]["vnni_compute_floor_ms"] = _step_floor_ms(targets[fmt], shapes, n, prefix, rates)
    return out


def _matrix_shapes():
    """(GGML type, N, K) of SmolLM2's block matrices, as the kernel table runs them."""
    from taps.models.gguf_file import GGUFFile
    from taps.models.target import find_smollm2_gguf

    return [(t.ggml_type, t.shape[1], t.shape[0]) for t in GGUFFile(find_smollm2_gguf()).tensors.values()
            if t.ggml_type in (3, 8)]


def _step_floor_ms(target, shapes, nodes, prefix, rates):
    """The VNNI path's compute floor of an n-node verify at ``prefix``: the block kernels at n rows (2n with two
    activation digits) and n rows of attention over the prefix (cpu_units.py); a decode step is bound by memory
    instead, so its floor is the streaming one."""
    c = target.config
    block_ms, _ = block_kernel_floor_ms(shapes, nodes * target.activation_digits, rates)
    return block_ms + nodes * attention_floor_ms_per_row(c.num_hidden_layers, c.num_attention_heads, c.head_dim,
                                                         prefix, rates)


def batch_decode_table(batch, prefixes, repeats):
    """ms per row of one decode step over ``batch`` rows at each prefix, float32 and float16 caches interleaved."""
    from taps.decode.gguf_verifier import chain_bits
    from taps.models.gguf_target import load_gguf_target
    from taps.models.target import find_smollm2_gguf

    targets = {str(dt).replace("torch.", ""): load_gguf_target(find_smollm2_gguf(), kv_dtype=dt)
               for dt in (torch.float32, torch.float16)}
    c = targets["float16"].config
    gen = torch.Generator().manual_seed(0)
    none, rows = torch.zeros(0, dtype=torch.int64), torch.arange(batch)
    bits = chain_bits(1).expand(batch, 1, 1).contiguous()
    out = []
    for P in prefixes:
        rec = {"batch": batch, "prefix": P}
        shape = (batch, c.num_key_value_heads, P + 1, c.head_dim)
        cache = [torch.randn(shape, generator=gen) for _ in range(2 * c.num_hidden_layers)]
        tok = torch.randint(0, c.vocab_size, (batch, 1), generator=gen)
        pos, pre = torch.full((batch, 1), P), torch.full((batch,), P)
        for name, t in targets.items():
            kv = [x.to(t.kv_dtype) for x in cache]
            L = c.num_hidden_layers
            rec[f"{name}_ms_per_row"] = _median_ms(
                lambda: t.forward_rows(tok, pos, pre, rows, bits, kv[:L], kv[L:], none, rows), repeats) / batch
        out.append(rec)
    return out


def anatomy_table(prefixes, repeats, block_bytes, stream_floor_ms_per_byte):
    """One decode step (one token, no features) at each prefix: ms with and without the head's logits."""
    from taps.decode.gguf_verifier import chain_bits
    from taps.models.gguf_target import load_gguf_target
    from taps.models.target import find_smollm2_gguf

    t = load_gguf_target(find_smollm2_gguf())
    c = t.config
    none, row = torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    out = []
    for P in prefixes:
        keys, values = t.new_cache(1, P + 1)
        for buf in keys + values:
            buf.copy_(torch.randn(buf.shape, generator=gen))
        args = (torch.tensor([[5]]), torch.tensor([[P]]), torch.tensor([P]), row, chain_bits(1), keys, values, none)
        body, step = _interleaved_median_ms(lambda: t.forward_rows(*args, none), lambda: t.forward_rows(*args, row),
                                            repeats)
        kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * P * c.head_dim * keys[0].element_size()
        out.append({"prefix": P, "step_ms": step, "without_head_ms": body, "head_ms": step - body,
                    "kv_bytes": kv_bytes, "stream_floor_ms": (block_bytes + kv_bytes) * stream_floor_ms_per_byte})
    base = out[0]
    for r in out[1:]:
        r["attention_ms_per_100_keys"] = 100 * (r["without_head_ms"] - base["without_head_ms"]) / (
            r["prefix"] - base["prefix"])
    return out


def _ints(text):
    return [int(v) for v in text.split(",") if v.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--nodes", default="1,2,4,8,16,32,64")
    ap.add_argument("--prefix", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 HF target in the step table")
    ap.add_argument("--batch", type=int, default=64, help="rows of the batched decode table (0: skip it)")
    ap.add_argument("--batch-prefixes", default="16,150,300,450")
    ap.add_argument("--anatomy-prefixes", default="16,250,500,1000",
                    help="prefixes of the decode-step anatomy table ('' to skip it)")
    ap.add_argument("--compare-path", default=None, choices=["vnni", "avx2", "scalar"],
                    help="also time the block kernels through this slower path (e.g. vnni on an AMX CPU)")
    ap.add_argument("--out", default="bench/results/gguf_target_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from taps.decode.latency import cpu_name
    from taps_kernels import _C

    torch.set_grad_enabled(False)
    path = _C.gguf_kernel_path()
    vnni_col = "gguf_ms" if path == "vnni" else ("vnni_ms" if args.compare_path == "vnni" else None)
    rates, why = unit_rates() if vnni_col else (None, f"the {path} path runs here; the floors are the VNNI path's")
    res = {"cpu": cpu_name(), "threads": args.threads, "kernel_path": path,
           "unit_rates": rates if rates else {"unavailable": why},
           "kernels": kernel_table(_ints(args.rows) or [1], args.repeats, args.compare_path, rates)}
    k = res["kernels"]
    print(f"# {res['cpu']}, {args.threads} thread(s), {res['kernel_path']} kernels: "
          f"all {k['matrices']} matrices of SmolLM2 "
          f"({k['bytes'] / 1e6:.1f} MB of blocks; streaming them once: {k['stream_floor_ms']:.2f} ms)")
    if rates:
        print(f"# this core, per second: vpdpbusd {rates['vpdpbusd_per_s'] / 1e9:.2f} G, vmulps "
              f"{rates['vmulps_per_s'] / 1e9:.2f} G, the two alternating {rates['vpdpbusd_vmulps_per_s'] / 1e9:.2f} G, "
              f"vfmadd231ps {rates['vfmadd231ps_per_s'] / 1e9:.2f} G (cpu_units.py); VNNI floor: 8 vpdpbusd + the "
              f"float step's 3 (Q4_1) / 2 (Q8_0) multiplies per 16 outputs, row and block")
    else:
        print(f"# no compute floors: {why}")
    other = f"{args.compare_path}_ms" if args.compare_path else None
    floors = f" {'floor ms':>8} {'x floor':>7}" if rates else ""
    print(f"{'rows':>5} {'gguf ms':>8} {'GB/s':>6} {'GOP/s':>7} {'a16 ms':>7} {'fp32 ms':>8} {'bf16 ms':>8} "
          f"{'int8 ms':>8}" + (f" {other:>9}" if other else "") + floors)
    for r in k["rows"]:
        print(f"{r['rows']:>5} {r['gguf_ms']:>8.2f} {r['gguf_GBps']:>6.1f} {r['gguf_GOPs']:>7.0f} "
              f"{r['gguf_a16_ms']:>7.2f} {r['fp32_ms']:>8.2f} {r['bf16_ms']:>8.2f} {r['int8_fbgemm_ms']:>8.2f}"
              + (f" {r[other]:>9.2f}" if other else "")
              + (f" {r['vnni_floor_ms']:>8.2f} {r[vnni_col] / r['vnni_floor_ms']:>7.2f}" if rates else ""))
    res["prefix"] = args.prefix
    res["steps"] = step_table(_ints(args.nodes) or [1], args.prefix, args.repeats, not args.no_fp32, rates)
    print(f"\n# target step, prefix {args.prefix}: one verify forward (logits + the drafter's 5 feature layers)"
          + ("; floor: the VNNI block kernels' and attention's compute floor (a decode step is bound by memory)"
             if rates else ""))
    print(f"{'format':>8} {'nodes':>5} {'shape':>6} {'ms':>8} {'x decode':>8}" + (f" {'floor ms':>8}" if rates else ""))
    base = {s["format"]: s["ms"] for s in res["steps"] if s["nodes"] == 1}
    for s in res["steps"]:
        floor = s.get("vnni_compute_floor_ms")
        print(f"{s['format']:>8} {s['nodes']:>5} {s['shape']:>6} {s['ms']:>8.2f} {s['ms'] / base[s['format']]:>8.2f}"
              + ((f" {floor:>8.2f}" if floor is not None else f" {'':>8}") if rates else ""))
    if args.batch:
        res["batch_decode"] = batch_decode_table(args.batch, _ints(args.batch_prefixes),
                                                 max(3, args.repeats // 2))
        print(f"\n# gguf decode step over {args.batch} rows, each its own prefix: ms per row by KV cache dtype")
        print(f"{'prefix':>6} {'float32':>8} {'float16':>8}")
        for r in res["batch_decode"]:
            print(f"{r['prefix']:>6} {r['float32_ms_per_row']:>8.3f} {r['float16_ms_per_row']:>8.3f}")
    if _ints(args.anatomy_prefixes):
        per_byte = k["stream_floor_ms"] / k["bytes"]
        res["decode_anatomy"] = anatomy_table(_ints(args.anatomy_prefixes), max(9, args.repeats), k["bytes"], per_byte)
        print("\n# gguf decode step (one token, logits, no features) by prefix: where the time goes")
        print(f"{'prefix':>6} {'step ms':>8} {'no head':>8} {'head':>6} {'attn ms/100 keys':>16} {'stream floor':>12}")
        for r in res["decode_anatomy"]:
            slope = r.get("attention_ms_per_100_keys")
            print(f"{r['prefix']:>6} {r['step_ms']:>8.2f} {r['without_head_ms']:>8.2f} {r['head_ms']:>6.2f} "
                  f"{'' if slope is None else f'{slope:.3f}':>16} {r['stream_floor_ms']:>12.2f}")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
