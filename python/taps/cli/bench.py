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
  through the batched decoder (protocol and metrics: :mod:`.bench_batch`); the summary gains
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

Speedup = AR seconds per output token / policy seconds per output token, both measured here.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..decode.stats import BUILD_STAGES, SPLIT_HEADER, SPLIT_STAGES
from .bench_batch import (Progress, add_speedups, batch_row, format_batch_table, latency_note, make_batch_decoder,
                          mark_identical, parse_batch_sizes, rotated, row_from_single, run_batch)
from .common import (CLIError, add_model_flags, add_sampling_flags, check_prompt_lookup, drafter_dir_cli,
                     hf_generate_item, load_drafter_cli, load_target_cli, parse_policies, policy_from_args,
                     positive_int, quiet_warnings, run_item, sampling_from_args, setup_torch, stop_token_ids)

BUDGETS = (4, 8, 16, 32, 64, 128)
DATASETS = ("humaneval", "mtbench")


def _cmdline(args=None) -> str:
    from taps.paths import portable_command

    return "taps " + portable_command(getattr(args, "argv", None) or sys.argv[1:])


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


def build_decoders(model, tok, drafter, specs: List[str], sampling, args=None):
    """One batch-1 decoder per policy spec; ``args`` carries the policies' options (``--scorer``, ``--pool-size``)."""
    from taps.decode import SpeculativeDecoder

    stops = stop_token_ids(tok, model)
    decoders = {}
    for s in specs:
        try:
            # bind() runs here: a policy whose learned parts (scorer, latency table) are missing fails now
            decoders[s] = SpeculativeDecoder(model, policy_from_args(s, args), drafter=drafter, sampling=sampling,
                                             stop_token_ids=stops)
        except (FileNotFoundError, ValueError, KeyError, OSError) as e:
            raise CLIError(f"policy {s}: {str(e).strip().splitlines()[0]}") from None
    return decoders


def hf_pld_name(num_tokens: int) -> str:
    """The row name of HF prompt-lookup decoding with ``prompt_lookup_num_tokens=num_tokens``."""
    return f"hf-pld:{num_tokens}"


def hf_rows(hf_baseline: bool, hf_prompt_lookup: Optional[int]) -> Dict[str, Optional[int]]:
    """The HF baseline rows asked for, in run order: ``{row name: prompt_lookup_num_tokens}`` (None: plain
    greedy ``generate``). ``hf_prompt_lookup`` must be None or an int >= 1."""
    check_prompt_lookup("hf_prompt_lookup", hf_prompt_lookup)
    rows: Dict[str, Optional[int]] = {"hf": None} if hf_baseline else {}
    if hf_prompt_lookup is not None:
        rows[hf_pld_name(hf_prompt_lookup)] = hf_prompt_lookup
    return rows


def run_suite(model, tok, decoders: Dict, items, max_new_tokens: int, seed: int = 0, warmup: int = 1,
              hf_baseline: bool = False, on_record: Optional[Callable[[dict], None]] = None,
              hf_prompt_lookup: Optional[int] = None) -> Dict[str, List[dict]]:
    """Run every item with every decoder (items outer, policies inner). Returns ``{policy: [record, ...]}``;
    a record is :func:`run_item`'s dict plus ``identical_to_ar``; ``"hf"`` holds the HF baseline if asked,
    ``"hf-pld:N"`` HF prompt-lookup decoding with ``prompt_lookup_num_tokens = hf_prompt_lookup`` (>= 1) if
    asked. The HF rows run after the decoders on each prompt and carry no rounds or tau."""
    from taps.data import PromptItem

    hf = hf_rows(hf_baseline, hf_prompt_lookup)
    greedy = all(dec.sampling.greedy for dec in decoders.values())
    warm = PromptItem("warmup", "warmup", ["Say hello."])
    for dec in decoders.values():
        for _ in range(warmup):
            run_item(dec, tok, warm, 8, seed=seed)
    stops = stop_token_ids(tok, model)
    if warmup:
        for n in hf.values():
            hf_generate_item(model, tok, warm, 8, stops, ["hello"], prompt_lookup_num_tokens=n)
    results: Dict[str, List[dict]] = {s: [] for s in decoders}
    results.update({name: [] for name in hf})
    for item in items:
        ar_tokens = None
        for spec, dec in decoders.items():
            rec = run_item(dec, tok, item, max_new_tokens, seed=seed)
            rec["policy"] = spec
            toks = [t["token_ids"] for t in rec["turns"]]
            if spec == "ar":
                ar_tokens = toks
                ar_answers = [t["text"] for t in rec["turns"]]
            # sampled outputs differ from AR's by design (same distribution, other draws)
            rec["identical_to_ar"] = (toks == ar_tokens) if ar_tokens is not None and greedy else None
            results[spec].append(rec)
            if on_record:
                on_record(rec)
        for name, n in hf.items():
            rec = hf_generate_item(model, tok, item, max_new_tokens, stops, ar_answers, prompt_lookup_num_tokens=n)
            rec.update(id=item.id, source=item.source, policy=name)
            rec["tokens_per_s"] = rec["new_tokens"] / rec["seconds"] if rec["seconds"] > 0 else 0.0
            rec["identical_to_ar"] = [t["token_ids"] for t in rec["turns"]] == ar_tokens if greedy else None
            results[name].append(rec)
            if on_record:
                on_record(rec)
    return results


