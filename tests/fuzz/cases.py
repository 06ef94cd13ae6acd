"""The fuzz catalogue: every public op and every ``torch.ops.taps`` custom op, a valid base input for each, and
the malformed variants built from it, identified by a string id that a worker process rebuilds deterministically.

A case id is ``"<op>|<arg>|<mutation>|<mode>"`` (``mode``: ``check`` runs the op with its default validation and
asks every backend for the same answer; ``none`` runs it with ``validate="none"`` on out-of-contract values and
asks only that no backend crashes or hangs), or ``"named|<name>"`` for a hand-written case, or
``"hyp|<op>|<n>"`` for a block of hypothesis-drawn valid inputs compared across backends.

Ops (``OPS``) name their arguments flat: ``tree.parents``, ``pool.logq``, ``keys.0`` are fields that the op's
``call`` assembles into a :class:`Tree`, :class:`CandidatePool` or list, so one mutation touches one field.
"""
from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import taps_kernels as tk
from taps_kernels import ScorerWeights
from taps_kernels.layout import CandidatePool, TopKStats, Tree

INT64_MAX = 2 ** 63 - 1
INT64_MIN = -2 ** 63


# ----------------------------------------------------------------------------------------------- valid inputs
def random_tree(g: torch.Generator, B: int, N: int, vocab: int = 11, chain: bool = False, pad: bool = True) -> Tree:
    """Topological trees, row 1 padded after about half its rows (when ``pad``), tokens in [0, vocab)."""
    tokens = torch.zeros(B, N, dtype=torch.int64)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    depth = torch.zeros(B, N, dtype=torch.int32)
    num_nodes = torch.full((B,), N, dtype=torch.int32)
    for b in range(B):
        n = N if (b != 1 or not pad) else max(1, N // 2 + 1)
        num_nodes[b] = n
        tokens[b, 0] = int(torch.randint(vocab, (1,), generator=g))
        for i in range(1, n):
            p = i - 1 if chain else int(torch.randint(i, (1,), generator=g))
            parents[b, i], depth[b, i] = p, depth[b, p] + 1
            tokens[b, i] = int(torch.randint(vocab, (1,), generator=g))
    return Tree(tokens, parents, depth, num_nodes)


def tree_fields(prefix: str, tree: Tree) -> Dict[str, object]:
    return {f"{prefix}.tokens": tree.tokens, f"{prefix}.parents": tree.parents, f"{prefix}.depth": tree.depth,
            f"{prefix}.num_nodes": tree.num_nodes}


def take_tree(a: Dict[str, object], prefix: str = "tree") -> Tree:
    return Tree(a[f"{prefix}.tokens"], a[f"{prefix}.parents"], a[f"{prefix}.depth"], a[f"{prefix}.num_nodes"])


def _log_reach(g, tree: Tree) -> torch.Tensor:
    """Non-increasing log reach with a few ties and an unreachable (-inf) node."""
    edge = -torch.rand(tree.parents.shape, generator=g) * 2
    edge[:, 1::4] = -0.5
    lr = tk.propagate_reach(tree.parents, edge, backend="reference")
    if tree.parents.shape[1] > 3:
        lr[0, 3] = float("-inf")
    return lr


_POOL_FIELDS = ("logq", "step_logq", "rank", "topk_logp", "topk_ids", "entropy", "margin", "topk_mass")


def _pool(g, B=2, D=3, V=13, K=4, pool_size=9):
    logits = torch.randn(B, D, V, generator=g) * 2
    roots = torch.randint(V, (B,), generator=g)
    return tk.candidate_pool(logits, roots, K, pool_size, backend="reference", pool_backend="reference")


def _caches(g, B, H, L, Dh, layers=1, dtype=torch.float32):
    keys = [torch.randn(B, H, L, Dh, generator=g).to(dtype) for _ in range(layers)]
    values = [torch.randn(B, H, L, Dh, generator=g).to(dtype) for _ in range(layers)]
    return keys, values


def base_args(op: str, g: torch.Generator) -> Dict[str, object]:
    """A valid, awkwardly shaped input of ``op`` (``g`` seeded by the case id)."""
    if op == "topk_stats":
        return {"draft_logits": torch.randn(2, 3, 37, generator=g), "top_k": 5}
    if op == "candidate_pool":
        return {"draft_logits": torch.randn(2, 3, 17, generator=g), "root_tokens": torch.tensor([3, 16]),
                "top_k": 4, "pool_size": 9}
    if op == "best_first_pool":
        s = tk.topk_stats(torch.randn(2, 3, 11, generator=g), 4, backend="reference")
        return {"stats.topk_logp": s.topk_logp, "stats.topk_ids": s.topk_ids, "stats.entropy": s.entropy,
                "stats.margin": s.margin, "stats.topk_mass": s.topk_mass, "root_tokens": torch.tensor([1, 7]),
                "pool_size": 8}
    if op == "propagate_reach":
        t = random_tree(g, 2, 9)
        return {"parents": t.parents, "edge_logq": -torch.rand(2, 9, generator=g) * 3}
    if op in ("score_edges", "score_edges_full"):
        pool = _pool(g)
        a = tree_fields("pool.tree", pool.tree)
        a.update({f"pool.{f}": getattr(pool, f) for f in _POOL_FIELDS})
        if op == "score_edges":
            a["weights"] = ScorerWeights.random(tiny=True, generator=g)
        else:
            a["weights"] = ScorerWeights.random(embed_dim=6, hidden_dim=5, max_depth=3, token_dim=4, depth_dim=3,
                                                hidden_proj_dim=4, mlp_dim=8, generator=g)
            a["token_embeddings"] = torch.randn(13, 6, generator=g)
            a["drafter_hidden"] = torch.randn(2, 3, 5, generator=g)
        return a
    if op == "select_subtree":
        t = random_tree(g, 2, 11)
        return {**tree_fields("tree", t), "log_reach": _log_reach(g, t), "max_nodes": 4, "latency": None,
                "t0": 0.01, "rule": "reach"}
    if op == "select_subtree_latency":
        t = random_tree(g, 2, 11)
        return {**tree_fields("tree", t), "log_reach": _log_reach(g, t), "max_nodes": 6,
                "latency": torch.tensor([0.05, 0.06, 0.065, 0.08, 0.1, 0.2], dtype=torch.float64), "t0": 0.01}
    if op == "select_subtree_utility":
        t = random_tree(g, 2, 11)
        return {**tree_fields("tree", t), "log_reach": _log_reach(g, t), "max_nodes": 5, "rule": "utility",
                "lambda_node": 1.0, "lambda_depth": 0.05, "min_utility": 0.01}
    if op in ("tree_mask", "custom.tree_mask"):
        t = random_tree(g, 2, 35)
        return {**tree_fields("tree", t), "prefix_lens": torch.tensor([0, 7])}
    if op == "additive_mask":
        t = random_tree(g, 2, 5)
        _, bits = tk.tree_mask(t, torch.tensor([0, 2]), backend="reference")
        return {"ancestor_bits": bits, "prefix_lens": torch.tensor([0, 2]), "kv_len": 9, "dtype": torch.float32}
    if op in ("tree_attention", "custom.tree_attention"):
        t = random_tree(g, 2, 5)
        _, bits = tk.tree_mask(t, torch.tensor([3, 0]), backend="reference")
        return {"q": torch.randn(2, 4, 5, 8, generator=g), "k": torch.randn(2, 2, 9, 8, generator=g),
                "v": torch.randn(2, 2, 9, 8, generator=g), "ancestor_bits": bits, "prefix_lens": torch.tensor([3, 0]),
                "scale": None}
    if op in ("accept_greedy", "custom.accept_greedy"):
        t = random_tree(g, 2, 12, vocab=3)
        return {**tree_fields("tree", t), "target_tokens": torch.randint(3, (2, 12), generator=g), "max_depth": 5}
    if op in ("compact_kv", "custom.compact_kv"):
        keys, values = _caches(g, 2, 2, 12, 3, layers=2)
        return {"keys.0": keys[0], "keys.1": keys[1], "values.0": values[0], "values.1": values[1],
                "prefix_lens": torch.tensor([2, 4]), "path": torch.tensor([[0, 2, 5, -1], [0, 1, -1, -1]])}
    if op == "accept_round":  # an idle row; a history near full
        t = random_tree(g, 2, 9, vocab=3)
        return {**tree_fields("tree", t), "target_tokens": torch.randint(3, (2, 9), generator=g),
                "active": torch.tensor([False, True]), "max_depth": 5,
                "history_tokens": torch.randint(0, 3, (2, 8), generator=g), "history_lengths": torch.tensor([3, 6])}
    if op == "commit_round":  # 3 cache rows for a 2-row tree; integer-valued logits (ties); a history near full
        t = random_tree(g, 2, 7, vocab=5)
        keys, values = _caches(g, 3, 2, 12, 3, layers=2)
        return {**tree_fields("tree", t), "active": torch.tensor([True, False]), "max_depth": 4,
                "keys.0": keys[0], "keys.1": keys[1], "values.0": values[0], "values.1": values[1],
                "lengths": torch.tensor([2, 5]), "logits": torch.randint(0, 3, (2, 7, 5), generator=g).float(),
                "history_tokens": torch.randint(0, 5, (2, 9), generator=g), "history_lengths": torch.tensor([6, 0])}
    if op == "rows_linear":
        return {"x": torch.randn(3, 2, 7, generator=g), "weight": torch.randn(5, 7, generator=g),
                "bias": torch.randn(5, generator=g)}
    if op == "lookup_chain":  # a small alphabet: matches, siblings; one empty history
        return {"tokens": torch.randint(0, 4, (3, 17), generator=g), "lengths": torch.tensor([17, 6, 0]),
                "num_tokens": 4, "max_ngram": 3}
    if op == "graft_chain":
        t = random_tree(g, 2, 9, vocab=3)
        return {**tree_fields("tree", t), "log_reach": _log_reach(g, t),
                "chain": torch.randint(0, 3, (2, 4), generator=g), "chain_len": torch.tensor([4, 2]),
                "chain_log_reach": torch.cumsum(-torch.rand(2, 4, generator=g), 1)}
    if op == "build_tree_lookup":  # an undrafted round: the root, the lookup chain and its sibling
        return {"root_tokens": torch.tensor([3, 1]), "max_nodes": 5,
                "history": torch.randint(0, 3, (2, 15), generator=g), "lengths": torch.tensor([15, 7]), "num_tokens": 4, "max_ngram": 3,
                "log_q": torch.tensor([0.0, -0.4, -0.2, -0.1]), "log_s": torch.tensor([0.0, -1.0, -0.8, -1.5]),
                "latency": torch.tensor([0.05, 0.05, 0.06, 0.07, 0.09, 0.1], dtype=torch.float64),
                "plain_seconds": 0.05}
    raise KeyError(op)


# ---------------------------------------------------------------------------------------------- calling the ops
def _pool_from(a) -> CandidatePool:
    return CandidatePool(take_tree(a, "pool.tree"), *(a[f"pool.{f}"] for f in _POOL_FIELDS))


def _kv_lists(a):
    keys = [a[k] for k in sorted(k for k in a if k.startswith("keys."))]
    values = [a[k] for k in sorted(k for k in a if k.startswith("values."))]
    return keys, values


def _history_read(history):
    """A history as its readers see it: the last column is the write sink, never read (backends differ there)."""
    tokens, lengths = history
    return (tokens[:, :-1] if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 else tokens), lengths


def _with_backend_env(backend, fn):
    old = os.environ.get("TAPS_BACKEND")
    os.environ["TAPS_BACKEND"] = backend
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("TAPS_BACKEND", None)
        else:
            os.environ["TAPS_BACKEND"] = old


def take_rule(a: Dict[str, object]):
    """The select_subtree rule named by the ``rule`` field (default ``"reach"``), built from the fields of that
    rule; a ``rule`` value naming neither is passed on as it is (the public op must refuse it by name)."""
    kind = a.get("rule", "reach")
    if isinstance(kind, str) and kind == "reach":
        return tk.ReachRule(**{k: a[k] for k in ("latency", "t0") if k in a})
    if isinstance(kind, str) and kind == "utility":
        return tk.UtilityRule(**{k: a[k] for k in ("lambda_node", "lambda_depth", "min_utility") if k in a})
    return kind


def call(op: str, a: Dict[str, object], backend: str, validate: Optional[str]):
    """Run ``op`` on the (possibly mutated) arguments with ``backend``; returns its outputs (in-place ops: the
    returned value plus every cache tensor after the call)."""
    v = {} if validate is None else {"validate": validate}
    if op == "topk_stats":
        return tk.topk_stats(a["draft_logits"], a["top_k"], backend=backend, **v)
    if op == "candidate_pool":
        # Triton has only the top-K pass; its pool runs on the reference.
        pool_backend = "reference" if backend == "triton" else backend
        return tk.candidate_pool(a["draft_logits"], a["root_tokens"], a["top_k"], a["pool_size"], backend=backend,
                                 pool_backend=pool_backend, **v)
    if op == "best_first_pool":
        stats = TopKStats(a["stats.topk_logp"], a["stats.topk_ids"], a["stats.entropy"], a["stats.margin"],
                          a["stats.topk_mass"])
        return tk.best_first_pool(stats, a["root_tokens"], a["pool_size"], backend=backend, **v)
    if op == "propagate_reach":
        return tk.propagate_reach(a["parents"], a["edge_logq"], backend=backend, **v)
    if op in ("score_edges", "score_edges_full"):
        return tk.score_edges(_pool_from(a), a["weights"], a.get("token_embeddings"), a.get("drafter_hidden"),
                              backend=backend, **v)
    if op.startswith("select_subtree"):
        return tk.select_subtree(take_tree(a), a["log_reach"], a["max_nodes"], rule=take_rule(a), backend=backend, **v)
    if op == "tree_mask":
        return tk.tree_mask(take_tree(a), a["prefix_lens"], backend=backend, **v)
    if op == "additive_mask":
        return tk.ancestor_bits_to_additive_mask(a["ancestor_bits"], a["prefix_lens"], a["kv_len"], a["dtype"], **v)
    if op == "tree_attention":
        return tk.tree_attention(a["q"], a["k"], a["v"], a["ancestor_bits"], a["prefix_lens"], a["scale"],
                                 return_lse=True, backend=backend, **v)
    if op == "accept_greedy":
        return tk.accept_greedy(take_tree(a), a["target_tokens"], a["max_depth"], backend=backend, **v)
    if op == "compact_kv":
        keys, values = _kv_lists(a)
        out = tk.compact_kv(keys, values, a["prefix_lens"], a["path"], backend=backend, **v)
        return (out, *keys, *values)
    if op == "accept_round":
        history = (a["history_tokens"], a["history_lengths"])
        out = tk.accept_round(take_tree(a), a["target_tokens"], a["active"], a["max_depth"], history=history,
                              backend=backend, **v)
        return (*out, *_history_read(history))
    if op == "commit_round":
        keys, values = _kv_lists(a)
        history = (a["history_tokens"], a["history_lengths"])
        out = tk.commit_round(take_tree(a), a["active"], a["max_depth"], keys, values, a["lengths"], logits=a["logits"],
                              history=history, backend=backend, **v)
        return (*out, *keys, *values, a["lengths"], *_history_read(history))
    if op == "rows_linear":
        return tk.rows_linear(a["x"], a["weight"], a["bias"], backend=backend)
    if op == "lookup_chain":
        return tk.lookup_chain(a["tokens"], a["lengths"], a["num_tokens"], a["max_ngram"], backend=backend, **v)
    if op == "graft_chain":
        return tk.graft_chain(take_tree(a), a["log_reach"], a["chain"], a["chain_len"], a["chain_log_reach"],
                              backend=backend, **v)
    if op == "build_tree_lookup":
        lookup = tk.LookupProposal(a["history"], a["lengths"], a["num_tokens"], a["max_ngram"], a["log_q"], a["log_s"])
        rule = tk.ThroughputRule(a["latency"], a["plain_seconds"])
        out = tk.build_tree(a["root_tokens"], a["max_nodes"], rule, lookup=lookup, backend=backend, **v)
        return out.selection, out.chain  # not the stage seconds: only the C++ call times its stages
    # custom ops: the raw torch.ops.taps entry points, on the backend TAPS_BACKEND names
    ops = torch.ops.taps
    if op == "custom.tree_mask":
        return _with_backend_env(backend, lambda: ops.tree_mask(a["tree.parents"], a["tree.depth"],
                                                                a["tree.num_nodes"], a["prefix_lens"]))
    if op == "custom.accept_greedy":
        md = a["max_depth"]
        path_len = md + 1 if isinstance(md, int) and not isinstance(md, bool) else md
        return _with_backend_env(backend, lambda: ops.accept_greedy(a["tree.tokens"], a["tree.parents"],
                                                                    a["tree.num_nodes"], a["target_tokens"], path_len))
    if op == "custom.compact_kv":
        keys, values = _kv_lists(a)
        out = _with_backend_env(backend, lambda: ops.compact_kv(keys, values, a["prefix_lens"], a["path"]))
        return (out, *keys, *values)
    if op == "custom.tree_attention":
        return _with_backend_env(backend, lambda: ops.tree_attention(a["q"], a["k"], a["v"], a["ancestor_bits"],
                                                                     a["prefix_lens"], a["scale"]))
    raise KeyError(op)


@dataclass
class OpSpec:
    backends: Tuple[str, ...]
    validates: bool = True          # takes validate=
    inplace: bool = False           # mutates its tensor arguments: each backend gets its own copy
    mutate_args: Optional[Sequence[str]] = None  # variants of an op mutate only the arguments they add


OPS: Dict[str, OpSpec] = {
    "topk_stats": OpSpec(("reference", "cpp", "triton")),
    # Triton has only the top-K pass (compared within tolerance under topk_stats): a 1-ulp difference in a
    # log-prob may break an exact tie of the pool's best-first order differently, so pools are compared on the
    # exact backends only.
    "candidate_pool": OpSpec(("reference", "cpp")),
    "best_first_pool": OpSpec(("reference", "cpp", "triton")),
    "propagate_reach": OpSpec(("reference", "cpp", "triton")),
    "score_edges": OpSpec(("reference", "cpp", "triton")),
    "score_edges_full": OpSpec(("reference", "cpp", "triton"), mutate_args=("weights", "token_embeddings",
                                                                               "drafter_hidden", "pool.tree.tokens")),
    "select_subtree": OpSpec(("reference", "cpp", "triton")),
    "select_subtree_latency": OpSpec(("reference", "cpp", "triton"),
                                     mutate_args=("latency", "t0", "max_nodes", "log_reach")),
    "select_subtree_utility": OpSpec(("reference", "cpp", "triton"), mutate_args=("rule", "lambda_node",
                                                                                  "lambda_depth", "min_utility",
                                                                                  "log_reach")),
    "tree_mask": OpSpec(("reference", "cpp")),
    "additive_mask": OpSpec(("reference",)),
    "tree_attention": OpSpec(("reference", "triton")),
    "accept_greedy": OpSpec(("reference", "cpp")),
    "compact_kv": OpSpec(("reference", "cpp"), inplace=True),
    "accept_round": OpSpec(("reference", "cpp"), inplace=True),
    "commit_round": OpSpec(("reference", "cpp"), inplace=True),
    "rows_linear": OpSpec(("reference", "cpp"), validates=False),
    "lookup_chain": OpSpec(("reference", "cpp")),
    "graft_chain": OpSpec(("reference", "cpp")),
    "build_tree_lookup": OpSpec(("reference", "cpp")),
    "custom.tree_mask": OpSpec(("reference", "cpp"), validates=False),
    "custom.accept_greedy": OpSpec(("reference", "cpp"), validates=False),
    "custom.compact_kv": OpSpec(("reference", "cpp"), validates=False, inplace=True),
    "custom.tree_attention": OpSpec(("reference", "triton"), validates=False),
}


# ------------------------------------------------------------------------------------------------- mutations
def _set_one(t: torch.Tensor, value, where: int = -1) -> torch.Tensor:
    t = t.clone()
    flat = t.view(-1) if t.is_contiguous() else None
    if flat is None or t.numel() == 0:
        return t
    flat[where % t.numel()] = value
    return t


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values, last dim strided (stride 2)."""
    if t.dim() == 0:
        return t
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def _tensor_mutations(t: torch.Tensor) -> Dict[str, Callable[[], object]]:
    m: Dict[str, Callable[[], object]] = {
        "none": lambda: None,
        "list": lambda: t.tolist(),
        "meta": lambda: t.to("meta"),
        "rank+": lambda: t.unsqueeze(0),
        "noncontig": lambda: _noncontig(t),
    }
    if t.dim() >= 1:
        m["short"] = lambda: t.narrow(-1, 0, max(0, t.shape[-1] - 1))
        m["empty0"] = lambda: t.narrow(0, 0, 0)
        m["emptyL"] = lambda: t.narrow(-1, 0, 0)
        m["expand0"] = lambda: t[:1].expand(*t.shape) if t.shape[0] > 1 else t.expand(3, *t.shape[1:])
    if t.is_floating_point():
        m.update({
            "f64": lambda: t.double(), "i32": lambda: t.int(), "f16": lambda: t.half(),
            "nan": lambda: _set_one(t, float("nan")), "posinf": lambda: _set_one(t, float("inf")),
            "neginf": lambda: _set_one(t, float("-inf")), "allneginf": lambda: torch.full_like(t, float("-inf")),
            "huge": lambda: _set_one(t, 3e38), "grad": lambda: t.clone().requires_grad_(),
        })
    elif t.dtype != torch.bool:
        other = torch.int32 if t.dtype == torch.int64 else torch.int64
        info = torch.iinfo(t.dtype)
        m.update({
            "retype": lambda: t.to(other), "f32": lambda: t.float(),
            "neg": lambda: _set_one(t, -2), "negfirst": lambda: _set_one(t, -3, 0),
            "big": lambda: _set_one(t, 2 ** 31 - 1 if t.dtype == torch.int32 else 2 ** 40),
            "max": lambda: _set_one(t, info.max), "min": lambda: _set_one(t, info.min),
        })
    return m


INT_SCALARS = {"zero": 0, "neg": -1, "i31": 2 ** 31, "i31m3": 2 ** 31 - 3, "i63": 2 ** 63, "np64": np.int64(3),
               "tensor": torch.tensor(3), "float": 2.5, "bool": True, "str": "3", "none": None,
               "huge40": 2 ** 40}
FLOAT_SCALARS = {"nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "neg": -1.0, "zero": 0.0,
                 "str": "x", "np32": np.float32(0.5), "tensor": torch.tensor(0.25), "bool": False, "none": None}
STR_SCALARS = {"bad": "best", "none": None, "int": 3}

SECONDARY_SKIP = {"list", "rank+", "emptyL", "f16", "i32", "f32"}
_INT_ARGS = {"top_k", "pool_size", "max_nodes", "max_depth", "kv_len", "num_tokens", "max_ngram"}
_FLOAT_ARGS = {"t0", "lambda_node", "lambda_depth", "min_utility", "scale", "plain_seconds"}
# out-of-contract VALUES (not types or shapes): the ones whose validate="none" run must still be memory-safe
VALUE_MUTATIONS = {"nan", "posinf", "neginf", "allneginf", "huge", "neg", "negfirst", "big", "max", "min"}
TRITON_MUTATIONS = {"none", "meta", "short", "empty0", "emptyL", "f64", "nan", "posinf", "allneginf", "neg",
                    "big", "max", "min", "grad", "noncontig", "expand0"}


def mutations_of(op: str) -> List[Tuple[str, str]]:
    """Every ``(arg, mutation)`` the catalogue applies to ``op``'s base input."""
    a = base_args(op, torch.Generator().manual_seed(0))
    out = []
    only = OPS[op].mutate_args
    first = True
    for name, value in a.items():
        if only is not None and name not in only:
            continue
        if isinstance(value, torch.Tensor):
            # the first tensor argument gets every mutation; the others skip the ones that test the same
            # type/rank plumbing again (the interpreter and 2-core CI budget is ~2 minutes)
            skip = set() if first else SECONDARY_SKIP
            out += [(name, m) for m in _tensor_mutations(value) if m not in skip]
            first = False
        elif name in _INT_ARGS:
            out += [(name, m) for m in INT_SCALARS]
        elif name in _FLOAT_ARGS:
            out += [(name, m) for m in FLOAT_SCALARS]
        elif name == "rule":
            out += [(name, m) for m in STR_SCALARS]
        elif name == "weights":
            out += [(name, "none"), (name, "wrongtype")]
        elif name == "dtype":
            out += [(name, "int"), (name, "str")]
    return out


def mutate(op: str, a: Dict[str, object], arg: str, mutation: str) -> Dict[str, object]:
    a = dict(a)
    value = a[arg]
    if isinstance(value, torch.Tensor):
        a[arg] = _tensor_mutations(value)[mutation]()
    elif arg in _INT_ARGS:
        a[arg] = INT_SCALARS[mutation]
    elif arg in _FLOAT_ARGS:
        a[arg] = FLOAT_SCALARS[mutation]
    elif arg == "rule":
        a[arg] = STR_SCALARS[mutation]
    elif arg == "weights":
        a[arg] = None if mutation == "none" else {"edge_ln_weight": torch.ones(7)}
    elif arg == "dtype":
        a[arg] = torch.int32 if mutation == "int" else "float32"
    return a


# --------------------------------------------------------------------------------------------- named cases
def _named_cases():
    """Hand-written cases: ``name -> () -> (op, args, validate)``, the audit's findings and more; and the generator
    they draw from (re-seeded from the case id before each build, so every backend sees the same input)."""
    g = torch.Generator().manual_seed(7)
    c: Dict[str, Callable] = {}

    def chain_pool(n=30, D=2):
        logits = torch.randn(1, D, 5, generator=g)
        pool = tk.candidate_pool(logits, torch.tensor([0]), 1, 2, backend="reference", pool_backend="reference")
        t = random_tree(g, 1, n, vocab=5, chain=True)
        a = tree_fields("pool.tree", t)
        a.update({f"pool.{f}": getattr(pool, f) for f in _POOL_FIELDS})
        a["pool.logq"] = -torch.arange(n, dtype=torch.float32)[None] * 0.1
        a["pool.step_logq"] = torch.full((1, n), -0.1)
        a["pool.step_logq"][0, 0] = 0.0
        a["pool.rank"] = torch.zeros(1, n, dtype=torch.int32)
        return a

    # 1. score_edges with D = 0
    def d0():
        a = base_args("score_edges", g)
        for f in ("topk_logp", "topk_ids"):
            a[f"pool.{f}"] = a[f"pool.{f}"][:, :0]
        for f in ("entropy", "margin", "topk_mass"):
            a[f"pool.{f}"] = a[f"pool.{f}"][:, :0]
        return "score_edges", a, None
    c["score_edges_d0"] = d0
    # 2. custom tree_attention: prefix past the cache, too few bit words, V shorter than K, K batch, int64 bits
    for name, edit in {
        "prefix_past_cache": lambda a: a.update(prefix_lens=torch.tensor([3, 100])),
        "prefix_int64_max": lambda a: a.update(prefix_lens=torch.tensor([3, INT64_MAX])),
        "few_bit_words": lambda a: a.update(ancestor_bits=a["ancestor_bits"][..., :0]),
        "v_shorter": lambda a: a.update(v=a["v"][:, :, :6]),
        "k_batch": lambda a: a.update(k=a["k"][:1]),
        "int64_bits": lambda a: a.update(ancestor_bits=a["ancestor_bits"].long()),
    }.items():
        for op in ("custom.tree_attention", "tree_attention"):
            def build(op=op, edit=edit):
                a = base_args(op, g)
                edit(a)
                return op, a, None
            c[f"{op}_{name}"] = build
    # 3. compact_kv: prefix + path overflows int64 (C++ used to copy prefix row 1 into row 4)
    for op in ("compact_kv", "custom.compact_kv"):
        def overflow(op=op):
            keys, values = _caches(g, 2, 1, 6, 2, layers=1)
            return op, {"keys.0": keys[0], "values.0": values[0], "prefix_lens": torch.tensor([3, 5]),
                        "path": torch.tensor([[0, INT64_MAX - 1], [0, -1]])}, None
        c[f"{op}_overflow_path"] = overflow

        def huge_prefix(op=op):
            keys, values = _caches(g, 1, 1, 6, 2, layers=1)
            return op, {"keys.0": keys[0], "values.0": values[0], "prefix_lens": torch.tensor([INT64_MAX]),
                        "path": torch.tensor([[0, 1]])}, None
        c[f"{op}_huge_prefix"] = huge_prefix
    # 4. score_edges on a tree deeper than D (clamped position on every backend)
    for scorer in ("none", "tiny"):
        def deep(scorer=scorer):
            a = chain_pool()
            a["weights"] = None if scorer == "none" else ScorerWeights.random(tiny=True, generator=g)
            return "score_edges", a, None
        c[f"score_edges_deeper_than_D_{scorer}"] = deep
    # 5. non-finite draft logits and reaches
    for where, val in (("nan", float("nan")), ("posinf", float("inf")), ("neginf", float("-inf"))):
        def logit(val=val):
            x = torch.randn(2, 3, 17, generator=g)
            x[1, 2, 5] = val
            return "candidate_pool", {"draft_logits": x, "root_tokens": torch.tensor([3, 16]), "top_k": 4,
                                      "pool_size": 9}, None
        c[f"candidate_pool_one_{where}_logit"] = logit

        def reach(val=val):
            a = base_args("select_subtree", g)
            a["log_reach"] = a["log_reach"].clone()
            a["log_reach"][0, 2] = val
            return "select_subtree", a, None
        c[f"select_subtree_one_{where}_reach"] = reach

        def reach_u(val=val):
            a = base_args("select_subtree_utility", g)
            a["log_reach"] = a["log_reach"].clone()
            a["log_reach"][0, 2] = val
            return "select_subtree_utility", a, None
        c[f"select_subtree_utility_one_{where}_reach"] = reach_u

    def neginf_many():  # several impossible tokens per position, K larger than the possible ones
        x = torch.randn(2, 3, 9, generator=g)
        x[:, :, 2:] = float("-inf")
        return "candidate_pool", {"draft_logits": x, "root_tokens": torch.tensor([0, 1]), "top_k": 5,
                                  "pool_size": 12}, None
    c["candidate_pool_mostly_impossible"] = neginf_many

    def topk_neginf():
        x = torch.randn(1, 2, 40, generator=g)
        x[0, 0, ::2] = float("-inf")
        return "topk_stats", {"draft_logits": x, "top_k": 30}, None
    c["topk_stats_half_impossible"] = topk_neginf
    # 6. tree attention non-finite contract: NaN propagates, no visible key -> 0 and -inf, bits above the diagonal
    def att(edit):
        def build():
            a = base_args("tree_attention", g)
            edit(a)
            return "tree_attention", a, None
        return build
    c["tree_attention_nan_q"] = att(lambda a: a.update(q=_set_one(a["q"], float("nan"), 0)))
    c["tree_attention_nan_k"] = att(lambda a: a.update(k=_set_one(a["k"], float("nan"), 0)))
    c["tree_attention_no_visible_key"] = att(lambda a: a.update(ancestor_bits=torch.zeros_like(a["ancestor_bits"]),
                                                                 prefix_lens=torch.tensor([0, 0])))
    c["tree_attention_bits_above_diagonal"] = att(lambda a: a.update(
        ancestor_bits=torch.full_like(a["ancestor_bits"], 0b11111)))
    c["tree_attention_bf16"] = att(lambda a: a.update(q=a["q"].bfloat16(), k=a["k"].bfloat16(), v=a["v"].bfloat16()))
    c["tree_attention_f16"] = att(lambda a: a.update(q=a["q"].half(), k=a["k"].half(), v=a["v"].half()))
    c["tree_attention_head_dim_0"] = att(lambda a: a.update(q=a["q"][..., :0], k=a["k"][..., :0], v=a["v"][..., :0]))
    c["tree_attention_n0"] = att(lambda a: a.update(q=a["q"][:, :, :0], ancestor_bits=a["ancestor_bits"][:, :0, :0]))
    # 7. position ids near the int64 maximum
    for op in ("tree_mask", "custom.tree_mask"):
        def pos(op=op):
            a = base_args(op, g)
            a["prefix_lens"] = torch.tensor([INT64_MAX - 3, 0])
            return op, a, None
        c[f"{op}_prefix_near_int64_max"] = pos
    # 8. aliasing caches
    for op in ("compact_kv", "custom.compact_kv"):
        def alias(kind, op=op):
            def build():
                base = torch.randn(2 * 12 * 3 * 2 + 8, generator=g)
                if kind == "partial":
                    k = base[:72].view(2, 2, 6, 3)
                    v = base[2:74].view(2, 2, 6, 3)
                elif kind == "same":
                    k = v = base[:72].view(2, 2, 6, 3)
                elif kind == "interleaved":
                    kv = base[:144].view(2, 2, 6, 2, 3)
                    k, v = kv[..., 0, :], kv[..., 1, :]
                else:  # stride-0 batch broadcast
                    k = base[:36].view(1, 2, 6, 3).expand(2, 2, 6, 3)
                    v = torch.randn(2, 2, 6, 3, generator=g)
                return op, {"keys.0": k, "values.0": v, "prefix_lens": torch.tensor([0, 1]),
                            "path": torch.tensor([[0, 2], [0, 3]])}, None
            return build
        for kind in ("partial", "same", "interleaved", "broadcast"):
            c[f"{op}_alias_{kind}"] = alias(kind)
    # 9. gradients
    c["rows_linear_grad"] = lambda: ("rows_linear", {"x": torch.randn(2, 4, generator=g).requires_grad_(),
                                                     "weight": torch.randn(3, 4, generator=g),
                                                     "bias": None}, None)

    def kv_grad():
        a = base_args("compact_kv", g)
        a["keys.0"] = a["keys.0"].clone().requires_grad_()
        return "compact_kv", a, None
    c["compact_kv_grad_leaf"] = kv_grad
    c["tree_attention_grad"] = att(lambda a: a.update(q=a["q"].clone().requires_grad_()))
    # 10. messages and budgets
    def accept_huge():
        a = base_args("accept_greedy", g)
        a["max_depth"] = 2 ** 31
        return "accept_greedy", a, None
    c["accept_greedy_max_depth_2p31"] = accept_huge
    for op, arg in (("candidate_pool", "pool_size"), ("select_subtree", "max_nodes"), ("accept_greedy", "max_depth")):
        def huge(op=op, arg=arg):
            a = base_args(op, g)
            a[arg] = 2 ** 31 - 3
            return op, a, None
        c[f"{op}_{arg}_huge_budget"] = huge
    def neg_lambda():
        a = base_args("select_subtree_utility", g)
        a["lambda_depth"] = -1.0
        return "select_subtree_utility", a, None
    c["select_subtree_negative_lambda_depth"] = neg_lambda
    def kv_len_huge():
        a = base_args("additive_mask", g)
        a["kv_len"] = 2 ** 40
        return "additive_mask", a, None
    c["additive_mask_huge_kv_len"] = kv_len_huge
    return c, g


NAMED, _NAMED_GEN = _named_cases()


# ------------------------------------------------------------------------------------------------- case ids
def all_case_ids(hypothesis_blocks: int = 1) -> List[str]:
    ids: List[str] = []
    for op, spec in OPS.items():
        for arg, m in mutations_of(op):
            ids.append(f"{op}|{arg}|{m}|check")
            if spec.validates and m in VALUE_MUTATIONS:
                ids.append(f"{op}|{arg}|{m}|none")
    ids += [f"named|{name}" for name in NAMED]
    ids += [f"hyp|{op}|{n}" for op in HYP_OPS for n in range(hypothesis_blocks)]
    return ids


HYP_OPS = ("topk_stats", "candidate_pool", "select_subtree", "tree_mask", "accept_greedy", "compact_kv",
           "propagate_reach", "score_edges", "tree_attention")


def seed_of(case_id: str) -> int:
    """Stable across processes (unlike hash())."""
    return zlib.crc32(case_id.encode())


def build(case_id: str):
    """``case_id`` -> ``(op, args, validate, backends, compare)``."""
    parts = case_id.split("|")
    if parts[0] == "named":
        _NAMED_GEN.manual_seed(seed_of(case_id))
        op, a, validate = NAMED[parts[1]]()
        return op, a, validate, OPS[op].backends, True
    op, arg, m, mode = parts
    spec = OPS[op]
    a = mutate(op, base_args(op, torch.Generator().manual_seed(seed_of(op))), arg, m)
    backends = spec.backends
    if "triton" in backends and m not in TRITON_MUTATIONS:
        backends = tuple(b for b in backends if b != "triton")
    if mode == "none":
        return op, a, "none", backends, False
    return op, a, None, backends, True
