"""The tree-policy interface and its registry.

A policy turns one round's draft into the tree the target verifies. Every
policy lives in its own file in this package and registers itself with
:func:`register_policy`; :func:`make_policy` builds one from a spec string such
as ``"ar"``, ``"dflash"`` or ``"ddtree:16"`` (name, then an optional argument
after the first colon). Adding a policy therefore means adding a file, never
editing the loop.

Policies that need more than the draft (a learned scorer reading the target's
embeddings, a measured latency table) get them in :meth:`TreePolicy.bind`,
called once by the decoder before the first round (they may raise there, e.g.
FileNotFoundError for a missing scorer). ``uses_drafter = False`` tells the loop
not to run (or load) a drafter at all.
"""
from __future__ import annotations

import importlib
import pkgutil
import time
from typing import Callable, Dict, Optional, Tuple

import torch

from taps_kernels import Tree


class PolicyError(ValueError):
    """A policy spec that cannot be built (unknown name, bad argument)."""


class TreePolicy:
    """Builds the verification tree of one round.

    Attributes:
        name: the spec string it was built from (``"ddtree:16"``), used in reports.
        uses_drafter: False for policies that verify the root alone (plain autoregressive decoding);
            the loop then never runs or even loads a drafter.
    """

    name: str = "base"
    uses_drafter: bool = True

    def bind(self, target_model, drafter, device: torch.device) -> None:
        """Hook called once before decoding; policies with learned parts load or move them here."""

    def reset(self) -> None:
        """Hook called by the decoder when a new generation starts (per-generation state goes here)."""

    def wants_draft(self) -> bool:
        """Whether the coming round runs the drafter; False makes the loop verify the root alone."""
        return True

    def build(self, draft_logits: Optional[torch.Tensor], draft_hidden: Optional[torch.Tensor],
              bonus: torch.Tensor) -> Tuple[Tree, Dict[str, float]]:
        """Return the tree to verify and the seconds spent per stage.

        Args:
            draft_logits: ``[1, D, V]`` drafter logits for block positions 1..D (position ``i`` proposes
                depth ``i + 1``), or None when ``uses_drafter`` is False.
            draft_hidden: ``[1, D, H]`` drafter hidden states at the same positions (or None).
            bonus: ``[1] int64`` the root token (the target's last, not yet verified, choice).
        Returns:
            ``(tree, timings)``: a :class:`taps_kernels.Tree` with batch 1, node 0 = ``bonus``, nodes in
            topological order; ``timings`` maps stage names (``"pool"``, ``"scoring"``, ``"selection"``)
            to seconds.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def root_only_tree(bonus: torch.Tensor) -> Tree:
    """Tree of the root alone: ``tokens [1,1] = bonus``."""
    dev = bonus.device
    return Tree(bonus.view(1, 1).to(torch.int64), torch.full((1, 1), -1, dtype=torch.int32, device=dev),
                torch.zeros(1, 1, dtype=torch.int32, device=dev), torch.ones(1, dtype=torch.int32, device=dev))


def chain_tree(bonus: torch.Tensor, chain: torch.Tensor) -> Tree:
    """Tree ``bonus -> chain[0] -> chain[1] -> ...``; ``chain [D] int64``; node i sits at depth i."""
    dev = bonus.device
    n = chain.numel() + 1
    tokens = torch.cat([bonus.view(1).to(torch.int64), chain.view(-1).to(torch.int64)]).view(1, n)
    idx = torch.arange(n, dtype=torch.int32, device=dev)
    return Tree(tokens, (idx - 1).view(1, n), idx.view(1, n).clone(), torch.full((1,), n, dtype=torch.int32, device=dev))


class Stopwatch:
    """Accumulates wall time per stage name: ``with sw("pool"): ...``; ``sw.times`` is the dict."""

    def __init__(self):
        self.times: Dict[str, float] = {}
        self._name = None
        self._t = 0.0

    def __call__(self, name: str) -> "Stopwatch":
        self._name = name
        return self

    def __enter__(self):
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.times[self._name] = self.times.get(self._name, 0.0) + time.perf_counter() - self._t
        return False


# --- registry -----------------------------------------------------------------------------------------------------

_REGISTRY: Dict[str, Tuple[Callable[[Optional[str]], TreePolicy], str]] = {}
_DISCOVERED = False


def register_policy(name: str, help: str = ""):
    """Decorator registering ``factory(arg: Optional[str]) -> TreePolicy`` under ``name``."""
    def deco(factory):
        _REGISTRY[name] = (factory, help)
        return factory
    return deco


def _discover() -> None:
    # Importing every module of this package lets a new policy file register itself.
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    pkg = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{__package__}.{info.name}")


def available_policies() -> Dict[str, str]:
    """``{name: one-line help}`` of every registered policy."""
    _discover()
    return {k: v[1] for k, v in sorted(_REGISTRY.items())}


def make_policy(spec: str) -> TreePolicy:
    """Build a policy from ``"name"`` or ``"name:arg"`` (e.g. ``"ddtree:16"``); raise PolicyError if unknown."""
    _discover()
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(f"policy: expected a name such as 'ar', 'dflash' or 'ddtree:16', received {spec!r}")
    name, _, arg = spec.strip().partition(":")
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise PolicyError(f"policy: unknown policy {name!r}; available: {known}")
    policy = _REGISTRY[name][0](arg or None)
    policy.name = spec.strip()
    return policy


def parse_budget(name: str, arg: Optional[str], default: Optional[int] = None) -> int:
    """Parse a positive integer policy argument (``"16"`` in ``"ddtree:16"``)."""
    if arg is None:
        if default is None:
            raise PolicyError(f"policy {name}: expected a node budget, e.g. '{name}:16'")
        return default
    try:
        value = int(arg)
    except ValueError:
        raise PolicyError(f"policy {name}: expected an integer budget after ':', received {arg!r}") from None
    if value < 1:
        raise PolicyError(f"policy {name}: expected a budget >= 1, received {value}")
    return value
