"""The drafter's configuration (``config.json``), which target layers feed it, and the check that a drafter
fits a target."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import torch


#: file beside ``config.json`` holding the reduced draft vocabulary (``ids``: sorted int64)
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def default_target_layer_ids(num_target_layers: int, n: int) -> List[int]:
    """``n`` target layer ids spread evenly from 1 to ``L-3`` (published rule),
    rounded to the nearest integer. ``n == 1`` gives ``[L // 2]``.

    >>> default_target_layer_ids(36, 5)
    [1, 9, 17, 25, 33]
    """
    if n < 1:
        raise ValueError("need at least one target layer")
    if num_target_layers < 4 and n > 1:
        raise ValueError(f"target has {num_target_layers} layers: too few to spread {n} layer ids over 1..L-3")
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]


def extract_context_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate ``hidden_states[id+1]`` for ``id`` in ``layer_ids`` (index 0
    of an HF ``output_hidden_states`` tuple is the embedding output).
    Returns ``[B, T, n*H]``."""
    n = len(hidden_states)
    for i in layer_ids:
        if not 0 <= i + 1 < n:
            raise ValueError(f"target layer id {i} out of range for {n - 1} target layers")
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)



@dataclass
class DFlashConfig:
    hidden_size: int = 576
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    num_hidden_layers: int = 3
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    vocab_size: int = 49152
    block_size: int = 16
    num_target_layers: int = 30
    target_layer_ids: List[int] = field(default_factory=lambda: [1, 8, 14, 20, 27])
    mask_token_id: Optional[int] = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    #: size of the reduced draft vocabulary stored beside the weights (``draft_vocab.safetensors``), or None
    draft_vocab_size: Optional[int] = None
    extra: dict = field(default_factory=dict)

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def num_draft_positions(self) -> int:
        return self.block_size - 1

    def to_dict(self) -> dict:
        d = dict(self.extra)
        d.update({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
        })
        if self.draft_vocab_size is not None:
            d["draft_vocab_size"] = int(self.draft_vocab_size)
            d["draft_vocab_file"] = DRAFT_VOCAB_FILE
        else:
            d.pop("draft_vocab_size", None)
            d.pop("draft_vocab_file", None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        d = dict(d)
        dfc = dict(d.pop("dflash_config", None) or {})
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kw = {}
        for k in list(d):
            if k in known:
                kw[k] = d.pop(k)
        if "target_layer_ids" in dfc:
            kw["target_layer_ids"] = dfc.pop("target_layer_ids")
        if "mask_token_id" in dfc:
            kw["mask_token_id"] = dfc.pop("mask_token_id")
        if "rope_theta" not in kw:
            rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
            if isinstance(rp, dict) and "rope_theta" in rp:
                kw["rope_theta"] = rp["rope_theta"]
        if "head_dim" not in kw and "hidden_size" in kw and "num_attention_heads" in kw:
            kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
        if "target_layer_ids" not in kw:
            kw["target_layer_ids"] = default_target_layer_ids(kw.get("num_target_layers", 30),
                                                              kw.get("num_hidden_layers", 3))
        kw["target_layer_ids"] = [int(x) for x in kw["target_layer_ids"]]
        for k in ("architectures", "model_type", "tie_word_embeddings"):
            d.pop(k, None)
        if dfc:
            d["dflash_config_extra"] = dfc
        return cls(**kw, extra=d)

    @classmethod
    def from_pretrained(cls, path) -> "DFlashConfig":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"drafter config not found: {p} (a drafter dir holds config.json + model.safetensors)")
        return cls.from_dict(json.loads(p.read_text()))

    def save(self, path) -> None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        (p / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _target_field(tc, name, default=None):
    if isinstance(tc, dict):
        v = tc.get(name, default)
    else:
        v = getattr(tc, name, default)
    return v


def check_compatible(drafter_config: DFlashConfig, target_config) -> None:
    """Raise ``ValueError`` naming the offending field when the drafter cannot
    run on this target (``target_config``: HF config or dict)."""
    dc = drafter_config
    th = _target_field(target_config, "hidden_size")
    tv = _target_field(target_config, "vocab_size")
    tl = _target_field(target_config, "num_hidden_layers")
    if th is not None and dc.hidden_size != th:
        raise ValueError(f"incompatible drafter: hidden_size {dc.hidden_size} != target hidden_size {th} "
                         f"(the drafter borrows the target's embeddings and LM head)")
    if tv is not None and dc.vocab_size != tv:
        raise ValueError(f"incompatible drafter: vocab_size {dc.vocab_size} != target vocab_size {tv}")
    if tl is not None:
        if dc.num_target_layers != tl:
            raise ValueError(f"incompatible drafter: num_target_layers {dc.num_target_layers} != target "
                             f"num_hidden_layers {tl}")
        bad = [i for i in dc.target_layer_ids if not 0 <= i < tl]
        if bad:
            raise ValueError(f"incompatible drafter: target_layer_ids {bad} out of range [0, {tl}) of the target")
    if not dc.target_layer_ids:
        raise ValueError("incompatible drafter: target_layer_ids is empty")
    if dc.mask_token_id is None:
        raise ValueError("incompatible drafter: mask_token_id is missing (dflash_config.mask_token_id)")
    vv = tv if tv is not None else dc.vocab_size
    if not 0 <= int(dc.mask_token_id) < vv:
        raise ValueError(f"incompatible drafter: mask_token_id {dc.mask_token_id} outside the vocabulary [0, {vv})")
    if dc.block_size < 2:
        raise ValueError(f"incompatible drafter: block_size {dc.block_size} < 2")
    if dc.num_attention_heads % dc.num_key_value_heads:
        raise ValueError(f"incompatible drafter: num_attention_heads {dc.num_attention_heads} not a multiple of "
                         f"num_key_value_heads {dc.num_key_value_heads}")
