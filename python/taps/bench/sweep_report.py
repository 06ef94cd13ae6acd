"""The batch sweep's part of ``taps report``: tables of batch size x policy from the ``batch`` sections of
``taps bench`` JSON, and the whole report (:mod:`.run_report`, then these tables)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from taps.decode.stats import BUILD_STAGES

from .run_report import write_report


def load_sweeps(paths) -> List[dict]:
    """The ``batch`` sections of every ``taps bench`` JSON, in file order."""
    return [s for p in paths for s in json.loads(Path(p).read_text()).get("batch", [])]


def _cell(x, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _grid(rows: List[dict], policies: List[str], sizes: List[int], fmt) -> List[str]:
    at = {(r["policy"], r["batch_size"]): r for r in rows}
    L = ["| B | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    for b in sizes:
        L.append(f"| {b} | " + " | ".join(fmt(at.get((p, b))) for p in policies) + " |")
    return L


def _stages(r) -> str:
    st = (r or {}).get("stage_ms_per_round")
    if not st:
        return "-"
    build = sum(st.get(k, 0.0) for k in BUILD_STAGES)
    return f"{build:.0f} / {st.get('verify', 0.0):.0f}"


def crossover(rows: List[dict], policy: str) -> Optional[int]:
    """The smallest batch size from which ``policy`` no longer beats batched AR (speedup < 1 there and at
    every larger size measured); None when it beats AR at the largest size."""
    sp = sorted((r["batch_size"], r["speedup"]) for r in rows if r["policy"] == policy and r["speedup"] is not None)
    first = None
    for b, s in sp:
        if s < 1.0:
            first = b if first is None else first
        else:
            first = None
    return first


def batch_tables(sweep: dict) -> List[str]:
    """Markdown for one dataset's batch sweep: total tokens/s, speedup over batched AR (with tau) and
    per-request tokens/s, batch size x policy; AR's scaling with B and each policy's crossover."""
    rows = sweep["rows"]
    sizes = sorted({r["batch_size"] for r in rows})
    policies = [p for p in sweep.get("policies") or dict.fromkeys(r["policy"] for r in rows)
                if any(r["policy"] == p for r in rows)]
    spec = [p for p in policies if p != "ar"]
    part = " (PARTIAL: run cut short)" if sweep.get("partial") else ""
    same = [r for r in rows if r.get("identical_to_ar") is not None]
    L = [f"## Batch sweep: {sweep['dataset']}, temperature {sweep['temperature']:g}, {sweep['prompts']} prompts, "
         f"{', '.join(policies)}{part}",
         "",
         "Total tokens/s (all output tokens / wall time of the batch run; B = 1 is the single-request protocol, "
         "its wall time the policy's summed generation time):", ""]
    L += _grid(rows, policies, sizes, lambda r: _cell(r and r["total_tokens_per_s"], ".2f"))
    if any(r.get("decode_tokens_per_s") for r in rows):
        L += ["", "Decode tokens/s (tokens / (wall - prefill time); each prompt is prefilled alone while the other "
              "rows wait):", ""]
        L += _grid(rows, policies, sizes, lambda r: _cell(r and r.get("decode_tokens_per_s"), ".2f"))
    L += ["", "Speedup over batched AR at the same B (tau in parentheses):", ""]
    L += _grid(rows, spec, sizes, lambda r: "-" if r is None or r["speedup"] is None else
               f"{r['speedup']:.2f}x ({_cell(r['tau'], '.2f')})")
    L += ["", "Per-request tokens/s (median over requests of own tokens / own latency, admission to last token):", ""]
    L += _grid(rows, policies, sizes, lambda r: _cell(r and r["per_request_tokens_per_s_median"], ".2f"))
    L += ["", "Verified nodes per row per round (root included):", ""]
    L += _grid(rows, policies, sizes, lambda r: _cell(r and r["nodes_per_round"], ".1f"))
    if any(r.get("stage_ms_per_round") for r in rows):
        L += ["", "Milliseconds per batch round, draft (+ pool, scoring, selection) / verify:", ""]
        L += _grid(rows, policies, sizes, _stages)
    L.append("")
    ar = {r["batch_size"]: r["total_tokens_per_s"] for r in rows if r["policy"] == "ar"}
    if 1 in ar and len(ar) > 1:
        L.append("* Batched AR, total tokens/s at B over B = 1: " +
                 ", ".join(f"B={b} {ar[b] / ar[1]:.2f}x" for b in sorted(ar) if b > 1) + ".")
    for p in spec:
        c = crossover(rows, p)
        if c is None:
            L.append(f"* {p}: beats batched AR at the largest B measured.")
        elif c == sizes[0]:
            L.append(f"* {p}: slower than batched AR at every B measured.")
        else:
            L.append(f"* {p}: stops paying (speedup < 1 from here on) at B = {c}.")
    if same:
        L.append(f"* Outputs identical to B = 1 AR: {sum(r['identical_to_ar'] for r in same)} of "
                 f"{sum(r['requests'] for r in same)} requests over every (policy, B).")
    return L + [""]


def write_bench_report(bench_paths, out_md, plot_prefix: Optional[str], scorer_metrics: Optional[str] = None,
                       projection: Optional[str] = None, notes: Optional[str] = None,
                       replay: Optional[str] = None) -> List[Path]:
    """The report of ``taps bench`` JSON(s) (:func:`taps.bench.run_report.write_report`) with the batch sweeps'
    tables after it and the ``notes`` markdown last; returns the written paths (markdown first, then plots)."""
    sweeps = load_sweeps(bench_paths)
    paths = write_report(bench_paths, out_md, plot_prefix=plot_prefix, scorer_metrics=scorer_metrics,
                         projection=projection, notes=None if sweeps else notes, replay=replay)
    if sweeps:  # batch tables before the appended notes
        L = [line for s in sweeps for line in batch_tables(s)]
        if notes:
            L.append(Path(notes).read_text())
        with open(paths[0], "a", encoding="utf-8") as f:
            f.write("\n".join(L) + "\n")
    return paths
