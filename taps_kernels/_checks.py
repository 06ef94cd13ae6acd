"""Argument checks shared by every public op: each error names the argument, the expectation and what arrived.

Two kinds of check, with different costs on a GPU:

* METADATA checks (type, dtype, rank, shape, device, strides, storage overlap, ``requires_grad``, Python
  scalars) read no tensor data: they always run, on every device.
* VALUE checks (tree structure, token and index ranges, prefix bounds, non-finite scans) read tensor data.
  On CPU tensors that is cheap, so they run by default; on CUDA tensors they would copy to the host and
  synchronise the stream on the decode hot path, so they run only when asked. :func:`values_checked`
  decides, from the op's ``validate=`` argument or the ``TAPS_VALIDATE`` environment variable:

  ==========  ====================================================================================
  ``auto``    (default) value checks on CPU tensors only; on CUDA the kernels clamp what they index
  ``full``    value checks on every device (debugging a GPU run; each op then synchronises)
  ``none``    no value checks anywhere (inputs trusted; out-of-contract values give unspecified,
              but memory-safe, results)
  ==========  ====================================================================================

Index arithmetic is done in Python ints or int64 tensors with comparisons that cannot overflow
(``path <= L - 1 - prefix`` rather than ``prefix + path < L``).
"""
from __future__ import annotations

import functools
import math
import operator
import os
from typing import Iterable, Optional, Sequence, Tuple

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT64_MAX = 2 ** 63 - 1
MAX_COUNT = 2 ** 31 - 2
"""Largest node count, budget or path length: node indices are int32 in the tree layout."""
VALIDATE_MODES = ("auto", "full", "none")
DATA_DEVICES = ("cpu", "cuda")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- validation mode -----------------------------------------------------------------------------------------------

def validate_mode(validate: Optional[str] = None) -> str:
    """``validate`` as given, or ``TAPS_VALIDATE`` when it is None (default ``"auto"``); checked against the modes."""
    if validate is None:
        env = os.environ.get("TAPS_VALIDATE", "auto") or "auto"
        if env not in VALIDATE_MODES:
            raise ValueError(f"TAPS_VALIDATE: expected one of {VALIDATE_MODES}, received {env!r}")
        return env
    if not isinstance(validate, str) or validate not in VALIDATE_MODES:
        raise ValueError(f"validate: expected one of {VALIDATE_MODES} or None, received {validate!r}")
    return validate


def values_by_default(device: torch.device) -> bool:
    """Whether ``"auto"`` reads tensor values on ``device``: only where that needs no device synchronisation."""
    return device.type == "cpu"


def values_checked(validate: Optional[str], device: torch.device) -> bool:
    """Whether the value checks run for tensors on ``device`` under ``validate`` (see the module docstring)."""
    mode = validate_mode(validate)
    if device.type not in DATA_DEVICES or torch.compiler.is_compiling():
        return False  # meta tensors, or fake ones inside torch.compile: no data to read
    return mode == "full" or (mode == "auto" and values_by_default(device))


# --- tensors: metadata -------------------------------------------------------------------------------------------

def check_tensor(name: str, value, dtypes: Optional[Sequence[torch.dtype]] = None, ndim: Optional[int] = None,
                 shape: Optional[Sequence[Optional[int]]] = None, device: Optional[torch.device] = None) -> torch.Tensor:
    """Return ``value`` if it is a tensor of the expected dtype/rank/shape/device; raise TypeError/ValueError otherwise.

    ``shape`` entries that are ``None`` match any size.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, received {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        want = " or ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, received {_dtype_name(value.dtype)}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, received shape {tuple(value.shape)}")
    if shape is not None:
        for want, got in zip(shape, value.shape):
            if want is not None and want != got:
                pretty = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
                raise ValueError(f"{name}: expected shape {pretty}, received {tuple(value.shape)}")
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device}, received one on {value.device}")
    return value


def check_data_device(name: str, value: torch.Tensor) -> torch.device:
    """The ops compute on tensors that hold data: CPU or CUDA. Meta tensors are for tracing the custom ops."""
    if value.device.type not in DATA_DEVICES:
        raise ValueError(f"{name}: expected a tensor on cpu or cuda, received one on {value.device} (meta tensors hold "
                         f"no data: trace the torch.ops.taps.* ops instead)")
    return value.device


def check_nonempty(name: str, value: torch.Tensor, dims: Sequence[Tuple[int, str]]) -> None:
    """Each ``(dim, what)`` of ``value`` must be >= 1: empty batches, positions or nodes are rejected by the op."""
    for dim, what in dims:
        if value.shape[dim] < 1:
            raise ValueError(f"{name}: expected at least one {what} (dimension {dim} >= 1), received shape "
                             f"{tuple(value.shape)}")


def storage_span(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(first byte address, one past the last byte address)`` of the elements ``t`` can reach; None if empty.

    Absolute addresses: two tensors over the same memory overlap whichever storage objects they came from.
    """
    if t.numel() == 0:
        return None
    if t.is_contiguous():  # the common case, without a Python loop over the dims
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (extent + 1) * t.element_size()


