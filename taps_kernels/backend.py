"""The one place that decides which implementation of an op runs, and says why (or why not).

Backends:

* ``"reference"``: plain PyTorch (``taps_kernels.reference``); always available; the spec.
* ``"cpp"``: the C++ extension ``taps_kernels._C``; CPU tensors only.
* ``"triton"``: Triton kernels; CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1``
  was set before ``taps_kernels`` was imported (the interpreter: slow, for tests).
* ``"cuda"``: the CUDA extension ``taps_kernels._C_cuda``; CUDA tensors only.

Default choice (``backend=None``): the op's row of :data:`PREFERENCES` for the tensors' device, first
available entry wins, ``reference`` last. The table gives each choice its one-line reason;
:func:`explain` prints it with every backend that cannot run and why. The interpreter is never a default:
it is orders of magnitude slower than the reference. ``TAPS_BACKEND`` (environment) replaces the default
for every op that has that backend and can run the call. Implementations register in
:mod:`taps_kernels._registry`; this module imports them lazily (:mod:`taps_kernels.impls`) on first use.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

from . import _registry
from ._registry import BACKENDS

_IMPLS = _registry.IMPLS
_SUPPORTS = _registry.SUPPORTS


def register(op: str, backend: str, supports: Optional[Callable[..., str]] = None):
    """Decorator: register ``fn`` as the ``backend`` implementation of ``op`` (see :mod:`taps_kernels._registry`)."""
    return _registry.register(op, backend, supports, table=_IMPLS)


class BackendUnavailable(RuntimeError):
    """Raised when an explicitly requested backend cannot run an op; the message says why."""


# --- the preference table ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Preference:
    """Default order of one op per device type, each with the reason (``reference`` always ends the order)."""

    cuda: Tuple[str, ...]
    cuda_why: str
    cpu: Tuple[str, ...] = ("cpp",)
    cpu_why: str = "C++ loops without per-node Python; bit-identical to the reference"
    example: Dict[str, object] = field(default_factory=dict)  # call context explain() shows for per-call rules


_NO_SYNC = "no host synchronisation"

PREFERENCES: Dict[str, Preference] = {
    "topk_stats": Preference(
        ("triton",), "fused log-softmax + top-K + statistics: one read of the [B,D,V] logits",
        cpu_why="one C++ pass per position (max, float64 exp sums, log-probs, a threshold-filtered top-K) instead "
                "of separate log-softmax / exp / sum / sort passes; floats within rounding of the reference, ids exact"),
    "best_first_pool": Preference(
        ("triton",), f"one program per request, frontier in registers (pools up to 1024 nodes), {_NO_SYNC}; "
        "a one-copy host search (cpp) was not measured on a GPU yet; larger pools search on the host "
        "(candidate_pool copies the top-K lattice once)",
        cpu_why="C++ heap search; the reference pays a Python heap operation per node"),
    "propagate_reach": Preference(
        ("triton",), f"one program per tree, float32 sums in the reference's order, {_NO_SYNC}"),
    "select_subtree": Preference(
        ("triton",), f"ranks, throughput size (latency table on the device) and greedy utility per tree, "
        f"{_NO_SYNC}"),
    "select_throughput": Preference(
        ("triton",), f"ranks per row in parallel, then one program merges the batch (up to 2048 candidates), "
        f"{_NO_SYNC}; larger batches fall back",
        cpu_why="one C++ pass over the batch (a sort per row, a B-way merge) instead of the reference's Python loops"),
    "reindex_subtree": Preference(
        ("triton",), "one launch (gather + binary search) instead of a dozen torch ops; the reference runs "
        "on any device too"),
    "tree_mask": Preference(("cuda",), f"plain CUDA kernel, one block per tree, {_NO_SYNC}"),
    "tree_attention": Preference(
        ("triton",), "flash-style attention over the packed ancestor bits",
        cpu=(), cpu_why="no C++ kernel: torch's matmuls under the reference's mask"),
    "accept_greedy": Preference(("cuda",), f"plain CUDA walk, one block per request, {_NO_SYNC}"),
    "accept_round": Preference(("cuda",), f"the CUDA walk and device ops, {_NO_SYNC}",
                               cpu_why="one C++ call for the walk, the committed tokens and the history append "
                                       "instead of the walk and about twenty torch ops"),
    "greedy_tokens": Preference((), "torch's argmax", cpu_why="one AVX-512 or AVX2 pass per row (max, then the first "
                                "equal entry): ~10x torch's last-dimension argmax here"),
    "compact_kv": Preference(("cuda",), "one CUDA launch moves the accepted rows of every layer in place"),
    "commit_round": Preference(("cuda",), f"torch's argmax, the CUDA walk and the CUDA compaction, {_NO_SYNC}",
                               cpu_why="one C++ call for the greedy tokens, the walk, the history append, the "
                                       "compaction and the lengths, through those ops' routines, instead of three "
                                       "ops and the small tensor ops between them"),
    "score_edges": Preference(
        ("triton",), "the edge MLP spread over the GPU, then one program per tree normalises and propagates",
        cpu_why="C++ scorer (matches the reference within float32 tolerance)"),
    "lookup_chain": Preference(
        (), "torch ops with static shapes (one pass per suffix length), no host synchronisation",
        cpu_why="one C++ scan per row (latest occurrence first) instead of a tensor pass per suffix length"),
    "graft_chain": Preference(
        (), "torch ops with static shapes (one pass per chain token), no host synchronisation",
        cpu_why="one C++ walk per row instead of a dozen tensor ops per chain token"),
    "build_tree": Preference(
        (), "the reference chains torch ops with host reads; a GPU policy builds op by op with its kernels instead",
        cpu_why="the pool, scorer, lookup graft and throughput rule in one C++ call through their own ops' routines "
                "(same tree bit for bit), without ~1 ms of per-op Python a round"),
    # Few-row linear layers (taps_kernels.rows_linear). Measured on the 2-core AVX-512 CPU of this project
    # (bench/results/rows_linear_cpu.json, 1 thread): torch's linear runs BLAS sgemm, which from 2 rows on costs
    # about twice its 1-row sgemv although both only stream the weights (SmolLM2's LM head: 11.5 ms at 1 row,
    # 20-26 ms at 2-16); the C++ kernel streams each weight row once for all rows (8.7 ms at 1 row, 10-13 at
    # 2-8, 17 at 16), so a whole SmolLM2 forward over 4-8 new rows takes 81 ms instead of 105-114 (75 at 1 row).
    # At 32 rows it is still ~10% ahead; at 64 even, and prefill sizes are BLAS's. Without AVX-512 the C++
    # kernel is plain loops, slower than BLAS; on GPUs cuBLAS.
    "rows_linear": Preference(
        (), "cuBLAS (torch's linear): the few-row kernel is a CPU answer to BLAS sgemm at small M",
        cpu_why="per call: the C++ kernel for 1..32 float32 rows on an AVX-512 CPU (half of sgemm's time at "
        "2-16 rows), torch's linear otherwise",
        example={"rows": 1, "dtype": torch.float32}),
}

ROWS_LINEAR_MAX_ROWS = 32


def _rows_linear_wants_cpp(rows: Optional[int], dtype: Optional[torch.dtype]) -> bool:
    if dtype != torch.float32 or rows is None or not 1 <= rows <= ROWS_LINEAR_MAX_ROWS:
        return False
    mod, _ = load_extension("_C")
    return mod is not None and bool(mod.rows_linear_vectorized())


def preferred_backends(op: str, device, **context) -> Tuple[str, ...]:
    """The default order for ``op`` on ``device`` (before availability), ``reference`` last.

    ``context`` carries what a per-call rule reads: ``rows``/``dtype`` for ``rows_linear``."""
    device = torch.device(device)
    pref = PREFERENCES.get(op)
    if pref is None:
        order: Tuple[str, ...] = ("triton", "cuda") if device.type == "cuda" else ("cpp",)
    elif device.type == "cuda":
        order = pref.cuda
    elif op == "rows_linear":
        order = ("cpp",) if _rows_linear_wants_cpp(context.get("rows"), context.get("dtype")) else ()
    else:
        order = pref.cpu
    return order + ("reference",)


# --- availability -----------------------------------------------------------------------------------------------

_EXT_CACHE: Dict[str, Tuple[Optional[object], str]] = {}


def load_extension(name: str):
    """Import ``taps_kernels.<name>`` once; return ``(module or None, reason it is missing)``."""
    if name not in _EXT_CACHE:
        try:
            mod = importlib.import_module(f"taps_kernels.{name}")
            _EXT_CACHE[name] = (mod, "")
        except Exception as exc:  # ImportError, or an ABI mismatch surfacing as OSError
            _EXT_CACHE[name] = (None, f"taps_kernels.{name} could not be imported ({type(exc).__name__}: {exc})")
    return _EXT_CACHE[name]


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_reason(device: torch.device) -> str:
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton is not installed ({exc})"
    if device.type == "cuda":
        return ""
    if device.type == "cpu" and triton_interpreting():
        return ""
    return (f"Triton needs CUDA tensors, or TRITON_INTERPRET=1 set before importing taps_kernels for CPU tensors; "
            f"received tensors on {device}")


def unavailable_reason(backend: str, device, op: Optional[str] = None, **context) -> str:
    """Empty string when ``backend`` can run ``op`` on ``device`` (for this call ``context``); otherwise why not."""
    device = torch.device(device)
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; expected one of {BACKENDS}"
    # the backend as a whole first (wrong device, extension not built): a module that failed to import
    # registered nothing, and "no implementation" would hide why
    if backend == "reference":
        why = ""
    elif backend == "cpp":
        why = (f"the C++ backend runs on CPU tensors, received tensors on {device}" if device.type != "cpu"
               else load_extension("_C")[1])
    elif backend == "cuda":
        why = (f"the CUDA backend runs on CUDA tensors, received tensors on {device}" if device.type != "cuda"
               else load_extension("_C_cuda")[1])
    else:
        why = _triton_reason(device)
    if why or op is None:
        return why
    _ensure_registered()
    if (op, backend) not in _IMPLS:
        have = sorted(b for (o, b) in _IMPLS if o == op)
        return f"op {op!r} has no {backend!r} implementation (available: {have})"
    return _SUPPORTS[(op, backend)](**context) if (op, backend) in _SUPPORTS else ""


def has_impl(op: str, backend: str) -> bool:
    """Whether ``backend`` registered an implementation of ``op`` (available or not on this machine)."""
    _ensure_registered()
    return (op, backend) in _IMPLS


def _choose(op: str, device: torch.device, context) -> Tuple[str, str]:
    """``(backend, reason)`` of the default for ``op`` on ``device``."""
    env = os.environ.get("TAPS_BACKEND")
    if env and (op, env) in _IMPLS and not unavailable_reason(env, device, op, **context):
        return env, f"TAPS_BACKEND={env} overrides the default"
    pref = PREFERENCES.get(op)
    why = (pref.cuda_why if device.type == "cuda" else pref.cpu_why) if pref else "no preference recorded"
    skipped = []
    for name in preferred_backends(op, device, **context):
        reason = unavailable_reason(name, device, op, **context)
        if not reason:
            if skipped:
                return name, "fallback: " + "; ".join(skipped)
            return name, why if name != "reference" else "the reference is the default here: " + why
        skipped.append(f"{name} unavailable ({reason})")
    return "reference", "fallback: " + "; ".join(skipped)


_CHOICES: Dict[tuple, str] = {}


def resolve(op: str, backend: Optional[str], device, **context) -> Tuple[str, Callable]:
    """Pick the implementation of ``op`` for tensors on ``device``; return ``(backend name, callable)``.

    ``context`` is what a per-call rule or a size limit reads (``rows``/``dtype`` for ``rows_linear``,
    ``pool_size`` for ``best_first_pool``). An explicit ``backend`` that cannot run raises
    :class:`BackendUnavailable` with the reason."""
    _ensure_registered()
    device = torch.device(device)
    if backend is None:
        # The choice depends only on these (the registry's contents, the environment override, the call
        # context); cached because every op call asks (measured: 3.7 us per _choose on this project's CPU).
        key = (op, device, os.environ.get("TAPS_BACKEND"), len(_IMPLS), id(_IMPLS), tuple(sorted(context.items())))
        name = _CHOICES.get(key)
        if name is None:
            name = _CHOICES[key] = _choose(op, device, context)[0]
        return name, _IMPLS[(op, name)]
    why = unavailable_reason(backend, device, op, **context)
    if why:
        raise BackendUnavailable(f"backend={backend!r} cannot run {op}: {why}")
    return backend, _IMPLS[(op, backend)]


def rows_linear_backend(rows: int, device, dtype: torch.dtype) -> str:
    """Default backend of ``rows_linear`` for ``rows`` rows of ``dtype`` on ``device``: :func:`resolve` with
    the measured rule of the ``rows_linear`` row of :data:`PREFERENCES` (``TAPS_BACKEND`` overrides it)."""
    return resolve("rows_linear", None, device, rows=rows, dtype=dtype)[0]


# Dynamic int8 linear layers (taps_kernels.integrations.int8_linear: the drafter's vocabulary head on CPU).
# Measured on this project's 2-core AVX-512 CPU, one thread, 7 rows x 576 -> 16,386 ids: fbgemm's int8 GEMM
# 0.37 ms, bf16 2.3 ms, fp32 6.5 ms (bench/results/draft_time_cpu.json has the whole draft pass).
@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def int8_linear_backend(device) -> Tuple[str, str]:
    """``(backend, why)`` of :class:`taps_kernels.integrations.int8_linear.Int8Linear` on ``device``:
    ``"fbgemm"`` (torch's int8 GEMM with dynamic activation quantisation; x86 CPUs) or ``"reference"``
    (:func:`taps_kernels.reference.int8_linear_reference`: the same arithmetic in plain torch, slow)."""
    device = torch.device(device)
    if device.type != "cpu":
        return "reference", f"fbgemm runs on CPU tensors, received tensors on {device}"
    return _cpu_int8_linear_backend()


@functools.lru_cache(maxsize=None)
def _cpu_int8_linear_backend() -> Tuple[str, str]:
    # asked on every draft's head projection: what the torch build offers cannot change within a process
    engines = getattr(torch.backends.quantized, "supported_engines", [])
    if "fbgemm" not in engines and "x86" not in engines:
        return "reference", f"this torch build has no fbgemm quantized engine (engines: {list(engines)})"
    if not hasattr(torch.ops.quantized, "linear_dynamic"):
        return "reference", "this torch build has no torch.ops.quantized.linear_dynamic"
    return "fbgemm", "int8 x uint8 GEMM with int32 sums: ~6x a bf16 head on this project's CPU"


@functools.lru_cache(maxsize=None)
def gguf_linear_backend() -> Tuple[str, str]:
    """``(path, why)`` of the GGUF block kernels (``csrc/gguf_linear.h``) and the GGUF target's forward on this
    CPU: ``"amx"`` (AMX-INT8 tiles for each 16 rows of a call and a last 12-15, VNNI for the rest; used after a
    start-up check against VNNI),
    ``"vnni"`` (AVX-512 VNNI), ``"avx2"`` (vpmaddubsw sums that cannot saturate), ``"scalar"`` (the same
    arithmetic in plain loops: exact, slow), ``"amx-emulated"`` (only where ``TAPS_GGUF_KERNELS`` asks for it) or
    ``"unavailable"``; every path gives the same bits."""
    mod, why = load_extension("_C")
    if mod is None:
        return "unavailable", f"the C++ extension is not built ({why})"
    if not mod.gguf_forward_available():
        return "unavailable", "the GGUF forward needs AVX-512F, or AVX2 with FMA and F16C; use the fp32 target format"
    path = mod.gguf_kernel_path()
    amx = ("; this CPU reports AMX-INT8, but the tile kernel's start-up check (tile permission, result equal to "
           "VNNI's in a child process) failed") if "amx_int8" in cpu_flags() and not mod.gguf_amx_available() else ""
    if path == "amx":
        return "amx", ("AMX-INT8 tiles (tdpbsud) over Q4_1 / Q8_0 blocks for each 16 rows of a call and a last 12-15, "
                       "VNNI for the rest; passed its start-up check against VNNI")
    if path == "amx-emulated":
        return path, "the AMX kernel with its tile multiplies in plain loops (TAPS_GGUF_KERNELS; a test path)"
    if path == "vnni":
        return "vnni", "vpdpbusd over Q4_1 / Q8_0 blocks, int8 activations per 32-block" + amx
    if path == "avx2":
        return "avx2", ("no AVX-512 VNNI here: vpmaddubsw / vpmaddwd over Q4_1 / Q8_0 blocks (exact int32 block "
                        "sums, the same bits as VNNI), the forward's row math on 8 lanes" + amx)
    return "scalar", "no AVX2 here: the block kernels run their plain loops (same bits, slower)" + amx


def int8_reduce_range() -> bool:
    """Whether int8 activations use 7 bits: without VNNI, fbgemm multiplies uint8 x int8 pairs through
    16-bit sums that can saturate at 8 bits; VNNI sums in 32 bits."""
    flags = cpu_flags()
    return not ("avx512_vnni" in flags or "avx_vnni" in flags)


def builds_round_in_one_call(device) -> bool:
    """Whether a policy with the throughput rule builds its rounds on ``device`` with :func:`taps_kernels.build_tree`
    (one C++ call) rather than stage by stage through the public ops: where ``build_tree``'s default is ``cpp`` and
    ``TAPS_BACKEND`` does not ask the stages for another backend (the Triton kernels under test, for instance)."""
    env = os.environ.get("TAPS_BACKEND")
    if env and env != "cpp":
        return False
    return resolve("build_tree", None, torch.device(device))[0] == "cpp"


def pool_placement(pool_backend: Optional[str], device, pool_size: int) -> Tuple[str, torch.device]:
    """Where ``candidate_pool`` runs its best-first search: ``(backend, device)``.

    On CUDA the default is the device kernel (no synchronisation; see the ``best_first_pool`` row of
    :data:`PREFERENCES`). A host backend (``cpp``/``reference``, asked for or the fallback for a pool the
    kernel cannot hold) searches on the CPU: the caller copies the top-K lattice there and the pool back."""
    device = torch.device(device)
    name = pool_backend if pool_backend is not None else resolve("best_first_pool", None, device,
                                                                 pool_size=pool_size)[0]
    if device.type == "cuda" and name in ("cpp", "reference"):
        host = torch.device("cpu")
        if pool_backend is None:
            name = resolve("best_first_pool", None, host, pool_size=pool_size)[0]
        return name, host
    return name, device


def available_backends(op: str, device) -> Dict[str, str]:
    """``{backend: reason}`` for every backend; an empty reason means available."""
    _ensure_registered()
    return {b: unavailable_reason(b, device, op) for b in BACKENDS}


# --- explanation --------------------------------------------------------------------------------------------------

def explain_dict(op: Optional[str] = None, device="cpu", **context) -> Dict[str, Dict[str, object]]:
    """For ``op`` (default: every op in :data:`PREFERENCES`) on ``device``:
    ``{op: {"backend": chosen, "why": reason, "order": default order, "unavailable": {backend: reason}}}``.
    Per-call rules (``rows_linear``'s rows and dtype, ``select_subtree``'s options) are evaluated at the
    row's ``example`` context updated with ``context`` (e.g. ``explain("select_subtree", max_leaves=64)``),
    shown as ``"context"``."""
    _ensure_registered()
    device = torch.device(device)
    ops = [op] if op is not None else list(PREFERENCES)
    out: Dict[str, Dict[str, object]] = {}
    for name in ops:
        if name not in PREFERENCES and not any(o == name for (o, _) in _IMPLS):
            raise ValueError(f"op: expected one of {sorted(PREFERENCES)}, received {name!r}")
        pref = PREFERENCES.get(name)
        call = {**(pref.example if pref else {}), **context}
        chosen, why = _choose(name, device, call)
        entry: Dict[str, object] = {
            "backend": chosen, "why": why, "order": list(preferred_backends(name, device, **call)),
            "unavailable": {b: r for b in BACKENDS if (r := unavailable_reason(b, device, name, **call))},
        }
        if call:
            entry["context"] = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
                                for k, v in call.items()}
        out[name] = entry
    return out


def explain(op: Optional[str] = None, device="cpu", **context) -> str:
    """Human-readable :func:`explain_dict` (same arguments): one line per op with its backend and why, then
    each backend that cannot run it and why."""
    device = torch.device(device)
    lines = [f"taps_kernels backends on {device}"
             + ("" if device.type != "cuda" or torch.cuda.is_available() else " (no CUDA device visible here)")
             + (f"; TAPS_BACKEND={os.environ['TAPS_BACKEND']}" if os.environ.get("TAPS_BACKEND") else "") + ":"]
    for name, entry in explain_dict(op, device, **context).items():
        ctx = entry.get("context")
        at = f" (at {', '.join(f'{k}={v}' for k, v in ctx.items())})" if ctx else ""
        lines.append(f"  {name}: {entry['backend']}{at} - {entry['why']}")
        for b, reason in entry["unavailable"].items():
            lines.append(f"      {b}: unavailable - {reason}")
    if op is None and device.type == "cpu":
        path, why = gguf_linear_backend()
        lines.append(f"  gguf_linear (GGUF target format): {path} - {why}")
        if path != "unavailable":
            lines.append("      gguf-a16 format: the same kernels over twice the rows (each activation's int8 code "
                         "and its residual's), the two results added in float32")
    return "\n".join(lines)


_REGISTERED = False


def _ensure_registered():
    # Implementation modules register themselves on import; import them lazily so that
    # a missing optional dependency (triton) only disables its own backend.
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    importlib.import_module("taps_kernels.impls")


def warn_if_cpp_missing() -> None:
    mod, why = load_extension("_C")
    if mod is None:
        warnings.warn(f"taps_kernels: C++ extension unavailable, CPU ops fall back to the PyTorch references: {why}",
                      RuntimeWarning, stacklevel=3)
