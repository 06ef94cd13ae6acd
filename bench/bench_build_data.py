"""``build-data``'s generation speed on this CPU: response tokens/s of the two generators at batch sizes
1..128, one thread, greedy, a fixed number of new tokens per row (no stop token, so every row makes them all),
the top-32 log-probabilities and the drafter's five feature layers captured as ``build-data`` does.

* ``fp32``: :class:`taps.data.generation.LlamaGenerator` over the dequantised fp32 target (the path of the
  ``fp32`` target format): left-padded batches, torch matrix products.
* ``gguf``: :class:`taps.data.gguf_generation.GGUFGenerator` over the shipped GGUF blocks (the default target
  format on AVX-512 VNNI CPUs): one C++ forward per step for all rows, the chat template's system turn
  prefilled once; with ``--kv-dtypes float32,float16`` also with a float32 KV cache (rows ``gguf-kv-float32``;
  the dtypes run in the order given at each batch size).

Each batch answers ``B`` prompts (a few code prompts of :mod:`taps.training.prompts` with the chat template,
repeated to fill the batch), admitted together, so the time includes their prefill. The table gives the
whole-batch rate in response tokens/s (what a shard of that batch size costs; ``tokens_per_s`` in the JSON
counts prompt tokens too, as ``stats.jsonl`` of ``build-data`` does) and, for ``gguf``, the decode steps alone and
the shares of the time spent in prefill and in choosing tokens (the top-k and the argmax). The load average is
recorded with the results: other processes on a shared machine slow every row.

Prints the table and writes JSON (default ``bench/results/build_data_cpu.json``).
"""
import argparse
import json
import os
import time

import torch


def _prompts(tok, n_distinct: int, max_prompt_tokens: int):
    from taps.models.target import apply_chat_template
    from taps.training.prompts import EvalFilter, build_prompts

    code = build_prompts(n_distinct, seed=0, eval_filter=EvalFilter())
    return [apply_chat_template(tok, p["text"])[-max_prompt_tokens:] for p in code]


def _run(gen, prompts, new_tokens, topk):
    t0 = time.perf_counter()
    res = gen.generate(prompts, new_tokens, eos_id=-1, topk=topk)
    el = time.perf_counter() - t0
    resp = sum(len(r.tokens) - r.prompt_len for r in res)
    assert resp == new_tokens * len(prompts), resp
    return resp, el


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,16,32,64,128")
    ap.add_argument("--fp32-batches", default="1,16,32,64",
                    help="batch sizes of the fp32 generator (its batch of 128 alone takes ~3 minutes here)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=6, help="distinct prompts, repeated to fill a batch")
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--kv-dtypes", default="float16",
                    help="KV cache dtypes of the gguf generator (float16: the format's; float32 beside it for an A/B)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/build_data_cpu.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from taps.data.generation import LlamaGenerator
    from taps.data.gguf_generation import GGUFGenerator
    from taps.decode.latency import cpu_name
    from taps.models.drafter import default_target_layer_ids
    from taps.models.gguf_target import load_gguf_target
    from taps.models.target import load_target
    from taps_kernels import _C

    batches = [int(b) for b in args.batches.split(",")]
    fp32_batches = [int(b) for b in args.fp32_batches.split(",") if b.strip()]
    load0 = os.getloadavg()
    t_start = time.time()
    gguf_target, tok = load_target("smollm2", target_format="gguf")
    kv_targets = {"gguf" if kv == "float16" else f"gguf-kv-{kv}":
                  load_gguf_target(gguf_target.path, kv_dtype=getattr(torch, kv))
                  for kv in args.kv_dtypes.split(",")}
    layer_ids = default_target_layer_ids(gguf_target.config.num_hidden_layers, 5)
    distinct = _prompts(tok, args.prompts, args.max_prompt_tokens)
    rows = []
    for B in batches:
        prompts = [distinct[i % len(distinct)] for i in range(B)]
        for name, target in kv_targets.items():
            gen = GGUFGenerator(target, layer_ids, batch_size=B)
            resp, el = _run(gen, prompts, args.new_tokens, args.topk)
            st = gen.last_stats
            rows.append({"generator": name, "batch": B, "response_tokens": resp, "seconds": round(el, 3),
                         "response_tokens_per_s": round(resp / el, 1),
                         "tokens_per_s": round((resp + sum(map(len, prompts))) / el, 1),
                         "decode_tokens_per_s": round(st["decode_rows"] / st["decode_seconds"], 1),
                         "prefill_share": round(st["prefill_seconds"] / el, 3),
                         "pick_share": round(st["pick_seconds"] / el, 3),
                         "prefill_tokens": st["prefill_rows"], "prompt_tokens": sum(map(len, prompts))})
            print(json.dumps(rows[-1]), flush=True)
    del gguf_target, kv_targets, gen
    fp32_target = load_target("smollm2", linear_kernel="torch", target_format="fp32")[0] if fp32_batches else None
    for B in fp32_batches:
        prompts = [distinct[i % len(distinct)] for i in range(B)]
        gen = LlamaGenerator(fp32_target, layer_ids)
        resp, el = _run(gen, prompts, args.new_tokens, args.topk)
        rows.append({"generator": "fp32", "batch": B, "response_tokens": resp, "seconds": round(el, 3),
                     "response_tokens_per_s": round(resp / el, 1),
                     "tokens_per_s": round((resp + sum(map(len, prompts))) / el, 1),
                     "prompt_tokens": sum(map(len, prompts))})
        print(json.dumps(rows[-1]), flush=True)
    res = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
           "kernel_path": _C.gguf_kernel_path(), "new_tokens": args.new_tokens, "topk": args.topk,
           "feature_layers": layer_ids, "distinct_prompts": len(distinct),
           "prompt_lengths": [len(p) for p in distinct], "load_average_before": [round(x, 2) for x in load0],
           "load_average_after": [round(x, 2) for x in os.getloadavg()],
           "seconds_total": round(time.time() - t_start, 1), "rows": rows}
    by = {(r["generator"], r["batch"]): r for r in rows}
    print(f"\n# {res['cpu']}, {args.threads} thread(s), {res['kernel_path']} kernels, "
          f"{args.new_tokens} new tokens per row, "
          f"top-{args.topk}, {len(layer_ids)} feature layers; load average {res['load_average_before'][0]:.1f} "
          f"before, {res['load_average_after'][0]:.1f} after")
    print(f"{'batch':>5} {'fp32 tok/s':>10} {'gguf tok/s':>10} {'x fp32':>7} {'gguf decode tok/s':>17} "
          f"{'gguf prefill %':>14}")
    for B in sorted({r["batch"] for r in rows}):
        f, g = by.get(("fp32", B)), by.get(("gguf", B))
        fs = f"{f['response_tokens_per_s']:>10.1f}" if f else f"{'-':>10}"
        gs = f"{g['response_tokens_per_s']:>10.1f}" if g else f"{'-':>10}"
        ratio = f"{g['response_tokens_per_s'] / f['response_tokens_per_s']:>7.2f}" if f and g else f"{'-':>7}"
        dec = f"{g['decode_tokens_per_s']:>17.1f} {100 * g['prefill_share']:>14.1f}" if g else ""
        print(f"{B:>5} {fs} {gs} {ratio} {dec}")
    for r in rows:
        if r["generator"].startswith("gguf-kv-"):
            print(f"{r['batch']:>5} {r['generator']}: {r['response_tokens_per_s']:.1f} tok/s")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    print(f"wrote {args.out} ({res['seconds_total']:.0f} s)")


if __name__ == "__main__":
    main()