def has_internal_overlap(t: torch.Tensor) -> bool:
    """True when two indices of ``t`` may share memory (a stride-0 broadcast, or strides that interleave).

    Conservative: dims sorted by stride must each step past everything the smaller ones reach.
    """
    if t.is_contiguous():
        return False
    reach = 0
    for st, s in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if st <= reach:
            return True
        reach += (s - 1) * st
    return False


def check_writable_disjoint(named: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Tensors an op writes in place: none may overlap itself, nor another one's storage span.

    Spans (first to last reachable byte) are compared, so two interleaved views of one buffer are refused
    even where their elements would not collide: allocate each cache tensor separately. Skipped while tracing
    (fake tensors have no addresses); the op's kernel checks again when the graph runs.
    """
    if torch.compiler.is_compiling():
        return
    spans = []
    for i, (name, t) in enumerate(named):
        if has_internal_overlap(t):
            raise ValueError(f"{name}: a tensor written in place must not overlap itself, received shape "
                             f"{tuple(t.shape)} with strides {t.stride()} (a stride-0 broadcast or interleaved "
                             f"strides); pass a tensor with its own memory (e.g. .contiguous())")
        span = storage_span(t)
        if span is not None:
            spans.append((span, i))
    # sorted by start, a span overlaps an earlier one iff it starts before the furthest end so far (n log n:
    # a 30-layer cache is 60 tensors, checked on every compaction)
    spans.sort()
    furthest = None
    for span, i in spans:
        if furthest is not None and span[0] < furthest[0][1]:
            other, j = furthest
            first, second = sorted((j, i))
            a, b = (other, span) if j == first else (span, other)
            if span == other:
                raise ValueError(f"{named[first][0]} and {named[second][0]}: the same tensor appears more than once; "
                                 f"list each cache tensor once")
            raise ValueError(f"{named[first][0]} and {named[second][0]}: their memory overlaps (byte spans "
                             f"[{a[0]:#x}, {a[1]:#x}) and [{b[0]:#x}, {b[1]:#x})); every cache tensor must have its "
                             f"own memory")
        if furthest is None or span[1] > furthest[0][1]:
            furthest = (span, i)


def grad_needed(tensors: Iterable[Optional[torch.Tensor]]) -> Optional[int]:
    """Index of the first tensor that requires grad while grad mode is on, else None (metadata only)."""
    if not torch.is_grad_enabled():
        return None
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return i
    return None


def differentiable_backend(op: str, backend: Optional[str], named: Sequence[Tuple[str, Optional[torch.Tensor]]]):
    """Backend for an op whose only backward is its PyTorch reference.

    When an input requires grad (grad mode on), ``backend=None`` picks ``"reference"`` and an explicit other
    backend is refused: its outputs would silently carry no gradient.
    """
    i = grad_needed(t for _, t in named)
    if i is None:
        return backend
    if backend is None:
        return "reference"
    if backend != "reference":
        raise ValueError(f"{named[i][0]}: requires grad, but the {backend!r} backend of {op} has no backward; use "
                         f"backend='reference' (or None), or pass a detached tensor / run under torch.no_grad()")
    return backend


def check_no_grad(op: str, named: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> None:
    """For ops without any backward whose float outputs would silently drop the gradient."""
    i = grad_needed(t for _, t in named)
    if i is not None:
        raise ValueError(f"{named[i][0]}: requires grad, but {op} has no backward (its outputs carry no gradient); "
                         f"pass {named[i][0]}.detach() or run under torch.no_grad()")


def check_not_grad_tracked(named: Sequence[Tuple[str, torch.Tensor]], op: str) -> None:
    """In-place ops write without autograd: refuse tensors that require grad while grad mode is on."""
    i = grad_needed(t for _, t in named)
    if i is not None:
        raise ValueError(f"{named[i][0]}: requires grad, but {op} writes it in place without autograd; detach it or "
                         f"run under torch.no_grad()")


# --- Python scalars ------------------------------------------------------------------------------------------------

def check_int(name: str, value, minimum: int = 1, maximum: Optional[int] = MAX_COUNT) -> int:
    """An integer argument: Python, numpy or one-element integer torch values (``operator.index``); bools refused."""
    is_bool = isinstance(value, bool) or type(value).__name__ == "bool_" or (
        isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    try:
        if is_bool:
            raise TypeError
        v = operator.index(value)
    except TypeError:
        shown = f"{type(value).__name__} {value!r}" if isinstance(value, (float, str, bool)) else type(value).__name__
        raise TypeError(f"{name}: expected an int, received {shown}") from None
    hi = "" if maximum is None else (f", 2**31 - {2 ** 31 - maximum}" if 2 ** 30 < maximum < 2 ** 31 else f", {maximum}")
    if v < minimum or (maximum is not None and v > maximum):
        want = f"an int in [{minimum}{hi}]" if maximum is not None else f"an int >= {minimum}"
        raise ValueError(f"{name}: expected {want}, received {v}")
    return v


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    return check_int(name, value, minimum=minimum)


def check_float(name: str, value, finite: bool = True, above: Optional[float] = None,
                at_least: Optional[float] = None, allow_nan: bool = False) -> float:
    """A real-number argument (Python, numpy or one-element torch values); NaN refused unless ``allow_nan``."""
    if isinstance(value, (bool, str, complex)) or type(value).__name__ == "bool_":
        raise TypeError(f"{name}: expected a float, received {type(value).__name__} {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name}: expected a float, received {type(value).__name__}") from None
    if math.isnan(v) and not allow_nan:
        raise ValueError(f"{name}: expected a number, received nan")
    if finite and math.isinf(v):
        raise ValueError(f"{name}: expected a finite float, received {v}")
    if above is not None and not v > above:
        raise ValueError(f"{name}: expected a float > {above}, received {v}")
    if at_least is not None and not v >= at_least:
        raise ValueError(f"{name}: expected a float >= {at_least}, received {v}")
    return v


@functools.lru_cache(maxsize=None)
def _memory_limit(device: torch.device) -> int:
    """Total memory of the device (fixed for the process: probed once per device)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def check_output_size(name: str, value: int, nbytes: int, device: torch.device) -> None:
    """Refuse, naming the argument, a size whose outputs could never fit in the device's memory (eager only: a
    compiled graph's sizes were checked when it was traced eagerly, and the memory probe is not traceable)."""
    if device.type not in DATA_DEVICES or torch.compiler.is_compiling():
        return
    limit = _memory_limit(device)
    if nbytes > limit:
        raise ValueError(f"{name}: {value} would need {_bytes(nbytes)} of outputs, more than the {_bytes(limit)} of "
                         f"memory on {device}")


# --- tensors: values (call only when values_checked(...)) -----------------------------------------------------------

def first_index(mask: torch.Tensor) -> Tuple[int, ...]:
    """Indices of the first True entry of ``mask`` (row-major), as Python ints."""
    return tuple(int(x) for x in mask.nonzero()[0])


def _at(idx: Tuple[int, ...]) -> str:
    return "[" + ",".join(str(i) for i in idx) + "]"


def check_nonnegative(name: str, values: Optional[torch.Tensor]) -> None:
    """Value check of counts or lengths (``None`` passes): every entry ``>= 0``, else the first bad one is named."""
    if values is not None and bool((values < 0).any()):
        idx = first_index(values < 0)
        raise ValueError(f"{name}{_at(idx)}: expected a value >= 0, received {int(values[idx])}")


def check_prefix_lens(prefix_lens, B: int, device, check_values: bool = True,
                      upper: Optional[Tuple[int, str]] = None) -> torch.Tensor:
    """``prefix_lens [B]`` int64/int32 on ``device``; returned as int64.

    Values (when ``check_values``): ``>= 0`` and, with ``upper=(bound, what)``, ``<= bound``.
    """
    check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64, torch.int32), shape=(B,), device=device)
    prefix_lens = prefix_lens.long()
    if check_values and B > 0:
        bad = prefix_lens < 0
        if upper is not None:
            bad = bad | (prefix_lens > upper[0])
        if bool(bad.any()):
            (b,) = first_index(bad)
            want = ">= 0" if upper is None else f"0 <= prefix_len <= {upper[1]} = {upper[0]}"
            raise ValueError(f"prefix_lens[{b}]: expected {want}, received {int(prefix_lens[b])}")
    return prefix_lens


