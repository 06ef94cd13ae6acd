"""Structural counts of the source tree, read with :mod:`ast` (nothing is imported or run).

Prints one line per count with its offenders (``path:line name``) and writes
``bench/results/code_counts.json``. What is counted, and how:

* ``long_functions``: functions (and methods) longer than 100 lines, ``def`` line to last line, docstring
  included, in ``taps_kernels/``, ``python/taps/`` and ``bench/``; Triton kernels (a decorator that names
  ``triton.jit`` or ``jit``) are not counted.
* ``many_parameters``: functions with more than 12 parameters (positional, keyword-only, ``*args`` and
  ``**kwargs`` each count one; ``self`` and ``cls`` count), same folders, Triton kernels not counted.
* ``cache_root_definitions``: places that decide where the cache lives: every ``def cache_root`` and every
  read of the ``TAPS_CACHE`` environment variable (``os.environ.get("TAPS_CACHE")``, ``os.environ[...]``,
  ``os.getenv(...)``) outside a function named ``cache_root``; same folders.
* ``front_doors``: per op (the keys of ``PREFERENCES`` in ``taps_kernels/backend.py``, the ops the dispatcher
  decides, and the ops ``taps_kernels/__init__.py`` imports from ``.ops``), the distinct Python functions a caller can enter to run that op. A function in ``taps_kernels/`` or
  ``python/taps/`` is a front door of op ``X`` when it

  1. is a module-level function named ``X`` (public API, wrappers, the loop's direct calls), or
  2. is decorated with ``custom_op("taps::X", ...)`` (reached as ``torch.ops.taps.X``), or
  3. calls the dispatcher itself with the literal name: ``resolve("X", ...)`` or ``_impl("X", ...)``.

  A function matching several rules counts once. A ``torch.library`` op defined with
  ``define("X(...)", kernel, fake)`` (:mod:`taps_kernels._library`) in the module of the public function ``X``
  that calls it is that public op's own path, not a second door: its kernel is not counted, and the entry
  of ``X`` says ``+ torch.ops.taps.X``; defined anywhere else, its kernel counts as a door. Not front doors: the specs (``taps_kernels/reference/``),
  the kernels (``taps_kernels/triton/``), the implementation modules that only register
  (``impls.py``, ``cpp_impls.py``, ``cuda_impls.py``, ``_registry.py``), the dispatcher itself
  (``backend.py``), and functions that reach the op through another front door. ``front_doors_max`` is the
  largest count over the ops.
* ``size_rules``: distinct functions that size a tree from a latency table (a parameter named ``latency``,
  ``lat``, ``table`` or ``latency_table``), Triton kernels not counted: in ``python/taps/`` and
  ``taps_kernels/`` (outside the references) a function named ``*_size`` or ``*_sizes``; in
  ``taps_kernels/reference/`` (the specs the C++ and Triton kernels of a rule follow) a public ``select_*``
  function, whose private helpers are part of it. Each entry lists the modules of the policies
  (``python/taps/decode/policies/``) and of the trace replay (``python/taps/scoring/``) that name it; a
  reference is reached through :func:`taps_kernels.select_subtree` instead.

Usage: ``python bench/code_counts.py [--root DIR] [--out FILE]`` (``--out -`` writes no file).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("taps_kernels", "python/taps", "bench")
LIBRARY_DIRS = ("taps_kernels", "python/taps")
NOT_DOORS = ("taps_kernels/reference/", "taps_kernels/triton/", "taps_kernels/impls.py",
             "taps_kernels/cpp_impls.py", "taps_kernels/cuda_impls.py", "taps_kernels/_registry.py",
             "taps_kernels/backend.py")
POLICY_DIRS = ("python/taps/decode/policies/", "python/taps/scoring/")
MAX_LINES = 100
MAX_PARAMS = 12
TABLE_PARAMS = {"latency", "lat", "table", "latency_table"}
REFERENCE_DIR = "taps_kernels/reference/"
DISPATCH_CALLS = {"resolve", "_impl", "backend_for"}

Func = Tuple[str, ast.AST, str]  # (relative path, node, qualified name)


def python_files(root: Path, dirs) -> Iterator[Tuple[str, ast.Module]]:
    """``(relative posix path, parsed module)`` of every ``.py`` file under ``dirs`` (sorted)."""
    for d in dirs:
        base = root / d
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            yield rel, ast.parse(p.read_text(encoding="utf-8"), filename=rel)


def functions(module: ast.Module, rel: str) -> Iterator[Func]:
    """Every function and method with its dotted name (``Class.method``, ``outer.inner``)."""
    stack = [(module, "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield rel, child, name
                stack.append((child, name + "."))
            elif isinstance(child, ast.ClassDef):
                stack.append((child, prefix + child.name + "."))
            else:
                stack.append((child, prefix))


def is_triton_kernel(fn) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        text = ast.unparse(target)
        if text == "jit" or text.endswith(".jit") and "triton" in text:
            return True
    return False


def num_params(fn) -> int:
    a = fn.args
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def param_names(fn) -> List[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def _where(rel: str, node, name: str, note: str = "") -> str:
    return f"{rel}:{node.lineno} {name}" + (f" ({note})" if note else "")


def _str_arg(call: ast.Call) -> Optional[str]:
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _own_nodes(fn) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s body, not descending into nested functions or classes."""
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.append(child)


