"""Where the shipped checkpoints live, and how paths are written into records.

Checkpoints (``smollm2-dflash``, ``smollm2-taps-scorer``, ``smollm2-taps-scorer-tiny``) are looked up in
this order, first hit wins:

1. ``$TAPS_HOME/checkpoints/<name>`` (a copy the user keeps outside any install);
2. package data: ``taps/checkpoints/<name>`` inside the installed package (a wheel ships them there);
3. the source checkout: ``<repo>/checkpoints/<name>`` (editable installs and ``PYTHONPATH`` runs).

Records that other machines read (bench JSON, scorer configs, trace metadata, READMEs) never hold an
absolute path of this machine: :func:`portable_path` writes paths relative to the checkout, or under
``$TAPS_CACHE`` / ``$TAPS_HOME``, or marks them as outside both.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

DRAFTER = "smollm2-dflash"
SCORER = "smollm2-taps-scorer"
SCORER_TINY = "smollm2-taps-scorer-tiny"

_PACKAGE_DIR = Path(__file__).resolve().parent


def repo_root() -> Optional[Path]:
    """The source checkout this module was imported from (``python/taps/paths.py`` under a directory
    holding ``setup.py`` and ``checkpoints/``), or None for an installed package."""
    root = _PACKAGE_DIR.parents[1]
    if (root / "setup.py").is_file() and (root / "checkpoints").is_dir():
        return root
    return None


def cache_root() -> Path:
    """``$TAPS_CACHE`` or ``~/.cache/taps`` (converted target, latency tables, traces)."""
    return Path(os.environ.get("TAPS_CACHE", "~/.cache/taps")).expanduser()


def checkpoint_candidates(name: str) -> List[Path]:
    """Every place :func:`checkpoint_dir` looks for ``name``, in lookup order."""
    out = []
    home = os.environ.get("TAPS_HOME")
    if home:
        out.append(Path(home).expanduser() / "checkpoints" / name)
    out.append(_PACKAGE_DIR / "checkpoints" / name)
    root = repo_root()
    if root is not None:
        out.append(root / "checkpoints" / name)
    return out


def checkpoint_dir(name: str) -> Path:
    """The directory of shipped checkpoint ``name`` (a directory holding ``config.json``).

    Raises FileNotFoundError listing the places searched when none holds it."""
    cands = checkpoint_candidates(name)
    for c in cands:
        if (c / "config.json").is_file():
            return c
    raise FileNotFoundError(f"checkpoint {name!r}: not found in " + ", ".join(str(c) for c in cands)
                            + " (set $TAPS_HOME to a directory holding checkpoints/)")


def resolve_checkpoint(path: PathLike) -> Path:
    """A user-given checkpoint path: as given when it exists; else ``checkpoints/<name>`` (or a bare
    ``<name>``) through :func:`checkpoint_dir`; else the path unchanged (the caller reports it missing)."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return p
    parts = p.parts
    name = parts[1] if len(parts) == 2 and parts[0] == "checkpoints" else (parts[0] if len(parts) == 1 else None)
    if name:
        try:
            return checkpoint_dir(name)
        except FileNotFoundError:
            pass
    return p


def _under(p: Path, root: Path) -> Optional[str]:
    try:
        return p.relative_to(root.resolve()).as_posix()
    except ValueError:
        return None


def portable_path(path: PathLike) -> str:
    """``path`` as written into records: relative to the source checkout (``checkpoints/smollm2-dflash``),
    ``checkpoints/<name>`` for packaged checkpoints, ``$TAPS_HOME/...`` or ``$TAPS_CACHE/...`` under those
    roots, ``~/...`` under the home directory, else ``<external>/<last part>`` (never an absolute path)."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        root = repo_root()
        p_abs = (Path.cwd() / p).resolve()
        if root is None or _under(p_abs, root) is None:
            return p.as_posix()
        p = p_abs
    p = p.resolve()
    root = repo_root()
    if root is not None:
        rel = _under(p, root)
        if rel is not None:
            return rel or "."
    rel = _under(p, _PACKAGE_DIR / "checkpoints")
    if rel is not None:
        return f"checkpoints/{rel}"
    for var, base in (("TAPS_HOME", os.environ.get("TAPS_HOME")), ("TAPS_CACHE", str(cache_root()))):
        if base:
            rel = _under(p, Path(base).expanduser())
            if rel is not None:
                return f"${var}/{rel}" if rel else f"${var}"
    rel = _under(p, Path.home())
    if rel is not None:
        return f"~/{rel}"
    return f"<external>/{p.name}"


def portable_record(obj):
    """A JSON-able record (dicts, lists, strings) with every absolute-path string made portable
    (:func:`portable_path`): what training and data scripts write into their configs and manifests."""
    if isinstance(obj, dict):
        return {k: portable_record(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable_record(v) for v in obj]
    if isinstance(obj, Path) or (isinstance(obj, str) and obj.startswith(("/", "~/"))):
        return portable_path(obj)
    return obj


def portable_command(argv) -> str:
    """A command line for records: every argument that is an absolute path (alone or after ``--flag=``)
    goes through :func:`portable_path`."""
    import shlex

    out = []
    for a in argv:
        a = str(a)
        flag, eq, val = a.partition("=") if a.startswith("-") else ("", "", a)
        if val.startswith(("/", "~")):
            val = portable_path(val)
        out.append(shlex.quote(flag + eq + val) if not val.startswith("$") else flag + eq + val)
    return " ".join(out)
