"""``taps generate``: one prompt, one policy; prints the text (or one JSON object with ``--json``)."""
from __future__ import annotations

import json
import sys

from .common import (CLIError, add_model_flags, drafter_dir_cli, add_sampling_flags, check_fits, encode_prompt, load_drafter_cli,
                     load_target_cli, quiet_warnings, sampling_from_args, setup_torch, stop_token_ids)


def add_subcommand(sub) -> None:
    p = sub.add_parser("generate", help="generate from one prompt with one policy")
    p.add_argument("--policy", default="ddtree:16", help="ar, dflash, ddtree:B, ... (default ddtree:16)")
    p.add_argument("--prompt", required=True, help="user message (chat template) or, with --raw, plain text")
    p.add_argument("--raw", action="store_true", help="tokenise the prompt as plain text, no chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (token_ids, text, tau, rounds, ...)")
    add_sampling_flags(p)
    add_model_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from taps.decode import SpeculativeDecoder
    from taps.decode.policies import make_policy

    quiet_warnings()
    if not args.prompt.strip():
        raise CLIError("--prompt: expected a non-empty prompt")
    policy = make_policy(args.policy)
    sampling = sampling_from_args(args)
    setup_torch(args)
    if policy.uses_drafter:
        drafter_dir_cli(args)
    model, tok = load_target_cli(args)
    drafter = load_drafter_cli(args, model) if policy.uses_drafter else None
    ids = encode_prompt(tok, args.prompt, raw=args.raw)
    check_fits(args, model, len(ids))
    dec = SpeculativeDecoder(model, policy, drafter=drafter, sampling=sampling, stop_token_ids=stop_token_ids(tok, model))
    res = dec.generate(ids, args.max_new_tokens, seed=args.seed)
    text = tok.decode(res.token_ids, skip_special_tokens=True)
    st = res.stats
    tps = len(res.token_ids) / st.total_s if st.total_s > 0 else 0.0
    if args.json:
        print(json.dumps({"policy": policy.name, "prompt_len": len(ids), "token_ids": res.token_ids, "text": text,
                          "stop_reason": res.stop_reason, "tau": st.tau, "rounds": st.num_rounds,
                          "nodes_per_round": st.nodes_per_round, "seconds": st.total_s, "tokens_per_s": tps,
                          "time_split": st.stage_totals()}))
    else:
        print(text)
        print(f"[{policy.name}] {len(res.token_ids)} tokens in {st.total_s:.2f} s ({tps:.1f} tok/s), "
              f"{st.num_rounds} rounds, tau {st.tau:.2f}, stop: {res.stop_reason}", file=sys.stderr)
    return 0
