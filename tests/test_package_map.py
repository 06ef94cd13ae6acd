"""The import rules of docs/DESIGN.md's map, read from the source: a package imports only the layers below it."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package directory -> module prefixes it must not import (absolute or relative)
RULES = {
    "taps_kernels": ("taps.",),
    "python/taps/models": ("taps.decode", "taps.scoring", "taps.training", "taps.bench", "taps.cli", "taps.data"),
    "python/taps/decode": ("taps.scoring", "taps.training", "taps.bench", "taps.cli", "taps.data"),
    "python/taps/scoring": ("taps.bench", "taps.cli"),
    "python/taps/training": ("taps.bench", "taps.cli"),
    "python/taps/data": ("taps.bench", "taps.cli"),
    "python/taps/bench": ("taps.cli",),
}


def _imports(path: Path, package: str):
    """Absolute module names imported by ``path`` (relative imports resolved against ``package``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else [])), node.lineno
            else:
                yield node.module or "", node.lineno


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT / "python") if path.is_relative_to(ROOT / "python") else path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] != "__init__" else parts[:-1])


@pytest.mark.parametrize("folder", sorted(RULES))
def test_packages_import_only_lower_layers(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name, line in _imports(path, _package_of(path)):
            if any(name == p.rstrip(".") or name.startswith(p if p.endswith(".") else p + ".") or name == p
                   for p in RULES[folder]):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, bad


def test_relative_imports_resolve_to_absolute_names():
    f = ROOT / "python/taps/decode/loop.py"
    names = [n for n, _ in _imports(f, _package_of(f))]
    assert "taps.decode.readout" in names  # relative imports resolve to absolute names
