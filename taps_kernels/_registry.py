"""The table of registered implementations, ``(op, backend) -> callable``, and the decorator that fills it.

Kept apart from :mod:`taps_kernels.backend` (which decides) so that the modules registering implementations
need not import the module that decides, and the decider imports them only when first asked.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

BACKENDS = ("reference", "cpp", "triton", "cuda")

IMPLS: Dict[Tuple[str, str], Callable] = {}
"""``(op, backend) -> implementation``."""
SUPPORTS: Dict[Tuple[str, str], Callable[..., str]] = {}
"""``(op, backend) -> supports(**call context)``: empty string when that call fits the implementation, else why
not (e.g. the Triton pool's register-resident frontier caps ``pool_size``)."""


def register(op: str, backend: str, supports: Optional[Callable[..., str]] = None,
             table: Optional[Dict[Tuple[str, str], Callable]] = None):
    """Decorator: register ``fn`` as the ``backend`` implementation of ``op`` (in ``table``, default ``IMPLS``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, received {backend!r}")

    def deco(fn):
        (IMPLS if table is None else table)[(op, backend)] = fn
        if supports is not None:
            SUPPORTS[(op, backend)] = supports
        return fn

    return deco
