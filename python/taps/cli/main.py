"""The ``taps`` console script: ``taps demo | generate | bench | export-drafter`` (+ the training subcommands when
present).

Bad input (missing model files, an incompatible drafter, an empty or too long
prompt, ``--max-new-tokens < 1``, an unknown policy) ends with one line on
stderr and exit code 2; ``taps demo`` exits 1 when an output differs from AR.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from .common import CLIError


def build_parser() -> argparse.ArgumentParser:
    from . import bench, demo, generate

    ap = argparse.ArgumentParser(prog="taps", description="Lossless tree speculative decoding (AR, DFlash, DDTree, "
                                 "TAPS) with a DFlash drafter.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    demo.add_subcommand(sub)
    generate.add_subcommand(sub)
    bench.add_subcommand(sub)
    try:
        drafter_cmds = importlib.import_module("taps.cli.drafter_cmds")
    except ImportError:
        drafter_cmds = None  # training extras not installed: inference commands still work
    if drafter_cmds is not None and hasattr(drafter_cmds, "add_subcommands"):
        drafter_cmds.add_subcommands(sub)
    from . import export_drafter, report, scorer_cmds

    scorer_cmds.add_subcommands(sub)  # traces, train-scorer, eval-scorer, calibrate
    bench.add_suite_subcommand(sub)
    report.add_subcommand(sub)
    export_drafter.add_subcommand(sub)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded (portably) by bench and train-scorer
    if getattr(args, "func", None) is None:
        ap.print_help(sys.stderr)
        return 2
    from taps.bench import BenchError
    from taps.data import DataError
    from taps.decode import GenerationError
    from taps.decode.policies import PolicyError

    try:
        rc = args.func(args)
    except (CLIError, BenchError, GenerationError, PolicyError, DataError) as e:
        print(f"taps {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"taps {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
