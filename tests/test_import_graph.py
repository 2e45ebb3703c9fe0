"""The package's import graph, read from the source (``ast``, every import
statement, the ones inside functions too): no module imports one that imports
it back, directly or through others; the kernels never reach the launcher;
the launcher is where a reader looks for it."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

from vllm_dsa_varlen.upstream import _imported_from, _statements

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "vllm_dsa_varlen"
KERNELS = ("common", "reference", "triton_paged_mqa_logits", "cuda_paged_mqa_logits",
           "cuda_plan", "cuda_binding")


def _modules() -> dict[str, str]:
    """Module name -> file, for every ``.py`` file of the package."""
    mods = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[mod.removesuffix(".__init__")] = path
    return mods


def _imported(mod: str, path: str, node, known) -> set[str]:
    """The package's modules one import statement of ``mod`` names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _imported_from(mod, pathlib.Path(path), node)
        names = [base] + [f"{base}.{a.name}" for a in node.names]  # a name may be a module
    return {n for n in names if n in known and n != mod}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        graph[mod] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[mod] |= _imported(mod, path, node, mods)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated last), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_the_cycle_finder_finds_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_relative_imports_resolve_to_the_package_modules():
    graph = import_graph()
    ops = f"{PACKAGE}.ops"
    assert {f"{ops}.{k}" for k in ("triton_paged_mqa_logits", "cuda_paged_mqa_logits",
                                   "common")} <= graph[f"{ops}.launcher"]


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert len(graph) > 20
    cycle = find_cycle(graph)
    assert cycle is None, ("import circle: " + " -> ".join(cycle) + ".  Move what both sides "
                           "need into a module below them, or import the higher one inside the "
                           "function that needs it (and say why).")


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_never_reach_the_launcher(kernel):
    graph = import_graph()
    ops = f"{PACKAGE}.ops"
    assert f"{ops}.launcher" not in reachable(graph, f"{ops}.{kernel}")


def test_the_launcher_holds_the_entry_points():
    from vllm_dsa_varlen.ops import launcher, triton_paged_mqa_logits

    for name in ("varlen_paged_mqa_logits", "precompile", "check_varlen_inputs", "graph_kernel",
                 "hopper_kernel_for", "resolve_kernel"):
        assert callable(getattr(launcher, name))
        assert not hasattr(triton_paged_mqa_logits, name)


def test_nothing_the_plugin_serves_with_imports_the_benchmark():
    graph = import_graph()
    bench = f"{PACKAGE}.bench"
    assert bench in graph and f"{bench}.logits" in graph
    for mod, deps in graph.items():
        if mod != bench and not mod.startswith(bench + "."):
            assert not {d for d in deps if d == bench or d.startswith(bench + ".")}, (
                f"{mod} imports the benchmark (vllm_dsa_varlen.bench): the plugin sits below "
                "it; move what both use into the plugin (e.g. ops/ or plan.py)")


def _outside_modules() -> set[str]:
    """Names a module could import from the project's folders outside the
    package (benchmarks/, scripts/, tests/, on ``sys.path`` when run there)."""
    names = {"benchmarks", "scripts", "tests"}
    for top in ("benchmarks", "scripts", "tests"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            names |= {n[:-3] for n in files if n.endswith(".py")}
            names.add(os.path.basename(folder))
    return names - {"__init__"}


def outside_imports(files: list[str], outside: set[str], no_path: set[str] = frozenset()
                    ) -> list[str]:
    """Each import in ``files`` of a module named in ``outside`` (top-level
    names), and each use of ``sys.path`` in ``no_path``, as ``file:line what``."""
    found = []
    for path in files:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        where = os.path.relpath(path, ROOT)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{where}:{node.lineno} import {n}" for n in names
                      if n.split(".")[0] in outside]
            if (path in no_path and isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                found.append(f"{where}:{node.lineno} sys.path")
    return found


def test_the_package_imports_nothing_from_outside_it():
    """benchmarks/, scripts/ and tests/ sit above the package: it imports none
    of their modules, and the plugin (all but the benchmark, whose
    ``--launch-host --base`` imports another revision's ``ops``) never edits
    ``sys.path``."""
    mods = _modules()
    files = list(mods.values())
    plugin = {p for m, p in mods.items() if not m.startswith(f"{PACKAGE}.bench")}
    outside = _outside_modules()
    assert {"summarize", "e2e_decode", "conftest", "logits_checks"} <= outside
    found = outside_imports(files, outside, plugin)
    assert found == [], ("the package reaches outside itself: " + "; ".join(found) + ".  Move "
                         "what it needs into the package; benchmarks/, scripts/ and tests/ may "
                         "import the package, never the reverse.")


def test_an_import_from_outside_is_found(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nsys.path.insert(0, 'benchmarks')\n"
                   "def f():\n    import summarize\n    from logits_checks import POISON\n"
                   "    from .ops import launcher\n")
    where = os.path.relpath(bad, ROOT)
    assert sorted(outside_imports([str(bad)], _outside_modules(), {str(bad)})) == [
        f"{where}:2 sys.path", f"{where}:4 import summarize", f"{where}:5 import logits_checks"]


def _top_level_names(path: str) -> set[str]:
    """What a module defines at its top level (also under a top-level ``if``,
    ``try`` or ``with``): functions, classes, assigned and imported names."""
    names = set()
    with open(path) as f:
        body = ast.parse(f.read(), path).body
    for node in _statements(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def unresolved_imports(files: list[str]) -> list[str]:
    """Every ``from`` import of the package's modules in ``files`` (relative
    in the package, absolute anywhere; inside functions too) whose module is
    not a file of the package or whose names are neither its submodules nor
    names it defines, as ``file:line module.name``."""
    mods = _modules()
    module_of = {path: mod for mod, path in mods.items()}
    defined: dict[str, set[str]] = {}
    found = []
    for path in files:
        mod = module_of.get(path)  # None outside the package
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                if mod is None:
                    continue
                base = _imported_from(mod, pathlib.Path(path), node)
            elif (node.module or "").split(".")[0] == PACKAGE:
                base = node.module
            else:
                continue
            where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
            if base not in mods:
                found.append(f"{where} {base}")
                continue
            if base not in defined:
                defined[base] = _top_level_names(mods[base])
            found += [f"{where} {base}.{a.name}" for a in node.names
                      if f"{base}.{a.name}" not in mods and a.name not in defined[base]]
    return found


def test_every_import_of_the_package_resolves():
    """Imports inside functions run only on the paths that call them (some
    only on a GPU): each must still name a module of the package and names it
    defines, in the package, the tests and the benchmarks."""
    files = [os.path.join(folder, name)
             for top in (PACKAGE, "tests", "benchmarks")
             for folder, _, names in os.walk(os.path.join(ROOT, top))
             for name in names if name.endswith(".py")]
    assert len(files) > 100
    assert unresolved_imports(files) == []


def test_an_unresolved_import_is_found(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(f"def f():\n    from {PACKAGE}.ops import no_such_module\n"
                   f"    from {PACKAGE}.bench.graph import capture_graph, no_such_name\n"
                   f"    from {PACKAGE}.bench_graph import capture_graph\n")
    assert unresolved_imports([str(bad)]) == [
        f"{os.path.relpath(bad, ROOT)}:2 {PACKAGE}.ops.no_such_module",
        f"{os.path.relpath(bad, ROOT)}:3 {PACKAGE}.bench.graph.no_such_name",
        f"{os.path.relpath(bad, ROOT)}:4 {PACKAGE}.bench_graph"]
