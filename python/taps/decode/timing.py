"""Stage timers of a round that are right on every device.

On a CPU every op has finished when Python moves on, so ``time.perf_counter`` around a stage is its time.
On a GPU ops are queued asynchronously: perf_counter would time the queueing. :class:`StageTimer` records
a CUDA event at each stage boundary instead and converts them to seconds only after the round's one host
read (which waits for the whole round, so every event has completed: reading them needs no extra
synchronisation). ``profile=True`` additionally synchronises at every boundary, so that each stage runs
alone (no overlap with the host's queueing of the next one) at the cost of the pipelining.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch


class StageTimer:
    """``with timer("verify"): ...`` per stage; :meth:`seconds` after the round's read.

    Args:
        device: the round's device (CUDA: events; anything else: perf_counter).
        profile: synchronise the device at every stage boundary (CUDA only; a profiling aid).
    """

    def __init__(self, device: Optional[torch.device] = None, profile: bool = False):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.device = torch.device(device) if device is not None else None
        self.profile = bool(profile)
        self.times: Dict[str, float] = {}
        self._events: List[Tuple[str, "torch.cuda.Event", "torch.cuda.Event"]] = []
        self._stack: List[Tuple[str, object]] = []

    def __call__(self, name: str) -> "_Stage":
        return _Stage(self, name)

    def _begin(self, name: str):
        if self.cuda:
            if self.profile:
                torch.cuda.synchronize(self.device)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _end(self, name: str, start) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            if self.profile:
                torch.cuda.synchronize(self.device)
            self._events.append((name, start, ev))
        else:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Add host seconds measured elsewhere (a C++ call that times its own stages; CPU rounds only)."""
        self.times[name] = self.times.get(name, 0.0) + seconds

    def seconds(self) -> Dict[str, float]:
        """Seconds per stage. On CUDA call it after the round's read (or a synchronisation): it resolves
        the events once."""
        for name, a, b in self._events:
            self.times[name] = self.times.get(name, 0.0) + a.elapsed_time(b) / 1000.0
        self._events.clear()
        return dict(self.times)


class _Stage:
    def __init__(self, timer: StageTimer, name: str):
        self.timer, self.name, self.start = timer, name, None

    def __enter__(self):
        self.start = self.timer._begin(self.name)
        return self

    def __exit__(self, *exc):
        self.timer._end(self.name, self.start)
        return False


class RoundClock:
    """Whole-round time without perturbing the round: perf_counter on CPU; on CUDA two events whose
    difference is read after the round's read."""

    def __init__(self, device: Optional[torch.device] = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self._start = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self):
        """Returns a handle for :meth:`seconds` (record the end now, resolve later)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return (self._start, end)
        return time.perf_counter() - self._start

    @staticmethod
    def seconds(handle) -> float:
        if isinstance(handle, tuple):
            return handle[0].elapsed_time(handle[1]) / 1000.0
        return float(handle)
