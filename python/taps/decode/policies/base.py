"""The tree-policy interface and its registry.

A policy turns one round's draft into the tree the target verifies. Every
policy lives in its own file in this package and registers itself with
:func:`register_policy`; :func:`make_policy` builds one from a spec string such
as ``"ar"``, ``"dflash"`` or ``"ddtree:16"`` (name, then an optional argument
after the first colon). Adding a policy therefore means adding a file, never
editing the loop.

Every policy builds the trees of all rows of a batch in one call, on the device, with static shapes
(:class:`BuiltTree`); the loop reads the results back once per round and hands the host-side numbers to
:meth:`TreePolicy.observe`.

Policies that need more than the draft (a learned scorer reading the target's
embeddings, a measured latency table) get them in :meth:`TreePolicy.bind`,
called once by the decoder before the first round (they may raise there, e.g.
FileNotFoundError for a missing scorer). ``uses_drafter = False`` tells the loop
not to run (or load) a drafter at all.

The simple policies (``ar``, ``dflash``, ``ddtree``, ``lookup``) are one small class each; the costed ones
are a :class:`.composed.ComposedPolicy` of proposal sources, a reach model, a size rule and an optional
draft gate, whose capabilities (the attributes below) follow from its parts.
"""
from __future__ import annotations

import contextlib
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from taps_kernels import Tree

from ..tree_ops import IN_ROUND, chain_tree, root_only_tree  # noqa: F401  (re-exported: policies build these)


class PolicyError(ValueError):
    """A policy spec that cannot be built (unknown name, bad argument)."""


@dataclass
class BuiltTree:
    """One round's trees for every row of the batch.

    Attributes:
        tree: :class:`taps_kernels.Tree` ``[B, N]`` on the draft's device; node 0 of row b is ``bonus[b]``,
            nodes in topological order, no node deeper than the row's depth cap. ``N`` is fixed per policy
            (static shapes): rows with fewer real nodes are padded.
        expected: ``[B] float32`` expected tokens of each row's tree (``1 + sum`` of its kept nodes' reach),
            or None when the policy has no estimate (the loop reads it back with the round's results; the
            draft gate uses it in :meth:`TreePolicy.observe`).
        sizes: ``[B] int64`` non-root nodes the size rule chose per row (before the depth cap), or None.
        aux: ``[B, A] int64`` columns the policy wants back on the host (packed into the round's one read and
            handed to :meth:`TreePolicy.observe_rows`), or None.
    """

    tree: Tree
    expected: Optional[torch.Tensor] = None
    sizes: Optional[torch.Tensor] = None
    aux: Optional[torch.Tensor] = None


