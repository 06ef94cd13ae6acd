"""Fuzz worker: runs a batch of case ids (JSON list on stdin) and reports each on stdout, one JSON line per event.

``{"start": id, "op": op}`` before a case runs (so that the parent knows which case a crash or hang belongs
to), then ``{"id": id, "op": op, "outcome": ..., "detail": ...}``. Outcomes (per case, over its backends):

* ``error``     every backend refused it with a clean ValueError/TypeError, leaving its inputs untouched
* ``agree``     every backend accepted it and the outputs agree (exact for integers, tolerance for floats)
* ``unchecked`` a ``validate="none"`` run on out-of-contract values: anything but a crash or a hang is fine
* ``DISAGREE``  backends differ: one accepts what another refuses, or their outputs differ
* ``UNCLEAN``   an error that is not a clean ValueError/TypeError, or a refused call that modified its inputs
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton kernels
warnings.filterwarnings("ignore")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases  # noqa: E402
from taps_kernels.backend import BackendUnavailable  # noqa: E402

CLEAN = (ValueError, TypeError)
# torch's own argument check of a custom op (schema types): it names the op, the argument, expected and received
SCHEMA_ERROR = "() Expected a value of type"
NO_BACKWARD = "has no backward"
TOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def flatten(out):
    """Outputs as a flat list of tensors / Python values (dataclasses by field, sequences in order)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "__dataclass_fields__"):
        return [x for f in out.__dataclass_fields__ for x in flatten(getattr(out, f))]
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in flatten(o)]
    return [out]


def differ(a, b) -> str:
    """Empty when ``a`` and ``b`` agree; else what differs."""
    fa, fb = flatten(a), flatten(b)
    if len(fa) != len(fb):
        return f"{len(fa)} outputs vs {len(fb)}"
    for k, (x, y) in enumerate(zip(fa, fb)):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"output {k}: {type(x).__name__} vs {type(y).__name__}"
        if not isinstance(x, torch.Tensor):
            if x != y:
                return f"output {k}: {x!r} vs {y!r}"
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"output {k}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        if x.requires_grad != y.requires_grad:
            return f"output {k}: requires_grad {x.requires_grad} vs {y.requires_grad}"
        x, y = x.detach(), y.detach()
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return f"output {k}: first difference at {(x != y).nonzero()[0].tolist()}"
            continue
        xf, yf = x.double(), y.double()
        if not torch.equal(xf.isnan(), yf.isnan()):
            return f"output {k}: NaN pattern differs at {(xf.isnan() != yf.isnan()).nonzero()[0].tolist()}"
        inf = xf.isinf() | yf.isinf()
        if not torch.equal(torch.where(inf, xf, 0), torch.where(inf, yf, 0)):
            return f"output {k}: inf pattern differs at {(inf & (xf != yf)).nonzero()[0].tolist()}"
        fin = ~(xf.isnan() | inf)
        tol = TOL.get(x.dtype, 1e-4)
        err = ((xf - yf).abs() - tol * (1 + yf.abs())).where(fin, torch.zeros_like(xf))
        if err.numel() and float(err.max()) > 0:
            i = int(err.flatten().argmax())
            return f"output {k}: {float(xf.flatten()[i])} vs {float(yf.flatten()[i])} (tol {tol})"
    return ""


def _snapshot(args):
    return {k: v.detach().clone() for k, v in args.items()
            if isinstance(v, torch.Tensor) and v.device.type == "cpu"}


def _touched(args, snap) -> str:
    for k, before in snap.items():
        now = args[k].detach()
        if not torch.equal(now.isnan(), before.isnan()) or not torch.equal(now.nan_to_num(0), before.nan_to_num(0)):
            return k
    return ""


