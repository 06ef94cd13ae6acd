"""Subtree selection: keep a prefix-closed subtree of the pool, by reach, throughput or published utility."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple, Union

import torch

from .._checks import (FLOAT_DTYPES, check_data_device, check_float, check_int, check_log_values, check_nonempty,
                       check_output_size, check_tensor, check_tree_tensors, first_index)
from .._library import backend_for, define, fresh, values_asked
from ..backend import has_impl, resolve
from ..layout import Selection, Tree, validate_tree
from ..reference.select import UTILITY_OPTION_DEFAULTS

RULES = ("reach", "utility")
"""The ``rule`` strings of the ``taps::select_subtree`` op (:class:`ReachRule`, :class:`UtilityRule`)."""


@dataclass(frozen=True)
class ReachRule:
    """The top nodes by prefix-closed reach (parent-first ties), as many as ``max_nodes`` or the table pays for.

    Fields:
        latency: optional ``[L]`` seconds to verify root + n nodes, ``n = 0..L-1`` (a float tensor or a sequence
            of floats); with it the size is ``n* = argmax (1 + sum of the top-n reaches) / (t0 + latency[n])``,
            each round on its own (METHOD.md); entries finite with ``t0 + latency[n] > 0``. None: ``max_nodes``.
        t0: finite fixed per-round seconds (draft, pool, selection) added to every latency entry.
    """

    latency: Optional[Union[torch.Tensor, Sequence[float]]] = None
    t0: float = 0.0

    def _op_args(self, device: torch.device) -> Tuple[tuple, dict]:
        """The op's ``(latency, t0, rule, lambda_node, lambda_depth, min_utility)`` and options, checked."""
        t0 = check_float("rule.t0", self.t0)
        latency = self.latency
        if latency is not None:
            if not isinstance(latency, torch.Tensor):
                try:
                    latency = torch.as_tensor(latency, dtype=torch.float64)
                except (TypeError, ValueError, RuntimeError) as exc:
                    raise TypeError(f"rule.latency: expected a 1-D table of seconds (tensor or sequence of floats), "
                                    f"received {type(latency).__name__} ({exc})") from None
            check_tensor("rule.latency", latency, dtypes=FLOAT_DTYPES + (torch.float64,), ndim=1)
            check_data_device("rule.latency", latency)
            if latency.numel() < 1:
                raise ValueError("rule.latency: expected a non-empty 1-D table of seconds, received shape (0,)")
            latency = latency.to(torch.float64).to(device)
        # the op's signature carries the utility scalars for both rules; the reach rule never reads them
        unread = (UtilityRule.lambda_node, UtilityRule.lambda_depth, UtilityRule.min_utility)
        return (latency, t0, "reach") + unread, {}


_PAPER = dict(max_leaves=64, fill_below_threshold=True, max_children=16, min_nodes=4)


