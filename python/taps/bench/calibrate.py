"""``taps calibrate``: measure this machine's verify-latency table for a target (and drafter), save it where
the policies look for it, and describe it.

The measurement itself (:func:`taps.decode.latency.measure_latency`) stays in the decode package: a costed
policy that finds no table for its machine and model measures one when it binds, so the decode loop needs it.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple


def calibrate(model, drafter=None, out: Optional[str] = None, n_max: int = 64, prefix_len: int = 256,
              repeats: int = 3, batch_sizes: Sequence[int] = ()) -> Tuple[dict, Path]:
    """Measure the table (with a progress bar) and save it to ``out`` (default: the cache path of its
    machine and model, where :func:`taps.decode.latency.get_table` reads it). Returns ``(record, path)``."""
    from taps.decode.latency import cache_path, measure_latency, save_table

    t = measure_latency(model, n_max=n_max, prefix_len=prefix_len, repeats=repeats, drafter=drafter,
                        progress=True, batch_sizes=list(batch_sizes))
    return t, save_table(t, out or cache_path(t["machine"], t["model"]))


def describe(t: dict) -> List[str]:
    """Lines for a terminal: machine, model, ``t0`` and its parts, every measured node count beside the
    table's value, and a sample of each batch table (milliseconds)."""
    raw = {int(k): v for k, v in t["raw"].items()}
    parts = t["t0_parts"]
    lines = [f"machine {t['machine']}", f"model {t['model']}", f"t0 {1000 * t['t0']:.1f} ms"]
    if parts:
        by_pos = " ".join(f"{1000 * x:.1f}" for x in parts["draft_by_positions"])
        lines.append(f"  context {1000 * parts['context']:.1f} ms; draft projecting 1..D positions (ms): {by_pos}")
    for n in sorted(raw):
        lines.append(f"  n={n:>4}  {1000 * raw[n]:8.1f} ms measured  {1000 * t['latency'][n]:8.1f} ms table")
    for rows, table in t.get("batch_latency", {}).items():
        lines.append(f"  {rows} rows: " + ", ".join(f"n={n} {1000 * table[n]:.1f} ms"
                                                   for n in range(0, len(table), int(rows) * 8)))
    return lines