def run_backend(case_id: str, backend: str):
    """``("ok", outputs)``, ``("skip", why)`` or ``("error", clean, text)`` for one backend, on fresh inputs."""
    op, args, validate, _, _ = cases.build(case_id)
    snap = _snapshot(args)
    try:
        out = cases.call(op, args, backend, validate)
    except BackendUnavailable as exc:
        return ("skip", str(exc))
    except Exception as exc:  # noqa: BLE001 - classifying every exception is the point
        clean = isinstance(exc, CLEAN) or (op.startswith("custom.") and isinstance(exc, RuntimeError)
                                           and SCHEMA_ERROR in str(exc))
        touched = _touched(args, snap)
        if touched:
            return ("error", False, f"{type(exc).__name__}: {exc} -- and modified {touched} before raising")
        return ("error", clean, f"{type(exc).__name__}: {str(exc)[:300]}")
    if not cases.OPS[op].inplace:
        touched = _touched(args, snap)
        if touched:
            return ("error", False, f"accepted but modified its input {touched}")
    return ("ok", out)


def classify(case_id: str):
    op, _, _, backends, compare = cases.build(case_id)
    results = {b: run_backend(case_id, b) for b in backends}
    results = {b: r for b, r in results.items() if r[0] != "skip"}
    errors = {b: r for b, r in results.items() if r[0] == "error"}
    oks = {b: r[1] for b, r in results.items() if r[0] == "ok"}
    unclean = {b: r[2] for b, r in errors.items() if not r[1]}
    if not compare:
        if len(errors) == len(results) and not unclean:
            return op, "error", ""
        return op, "unchecked", "; ".join(f"{b}: {t}" for b, t in unclean.items())[:500]
    if unclean:
        return op, "UNCLEAN", "; ".join(f"{b}: {t}" for b, t in unclean.items())[:800]
    if errors and oks and set(oks) == {"reference"} and all(NO_BACKWARD in r[2] for r in errors.values()):
        return op, "agree", "grad contract: the reference runs (it has the backward), other backends refuse"
    if errors and oks:
        return op, "DISAGREE", ("accepted by " + ", ".join(oks) + "; refused by " +
                                "; ".join(f"{b}: {r[2]}" for b, r in errors.items()))[:800]
    if errors:
        return op, "error", next(iter(errors.values()))[2][:200]
    names = list(oks)
    for b in names[1:]:
        why = differ(oks[names[0]], oks[b])
        if why:
            return op, "DISAGREE", f"{names[0]} vs {b}: {why}"[:800]
    return op, "agree", ""


def main() -> int:
    torch.set_num_threads(1)
    ids = json.loads(sys.stdin.read())
    for case_id in ids:
        if case_id.startswith("hyp|"):
            import hyp  # noqa: PLC0415 - hypothesis only where used
            op = case_id.split("|")[1]
            print(json.dumps({"start": case_id, "op": op}), flush=True)
            outcome, detail = hyp.run_block(case_id, differ, run_one=hyp_backend_runner)
        else:
            try:
                op = cases.build(case_id)[0]
            except Exception:  # noqa: BLE001
                print(json.dumps({"start": case_id, "op": "?"}), flush=True)
                print(json.dumps({"id": case_id, "op": "?", "outcome": "UNCLEAN",
                                  "detail": "case builder failed: " + traceback.format_exc()[-400:]}), flush=True)
                continue
            print(json.dumps({"start": case_id, "op": op}), flush=True)
            op, outcome, detail = classify(case_id)
        print(json.dumps({"id": case_id, "op": op, "outcome": outcome, "detail": detail}), flush=True)
    return 0


def hyp_backend_runner(op, args, backend):
    """One backend on one hypothesis-drawn (valid) input: outputs, or the exception it raised."""
    try:
        return "ok", cases.call(op, args, backend, None)
    except BackendUnavailable:
        return "skip", None
    except Exception as exc:  # noqa: BLE001
        return "error", f"{type(exc).__name__}: {str(exc)[:300]}"


if __name__ == "__main__":
    sys.exit(main())
