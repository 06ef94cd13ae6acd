"""``taps demo``: the shipped target + drafter on a few HumanEval and MT-Bench prompts, every policy,
a table of tau / tokens per second / speedup, and a check that every output equals AR's (exit 1 if not)."""
from __future__ import annotations

import sys
import time

from taps.bench import BenchError
from taps.bench.suite import build_decoders, run_suite
from taps.bench.summary import format_table, summarize
from taps.decode.policies import PolicyError

from .common import add_model_flags, drafter_dir_cli, load_drafter_cli, load_target_cli, positive_int, quiet_warnings, setup_torch

DEMO_POLICIES = ("ar", "dflash", "ddtree:16", "lookup")
#: Policies shown when they build from their bare name (they need the shipped scorer).
OPTIONAL_POLICIES = ("taps", "taps-lookup")


def add_subcommand(sub) -> None:
    p = sub.add_parser("demo", help="AR vs DFlash vs DDTree vs prompt lookup (vs TAPS) on real prompts; checks outputs equal "
                                      "AR's")
    p.add_argument("--humaneval", type=int, default=2, help="HumanEval prompts (default 2)")
    p.add_argument("--mtbench", type=int, default=2, help="MT-Bench prompts, first turn (default 2)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--policies", default=None, help="override the policy list (comma separated)")
    p.add_argument("--peer", choices=("auto", "none"), default="auto",
                   help="auto (default): llama.cpp's rows on the same GGUF and prompts where scripts/build_llamacpp.sh "
                        "built it; none: skip them")
    add_model_flags(p)
    p.set_defaults(func=run)


def demo_policies():
    from taps.decode.policies import PolicyError, available_policies, make_policy

    specs = list(DEMO_POLICIES)
    registered = available_policies()
    for name in OPTIONAL_POLICIES:
        if name in registered:
            try:
                make_policy(name)
                specs.append(name)
            except (PolicyError, FileNotFoundError, ValueError) as e:
                print(f"(skipping policy {name}: {e})", file=sys.stderr)
    return specs


def _peer_rows(args, model, tok, items, summary, ours) -> None:
    """llama.cpp beside our rows (``taps bench --peer llamacpp``'s rows) where it is built for the GGUF target;
    ``ours``: our AR's first-turn tokens per item (the agreement and logit checks against ``model``)."""
    from taps.models.target import SMOLLM2_NAMES

    from taps.bench import peer_llamacpp

    if args.peer == "none":
        return
    if args.target not in SMOLLM2_NAMES and not str(args.target).endswith(".gguf"):
        print("\n(llama.cpp rows: only for a GGUF target)")
        return
    if peer_llamacpp.find_llamacpp() is None:
        print("\n(llama.cpp is not built: `bash scripts/build_llamacpp.sh` adds its rows on the same GGUF)")
        return
    print()
    peer_llamacpp.rows_beside_ours(args, tok, items, summary, print, ours, model)


def run(args) -> int:
    from taps.data import PromptItem, load_humaneval, load_mtbench

    from .common import parse_policies

    quiet_warnings()
    specs = parse_policies(args.policies) if args.policies else demo_policies()
    if "ar" not in specs:
        specs = ["ar"] + specs
    items = load_humaneval(args.humaneval) if args.humaneval > 0 else []
    if args.mtbench > 0:
        items += [PromptItem(it.id, it.source, it.turns[:1]) for it in load_mtbench(args.mtbench)]
    setup_torch(args)
    t0 = time.perf_counter()
    drafter_dir_cli(args)
    model, tok = load_target_cli(args)
    drafter = load_drafter_cli(args, model)
    decoders = {}
    for spec in specs:
        try:
            decoders.update(build_decoders(model, tok, drafter, [spec], None, args))
        except (BenchError, PolicyError) as e:
            if args.policies or spec not in OPTIONAL_POLICIES:
                raise
            print(f"(skipping {e})")
    specs = list(decoders)

    print(f"target {args.target}, drafter {args.drafter}, {len(items)} prompts, {args.max_new_tokens} new tokens, "
          f"greedy; policies: {', '.join(specs)}")

    def show(rec):
        print(f"  {rec['id']:<16} {rec['policy']:<12} {rec['new_tokens']:>4} tokens  tau {rec['tau']:.2f}  "
              f"{rec['tokens_per_s']:6.2f} tok/s  {'same as AR' if rec['identical_to_ar'] else 'DIFFERS FROM AR'}",
              flush=True)

    results = run_suite(model, tok, decoders, items, args.max_new_tokens, warmup=1, on_record=show)
    summary = summarize(results)
    print()
    print(format_table(summary))
    _peer_rows(args, model, tok, items, summary, [r["turns"][0]["token_ids"] for r in results["ar"]])
    first = results["ar"][0]
    print(f"\nsample ({first['id']}, AR):\n{first['turns'][0]['text'][:400]}")
    bad = [(s, r["id"]) for s, recs in results.items() for r in recs if not r["identical_to_ar"]]
    print(f"\nwall {time.perf_counter() - t0:.1f} s")
    if bad:
        print(f"FAIL: {len(bad)} outputs differ from AR: {bad}")
        return 1
    print(f"OK: all {sum(len(r) for r in results.values())} outputs are identical to AR's")
    return 0
