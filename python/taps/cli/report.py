"""``taps report``: markdown table + plots (+ a GPU-latency projection) from ``taps bench`` JSON."""
from __future__ import annotations


def _cmd_report(args):
    from taps.scoring.report import write_report

    paths = write_report(args.bench, args.out_md, plot_prefix=args.plots, scorer_metrics=args.scorer_metrics,
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
