"""Hypothesis blocks of the fuzz suite: valid inputs of awkward shapes, drawn by strategies, that every backend of
an op must accept and answer alike. A block (``hyp|<op>|<n>``) runs a fixed number of derandomised examples
inside the worker, so a crash is still caught by the worker pool and pinned to its block.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

import cases
import taps_kernels as tk

EXAMPLES = {"tree_attention": 6, "score_edges": 6, "topk_stats": 8}
DEFAULT_EXAMPLES = 12
NODES = st.sampled_from([1, 2, 3, 7, 31, 32, 33])


@st.composite
def trees(draw, max_b: int = 3):
    B = draw(st.integers(1, max_b))
    N = draw(NODES)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 20)))
    return cases.random_tree(g, B, N, vocab=draw(st.sampled_from([2, 5, 50])), chain=draw(st.booleans()))


@st.composite
def logits(draw, max_v: int = 40):
    B, D, V = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, max_v))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 20)))
    x = torch.randn(B, D, V, generator=g) * draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()):
        x = x.round()  # ties
    if V > 1 and draw(st.booleans()):
        impossible = torch.rand(B, D, V, generator=g) < 0.4
        impossible[..., 0] = False  # every position keeps a possible token
        x = x.masked_fill(impossible, float("-inf"))
    return x


def _edge_logq(g, tree):
    e = -torch.rand(tree.parents.shape, generator=g) * 3
    e[torch.rand(tree.parents.shape, generator=g) < 0.1] = float("-inf")
    return e


@st.composite
def inputs(draw, op: str) -> Dict[str, object]:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 20)))
    if op == "topk_stats":
        return {"draft_logits": draw(logits(max_v=300)), "top_k": draw(st.integers(1, 40))}
    if op == "candidate_pool":
        x = draw(logits())
        roots = torch.randint(x.shape[2], (x.shape[0],), generator=g)
        return {"draft_logits": x, "root_tokens": roots, "top_k": draw(st.integers(1, 8)),
                "pool_size": draw(st.integers(1, 40))}
    if op == "propagate_reach":
        t = draw(trees())
        return {"parents": t.parents, "edge_logq": _edge_logq(g, t)}
    if op == "score_edges":
        x = draw(logits(max_v=12))
        pool = tk.candidate_pool(x, torch.zeros(x.shape[0], dtype=torch.int64), draw(st.integers(1, 4)),
                                 draw(st.integers(1, 20)), backend="reference", pool_backend="reference")
        a = cases.tree_fields("pool.tree", pool.tree)
        a.update({f"pool.{f}": getattr(pool, f) for f in cases._POOL_FIELDS})
        a["weights"] = draw(st.sampled_from([None, "tiny"]))
        if a["weights"] == "tiny":
            a["weights"] = tk.ScorerWeights.random(tiny=True, generator=g)
        return a
    if op == "select_subtree":
        t = draw(trees())
        a = {**cases.tree_fields("tree", t), "log_reach": tk.propagate_reach(t.parents, _edge_logq(g, t)),
             "max_nodes": draw(st.integers(1, 40)), "t0": draw(st.sampled_from([0.0, 0.02]))}
        rule = draw(st.sampled_from(["reach", "latency", "utility"]))
        if rule == "latency":
            n = draw(st.integers(1, 40))
            a["latency"] = torch.cumsum(torch.rand(n, generator=g, dtype=torch.float64) * 0.02, 0) + 0.05
        elif rule == "utility":
            a.update(rule="utility", lambda_depth=draw(st.sampled_from([0.0, 0.002, 0.5])),
                     min_utility=draw(st.sampled_from([0.0, 0.05, float("-inf")])))
        return a
    if op == "tree_mask":
        t = draw(trees())
        return {**cases.tree_fields("tree", t),
                "prefix_lens": torch.tensor(draw(st.lists(st.sampled_from([0, 1, 7, 2 ** 40, 2 ** 63 - 100]),
                                                          min_size=t.batch_size, max_size=t.batch_size)))}
    if op == "accept_greedy":
        t = draw(trees())
        return {**cases.tree_fields("tree", t), "target_tokens": torch.randint(3, t.tokens.shape, generator=g),
                "max_depth": draw(st.integers(0, 40))}
    if op == "compact_kv":
        B, L = draw(st.integers(1, 3)), draw(st.integers(1, 20))
        prefix = [draw(st.integers(0, L - 1)) for _ in range(B)]
        paths = []
        for b in range(B):
            room = L - prefix[b]
            nodes = sorted(draw(st.sets(st.integers(1, max(1, room - 1)), max_size=min(4, room - 1)))) if room > 1 else []
            paths.append([0] + nodes)
        P = max(len(p) for p in paths)
        path = torch.tensor([p + [-1] * (P - len(p)) for p in paths])
        keys, values = cases._caches(g, B, draw(st.integers(1, 2)), L, draw(st.integers(1, 3)), layers=2,
                                     dtype=draw(st.sampled_from([torch.float32, torch.float16])))
        return {"keys.0": keys[0], "keys.1": keys[1], "values.0": values[0], "values.1": values[1],
                "prefix_lens": torch.tensor(prefix), "path": path}
    if op == "tree_attention":
        t = draw(trees(max_b=2))
        B, N = t.tokens.shape
        prefix = [draw(st.integers(0, 4)) for _ in range(B)]
        L = max(prefix) + N + draw(st.integers(0, 2))
        Hkv = draw(st.integers(1, 2))
        Hq, Dh = Hkv * draw(st.integers(1, 2)), draw(st.sampled_from([1, 3, 16]))
        _, bits = tk.tree_mask(t, torch.tensor(prefix), backend="reference")
        return {"q": torch.randn(B, Hq, N, Dh, generator=g), "k": torch.randn(B, Hkv, L, Dh, generator=g),
                "v": torch.randn(B, Hkv, L, Dh, generator=g), "ancestor_bits": bits,
                "prefix_lens": torch.tensor(prefix), "scale": draw(st.sampled_from([None, 0.3]))}
    raise KeyError(op)


def describe(args) -> str:
    """Enough of an input to rebuild it by hand: shapes of tensors (values of small ones), scalars as they are."""
    out = []
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            out.append(f"{k}={v.tolist() if v.numel() <= 64 else tuple(v.shape)}")
        else:
            out.append(f"{k}={v!r}"[:80])
    return ", ".join(out)


def _fresh(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def run_block(case_id: str, differ: Callable, run_one: Callable):
    """-> ``(outcome, detail)``: ``agree`` when every example agreed on every backend, else ``DISAGREE`` with the
    shrunk example's description."""
    _, op, _ = case_id.split("|")
    backends = cases.OPS[op].backends
    failures = []

    @settings(max_examples=EXAMPLES.get(op, DEFAULT_EXAMPLES), derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=False,
              verbosity=Verbosity.quiet, phases=(Phase.explicit, Phase.generate))  # no shrinking: bounded time
    @given(args=inputs(op))
    def prop(args):
        results = {b: run_one(op, _fresh(args), b) for b in backends}
        results = {b: r for b, r in results.items() if r[0] != "skip"}
        bad = {b: r[1] for b, r in results.items() if r[0] == "error"}
        assert not bad, f"valid input refused: {bad}; input {describe(args)}"
        names = list(results)
        for b in names[1:]:
            why = differ(results[names[0]][1], results[b][1])
            assert not why, f"{names[0]} vs {b}: {why}; input {describe(args)}"

    try:
        prop()
    except Exception as exc:  # noqa: BLE001 - an assertion, or whatever a backend raised
        failures.append(f"{type(exc).__name__}: {exc}")
    if failures:
        return "DISAGREE", failures[0][:3000]
    return "agree", ""
