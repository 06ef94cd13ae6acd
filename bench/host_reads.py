"""Counting what a decode round reads back to the host, for the benchmarks.

Two counters, two notions:

* :class:`HostReadCounter` counts Python-level reads of tensor values (``item``, ``tolist``, ``cpu``,
  ``numpy``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``, and ``to`` towards the CPU from
  another device or with an explicit ``"cpu"``) while :attr:`active`, by wrapping those methods of
  ``torch.Tensor``. Reads made inside the Triton interpreter (a CPU emulation of the device) and inside
  taps_kernels' value validation (functions named ``check_*``, ``_check*``, ``validate*``; off by default
  on GPUs) are not counted. It works on every device.
* :class:`CudaSyncCounter` counts the synchronising CUDA operations PyTorch itself reports in its sync
  debug mode (``torch.cuda.set_sync_debug_mode("warn")``): device-to-host copies, but also uploads from
  pageable host memory and explicit synchronisations. CUDA only; a broader count than the first.

Neither is timed: wrapping tensor methods costs Python time, so counting runs apart from timing.
"""
from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from typing import Callable, Dict, List

import torch

READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "to")


def _excluded(frame: traceback.FrameSummary) -> bool:
    path = frame.filename.replace(os.sep, "/")
    if "/triton/" in path and "interpreter" in path:
        return True
    return "/taps_kernels/" in path and frame.name.startswith(("check_", "_check", "validate"))


def _reads_to_host(name: str, tensor: torch.Tensor, args, kwargs) -> bool:
    if name != "to":
        return True
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, str):
        try:
            return torch.device(target).type == "cpu"
        except RuntimeError:  # a dtype name such as "float" is not a device
            return False
    if isinstance(target, torch.device):
        return target.type == "cpu" and tensor.device.type != "cpu"
    return False


class HostReadCounter:
    """``with HostReadCounter() as c:`` installs the wrappers; reads count only while ``c.active``.

    ``count`` is the number of reads, ``where`` one ``"method at file:line"`` entry per read (the innermost
    frame that is not this module's).
    """

    def __init__(self):
        self.active = False
        self.count = 0
        self.where: List[str] = []
        self._saved: Dict[str, Callable] = {}

    def _wrap(self, name: str, fn: Callable) -> Callable:
        counter = self

        def wrapper(t, *args, **kwargs):
            if counter.active and _reads_to_host(name, t, args, kwargs):
                counter.active = False  # reads made while serving this read are not separate reads
                try:
                    stack = traceback.extract_stack()[:-1]
                    if not any(_excluded(f) for f in stack):
                        counter.count += 1
                        counter.where.append(f"{name} at {_short(stack[-1].filename)}:{stack[-1].lineno}")
                    return fn(t, *args, **kwargs)
                finally:
                    counter.active = True
            return fn(t, *args, **kwargs)

        return wrapper

    def __enter__(self) -> "HostReadCounter":
        for name in READ_METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> bool:
        self.active = False
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        self._saved.clear()
        return False

    @contextlib.contextmanager
    def counting(self):
        """Count inside the block; yields a list that holds, after the block, one entry per read in it."""
        found: List[str] = []
        start = len(self.where)
        self.active = True
        try:
            yield found
        finally:
            self.active = False
            found.extend(self.where[start:])


class CudaSyncCounter:
    """Counts PyTorch's sync-debug warnings while :meth:`counting`; ``available`` is False off CUDA or when
    this PyTorch has no sync debug mode (then every count stays None)."""

    MESSAGE = "synchroniz"  # "called a synchronizing CUDA operation"

    def __init__(self, device: torch.device):
        self.available = torch.device(device).type == "cuda" and hasattr(torch.cuda, "set_sync_debug_mode")

    @contextlib.contextmanager
    def counting(self):
        """Yields a list that holds, after the block, one ``"file:line"`` entry per synchronising operation."""
        found: List[str] = []
        if not self.available:
            yield found
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found.extend(f"{_short(w.filename)}:{w.lineno}" for w in caught if self.MESSAGE in str(w.message))


def _short(path: str) -> str:
    """``path`` from its package directory on (``taps/decode/loop.py``): no machine paths in records."""
    p = path.replace(os.sep, "/")
    for marker in ("/taps_kernels/", "/taps/", "/bench/", "/torch/", "/transformers/", "/triton/"):
        i = p.rfind(marker)
        if i >= 0:
            return p[i + 1:]
    return os.path.basename(p)
