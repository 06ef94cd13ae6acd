"""How far the GGUF target format is from the fp32 one on held-out text (Python standard library sources and
documentation strings on this machine, never HumanEval or MT-Bench): teacher-forced top-1 agreement of the two
formats' next-token choices, each format's perplexity, and the largest logit difference.

Both formats read the same Q4_1 / Q8_0 blocks; they differ in the GGUF forward's int8 activations per 32-block, its
float16 KV cache (and its float32 reduction orders). The GGUF forward with a float32 cache is measured too
(``gguf_f32_cache``), so the cache's share of the difference is on record, and the ``gguf-a16`` format (two int8
digits per activation, the float16 cache: ``gguf_a16``), so is the int8 rounding's. ``--peer llamacpp`` adds
llama.cpp on the same file and text (teacher-forced through its single-token decode path, ``taps-llamacpp-logits``
from ``scripts/build_llamacpp.sh``): its perplexity and its agreement with the fp32 format and with ours. Writes
JSON (default ``bench/results/gguf_quality_cpu.json``).
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
    ap.add_argument("--peer", choices=("none", "llamacpp"), default="none",
                    help="llamacpp: llama.cpp's logits on the same text beside ours (needs scripts/build_llamacpp.sh)")
    ap.add_argument("--out", default="bench/results/gguf_quality_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from taps.bench.peer_llamacpp import combine_gaps, llamacpp_logits, logit_gap, teacher_forced_logits
    from taps.decode.latency import cpu_name
    from taps.models.gguf_target import load_gguf_target
    from taps.models.target import load_target

    fp32, tok = load_target("smollm2", target_format="fp32", linear_kernel="torch")
    gguf, _ = load_target("smollm2", target_format="gguf")
    gguf_f32_cache = load_gguf_target(gguf.path, kv_dtype=torch.float32)
    gguf_a16, _ = load_target("smollm2", target_format="gguf-a16")
    peer = args.peer == "llamacpp"
    # each pair is (theirs, ours): logit_gap's positions predict the chunk's next tokens, so its last row is left out
    pairs = {"gguf_vs_fp32": ("fp32", "gguf"), "gguf_vs_gguf_f32_cache": ("gguf_f32_cache", "gguf"),
             "gguf_a16_vs_fp32": ("fp32", "gguf_a16")}
    if peer:
        pairs.update(llamacpp_vs_fp32=("fp32", "llamacpp"), llamacpp_vs_gguf=("gguf", "llamacpp"))
    gaps = {pair: [] for pair in pairs}
    nll = {}

    for ids in chunks(tok, args.length, args.chunks):
        logits = {"fp32": fp32(torch.tensor([ids])).logits[0].float(), "gguf": teacher_forced_logits(gguf, ids),
                  "gguf_f32_cache": teacher_forced_logits(gguf_f32_cache, ids),
                  "gguf_a16": teacher_forced_logits(gguf_a16, ids)}
        if peer:
            logits["llamacpp"] = llamacpp_logits(gguf.path, ids, 1, args.threads)
        nxt = torch.tensor(ids[1:])
        for name, lg in logits.items():
            nll[name] = nll.get(name, 0.0) + float(torch.nn.functional.cross_entropy(lg[:-1], nxt, reduction="sum"))
        for pair, (theirs, ours) in pairs.items():
            gaps[pair].append(logit_gap(logits[ours][:-1], logits[theirs][:-1]))
    totals = {pair: combine_gaps(gs) for pair, gs in gaps.items()}
    total = totals["gguf_vs_fp32"]["positions"]
    ppl = {k: math.exp(v / total) for k, v in nll.items()}
    res = {"cpu": cpu_name(), "threads": args.threads, "tokens": total, "chunks": args.chunks, "chunk_tokens": args.length,
           "text": "Python standard library sources: " + ", ".join(FILES),
           "kv_dtype": str(gguf.kv_dtype).replace("torch.", ""),
           "top1_agreement": totals["gguf_vs_fp32"]["top1_agreement"], "perplexity": ppl,
           "perplexity_ratio": ppl["gguf"] / ppl["fp32"],
           "max_abs_logit_diff": totals["gguf_vs_fp32"]["max_abs_logit_diff"],
           "top1_agreement_with_f32_cache": totals["gguf_vs_gguf_f32_cache"]["top1_agreement"],
           "gguf_a16": dict(totals["gguf_a16_vs_fp32"], perplexity_ratio=ppl["gguf_a16"] / ppl["fp32"])}
    if peer:
        res["llamacpp"] = {pair: totals[pair] for pair in ("llamacpp_vs_fp32", "llamacpp_vs_gguf", "gguf_vs_fp32")}
        res["llamacpp"]["path"] = "taps-llamacpp-logits --no-repack: one token per llama_decode (its greedy path)"
        res["llamacpp"]["perplexity_ratio"] = ppl["llamacpp"] / ppl["fp32"]
    print(json.dumps(res, indent=1))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
