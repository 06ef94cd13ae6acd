"""The one place that decides which implementation of an op runs, and says why when it cannot.

Backends:

* ``"reference"``: plain PyTorch (``taps_kernels.reference``); always available; the spec.
* ``"cpp"``: the C++ extension ``taps_kernels._C``; CPU tensors only.
* ``"triton"``: Triton kernels; CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1``
  was set before ``taps_kernels`` was imported (the interpreter: slow, for tests).
* ``"cuda"``: the CUDA extension ``taps_kernels._C_cuda``; CUDA tensors only.

Default choice (``backend=None``), per op, from the tensors' device:
CUDA -> the op's GPU preference order (Triton for the fused math, CUDA for the
bookkeeping walks), CPU -> ``cpp`` then ``reference``. The interpreter is never a
default: it is orders of magnitude slower than the reference. ``TAPS_BACKEND``
(environment) replaces the default for every op that has that backend.
"""
from __future__ import annotations

import importlib
import os
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

BACKENDS = ("reference", "cpp", "triton", "cuda")


class BackendUnavailable(RuntimeError):
    """Raised when an explicitly requested backend cannot run an op; the message says why."""


_IMPLS: Dict[Tuple[str, str], Callable] = {}
_GPU_ORDER: Dict[str, Tuple[str, ...]] = {}
_CPU_ORDER = ("cpp", "reference")


def register(op: str, backend: str, gpu_order: Optional[Tuple[str, ...]] = None):
    """Decorator: register ``fn`` as the ``backend`` implementation of ``op``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, received {backend!r}")

    def deco(fn):
        _IMPLS[(op, backend)] = fn
        if gpu_order is not None:
            _GPU_ORDER[op] = gpu_order
        return fn

    return deco


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


def unavailable_reason(backend: str, device: torch.device, op: Optional[str] = None) -> str:
    """Empty string when ``backend`` can run ``op`` on ``device``; otherwise why not."""
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; expected one of {BACKENDS}"
    if op is not None and (op, backend) not in _IMPLS:
        have = sorted(b for (o, b) in _IMPLS if o == op)
        return f"op {op!r} has no {backend!r} implementation (available: {have})"
    if backend == "reference":
        return ""
    if backend == "cpp":
        if device.type != "cpu":
            return f"the C++ backend runs on CPU tensors, received tensors on {device}"
        return load_extension("_C")[1]
    if backend == "cuda":
        if device.type != "cuda":
            return f"the CUDA backend runs on CUDA tensors, received tensors on {device}"
        return load_extension("_C_cuda")[1]
    return _triton_reason(device)


def has_impl(op: str, backend: str) -> bool:
    """Whether ``backend`` registered an implementation of ``op`` (available or not on this machine)."""
    _ensure_registered()
    return (op, backend) in _IMPLS


def resolve(op: str, backend: Optional[str], device: torch.device) -> Tuple[str, Callable]:
    """Pick the implementation of ``op`` for tensors on ``device``; return ``(backend name, callable)``."""
    _ensure_registered()
    if backend is None:
        env = os.environ.get("TAPS_BACKEND")
        if env and (op, env) in _IMPLS and not unavailable_reason(env, device, op):
            return env, _IMPLS[(op, env)]
        order = _GPU_ORDER.get(op, ("triton", "cuda")) + ("reference",) if device.type == "cuda" else _CPU_ORDER
        for name in order:
            if (op, name) in _IMPLS and not unavailable_reason(name, device, op):
                return name, _IMPLS[(op, name)]
        return "reference", _IMPLS[(op, "reference")]
    why = unavailable_reason(backend, device, op)
    if why:
        raise BackendUnavailable(f"backend={backend!r} cannot run {op}: {why}")
    return backend, _IMPLS[(op, backend)]


# Few-row linear layers (taps_kernels.rows_linear). Measured on the 2-core AVX-512 CPU of this project
# (bench/results/rows_linear_cpu.json, 1 thread): torch's linear runs BLAS sgemm, which from 2 rows on costs
# about twice its 1-row sgemv although both only stream the weights (SmolLM2's LM head: 11.5 ms at 1 row,
# 20-26 ms at 2-16); the C++ kernel streams each weight row once for all rows (8.7 ms at 1 row, 10-13 at
# 2-8, 17 at 16), so a whole SmolLM2 forward over 4-8 new rows takes 81 ms instead of 105-114 (75 at 1 row).
# At 32 rows it is still ~10% ahead; at 64 even, and prefill sizes are BLAS's. Without AVX-512 the C++
# kernel is plain loops, slower than BLAS; on GPUs cuBLAS.
ROWS_LINEAR_MAX_ROWS = 32


def rows_linear_backend(rows: int, device: torch.device, dtype: torch.dtype) -> str:
    """Default backend of ``rows_linear`` for ``rows`` rows of ``dtype`` on ``device`` (reasons above;
    ``TAPS_BACKEND`` overrides it as for every op)."""
    env = os.environ.get("TAPS_BACKEND")
    if env in ("reference", "cpp") and not unavailable_reason(env, device):
        return env
    if device.type != "cpu" or dtype != torch.float32 or not 1 <= rows <= ROWS_LINEAR_MAX_ROWS:
        return "reference"
    mod, _ = load_extension("_C")
    return "cpp" if mod is not None and mod.rows_linear_vectorized() else "reference"


def available_backends(op: str, device: torch.device) -> Dict[str, str]:
    """``{backend: reason}`` for every backend; an empty reason means available."""
    _ensure_registered()
    return {b: unavailable_reason(b, device, op) for b in BACKENDS}


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
