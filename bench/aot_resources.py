"""Ahead-of-time compile of every Triton kernel configuration for real GPUs, on a machine without one.

Every module of ``taps_kernels.triton`` that defines ``aot_configs()`` lists the launch
configurations its launcher can choose, as tuples

    (kernel, pointer_types, constexprs, float_arg_names, num_warps[, num_stages[, aligned_ints]])

* ``pointer_types``: ``{"x_ptr": "*bf16", ...}`` (arguments ending in ``_ptr``; default ``*fp32``);
* ``constexprs``: values of the ``tl.constexpr`` arguments, and of integer arguments that the launch
  always passes as 1 (Triton's launcher specialises those to constants, e.g. a unit stride);
* ``float_arg_names``: the float32 scalar arguments (other scalars are int32);
* ``num_stages``: software-pipelining depth (None: Triton's default);
* ``aligned_ints``: integer arguments that are multiples of 16 in the common case (strides of
  16-element rows): compiled with that divisibility, as Triton's launcher specialises them.

``aot_configs`` may take the compute capability (``aot_configs(arch)``) when its launcher chooses
per architecture; otherwise its configurations are the same on every target. Pointers are compiled
16-byte aligned (torch allocations are, and Triton specialises on it at launch).

Each configuration is compiled for each target (``GPUTarget("cuda", arch, 32)``: Triton -> PTX ->
the ptxas bundled with Triton -> cubin) and its shared memory is checked against the per-block
limit of the architecture; registers and spill bytes come from the ``ptxas -v`` log. A fresh
Triton cache is used so that every configuration is really compiled and logged.

Usage: ``python bench/aot_resources.py [--arch 80 89 90] [--sm89 all|limited] [--out PATH] [--no-write]``
Prints a table, writes ``bench/results/triton_aot_resources.json`` (unless ``--no-write``) and exits 1
when any configuration fails to compile or asks for more shared memory than its target allows.
``--sm89 limited`` compiles for sm_89 only the configurations that differ from the sm_80 ones or
whose sm_80 shared memory exceeds the sm_89 limit (sm_89 compiles like sm_80 but allows less).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Shared memory one block may ask for (bytes), by compute capability (cudaDevAttrMaxSharedMemoryPerBlockOptin).
LIMITS = {80: 166912, 89: 101376, 90: 232448}


def _prepare_triton():
    """Compile for real GPUs (not the interpreter), into a fresh cache, with the ptxas log printed."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="taps_aot_")
    import triton
    try:
        triton.knobs.nvidia.dump_ptxas_log = True
        triton.knobs.cache.dir = os.environ["TRITON_CACHE_DIR"]
    except AttributeError:  # older triton: no knobs, registers and spills are then not reported
        pass


def collect(arch: int):
    """Normalised configurations of every module of ``taps_kernels.triton`` for compute capability ``arch``."""
    sys.path.insert(0, ROOT)
    import taps_kernels.triton as pkg

    out = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        fn = getattr(mod, "aot_configs", None)
        if fn is None:
            continue
        configs = fn(arch) if inspect.signature(fn).parameters else fn()
        for cfg in configs:
            kernel, ptrs, consts, floats, warps = cfg[:5]
            stages = cfg[5] if len(cfg) > 5 else None
            aligned = tuple(cfg[6]) if len(cfg) > 6 else ()
            out.append(dict(module=info.name, kernel=kernel, ptrs=dict(ptrs), consts=dict(consts), floats=tuple(floats),
                            warps=warps, stages=stages, aligned=aligned))
    return out


def config_key(cfg) -> str:
    """A stable text key of one configuration (same key = same compile on sm_80 and sm_89)."""
    consts = ",".join(f"{k}={v}" for k, v in sorted(cfg["consts"].items()))
    ptrs = ",".join(f"{k}:{v}" for k, v in sorted(cfg["ptrs"].items()))
    return (f"{cfg['module']}.{cfg['kernel'].__name__}[{consts}] ptrs[{ptrs}] warps={cfg['warps']} "
            f"stages={cfg['stages']} aligned={','.join(cfg['aligned'])}")