def summarize(results: Dict[str, List[dict]]) -> Dict[str, dict]:
    """Per policy: tau, tokens/s (median, mean over prompts), speedup over AR, nodes per round, time split."""
    def per_token(recs):
        tokens = sum(r["new_tokens"] for r in recs)
        return sum(r["seconds"] for r in recs) / tokens if tokens else float("nan")

    ar_spt = per_token(results["ar"]) if results.get("ar") else float("nan")
    out = {}
    for spec, recs in results.items():
        if not recs:
            continue
        tps = [r["tokens_per_s"] for r in recs]
        spt = per_token(recs)
        rounds = sum(r.get("rounds", 0) for r in recs)
        accepted = sum(sum(r.get("accept_lens", [])) for r in recs)
        split: Dict[str, float] = {}
        for r in recs:
            for k, v in r.get("time_split", {}).items():
                split[k] = split.get(k, 0.0) + v
        total = sum(r["seconds"] for r in recs)
        # the prefill of every turn and the token it gives excluded: what a decode-only figure (llama-bench's) counts
        decode_s = total - split.get("prefill", 0.0)
        decode_tokens = sum(r["new_tokens"] - len(r.get("turns", ())) for r in recs)
        out[spec] = {
            "prompts": len(recs),
            "new_tokens": sum(r["new_tokens"] for r in recs),
            "seconds": total,
            "tau": accepted / rounds if rounds else None,
            "tokens_per_s_median": statistics.median(tps),
            "tokens_per_s_mean": statistics.fmean(tps),
            "decode_tokens_per_s": decode_tokens / decode_s if "prefill" in split and decode_s > 0 else None,
            "speedup": ar_spt / spt if spt == spt and spt > 0 else None,
            "nodes_per_round": sum(r.get("nodes", 0) for r in recs) / rounds if rounds else None,
            "rounds": rounds,
            "drafted_frac": sum(r.get("drafted_rounds", 0) for r in recs) / rounds if rounds else None,
            "time_split_s": split,
            "time_split_frac": {k: v / total for k, v in split.items()} if total > 0 else {},
            "identical_to_ar": sum(1 for r in recs if r.get("identical_to_ar")),
        }
    return out


def format_table(summary: Dict[str, dict]) -> str:
    head = (f"{'policy':<14}{'tau':>6}{'tok/s med':>11}{'tok/s mean':>11}{'speedup':>9}{'nodes/rd':>9}"
            f"{'same as AR':>12}  {SPLIT_HEADER}")
    lines = [head, "-" * len(head)]
    for spec, s in summary.items():
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
        nodes = f"{s['nodes_per_round']:.1f}" if s["nodes_per_round"] is not None else "-"
        sp = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        frac = s["time_split_frac"]
        split = "/".join(f"{100 * frac.get(k, 0.0):.0f}" for k in SPLIT_STAGES) if s["rounds"] else "-"
        lines.append(f"{spec:<14}{tau:>6}{s['tokens_per_s_median']:>11.2f}{s['tokens_per_s_mean']:>11.2f}{sp:>9}"
                     f"{nodes:>9}{s['identical_to_ar']:>7}/{s['prompts']:<4}  {split}")
    return "\n".join(lines)