class TreePolicy:
    """Builds the verification trees of one round, for every row of a batch at once.

    Attributes:
        name: the spec string it was built from (``"ddtree:16"``), used in reports.
        uses_drafter: False for policies that verify the root alone (plain autoregressive decoding);
            the loop then never runs or even loads a drafter.
        chain_trees: True when every tree is a chain (DFlash, AR).

    A policy never reads tensor values on the host inside :meth:`build` (the round's one host read is the
    loop's): host-side decisions (:meth:`wants_draft`) use what :meth:`observe` received from the previous
    rounds' reads.
    """

    name: str = "base"
    uses_drafter: bool = True
    #: every tree this policy builds is a chain (node i at depth i): the loop then skips KV moves (and, on the
    #: sdpa path with equal row lengths, the tree mask)
    chain_trees: bool = False
    #: :meth:`build` maps logit columns through :attr:`vocab_ids`: the loop may then hand it the drafter's
    #: reduced-vocabulary logits (a third of the columns for a 16K draft vocabulary; the pool costs less)
    handles_draft_vocab: bool = False
    #: ``[V_draft] int64`` sorted token ids of the logit columns :meth:`build` receives (set by :meth:`bind` when
    #: the drafter has a draft vocabulary and :attr:`handles_draft_vocab`), else None
    vocab_ids: Optional[torch.Tensor] = None
    #: :meth:`build` takes ``history=(tokens [B, C] int64, lengths [B] int64)``, each row's committed tokens
    #: (prompt, generated, and the root last; :class:`taps.decode.token_history.TokenHistory`), and is called in
    #: undrafted rounds too, with ``draft_logits`` and ``draft_hidden`` None
    wants_history: bool = False

    def bind(self, target_model, drafter, device: torch.device) -> None:
        """Called once before decoding: takes the drafter's draft vocabulary when :meth:`build` maps logit columns
        (:attr:`vocab_ids`); policies with learned parts load or move them here too (calling this first)."""
        draft_vocab = getattr(drafter, "draft_vocab", None)
        self.vocab_ids = draft_vocab if draft_vocab is not None and self.handles_draft_vocab else None

    def reset(self) -> None:
        """Hook called by the decoder when a new batch starts (per-run state goes here)."""

    def draft_positions(self, num_positions: int) -> int:
        """How many of the drafter's ``num_positions`` block positions this policy's trees can reach; the loop
        projects only those onto the vocabulary (the rest would cost head time and never be used)."""
        return num_positions

    def max_tree_depth(self, draft_positions: int) -> int:
        """Deepest node this policy's trees can have when the drafter has ``draft_positions`` positions (0:
        no drafter); the loop sizes the accepted path by it."""
        return draft_positions

    def tree_width(self, draft_positions: int) -> int:
        """Widest tree (root included) this policy builds when the drafter has ``draft_positions`` positions;
        the loop reserves cache room for it. Default: a chain as deep as :meth:`max_tree_depth`."""
        return self.max_tree_depth(draft_positions) + 1

    def wants_draft(self) -> bool:
        """Whether the coming round runs the drafter (for the whole batch); False: every row verifies its
        root alone."""
        return True

    def observe(self, expected: Optional[List[float]], sizes: Optional[List[int]], times: Dict[str, float]) -> None:
        """Host-side feedback after a drafted tree's round was read back: per running row the tree's
        expected tokens and chosen size (None when the policy returned none), and the seconds of the stages
        that built it (:data:`taps.decode.stats.BUILD_STAGES`)."""

    def observe_rows(self, accepted: Dict[int, Optional[List[int]]], aux: Dict[int, List[int]]) -> None:
        """Host-side feedback after every read that carried :attr:`BuiltTree.aux`, per running row index: the
        tokens the row committed in this round (the accepted nodes of the tree it verified, then the target's next
        token; None when the row just joined), and the aux columns of the tree it verifies next."""

    def build(self, draft_logits: Optional[torch.Tensor], draft_hidden: Optional[torch.Tensor], bonus: torch.Tensor,
              depth_cap: Optional[torch.Tensor] = None, timer=None, rows: Optional[int] = None) -> BuiltTree:
        """Return the trees to verify.

        Args:
            draft_logits: ``[B, D, V]`` drafter logits for block positions 1..D (position ``i`` proposes
                depth ``i + 1``), or None when ``uses_drafter`` is False; with :attr:`vocab_ids` set,
                ``[B, D, V_draft]`` whose column ``j`` is token ``vocab_ids[j]``.
            draft_hidden: ``[B, D, H]`` drafter hidden states at the same positions (or None).
            bonus: ``[B] int64`` the roots (each row's last, not yet verified, target choice).
            depth_cap: ``[B] int64`` deepest node each row may keep (nodes below could only produce tokens
                the length limit truncates; 0 = root only), on the draft's device; None: no cap.
            timer: stage timer (``with timer("pool"): ...``; :class:`taps.decode.timing.StageTimer`);
                None: untimed.
            rows: how many rows are running (a host int; default B); the others have depth cap 0 and
                their trees are never verified.

        Policies with :attr:`wants_history` also receive ``history=(tokens [B, C], lengths [B])``.

        Returns:
            :class:`BuiltTree`.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class _NoTimer:
    def __call__(self, name):
        return contextlib.nullcontext()

    def add(self, name, seconds):
        pass


NO_TIMER = _NoTimer()


# --- registry -----------------------------------------------------------------------------------------------------

_REGISTRY: Dict[str, Tuple[Callable[..., TreePolicy], str]] = {}
_PARAMS: Dict[str, str] = {}
_OPTIONS: Dict[str, Tuple[str, ...]] = {}
_DISCOVERED = False


def register_policy(name: str, help: str = "", params: str = "", options: Tuple[str, ...] = ()):
    """Decorator registering ``factory(arg: Optional[str], **options) -> TreePolicy`` under ``name``; ``params``
    names its argument after the colon (``"B"`` for ``ddtree:B``; brackets when optional), empty when it takes
    none; ``options`` names the keyword options it accepts (``("scorer", "pool_size")`` for TAPS)."""
    def deco(factory):
        _REGISTRY[name] = (factory, help)
        _PARAMS[name] = params
        _OPTIONS[name] = tuple(options)
        return factory
    return deco


def policy_options(spec: str) -> Tuple[str, ...]:
    """Keyword options the policy of ``spec`` accepts in :func:`make_policy` (``()`` for most)."""
    _discover()
    return _OPTIONS.get(spec.strip().partition(":")[0], ())


def policy_params() -> Dict[str, str]:
    """``{name: argument syntax}`` of every registered policy (``""`` when it takes none)."""
    _discover()
    return {k: _PARAMS.get(k, "") for k in sorted(_REGISTRY)}


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


def make_policy(spec: str, **options) -> TreePolicy:
    """Build a policy from ``"name"`` or ``"name:arg"`` (e.g. ``"ddtree:16"``) and the keyword options it
    accepts (:func:`policy_options`; e.g. ``make_policy("taps", scorer="path/to/scorer", pool_size=64)``).
    Options given as None are ignored. Raise PolicyError for an unknown name or option."""
    _discover()
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(f"policy: expected a name such as 'ar', 'dflash' or 'ddtree:16', received {spec!r}")
    name, _, arg = spec.strip().partition(":")
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise PolicyError(f"policy: unknown policy {name!r}; available: {known}")
    options = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(options) - set(_OPTIONS[name]))
    if unknown:
        accepted = ", ".join(_OPTIONS[name]) or "none"
        raise PolicyError(f"policy {name}: unknown option(s) {unknown}; it accepts: {accepted}")
    policy = _REGISTRY[name][0](arg or None, **options)
    policy.name = spec.strip()
    return policy


#: The options a run passes to every policy it builds (``--scorer``, ``--pool-size``); each policy takes those it accepts.
RUN_OPTIONS = ("scorer", "pool_size")


def policy_from_options(spec: str, options=None) -> TreePolicy:
    """:func:`make_policy` of ``spec`` with the :data:`RUN_OPTIONS` attributes of ``options`` (any object, e.g. a
    command's arguments; missing or None: not passed) that this policy accepts, so one set of run options
    serves a list of policies."""
    accepted = policy_options(spec)
    given = {k: getattr(options, k, None) for k in RUN_OPTIONS if k in accepted}
    return make_policy(spec, **given)


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
