"""Per-policy figures of a batch-1 run (tau, tokens/s, speedup over AR, nodes per round, time split) and
their table."""
from __future__ import annotations

import statistics
from typing import Dict, List

from taps.decode.stats import BUILD_STAGES, SPLIT_HEADER, SPLIT_STAGES


def summarize(results: Dict[str, List[dict]]) -> Dict[str, dict]:
    """Per policy: tau, tokens/s (median, mean over prompts), speedup over AR (time per token, prefills
    included), decode-only tokens/s, nodes per round, time split."""
    def per_token(recs):
        tokens = sum(r["new_tokens"] for r in recs)
        return sum(r["seconds"] for r in recs) / tokens if tokens else float("nan")

    ar_spt = per_token(results["ar"]) if results.get("ar") else float("nan")
    out = {}
    for spec, recs in results.items():
        if not recs:
            continue
        tps = [r["tokens_per_s"] for r in recs]
        spt = per_token(recs)
        rounds = sum(r.get("rounds", 0) for r in recs)
        accepted = sum(sum(r.get("accept_lens", [])) for r in recs)
        split: Dict[str, float] = {}
        for r in recs:
            for k, v in r.get("time_split", {}).items():
                split[k] = split.get(k, 0.0) + v
        total = sum(r["seconds"] for r in recs)
        # the prefill of every turn and the token it gives excluded: what a decode-only figure (llama-bench's) counts
        decode_s = total - split.get("prefill", 0.0)
        decode_tokens = sum(r["new_tokens"] - len(r.get("turns", ())) for r in recs)
        out[spec] = {
            "prompts": len(recs),
            "new_tokens": sum(r["new_tokens"] for r in recs),
            "seconds": total,
            "tau": accepted / rounds if rounds else None,
            "tokens_per_s_median": statistics.median(tps),
            "tokens_per_s_mean": statistics.fmean(tps),
            "decode_tokens_per_s": decode_tokens / decode_s if "prefill" in split and decode_s > 0 else None,
            "speedup": ar_spt / spt if spt == spt and spt > 0 else None,
            "nodes_per_round": sum(r.get("nodes", 0) for r in recs) / rounds if rounds else None,
            "rounds": rounds,
            "drafted_frac": sum(r.get("drafted_rounds", 0) for r in recs) / rounds if rounds else None,
            "time_split_s": split,
            "time_split_frac": {k: v / total for k, v in split.items()} if total > 0 else {},
            "identical_to_ar": sum(1 for r in recs if r.get("identical_to_ar")),
        }
    return out


def _hist(values):
    h = {}
    for v in values:
        h[str(v)] = h.get(str(v), 0) + 1
    return dict(sorted(h.items(), key=lambda kv: int(kv[0])))


def block_summary(results):
    """:func:`summarize` plus, per policy, the acceptance-length histogram, selection overhead and stage
    milliseconds per round, and the per-prompt figures (what a ``taps bench`` record keeps)."""
    summary = summarize(results)
    for spec, recs in results.items():
        s = summary[spec]
        s["accept_len_hist"] = _hist([a for r in recs for a in r.get("accept_lens", [])])
        rounds = max(s["rounds"], 1)
        sp = s["time_split_s"]
        s["selection_overhead_ms_per_round"] = 1000 * sum(sp.get(k, 0.0) for k in BUILD_STAGES[1:]) / rounds
        s["stage_ms_per_round"] = {k: 1000 * v / rounds for k, v in sp.items() if k != "prefill"}
        s["per_prompt"] = [{"id": r["id"], "new_tokens": r["new_tokens"], "seconds": r["seconds"], "tau": r.get("tau"),
                            "identical_to_ar": r["identical_to_ar"],
                            "prompt_tokens": sum(t.get("prompt_len", 0) for t in r.get("turns", ())),
                            "prefix_reused": sum(t.get("prefix_reused", 0) for t in r.get("turns", ()))} for r in recs]
    return summary


def best_ddtree(summary):
    """The DDTree budget (``ddtree:B``) with the highest median tokens/s, or None."""
    dd = {k: v for k, v in summary.items() if k.startswith("ddtree:")}
    if not dd:
        return None
    return max(dd, key=lambda k: dd[k]["tokens_per_s_median"])


def decode_speedup(summary: Dict[str, dict], spec: str):
    """AR's time per decoded token over ``spec``'s, the prefills and the tokens they give left out (every
    policy prefills the same way: this is the part speculation can speed up); None without decode figures."""
    ar, s = summary.get("ar") or {}, summary.get(spec) or {}
    if not ar.get("decode_tokens_per_s") or not s.get("decode_tokens_per_s"):
        return None
    return s["decode_tokens_per_s"] / ar["decode_tokens_per_s"]


def format_table(summary: Dict[str, dict]) -> str:
    head = (f"{'policy':<14}{'tau':>6}{'tok/s med':>11}{'tok/s mean':>11}{'speedup':>9}{'decode':>8}{'nodes/rd':>9}"
            f"{'same as AR':>12}  {SPLIT_HEADER}")
    lines = [head, "-" * len(head)]
    for spec, s in summary.items():
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
        nodes = f"{s['nodes_per_round']:.1f}" if s["nodes_per_round"] is not None else "-"
        sp = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        dsp = decode_speedup(summary, spec)
        dsp = f"{dsp:.2f}x" if dsp is not None else "-"
        frac = s["time_split_frac"]
        split = "/".join(f"{100 * frac.get(k, 0.0):.0f}" for k in SPLIT_STAGES) if s["rounds"] else "-"
        lines.append(f"{spec:<14}{tau:>6}{s['tokens_per_s_median']:>11.2f}{s['tokens_per_s_mean']:>11.2f}"
                     f"{sp:>9}{dsp:>8}{nodes:>9}{s['identical_to_ar']:>7}/{s['prompts']:<4}  {split}")
    return "\n".join(lines)