def llamacpp_peer(args, tok, items, summary: Dict[str, dict], log) -> List[dict]:
    """llama.cpp's rows on the first turns of ``items`` (same GGUF, token count and threads), printed beside
    our decode-only tokens/s (:mod:`taps.cli.peer_llamacpp`)."""
    import torch

    from taps.models.target import SMOLLM2_NAMES, find_smollm2_gguf

    from . import peer_llamacpp
    from .common import encode_prompt

    gguf = find_smollm2_gguf() if args.target in SMOLLM2_NAMES else Path(args.target)
    texts = [tok.decode(encode_prompt(tok, it.turns[0], raw=it.raw)) for it in items]
    try:
        rows = peer_llamacpp.peer_rows(gguf, texts, args.max_new_tokens, torch.get_num_threads())
    except RuntimeError as e:
        raise CLIError(f"--peer llamacpp: {e}") from None
    log(f"llama.cpp {rows[0]['llamacpp_commit']} on {rows[0]['cpu']}, {rows[0]['threads']} thread(s), first turns "
        f"of {len(texts)} prompts, {args.max_new_tokens} tokens: decode tokens/s (prefill and its token excluded)")
    for r in rows:
        log(f"  {r['name']:<48} {r['tok_s']:8.2f}")
    for spec, s in summary.items():
        if s.get("decode_tokens_per_s"):
            log(f"  ours: {spec:<42} {s['decode_tokens_per_s']:8.2f}  (all turns)")
    return rows


def _hist(values):
    h = {}
    for v in values:
        h[str(v)] = h.get(str(v), 0) + 1
    return dict(sorted(h.items(), key=lambda kv: int(kv[0])))


def _summarize(results):
    summary = summarize(results)
    for spec, recs in results.items():
        s = summary[spec]
        s["accept_len_hist"] = _hist([a for r in recs for a in r.get("accept_lens", [])])
        rounds = max(s["rounds"], 1)
        sp = s["time_split_s"]
        s["selection_overhead_ms_per_round"] = 1000 * sum(sp.get(k, 0.0) for k in BUILD_STAGES[1:]) / rounds
        s["stage_ms_per_round"] = {k: 1000 * v / rounds for k, v in sp.items() if k != "prefill"}
        s["per_prompt"] = [{"id": r["id"], "new_tokens": r["new_tokens"], "seconds": r["seconds"], "tau": r.get("tau"),
                            "identical_to_ar": r["identical_to_ar"]} for r in recs]
    return summary


@dataclass
class BlockPlan:
    """What one batch-1 block runs: the policy ``specs``, the ``sampling``, ``max_new_tokens`` per turn, the
    ``seed``, ``warmup`` untimed runs before the first prompt, and the HF rows: ``hf_baseline`` times HF
    ``generate`` on every prompt (policy ``"hf"``), ``hf_prompt_lookup`` HF prompt-lookup decoding (policy
    ``"hf-pld:N"``)."""

    specs: List[str]
    sampling: object
    max_new_tokens: int
    seed: int
    warmup: int
    hf_baseline: bool = False
    hf_prompt_lookup: Optional[int] = None


def _run_block(model, tok, drafter, items, plan: BlockPlan, log, on_partial=None, on_record=None, args=None):
    """Run ``items`` x ``plan.specs``; after every prompt (all policies) ``on_partial(summary, prompts_done)`` is
    called, so a run cut short still leaves a valid JSON of the prompts completed. ``on_record(record)`` sees
    every record; ``args`` carries the policies' options (``--scorer``, ``--pool-size``)."""
    specs, hf_baseline, hf_prompt_lookup = plan.specs, plan.hf_baseline, plan.hf_prompt_lookup
    hf = hf_rows(hf_baseline, hf_prompt_lookup)
    decoders = build_decoders(model, tok, drafter, specs, plan.sampling, args)
    partial = {s: [] for s in specs + list(hf)}

    def show(rec):
        tau = f"tau {rec['tau']:.2f}" if "tau" in rec else "        "
        log(f"  {rec['id']:<22} {rec['policy']:<14} {rec['new_tokens']:>4} tok  {tau}  "
            f"{rec['tokens_per_s']:6.2f} tok/s  "
            f"{ {True: '=AR', False: 'DIFFERS', None: '(sampled)'}[rec['identical_to_ar']] }")
        partial[rec["policy"]].append(rec)
        if on_record is not None:
            on_record(rec)
        done = min(len(v) for v in partial.values())
        if on_partial is not None and all(len(v) == done for v in partial.values()):
            on_partial(_summarize(partial), done)

    # AR first (the lossless check compares against it), then the other policies in an order rotated by one
    # per prompt: on a shared machine the load drifts within a prompt, and a fixed order would always hand
    # the same policies the slow minutes.
    others = [s for s in specs if s != "ar"]
    results = {s: [] for s in partial}
    for i, item in enumerate(items):
        k = i % max(len(others), 1)
        order = (["ar"] if "ar" in decoders else []) + others[k:] + others[:k]
        res = run_suite(model, tok, {s: decoders[s] for s in order}, [item], plan.max_new_tokens, seed=plan.seed,
                        warmup=plan.warmup if i == 0 else 0, hf_baseline=hf_baseline, on_record=show,
                        hf_prompt_lookup=hf_prompt_lookup)
        for s, recs in res.items():
            results[s] += recs
    return _summarize(results)


