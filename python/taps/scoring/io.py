"""Scorer directories: ``model.safetensors`` (ScorerWeights field names) + ``config.json`` (+ ``README.md``).

``config.json`` holds the module's constructor arguments (:meth:`TapsScorer.config`) and a ``meta``
dict: the target/drafter pair the scorer was trained against, training data size, metrics. A scorer
is specific to its target/drafter pair, so ``meta.drafter`` is checked by the policies when present.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple

import torch

from taps_kernels import ScorerWeights

from taps.decode.policies.scorer_io import (CONFIG_FILE, WEIGHTS_FILE, load_scorer_weights,  # noqa: F401
                                            read_config)

from .model import TapsScorer


def save_scorer(path, model: TapsScorer, meta: Optional[dict] = None, readme: Optional[str] = None) -> Path:
    """Write ``model`` to directory ``path`` (created); returns the directory."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.to_weights(device="cpu").tensors().items()}
    save_file(tensors, str(p / WEIGHTS_FILE), metadata={"format": "taps-scorer"})
    cfg = {"model": model.config(), "meta": meta or {}}
    (p / CONFIG_FILE).write_text(json.dumps(cfg, indent=1) + "\n", encoding="utf-8")
    if readme is not None:
        (p / "README.md").write_text(readme, encoding="utf-8")
    return p


def load_scorer(path) -> Tuple[TapsScorer, dict]:
    """``(TapsScorer, config dict)`` of a scorer directory (CPU, float32)."""
    w, cfg = load_scorer_weights(path)
    try:
        model = TapsScorer(**cfg["model"])
    except (KeyError, TypeError):
        return TapsScorer.from_weights(w), cfg  # config without constructor arguments: shapes from the weights
    with torch.no_grad():
        live = model.live_weights()
        for k, t in w.tensors().items():
            getattr(live, k).copy_(t)
    return model, cfg
