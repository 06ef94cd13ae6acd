"""``taps report``: markdown table + plots (+ a GPU-latency projection) from ``taps bench`` JSON, and the
batch sweep's tables (batch size x policy) when the JSON holds a ``batch`` section
(:func:`taps.bench.sweep_report.write_bench_report`)."""
from __future__ import annotations

from pathlib import Path


def _cmd_report(args):
    from taps.bench.sweep_report import write_bench_report

    from .common import CLIError

    for p in args.bench:
        if not Path(p).is_file():
            raise CLIError(f"report: bench JSON {p}: no such file")
    paths = write_bench_report(args.bench, args.out_md, plot_prefix=args.plots, scorer_metrics=args.scorer_metrics,
                               projection=args.projection_latency, notes=args.notes, replay=args.replay)
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

