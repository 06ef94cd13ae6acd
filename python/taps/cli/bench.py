"""``taps bench``: policies on prompt sets through one harness; speedup over AR (and HF ``generate``).

One command, one protocol, one summary format (``taps bench-suite`` is a deprecated alias with the suite's
defaults: both datasets, every DDTree budget, a temperature-1 run).

* Prompts: ``--dataset`` / ``--datasets`` (HumanEval, MT-Bench with ``--turns``) or ``--prompts`` JSONL.
* Policies: AR (always, first: the lossless check compares against it), the ``--budgets`` as ``ddtree:B``,
  then ``--policies``. Per prompt the non-AR policies run in an order rotated by one, so load drift on a
  shared machine does not always land on the same policies.
* Runs: one at ``--temperature`` (greedy by default) per dataset; ``--t1-policies`` adds a temperature-1
  run on the first ``--t1-limit`` prompts (``ddtree-best`` = the fastest DDTree budget of the first run).
* Batches: ``--batch-size B`` / ``--batch-sizes 1,2,4,8,16`` run every policy with B requests at once
  through the batched decoder (protocol and metrics: :mod:`taps.bench.sweep`); the summary gains
  ``"batch": [{"dataset", "temperature", "prompts", "batch_sizes", "rows": [{policy, batch_size, ...}]}]``.
  B = 1 is the single-request protocol above (its ``runs`` entry); ``--t1-policies``, ``--hf-baseline`` and
  ``--hf-prompt-lookup`` apply to it only.
* HF baselines (greedy runs only): ``--hf-baseline`` times HF ``generate(do_sample=False)`` on every prompt
  (row ``hf``); ``--hf-prompt-lookup N`` times HF's prompt-lookup decoding with ``prompt_lookup_num_tokens=N``
  (row ``hf-pld:N``), the speculative baseline that needs no drafter. Both see our AR's prompts and turn
  history and the same stop tokens, and are checked token for token against AR.
* Output: one JSON line per (prompt, policy[, batch size]) on stdout (or ``--jsonl FILE``), a table per run
  on stderr, progress bars on stderr (tqdm when installed; ``--quiet`` turns them off), and with ``--out``
  the summary ``{"config": {...}, "runs": [{"dataset", "temperature", "prompts", "policies": {spec:
  summary}, "best_ddtree", "partial"}], "batch": [...]}``, rewritten after every prompt (every batch run)
  so a run cut short leaves a valid file; ``taps report`` reads it.

Speedup = AR seconds per output token / policy seconds per output token, both measured here. The running,
summaries and tables are :mod:`taps.bench`; this module holds the flags and the checks of their values.
"""
from __future__ import annotations

from typing import List, Optional

from taps.decode.policies import policy_from_options

from .common import (CLIError, add_model_flags, add_sampling_flags, drafter_dir_cli, load_drafter_cli, load_target_cli,
                     parse_policies, positive_int, quiet_warnings, sampling_from_args, setup_torch)

BUDGETS = (4, 8, 16, 32, 64, 128)
DATASETS = ("humaneval", "mtbench")


