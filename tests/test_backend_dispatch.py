"""Backend choice: one table in taps_kernels.backend, explained by ``explain``; overrides, limits, no import cycle."""
import ast
import importlib
import os
import subprocess
import sys

import pytest
import torch

import taps_kernels as tk
from taps_kernels import backend as bk
from taps_kernels.reference.pool import best_first_pool_reference

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ROUND_OPS = ("topk_stats", "best_first_pool", "propagate_reach", "select_subtree", "reindex_subtree", "score_edges",
             "tree_attention")
LOOP_REFERENCES = ("best_first_pool", "propagate_reach", "select_subtree")  # references with per-node Python loops


def test_every_registered_op_has_a_row_with_reasons():
    bk._ensure_registered()
    registered = {op for (op, _) in bk._IMPLS}
    assert registered <= set(bk.PREFERENCES), registered - set(bk.PREFERENCES)
    loaded = {b for (_, b) in bk._IMPLS}  # backends whose module imported here (the CUDA extension may not)
    for op, pref in bk.PREFERENCES.items():
        assert pref.cuda_why and pref.cpu_why, op
        for name in pref.cuda + pref.cpu:
            assert name in bk.BACKENDS and name != "reference", (op, name)
            if name in loaded:
                assert bk.has_impl(op, name), f"{op}: preferred backend {name!r} has no implementation"


#: The default each op must get with every backend built, ``(on CUDA tensors, on CPU tensors)``; for
#: ``rows_linear`` at explain's example call (one float32 row). Written out here, not read from
#: ``backend.PREFERENCES``, so a wrong entry there (or a wrong rule in the choice) fails; a new op adds its row.
EXPECTED = {
    "topk_stats": ("triton", "cpp"),
    "best_first_pool": ("triton", "cpp"),
    "propagate_reach": ("triton", "cpp"),
    "select_subtree": ("triton", "cpp"),
    "select_throughput": ("triton", "cpp"),
    "reindex_subtree": ("triton", "cpp"),
    "tree_mask": ("cuda", "cpp"),
    "tree_attention": ("triton", "reference"),
    "accept_greedy": ("cuda", "cpp"),
    "accept_round": ("cuda", "cpp"),
    "greedy_tokens": ("reference", "cpp"),
    "compact_kv": ("cuda", "cpp"),
    "commit_round": ("cuda", "cpp"),
    "score_edges": ("triton", "cpp"),
    "lookup_chain": ("reference", "cpp"),
    "graft_chain": ("reference", "cpp"),
    "rows_linear": ("reference", "cpp"),
    "build_tree": ("reference", "cpp"),
}

#: Per-call rules: ``(op, device, call context, default with every backend built)``.
CALLS = [
    ("rows_linear", "cpu", dict(rows=1, dtype=torch.float32), "cpp"),
    ("rows_linear", "cpu", dict(rows=32, dtype=torch.float32), "cpp"),
    ("rows_linear", "cpu", dict(rows=33, dtype=torch.float32), "reference"),  # prefill sizes: BLAS
    ("rows_linear", "cpu", dict(rows=4, dtype=torch.float64), "reference"),
    ("rows_linear", "cpu", dict(rows=4, dtype=torch.bfloat16), "reference"),
    ("rows_linear", "cuda", dict(rows=4, dtype=torch.float32), "reference"),  # cuBLAS
    ("best_first_pool", "cuda", dict(pool_size=1024), "triton"),
    ("best_first_pool", "cuda", dict(pool_size=1025), "reference"),  # more than the kernel holds
    ("best_first_pool", "cpu", dict(pool_size=5000), "cpp"),
    ("select_throughput", "cuda", dict(batch_size=32, max_nodes=64), "triton"),
    ("select_throughput", "cuda", dict(batch_size=33, max_nodes=64), "reference"),  # one program ranks 2048
    ("select_throughput", "cuda", dict(batch_size=64, max_nodes=64, columns=33), "triton"),
]


def _on_this_machine(want: str, op: str) -> str:
    """``want`` where this machine built it, else the reference (what every order ends with)."""
    cpp = bk.load_extension("_C")[0]
    missing = {"cpp": cpp is None or (op == "rows_linear" and not cpp.rows_linear_vectorized()),
               "cuda": bk.load_extension("_C_cuda")[0] is None,
               "triton": bool(bk.unavailable_reason("triton", CUDA))}
    return "reference" if missing.get(want, False) else want


