"""Our AR decode loop against HF ``generate(do_sample=False)``: same target, same prompts, same process.

Each (prompt, repeat) runs both, alternating which goes first, with a fixed number of new tokens
(``min_new_tokens`` for HF, no stop tokens for ours), and checks the tokens are identical. Prints a
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
    from taps.cli.common import encode_prompt
    from taps.data import load_humaneval
    from taps.decode import SpeculativeDecoder
    from taps.decode.policies import make_policy
    from taps.models.target import load_target

    model, tok = load_target("smollm2")
    dec = SpeculativeDecoder(model, make_policy("ar"), stop_token_ids=[])
    rows = []
    for item in load_humaneval(args.prompts):
        ids = encode_prompt(tok, item.turns[0], raw=item.raw, history=[])
        inp = torch.tensor([ids])
        for rep in range(args.repeats):
            times = {}
            for name in (("ours", "hf") if rep % 2 == 0 else ("hf", "ours")):
                t0 = time.perf_counter()
                if name == "ours":
                    out = dec.generate(ids, args.new_tokens).token_ids
                else:
                    with torch.inference_mode():
                        g = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                           max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                           temperature=None, top_p=None, top_k=None)
                    hf_tokens = g[0, len(ids):].tolist()
                times[name] = (time.perf_counter() - t0) / args.new_tokens
            rows.append({"id": item.id, "repeat": rep, "ours_ms_per_token": 1e3 * times["ours"],
                         "hf_ms_per_token": 1e3 * times["hf"], "identical": out == hf_tokens})
    ours = statistics.median(r["ours_ms_per_token"] for r in rows)
    hf = statistics.median(r["hf_ms_per_token"] for r in rows)
    summary = {"prompts": args.prompts, "repeats": args.repeats, "new_tokens": args.new_tokens,
               "threads": args.threads, "median_ms_per_token": {"ours_ar": ours, "hf_generate": hf},
               "hf_time_over_ours": hf / ours, "all_identical": all(r["identical"] for r in rows), "runs": rows}
    print(f"{'':<10}{'ms/token (median)':>18}")
    print(f"{'ours AR':<10}{ours:>18.1f}\n{'HF':<10}{hf:>18.1f}")
    print(f"HF time / our time: {hf / ours:.3f}; identical tokens: {summary['all_identical']}")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
