"""One ``taps bench`` run: the summary record (``{"config", "runs", "batch", "peers"}``, rewritten after every
prompt so a run cut short leaves a valid file; ``taps report`` reads it), the JSON lines of every record, and
the tables on stderr."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, Optional

from . import peer_llamacpp
from .progress import Progress
from .suite import BlockPlan, hf_pld_name, hf_rows, prefix_reuse_asked, run_block
from .summary import best_ddtree, format_table
from .sweep import (add_speedups, batch_row, format_batch_table, latency_note, make_batch_decoder, mark_identical,
                    rotated, row_from_single, run_batch)


def _cmdline(args=None) -> str:
    """This command line for the record, with absolute paths made portable."""
    from taps.paths import portable_command

    return "taps " + portable_command(getattr(args, "argv", None) or sys.argv[1:])


def save_json(obj, path):
    """Write ``obj`` as JSON to ``path`` atomically (a reader never sees half a file)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(p)


def log(s: str) -> None:
    """A line on stderr (stdout carries the JSON records)."""
    print(s, file=sys.stderr, flush=True)


def _log_hf_rows(summ: Dict[str, dict], hf: bool, pld: Optional[int]) -> None:
    """HF generate's and HF prompt lookup's rows against our AR, when they ran."""
    if hf and "hf" in summ and summ["hf"].get("speedup"):
        hfs, ar = summ["hf"], summ["ar"]
        log(f"HF generate: {hfs['tokens_per_s_median']:.2f} tok/s median vs our AR {ar['tokens_per_s_median']:.2f} "
            f"(our AR speed / HF speed, time per token: {1 / hfs['speedup']:.3f})")
    name = hf_pld_name(pld) if pld is not None else None
    if name in summ and summ[name].get("speedup") and "ar" in summ:
        s, ar = summ[name], summ["ar"]
        log(f"HF prompt lookup ({name}): {s['tokens_per_s_median']:.2f} tok/s median vs our AR "
            f"{ar['tokens_per_s_median']:.2f} (speedup over our AR, time per token: {s['speedup']:.3f}x)")



