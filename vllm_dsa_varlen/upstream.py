"""What a patched vLLM attribute looks like in the installed vLLM's source,
read without importing it.

The patch registry (:mod:`.patches`) records, for each attribute it
replaces, the *shape* the attribute had in the release it was read from
(:func:`shape`): a function's or method's parameter names, a class's
annotated fields, a module global's import.  Before the plugin patches a
vLLM whose version only says "same line" (0.27.x, 0.33.x, 0.34.x), it compares
those shapes with the installed source, so a release that changed what a
patch relies on is left unpatched (stock behaviour, with a warning that
names the difference) instead of failing at import or in a decode step.

Only source files are read (``ast``), found below the installed ``vllm``
package's directory: no vLLM module is imported here.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib

__all__ = ["source_path", "shape"]


def source_path(module: str) -> pathlib.Path | None:
    """The source file of ``module`` (dotted name) in its installed top-level
    package, without importing anything below that package; ``None`` where
    there is none."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return pathlib.Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    for base in spec.submodule_search_locations or ():
        path = pathlib.Path(base, *rest)
        for candidate in (path / "__init__.py", path.with_suffix(".py")):
            if candidate.is_file():
                return candidate
    return None


@functools.lru_cache(maxsize=64)
def _tree(path: pathlib.Path, mtime_ns: int) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _module_tree(module: str) -> tuple[pathlib.Path, ast.Module] | None:
    """``module``'s source file and its parsed tree, or ``None``."""
    path = source_path(module)
    if path is None:
        return None
    try:
        return path, _tree(path, path.stat().st_mtime_ns)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _statements(body: list[ast.stmt]):
    """A scope's statements, those inside its ``if`` / ``try`` / ``with``
    blocks included (conditional definitions), in source order."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _statements(node.body)
            yield from _statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse,
                          node.finalbody):
                yield from _statements(block)
        elif isinstance(node, ast.With):
            yield from _statements(node.body)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        names.append("*")
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return "def(" + ", ".join(names) + ")"


def _fields(cls: ast.ClassDef) -> str:
    names = [n.target.id for n in cls.body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return "class(" + ", ".join(names) + ")"


def _imported_from(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute name of the module ``node`` (in ``module``, read from
    ``path``) imports from, its relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def shape(module: str, attribute: str) -> str | None:
    """The shape of ``module``'s ``attribute`` (a dotted path inside it, e.g.
    ``"Builder.build"``) in the installed source: ``"def(a, b, *, c)"`` for a
    function or method (its parameter names), ``"class(x, y)"`` for a class
    (its annotated fields), ``"import torch"`` for a module bound by
    ``import``, a name bound by ``from M import n`` as ``"M.n: "`` and the
    shape there, ``"assigned"`` for another module-level binding; ``None``
    where the module or the attribute is not found."""
    return _shape(module, attribute, 0)


def _shape(module: str, attribute: str, depth: int) -> str | None:
    found = _module_tree(module)
    if found is None:
        return None
    path, tree = found
    *owners, name = attribute.split(".")
    scope = tree.body
    for owner in owners:
        cls = next((n for n in _statements(scope)
                    if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if cls is None:
            return None
        scope = cls.body
    for node in _statements(scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return _params(node)
        if isinstance(node, ast.ClassDef) and node.name == name:
            return _fields(node)
        if owners:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (alias.asname or alias.name.partition(".")[0]) == name:
                    return f"import {alias.name}"
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = _imported_from(module, path, node)
                    if depth >= 4:  # a chain of re-exports: not followed further
                        return f"{source}.{alias.name}: ?"
                    there = _shape(source, alias.name, depth + 1)
                    return f"{source}.{alias.name}: {there}"
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return "assigned"
    return None