def _add_flags(p, suite: bool) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--dataset", "--datasets", dest="datasets", default="humaneval,mtbench" if suite else "humaneval",
                     help="comma list of humaneval, mtbench (default %(default)s)")
    src.add_argument("--prompts", default=None, help='JSONL file, one {"prompt": ...} (or {"turns": [...]}) per line')
    p.add_argument("--limit", type=positive_int, default=10, help="prompts per dataset (full: 164 / 80; default 10)")
    p.add_argument("--turns", type=int, choices=(1, 2), default=2, help="MT-Bench turns (default 2)")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)) if suite else "",
                   help="DDTree budgets run as ddtree:B (comma list; default %(default)r)")
    p.add_argument("--policies", default="dflash,ddtree-cost,taps-paper,taps" if suite else "ar,dflash,ddtree:16",
                   help="comma list, after AR and the budgets (default %(default)s)")
    p.add_argument("--t1-policies", default="dflash,ddtree-best,taps" if suite else "",
                   help="temperature-1 run of these policies ('' to skip; default %(default)r)")
    p.add_argument("--t1-limit", type=positive_int, default=5, help="prompts per dataset in the temperature-1 run")
    p.add_argument("--out", default="bench/results/taps_bench_cpu.json" if suite else None,
                   help="write the JSON summary here")
    p.add_argument("--jsonl", default=None, help="write per-prompt records here instead of stdout")
    p.add_argument("--hf-baseline", action="store_true", help="greedy runs: also time HF generate(do_sample=False)")
    p.add_argument("--hf-prompt-lookup", type=positive_int, default=None, metavar="N",
                   help="greedy runs: also time HF generate with prompt-lookup decoding, prompt_lookup_num_tokens=N "
                        "(row hf-pld:N; default off)")
    p.add_argument("--peer", choices=("llamacpp",), default=None,
                   help="also run llama.cpp on the same GGUF, first turns, token count and threads (rows: its "
                        "llama-bench decode, llama-completion --no-repack, llama-lookup; build it with "
                        "scripts/build_llamacpp.sh)")
    p.add_argument("--warmup", type=int, default=1, help="short warm-up generations per policy (default 1)")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="prefill every prompt whole (default: on the gguf format a prompt runs on top of the cache "
                        "rows its policy's previous prompt left, from where they part: a turn's earlier turns, the "
                        "system turn)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="run each policy with this many requests at once (batched decoder, continuous batching)")
    p.add_argument("--batch-sizes", default=None,
                   help="comma list of batch sizes to sweep, e.g. 1,2,4,8,16 (B = 1: the single-request protocol)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_sampling_flags(p)
    p.set_defaults(max_new_tokens=64 if suite else 128)
    add_model_flags(p)


def add_subcommand(sub) -> None:
    p = sub.add_parser("bench", help="benchmark policies on HumanEval, MT-Bench or a JSONL prompt file")
    _add_flags(p, suite=False)
    p.set_defaults(func=run, deprecated_alias=None)


def add_suite_subcommand(sub) -> None:
    p = sub.add_parser("bench-suite", help="deprecated alias of `taps bench` with the full-suite defaults "
                       "(both datasets, every DDTree budget, a temperature-1 run)")
    _add_flags(p, suite=True)
    p.set_defaults(func=run, deprecated_alias="bench-suite")



def parse_batch_sizes(batch_size: Optional[int], batch_sizes: Optional[str]) -> Optional[List[int]]:
    """``--batch-size`` / ``--batch-sizes`` as a sorted list without repeats (None: neither given)."""
    if batch_size is not None and batch_sizes is not None:
        raise CLIError("--batch-size and --batch-sizes: give one of them, received both")
    if batch_size is not None:
        return [batch_size]
    if batch_sizes is None:
        return None
    try:
        sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise CLIError(f"--batch-sizes: expected a comma list of integers >= 1, received {batch_sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise CLIError(f"--batch-sizes: expected a comma list of integers >= 1, received {batch_sizes!r}")
    return sorted(set(sizes))



def _items(args):
    from taps.data import PromptItem, load_dataset, load_jsonl
    from taps.paths import portable_path

    if args.prompts:
        return {"jsonl:" + portable_path(args.prompts): load_jsonl(args.prompts, args.limit)}
    out = {}
    for name in (s.strip() for s in args.datasets.split(",") if s.strip()):
        if name not in DATASETS:
            raise CLIError(f"--datasets: expected humaneval and/or mtbench, received {name!r}")
        items = load_dataset(name, args.limit)
        out[name] = items if args.turns == 2 else [PromptItem(i.id, i.source, i.turns[:1]) for i in items]
    if not out:
        raise CLIError("--datasets: expected humaneval and/or mtbench, received nothing")
    return out


def _specs(args) -> List[str]:
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        raise CLIError(f"--budgets: expected a comma list of integers, received {args.budgets!r}") from None
    base = ["ar", "dflash"] if args.deprecated_alias else ["ar"]  # the suite always ran DFlash
    specs = base + [f"ddtree:{b}" for b in budgets] + [s.strip() for s in args.policies.split(",") if s.strip()]
    return parse_policies(",".join(dict.fromkeys(specs)))



def run(args) -> int:
    from taps.bench.harness import Harness, log

    quiet_warnings()
    if args.deprecated_alias:
        log(f"taps {args.deprecated_alias}: deprecated, use `taps bench` (same flags; this alias keeps the "
            "full-suite defaults for one release)")
    specs = _specs(args)
    batch_sizes = parse_batch_sizes(args.batch_size, args.batch_sizes)
    t1 = [s.strip() for s in args.t1_policies.split(",") if s.strip()]
    parse_policies(",".join(s for s in t1 if s != "ddtree-best") or "ar")
    sampling = sampling_from_args(args)
    datasets = _items(args)
    setup_torch(args)
    t1_specs = [s for s in t1 if s != "ddtree-best"]
    need_drafter = any(policy_from_options(s, args).uses_drafter for s in specs + t1_specs) or "ddtree-best" in t1
    if need_drafter:
        drafter_dir_cli(args)
    model, tok = load_target_cli(args)
    if getattr(model, "format", None) == "gguf" and (args.hf_baseline or args.hf_prompt_lookup is not None):
        raise CLIError("--hf-baseline / --hf-prompt-lookup run transformers' generate, which needs the fp32 "
                       "target: add --target-format fp32")
    drafter = load_drafter_cli(args, model) if need_drafter else None
    harness = Harness(args, model, tok, drafter, specs, sampling, batch_sizes, datasets, t1)
    if batch_sizes is not None and 1 not in batch_sizes and (args.hf_baseline or args.hf_prompt_lookup):
        log("--hf-baseline / --hf-prompt-lookup: single-request baselines, run only when --batch-sizes includes 1")
    harness.run(datasets, t1)
    return 0