@dataclass(frozen=True)
class UtilityRule:
    """The published utility rule: nodes by ``u = r / (lambda_node + lambda_depth * depth)`` with their ancestors,
    stopping at the first below ``min_utility``; plus the TAPS authors' additions (docs/DESIGN.md, "Upstream
    parity"), whose defaults give the rule as described, bit for bit. :meth:`paper` gives the authors' values.

    Nodes are visited by ``(-u, index)`` in every pass.

    Fields:
        lambda_node: finite, ``> 0``. lambda_depth: finite, ``>= 0``.
        min_utility: a float, not NaN (``-inf`` keeps going to ``max_nodes``).
        max_leaves: None or an int ``>= 1``: the main pass ends after that many candidates added nodes (each is a
            leaf when taken, so that pass leaves at most ``max_leaves`` leaves; when utility falls along paths
            each adds one node, so the tree holds about ``max_leaves`` nodes).
        fill_below_threshold: a bool; when no candidate reaches ``min_utility``, take candidates anyway (instead
            of a root-only tree).
        max_children: None or an int ``>= 1``: only the first ``max_children`` children of a parent, in pool
            order (draft rank order in a best-first pool), are candidates; a later child can still enter as the
            missing ancestor of a candidate, as in the authors' code.
        min_nodes: an int ``>= 0``: while fewer than ``min(min_nodes, max_nodes)`` nodes are kept, a second pass
            over all candidates, threshold and ``max_leaves`` ignored, adds more.

    The C++ and Triton backends implement the four additions at their defaults only: other values run the
    reference (a host loop; CUDA tensors are copied to the host), and ``backend="cpp"``/``"triton"`` raises
    :class:`BackendUnavailable` naming the option.
    """

    lambda_node: float = 1.0
    lambda_depth: float = 0.002
    min_utility: float = 0.0
    max_leaves: Optional[int] = None
    fill_below_threshold: bool = False
    max_children: Optional[int] = None
    min_nodes: int = 0

    @classmethod
    def paper(cls, **overrides) -> "UtilityRule":
        """The TAPS authors' prefix-closed selector: at most 64 endpoints (max_verify_sequences), the threshold
        dropped when no node passes it, the first 16 children of a parent as candidates (per_parent_child_cap),
        at least 4 nodes (min_verify_nodes of the published runs); ``overrides`` win, defaults included."""
        return replace(cls(**_PAPER), **overrides)

    def _op_args(self, device: torch.device) -> Tuple[tuple, dict]:
        """The op's ``(latency, t0, rule, lambda_node, lambda_depth, min_utility)`` and the options off their
        default (the backends that lack an option decline a call that names it), checked."""
        scalars = (None, 0.0, "utility", check_float("rule.lambda_node", self.lambda_node, above=0.0),
                   check_float("rule.lambda_depth", self.lambda_depth, at_least=0.0),
                   check_float("rule.min_utility", self.min_utility, finite=False))
        options = dict(max_leaves=self.max_leaves, fill_below_threshold=self.fill_below_threshold,
                       max_children=self.max_children, min_nodes=self.min_nodes)
        for name in ("max_leaves", "max_children"):
            if options[name] is not None:
                options[name] = check_int(f"rule.{name}", options[name], minimum=1)
        fill = options["fill_below_threshold"]
        if not (isinstance(fill, bool) or type(fill).__name__ == "bool_"):
            raise TypeError(f"rule.fill_below_threshold: expected a bool, received {type(fill).__name__} {fill!r}")
        options["fill_below_threshold"] = bool(fill)
        options["min_nodes"] = check_int("rule.min_nodes", options["min_nodes"], minimum=0)
        return scalars, {k: v for k, v in options.items() if v != UTILITY_OPTION_DEFAULTS[k]}


@dataclass(frozen=True)
class ThroughputRule:
    """The size rule the shipped policies use: tree sizes chosen jointly for the batch, for long-run tokens/s.

    Take every row's best ``max_nodes`` nodes by reach, merge them by reach, and keep each while its expected
    tokens pay for the verify time it adds at the batch's total node count:
    ``k* = argmax_k sum_{i<=k} r_(i) - rows * (latency[k] - latency[0]) / plain_seconds``; row b's tree is its best
    ``n_b`` nodes (its entries among the first ``k*``), so a row whose draft is poor gets few nodes and a batch on
    flat verify costs (a GPU) gets large trees everywhere; one row is the one-row rule. Why long-run rate and not
    each round's own ratio: :class:`taps.decode.policies.sizing.ThroughputSize`. Reach must be non-increasing along
    paths (pool log-masses and scorer reach are), so each row's top nodes are prefix-closed.

    Fields:
        latency: ``[L] float64`` seconds to verify the batch's roots plus ``k`` nodes in total (a tensor on the
            tree's device: built once; ``taps.decode.latency.LatencyTable.batch_seconds``), non-decreasing.
        plain_seconds: seconds of a plain (root-only) round of the batch, ``> 0``.
        rows: rows that decode (the plain round makes ``rows`` tokens); None: the batch size.
    """

    latency: torch.Tensor
    plain_seconds: float
    rows: Optional[int] = None


