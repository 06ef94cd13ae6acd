"""``taps generate``: one prompt (or a JSONL file of prompts, batched) with one policy; prints the text, or
JSON with ``--json``. ``taps policies``: every policy name with its parameters."""
from __future__ import annotations

import json
import os
import sys

from taps.data import encode_prompt, stop_token_ids
from taps.decode.policies import policy_from_options

from .common import (CLIError, add_model_flags, add_sampling_flags, check_fits, drafter_dir_cli, load_drafter_cli,
                     load_target_cli, positive_int, quiet_warnings, sampling_from_args, setup_torch)

BACKENDS = ("auto", "reference", "cpp", "triton", "cuda")
ATTENTIONS = ("auto", "taps_tree", "sdpa")


def add_subcommand(sub) -> None:
    p = sub.add_parser("generate", help="generate from one prompt (or a JSONL file, batched) with one policy")
    p.add_argument("--policy", default="taps-lookup",
                   help="taps-lookup (default: TAPS with the prompt-lookup chain in its pool), taps, lookup, ar, dflash, "
                        "ddtree[:B] (default budget 8), ...; `taps policies` lists them")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (chat template) or, with --raw, plain text")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help='JSONL, one {"prompt": ...} per line (first turn used); one JSON line per prompt is '
                          'printed, in input order')
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="rows decoded together with --prompts (continuous batching; default 1)")
    p.add_argument("--raw", action="store_true", help="tokenise the prompt as plain text, no chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (token_ids, text, tau, rounds, ...)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="default backend of the tree ops for this run (auto: each op's best for the device; "
                        "triton on CPU needs TRITON_INTERPRET=1 in the environment)")
    p.add_argument("--attention", default="auto", choices=ATTENTIONS,
                   help="verify attention: taps_tree (taps_kernels.tree_attention), sdpa (dense-mask fallback) or "
                        "auto (taps_tree on GPUs; on CPU the faster of the two, measured: sdpa)")
    p.add_argument("--verbose", action="store_true", help="print which backend runs each op, and why, to stderr")
    add_sampling_flags(p)
    add_model_flags(p)
    p.set_defaults(func=run)
    q = sub.add_parser("policies", help="list every policy name with its parameters")
    q.set_defaults(func=run_policies)


def run_policies(args) -> int:
    from taps.decode.policies import available_policies, policy_params

    params = policy_params()
    names = available_policies()

    def spec(name):  # "ddtree[:B]" when the argument is optional, "taps-fixed:N" when required
        arg = params.get(name, "")
        return name + (f"[:{arg[1:-1]}]" if arg.startswith("[") else f":{arg}" if arg else "")

    width = max(len(spec(n)) for n in names)
    for name, help_text in names.items():
        print(f"{spec(name):<{width}}  {help_text}")
    return 0


def _set_backend(args, device) -> None:
    import torch

    import taps_kernels

    if args.backend == "auto":
        return
    why = taps_kernels.backend.unavailable_reason(args.backend, torch.device(device))
    if why:
        raise CLIError(f"--backend {args.backend}: {why}")
    os.environ["TAPS_BACKEND"] = args.backend


def _explain(device) -> str:
    import torch

    import taps_kernels

    be = taps_kernels.backend
    if hasattr(be, "explain"):
        return be.explain(device=device)
    ops = ("topk_stats", "best_first_pool", "score_edges", "select_subtree", "tree_mask", "tree_attention",
           "accept_greedy", "compact_kv")
    lines = [f"taps_kernels backends on {device}:"]
    for op in ops:
        avail = be.available_backends(op, torch.device(device))
        lines.append(f"  {op}: {be.resolve(op, None, torch.device(device))[0]} (available: "
                     f"{', '.join(b for b, r in avail.items() if not r)})")
    return "\n".join(lines)


def _record(policy, ids, res, text) -> dict:
    st = res.stats
    tps = len(res.token_ids) / st.total_s if st.total_s > 0 else 0.0
    return {"policy": policy.name, "prompt_len": len(ids), "prefix_reused": st.prefix_reused,
            "token_ids": res.token_ids, "text": text,
            "stop_reason": res.stop_reason, "tau": st.tau, "rounds": st.num_rounds,
            "nodes_per_round": st.nodes_per_round, "seconds": st.total_s, "tokens_per_s": tps,
            "time_split": st.stage_totals()}


def run(args) -> int:
    from taps.decode import BatchDecoder, GenerationError, Request

    quiet_warnings()
    if args.prompt is not None and not args.prompt.strip():
        raise CLIError("--prompt: expected a non-empty prompt")
    if args.prompts is None and args.batch_size != 1:
        raise CLIError("--batch-size: needs --prompts (a single --prompt is one row)")
    policy = policy_from_options(args.policy, args)
    sampling = sampling_from_args(args)
    setup_torch(args)
    _set_backend(args, args.device)
    if args.verbose:
        print(_explain(args.device), file=sys.stderr)
    items = None
    if args.prompts is not None:
        from taps.data import load_jsonl

        items = load_jsonl(args.prompts)
    if policy.uses_drafter:
        drafter_dir_cli(args)
    model, tok = load_target_cli(args)
    drafter = load_drafter_cli(args, model) if policy.uses_drafter else None
    if items is None:
        prompts = [encode_prompt(tok, args.prompt, raw=args.raw)]
    else:
        prompts = [encode_prompt(tok, it.turns[0], raw=it.raw or args.raw) for it in items]
    for ids in prompts:
        check_fits(args, model, len(ids))
    try:
        dec = BatchDecoder(model, policy, drafter=drafter, sampling=sampling, stop_token_ids=stop_token_ids(tok, model),
                           max_batch=args.batch_size, attention=args.attention)
    except ValueError as e:
        raise GenerationError(str(e)) from None
    if args.verbose:
        print(f"verify attention: {dec.verifier.attention}; batch size {args.batch_size}", file=sys.stderr)
    reqs = [Request(ids, args.max_new_tokens, None, args.seed + i) for i, ids in enumerate(prompts)]
    results = dec.generate_batch(reqs)
    for ids, res in zip(prompts, results):
        text = tok.decode(res.token_ids, skip_special_tokens=True)
        if args.json or items is not None:
            print(json.dumps(_record(policy, ids, res, text)))
        else:
            st = res.stats
            tps = len(res.token_ids) / st.total_s if st.total_s > 0 else 0.0
            print(text)
            print(f"[{policy.name}] {len(res.token_ids)} tokens in {st.total_s:.2f} s ({tps:.1f} tok/s), "
                  f"{st.num_rounds} rounds, tau {st.tau:.2f}, stop: {res.stop_reason}", file=sys.stderr)
    return 0