def test_every_op_chooses_the_backend_of_the_written_table(monkeypatch):
    monkeypatch.delenv("TAPS_BACKEND", raising=False)
    assert set(EXPECTED) == set(bk.PREFERENCES)
    for device in ("cpu", "cuda"):
        table = bk.explain_dict(device=device)
        text = tk.explain(device=device)
        assert set(table) == set(EXPECTED)
        for op, (on_cuda, on_cpu) in EXPECTED.items():
            want = _on_this_machine(on_cpu if device == "cpu" else on_cuda, op)
            ctx = dict(rows=1, dtype=torch.float32) if op == "rows_linear" else {}
            assert table[op]["backend"] == want, (op, device, table[op])
            assert bk.resolve(op, None, torch.device(device), **ctx)[0] == want, (op, device)
            assert f"  {op}: {want}" in text, (op, device)


@pytest.mark.parametrize("op,device,ctx,want", CALLS,
                         ids=[f"{c[0]}-{c[1]}-" + "-".join(f"{k}={v}" for k, v in c[2].items()) for c in CALLS])
def test_per_call_rules_choose_the_written_backend(monkeypatch, op, device, ctx, want):
    monkeypatch.delenv("TAPS_BACKEND", raising=False)
    assert bk.resolve(op, None, torch.device(device), **ctx)[0] == _on_this_machine(want, op)


def test_explain_names_every_unavailable_backend_with_its_reason(monkeypatch):
    monkeypatch.delenv("TAPS_BACKEND", raising=False)
    for device in ("cpu", "cuda"):
        table = bk.explain_dict(device=device)
        text = tk.explain(device=device)
        for op, entry in table.items():
            assert entry["why"] and entry["why"] in text, op
            # the other device's backends can never run here, whatever is built
            assert ("cuda" if device == "cpu" else "cpp") in entry["unavailable"], (op, device)
            ctx = entry.get("context", {})
            ctx = {**ctx, **({"dtype": getattr(torch, ctx["dtype"])} if "dtype" in ctx else {})}
            for name in bk.BACKENDS:
                reason = bk.unavailable_reason(name, device, op, **ctx)
                assert (name in entry["unavailable"]) == bool(reason), (op, name)
                if reason:
                    assert f"      {name}: unavailable - {reason}" in text
    one = bk.explain_dict("best_first_pool", device="cuda")
    assert list(one) == ["best_first_pool"]
    assert "not measured on a GPU" in one["best_first_pool"]["why"]
    with pytest.raises(ValueError, match="op"):
        bk.explain_dict("no_such_op")


def test_no_python_loop_reference_on_a_device_with_triton(monkeypatch):
    """The preference function puts a device kernel first for every op of a decode round on CUDA; where triton is
    importable (CPU-only here, so CUDA is faked) resolve picks it, never a per-node Python reference."""
    monkeypatch.delenv("TAPS_BACKEND", raising=False)
    for op in ROUND_OPS:
        assert bk.preferred_backends(op, CUDA)[0] == "triton", op
    for op in ("tree_mask", "accept_greedy", "compact_kv"):
        assert bk.preferred_backends(op, CUDA)[0] == "cuda", op
    if bk.unavailable_reason("triton", CUDA):
        pytest.skip(f"triton unavailable: {bk.unavailable_reason('triton', CUDA)}")
    for op in ROUND_OPS:
        assert bk.resolve(op, None, CUDA)[0] == "triton", op
    assert bk.resolve("best_first_pool", None, CUDA, pool_size=1024)[0] == "triton"
    # a pool the kernel cannot hold: the fallback is named, and candidate_pool searches it on the host in C++
    assert bk.resolve("best_first_pool", None, CUDA, pool_size=1025)[0] == "reference"
    assert "1024" in bk.unavailable_reason("triton", CUDA, "best_first_pool", pool_size=1025)
    with pytest.raises(bk.BackendUnavailable, match="1024"):
        bk.resolve("best_first_pool", "triton", CUDA, pool_size=1025)
    host = "cpp" if not bk.unavailable_reason("cpp", CPU) else "reference"
    assert bk.pool_placement(None, CUDA, 1025) == (host, CPU)
    assert bk.pool_placement(None, CUDA, 64) == ("triton", CUDA)


