"""Microbenchmarks of the fused kernels against their references and the usual PyTorch alternatives.

Tree attention, two head shapes: SmolLM2-135M (9 query / 3 KV heads, head dim 64) and a Qwen3-8B-like
layer (32 / 8, head dim 128); the headline point is prefix 4096, a 64-node tree, bf16 (GPU):
  * ``triton``      the Triton tree-attention kernel (GPU only; prefix split over SMs when B*Hkv is small),
  * ``reference``   the PyTorch reference (dense fp32 scores, the spec),
  * ``sdpa_mask``   ``scaled_dot_product_attention`` with a dense additive float mask ``[B,1,N,L]``
                    (K/V already expanded to Hq heads outside the timed region: favourable to SDPA),
  * ``flex``        FlexAttention with a block mask built from the ancestor bits (GPU, where available),
  * ``sdpa_causal`` causal flash attention: SDPA with a lower-right causal mask, i.e. the same N queries
                    over the same prefix as ordinary causal tokens (chunked prefill) - the cost a tree of
                    N nodes is compared against.
Top-K statistics (15 draft positions): ``triton``, ``reference``, and ``torch.topk`` alone.
Edge scoring (full 111->64 scorer): ``triton``, ``reference``, and ``cpp`` on CPU.

GPU: CUDA events, median of many runs. CPU: wall clock, median, reduced grid, and only the
PyTorch paths: the Triton interpreter is a correctness tool, not a speed path. ``--quick`` shrinks
every size so the script runs in seconds on a CPU (the smoke test in tests/ runs it that way).

Prints a table and writes ``bench/results/kernels_<device>.json`` (and a plot when matplotlib is present).
Usage: ``python bench/bench_kernels.py [--iters 50] [--quick] [--out DIR]``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import taps_kernels  # noqa: E402
from taps_kernels import ScorerWeights, candidate_pool  # noqa: E402
from taps_kernels.reference.attention import tree_attention_reference, tree_visibility  # noqa: E402
from taps_kernels.reference.mask import ancestor_bits_reference  # noqa: E402
from taps_kernels.reference.pool import topk_stats_reference  # noqa: E402
from taps_kernels.reference.score import score_edges_reference  # noqa: E402

# (label, Hq, Hkv, Dh) of the attention benchmark
SHAPES = [("smollm2", 9, 3, 64), ("qwen3-8b", 32, 8, 128)]
HEADLINE = (4096, 64)  # (prefix, tree nodes)
DRAFT_POSITIONS = 15


def _triton_ops():
    """The Triton entry points, or None when they cannot run here (no CUDA: the interpreter is not timed)."""
    if not torch.cuda.is_available():
        return None
    try:
        from taps_kernels.triton import score_edges_triton, topk_stats_triton, tree_attention_triton
    except ImportError:
        return None
    return {"tree_attention": tree_attention_triton, "topk_stats": topk_stats_triton,
            "score_edges": score_edges_triton}


def _flex():
    if not torch.cuda.is_available():
        return None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    import torch._dynamo as dynamo  # binds "dynamo": a bare "import torch._dynamo" here would make "torch" local
    # one compiled kernel per (shape, prefix, N) point: raise the recompile limit so no point falls back to eager
    dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def time_ms(fn, device, warmup, iters):
    """Median milliseconds of ``fn()``: CUDA events on GPU, ``perf_counter`` on CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def draft_tree(n_rows, device, seed=0):
    """A DDTree-shaped tree of ``n_rows`` rows (best-first pool of random draft logits)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, DRAFT_POSITIONS, 512, generator=g) * 3
    pool = candidate_pool(logits, torch.zeros(1, dtype=torch.int64), 16, n_rows - 1, backend="reference",
                          pool_backend="reference")
    return pool


def bench_attention(device, dtype, prefixes, sizes, warmup, iters, rows, shapes=SHAPES):
    triton_ops, flex = _triton_ops(), _flex()
    for label, HQ, HKV, DH in shapes:
        for P in prefixes:
            for N in sizes:
                pool = draft_tree(N, device)
                bits = ancestor_bits_reference(pool.tree.parents, pool.tree.num_nodes).to(device)
                L = P + N
                g = torch.Generator().manual_seed(P + N)
                q = torch.randn(1, HQ, N, DH, generator=g).to(device=device, dtype=dtype)
                # K/V as views of a preallocated cache with spare capacity, as a decoder holds them
                k = torch.randn(1, HKV, L + 256, DH, generator=g).to(device=device, dtype=dtype)[:, :, :L]
                v = torch.randn(1, HKV, L + 256, DH, generator=g).to(device=device, dtype=dtype)[:, :, :L]
                plen = torch.tensor([P], dtype=torch.int64, device=device)
                visible = tree_visibility(bits, plen, L)  # [1,N,L] bool
                add_mask = torch.zeros(1, 1, N, L, dtype=dtype, device=device).masked_fill(
                    ~visible[:, None], torch.finfo(dtype).min)
                kx, vx = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
                impls = {
                    "reference": lambda: tree_attention_reference(q, k, v, bits, plen),
                    "sdpa_mask": lambda: F.scaled_dot_product_attention(q, kx, vx, attn_mask=add_mask),
                }
                try:
                    from torch.nn.attention.bias import causal_lower_right
                    causal = causal_lower_right(N, L)
                    impls["sdpa_causal"] = lambda: F.scaled_dot_product_attention(q, kx, vx, attn_mask=causal)
                except ImportError:
                    pass
                if triton_ops is not None:
                    impls["triton"] = lambda: triton_ops["tree_attention"](q, k, v, bits, plen)
                if flex is not None and (P, N) == HEADLINE:  # one torch.compile per point: only the headline
                    flex_attention, create_block_mask = flex
                    vis = visible[0]

                    def mask_mod(b, h, q_idx, kv_idx):
                        return vis[q_idx, kv_idx]

                    block_mask = create_block_mask(mask_mod, None, None, N, L, device=device)
                    impls["flex"] = lambda: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
                if device.type == "cpu" and P * N * HQ > 4096 * 256 * 32:
                    impls.pop("reference")  # dense fp32 scores of this size take seconds per call on 2 cores
                flops = 4.0 * HQ * N * L * DH  # dense-equivalent work, same count for every implementation
                kv_bytes = 2.0 * HKV * L * DH * k.element_size()  # K and V read once: the floor for decode
                for name, fn in impls.items():
                    try:
                        ms = time_ms(fn, device, warmup, iters)
                    except Exception as exc:  # one failing path (e.g. flex on an old torch) must not end the run
                        print(f"  tree_attention  {label:9s} prefix={P:6d} N={N:5d}  {name:12s} FAILED: "
                              f"{type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    rows.append({"kernel": "tree_attention", "shape": label, "Hq": HQ, "Hkv": HKV, "Dh": DH,
                                 "impl": name, "prefix": P, "nodes": N, "ms": ms,
                                 "tflops": flops / (ms * 1e-3) / 1e12, "kv_gbps": kv_bytes / (ms * 1e-3) / 1e9})
                    print(f"  tree_attention  {label:9s} prefix={P:6d} N={N:5d}  {name:12s} {ms:10.3f} ms")


def bench_topk(device, vocab_sizes, top_k, warmup, iters, rows):
    triton_ops = _triton_ops()
    for V in vocab_sizes:
        logits = torch.randn(1, DRAFT_POSITIONS, V, device=device) * 3
        if device.type == "cuda":
            logits = logits.to(torch.bfloat16)
        impls = {
            "reference": lambda: topk_stats_reference(logits, top_k),
            "torch.topk": lambda: torch.topk(logits, top_k, dim=-1),
        }
        if triton_ops is not None:
            impls["triton"] = lambda: triton_ops["topk_stats"](logits, top_k)
        for name, fn in impls.items():
            ms = time_ms(fn, device, warmup, iters)
            rows.append({"kernel": "topk_stats", "impl": name, "vocab": V, "top_k": top_k, "ms": ms})
            print(f"  topk_stats      V={V:7d} K={top_k:3d}      {name:12s} {ms:10.3f} ms")


def bench_score(device, sizes, embed_dim, warmup, iters, rows):
    triton_ops = _triton_ops()
    g = torch.Generator().manual_seed(0)
    V = 4096
    emb = torch.randn(V, embed_dim, generator=g).to(device)
    weights = ScorerWeights.random(embed_dim, embed_dim, DRAFT_POSITIONS, generator=g).to(device)
    tiny = ScorerWeights.random(tiny=True, generator=g).to(device)
    for N in sizes:
        logits = torch.randn(1, DRAFT_POSITIONS, V, generator=g) * 3
        pool = candidate_pool(logits, torch.zeros(1, dtype=torch.int64), 16, N - 1, backend="reference",
                              pool_backend="reference")
        if device.type == "cuda":
            pool = type(pool)(pool.tree.to(device), *(getattr(pool, f).to(device) for f in (
                "logq", "step_logq", "rank", "topk_logp", "topk_ids", "entropy", "margin", "topk_mass")))
        hidden = torch.randn(1, DRAFT_POSITIONS, embed_dim, generator=g).to(device)
        for variant, w in (("full", weights), ("tiny", tiny)):
            impls = {"reference": lambda: score_edges_reference(pool, w, emb, hidden)}
            if triton_ops is not None:
                impls["triton"] = lambda: triton_ops["score_edges"](pool, w, emb, hidden)
            bk = taps_kernels.backend
            if device.type == "cpu" and bk.has_impl("score_edges", "cpp") and not bk.unavailable_reason("cpp", device):
                cpp = taps_kernels.backend.resolve("score_edges", "cpp", device)[1]
                impls["cpp"] = lambda: cpp(pool, w, emb, hidden)
            for name, fn in impls.items():
                ms = time_ms(fn, device, warmup, iters)
                rows.append({"kernel": f"score_edges_{variant}", "impl": name, "nodes": N, "embed_dim": embed_dim,
                             "ms": ms})
                print(f"  score_edges     {variant:4s} N={N:5d} E=H={embed_dim}  {name:12s} {ms:10.3f} ms")


def device_tag(device):
    if device.type == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    att = [r for r in rows if r["kernel"] == "tree_attention"]
    panels = list(dict.fromkeys((r["shape"], r["prefix"]) for r in att))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * (len(panels) + 1), 3.8), squeeze=False)
    for ax, (shape, P) in zip(axes[0], panels):
        for impl in sorted({r["impl"] for r in att}):
            pts = sorted((r["nodes"], r["ms"]) for r in att if (r["shape"], r["prefix"]) == (shape, P)
                         and r["impl"] == impl)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tree nodes N")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"tree attention {shape}, prefix {P}", fontsize=8)
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    other = [r for r in rows if r["kernel"] != "tree_attention"]
    labels = [f"{r['kernel'].replace('score_edges_', 'score/')}\n"
              f"{('V=' + str(r['vocab'])) if 'vocab' in r else ('N=' + str(r['nodes']))}\n{r['impl']}" for r in other]
    ax.barh(range(len(other)), [r["ms"] for r in other])
    ax.set_yticks(range(len(other)), labels, fontsize=5)
    ax.set_xscale("log")
    ax.set_xlabel("ms (median)")
    ax.set_title("top-K statistics and edge scoring")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_tables(rows):
    """Tree attention per shape against causal flash attention (ratio), then top-K against torch.topk."""
    att = [r for r in rows if r["kernel"] == "tree_attention"]
    impls = [i for i in ("triton", "flex", "sdpa_mask", "reference", "sdpa_causal") if any(r["impl"] == i for r in att)]
    print("\n# tree attention, ms (x = ratio to sdpa_causal: the same N queries as causal tokens over the same prefix)")
    print(f"{'shape':>9} {'prefix':>7} {'N':>5} " + " ".join(f"{i:>20}" for i in impls))
    for key in dict.fromkeys((r["shape"], r["prefix"], r["nodes"]) for r in att):
        pts = {r["impl"]: r["ms"] for r in att if (r["shape"], r["prefix"], r["nodes"]) == key}
        base = pts.get("sdpa_causal")
        cells = [f"{'-':>20}" if i not in pts else
                 f"{pts[i]:>11.3f}{(f' ({pts[i] / base:5.2f}x)' if base else ''):>9}" for i in impls]
        print(f"{key[0]:>9} {key[1]:>7} {key[2]:>5} " + " ".join(cells))
    top = [r for r in rows if r["kernel"] == "topk_stats"]
    if top:
        print("\n# top-K statistics, ms (x = ratio to torch.topk alone)")
        for V in dict.fromkeys(r["vocab"] for r in top):
            pts = {r["impl"]: r["ms"] for r in top if r["vocab"] == V}
            base = pts.get("torch.topk")
            print(f"  V={V:7d}  " + "  ".join(f"{i} {ms:.3f}" + (f" ({ms / base:.2f}x)" if base else "")
                                              for i, ms in pts.items()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=None, help="timed runs per point (default 100 GPU, 5 CPU)")
    ap.add_argument("--quick", action="store_true", help="smallest grid (smoke test)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU intra-op threads (default 1 on CPU: on a shared, oversubscribed machine OpenMP barrier "
                         "waits inflated sub-millisecond ops 200x with 2 threads)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    iters = args.iters or (100 if gpu else 5)
    if args.threads or not gpu:
        torch.set_num_threads(args.threads or 1)
    warmup = 10 if gpu else 1
    if gpu:
        prefixes, sizes, vocabs, score_sizes, embed, dtype = [4096, 16384], [16, 64, 256], [49152, 151936], \
            [16, 64, 256], 2560, torch.bfloat16
    else:
        prefixes, sizes, vocabs, score_sizes, embed, dtype = [512, 4096], [16, 64], [49152, 151936], [16, 64], 2560, \
            torch.float32
    if args.quick:  # seconds on a CPU: the smoke test
        prefixes, sizes, vocabs, score_sizes, embed = [128], [16], [4096], [16], 64
    note = ("GPU: CUDA events, median of %d runs" % iters if gpu else
            "CPU: wall clock, median of %d runs, reduced grid, PyTorch paths only (the Triton interpreter is a "
            "correctness tool, not a speed path, so Triton/FlexAttention are not timed here); the dense reference "
            "is skipped where prefix*N*Hq > 4096*256*32" % iters)
    print(f"# taps_kernels kernel benchmark on {device_tag(device)} ({note})")
    print(f"# tree attention shapes (label, Hq, Hkv, Dh): {SHAPES}, dtype={str(dtype).replace('torch.', '')}; "
          f"torch threads={torch.get_num_threads()}")
    rows = []
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # CPU numbers are only as quiet as the machine
    torch.set_grad_enabled(False)
    bench_attention(device, dtype, prefixes, sizes, warmup, iters, rows)
    bench_topk(device, vocabs, 64, warmup, iters, rows)
    bench_score(device, score_sizes, embed, warmup, iters, rows)
    print_tables(rows)

    os.makedirs(args.out, exist_ok=True)
    tag = device_tag(device)
    meta = {"device": tag, "torch": torch.__version__, "python": platform.python_version(),
            "cpu_threads": torch.get_num_threads(), "note": note, "iters": iters,
            "loadavg_1m_start": load_start, "loadavg_1m_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "attention_shapes": [dict(zip(("label", "Hq", "Hkv", "Dh"), sh)) for sh in SHAPES],
            "dtype": str(dtype), "quick": args.quick}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    json_path = os.path.join(args.out, f"kernels_{tag}.json")
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    png_path = os.path.join(args.out, f"kernels_{tag}.png")
    try:
        plot(rows, png_path, f"taps_kernels on {tag}" + ("" if gpu else " (wall clock, PyTorch paths only)"))
    except ImportError as exc:
        print(f"# plot skipped: {exc}")
        png_path = None
    print(f"# wrote {json_path}" + (f" and {png_path}" if png_path else ""))


if __name__ == "__main__":
    main()
