"""One host read per round on the kernel path.

A round of the batched decoder (verify through ``taps_tree`` / ``tree_attention``, acceptance, compaction,
the drafter's context update, the next draft and trees) must read tensor values back to the host exactly
once: the packed result at its end. This test runs every op that has a Triton implementation through it
(``TAPS_BACKEND=triton``, CPU tensors under ``TRITON_INTERPRET=1``, set by conftest), switches the ops' value
validation off (``TAPS_VALIDATE=none``: on a GPU it is off by default, and it is not part of the loop), and
counts every Python-level read of a tensor during ``step()``: ``item``, ``tolist``, ``cpu``, ``numpy``,
``__bool__``, ``__int__``, ``__float__``, ``__index__``, and ``to`` towards the CPU (a tensor on another device,
or an explicit ``"cpu"``: ``x.to(y.device)`` with ``y`` on the CPU moves nothing). Not counted:

* reads made by the Triton interpreter itself: on CPU it emulates the device by reading tensors into numpy,
  which a GPU does on the device;
* reads made by taps_kernels' value validation (functions named ``check_*``, ``_check*`` or ``validate*``):
  on a GPU they are skipped by default (``taps_kernels._checks.values_checked``). ``TAPS_VALIDATE=none``
  turns off those of the public ops; the ``taps::`` custom ops still check values on CPU tensors, so those
  reads are recognised by their frames.

A second case injects one extra ``.item()`` into the round (through the loop's ``round_hook`` seam) and
checks that the counter sees it, so the first case cannot pass by counting nothing.
"""
import os
import traceback

import pytest
import torch

import taps_kernels
import taps_kernels.ops.pool
import taps_kernels.ops.score
import taps_kernels.ops.select
from helpers import random_scorer, tiny_drafter, tiny_target
from taps_kernels import backend
from taps.decode import BatchDecoder, make_policy
from taps.decode.policies.lookup import taps_lookup_policy
from taps.decode.policies.taps import taps_policy

V, HID = 61, 32
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class ReadCounter:
    """Counts tensor reads while ``active``; ``where`` keeps the innermost non-test frame of each."""

    def __init__(self):
        self.active = False
        self.count = 0
        self.where = []

    def wrap(self, name, fn):
        counter = self

        def wrapper(t, *args, **kwargs):
            if counter.active and counter._counts(name, args, kwargs, t):
                counter.active = False  # reads made inside this read are not separate reads
                try:
                    stack = traceback.extract_stack()[:-1]
                    if not any(_excluded(f) for f in stack):
                        counter.count += 1
                        counter.where.append(f"{name} at {stack[-1].filename}:{stack[-1].lineno}")
                    return fn(t, *args, **kwargs)
                finally:
                    counter.active = True
            return fn(t, *args, **kwargs)

        return wrapper

    @staticmethod
    def _counts(name, args, kwargs, tensor=None):
        if name != "to":
            return True
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, str):
            return torch.device(target).type == "cpu"
        if isinstance(target, torch.device):
            return target.type == "cpu" and tensor is not None and tensor.device.type != "cpu"
        return False


def _excluded(frame) -> bool:
    path = frame.filename.replace(os.sep, "/")
    if "/triton/" in path and "interpreter" in path:
        return True
    name = frame.name
    return "/taps_kernels/" in path and (name.startswith(("check_", "_check", "validate")))


@pytest.fixture
def counter(monkeypatch):
    monkeypatch.setenv("TAPS_BACKEND", "triton")
    monkeypatch.setenv("TAPS_VALIDATE", "none")
    c = ReadCounter()
    c.resolved = set()
    real = backend.resolve

    def resolve(op, *args, **kwargs):
        got = real(op, *args, **kwargs)
        c.resolved.add((op, got[0]))
        return got

    monkeypatch.setattr(backend, "resolve", resolve)
    for mod in (taps_kernels.ops.pool, taps_kernels.ops.score, taps_kernels.ops.select, taps_kernels.ops.mask,
                taps_kernels.ops.accept, taps_kernels.ops.kv, taps_kernels.ops.attention, taps_kernels.ops.lookup,
                taps_kernels._library):
        if hasattr(mod, "resolve"):
            monkeypatch.setattr(mod, "resolve", resolve)
    for name in READS + ("to",):
        monkeypatch.setattr(torch.Tensor, name, c.wrap(name, getattr(torch.Tensor, name)))
    return c