def test_pool_placement_rules(monkeypatch):
    monkeypatch.delenv("TAPS_BACKEND", raising=False)
    assert bk.pool_placement("cpp", CUDA, 64) == ("cpp", CPU)            # asked for: one copy to the host
    assert bk.pool_placement("reference", CUDA, 64) == ("reference", CPU)
    assert bk.pool_placement("reference", CPU, 64) == ("reference", CPU)
    assert bk.pool_placement(None, CPU, 64) == (bk.resolve("best_first_pool", None, CPU)[0], CPU)


def test_taps_backend_override(monkeypatch):
    monkeypatch.setenv("TAPS_BACKEND", "reference")
    for op in bk.PREFERENCES:
        assert bk.resolve(op, None, CPU)[0] == "reference", op
        assert bk.resolve(op, None, CUDA)[0] == "reference", op
    assert "TAPS_BACKEND=reference" in tk.explain("propagate_reach")
    assert bk.rows_linear_backend(4, CPU, torch.float32) == "reference"
    # an override that cannot run a call is ignored for that call (the default runs), not an error
    monkeypatch.delenv("TAPS_BACKEND")
    default = {op: bk.resolve(op, None, CPU)[0] for op in bk.PREFERENCES}
    monkeypatch.setenv("TAPS_BACKEND", "cuda")
    assert {op: bk.resolve(op, None, CPU)[0] for op in bk.PREFERENCES} == default
    if not bk.unavailable_reason("triton", CPU):  # interpreter on: the override reaches the Triton kernels on CPU
        monkeypatch.setenv("TAPS_BACKEND", "triton")
        assert bk.resolve("select_subtree", None, CPU)[0] == "triton"
        assert bk.resolve("tree_mask", None, CPU)[0] == default["tree_mask"]  # no Triton tree_mask
        calls = []
        real = bk._IMPLS[("best_first_pool", "triton")]
        monkeypatch.setitem(bk._IMPLS, ("best_first_pool", "triton"), lambda *a: calls.append(1) or real(*a))
        pool = tk.candidate_pool(torch.randn(1, 3, 20), torch.tensor([1]), 4, 12)
        assert calls == [1]
        want = best_first_pool_reference(pool.topk_logp, pool.topk_ids, torch.tensor([1]), 12)
        assert torch.equal(pool.tree.parents, want[1]) and torch.equal(pool.tree.tokens, want[0])


