"""Scorer subcommands of the ``taps`` CLI.

* ``taps traces``       target over large marginal pools on training prompts -> trace shards (resumable)
* ``taps train-scorer`` full + tiny scorer from traces -> scorer dirs (weights, config, README with metrics)
* ``taps eval-scorer``  calibration / top-1 child accuracy / offline tau on held-out traces
* ``taps calibrate``    verify-latency table of this machine and model (cached)

``taps.cli.main`` calls :func:`add_subcommands`.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from taps.models.target import TARGET_FORMATS

from .common import CLIError, positive_int


def _cmdline(args=None) -> str:
    """This command line for records, with absolute paths made portable (:func:`taps.paths.portable_command`)."""
    from taps.paths import portable_command

    return "taps " + portable_command(getattr(args, "argv", None) or sys.argv[1:])


# --- traces ---------------------------------------------------------------------------------------------------------

def _cmd_traces(args):
    from taps.cli.common import _resolve_drafter_dir
    from taps.scoring.traces import TraceConfig, collect_traces

    d = _resolve_drafter_dir(args.drafter)
    if not (d / "config.json").is_file():
        raise CLIError(f"--drafter {args.drafter}: no drafter checkpoint there (config.json missing)")
    config = TraceConfig(target=args.target, num_prompts=args.num_prompts, pool_size=args.pool_size,
                         top_k=args.top_k, lattice_k=args.lattice_k, max_new_tokens=args.max_new_tokens,
                         max_prompt_tokens=args.max_prompt_tokens, prompts_per_shard=args.prompts_per_shard,
                         seed=args.seed, exclude_prompts=args.exclude_prompts, chat_fraction=args.chat_fraction,
                         draft_dtype=args.draft_dtype, target_format=args.target_format, threads=args.threads,
                         max_minutes=args.max_minutes, worker=args.worker, workers=args.workers)
    summ = collect_traces(args.out, str(d), config)
    print(json.dumps(summ, indent=1))
    return 0


# --- train / eval ---------------------------------------------------------------------------------------------------

def _load_split(trace_dirs, val_fraction):
    from taps.scoring.traces import load_traces, split_by_prompt

    try:
        tr = load_traces(trace_dirs)
    except FileNotFoundError as e:
        raise CLIError(str(e)) from None
    return split_by_prompt(tr, val_fraction)


def _trace_meta(trace_dirs):
    metas = []
    for d in trace_dirs:
        p = Path(d) / "meta.json"
        metas.append(json.loads(p.read_text()) if p.exists() else {})
    return metas


def _count_prompts(*splits) -> int:
    """Distinct traced prompts: a prompt index is per trace directory (``source``)."""
    return len({(int(s), int(i)) for sp in splits for s, i in zip(sp["source"].tolist(), sp["prompt_index"].tolist())})


def _readme(name, cmd, meta, ev, hist, params, tiny, traces_doc=False):
    s, m = ev.get("scorer", {}), ev.get("marginal", {})
    budgets = list(s.get("offline_tau", {}).keys())
    lines = [f"# {name}", "",
             f"TAPS edge scorer ({'tiny, 7 scalar features' if tiny else 'full: token/depth/hidden + 7 scalars'}, "
             f"{params} parameters) for the target `{meta.get('target')}` and the DFlash drafter "
             f"`{meta.get('drafter', {}).get('path')}` (weights sha256 prefix `{meta.get('drafter', {}).get('sha256')}`). "
             "A scorer is specific to its target/drafter pair: retrain it when the drafter changes.", "",
             "Load: `taps.scoring.io.load_scorer_weights(dir)` -> `taps_kernels.ScorerWeights` for "
             "`taps_kernels.score_edges`; used by the policies `taps`, `taps-paper`, `taps-fixed`"
             f"{', `taps-tiny`' if tiny else ''}.", "",
             "## Recipe", "", "```", cmd, "```", "",
             f"Traces: {meta.get('train_rounds')} training rounds + {meta.get('val_rounds')} held-out rounds "
             f"(whole prompts held out) from {meta.get('trace_prompts')} training prompts (never HumanEval/MT-Bench), "
             f"{meta.get('pool_size')}-node DDTree pools, top-{meta.get('top_k')} per position, greedy. "
             f"Loss: KL over children + other, plus 0.5 x BCE on propagated reach; target `{hist.get('target')}`; "
             f"AdamW lr {meta.get('lr')}, {len(hist.get('epochs', []))} epochs, best epoch {hist.get('best_epoch')}, "
             f"{hist.get('seconds')} s on this CPU."
             + (f" Started from the scorer `{meta['init_from']}` (trained for an earlier drafter; its recipe is in "
                "that directory's history)." if meta.get("init_from") else ""), "",
             "## Held-out validation", "",
             "| metric | scorer | marginal product |", "|---|---|---|",
             f"| expected calibration error (reach vs real acceptance, {ev.get('bins')} bins) | {s.get('ece', 0):.4f} | {m.get('ece', 0):.4f} |",
             f"| correlation (reach, acceptance) | {s.get('corr', 0):.3f} | {m.get('corr', 0):.3f} |",
             f"| mean predicted reach (real acceptance rate {ev.get('accept_rate', 0):.4f}) | {s.get('mean_pred', 0):.4f} | {m.get('mean_pred', 0):.4f} |",
             f"| top-1 child accuracy, all parents | {s.get('top1_child_acc', 0):.3f} | {m.get('top1_child_acc', 0):.3f} |",
             f"| top-1 child accuracy, parents on the accepted path | {s.get('top1_child_acc_on_path', 0):.3f} | {m.get('top1_child_acc_on_path', 0):.3f} |"]
    for b in budgets:
        lines.append(f"| offline tau at {b} nodes (top-{b} by reach vs DDTree-{b}) | {s['offline_tau'][b]:.3f} | "
                     f"{m['offline_tau'][b]:.3f} |")
    lines += ["", f"Held-out set: {ev.get('rounds')} rounds, {ev.get('nodes')} pool nodes. Full metrics: `metrics.json`.", ""]
    if traces_doc:
        lines += ["How the traces were made (commands, prompt lists, data size against held-out tau): `TRACES.md`.", ""]
    return "\n".join(lines)


def _cmd_train(args):
    import torch

    from taps.scoring.eval_scorer import evaluate_scorer, format_eval
    from taps.scoring.io import save_scorer
    from taps.scoring.model import count_parameters
    from taps.paths import portable_path
    from taps.scoring.train_scorer import InitShapeError, ScorerTrainOptions, target_embeddings, train_scorer

    if args.threads:
        torch.set_num_threads(args.threads)
    train, val = _load_split(args.traces, args.val_fraction)
    metas = _trace_meta(args.traces)
    m0 = metas[0]
    if any(m.get("drafter") != m0.get("drafter") for m in metas):
        raise CLIError("--traces: the directories were traced with different drafters; a scorer is per pair")
    emb = target_embeddings(m0.get("target", args.target))
    cmd = _cmdline(args)
    variants = [("full", False, args.out, args.init_from)]
    if args.tiny_out:
        variants.append(("tiny", True, args.tiny_out, args.tiny_init_from))
    results = {}
    for label, tiny, out, init_dir in variants:
        init = None
        if init_dir:
            from taps.scoring.io import load_scorer

            try:
                init = load_scorer(init_dir)[0]
            except (FileNotFoundError, OSError, ValueError, KeyError) as e:
                raise CLIError(f"--{'tiny-' if tiny else ''}init-from {init_dir}: {e}") from None
        try:
            opts = ScorerTrainOptions(tiny=tiny, epochs=args.epochs, batch=args.batch, lr=args.lr,
                                      target=args.target_dist, seed=args.seed, top_k=int(m0.get("top_k", 64)))
            model, hist = train_scorer(train, val, emb, opts, init=init)
        except InitShapeError as e:
            raise CLIError(f"--{'tiny-' if tiny else ''}init-from {init_dir}: {e}") from None
        ev = evaluate_scorer(val, model.to_weights(), emb)
        print(f"[{label}] " + format_eval(ev))
        meta = {"target": m0.get("target"), "drafter": m0.get("drafter"), "pool_size": m0.get("pool_size"),
                "top_k": m0.get("top_k"), "train_rounds": int(train["tokens"].shape[0]),
                "val_rounds": int(val["tokens"].shape[0]),
                "trace_prompts": _count_prompts(train, val),
                "trace_dirs": [portable_path(d) for d in args.traces],
                "lr": args.lr, "epochs": args.epochs, "target_dist": args.target_dist, "seed": args.seed,
                "init_from": portable_path(init_dir) if init_dir else None,
                "command": cmd, "best_epoch": hist["best_epoch"], "train_seconds": hist["seconds"],
                "val_ece": ev["scorer"]["ece"], "val_ece_marginal": ev["marginal"]["ece"],
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        params = count_parameters(model)
        meta["parameters"] = params
        name = Path(out).name
        readme = _readme(name, cmd, meta, ev, hist, params, tiny, traces_doc=(Path(out) / "TRACES.md").is_file())
        save_scorer(out, model, meta=meta, readme=readme)
        (Path(out) / "metrics.json").write_text(json.dumps({"eval": ev, "history": hist}, indent=1) + "\n")
        results[label] = {"dir": str(out), "ece": ev["scorer"]["ece"], "ece_marginal": ev["marginal"]["ece"]}
    print(json.dumps(results, indent=1))
    return 0


def _cmd_eval(args):
    import torch

    from taps.scoring.eval_scorer import evaluate_scorer, format_eval
    from taps.scoring.io import load_scorer_weights
    from taps.scoring.traces import load_traces
    from taps.scoring.train_scorer import target_embeddings

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.split == "val":
        _, data = _load_split(args.traces, args.val_fraction)
    else:
        data = load_traces(args.traces)
    w, cfg = load_scorer_weights(args.scorer)
    emb = target_embeddings(cfg.get("meta", {}).get("target") or args.target) if w.full else None
    ev = evaluate_scorer(data, w, emb, bins=args.bins)
    print(format_eval(ev))
    if args.latency:
        from taps.scoring.eval_scorer import replay_throughput
        from taps.decode.latency import load_table

        table = load_table(args.latency)
        over = json.loads(args.overhead_ms) if args.overhead_ms else {}
        over = {k: v / 1000 for k, v in over.items()}
        from taps.paths import portable_path

        ev["replay"] = {"latency_table": portable_path(args.latency), "table_machine": table.get("machine"), "t0": table.get("t0"),
                        "overhead_s": over, "rounds": int(data["tokens"].shape[0]),
                        "policies": replay_throughput(data, w, emb, table, over)}
        for k, v in ev["replay"]["policies"].items():
            print(f"replay {k:<14} tau {v['tau']:.3f}  nodes {v['nodes_per_round']:.1f}  tok/s {v['tokens_per_s']:.2f}  "
                  f"speedup {v['speedup']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(ev, indent=1) + "\n")
    return 0


# --- calibrate ------------------------------------------------------------------------------------------------------

def _cmd_calibrate(args):
    from taps.bench.calibrate import calibrate, describe
    from taps.cli.common import load_drafter_cli, load_target_cli, quiet_warnings, setup_torch

    quiet_warnings()
    setup_torch(args)
    model, _ = load_target_cli(args)
    drafter = None
    if not args.no_drafter:
        drafter = load_drafter_cli(args, model)
    t, p = calibrate(model, drafter, args.out, n_max=args.n_max, prefix_len=args.prefix_len, repeats=args.repeats,
                     batch_sizes=[int(b) for b in args.batch_sizes.split(",") if b.strip()])
    print("\n".join(describe(t)))
    print(f"wrote {p}")
    return 0


# --- parser ---------------------------------------------------------------------------------------------------------

def add_subcommands(sub) -> None:
    from .common import add_model_flags

    p = sub.add_parser("traces", help="scorer training traces: target over large marginal pools (training prompts)")
    p.add_argument("--out", required=True, help="trace directory (resumable)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="checkpoints/smollm2-dflash")
    p.add_argument("--num-prompts", type=positive_int, default=128)
    p.add_argument("--pool-size", type=positive_int, default=256)
    p.add_argument("--top-k", type=positive_int, default=64)
    p.add_argument("--lattice-k", type=positive_int, default=32)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=512)
    p.add_argument("--prompts-per-shard", type=positive_int, default=4)
    p.add_argument("--seed", type=int, default=1, help="prompt sampling seed (the drafter data used 0)")
    p.add_argument("--exclude-prompts", default=None, help="JSONL of prompts (with 'id') to skip, e.g. the drafter's")
    p.add_argument("--chat-fraction", type=float, default=0.0,
                   help="share of chat prompts written by the target itself (Magpie), e.g. 0.5")
    p.add_argument("--draft-dtype", choices=("auto", "blocks", "float32", "bfloat16"), default="auto",
                   help="drafter layers' dtype; auto drafts as the decoders do on this machine")
    p.add_argument("--target-format", default="auto", choices=TARGET_FORMATS,
                   help="the target that verifies the pools; auto: as the CLI decoders run it on this machine")
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--worker", type=int, default=0, help="this process takes shards s with s %% workers == worker")
    p.add_argument("--workers", type=positive_int, default=1)
    p.set_defaults(func=_cmd_traces)

    p = sub.add_parser("train-scorer", help="train the TAPS scorer (full, and tiny with --tiny-out) on traces")
    p.add_argument("--traces", nargs="+", required=True)
    p.add_argument("--out", default="checkpoints/smollm2-taps-scorer")
    p.add_argument("--tiny-out", default=None, help="also train the 7-scalar variant into this dir")
    p.add_argument("--init-from", default=None, help="start from this scorer (same shape), e.g. the previous "
                   "drafter's: a new drafter needs less data that way")
    p.add_argument("--tiny-init-from", default=None, help="the same for the 7-scalar variant")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--epochs", type=positive_int, default=30)
    p.add_argument("--batch", type=positive_int, default=32, help="rounds per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--target-dist", choices=("greedy", "soft"), default="greedy",
                   help="greedy: one-hot target argmax (greedy acceptance); soft: target probabilities")
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=None)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("eval-scorer", help="calibration (ECE, reliability), top-1 child accuracy, offline tau")
    p.add_argument("--scorer", default="checkpoints/smollm2-taps-scorer")
    p.add_argument("--traces", nargs="+", required=True)
    p.add_argument("--split", choices=("val", "all"), default="val")
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument("--bins", type=positive_int, default=10)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--out", default=None, help="write the metrics JSON here")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--latency", default=None, help="latency table JSON: also replay every policy's trees on the "
                   "traces and time them with the table (no wall-clock noise)")
    p.add_argument("--overhead-ms", default=None, help='per-policy selection overhead for the replay, JSON, e.g. '
                   '\'{"taps": 19.7, "ddtree": 11.1, "dflash": 2}\'')
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("calibrate", help="measure verify latency for n = 0..N nodes and t0; cache per machine+model")
    p.add_argument("--n-max", type=int, default=64)
    p.add_argument("--prefix-len", type=positive_int, default=256)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--no-drafter", action="store_true", help="time the target alone (t0 = 0)")
    p.add_argument("--batch-sizes", default="", help="also measure batch tables for these row counts, e.g. 2,4,8 "
                   "(batch_latency: R rows holding n nodes in total; the throughput rule sizes batched trees from it)")
    p.add_argument("--out", default=None, help="JSON path (default: $TAPS_CACHE/latency/<model>__<machine>.json)")
    add_model_flags(p)
    p.set_defaults(func=_cmd_calibrate)
