"""The package's code keeps its evidence elsewhere: no module of the package
(its Python and CUDA sources) names a benchmark run's folder (``h200-`` or
``cpu-`` and a commit) or a bare commit id.  Such names go stale with the
code; the figures and the raw files they point to belong in BENCHMARKS.md and
docs/design.md, the history in the commit log.  The import structure's guards
(no circle; the benchmark and anything outside the package above the plugin)
are tests/test_import_graph.py's."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "vllm_dsa_varlen"

RUN_FOLDER = re.compile(r"\b(?:h100|h200|b200|gb200|cpu)-[0-9a-f]{7,40}\b")
# 7 to 40 lowercase hex digits with a letter and a digit among them, standing alone
# (not a hex literal's tail, not part of a name): what `git log --oneline` prints.
COMMIT_ID = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?!\w)")

# Modules that still name runs, each to be cleaned by whoever owns it now; the
# test below fails for a module listed here once it is clean (strict xfail), so
# the list only shrinks.
PENDING_CLEANUP: dict[str, str] = {}


def run_names(text: str) -> list[tuple[int, str]]:
    """Each run folder or commit id ``text`` names, as ``(line, name)``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        seen = set()
        for match in RUN_FOLDER.finditer(line):
            found.append((number, match.group()))
            seen.add(match.group().split("-", 1)[1])
        found += [(number, m.group()) for m in COMMIT_ID.finditer(line) if m.group() not in seen]
    return found


def package_sources() -> list[str]:
    """Every Python and CUDA source of the package, relative to the root."""
    found = []
    for folder, dirs, names in os.walk(os.path.join(ROOT, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [os.path.relpath(os.path.join(folder, n), ROOT).replace(os.sep, "/")
                  for n in sorted(names) if n.endswith((".py", ".cu", ".cuh"))]
    return found


def test_the_detector_finds_runs_and_commits_not_numbers_or_hex_literals():
    text = ("# 1.15x (h200-9f1a909/pipe.log), as in cpu-5cb2676\n"
            "x = 0xffffffff  # since 2e367fe; at-436fd5f/ a build\n"
            "PAGE = 163840; mask = 0x1FFF; name = 'fp8e4nv'; arch = 'sm_90a'\n"
            "abcdef1234567890abcdef1234567890abcdef12 deadbeef 2048 e4m3 cafe123\n")
    assert run_names(text) == [(1, "h200-9f1a909"), (1, "cpu-5cb2676"), (2, "2e367fe"),
                               (2, "436fd5f"), (4, "abcdef1234567890abcdef1234567890abcdef12"),
                               (4, "cafe123")]


def test_the_pending_list_names_package_sources():
    """A listed module that was moved or removed leaves the list too."""
    missing = sorted(set(PENDING_CLEANUP) - set(package_sources()))
    assert not missing, f"remove {missing} from PENDING_CLEANUP: no such module"


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.xfail(
        strict=True, reason=f"pending: {PENDING_CLEANUP[p]}; once it names no run, remove "
                            f"{p} from PENDING_CLEANUP in tests/test_house_code.py"))
    if p in PENDING_CLEANUP else p
    for p in package_sources()])
def test_no_module_names_a_run_or_a_commit(path):
    with open(os.path.join(ROOT, path)) as f:
        found = run_names(f.read())
    assert not found, (
        f"{path} names runs or commits: {', '.join(f'line {n}: {h}' for n, h in found)}.  "
        "Say why in the comment and point to the evidence by name (e.g. 'BENCHMARKS.md, the "
        "decode top-k'); the run folder belongs in BENCHMARKS.md, the history in the commit "
        "message.")
