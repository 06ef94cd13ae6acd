"""Benchmarks of the decoding policies: running prompt sets through every policy (batch 1 and batch-size
sweeps), their summaries and tables, llama.cpp's peer rows, the markdown report and the latency
calibration command.

Layout: :mod:`.suite` (one prompt through every policy, HF baselines), :mod:`.summary` (per-policy figures
and the table), :mod:`.sweep` (batch sizes > 1), :mod:`.harness` (one ``taps bench`` run: its record, saved
as it grows), :mod:`.progress`, :mod:`.peer_llamacpp`, :mod:`.run_report` and :mod:`.sweep_report` (the
report), :mod:`.calibrate` (measure, save and print a latency table). Imports decode, models, data,
scoring and paths; never the CLI.
"""


class BenchError(Exception):
    """A benchmark that cannot run as asked (a policy that does not build, a peer that fails): one line,
    exit code 2 from the ``taps`` command."""