def make(spec):
    latency = {"latency": [0.05 + 0.004 * n for n in range(17)], "t0": 0.02,
               "t0_parts": {"draft": 0.02, "context": 0.001}}
    if spec == "taps":
        return taps_policy(8, rule="reach", pool_size=16, scorer=random_scorer(False).to_weights(), top_k=8,
                           latency=latency)
    if spec == "taps-lookup":  # the n-gram match and graft run inside the round too
        return taps_lookup_policy(8, pool_size=16, scorer=random_scorer(False).to_weights(), top_k=8, latency=latency)
    return make_policy(spec)


@pytest.mark.parametrize("spec,inject", [("dflash", False), ("ddtree:8", False), ("taps", False), ("taps-lookup", False),
                                         ("lookup", False), ("ddtree:8", True)],
                         ids=["dflash", "ddtree:8", "taps", "taps-lookup", "lookup", "ddtree:8-injected-read"])
def test_one_host_read_per_round(counter, spec, inject):
    target, drafter = tiny_target(0, vocab=V, layers=4), tiny_drafter(0, vocab=V, target_layers=4)
    policy = make(spec)
    dec = BatchDecoder(target, policy, drafter=drafter if policy.uses_drafter else None, max_batch=3,
                       attention="taps_tree")
    assert dec.verifier.attention == "taps_tree"
    prompts = [[5, 9, 2, 44, 17, 3], [8, 1], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    for p in prompts:
        dec.submit(p, 12)
    dec.admit()
    if inject:
        dec.round_hook = lambda d: d.verifier.lengths[0].item()
    rounds = 0
    while dec.running and rounds < 3:
        counter.active = True
        try:
            dec.step()
        finally:
            counter.active = False
        rounds += 1
        if not inject:
            assert counter.count == rounds, counter.where
    assert rounds == 3
    # the kernel path really ran: tree attention (and the draft statistics) on the Triton kernels
    assert ("tree_attention", "triton") in counter.resolved and ("topk_stats", "triton") in counter.resolved or \
        spec in ("dflash", "lookup") and ("tree_attention", "triton") in counter.resolved, counter.resolved
    if inject:
        assert counter.count == 2 * rounds, counter.where  # the hook's read is caught every round
    else:
        assert all("tolist" in w and "readout.py" in w for w in counter.where), counter.where


@pytest.mark.parametrize("spec", ["ddtree:8", "taps-lookup"])
def test_a_round_builds_no_tensor_from_host_values(monkeypatch, spec):
    """Between its first op and its read a round copies nothing from the host: on a GPU ``torch.tensor(list,
    device=cuda)`` is a pageable copy that waits for the device. Which rows run lives on the device, set
    between rounds. (The throughput rule's latency table goes to the device once per batch size and stays
    cached: the first round warms it, the rows stay the same after.)"""
    monkeypatch.setenv("TAPS_BACKEND", "triton")
    target, drafter = tiny_target(0, vocab=V, layers=4), tiny_drafter(0, vocab=V, target_layers=4)
    policy = make(spec)
    dec = BatchDecoder(target, policy, drafter=drafter, max_batch=3, attention="taps_tree")
    for p in ([5, 9, 2, 44, 17, 3], [8, 1]):
        dec.submit(p, 40)
    dec.admit()
    dec.step()
    made = []
    real = torch.tensor

    def tensor(*args, **kwargs):
        stack = traceback.extract_stack()[:-1]
        here = stack[-1]
        if "/taps/decode/" in here.filename.replace(os.sep, "/"):
            made.append(f"{here.filename}:{here.lineno}")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    for _ in range(3):
        dec.step()
    assert made == [], made