def select_subtree(tree: Tree, log_reach: torch.Tensor, max_nodes: int,
                   rule: Union[ReachRule, UtilityRule, ThroughputRule] = ReachRule(), backend: Optional[str] = None,
                   validate: Optional[str] = None) -> Selection:
    """Choose the subtree to verify.

    Args:
        tree: the pool (:class:`Tree`, ``N`` rows).
        log_reach: ``[B, N]`` float log reach of each node (root 0).
        max_nodes: most non-root nodes kept (``>= 1``).
        rule: which nodes, and how many, with the rule's own values (checked here, errors name the field):
            :class:`ReachRule` (default: the top ``max_nodes`` by reach; with a latency table, the per-round
            throughput size), :class:`UtilityRule` (the published utility rule; ``UtilityRule.paper()`` the
            authors' settings) or :class:`ThroughputRule` (the batch's trees sized jointly, the rule the shipped
            policies use; the :class:`Selection` then carries ``expected``).
        backend: None (the dispatcher's choice, :mod:`taps_kernels.backend`) or a backend name.
        validate: value checks (tree structure, non-finite reach, latency table): ``"auto"`` (default, or
            ``TAPS_VALIDATE``) on CPU tensors only, ``"full"`` on any device, ``"none"`` never
            (:mod:`taps_kernels._checks`).
    Non-finite values: ``log_reach`` of real non-root nodes is finite or ``-inf`` (unreachable: ranked last, ties
    by node index, identical on every backend); NaN and ``+inf`` are refused.
    Returns:
        :class:`Selection`: ``tree`` with ``max_nodes + 1`` rows (pool order kept, root first),
        ``pool_index [B, max_nodes+1] int64`` and ``num_selected [B] int32``.
    """
    if isinstance(rule, ThroughputRule):
        return _select_throughput(tree, log_reach, max_nodes, rule, backend, validate)
    if not isinstance(rule, (ReachRule, UtilityRule)):
        raise TypeError(f"rule: expected a ReachRule, UtilityRule or ThroughputRule, received "
                        f"{type(rule).__name__} {rule!r}")
    validate_tree(tree, "tree", deep=False)  # values (structure, reach, latency table): in the op, as validate says
    dev = check_data_device("tree.tokens", tree.tokens)
    check_nonempty("tree.tokens", tree.tokens, [(0, "tree (batch row)")])
    max_nodes = check_int("max_nodes", max_nodes)
    B, N = tree.tokens.shape
    check_output_size("max_nodes", max_nodes, B * (max_nodes + 1) * (8 + 8 + 4 + 4), dev)
    check_tensor("log_reach", log_reach, dtypes=FLOAT_DTYPES, shape=(B, N), device=dev)
    scalars, options = rule._op_args(dev)
    parents, depth, num_nodes = tree.parents.contiguous(), tree.depth.contiguous(), tree.num_nodes.contiguous()
    pool_index, num_selected = select_subtree_op(parents, depth, num_nodes, log_reach.float().contiguous(), max_nodes,
                                                 *scalars, backend=backend, validate=validate, **options)
    # Re-index with the same backend when it has a re-indexer (cpp, triton); else the torch version (any device).
    reindex_backend = backend if backend is None or has_impl("reindex_subtree", backend) else "reference"
    sub = reindex_subtree_op(tree.tokens.contiguous(), parents, depth, num_nodes, pool_index, num_selected,
                             reindex_backend)
    return Selection(Tree(*sub), pool_index, num_selected)


def _select_throughput(tree: Tree, log_reach: torch.Tensor, max_nodes: int, rule: ThroughputRule,
                       backend: Optional[str], validate: Optional[str]) -> Selection:
    validate_tree(tree, "tree", deep=False)
    dev = check_data_device("tree.tokens", tree.tokens)
    check_nonempty("tree.tokens", tree.tokens, [(0, "tree (batch row)")])
    B, N = tree.tokens.shape
    max_nodes = check_int("max_nodes", max_nodes)
    check_output_size("max_nodes", max_nodes, B * (max_nodes + 1) * (8 + 8 + 4 + 4 + 4), dev)
    check_tensor("log_reach", log_reach, dtypes=FLOAT_DTYPES, shape=(B, N), device=dev)
    check_tensor("rule.latency", rule.latency, dtypes=(torch.float64,), ndim=1, device=dev)
    plain = check_float("rule.plain_seconds", rule.plain_seconds, above=0.0)
    rows = B if rule.rows is None else check_int("rule.rows", rule.rows)
    parents, depth, num_nodes = tree.parents.contiguous(), tree.depth.contiguous(), tree.num_nodes.contiguous()
    pool_index, num_selected, expected = select_throughput_op(parents, depth, num_nodes, log_reach.float().contiguous(),
                                                              max_nodes, rule.latency, plain, rows, backend, validate)
    reindex_backend = backend if backend is None or has_impl("reindex_subtree", backend) else "reference"
    sub = reindex_subtree_op(tree.tokens.contiguous(), parents, depth, num_nodes, pool_index, num_selected,
                             reindex_backend)
    return Selection(Tree(*sub), pool_index, num_selected, expected)


def _throughput_meta(parents, depth, num_nodes, log_reach, max_nodes, table, plain_seconds, rows) -> Tuple[int, int]:
    B, N = check_tree_tensors(None, parents, depth, num_nodes)
    check_nonempty("parents", parents, [(0, "tree (batch row)")])
    check_tensor("log_reach", log_reach, dtypes=(torch.float32,), shape=(B, N), device=parents.device)
    max_nodes = check_int("max_nodes", max_nodes)
    check_tensor("latency", table, dtypes=(torch.float64,), ndim=1, device=parents.device)
    check_nonempty("latency", table, [(0, "table entry")])
    check_float("plain_seconds", plain_seconds, above=0.0)
    check_int("rows", rows)
    return B, max_nodes + 1


