"""Training subcommands of the ``taps`` CLI: ``build-data``, ``train-drafter``, ``eval-drafter``.

``taps.cli.main`` calls :func:`add_subcommands` on its subparsers; each
subparser sets ``func`` (called with the parsed ``args``). Also runnable alone:
``python -m taps.cli.drafter_cmds build-data ...``.
"""
from __future__ import annotations

import argparse
import json
import time

from taps.models.target import TARGET_FORMATS


def _int_list(s):
    return [int(x) for x in s.split(",") if x.strip()] if s else None


def _cmd_build_data(args):
    import sys

    from taps.paths import portable_command
    from taps.training.data import BuildDataConfig, build_data, data_summary

    deadline = time.time() + args.max_minutes * 60 if args.max_minutes else None
    cfg = BuildDataConfig(out=args.out, target=args.target, num_prompts=args.num_prompts, shard_size=args.shard_size,
                          batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                          max_prompt_tokens=args.max_prompt_tokens, num_feature_layers=args.num_feature_layers,
                          layer_ids=_int_list(args.layer_ids), seed=args.seed, feat_dtype=args.feat_dtype,
                          threads=args.threads, deadline=deadline, part=args.part, num_parts=args.num_parts,
                          chat_fraction=args.chat_fraction, topk=args.topk,
                          magpie_temperature=args.magpie_temperature, magpie_max_tokens=args.magpie_max_tokens,
                          target_format=args.target_format)
    build_data(cfg, command="python -m taps.cli.drafter_cmds " + portable_command(sys.argv[1:]))
    print(json.dumps(data_summary(args.out), indent=1))
    return 0


def _cmd_train(args):
    from dataclasses import fields

    from taps.training.train_drafter import TrainConfig, train_drafter

    # the config's own fields only: the parser's namespace also carries the CLI's bookkeeping (func, argv, ...)
    train_drafter(TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}))
    return 0


def _cmd_draft_vocab(args):
    from taps.models.drafter import load_drafter
    from taps.training.draft_vocab import coverage_report, expected_token_counts, select_draft_vocab

    holdout = _int_list(args.holdout_shards) or []
    drafter = load_drafter(args.drafter)
    V = drafter.config.vocab_size
    counted = None if args.max_shard is None else [s for s in range(args.max_shard + 1) if s not in holdout]
    counts = expected_token_counts(args.data, V, shards=counted, exclude=holdout)
    ids = select_draft_vocab(counts, size=args.size, coverage=args.coverage, always=_int_list(args.always) or [])
    rep = coverage_report(args.data, ids, V, holdout, shards=counted)
    drafter.set_draft_vocab(ids)
    from safetensors.torch import save_file

    from taps.models.drafter import DRAFT_VOCAB_FILE

    # only the vocabulary file and the config declaration change; the weights stay as they are
    save_file({"ids": ids.contiguous()}, str(f"{args.drafter}/{DRAFT_VOCAB_FILE}"))
    drafter.config.save(args.drafter)
    print(json.dumps(rep, indent=1))
    if args.out_json:
        with open(args.out_json, "w") as f:
            f.write(json.dumps(rep, indent=1) + "\n")
    return 0


def _cmd_eval(args):
    import torch

    from taps.training.eval_drafter import EvalOptions, eval_drafter

    opts = EvalOptions(target=args.target, shards=_int_list(args.shards), max_seqs=args.max_seqs,
                       anchors_per_seq=args.anchors_per_seq, seed=args.seed, out_json=args.out_json,
                       threads=args.threads, use_draft_vocab=args.draft_vocab, dtype=getattr(torch, args.dtype),
                       block_positions=args.block_positions, short_blocks=args.short_blocks,
                       head_dtype=None if args.head_dtype == "lm_head" else getattr(torch, args.head_dtype))
    res = eval_drafter(args.drafter, args.data, opts)
    print(json.dumps(res, indent=1))
    return 0


def add_subcommands(subparsers):
    _add_build_data(subparsers)
    _add_train_drafter(subparsers)
    _add_draft_vocab(subparsers)
    _add_eval_drafter(subparsers)
    return subparsers


def _add_build_data(subparsers):
    """The ``build-data`` subcommand and its flags."""
    p = subparsers.add_parser("build-data", help="target regenerates responses to local prompts (+ hidden features)")
    p.add_argument("--out", required=True, help="data directory (shards, resumable)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=4000)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--num-feature-layers", type=int, default=5)
    p.add_argument("--layer-ids", default=None, help="comma list; default: spread 1..L-3")
    p.add_argument("--feat-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-minutes", type=float, default=None, help="start no new shard after this many minutes")
    p.add_argument("--part", type=int, default=0, help="this process writes shards s with s %% num_parts == part")
    p.add_argument("--num-parts", type=int, default=1)
    p.add_argument("--chat-fraction", type=float, default=0.5,
                   help="share of each shard answering Magpie chat prompts written by the target")
    p.add_argument("--topk", type=int, default=32, help="top-k target log-probabilities kept per response token")
    p.add_argument("--magpie-temperature", type=float, default=1.0)
    p.add_argument("--magpie-max-tokens", type=int, default=96)
    p.add_argument("--target-format", default="auto", choices=TARGET_FORMATS,
                   help="gguf (or gguf-a16, two activation digits): the shipped GGUF blocks through the C++ forward, "
                        "--batch-size rows per decode step (auto picks gguf on CPUs with AVX-512 VNNI or AVX2); fp32: "
                        "transformers' dequantised modules")
    p.set_defaults(func=_cmd_build_data)


