"""``taps export-drafter --format vllm OUT``: write a drafter in a serving engine's layout.

``--format vllm`` writes the directory vLLM's DFlash loader reads (:mod:`taps.models.export_vllm`); pass it
as ``speculative_config={"method": "dflash", "model": OUT, "num_speculative_tokens": block_size - 1}``.
``--format llamacpp`` is refused with the reason (``docs/ENGINES.md``, "llama.cpp"). A drafter missing a
field, an incompatible target or an ``OUT`` that exists ends with one line on stderr and exit code 2;
nothing is written then.
"""
from __future__ import annotations

from .common import DEFAULT_DRAFTER, CLIError

FORMATS = ("vllm", "llamacpp")

LLAMACPP_REFUSAL = (
    "--format llamacpp: not offered. llama.cpp's DFlash converter (conversion/qwen.py, class DFlashModel, in "
    "the llama.cpp that scripts/build_llamacpp.sh builds) maps the drafter's Qwen3 body but has no case for the "
    "reduced draft vocabulary: only its DSpark subclass turns d2t into the absolute ids its runtime reads; on our "
    "export it stops with \"Can not map tensor 'model.d2t'\" (docs/ENGINES.md, llama.cpp)")


def add_subcommand(sub) -> None:
    p = sub.add_parser("export-drafter", help="write the drafter in a serving engine's layout (vLLM's DFlash loader)")
    p.add_argument("out", help="output directory (must not exist)")
    p.add_argument("--format", choices=FORMATS, default="vllm", help="engine layout (default vllm)")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help=f"DFlash drafter dir (default {DEFAULT_DRAFTER})")
    p.add_argument("--target", default="smollm2",
                   help="target whose output embeddings give the draft-vocabulary head: 'smollm2' (the safetensors "
                        "converted from the GGUF under $TAPS_CACHE) or a checkpoint dir with *.safetensors")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from taps.models.export_vllm import ExportError, export_vllm
    from taps.paths import portable_path

    from .common import _resolve_drafter_dir

    if args.format == "llamacpp":
        raise CLIError(LLAMACPP_REFUSAL)
    try:
        out = export_vllm(_resolve_drafter_dir(args.drafter), args.out, target=args.target)
    except (ExportError, FileNotFoundError) as e:
        raise CLIError(str(e)) from None
    print(f"wrote {portable_path(out)} (vLLM DFlash layout): speculative_config={{\"method\": \"dflash\", "
          f"\"model\": \"{portable_path(out)}\", ...}}", file=sys.stderr)
    return 0