def _reads_cache_env(node) -> bool:
    """``os.environ.get("TAPS_CACHE", ...)``, ``os.getenv("TAPS_CACHE")`` or ``os.environ["TAPS_CACHE"]``."""
    if isinstance(node, ast.Call) and _call_name(node) in ("get", "getenv") and _str_arg(node) == "TAPS_CACHE":
        return True
    return (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and node.slice.value == "TAPS_CACHE" and ast.unparse(node.value).endswith("environ"))


def op_names(root: Path) -> List[str]:
    """The keys of ``PREFERENCES`` in ``taps_kernels/backend.py`` (the ops the dispatcher decides), then the
    public ops ``taps_kernels/__init__.py`` imports from ``.ops`` that the table lacks."""
    ops = []
    backend, init = root / "taps_kernels" / "backend.py", root / "taps_kernels" / "__init__.py"
    for node in ast.walk(ast.parse(backend.read_text(encoding="utf-8"))) if backend.is_file() else ():
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "PREFERENCES" and isinstance(node.value, ast.Dict):
            ops += [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    for node in ast.parse(init.read_text(encoding="utf-8")).body if init.is_file() else ():
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "ops":
            ops += [a.name for a in node.names if a.name not in ops]
    return ops


def _library_kernels(mod: ast.Module, ops) -> Dict[str, str]:
    """``{kernel function name: op}`` of the ``define("op(...)", kernel, fake)`` calls at ``mod``'s top level whose
    public function ``op`` (same module) calls the defined op."""
    defined = {}
    for node in mod.body:
        value = node.value if isinstance(node, (ast.Assign, ast.Expr)) else None
        if isinstance(value, ast.Call) and _call_name(value) == "define" and len(value.args) >= 2:
            op = (_str_arg(value) or "").split("(", 1)[0]
            target = node.targets[0].id if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) \
                else None
            if op in ops and isinstance(value.args[1], ast.Name):
                defined[op] = (value.args[1].id, target)
    public = {n.name: n for n in mod.body if isinstance(n, ast.FunctionDef)}
    out = {}
    for op, (kernel, handle) in defined.items():
        calls = {_call_name(c) for fn in public.values() for c in ast.walk(fn) if isinstance(c, ast.Call)}
        if handle is not None and handle in calls and op in {f for f in public if f in ops} | set(public):
            out[kernel] = op
    return out


def _door_ops(fn, top_level: bool, ops) -> List[str]:
    found = set()
    if top_level and fn.name in ops:
        found.add(fn.name)
    for d in fn.decorator_list:
        if isinstance(d, ast.Call) and _call_name(d) == "custom_op":
            name = _str_arg(d) or ""
            if name.startswith("taps::") and name[6:] in ops:
                found.add(name[6:])
    for node in _own_nodes(fn):
        if isinstance(node, ast.Call) and _call_name(node) in DISPATCH_CALLS and _str_arg(node) in ops:
            found.add(_str_arg(node))
    return sorted(found)


def _is_size_rule(rel: str, fn) -> bool:
    if not TABLE_PARAMS & set(param_names(fn)):
        return False
    if rel.startswith(REFERENCE_DIR):
        return fn.name.startswith("select_")
    return fn.name.endswith(("_size", "_sizes"))