def _add_train_drafter(subparsers):
    """The ``train-drafter`` subcommand and its flags."""
    p = subparsers.add_parser("train-drafter", help="train a DFlash drafter on build-data shards")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, help="work dir (checkpoints, log)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--anchors-per-seq", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--max-seq-len", type=int, default=640)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--holdout-shards", default="0", help="comma list of shard indices kept out of training")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-minutes", type=float, default=None, help="training-time budget in minutes (counted over resumes): the cosine schedule ends and training stops when it is spent")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--train-vocab", default="seen", choices=["seen", "full"],
                   help="softmax over tokens seen in the data (+ random negatives) or the full vocab")
    p.add_argument("--extra-negatives", type=int, default=4096)
    p.add_argument("--rescan-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--norm-lr-mult", type=float, default=10.0, help="learning-rate multiplier of RMSNorm gains")
    p.add_argument("--no-normalize-features", dest="normalize_features", action="store_false",
                   help="do not rescale context-feature channels by 1/RMS (the scale is folded into fc on save)")
    p.add_argument("--init-from", default=None,
                   help="drafter dir a new run starts from (weights + architecture; --block-size still applies)")
    p.add_argument("--init-layers", default=None,
                   help="with --init-from: comma list of its layers to keep, e.g. 0,2 (a 2-layer drafter); a "
                        "repeated index adds a layer that starts as the identity, e.g. 0,1,1")
    p.add_argument("--kl-weight", type=float, default=0.0,
                   help="weight of the distillation term to the target's top-k (data built with --topk)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine schedule ends at this x lr")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the forward up to the logits (inductor, needs a C++ compiler; the first step "
                        "compiles for a minute or two, later steps run faster)")
    p.add_argument("--bucket-by-length", action="store_true",
                   help="draw each batch from a window of sequences of similar length (less padding)")
    p.set_defaults(func=_cmd_train)


def _add_draft_vocab(subparsers):
    """The ``draft-vocab`` subcommand and its flags."""
    p = subparsers.add_parser("draft-vocab", help="store a reduced draft vocabulary (most frequent response "
                                                  "tokens of the data) beside a drafter")
    p.add_argument("--drafter", required=True, help="drafter dir: draft_vocab.safetensors + config are written there")
    p.add_argument("--data", required=True)
    p.add_argument("--size", type=int, default=None,
                   help="number of ids (default: the fewest covering --coverage of the expected counts)")
    p.add_argument("--coverage", type=float, default=0.99)
    p.add_argument("--always", default="0,1,2", help="comma list of ids always kept (special tokens)")
    p.add_argument("--holdout-shards", default="0", help="shards not counted (coverage is reported on them)")
    p.add_argument("--max-shard", type=int, default=None,
                   help="count shards 0..N only (the data the drafter was trained on); default every shard")
    p.add_argument("--out-json", default=None)
    p.set_defaults(func=_cmd_draft_vocab)


def _add_eval_drafter(subparsers):
    """The ``eval-drafter`` subcommand and its flags."""
    p = subparsers.add_parser("eval-drafter", help="per-position agreement and tau on held-out generated text")
    p.add_argument("--drafter", required=True, help="drafter dir (config.json + model.safetensors)")
    p.add_argument("--data", required=True)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--shards", default="0")
    p.add_argument("--max-seqs", type=int, default=96)
    p.add_argument("--anchors-per-seq", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-json", default=None)
    p.add_argument("--draft-vocab", action="store_true",
                   help="argmax over the drafter's draft vocabulary (as decoding proposes) instead of the full one")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="drafter body dtype")
    p.add_argument("--head-dtype", default="lm_head", choices=["lm_head", "float32", "bfloat16", "int8"],
                   help="vocabulary projection as draft() runs it (int8: the int8 head); lm_head: the target's "
                        "head in its own dtype")
    p.add_argument("--block-positions", type=int, default=None,
                   help="count block positions 1..P only (what a policy drafting P positions can accept)")
    p.add_argument("--short-blocks", action="store_true",
                   help="with --block-positions P: run the block [bonus, MASK x P] instead of the trained block")
    p.set_defaults(func=_cmd_eval)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="taps-train")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_subcommands(sub)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