def _throughput_kernel(parents, depth, num_nodes, log_reach, max_nodes, table, plain_seconds, rows, backend=None,
                       validate=None):
    args = (parents, depth, num_nodes, log_reach, max_nodes, table, plain_seconds, rows)
    check = values_asked(validate, parents)
    # the call's size decides whether the Triton kernel (one program for the whole batch) can take it
    size = dict(batch_size=parents.shape[0], max_nodes=max_nodes, columns=parents.shape[1]) \
        if isinstance(parents, torch.Tensor) and parents.dim() == 2 else {}
    name, fn = backend_for("select_throughput", backend, parents, _throughput_meta, args, check, **size)
    if check:
        _select_values(parents, depth, num_nodes, log_reach, None, 0.0)
        check_throughput_table(table)
    return fresh(fn(*args), args[:4] + (table,), name)


def check_throughput_table(table: torch.Tensor, name: str = "latency") -> None:
    """A throughput rule's table (values): finite, positive and non-decreasing seconds."""
    bad = ~torch.isfinite(table) | (table <= 0)
    if bool(bad.any()):
        (n,) = first_index(bad)
        raise ValueError(f"{name}[{n}]: expected finite seconds > 0, received {float(table[n])}")
    bad = table[1:] < table[:-1]
    if bool(bad.any()):
        (n,) = first_index(bad)
        raise ValueError(f"{name}[{n + 1}]: expected a non-decreasing table of seconds, received "
                         f"{float(table[n + 1])} after {float(table[n])}")


def _throughput_fake(parents, depth, num_nodes, log_reach, max_nodes, table, plain_seconds, rows, backend=None,
                     validate=None):
    B, M = _throughput_meta(parents, depth, num_nodes, log_reach, max_nodes, table, plain_seconds, rows)
    return (parents.new_empty((B, M), dtype=torch.int64), parents.new_empty((B,), dtype=torch.int32),
            log_reach.new_empty((B,), dtype=torch.float32))


select_throughput_op = define(
    "select_throughput(Tensor parents, Tensor depth, Tensor num_nodes, Tensor log_reach, int max_nodes, Tensor table, "
    "float plain_seconds, int rows, str? backend=None, str? validate=None) -> (Tensor, Tensor, Tensor)",
    _throughput_kernel, _throughput_fake)
"""``taps::select_throughput``: ``parents/depth [B,N] int32``, ``num_nodes [B] int32``, ``log_reach [B,N] f32``,
``table [L] float64`` (seconds for the batch's roots plus ``k`` nodes), ``plain_seconds``, ``rows`` ->
``(pool_index [B, max_nodes+1] int64, num_selected [B] int32, expected [B] float32)`` (:class:`ThroughputRule`).
Checks metadata, then the tree, the reach and the table (finite, non-decreasing) as ``validate`` says."""


def _select_meta(parents, depth, num_nodes, log_reach, max_nodes, latency, rule) -> Tuple[int, int]:
    B, N = check_tree_tensors(None, parents, depth, num_nodes)
    check_nonempty("parents", parents, [(0, "tree (batch row)")])
    check_tensor("log_reach", log_reach, dtypes=(torch.float32,), shape=(B, N), device=parents.device)
    max_nodes = check_int("max_nodes", max_nodes)
    check_output_size("max_nodes", max_nodes, B * (max_nodes + 1) * (8 + 8 + 4 + 4), parents.device)
    if not isinstance(rule, str) or rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES}, received {rule!r}")
    if latency is not None:
        check_tensor("latency", latency, dtypes=(torch.float64,), ndim=1, device=parents.device)
        check_nonempty("latency", latency, [(0, "table entry")])
        if rule != "reach":
            raise ValueError("latency: the throughput rule needs rule='reach'")
    return B, max_nodes + 1


def _select_values(parents, depth, num_nodes, log_reach, latency, t0) -> None:
    B, N = parents.shape
    validate_tree(Tree(parents.new_zeros((B, N), dtype=torch.int64), parents, depth, num_nodes), "tree", deep=True)
    check_log_values("log_reach", torch.where(parents >= 0, log_reach, torch.zeros_like(log_reach)), what="log reach")
    if latency is not None:
        bad = ~torch.isfinite(latency) | (latency + t0 <= 0)
        if bool(bad.any()):
            (n,) = first_index(bad)
            raise ValueError(f"latency[{n}]: expected finite seconds with t0 + latency[n] > 0, received "
                             f"{float(latency[n])} (t0={t0})")