def count(root: Path = ROOT) -> Dict[str, object]:
    """All counts of the tree under ``root``: ``{name: count}`` plus ``offenders`` (lists of ``path:line name``)
    and ``front_doors`` (``{op: [path:line name, ...]}``)."""
    root = Path(root)
    long_fns, many_params, cache_defs = [], [], []
    for rel, mod in python_files(root, SOURCE_DIRS):
        for _, fn, name in functions(mod, rel):
            if is_triton_kernel(fn):
                continue
            lines = fn.end_lineno - fn.lineno + 1
            if lines > MAX_LINES:
                long_fns.append(_where(rel, fn, name, f"{lines} lines"))
            if num_params(fn) > MAX_PARAMS:
                many_params.append(_where(rel, fn, name, f"{num_params(fn)} parameters"))
            if fn.name == "cache_root":
                cache_defs.append(_where(rel, fn, name, "def"))
            else:
                for node in _own_nodes(fn):
                    if _reads_cache_env(node):
                        cache_defs.append(_where(rel, node, name, "reads TAPS_CACHE"))
        for node in mod.body:  # module-level reads (outside any function)
            for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                               ast.ClassDef)) else ():
                if _reads_cache_env(sub):
                    cache_defs.append(_where(rel, sub, "<module>", "reads TAPS_CACHE"))

    ops = op_names(root)
    doors: Dict[str, List[str]] = {op: [] for op in ops}
    size_rules, names_used = [], {}
    for rel, mod in python_files(root, LIBRARY_DIRS):
        top = {id(n) for n in mod.body}
        if rel.startswith(POLICY_DIRS):
            names_used[rel] = {n.id for n in ast.walk(mod) if isinstance(n, ast.Name)} | {
                n.attr for n in ast.walk(mod) if isinstance(n, ast.Attribute)} | {
                a.name for n in ast.walk(mod) if isinstance(n, ast.ImportFrom) for a in n.names}
        kernels = _library_kernels(mod, ops)
        for _, fn, name in functions(mod, rel):
            if is_triton_kernel(fn):
                continue
            if not rel.startswith(NOT_DOORS) and fn.name not in kernels:
                for op in _door_ops(fn, id(fn) in top, ops):
                    note = f"+ torch.ops.taps.{op}" if op == fn.name and op in kernels.values() else ""
                    doors[op].append(_where(rel, fn, name, note))
            if _is_size_rule(rel, fn):
                size_rules.append((rel, fn, name))
    sizes = []
    for rel, fn, name in size_rules:
        users = sorted(r for r, used in names_used.items() if fn.name in used)
        if rel.startswith(REFERENCE_DIR):
            note = "a reference: reached through select_subtree"
        else:
            note = "named in " + ", ".join(users) if users else "named in no policy or trace-replay module"
        sizes.append(_where(rel, fn, name, note))

    return {
        "long_functions": len(long_fns), "many_parameters": len(many_params),
        "cache_root_definitions": len(cache_defs),
        "front_doors_max": max((len(v) for v in doors.values()), default=0), "size_rules": len(sizes),
        "limits": {"lines": MAX_LINES, "parameters": MAX_PARAMS},
        "offenders": {"long_functions": long_fns, "many_parameters": many_params,
                      "cache_root_definitions": cache_defs, "size_rules": sizes},
        "front_doors": doors,
    }


def report(counts: Dict[str, object]) -> str:
    out = []
    rows = (("long_functions", f"functions over {MAX_LINES} lines (Triton kernels excluded)"),
            ("many_parameters", f"functions over {MAX_PARAMS} parameters (Triton kernels excluded)"),
            ("cache_root_definitions", "definitions of cache_root"),
            ("size_rules", "ways to size a tree"))
    for key, label in rows:
        out.append(f"{label}: {counts[key]}")
        out += [f"    {x}" for x in counts["offenders"][key]]
    out.append(f"front doors per op (most: {counts['front_doors_max']}):")
    for op, doors in counts["front_doors"].items():
        out.append(f"  {op}: {len(doors)}")
        out += [f"    {x}" for x in doors]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(ROOT), help="tree to read (default: this checkout)")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/code_counts.json; '-': none)")
    args = ap.parse_args(argv)
    counts = count(Path(args.root))
    print(report(counts))
    if args.out != "-":
        out = Path(args.out) if args.out else ROOT / "bench" / "results" / "code_counts.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(counts, indent=1) + "\n", encoding="utf-8")
        print(f"# wrote {out.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
