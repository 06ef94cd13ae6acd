"""Collect a drafter study (shapes or a training curve) into one JSON and one plot: held-out tau against
training blocks, code and chat prompts separately, from the evaluations and training logs of the runs.

    python bench/drafter_study.py --run NAME=WORKDIR [--run ...] --evals DIR [--e2e DIR] [--baseline NAME=EVAL]
        --title TEXT --out bench/results/drafter_shape_gguf.json

``WORKDIR`` is a ``train-drafter`` work directory (``train_config.json``, ``train_log.jsonl``,
``train_summary.json``). ``DIR`` (``--evals``) holds ``taps eval-drafter --out-json`` files named
``<NAME>_fp32.json`` (the final drafter, full vocabulary, float32), ``<NAME>_dec.json`` (as decoding drafts:
draft vocabulary, bfloat16 body, int8 head) and ``<NAME>@<step>.json`` (the drafter as saved at that step: a
point of the curve). ``--e2e DIR`` holds ``taps bench --out`` summaries named ``<NAME>.json``. ``--baseline``:
an evaluation drawn as a horizontal line (the drafter every run started from). Writes the JSON and a PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_drafter_scaling import fit  # noqa: E402  (the one least-squares line in log2 of the scaling plots)

KINDS = ("code", "chat")


def _read_log(workdir: Path) -> list:
    return [json.loads(line) for line in (workdir / "train_log.jsonl").read_text().splitlines() if line.startswith("{")]


def blocks_at_step(log: list, step: int) -> int:
    """Training blocks seen after ``step`` optimiser steps (the log's record at that step, else interpolated
    between the two records around it)."""
    before = [r for r in log if r["step"] <= step]
    after = [r for r in log if r["step"] >= step]
    if not before:
        return round(after[0]["blocks_seen"] * step / after[0]["step"])
    if not after or before[-1]["step"] == step:
        return before[-1]["blocks_seen"]
    a, b = before[-1], after[0]
    rate = (b["blocks_seen"] - a["blocks_seen"]) / (b["step"] - a["step"])
    return round(a["blocks_seen"] + rate * (step - a["step"]))


def _tau(ev: dict) -> dict:
    return {"all": ev["tau"], **{k: ev["family_tau"][k]["tau"] for k in KINDS}, "blocks": ev["blocks"],
            "pos_acc": ev["pos_acc"]}


def _e2e(summary: dict) -> dict:
    """Per dataset and policy: tau, median tokens/s, speedup over AR, outputs identical to AR."""
    out = {}
    for res in summary["runs"]:
        out[res["dataset"]] = {p: {"tau": r["tau"], "tokens_per_s_median": r["tokens_per_s_median"],
                                   "speedup": r["speedup"], "nodes_per_round": r["nodes_per_round"],
                                   "draft_ms_per_round": r["stage_ms_per_round"]["draft"],
                                   "identical_to_ar": r["identical_to_ar"], "prompts": r["prompts"]}
                               for p, r in res["policies"].items()}
    return out


def collect(runs: dict, evals: Path, e2e: Path | None, baseline: dict) -> dict:
    out = {"runs": {}, "baseline": {}}
    for name, path in baseline.items():
        out["baseline"][name] = _tau(json.loads(Path(path).read_text()))
    for name, workdir in runs.items():
        cfg = json.loads((workdir / "train_config.json").read_text())
        summary = json.loads((workdir / "train_summary.json").read_text())
        log = _read_log(workdir)
        dc = cfg["drafter_config"]
        run = {"layers": dc["num_hidden_layers"], "block_size": dc["block_size"], "params": cfg["params"],
               "init_from": cfg.get("init_from"), "init_layers": cfg.get("init_layers"),
               "train": {k: summary[k] for k in ("step", "train_seconds", "blocks_seen", "rows_seen")}}
        for mode in ("fp32", "dec"):
            f = evals / f"{name}_{mode}.json"
            if f.exists():
                run[f"heldout_{mode}"] = _tau(json.loads(f.read_text()))
        curve = []
        for f in sorted(evals.glob(f"{name}@*.json"), key=lambda p: int(p.stem.split("@")[1])):
            step = int(f.stem.split("@")[1])
            curve.append({"step": step, "blocks_seen": blocks_at_step(log, step), **_tau(json.loads(f.read_text()))})
        if "heldout_fp32" in run and not any(p["step"] == summary["step"] for p in curve):  # one point a step
            curve.append({"step": summary["step"], "blocks_seen": summary["blocks_seen"], **run["heldout_fp32"]})
        run["curve"] = curve
        if e2e is not None and (e2e / f"{name}.json").exists():
            run["end_to_end"] = _e2e(json.loads((e2e / f"{name}.json").read_text()))
        out["runs"][name] = run
    return out


def plot(study: dict, title: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, kind in zip(axes, KINDS):
        for i, (name, run) in enumerate(study["runs"].items()):
            pts = [p for p in run["curve"] if p["blocks_seen"] > 0]
            if pts:
                ax.plot([p["blocks_seen"] for p in pts], [p[kind] for p in pts], marker="o", color=f"C{i}",
                        label=f"{name} ({run['layers']} layers, block {run['block_size']})")
        for j, (name, b) in enumerate(study["baseline"].items()):
            ax.axhline(b[kind], color="gray", lw=1, ls=":" if j else "--", label=f"{name} (start)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training blocks seen")
        ax.set_title(f"{kind} prompts")
    axes[0].set_ylabel("held-out tau (bonus counted)")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _pairs(items, flag):
    out = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"{flag}: expected NAME=PATH, received {item!r}")
        out[name] = Path(path)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="NAME=WORKDIR (repeat)")
    ap.add_argument("--evals", required=True)
    ap.add_argument("--e2e", default=None)
    ap.add_argument("--baseline", action="append", help="NAME=EVAL_JSON (repeat)")
    ap.add_argument("--title", default="held-out tau against training blocks")
    ap.add_argument("--notes", default="", help="what the study is (stored in the JSON)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    study = collect(_pairs(args.run, "--run"), Path(args.evals), Path(args.e2e) if args.e2e else None,
                    _pairs(args.baseline, "--baseline"))
    study = {"what": args.notes, **study}
    for name, run in study["runs"].items():
        c = run["curve"]
        if len(c) >= 3:
            blocks = [p["blocks_seen"] for p in c]
            run["fit_per_doubling_of_blocks"] = {k: round(fit(blocks, [p[k] for p in c])[1], 4) for k in KINDS}
    out = Path(args.out)
    out.write_text(json.dumps(study, indent=1) + "\n")
    plot(study, args.title, out.with_suffix(".png"))
    for name, run in study["runs"].items():
        h = run.get("heldout_fp32", {})
        print(f"{name:10s} {run['layers']} layers block {run['block_size']:2d}: {run['train']['step']:5d} steps, "
              f"{run['train']['blocks_seen']:7d} blocks, held-out tau code {h.get('code', float('nan')):.3f} chat "
              f"{h.get('chat', float('nan')):.3f}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
