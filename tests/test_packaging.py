"""The wheel a user installs (``pip install .``, not editable): it carries every
file of the package, the CUDA sources the sm_90 kernels compile at run time
among them, and declares the vLLM plugin and the benchmark command.  Built from
a copy of the project's packaging files (nothing written into the checkout),
without build isolation or dependencies (no package index needed).  And the
package parses on the oldest Python ``requires-python`` admits."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "vllm_dsa_varlen"


def _package_files(root: str) -> set[str]:
    """Every file below ``root/PACKAGE`` (caches aside), relative to ``root``."""
    found = set()
    for folder, dirs, names in os.walk(os.path.join(root, PACKAGE)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found |= {os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/")
                  for n in names if not n.endswith((".pyc", ".pyo"))}
    return found


def _wheel(tmp_path, extra: dict[str, str] | None = None) -> tuple[str, zipfile.ZipFile]:
    """The project's wheel, built from a copy of it in ``tmp_path`` (with
    ``extra`` files added there: path -> text); returns the copy's root and the
    wheel."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, PACKAGE), src / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path, text in (extra or {}).items():
        (src / path).write_text(text)
    out = tmp_path / "wheel"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "No module named" in done.stderr:
        pytest.skip(f"no wheel builder here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    (wheel,) = os.listdir(out)
    return str(src), zipfile.ZipFile(out / wheel)


def _missing(src: str, wheel: zipfile.ZipFile) -> set[str]:
    return _package_files(src) - set(wheel.namelist())


def test_the_wheel_carries_the_whole_package_and_declares_its_entry_points(tmp_path):
    src, wheel = _wheel(tmp_path)
    files = _package_files(src)
    assert f"{PACKAGE}/ops/cuda/sm90_varlen_logits.cu" in files  # what the kernels compile
    assert {f for f in files if f.endswith(".cu")} and _missing(src, wheel) == set()
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    lines = wheel.read(entry_points).decode().splitlines()
    plugins = lines[lines.index("[vllm.general_plugins]") + 1]
    assert plugins.replace(" ", "") == f"dsa_varlen={PACKAGE}:register"
    scripts = lines[lines.index("[console_scripts]") + 1]
    assert scripts.replace(" ", "") == f"vllm-dsa-varlen-bench={PACKAGE}.bench.logits:main"


def test_a_file_the_package_data_misses_is_found(tmp_path):
    """Not blind: a CUDA header beside the kernels, which the package data
    does not name, is reported missing from the wheel."""
    header = f"{PACKAGE}/ops/cuda/extra.cuh"
    src, wheel = _wheel(tmp_path, {header: "// a header\n"})
    assert _missing(src, wheel) == {header}


def _oldest_python() -> tuple[int, int]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        spec = tomllib.load(f)["project"]["requires-python"]
    assert spec.startswith(">="), spec
    major, minor = spec[2:].split(".")[:2]
    return int(major), int(minor)


def test_the_package_parses_on_the_oldest_python_it_admits():
    """Every module's syntax in the grammar of ``requires-python``'s lower
    bound (``ast.parse(feature_version=...)``: newer syntax, such as
    ``except*`` on 3.10, is refused)."""
    oldest = _oldest_python()
    assert oldest >= (3, 10)
    files = sorted(_package_files(ROOT))
    assert len([f for f in files if f.endswith(".py")]) > 40
    for name in files:
        if name.endswith(".py"):
            with open(os.path.join(ROOT, name)) as f:
                ast.parse(f.read(), name, feature_version=oldest)
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))
