"""How far the GGUF target format is from the fp32 one on held-out text (Python standard library sources and
documentation strings on this machine, never HumanEval or MT-Bench): teacher-forced top-1 agreement of the
two formats' next-token choices, each format's perplexity, and the largest logit difference.

Both formats read the same Q4_1 / Q8_0 blocks; they differ in the GGUF forward's int8 activations per 32-block,
its float16 KV cache (and its float32 reduction orders). The GGUF forward with a float32 cache is measured too
(``gguf_f32_cache``), so the cache's share of the difference is on record. Writes JSON (default
``bench/results/gguf_quality_cpu.json``).
"""
import argparse
import json
import math
import sysconfig
from pathlib import Path

import torch

#: Standard library files read as held-out text (a mix of code and prose in docstrings).
FILES = ("textwrap.py", "fractions.py", "statistics.py", "heapq.py", "bisect.py", "difflib.py", "argparse.py",
         "csv.py", "calendar.py", "shlex.py", "pprint.py", "string.py")


def chunks(tok, length, count):
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in FILES:
        p = lib / name
        if not p.is_file():
            continue
        ids = tok(p.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids) - length, length * 4):
            out.append(ids[s:s + length])
            if len(out) >= count:
                return out
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--length", type=int, default=256, help="tokens per chunk")
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/gguf_quality_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from taps.decode.gguf_verifier import chain_bits
    from taps.decode.latency import cpu_name
    from taps.models.gguf_target import load_gguf_target
    from taps.models.target import load_target

    fp32, tok = load_target("smollm2", target_format="fp32", linear_kernel="torch")
    gguf, _ = load_target("smollm2", target_format="gguf")
    gguf_f32_cache = load_gguf_target(gguf.path, kv_dtype=torch.float32)
    agree = agree_cache = total = 0
    nll = {"fp32": 0.0, "gguf": 0.0, "gguf_f32_cache": 0.0}
    max_diff = 0.0

    def run(target, x):
        T = x.shape[1]
        keys, values = target.new_cache(1, T)
        return target.forward_rows(x, torch.arange(T)[None], torch.zeros(1, dtype=torch.int64),
                                   torch.zeros(1, dtype=torch.int64), chain_bits(T), keys, values,
                                   torch.zeros(0, dtype=torch.int64), torch.arange(T))[0]

    for ids in chunks(tok, args.length, args.chunks):
        T = len(ids)
        x = torch.tensor([ids])
        ref = fp32(x).logits[0].float()
        got, got_f32_cache = run(gguf, x), run(gguf_f32_cache, x)
        agree += int((ref[:-1].argmax(-1) == got[:-1].argmax(-1)).sum())
        agree_cache += int((got_f32_cache[:-1].argmax(-1) == got[:-1].argmax(-1)).sum())
        total += T - 1
        nxt = x[0, 1:]
        for name, lg in (("fp32", ref), ("gguf", got), ("gguf_f32_cache", got_f32_cache)):
            nll[name] += float(torch.nn.functional.cross_entropy(lg[:-1], nxt, reduction="sum"))
        max_diff = max(max_diff, float((ref - got).abs().max()))
    ppl = {k: math.exp(v / total) for k, v in nll.items()}
    res = {"cpu": cpu_name(), "tokens": total, "chunks": args.chunks, "chunk_tokens": args.length,
           "text": "Python standard library sources: " + ", ".join(FILES),
           "kv_dtype": str(gguf.kv_dtype).replace("torch.", ""),
           "top1_agreement": agree / total, "perplexity": ppl, "perplexity_ratio": ppl["gguf"] / ppl["fp32"],
           "max_abs_logit_diff": max_diff, "top1_agreement_with_f32_cache": agree_cache / total}
    print(json.dumps(res, indent=1))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
