"""The ``taps::`` operator namespace: every tree op is one ``torch.library`` op, defined beside its public function.

Each public op in :mod:`taps_kernels.ops` checks its arguments (metadata always; values as its ``validate=``
says) and calls its ``torch.ops.taps.*`` op, which picks the backend (:func:`taps_kernels.backend.resolve`)
and runs it. The same op is what ``torch.compile(fullgraph=True)`` graphs and CUDA-graph captures record: its
fake (meta) implementation checks the metadata and computes output shapes without data. One path per op:

    public op (checks) -> torch.ops.taps.<op> (backend choice) -> backend kernel (C++ / CUDA / Triton / torch)

(in eager mode on plain CPU tensors the public op calls the op's kernel itself: :class:`TapsOp`).

The ops are defined with :class:`torch.library.Library` rather than ``torch.library.custom_op``: the same
registration (schema, kernel, fake), without the Python wrapper layer that costs ~8 us per call on this
project's CPU (a decode round calls about ten of these ops).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from ._checks import values_checked
from .backend import resolve

LIB = torch.library.Library("taps", "DEF")


class TapsOp:
    """A ``taps::`` op as the public functions call it: the registered ``torch.ops.taps`` op, except in eager
    mode on plain CPU tensors, where the same kernel is called without the dispatcher's round trip (C++
    dispatcher -> Python kernel). That trip cost ~20 us per call warm and ~250 us in a decode round, where the
    target's forward has just evicted the interpreter's caches (measured on this project's CPU; a round calls
    about ten ops). Compiled graphs, fake tensors, dispatch modes and CUDA tensors always go through the op."""

    def __init__(self, op, kernel: Callable):
        self.op = op
        self.kernel = kernel

    def __call__(self, *args, **kwargs):
        return self.kernel(*args, **kwargs) if _plain_cpu_eager(args, kwargs) else self.op(*args, **kwargs)


def _plain_cpu_eager(args: Sequence, kwargs: dict) -> bool:
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    for a in (*args, *kwargs.values()):
        t = a[0] if isinstance(a, (list, tuple)) and a else a  # a list's tensors share a device (the ops check it)
        if isinstance(t, torch.Tensor) and (type(t) is not torch.Tensor or t.device.type != "cpu"):
            return False
    return True


def define(schema: str, kernel: Callable, fake: Callable) -> TapsOp:
    """Define ``taps::<schema>`` with ``kernel`` for every device and ``fake`` for tracing; return the op."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"taps::{name}", fake, lib=LIB)
    return TapsOp(getattr(torch.ops.taps, name), kernel)


def fresh(outputs: Sequence[torch.Tensor], inputs: Sequence[Optional[torch.Tensor]],
          backend: Optional[str] = None) -> Tuple[torch.Tensor, ...]:
    """An op's outputs may alias neither its inputs nor each other (functionalisation relies on it); copy any that
    does (a reference may return a view of its input when nothing changes). ``backend="cpp"``: returned as they
    are (the C++ entry points allocate every output)."""
    if backend == "cpp":
        return tuple(outputs)
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if ptr is not None:
            seen.add(ptr)
        out.append(t)
    return tuple(out)


def values_asked(validate: Optional[str], first) -> bool:
    """Whether a kernel call runs its value checks (``validate`` for ``first``'s device; see :mod:`._checks`)."""
    return isinstance(first, torch.Tensor) and values_checked(validate, first.device)


def backend_for(op: str, backend: Optional[str], first, meta: Callable, args: Sequence, always_meta: bool = False,
                **context):
    """``(name, implementation)`` of ``op`` for a kernel call, with ``meta(*args)`` (the op's metadata checks) run
    before it is called.

    The C++ entry points check the same metadata themselves (``csrc/bindings.cpp``, ``csrc/torch_checks.h``), so on
    the ``cpp`` backend the Python checks are skipped unless ``always_meta`` (value checks follow, which index the
    tensors): they cost more than the C++ tree kernels themselves (~10 us per call). ``first`` is the tensor whose
    device picks the backend."""
    if always_meta or not isinstance(first, torch.Tensor):
        meta(*args)  # a non-tensor raises the named error here
        always_meta = True
    name, fn = resolve(op, backend, first.device, **context)
    if name != "cpp" and not always_meta:
        meta(*args)
    return name, fn
