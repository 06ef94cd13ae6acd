"""Our AR decode loop against HF ``generate(do_sample=False)``: same target, same prompts, same process.

Three runs per (prompt, repeat), in an order rotated per repeat, each with a fixed number of new tokens
(``min_new_tokens`` for HF, no stop tokens for ours): ``ours`` (our AR loop on the model as
``load_target`` returns it, linear layers on the few-row kernel), ``hf`` (HF generate on that same
model) and ``hf_stock`` (HF generate with torch's own linear layers, the model as HF ships it). The
tokens of all three must be identical. Prints a
table and writes JSON (default ``bench/results/ar_vs_hf_cpu.json``). ``taps bench-suite --hf-baseline``
records the same comparison inside the full benchmark, where each prompt runs both only once.
"""
import argparse
import json
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=5, help="first N HumanEval prompts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/ar_vs_hf_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from taps.data import encode_prompt
    from taps.data import load_humaneval
    from taps.decode import SpeculativeDecoder
    from taps.decode.policies import make_policy
    from taps.models.target import load_target
    from taps_kernels.integrations.rows_linear import restore_linear, use_rows_linear

    model, tok = load_target("smollm2")
    dec = SpeculativeDecoder(model, make_policy("ar"), stop_token_ids=[])
    rows = []
    names = ["ours", "hf", "hf_stock"]
    for item in load_humaneval(args.prompts):
        ids = encode_prompt(tok, item.turns[0], raw=item.raw, history=[])
        inp = torch.tensor([ids])
        for rep in range(args.repeats):
            times, tokens = {}, {}
            for name in names[rep % 3:] + names[:rep % 3]:
                t0 = time.perf_counter()
                if name == "ours":
                    tokens[name] = dec.generate(ids, args.new_tokens).token_ids
                else:
                    if name == "hf_stock":
                        restore_linear(model)
                    with torch.inference_mode():
                        g = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                           max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                           temperature=None, top_p=None, top_k=None)
                    tokens[name] = g[0, len(ids):].tolist()
                times[name] = (time.perf_counter() - t0) / args.new_tokens
                if name == "hf_stock":
                    use_rows_linear(model)  # back to the kernel, outside the timed region
            rows.append({"id": item.id, "repeat": rep, **{f"{k}_ms_per_token": 1e3 * v for k, v in times.items()},
                         "identical": tokens["ours"] == tokens["hf"] == tokens["hf_stock"]})
    med = {k: statistics.median(r[f"{k}_ms_per_token"] for r in rows) for k in names}
    summary = {"prompts": args.prompts, "repeats": args.repeats, "new_tokens": args.new_tokens,
               "threads": args.threads, "median_ms_per_token": med,
               "hf_time_over_ours": med["hf"] / med["ours"], "hf_stock_time_over_ours": med["hf_stock"] / med["ours"],
               "all_identical": all(r["identical"] for r in rows), "runs": rows}
    print(f"{'':<34}{'ms/token (median)':>18}")
    for k, label in (("ours", "ours AR (few-row kernel)"), ("hf", "HF generate, same model"),
                     ("hf_stock", "HF generate, torch linear")):
        print(f"{label:<34}{med[k]:>18.1f}")
    print(f"HF time / our time: {summary['hf_time_over_ours']:.3f} (same model), "
          f"{summary['hf_stock_time_over_ours']:.3f} (torch linear); identical tokens: {summary['all_identical']}")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
