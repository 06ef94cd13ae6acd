"""Verify-latency tables: the runtime module moved below the decode loop (:mod:`taps.decode.latency`), which
the throughput-rule policies read; this name stays for the scorer's tools and older imports."""
from taps.decode.latency import (cache_path, cache_root, default_grid, get_table, interpolate, isotonic,  # noqa: F401
                                 load_table, machine_key, measure_batch_latency, measure_latency, model_key,
                                 measure_draft_time, drafter_key, random_tree, save_table)
