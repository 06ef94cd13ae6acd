"""``taps report``: markdown table + plots (+ a GPU-latency projection) from ``taps bench`` JSON, and the
batch sweep's tables (batch size x policy) when the JSON holds a ``batch`` section."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from ..decode.stats import BUILD_STAGES


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


def _cmd_report(args):
    from taps.scoring.report import write_report

    from .common import CLIError

    for p in args.bench:
        if not Path(p).is_file():
            raise CLIError(f"report: bench JSON {p}: no such file")
    sweeps = load_sweeps(args.bench)
    paths = write_report(args.bench, args.out_md, plot_prefix=args.plots, scorer_metrics=args.scorer_metrics,
                         projection=args.projection_latency, notes=None if sweeps else args.notes,
                         replay=args.replay)
    if sweeps:  # batch tables before the appended notes
        L = [line for s in sweeps for line in batch_tables(s)]
        if args.notes:
            L.append(Path(args.notes).read_text())
        with open(paths[0], "a", encoding="utf-8") as f:
            f.write("\n".join(L) + "\n")
    for p in paths:
        print(f"wrote {p}")
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("report", help="markdown table + plots from `taps bench` JSON (+ GPU-latency projection)")
    p.add_argument("bench", nargs="+", help="`taps bench --out` JSON(s); several are merged (e.g. one per dataset)")
    p.add_argument("--out-md", default="bench/results/taps_bench_cpu.md")
    p.add_argument("--plots", default="bench/results/taps_cpu", help="plot file prefix ('' for none)")
    p.add_argument("--scorer-metrics", default=None, help="metrics.json of the scorer (calibration section)")
    p.add_argument("--projection-latency", default=None,
                   help="latency table JSON measured on a GPU: adds a projected tokens/s column, labelled so")
    p.add_argument("--notes", default=None, help="markdown file appended (analysis)")
    p.add_argument("--replay", default=None, help="eval-scorer JSON with a 'replay' section (trace replay table)")
    p.set_defaults(func=_cmd_report)