def _signature(cfg):
    kernel = cfg["kernel"]
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in cfg["consts"]:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = cfg["ptrs"].get(name, "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in cfg["floats"] else "i32"
            if name in cfg["aligned"]:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_one(cfg, arch: int) -> dict:
    """Compile one configuration for ``sm_<arch>``; a result row (status ``ok``, ``FAIL shared`` or ``FAIL compile``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = _signature(cfg)
    options = {"num_warps": cfg["warps"]}
    if cfg["stages"] is not None:
        options["num_stages"] = cfg["stages"]
    row = dict(module=cfg["module"], kernel=cfg["kernel"].__name__, arch=arch, limit=LIMITS.get(arch),
               constexprs={k: v for k, v in cfg["consts"].items()}, pointers=cfg["ptrs"], num_warps=cfg["warps"],
               num_stages=cfg["stages"], key=config_key(cfg))
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(cfg["kernel"], sig, cfg["consts"], attrs),
                                      target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # every failing configuration is reported, not just the first
        row.update(status="FAIL compile", error=f"{type(exc).__name__}: {str(exc)[:800]}",
                   seconds=round(time.perf_counter() - t0, 2))
        return row
    text = log.getvalue()
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", text)]
    stores = [int(x) for x in re.findall(r"(\d+) bytes spill stores", text)]
    loads = [int(x) for x in re.findall(r"(\d+) bytes spill loads", text)]
    shared = int(compiled.metadata.shared)
    row.update(shared=shared, registers=max(regs) if regs else None,
               spill_stores=max(stores) if stores else None, spill_loads=max(loads) if loads else None,
               seconds=round(time.perf_counter() - t0, 2))
    row["status"] = "ok" if row["limit"] is None or shared <= row["limit"] else "FAIL shared"
    return row


def run(archs, sm89="all", verbose=True):
    """Compile every configuration for every arch; returns the result rows."""
    _prepare_triton()
    rows = []
    sm80 = {}
    for arch in archs:
        for cfg in collect(arch):
            key = config_key(cfg)
            if arch == 89 and sm89 == "limited" and key in sm80 and sm80[key].get("shared", 0) <= LIMITS[89] \
                    and sm80[key]["status"] == "ok":
                continue  # compiles exactly as on sm_80, which fits the smaller sm_89 limit
            row = compile_one(cfg, arch)
            if arch == 80:
                sm80[key] = row
            rows.append(row)
            if verbose:
                print(_line(row), flush=True)
    return rows


def _short(row) -> str:
    c = row["constexprs"]
    return ",".join(f"{k}={v}" for k, v in c.items())[:70]


def _line(row) -> str:
    dt = "/".join(sorted({v.lstrip("*") for k, v in row["pointers"].items() if v.lstrip("*") in
                          ("bf16", "fp16", "fp32")} & {"bf16", "fp16"})) or "-"
    if row["status"] == "FAIL compile":
        return f"FAIL sm_{row['arch']} {row['module']}.{row['kernel']} [{_short(row)}] {row['error'][:300]}"
    return (f"{row['status']:<11} sm_{row['arch']} {row['module'] + '.' + row['kernel']:<48} {dt:<9} "
            f"w{row['num_warps']} s{row['num_stages'] if row['num_stages'] is not None else '-'} "
            f"smem {row['shared']:>6}/{row['limit']} regs {row['registers']} spills {row['spill_stores']} "
            f"[{_short(row)}] {row['seconds']:.1f}s")


def summary(rows):
    """Per (kernel, arch): max shared memory, max registers, max spill-store bytes, configurations."""
    out = {}
    for r in rows:
        if r["status"] == "FAIL compile":
            continue
        s = out.setdefault(f"{r['module']}.{r['kernel']} sm_{r['arch']}",
                           dict(configs=0, max_shared=0, limit=r["limit"], max_registers=0, max_spill_stores=0))
        s["configs"] += 1
        s["max_shared"] = max(s["max_shared"], r["shared"])
        s["max_registers"] = max(s["max_registers"], r["registers"] or 0)
        s["max_spill_stores"] = max(s["max_spill_stores"], r["spill_stores"] or 0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 89, 90], choices=sorted(LIMITS))
    ap.add_argument("--sm89", choices=("all", "limited"), default="all")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "triton_aot_resources.json"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = run(sorted(args.arch), args.sm89)
    import triton
    summ = summary(rows)
    print(f"\n# per kernel and arch: configurations, max shared memory / limit (bytes), max registers, "
          f"max spill stores (bytes)")
    for name, s in sorted(summ.items()):
        print(f"{name:<64} {s['configs']:>3}  smem {s['max_shared']:>6}/{s['limit']}  regs {s['max_registers']:>3}  "
              f"spills {s['max_spill_stores']}")
    failures = [r for r in rows if r["status"] != "ok"]
    wall = time.perf_counter() - t0
    print(f"# {len(rows)} compiles in {wall:.0f} s, {len(failures)} failures")
    if not args.no_write:
        meta = dict(triton=triton.__version__, archs=sorted(args.arch), limits=LIMITS, sm89=args.sm89,
                    seconds=round(wall, 1), note="shared memory from the compiled kernel's metadata (asked at launch); "
                    "registers and spill bytes from ptxas -v; pointers 16-byte aligned")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "summary": summ, "results": rows}, f, indent=1, default=str)
        print(f"# wrote {os.path.relpath(args.out, ROOT) if args.out.startswith(ROOT) else args.out}")
    for r in failures:
        print(_line(r))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