class Harness:
    """One ``taps bench`` invocation: its summary record (``out``, saved after every prompt), the JSON-lines
    sink, and the two ways to run a dataset (batch 1 with every policy interleaved; a batch-size sweep).
    ``args`` holds the command's options (the ``taps bench`` flags, by attribute)."""

    def __init__(self, args, model, tok, drafter, specs, sampling, batch_sizes, datasets, t1):
        self.args, self.model, self.tok, self.drafter = args, model, tok, drafter
        self.specs, self.sampling, self.batch_sizes = specs, sampling, batch_sizes
        self.out = {"config": self._config(datasets, t1), "runs": []}
        if batch_sizes is not None:
            self.out["batch"] = []
            self.out["config"]["batch_order"] = "per batch size: AR first, then the other policies rotated by one per size"
        self.sink = open(args.jsonl, "w", encoding="utf-8") if args.jsonl else sys.stdout

    def _config(self, datasets, t1) -> dict:
        import torch

        from taps.decode.latency import cpu_name
        from taps.decode.policies.taps import scorer_dir
        from taps.models.target import target_format_of
        from taps.paths import portable_path, resolve_checkpoint
        from taps.scoring.traces import drafter_identity

        args = self.args
        drafter = drafter_identity(resolve_checkpoint(args.drafter)) if self.drafter is not None else None
        return {"command": _cmdline(args), "target": args.target, "drafter": drafter,
                "datasets": list(datasets), "limit_per_dataset": args.limit, "mtbench_turns": args.turns,
                "max_new_tokens": args.max_new_tokens, "policies": self.specs, "temperature": self.sampling.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "t1_policies": t1, "t1_limit": args.t1_limit,
                "device": args.device, "dtype": args.dtype,
                "target_format": target_format_of(self.model),
                "kv_cache_dtype": str(getattr(self.model, "kv_dtype", None) or next(self.model.parameters()).dtype
                                      ).replace("torch.", ""),
                "cpu": cpu_name(), "threads": torch.get_num_threads(),
                "seed": args.seed, "scorer": portable_path(getattr(args, "scorer", None) or scorer_dir()),
                "order": "AR first, then the other policies rotated by one per prompt",
                "batch_sizes": self.batch_sizes, "hf_baseline": args.hf_baseline,
                "prefix_reuse": prefix_reuse_asked(args) and getattr(self.model, "format", None) == "gguf",
                "hf_prompt_lookup": args.hf_prompt_lookup,
                "latency_table": portable_path(os.environ["TAPS_LATENCY"]) if os.environ.get("TAPS_LATENCY")
                else "$TAPS_CACHE/latency (per machine and model)",
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "note": (f"first {args.limit} prompts per dataset (HumanEval has 164, MT-Bench 80), "
                         f"{args.max_new_tokens} new tokens per turn")}

    def run(self, datasets, t1) -> dict:
        """Every dataset at the command's temperature (batch 1, or the batch-size sweep), the temperature-1
        run of the ``t1`` policies (``ddtree-best``: the fastest DDTree budget of the first run) and the
        llama.cpp rows when asked; saves and returns the summary record."""
        from taps.decode import SamplingConfig

        args, sampling, batch_sizes = self.args, self.sampling, self.batch_sizes
        t_start = time.time()
        try:
            records = {ds: [] for ds in datasets}  # per dataset, for the llama.cpp rows' agreement check
            if batch_sizes is None:
                first = [self.block(ds, items, self.specs, sampling, args.warmup, args.hf_baseline and sampling.greedy,
                                    records[ds], pld=args.hf_prompt_lookup if sampling.greedy else None)
                         for ds, items in datasets.items()]
            else:
                first = [r for ds, items in datasets.items() for r in self.batch_block(ds, items)]
            if t1:
                t1_sampling = SamplingConfig(temperature=1.0)
                for run_rec in first:
                    chosen = [run_rec["best_ddtree"] if s == "ddtree-best" else s for s in t1]
                    specs1 = list(dict.fromkeys(["ar"] + [s for s in chosen if s]))
                    self.block(run_rec["dataset"], datasets[run_rec["dataset"]][: args.t1_limit], specs1, t1_sampling,
                               0, False)
            if args.peer == "llamacpp" and batch_sizes is None:
                self.out["peers"] = {}
                for (ds, items), run_rec in zip(datasets.items(), first):
                    ar = {r["id"]: r["turns"][0]["token_ids"] for r in records[ds] if r["policy"] == "ar"}
                    ours = [ar[it.id] for it in items] if sampling.greedy and len(ar) == len(items) else None
                    self.out["peers"][ds] = peer_llamacpp.rows_beside_ours(args, self.tok, items, run_rec["policies"],
                                                                           log, ours, self.model)
        finally:
            self.close()
        out = self.out
        out["config"]["wall_s"] = round(time.time() - t_start, 1)
        if args.out:
            save_json(out, args.out)
            log(f"wrote {args.out}")
        log(f"{sum(len(v) for v in datasets.values())} prompts, {args.max_new_tokens} max new tokens, "
            f"wall {out['config']['wall_s']} s")
        return out

    def close(self) -> None:
        if self.sink is not sys.stdout:
            self.sink.close()

    def _save(self) -> None:
        if self.args.out:
            save_json(self.out, self.args.out)

    def emit(self, rec) -> None:
        self.sink.write(json.dumps({k: v for k, v in rec.items() if k != "accept_lens"}) + "\n")
        self.sink.flush()

    def block(self, ds, items, run_specs, run_sampling, warmup, hf, records=None, pld=None):
        """Batch 1 on one dataset: every prompt through every policy (AR first), the summary saved as it grows."""
        args = self.args
        hf_names = list(hf_rows(hf, pld))
        log(f"== {ds}: {len(items)} prompts, temperature {run_sampling.temperature:g}, policies "
            f"{', '.join(run_specs + hf_names)}")
        bar = Progress(len(items) * (len(run_specs) + len(hf_names)), f"{ds} B=1", "gen", enabled=not args.quiet)

        def on_record(rec):
            if self.batch_sizes is not None:
                rec["batch_size"] = 1
            self.emit(rec)
            if records is not None:
                records.append(rec)
            bar.update()
        run = {"dataset": ds, "temperature": run_sampling.temperature, "prompts": 0, "policies": {},
               "best_ddtree": None, "partial": True}
        self.out["runs"].append(run)

        def partial(summ, done):
            run.update(prompts=done, policies=summ, best_ddtree=best_ddtree(summ))
            self._save()

        try:
            plan = BlockPlan(run_specs, run_sampling, args.max_new_tokens, args.seed, warmup, hf_baseline=hf,
                             hf_prompt_lookup=pld)
            summ = run_block(self.model, self.tok, self.drafter, items, plan, bar.write, on_partial=partial,
                              on_record=on_record, args=args)
        finally:
            bar.close()
        run.update(prompts=len(items), policies=summ, best_ddtree=best_ddtree(summ), partial=False)
        self._save()
        log(format_table(summ))
        _log_hf_rows(summ, hf, pld)
        return run

    def batch_block(self, ds, items):
        """Every batch size of ``batch_sizes`` on one dataset (B = 1: the single-request protocol)."""
        args, specs, sampling, batch_sizes = self.args, self.specs, self.sampling, self.batch_sizes
        sweep = {"dataset": ds, "temperature": sampling.temperature, "prompts": len(items), "batch_sizes": batch_sizes,
                 "policies": specs, "rows": [], "partial": True}
        self.out["batch"].append(sweep)
        reference = None  # {item id: AR tokens per turn}, from B = 1 when it runs
        runs = []
        if 1 in batch_sizes:
            records = []
            # the HF rows are single-request baselines: B = 1 only, and not rows of the batch table
            runs.append(self.block(ds, items, specs, sampling, args.warmup, args.hf_baseline and sampling.greedy,
                                   records, pld=args.hf_prompt_lookup if sampling.greedy else None))
            reference = {r["id"]: [t["token_ids"] for t in r["turns"]] for r in records if r["policy"] == "ar"}
            sweep["rows"] += [row_from_single(s, [r for r in records if r["policy"] == s]) for s in specs]
        for j, B in enumerate(b for b in batch_sizes if b > 1):
            ref = reference  # without B = 1, each batch size compares with its own AR (which runs first)
            for spec in rotated(specs, j):
                dec = make_batch_decoder(self.model, self.tok, self.drafter, spec, B, sampling, args)
                bar = Progress(sum(len(it.turns) for it in items) * args.max_new_tokens,
                               f"{ds} B={B} {spec}", "tok", enabled=not args.quiet)
                try:
                    recs = run_batch(dec, self.tok, items, args.max_new_tokens, args.seed, args.warmup, bar)
                finally:
                    bar.close()
                if spec == "ar" and ref is None:
                    ref = {r["id"]: [t["token_ids"] for t in r["turns"]] for r in recs}
                mark_identical(recs, ref, sampling.greedy)
                for rec in recs:
                    rec["policy"] = spec
                    self.emit(rec)
                row = batch_row(spec, B, recs, recs[0]["batch_wall_s"] if recs else 0.0)
                row["latency_table"] = latency_note(dec.policy)
                sweep["rows"].append(row)
                add_speedups(sweep["rows"])
                log(f"  {ds} B={B:<3} {spec:<14} {row['total_tokens_per_s']:8.2f} tok/s total, "
                    f"{row['per_request_tokens_per_s_median']:7.2f} per request, wall {row['wall_s']:.1f} s")
                self._save()
        sweep["rows"].sort(key=lambda r: (r["batch_size"], specs.index(r["policy"])))
        add_speedups(sweep["rows"])
        sweep["partial"] = False
        self._save()
        log(f"== {ds}: batch sweep, total tok/s = all output tokens / batch wall time")
        log(format_batch_table(sweep["rows"]))
        return runs

