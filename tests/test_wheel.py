"""Packaging: the build copies the shipped checkpoints into the ``taps`` package (fast, no compiler), and a
wheel built the documented way (``pip wheel . --no-build-isolation --no-deps``, against this environment's
torch) holds the checkpoints, the transformers ``custom_generate`` folder and the compiled extension
(slow: compiles the C++ extension from a copy of the tracked files)."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = ("smollm2-dflash", "smollm2-taps-scorer", "smollm2-taps-scorer-tiny")


def tracked_copy(dst: Path) -> Path:
    """The tracked files of the checkout (what a clean clone holds) copied to ``dst``."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    for n in filter(None, names):
        src = ROOT / n
        if src.is_file():
            (dst / n).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / n)
    return dst


def shipped_files(name: str):
    d = ROOT / "checkpoints" / name
    return sorted(p.name for p in d.iterdir() if p.suffix in (".json", ".safetensors", ".md"))


def test_build_py_copies_checkpoints_into_the_package(tmp_path):
    src = tracked_copy(tmp_path / "src")
    env = dict(os.environ, TAPS_SKIP_CPP="1")
    out = tmp_path / "lib"
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(out)], cwd=src, env=env, check=True,
                   capture_output=True, timeout=300)
    for name in CHECKPOINTS:
        got = sorted(p.name for p in (out / "taps" / "checkpoints" / name).iterdir())
        assert got == shipped_files(name), name
        assert (out / "taps" / "checkpoints" / name / "config.json").read_bytes() == \
            (ROOT / "checkpoints" / name / "config.json").read_bytes()
    assert (out / "taps" / "hf" / "custom_generate" / "generate.py").is_file()
    assert (out / "taps" / "paths.py").is_file()


@pytest.mark.slow
def test_wheel_holds_checkpoints_and_the_extension(tmp_path):
    src = tracked_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    env = dict(os.environ, TAPS_CUDA="0")
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-build-isolation", "--no-deps", "-q", "-w",
                    str(dist)], cwd=src, env=env, check=True, capture_output=True, timeout=1800)
    (whl,) = dist.glob("taps_kernels-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for name in CHECKPOINTS:
        for f in shipped_files(name):
            assert f"taps/checkpoints/{name}/{f}" in names
    assert any(n.startswith("taps_kernels/_C") and n.endswith(".so") for n in names), names
    assert "taps/hf/custom_generate/generate.py" in names and "taps/paths.py" in names
    assert not any(n.startswith(("tests/", "bench/", "csrc/")) for n in names)