def _best_ddtree(summary):
    dd = {k: v for k, v in summary.items() if k.startswith("ddtree:")}
    if not dd:
        return None
    return max(dd, key=lambda k: dd[k]["tokens_per_s_median"])


def _save(obj, path):
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(p)




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


def _log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def _log_hf_rows(summ: Dict[str, dict], hf: bool, pld: Optional[int]) -> None:
    """HF generate's and HF prompt lookup's rows against our AR, when they ran."""
    if hf and "hf" in summ and summ["hf"].get("speedup"):
        hfs, ar = summ["hf"], summ["ar"]
        _log(f"HF generate: {hfs['tokens_per_s_median']:.2f} tok/s median vs our AR {ar['tokens_per_s_median']:.2f} "
             f"(our AR speed / HF speed, time per token: {1 / hfs['speedup']:.3f})")
    name = hf_pld_name(pld) if pld is not None else None
    if name in summ and summ[name].get("speedup") and "ar" in summ:
        s, ar = summ[name], summ["ar"]
        _log(f"HF prompt lookup ({name}): {s['tokens_per_s_median']:.2f} tok/s median vs our AR "
             f"{ar['tokens_per_s_median']:.2f} (speedup over our AR, time per token: {s['speedup']:.3f}x)")


def run(args) -> int:
    from taps.decode import SamplingConfig

    quiet_warnings()
    if args.deprecated_alias:
        _log(f"taps {args.deprecated_alias}: deprecated, use `taps bench` (same flags; this alias keeps the "
             "full-suite defaults for one release)")
    specs = _specs(args)
    batch_sizes = parse_batch_sizes(args.batch_size, args.batch_sizes)
    t1 = [s.strip() for s in args.t1_policies.split(",") if s.strip()]
    parse_policies(",".join(s for s in t1 if s != "ddtree-best") or "ar")
    sampling = sampling_from_args(args)
    datasets = _items(args)
    setup_torch(args)
    need_drafter = any(policy_from_args(s, args).uses_drafter for s in specs + [s for s in t1 if s != "ddtree-best"]) or \
        "ddtree-best" in t1
    if need_drafter:
        drafter_dir_cli(args)
    model, tok = load_target_cli(args)
    from taps.models.target import target_format_of

    if target_format_of(model) == "gguf" and (args.hf_baseline or args.hf_prompt_lookup is not None):
        raise CLIError("--hf-baseline / --hf-prompt-lookup run transformers' generate, which needs the fp32 "
                       "target: add --target-format fp32")
    drafter = load_drafter_cli(args, model) if need_drafter else None
    bench = _Bench(args, model, tok, drafter, specs, sampling, batch_sizes, datasets, t1)
    if batch_sizes is not None and 1 not in batch_sizes and (args.hf_baseline or args.hf_prompt_lookup):
        _log("--hf-baseline / --hf-prompt-lookup: single-request baselines, run only when --batch-sizes includes 1")
    t_start = time.time()
    try:
        if batch_sizes is None:
            first = [bench.block(ds, items, specs, sampling, args.warmup, args.hf_baseline and sampling.greedy,
                                 pld=args.hf_prompt_lookup if sampling.greedy else None)
                     for ds, items in datasets.items()]
        else:
            first = [r for ds, items in datasets.items() for r in bench.batch_block(ds, items)]
        if t1:
            t1_sampling = SamplingConfig(temperature=1.0)
            for run_rec in first:
                chosen = [run_rec["best_ddtree"] if s == "ddtree-best" else s for s in t1]
                specs1 = list(dict.fromkeys(["ar"] + [s for s in chosen if s]))
                bench.block(run_rec["dataset"], datasets[run_rec["dataset"]][: args.t1_limit], specs1, t1_sampling, 0,
                            False)
        if args.peer == "llamacpp":
            bench.out["peers"] = {ds: llamacpp_peer(args, tok, items, run_rec["policies"], _log)
                                  for (ds, items), run_rec in zip(datasets.items(), first) if batch_sizes is None}
    finally:
        bench.close()
    out = bench.out
    out["config"]["wall_s"] = round(time.time() - t_start, 1)
    if args.out:
        _save(out, args.out)
        _log(f"wrote {args.out}")
    _log(f"{sum(len(v) for v in datasets.values())} prompts, {args.max_new_tokens} max new tokens, "
         f"wall {out['config']['wall_s']} s")
    return 0


