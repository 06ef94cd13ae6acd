"""Loading a trained scorer's weights at run time: ``model.safetensors`` (ScorerWeights field names) +
``config.json`` of a scorer directory. Training, saving and evaluation live in :mod:`taps.scoring`, which
builds on this; the decode loop never imports :mod:`taps.scoring`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Tuple

from taps_kernels import ScorerWeights

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def read_config(path) -> dict:
    """The ``config.json`` of scorer directory ``path`` (``model`` constructor arguments and ``meta``)."""
    p = Path(path)
    f = p / CONFIG_FILE
    if not f.is_file():
        raise FileNotFoundError(f"scorer dir {p}: missing {CONFIG_FILE} (train one with `taps train-scorer`)")
    return json.loads(f.read_text(encoding="utf-8"))


def load_scorer_weights(path, device=None) -> Tuple[ScorerWeights, dict]:
    """``(ScorerWeights on device, config dict)`` of a scorer directory."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg = read_config(p)
    wf = p / WEIGHTS_FILE
    if not wf.is_file():
        raise FileNotFoundError(f"scorer dir {p}: missing {WEIGHTS_FILE}")
    tensors = load_file(str(wf))
    eps = float(cfg.get("model", {}).get("ln_eps", 1e-5))
    try:
        w = ScorerWeights(ln_eps=eps, **{k: v.float() for k, v in tensors.items()})
    except TypeError as e:
        raise ValueError(f"scorer dir {p}: {WEIGHTS_FILE} does not hold ScorerWeights fields ({e})") from None
    w.validate(name=str(wf))
    if device is not None:
        w = w.to(device=device)
    return w, cfg
