"""The house's own limits: the README, BENCHMARKS.md and docs/ stay within
their sizes, every raw file the text cites exists, and every run folder under
docs/results/ backs something the text states."""

import glob
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
WHAT_TO_DO = "keep only what backs a figure stated now; history stays in git"

README_LIMIT = 10 * 1024
BENCHMARKS_LIMIT = 25 * 1024
DOCS_LIMIT = 1024 * 1024

# `<commit>:<path>`: a file cited from git history (`git show` it).
HISTORY = re.compile(r"\b([0-9a-f]{7,40}):((?:docs|vllm_dsa_varlen|tests|benchmarks|scripts)/[^\s`'\"<>|]*)")
# A path under docs/results/: written from the repository root (any folder), or
# from that folder when it is a run's (named by card or CPU and commit).
RESULT = re.compile(r"(?<![\w/.:-])(?:docs/results/([^\s`'\"<>|]+)"
                    r"|((?:h200|h100|cpu)-[0-9a-f]{7}[\w.-]*(?:/[^\s`'\"<>|]*)?))")
TRAILING = ".,;:)]"


def _size(path: str) -> int:
    return os.path.getsize(os.path.join(ROOT, path))


def _tree_size(folder: str) -> int:
    total = 0
    for base, _dirs, names in os.walk(os.path.join(ROOT, folder)):
        total += sum(os.path.getsize(os.path.join(base, n)) for n in names)
    return total


def _texts() -> dict[str, str]:
    """README.md, BENCHMARKS.md and every Markdown file under docs/ (the raw
    files under docs/results/ are evidence, not text, and are never edited)."""
    paths = ["README.md", "BENCHMARKS.md"]
    for base, dirs, names in os.walk(os.path.join(ROOT, "docs")):
        dirs[:] = [d for d in dirs if os.path.join(base, d) != RESULTS]
        paths += [os.path.relpath(os.path.join(base, n), ROOT) for n in names if n.endswith(".md")]
    return {p: open(os.path.join(ROOT, p), encoding="utf-8").read() for p in sorted(paths)}


def _expand(path: str) -> list[str]:
    """``a{b,c}d`` -> ``[abd, acd]`` (one level, as the text writes families of files)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",")
            for x in _expand(path[:m.start()] + alt + path[m.end():])]


def cited_results(text: str) -> set[str]:
    """Paths relative to docs/results/ that ``text`` cites as kept files (not
    those cited from history as ``<commit>:docs/results/...``)."""
    live = HISTORY.sub(" ", text)
    found = set()
    for m in RESULT.finditer(live):
        path = (m.group(1) or m.group(2)).rstrip(TRAILING)
        found.update(_expand(path))
    return found


def _exists(rel: str) -> bool:
    full = os.path.join(RESULTS, rel)
    if any(c in rel for c in "*?["):
        return bool(glob.glob(full))
    return os.path.exists(full)


def test_readme_size():
    size = _size("README.md")
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes, over {README_LIMIT}: the README is the front door "
        f"(what it is, install, the main job, one results table); {WHAT_TO_DO}")


# "With `vllm serve`": the command, one table, where the raw files are.
SERVE_SECTION_LINES = 10


def test_readme_serve_section_is_short():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    heading = "\n## With `vllm serve`\n"
    assert heading in text, "README.md has no '## With `vllm serve`' section"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.strip()]
    assert len(lines) <= SERVE_SECTION_LINES, (
        f"README's 'With `vllm serve`' has {len(lines)} lines, over {SERVE_SECTION_LINES}: "
        "the command, one result table and where the raw files are; the rest in BENCHMARKS.md")


def test_benchmarks_size():
    size = _size("BENCHMARKS.md")
    assert size <= BENCHMARKS_LIMIT, (
        f"BENCHMARKS.md is {size} bytes, over {BENCHMARKS_LIMIT}: one table per question, "
        f"no chronology or superseded tables; {WHAT_TO_DO}")


def test_docs_size():
    size = _tree_size("docs")
    assert size <= DOCS_LIMIT, (
        f"docs/ holds {size} bytes, over {DOCS_LIMIT}: prune docs/results/ to the raw files "
        f"behind figures README.md or BENCHMARKS.md state (cite older runs as "
        f"<commit>:docs/results/<path>); {WHAT_TO_DO}")


def test_every_cited_result_exists():
    missing = sorted(f"{name}: {rel}" for name, text in _texts().items()
                     for rel in cited_results(text) if not _exists(rel))
    assert not missing, (
        "cited under docs/results/ but not there (keep the file, or cite it from history as "
        "<commit>:docs/results/<path>): " + "; ".join(missing))


def test_every_result_folder_is_cited():
    cited = {rel.split("/", 1)[0] for text in _texts().values() for rel in cited_results(text)}
    folders = sorted(d for d in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, d)))
    orphans = [d for d in folders if d not in cited]
    assert not orphans, (
        f"docs/results/ folders no text cites: {orphans}; delete them ({WHAT_TO_DO}) or cite "
        "the figure they back")


def test_history_citations_resolve():
    """Every ``<commit>:<path>`` the text cites names a file or folder at that
    commit (where this checkout has the commit: a shallow clone may not)."""
    git = shutil.which("git")
    if git is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    cites = sorted({(c, p.rstrip(TRAILING)) for text in _texts().values()
                    for c, p in HISTORY.findall(text)})
    assert cites, "no history citation found: the pattern no longer matches the text"
    unknown, missing = [], []
    for commit, path in cites:
        if subprocess.run([git, "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT,
                          capture_output=True).returncode != 0:
            unknown.append(commit)
            continue
        for one in _expand(path):
            if subprocess.run([git, "cat-file", "-e", f"{commit}:{one.rstrip('/')}"], cwd=ROOT,
                              capture_output=True).returncode != 0:
                missing.append(f"{commit}:{one}")
    assert not missing, f"cited from history but not at that commit: {missing}"
    if unknown and len(unknown) == len(cites):
        pytest.skip(f"history not in this checkout (shallow clone?): {sorted(set(unknown))}")


def test_citation_patterns():
    """The patterns above read the citations as the text writes them."""
    text = ("(`h200-9220b82/perstep-clean.log`), docs/results/cpu-7a53261/, "
            "`82ee51e:docs/results/h200-14bd3b9/` and h200-9220b82/lead-{early,copy}.log.")
    assert cited_results(text) == {"h200-9220b82/perstep-clean.log", "cpu-7a53261/",
                                   "h200-9220b82/lead-early.log", "h200-9220b82/lead-copy.log"}
    assert HISTORY.findall(text) == [("82ee51e", "docs/results/h200-14bd3b9/")]