class _Bench:
    """One ``taps bench`` invocation: its summary record (``out``, saved after every prompt), the JSON-lines
    sink, and the two ways to run a dataset (batch 1 with every policy interleaved; a batch-size sweep)."""

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
        from taps.paths import portable_path
        from taps.scoring.traces import drafter_identity

        from .common import _resolve_drafter_dir

        args = self.args
        drafter = drafter_identity(_resolve_drafter_dir(args.drafter)) if self.drafter is not None else None
        return {"command": _cmdline(args), "target": args.target, "drafter": drafter,
                "datasets": list(datasets), "limit_per_dataset": args.limit, "mtbench_turns": args.turns,
                "max_new_tokens": args.max_new_tokens, "policies": self.specs, "temperature": self.sampling.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "t1_policies": t1, "t1_limit": args.t1_limit,
                "device": args.device, "dtype": args.dtype,
                "target_format": target_format_of(self.model), "cpu": cpu_name(), "threads": torch.get_num_threads(),
                "seed": args.seed, "scorer": portable_path(scorer_dir()),
                "order": "AR first, then the other policies rotated by one per prompt",
                "batch_sizes": self.batch_sizes, "hf_baseline": args.hf_baseline,
                "hf_prompt_lookup": args.hf_prompt_lookup,
                "latency_table": portable_path(os.environ["TAPS_LATENCY"]) if os.environ.get("TAPS_LATENCY")
                else "$TAPS_CACHE/latency (per machine and model)",
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "note": (f"first {args.limit} prompts per dataset (HumanEval has 164, MT-Bench 80), "
                         f"{args.max_new_tokens} new tokens per turn")}

    def close(self) -> None:
        if self.sink is not sys.stdout:
            self.sink.close()

    def _save(self) -> None:
        if self.args.out:
            _save(self.out, self.args.out)

    def emit(self, rec) -> None:
        self.sink.write(json.dumps({k: v for k, v in rec.items() if k != "accept_lens"}) + "\n")
        self.sink.flush()

    def block(self, ds, items, run_specs, run_sampling, warmup, hf, records=None, pld=None):
        """Batch 1 on one dataset: every prompt through every policy (AR first), the summary saved as it grows."""
        args = self.args
        hf_names = list(hf_rows(hf, pld))
        _log(f"== {ds}: {len(items)} prompts, temperature {run_sampling.temperature:g}, policies "
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
            run.update(prompts=done, policies=summ, best_ddtree=_best_ddtree(summ))
            self._save()

        try:
            plan = BlockPlan(run_specs, run_sampling, args.max_new_tokens, args.seed, warmup, hf_baseline=hf,
                             hf_prompt_lookup=pld)
            summ = _run_block(self.model, self.tok, self.drafter, items, plan, bar.write, on_partial=partial,
                              on_record=on_record, args=args)
        finally:
            bar.close()
        run.update(prompts=len(items), policies=summ, best_ddtree=_best_ddtree(summ), partial=False)
        self._save()
        _log(format_table(summ))
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
                _log(f"  {ds} B={B:<3} {spec:<14} {row['total_tokens_per_s']:8.2f} tok/s total, "
                     f"{row['per_request_tokens_per_s_median']:7.2f} per request, wall {row['wall_s']:.1f} s")
                self._save()
        sweep["rows"].sort(key=lambda r: (r["batch_size"], specs.index(r["policy"])))
        add_speedups(sweep["rows"])
        sweep["partial"] = False
        self._save()
        _log(f"== {ds}: batch sweep, total tok/s = all output tokens / batch wall time")
        _log(format_batch_table(sweep["rows"]))
        return runs