def test_rows_linear_choice_goes_through_resolve(monkeypatch):
    monkeypatch.delenv("TAPS_BACKEND", raising=False)
    calls = []
    real = bk.resolve
    monkeypatch.setattr(bk, "resolve", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    assert bk.rows_linear_backend(500, CPU, torch.float32) == "reference"  # prefill sizes: BLAS
    assert bk.rows_linear_backend(4, CUDA, torch.float32) == "reference"   # GPUs: cuBLAS
    assert calls and all(a[0] == "rows_linear" for a, _ in calls)


def test_backend_and_impls_do_not_import_each_other():
    import taps_kernels.backend as backend_mod
    import taps_kernels.impls as impls_mod
    for mod, other in ((backend_mod, "impls"), (impls_mod, "backend")):
        tree = ast.parse(open(mod.__file__).read())
        for node in tree.body:  # module level only: a lazy import inside a function is the intended way
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
                assert not any(n == other or n.endswith("." + other) for n in names), (mod.__name__, names)
            elif isinstance(node, ast.Import):
                assert not any(a.name.endswith("." + other) for a in node.names), (mod.__name__, node.names)
    env = {k: v for k, v in os.environ.items() if k != "TAPS_BACKEND"}
    for stmt in ("import taps_kernels.impls", "import taps_kernels.backend as b; b.resolve('propagate_reach', None, 'cpu')"):
        proc = subprocess.run([sys.executable, "-c", stmt], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{stmt}: {proc.stderr[-2000:]}"


def test_explicit_backend_errors_say_why():
    with pytest.raises(bk.BackendUnavailable, match="cuda"):
        bk.resolve("tree_mask", "cuda", CPU)
    with pytest.raises(bk.BackendUnavailable, match="unknown backend"):
        bk.resolve("tree_mask", "fpga", CPU)


LIBRARY_OPS = ["accept_greedy", "best_first_pool", "compact_kv", "reindex_subtree", "score_edges", "select_subtree",
               "topk_stats", "tree_attention", "tree_mask"]


def test_import_registers_the_library_ops():
    # An engine imports the package once: every torch.ops.taps.* op must exist after `import taps_kernels`.
    code = ("import torch, taps_kernels\n"
            f"print(sorted(n for n in {LIBRARY_OPS!r} if hasattr(torch.ops.taps, n)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(LIBRARY_OPS)


@pytest.mark.parametrize("op", LIBRARY_OPS)
def test_each_public_op_has_one_path_through_its_library_op(op, monkeypatch):
    """The public op reaches its backend only through ``torch.ops.taps.<op>``: every choice of ``op``'s backend
    happens inside that op's dispatch (seen by a dispatch mode), never beside it (a second door)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops_module = {"accept_greedy": "accept", "best_first_pool": "pool", "compact_kv": "kv",
                  "reindex_subtree": "select", "score_edges": "score", "select_subtree": "select",
                  "topk_stats": "pool", "tree_attention": "attention", "tree_mask": "mask"}[op]
    mod = importlib.import_module(f"taps_kernels.ops.{ops_module}")
    call = _public_calls()[op]
    events = []

    class LibraryOps(TorchDispatchMode):
        inside = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace != "taps":
                return func(*args, **(kwargs or {}))
            events.append(("op", func._opname))
            LibraryOps.inside += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                LibraryOps.inside -= 1

    real = mod.resolve

    def resolve(name, *a, **k):
        events.append(("resolve", name, LibraryOps.inside > 0))
        return real(name, *a, **k)

    import taps_kernels._library as library

    monkeypatch.setattr(mod, "resolve", resolve)
    monkeypatch.setattr(library, "resolve", resolve)  # the kernels that choose through backend_for
    with LibraryOps():
        call()
    assert ("op", op) in events, events
    chosen = [e for e in events if e[0] == "resolve" and e[1] == op]
    assert chosen and all(inside for _, _, inside in chosen), events


def _public_calls():
    g = torch.Generator().manual_seed(0)
    tree = tk.Tree(torch.tensor([[3, 4, 5]]), torch.tensor([[-1, 0, 1]], dtype=torch.int32),
                   torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
    logits = torch.randn(1, 2, 9, generator=g)
    stats = tk.topk_stats(logits, 3)
    pool = tk.candidate_pool(logits, torch.tensor([1]), 3, 4)
    keys, values = [torch.randn(1, 1, 8, 4)], [torch.randn(1, 1, 8, 4)]
    q = torch.randn(1, 1, 3, 4)
    bits = tk.tree_mask(tree, torch.tensor([2]))[1]
    return {
        "accept_greedy": lambda: tk.accept_greedy(tree, torch.tensor([[4, 5, 6]]), max_depth=2),
        "best_first_pool": lambda: tk.best_first_pool(stats, torch.tensor([1]), 4),
        "compact_kv": lambda: tk.compact_kv(keys, values, torch.tensor([2]), torch.tensor([[0, 1]])),
        "reindex_subtree": lambda: tk.select_subtree(pool.tree, pool.logq, 2),
        "score_edges": lambda: tk.score_edges(pool, None),
        "select_subtree": lambda: tk.select_subtree(pool.tree, pool.logq, 2),
        "topk_stats": lambda: tk.topk_stats(logits, 3),
        "tree_attention": lambda: tk.tree_attention(q, keys[0], values[0], bits, torch.tensor([2])),
        "tree_mask": lambda: tk.tree_mask(tree, torch.tensor([2])),
    }


def test_rounds_are_built_in_one_call_only_where_build_tree_runs_cpp(monkeypatch):
    monkeypatch.delenv("TAPS_BACKEND", raising=False)
    cpp = bk.load_extension("_C")[0] is not None
    assert bk.builds_round_in_one_call("cpu") is cpp
    assert bk.builds_round_in_one_call("cuda") is False  # a GPU builds stage by stage with its kernels
    monkeypatch.setenv("TAPS_BACKEND", "triton")  # the stages asked for another backend: through the ops
    assert bk.builds_round_in_one_call("cpu") is False
    monkeypatch.setenv("TAPS_BACKEND", "cpp")
    assert bk.builds_round_in_one_call("cpu") is cpp

