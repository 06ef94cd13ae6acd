"""A drafter directory on disk: ``config.json`` (:class:`~taps.models.drafter_config.DFlashConfig`),
``*.safetensors`` weights under the published names and, with a reduced draft vocabulary,
``draft_vocab.safetensors`` (``ids``: sorted int64)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch

from .drafter_config import DRAFT_VOCAB_FILE, DFlashConfig


def read_weights(p: Path) -> Dict[str, torch.Tensor]:
    """Every ``*.safetensors`` file of directory ``p`` but the draft vocabulary, merged, without a ``model.``
    prefix and without the target's embedding, LM head and rotary tables (the drafter borrows or computes
    them)."""
    from safetensors.torch import load_file

    files = [f for f in sorted(p.glob("*.safetensors")) if f.name != DRAFT_VOCAB_FILE]
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in drafter directory {p}")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    sd = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
    return {k: v for k, v in sd.items() if not (k.startswith("embed_tokens") or k.startswith("lm_head")
                                                 or k.endswith("rotary_emb.inv_freq"))}


def read_draft_vocab(p: Path, cfg: DFlashConfig) -> Optional[torch.Tensor]:
    """The draft vocabulary ``[draft_vocab_size] int64`` that ``cfg`` declares, read from directory ``p``, or
    None when it declares none."""
    from safetensors.torch import load_file

    if cfg.draft_vocab_size is None:
        return None
    vf = p / DRAFT_VOCAB_FILE
    if not vf.is_file():
        raise FileNotFoundError(f"drafter config declares draft_vocab_size {cfg.draft_vocab_size} but {vf} "
                                f"is missing")
    ids = load_file(str(vf))["ids"]
    if ids.numel() != cfg.draft_vocab_size:
        raise ValueError(f"{vf} holds {ids.numel()} ids, config declares draft_vocab_size "
                         f"{cfg.draft_vocab_size}")
    return ids.to(torch.int64)


def write_drafter(path, cfg: DFlashConfig, state_dict: Dict[str, torch.Tensor],
                  draft_vocab: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> None:
    """Write directory ``path``: ``cfg``, ``state_dict`` in ``dtype`` (None: as it is) and the draft vocabulary
    (a stale vocabulary file is removed when there is none)."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    cfg.save(p)
    sd = {k: (v.to(dtype) if dtype is not None else v).contiguous().cpu() for k, v in state_dict.items()}
    save_file(sd, str(p / "model.safetensors"), metadata={"format": "pt"})
    if draft_vocab is not None:
        save_file({"ids": draft_vocab.cpu().contiguous()}, str(p / DRAFT_VOCAB_FILE))
    elif (p / DRAFT_VOCAB_FILE).exists():
        (p / DRAFT_VOCAB_FILE).unlink()
