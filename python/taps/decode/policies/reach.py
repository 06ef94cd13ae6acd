"""Reach models: the log probability that the target accepts each node of a candidate pool.

* :class:`MarginalReach`: the pool's own log-mass (the drafter's marginal product along the path; it
  underestimates acceptance, METHOD.md section 3).
* :class:`ScorerReach`: the learned scorer's path-conditioned reach (:func:`taps_kernels.score_edges`),
  reading the target's input embeddings and the drafter's hidden states.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

import taps_kernels
from taps_kernels import CandidatePool

from ..tree_ops import IN_ROUND
from .base import PolicyError
from .scorer_io import load_scorer_weights
from .sources import DEFAULT_TOP_K


def scorer_dir(tiny: bool = False) -> Path:
    """The shipped scorer's directory (``tiny``: the 7-scalar variant)."""
    from taps import paths  # $TAPS_HOME, then package data, then the source checkout

    name = paths.SCORER_TINY if tiny else paths.SCORER
    try:
        return paths.checkpoint_dir(name)
    except FileNotFoundError:
        return paths.checkpoint_candidates(name)[-1]  # the loader names the missing directory


class MarginalReach:
    """The pool's log-mass ``logq``: nothing to load, nothing to time."""

    top_k: Optional[int] = None

    def bind(self, policy_name: str, target_model, drafter, device) -> None:
        pass

    def __call__(self, pool: CandidatePool, draft_hidden, timer) -> torch.Tensor:
        return pool.logq


class ScorerReach:
    """Scorer reach over the pool.

    Args:
        scorer: a scorer directory (default: :func:`scorer_dir`), or already loaded ScorerWeights.
        tiny: the 7-scalar scorer (default directory only).
        top_k: the pool's top-K (default: the scorer's training top-K, else :data:`DEFAULT_TOP_K`).
    """

    def __init__(self, scorer=None, tiny: bool = False, top_k: Optional[int] = None):
        self.scorer = scorer
        self.tiny = tiny
        self.top_k = top_k
        self.weights = None
        self.emb = None

    def bind(self, policy_name: str, target_model, drafter, device) -> None:
        """Load the weights (once), move them to ``device`` and refuse a scorer whose widths do not fit."""
        if self.weights is None:
            if isinstance(self.scorer, taps_kernels.ScorerWeights):
                w, cfg = self.scorer, {}
            else:
                d = Path(self.scorer) if self.scorer is not None else scorer_dir(self.tiny)
                if not d.is_dir():
                    raise FileNotFoundError(f"policy {policy_name}: scorer directory {d} not found (train one with "
                                            f"`taps train-scorer`, or pass scorer=/--scorer)")
                w, cfg = load_scorer_weights(d)
            self.top_k = self.top_k or int(cfg.get("model", {}).get("top_k", DEFAULT_TOP_K))
            self.weights = w
        self.weights = self.weights.to(device=device, dtype=torch.float32)
        # A scorer is trained for one target/drafter pair: refuse one whose widths cannot fit before any round runs.
        embed_dim = target_model.get_input_embeddings().weight.shape[1]
        hidden_dim = getattr(getattr(drafter, "config", None), "hidden_size", None)
        try:
            self.weights.validate(embed_dim=embed_dim if self.weights.full else None,
                                  hidden_dim=hidden_dim if self.weights.full else None)
        except ValueError as e:
            raise PolicyError(f"policy {policy_name}: the scorer does not fit this target/drafter ({e})") from None
        if self.weights.full:
            self.emb = target_model.get_input_embeddings().weight.detach()
            if self.emb.dtype != torch.float32:
                self.emb = self.emb.float()

    def __call__(self, pool: CandidatePool, draft_hidden, timer) -> torch.Tensor:
        with timer("scoring"):
            hid = draft_hidden.float() if self.weights.full else None
            _, _, log_reach = taps_kernels.score_edges(pool, self.weights, self.emb if self.weights.full else None, hid,
                                                      validate=IN_ROUND)
        return log_reach
