"""Export a DFlash drafter of this project in the layout vLLM's DFlash loader reads.

vLLM (0.32 line) loads a DFlash drafter as ``DFlashDraftModel`` (its ``qwen3_dflash`` model) from a
directory holding ``config.json`` and ``*.safetensors``. What it reads, and what this exporter writes:

* ``config.json``: the Qwen3 fields of our config (``hidden_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``num_hidden_layers``, ``rms_norm_eps``,
  ``rope_theta`` and ``rope_parameters``, ``vocab_size`` = the target's vocabulary), ``architectures =
  ["DFlashDraftModel"]``, ``model_type = "qwen3"``, ``block_size``, ``num_target_layers``,
  ``dflash_config.target_layer_ids`` (the same ids as ours: vLLM adds one to each to index the target's
  auxiliary hidden states, which is our ``hidden_states[id + 1]``), ``dflash_config.mask_token_id``,
  ``layer_types`` all ``"full_attention"`` (vLLM then runs every drafter layer non-causal, as our block
  attention is) and, with a reduced draft vocabulary, ``draft_vocab_size``.
* ``model.safetensors``: our weight names unchanged (``fc.weight``, ``hidden_norm.weight``,
  ``norm.weight``, ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.self_attn.{q,k}_norm.weight``,
  ``layers.N.{input,post_attention}_layernorm.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``; vLLM
  prefixes ``model.`` and stacks q/k/v and gate/up itself), in the checkpoint's dtype; with a draft
  vocabulary also ``lm_head.weight [V_draft, H]`` (the target's output-embedding rows of the draft ids,
  in the target's dtype) and ``d2t [V_draft] int64`` with ``d2t[j] = draft_vocab[j] - j`` (vLLM maps draft
  column ``j`` to target token ``j + d2t[j]``). Without a draft vocabulary neither is written and vLLM
  shares the target's head. The embedding table is never written: vLLM shares the target's.

The export is written into a temporary directory beside ``out_dir`` and renamed into place at the end,
so a failure leaves nothing at ``out_dir``; an existing ``out_dir`` is refused.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from .drafter import DRAFT_VOCAB_FILE, DFlashDrafter, load_drafter

PathLike = Union[str, "os.PathLike[str]"]

#: weight file of an export
WEIGHTS_FILE = "model.safetensors"
#: architecture name vLLM's registry maps to its DFlash drafter
ARCHITECTURE = "DFlashDraftModel"

#: top-level fields an exportable drafter's ``config.json`` must hold
REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                   "num_hidden_layers", "rms_norm_eps", "vocab_size", "block_size", "num_target_layers")
#: fields of ``dflash_config`` an exportable drafter must hold
REQUIRED_DFLASH_FIELDS = ("target_layer_ids", "mask_token_id")


class ExportError(ValueError):
    """A drafter that cannot be exported, or an output path that cannot be written; the message names the
    field or path, what was expected and what was found."""


# ------------------------------------------------------------------------------------------- checks

def read_checkpoint_config(drafter_dir: PathLike) -> dict:
    """The raw ``config.json`` of drafter directory ``drafter_dir``, checked for every field the export
    needs (:data:`REQUIRED_FIELDS`, :data:`REQUIRED_DFLASH_FIELDS`, ``rope_theta`` or
    ``rope_parameters.rope_theta``, and ``draft_vocab_file`` present when ``draft_vocab_size`` is).

    Defaults are not filled in (``load_drafter`` would spread missing target layer ids evenly): a field
    vLLM needs that the checkpoint lacks is an :class:`ExportError` naming it."""
    d = Path(drafter_dir)
    cfg_path = d / "config.json"
    if not d.is_dir():
        raise ExportError(f"drafter: expected a drafter directory (config.json + model.safetensors), received "
                          f"{d} (no such directory)")
    if not cfg_path.is_file():
        raise ExportError(f"drafter: expected {cfg_path} to exist, it does not")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"drafter config {cfg_path}: expected JSON, received invalid text ({e})") from None
    if not isinstance(cfg, dict):
        raise ExportError(f"drafter config {cfg_path}: expected a JSON object, received {type(cfg).__name__}")
    missing = [k for k in REQUIRED_FIELDS if cfg.get(k) is None]
    dfc = cfg.get("dflash_config")
    if not isinstance(dfc, dict):
        missing += [f"dflash_config.{k}" for k in REQUIRED_DFLASH_FIELDS]
    else:
        missing += [f"dflash_config.{k}" for k in REQUIRED_DFLASH_FIELDS if dfc.get(k) is None]
    rp = cfg.get("rope_parameters")
    if cfg.get("rope_theta") is None and not (isinstance(rp, dict) and rp.get("rope_theta") is not None):
        missing.append("rope_theta")
    if missing:
        raise ExportError(f"drafter config {cfg_path}: expected the fields {', '.join(missing)}, they are missing")
    ids = dfc["target_layer_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ExportError(f"drafter config {cfg_path}: dflash_config.target_layer_ids: expected a non-empty list "
                          f"of ints, received {ids!r}")
    L = cfg["num_target_layers"]
    bad = [i for i in ids if not 0 <= i < L - 1]
    if bad:
        raise ExportError(f"drafter config {cfg_path}: dflash_config.target_layer_ids: expected ids in [0, {L - 1}) "
                          f"(vLLM reads the output of layer id as the input of layer id + 1 of the "
                          f"{L}-layer target), received {bad}")
    m = dfc["mask_token_id"]
    if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < cfg["vocab_size"]:
        raise ExportError(f"drafter config {cfg_path}: dflash_config.mask_token_id: expected an int in "
                          f"[0, {cfg['vocab_size']}), received {m!r}")
    if not isinstance(cfg["block_size"], int) or cfg["block_size"] < 2:
        raise ExportError(f"drafter config {cfg_path}: block_size: expected an int >= 2, received "
                          f"{cfg['block_size']!r}")
    if cfg.get("draft_vocab_size") is not None and not (d / DRAFT_VOCAB_FILE).is_file():
        raise ExportError(f"drafter config {cfg_path}: draft_vocab_size {cfg['draft_vocab_size']} is declared, "
                          f"expected {d / DRAFT_VOCAB_FILE} to hold the ids, it is missing")
    return cfg


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() or out_dir.is_symlink():
        raise ExportError(f"out_dir: expected a path that does not exist yet, received {out_dir} (it exists; "
                          f"remove it or pick another directory)")
    parent = out_dir.parent
    if not parent.is_dir():
        raise ExportError(f"out_dir: expected its parent directory {parent} to exist, it does not")


def target_output_embeddings(target: PathLike) -> Tuple[torch.Tensor, dict]:
    """``(weight [V, H], config dict)`` of a target checkpoint directory's vocabulary projection:
    ``lm_head.weight``, or ``model.embed_tokens.weight`` when the config ties them (SmolLM2).
    ``target``: an HF checkpoint directory (``config.json`` + ``*.safetensors``) or ``"smollm2"`` (the
    safetensors copy converted from the GGUF under ``$TAPS_CACHE``)."""
    from safetensors import safe_open

    from .target import SMOLLM2_NAMES, convert_smollm2

    d = convert_smollm2() if str(target) in SMOLLM2_NAMES else Path(target).expanduser()
    if not (d / "config.json").is_file():
        raise ExportError(f"target: expected 'smollm2' or a checkpoint directory holding config.json and "
                          f"*.safetensors, received {target}")
    cfg = json.loads((d / "config.json").read_text())
    tied = bool(cfg.get("tie_word_embeddings", False))
    want = ["model.embed_tokens.weight", "lm_head.weight"] if tied else ["lm_head.weight"]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ExportError(f"target: expected *.safetensors weights in {d}, found none")
    for name in want:
        for f in files:
            with safe_open(str(f), "pt") as s:
                if name in s.keys():
                    return s.get_tensor(name), cfg
    raise ExportError(f"target: expected one of {want} in the weights of {d}, found none")


# ------------------------------------------------------------------------------------------- layout

def vllm_config(raw_config: dict, drafter: DFlashDrafter) -> dict:
    """The ``config.json`` vLLM reads for ``drafter`` (fields in this module's docstring); ``raw_config`` is
    the checkpoint's own config, whose extra fields are kept."""
    c = drafter.config
    out = {k: v for k, v in raw_config.items() if k not in ("draft_vocab_file",)}
    out.update(c.to_dict())
    out.pop("draft_vocab_file", None)
    out.update({
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "rope_theta": float(c.rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(c.rope_theta)},
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "dflash_config": {"target_layer_ids": [int(i) for i in c.target_layer_ids],
                          "mask_token_id": int(c.mask_token_id)},
    })
    if drafter.draft_vocab is not None:
        out["draft_vocab_size"] = int(drafter.draft_vocab.numel())
    else:
        out.pop("draft_vocab_size", None)
    return out


def draft_to_target_offsets(draft_vocab: torch.Tensor) -> torch.Tensor:
    """vLLM's ``d2t [V_draft] int64`` from our sorted draft vocabulary ``draft_vocab [V_draft] int64``:
    ``d2t[j] = draft_vocab[j] - j`` (vLLM maps draft column ``j`` to token ``j + d2t[j]``)."""
    if not isinstance(draft_vocab, torch.Tensor) or draft_vocab.dim() != 1 or draft_vocab.dtype != torch.int64:
        raise ExportError(f"draft_vocab: expected a 1-D int64 tensor, received "
                          f"{getattr(draft_vocab, 'dtype', type(draft_vocab))} "
                          f"{tuple(getattr(draft_vocab, 'shape', ()))}")
    return (draft_vocab - torch.arange(draft_vocab.numel(), dtype=torch.int64)).contiguous()


def vllm_state_dict(drafter: DFlashDrafter, head_weight: Optional[torch.Tensor],
                    dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """The tensors of ``model.safetensors``: the drafter's weights under our names (in ``dtype``, default
    their own), plus ``lm_head.weight [V_draft, H]`` = ``head_weight[draft_vocab]`` (the target's dtype) and
    ``d2t`` when the drafter has a draft vocabulary (then ``head_weight [V, H]`` is required)."""
    sd = {k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu()
          for k, v in drafter.folded_state_dict().items()}
    ids = drafter.draft_vocab
    if ids is not None:
        c = drafter.config
        if head_weight is None:
            raise ExportError("head_weight: expected the target's output embeddings [V, H] for a drafter with a "
                              "draft vocabulary, received None")
        if tuple(head_weight.shape) != (c.vocab_size, c.hidden_size):
            raise ExportError(f"head_weight: expected shape ({c.vocab_size}, {c.hidden_size}) (the drafter's "
                              f"vocab_size, hidden_size), received {tuple(head_weight.shape)}")
        ids = ids.cpu()
        sd["lm_head.weight"] = head_weight.index_select(0, ids).contiguous()
        sd["d2t"] = draft_to_target_offsets(ids)
    return sd


# ------------------------------------------------------------------------------------------- export

def export_vllm(drafter_dir: PathLike, out_dir: PathLike, target: PathLike = "smollm2",
                dtype: Optional[torch.dtype] = None) -> Path:
    """Write drafter directory ``drafter_dir`` (this project's format) to the new directory ``out_dir`` in
    the layout of this module's docstring, and return ``out_dir``.

    ``target``: the target checkpoint whose output embeddings give ``lm_head.weight`` (only read when the
    drafter has a draft vocabulary); its hidden size and vocabulary must be the drafter's. ``dtype``: the
    drafter weights' dtype in the export (default: as stored).
    Raises :class:`ExportError` (a ``ValueError``) for a checkpoint missing a field or weight, an
    incompatible target, or an ``out_dir`` that exists; nothing is left at ``out_dir`` then.
    """
    out = Path(out_dir)
    _check_out_dir(out)
    raw = read_checkpoint_config(drafter_dir)
    try:
        drafter = load_drafter(drafter_dir, dtype=torch.float32)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ExportError(f"drafter {drafter_dir}: {e}") from None
    # load_drafter upcasts; keep the stored dtype unless asked otherwise
    stored = _stored_dtype(Path(drafter_dir))
    head = None
    if drafter.draft_vocab is not None:
        head, tcfg = target_output_embeddings(target)
        from .drafter import check_compatible

        try:
            check_compatible(drafter.config, tcfg)
        except ValueError as e:
            raise ExportError(f"target {target}: {e}") from None
    sd = vllm_state_dict(drafter, head, dtype=dtype or stored)
    cfg = vllm_config(raw, drafter)
    from safetensors.torch import save_file

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=str(out.parent)))
    try:
        save_file(sd, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # mkdtemp makes a private directory: give the export the usual modes
            os.chmod(f, 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        if out.exists():
            raise ExportError(f"out_dir: expected a path that does not exist yet, received {out} (it appeared "
                              f"during the export)")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _stored_dtype(drafter_dir: Path) -> Optional[torch.dtype]:
    """The dtype of ``fc.weight`` in the drafter's weight files (None if not found)."""
    from safetensors import safe_open

    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    for f in sorted(drafter_dir.glob("*.safetensors")):
        if f.name == DRAFT_VOCAB_FILE:
            continue
        with safe_open(str(f), "pt") as s:
            for k in ("fc.weight", "model.fc.weight"):
                if k in s.keys():
                    return names.get(s.get_slice(k).get_dtype())
    return None


def exported_names(num_layers: int, draft_vocab: bool) -> List[str]:
    """Every tensor name an export of a ``num_layers``-layer drafter holds (sorted)."""
    per = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
           "self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
           "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    names += [f"layers.{i}.{p}" for i in range(num_layers) for p in per]
    if draft_vocab:
        names += ["lm_head.weight", "d2t"]
    return sorted(names)