def check_finite_logits(name: str, logits: torch.Tensor) -> None:
    """``[..., V]`` logits: NaN and +inf refused, -inf allowed (an impossible token) unless a whole row is -inf."""
    if logits.numel() == 0:
        return
    # max propagates NaN and +inf and is -inf only for an all -inf row: one pass, one host read.
    top = logits.amax(-1)
    if bool(torch.isfinite(top).all()):
        return
    if bool(logits.isnan().any()):
        idx = first_index(logits.isnan())
        raise ValueError(f"{name}{_at(idx)}: NaN logit; expected finite logits or -inf (an impossible token)")
    if bool(torch.isposinf(logits).any()):
        idx = first_index(torch.isposinf(logits))
        raise ValueError(f"{name}{_at(idx)}: +inf logit; expected finite logits or -inf (an impossible token)")
    idx = first_index(torch.isneginf(top))
    raise ValueError(f"{name}{_at(idx)}: every logit of this position is -inf; expected at least one possible token")


def check_log_values(name: str, values: torch.Tensor, what: str = "log-probability") -> None:
    """Log-probabilities: -inf allowed (unreachable / impossible), NaN and +inf refused."""
    if values.numel() == 0:
        return
    top = values.max()  # NaN and +inf both surface here
    if bool(top < math.inf):
        return
    bad = values.isnan() | torch.isposinf(values)
    idx = first_index(bad)
    raise ValueError(f"{name}{_at(idx)}: expected a {what} (finite or -inf), received {float(values[idx])}")


