"""Tracked files speak of the product only: no absolute path of a machine (``/work/``, ``/tmp/``, ``/root/``,
``/home/<user>/``, ``C:\\``) anywhere, and no words about how the work was organised (session, issue, lent)
outside the tests. Skipped outside a git checkout (an installed wheel has no tracked files)."""
import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = "tests/test_product_text.py"

# An absolute path starts a token: not preceded by a word character, '$', '.', '~', '/' or '-'
# (so `$TAPS_CACHE/scratch/` and `a/tmp/b` are fine).
ABS_PATH = re.compile(r"(?<![\w$.~/-])(?:/work/|/tmp/|/root/|/home/[A-Za-z0-9_.-]+/)|(?<![A-Za-z0-9_\\])[A-Z]:\\{1,2}[A-Za-z]")
WORDS = re.compile(r"\b(?:sessions?|issues?|lent)\b", re.IGNORECASE)

#: (file glob, phrase regex, why it is allowed). Keep it short; every entry says why.
ALLOW = (
    ("*", r"GitHub issues?\b", "cites an upstream project's bug tracker, not this project's process"),
    ("bench/results/*.json", r'"text": ".*', "a model's generated text, recorded as it came out"),
)


def tracked_text_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    files = []
    for name in out.decode().split("\0"):
        p = ROOT / name
        if not name or not p.is_file():
            continue
        head = p.read_bytes()[:8192]
        if b"\0" in head:
            continue  # binary: weights, images, compiled objects
        files.append(name)
    return files


def allowed(name: str, line: str, match: re.Match) -> bool:
    for glob, phrase, _why in ALLOW:
        if fnmatch.fnmatch(name, glob):
            for m in re.finditer(phrase, line, re.IGNORECASE):
                if m.start() <= match.start() < m.end():
                    return True
    return False


def scan(name: str, text: str, check_words: bool):
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        for m in ABS_PATH.finditer(line):
            hits.append(f"{name}:{i}: absolute path {m.group(0)!r}: {line.strip()[:120]}")
        if check_words:
            for m in WORDS.finditer(line):
                if not allowed(name, line, m):
                    hits.append(f"{name}:{i}: word {m.group(0)!r}: {line.strip()[:120]}")
    return hits


def test_scanner_catches_what_it_should():
    assert scan("x.md", "data in /tmp/taps_work/data", True)
    assert scan("x.json", '"scorer": "/work/main/checkpoints/s"', True)
    assert scan("x.md", "see /home/alice/notes", True)
    assert scan("x.md", r"C:\Users\bob", True)
    assert scan("x.md", "in session 4 we", True) and scan("x.md", "Issues targets", True)
    assert scan("x.md", "no GPU was lent", True)
    assert not scan("x.md", "under $TAPS_CACHE/scratch/traces and ~/x and checkpoints/a", True)
    assert not scan("x.md", "loads are issued before stores; dense-equivalent work; silent", True)
    assert not scan("x.md", "a GitHub issue of vLLM", True)
    assert not scan("bench/results/r.json", '"text": "help you with your issues"', True)
    assert scan("bench/results/r.json", '"note": "issues"', True) and scan("r.json", '"text": "issues"', True)
    assert not scan("tests/t.py", "session", False)


def test_tracked_files_hold_no_machine_paths_or_process_words():
    files = tracked_text_files()
    if files is None:
        pytest.skip("not a git checkout")
    hits = []
    for name in files:
        if name == THIS:
            continue
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        hits += scan(name, text, check_words=not name.startswith("tests/"))
    assert not hits, "product text:\n" + "\n".join(hits[:50])