def _select_kernel(parents, depth, num_nodes, log_reach, max_nodes, latency, t0, rule, lambda_node, lambda_depth,
                   min_utility, max_leaves=None, fill_below_threshold=False, max_children=None, min_nodes=0,
                   backend=None, validate=None):
    given = dict(max_leaves=max_leaves, fill_below_threshold=fill_below_threshold, max_children=max_children,
                 min_nodes=min_nodes)
    # Options off their default travel as the call context (backends that lack them decline it) and as kwargs.
    options = {k: v for k, v in given.items() if v != UTILITY_OPTION_DEFAULTS[k]}
    check = values_asked(validate, parents)
    name, fn = backend_for("select_subtree", backend, parents, _select_meta,
                           (parents, depth, num_nodes, log_reach, max_nodes, latency, rule), check, **options)
    if check:
        _select_values(parents, depth, num_nodes, log_reach, latency, t0)
    out = fn(parents, depth, num_nodes, log_reach, max_nodes, latency, t0, rule, lambda_node, lambda_depth,
             min_utility, **options)
    return fresh(out, (parents, depth, num_nodes, log_reach, latency), name)


def _select_fake(parents, depth, num_nodes, log_reach, max_nodes, latency, t0, rule, lambda_node, lambda_depth,
                 min_utility, max_leaves=None, fill_below_threshold=False, max_children=None, min_nodes=0,
                 backend=None, validate=None):
    B, M = _select_meta(parents, depth, num_nodes, log_reach, max_nodes, latency, rule)
    return parents.new_empty((B, M), dtype=torch.int64), parents.new_empty((B,), dtype=torch.int32)


select_subtree_op = define(
    "select_subtree(Tensor parents, Tensor depth, Tensor num_nodes, Tensor log_reach, int max_nodes, Tensor? latency, "
    "float t0, str rule, float lambda_node, float lambda_depth, float min_utility, int? max_leaves=None, "
    "bool fill_below_threshold=False, int? max_children=None, int min_nodes=0, str? backend=None, str? validate=None) "
    "-> (Tensor, Tensor)",
    _select_kernel, _select_fake)
"""``taps::select_subtree``: ``parents/depth [B,N] int32``, ``num_nodes [B] int32``, ``log_reach [B,N] f32``,
``latency [L] float64`` on the tree's device or None, the rule's scalars and options as in :func:`select_subtree`
-> ``(pool_index [B, max_nodes+1] int64 (kept pool rows ascending, -1 padded), num_selected [B] int32)``.
Checks metadata, then the tree's structure, the reach and the latency table as ``validate`` says."""


def _reindex_meta(tokens, parents, depth, num_nodes, pool_index, num_selected) -> Tuple[int, int]:
    B, _ = check_tree_tensors(tokens, parents, depth, num_nodes)
    check_nonempty("parents", parents, [(0, "tree (batch row)")])
    check_tensor("pool_index", pool_index, dtypes=(torch.int64,), shape=(B, None), device=parents.device)
    check_nonempty("pool_index", pool_index, [(1, "row (the root)")])
    check_tensor("num_selected", num_selected, dtypes=(torch.int32,), shape=(B,), device=parents.device)
    return B, pool_index.shape[1]


def _reindex_kernel(tokens, parents, depth, num_nodes, pool_index, num_selected, backend=None):
    args = (tokens, parents, depth, num_nodes, pool_index, num_selected)
    name, fn = backend_for("reindex_subtree", backend, parents, _reindex_meta, args)
    return fresh(fn(*args), args, name)


def _reindex_fake(tokens, parents, depth, num_nodes, pool_index, num_selected, backend=None):
    B, M = _reindex_meta(tokens, parents, depth, num_nodes, pool_index, num_selected)
    i32 = torch.int32
    return (tokens.new_empty((B, M)), parents.new_empty((B, M), dtype=i32), parents.new_empty((B, M), dtype=i32),
            parents.new_empty((B,), dtype=i32))


reindex_subtree_op = define(
    "reindex_subtree(Tensor tokens, Tensor parents, Tensor depth, Tensor num_nodes, Tensor pool_index, "
    "Tensor num_selected, str? backend=None) -> (Tensor, Tensor, Tensor, Tensor)", _reindex_kernel, _reindex_fake)
"""``taps::reindex_subtree``: the pool tree (``[B,N]``), ``pool_index [B,M] int64`` (ascending, -1 padded) and
``num_selected [B] int32`` of ``taps::select_subtree`` -> the kept subtree ``(tokens [B,M] int64, parents [B,M]
int32, depth [B,M] int32, num_nodes [B] int32)``, pool order kept, root first. Trusts ``pool_index`` to be a
prefix-closed selection of real pool rows (as ``taps::select_subtree`` gives)."""