FEATURE_LIMIT = 1e15
"""Largest magnitude of a scorer input feature: the float32 LayerNorm squares and sums ~100 of them."""


def check_feature_values(name: str, values: torch.Tensor) -> None:
    """Scorer inputs: finite, with magnitude at most :data:`FEATURE_LIMIT`."""
    if values.numel() == 0:
        return
    bad = ~(values.abs() <= FEATURE_LIMIT)  # also NaN
    if bool(bad.any()):
        idx = first_index(bad)
        raise ValueError(f"{name}{_at(idx)}: expected a finite scorer feature within +-{FEATURE_LIMIT:g}, received "
                         f"{float(values[idx])}")


def check_no_nan(name: str, values: torch.Tensor) -> None:
    if values.numel() == 0:
        return
    if bool(values.isnan().any()):
        idx = first_index(values.isnan())
        raise ValueError(f"{name}{_at(idx)}: expected a number, received nan")


def check_tree_tensors(tokens: Optional[torch.Tensor], parents: torch.Tensor, depth: Optional[torch.Tensor],
                       num_nodes: torch.Tensor) -> Tuple[int, int]:
    """Metadata of a tree passed as raw tensors (the ``torch.ops.taps`` ops' arguments); -> ``(B, N)``, ``N >= 1``.

    ``tokens [B,N] int64`` and ``depth [B,N] int32`` are checked when given (an op that reads neither passes
    None); ``parents [B,N] int32``, ``num_nodes [B] int32``."""
    check_tensor("parents", parents, dtypes=(torch.int32,), ndim=2)
    B, N = parents.shape
    if N < 1:
        raise ValueError(f"parents: expected at least one node (the root), received shape {(B, N)}")
    if tokens is not None:
        check_tensor("tokens", tokens, dtypes=(torch.int64,), shape=(B, N), device=parents.device)
    if depth is not None:
        check_tensor("depth", depth, dtypes=(torch.int32,), shape=(B, N), device=parents.device)
    check_tensor("num_nodes", num_nodes, dtypes=(torch.int32,), shape=(B,), device=parents.device)
    return B, N
