"""upstream.shape: a patched attribute's shape read from source, without
importing it; checked on a package written for the test and, against Python's
own introspection of the imported objects, on the installed vLLM's targets."""

import importlib
import inspect
import random
import sys
import textwrap

import pytest

from vllm_dsa_varlen import upstream


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh package (random name, never imported by the test) with a module
    of every binding kind and a sibling it imports from."""
    name = f"upshape_{random.randrange(1 << 30)}"
    root = tmp_path / name
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (root / "sub" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (root / "sib.py").write_text("def helper(x, /, y=1, *rest, z, **kw):\n    pass\n")
    (root / "sub" / "mod.py").write_text(textwrap.dedent(f"""
        import torch
        import os.path as osp
        from ..sib import helper
        from {name}.sib import helper as again
        from {name}.missing import gone
        LIMIT = 4
        if LIMIT:
            def conditional(a, b):
                pass
        try:
            def guarded(*, k):
                pass
        except ImportError:
            pass

        @decorated
        def plain(q, kv, weights, *, out=None):
            pass

        class Builder:
            field_a: int
            field_b: "str" = ""
            not_a_field = 3

            def build(self, step, fast=False):
                pass

            @classmethod
            def support(cls, config):
                pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield f"{name}.sub.mod", name
    assert name not in sys.modules  # nothing was imported


def test_shapes_of_every_binding_kind(package):
    mod, name = package
    assert upstream.shape(mod, "plain") == "def(q, kv, weights, *, out)"
    assert upstream.shape(mod, "Builder.build") == "def(self, step, fast)"
    assert upstream.shape(mod, "Builder.support") == "def(cls, config)"
    assert upstream.shape(mod, "Builder") == "class(field_a, field_b)"
    assert upstream.shape(mod, "conditional") == "def(a, b)"
    assert upstream.shape(mod, "guarded") == "def(*, k)"
    assert upstream.shape(mod, "torch") == "import torch"
    assert upstream.shape(mod, "osp") == "import os.path"
    assert upstream.shape(mod, "LIMIT") == "assigned"
    assert upstream.shape(mod, "helper") == f"{name}.sib.helper: def(x, y, *rest, z, **kw)"
    assert upstream.shape(mod, "again") == f"{name}.sib.helper: def(x, y, *rest, z, **kw)"
    assert upstream.shape(mod, "gone") == f"{name}.missing.gone: None"


def test_what_is_not_there_has_no_shape(package):
    mod, name = package
    assert upstream.shape(mod, "absent") is None
    assert upstream.shape(mod, "Builder.absent") is None
    assert upstream.shape(mod, "Absent.build") is None
    assert upstream.shape(mod, "Builder.field_a") is None  # a field is not a method
    assert upstream.shape(f"{name}.nowhere", "plain") is None
    assert upstream.shape(f"no_such_top_{random.randrange(1 << 30)}.mod", "x") is None


def _runtime_params(obj) -> list[str]:
    """Parameter names as Python's introspection gives them, in upstream.shape's
    notation."""
    out = []
    for p in inspect.signature(obj, follow_wrapped=True).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
        elif p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
        else:
            if p.kind is p.KEYWORD_ONLY and not any(o.startswith("*") for o in out):
                out.append("*")
            out.append(p.name)
    return out


def test_the_installed_vllm_targets_read_as_python_introspects_them(clean_plugin):
    """For every patch of the installed line whose target is a function or
    method, the parameters read from source are those ``inspect`` gives of the
    imported stock object (an independent reading of the same code)."""
    pytest.importorskip("vllm")
    from vllm_dsa_varlen import patches

    line = patches.installed_line()
    if line not in patches.LINES:
        pytest.skip(f"no patch set for vLLM line {line}")
    checked = 0
    for patch in patches.for_line(line):
        got = upstream.shape(patch.module, patch.attribute)
        assert got is not None, patch.key
        text = got.rpartition(": ")[2]
        if not text.startswith("def("):
            continue
        owner = importlib.import_module(patch.module)
        *parents, name = patch.attribute.split(".")
        for part in parents:
            owner = getattr(owner, part)
        obj = inspect.getattr_static(owner, name)
        obj = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
        assert text == "def(" + ", ".join(_runtime_params(obj)) + ")", patch.key
        checked += 1
    assert checked >= 6
