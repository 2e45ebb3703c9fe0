"""The settings table and its one reader (:mod:`vllm_dsa_varlen.settings`), and
the guards that keep every variable the package reads in that table."""

from __future__ import annotations

import ast
import logging
import os
import random
import re
from collections.abc import Sequence

import pytest

from vllm_dsa_varlen import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "vllm_dsa_varlen")
# A name of the plugin's variable family, old or new, as code or text writes it.
NAME = re.compile(r"(?<![A-Za-z0-9_])(?:VLLM_)?DSA_VARLEN(?:_[A-Z0-9]+)*(?![A-Za-z0-9_])")


class _Warnings(Sequence):
    """The warning messages among the plugin logger's records, read live."""

    def __init__(self, records: list):
        self._records = records

    def _messages(self) -> list[str]:
        return [r.getMessage() for r in self._records if r.levelno >= logging.WARNING]

    def __getitem__(self, i):
        return self._messages()[i]

    def __len__(self) -> int:
        return len(self._messages())


@pytest.fixture
def warnings_seen(monkeypatch, plugin_log):
    """The settings' warnings logged in this test (each given once a process:
    the memory of those given is emptied first), from conftest's plugin_log."""
    monkeypatch.setattr(settings, "_warned", set())
    return _Warnings(plugin_log)


# ---------------------------------------------------------------- the table

def test_every_setting_has_the_prefix_a_meaning_and_its_default_parses():
    assert len(settings.SETTINGS) == 10
    for name, s in settings.SETTINGS.items():
        assert s.name == name and NAME.fullmatch(name) and not name.startswith("VLLM_")
        assert s.old_name == "VLLM_" + name and s.meaning and s.values
        assert settings.get(name, {}) == s.default


@pytest.mark.parametrize("name,allowed", [
    (settings.MODE_ENV, settings.MODES), (settings.BACKEND_ENV, settings.BACKENDS),
    (settings.TOPK_ENV, settings.TOPK_SETTINGS), (settings.FUSED_Q_ENV, settings.FUSED_Q_SETTINGS),
    (settings.KERNEL_ENV, settings.KERNELS), (settings.HEAD_SUM_ENV, settings.HEAD_SUMS)])
def test_choices_take_their_values_in_any_case_and_refuse_the_rest(name, allowed):
    """Each value (blanks and case ignored) reads back as itself, unset or
    empty as the default (the first); a random other word is a ValueError
    naming the variable, the value and the choices."""
    rng = random.Random(name)
    assert settings.get(name, {}) == settings.get(name, {name: "  "}) == allowed[0]
    for value in allowed:
        raw = "".join(c.upper() if rng.random() < 0.5 else c for c in value)
        assert settings.get(name, {name: f" {raw}\t"}) == value
    for _ in range(20):
        bad = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789_")
                      for _ in range(rng.randint(1, 9)))
        if bad in allowed or bad in settings.BACKEND_ALIASES:
            continue
        with pytest.raises(ValueError) as err:
            settings.get(name, {name: bad})
        msg = str(err.value)
        assert msg.startswith(f"{name}={bad!r} is not valid") and all(v in msg for v in allowed)


@pytest.mark.parametrize("name", [settings.PIPELINE_ENV, settings.PDL_ENV])
def test_flags_take_0_and_1(name):
    assert settings.get(name, {}) is False
    assert settings.get(name, {name: " 1 "}) is True and settings.get(name, {name: "0"}) is False
    for bad in ("2", "yes", "on", "true", "1,0"):
        with pytest.raises(ValueError, match=name):
            settings.get(name, {name: bad})


def test_fused_q_blocks_take_four_powers_of_two():
    name = settings.FUSED_Q_BLOCKS_ENV
    rng = random.Random(0)
    assert settings.get(name, {}) is None
    for _ in range(50):
        want = tuple(2 ** rng.randint(0, 6) for _ in range(4))
        assert settings.get(name, {name: " " + "/".join(map(str, want)) + " "}) == want
    for bad in ("8/16/2", "8/16/3/2", "a/b/c/d", "0/16/2/2", "8/16/2/2/2", "-8/16/2/2"):
        with pytest.raises(ValueError, match=name):
            settings.get(name, {name: bad})


def test_the_nvrtc_path_must_name_a_file(tmp_path):
    name = settings.NVRTC_ENV
    lib = tmp_path / "libnvrtc.so.12"
    lib.write_bytes(b"")
    assert settings.get(name, {}) is None
    assert settings.get(name, {name: str(lib)}) == str(lib)
    assert settings.get(name, {name: "libnvrtc.so.12"}) == "libnvrtc.so.12"  # the loader's search
    with pytest.raises(ValueError, match=f"{name}=.*missing.so.*no such file"):
        settings.get(name, {name: str(tmp_path / "missing.so")})


def test_a_retired_kernel_says_what_to_ask_for():
    with pytest.raises(ValueError, match=r"DSA_VARLEN_KERNEL='sm90_gluon'.*retired.*\"sm90\""):
        settings.get(settings.KERNEL_ENV, {settings.KERNEL_ENV: "sm90_gluon"})


def test_an_unknown_setting_name_is_refused():
    with pytest.raises(ValueError, match="name: 'DSA_VARLEN_NOPE'"):
        settings.get("DSA_VARLEN_NOPE", {})


def test_validate_reads_every_setting_and_names_the_bad_one():
    assert settings.validate({}) == {n: s.default for n, s in settings.SETTINGS.items()}
    for name in settings.SETTINGS:
        with pytest.raises(ValueError, match=f"^{name}="):
            settings.validate({name: "/no/such/file/bogus"})


def test_the_reader_defaults_to_the_process_environment(monkeypatch):
    monkeypatch.setenv(settings.MODE_ENV, "off")
    monkeypatch.setenv(settings.TOPK_ENV, "vllm")
    assert settings.get(settings.MODE_ENV) == "off" and settings.get(settings.TOPK_ENV) == "vllm"


def test_the_markdown_table_has_a_row_per_setting_in_order():
    rows = settings.markdown_table().splitlines()[2:]
    assert [re.match(r"^\| `([A-Z_]+)` \|", r).group(1) for r in rows] == list(settings.SETTINGS)


# ---------------------------------------------------------------- deprecated names

def test_an_old_name_is_read_with_one_warning_naming_the_new(warnings_seen):
    for name, s in settings.SETTINGS.items():
        if s.default is None:
            continue
        value = "1" if s.default is False else str(s.default)
        got = settings.get(name, {s.old_name: value})
        assert got == settings.get(name, {name: value})
        assert settings.get(name, {s.old_name: value}) == got  # the second read: no warning
    olds = [m for m in warnings_seen if "deprecated" in m]
    assert len(olds) == sum(s.default is not None for s in settings.SETTINGS.values())
    for name, s in settings.SETTINGS.items():
        if s.default is not None:
            assert sum(m.startswith(f"vllm-dsa-varlen: {s.old_name} is deprecated")
                       and m.endswith(f"set {name} instead") for m in olds) == 1


def test_the_new_name_wins_over_the_old_with_a_warning(warnings_seen):
    env = {settings.MODE_ENV: "off", "VLLM_DSA_VARLEN": "stock"}
    assert settings.get(settings.MODE_ENV, env) == "off"
    assert settings.get(settings.MODE_ENV, env) == "off"
    assert len(warnings_seen) == 1
    assert "both" in warnings_seen[0] and "DSA_VARLEN wins" in warnings_seen[0]


def test_a_bad_value_under_an_old_name_names_the_old_name(warnings_seen):
    with pytest.raises(ValueError, match="^VLLM_DSA_VARLEN_TOPK='x' is not valid"):
        settings.get(settings.TOPK_ENV, {"VLLM_DSA_VARLEN_TOPK": "x"})


def test_the_triton_backend_is_read_as_own_with_one_warning(warnings_seen):
    for env in ({settings.BACKEND_ENV: "triton"}, {settings.BACKEND_ENV: "Triton"}):
        assert settings.get(settings.BACKEND_ENV, env) == "own"
    assert len(warnings_seen) == 1 and "DSA_VARLEN_BACKEND=own" in warnings_seen[0]


# ---------------------------------------------------------------- the guards

def _sources(*tops: str) -> list[str]:
    found = []
    for top in tops:
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found += [os.path.join(folder, n) for n in sorted(names)
                      if n.endswith((".py", ".sh"))]
    return found


def unknown_names(paths: list[str], allow_old: bool) -> list[str]:
    """Each name of the variable family in ``paths`` that is not a setting (or,
    with ``allow_old``, a setting's deprecated name), as ``file:line NAME``."""
    known = set(settings.SETTINGS)
    if allow_old:
        known |= {s.old_name for s in settings.SETTINGS.values()}
    found = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                found += [f"{os.path.relpath(path, ROOT)}:{number} {m.group()}"
                          for m in NAME.finditer(line) if m.group() not in known]
    return found


def environment_reads(path: str) -> list[str]:
    """Each place the module at ``path`` touches ``os.environ`` or
    ``os.getenv`` other than with a literal name outside the plugin's family,
    as ``file:line``: what only :mod:`vllm_dsa_varlen.settings` may do."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv", "environb") for a in node.names):
            found.append(node.lineno)
            continue
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "os" and node.attr in ("environ", "getenv", "environb")):
            continue
        key = None
        up = parents.get(node)
        if isinstance(up, ast.Subscript) and up.value is node:
            key = up.slice
        elif isinstance(up, ast.Attribute) and isinstance(parents.get(up), ast.Call):
            call = parents[up]
            key = call.args[0] if call.args else None
        elif isinstance(up, ast.Call) and up.func is node:
            key = up.args[0] if up.args else None
        literal = isinstance(key, ast.Constant) and isinstance(key.value, str)
        if not literal or NAME.search(key.value):
            found.append(node.lineno)
    rel = os.path.relpath(path, ROOT)
    return [f"{rel}:{n}" for n in sorted(set(found))]


def test_every_variable_the_package_names_is_in_the_table():
    found = unknown_names(_sources("vllm_dsa_varlen"), allow_old=True)
    assert found == [], (f"{found}: not a setting; add each to vllm_dsa_varlen/settings.py's "
                         "SETTINGS table and read it with settings.get")


def test_the_benchmarks_and_scripts_use_only_the_new_names():
    """(Their own variables, e.g. the setup scripts' DSA_VARLEN_VENV, are theirs.)"""
    found = [f for f in unknown_names(_sources("benchmarks", "scripts"), allow_old=False)
             if " VLLM_" in f]
    assert found == [], (f"{found}: an old name in vLLM's namespace; use the DSA_VARLEN* name "
                         "of vllm_dsa_varlen/settings.py (settings.MODE_ENV, ...)")


def test_only_the_settings_module_reads_the_environment_for_the_plugin():
    found = [where for path in _sources("vllm_dsa_varlen") if path.endswith(".py")
             and os.path.relpath(path, PACKAGE) != "settings.py"
             for where in environment_reads(path)]
    assert found == [], (f"{found} read os.environ for a DSA_VARLEN* setting (or a name that "
                         "cannot be told): add the variable to vllm_dsa_varlen/settings.py's "
                         "SETTINGS table and read it with settings.get")


def test_the_guards_find_what_they_guard(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom os import environ\n"
                   "a = os.environ.get('DSA_VARLEN_TOPK')\n"
                   "b = os.environ['VLLM_DSA_VARLEN']\n"
                   "name = 'X'\nc = os.getenv(name)\n"
                   "d = os.environ if name else {}\n"
                   "e = os.environ.get('TRITON_INTERPRET')\n"
                   "f = 'DSA_VARLEN_TOPKK'  # a typo\n")
    rel = os.path.relpath(bad, ROOT)
    assert environment_reads(str(bad)) == [f"{rel}:{n}" for n in (2, 3, 4, 6, 7)]
    assert unknown_names([str(bad)], allow_old=True) == [f"{rel}:9 DSA_VARLEN_TOPKK"]
    assert unknown_names([str(bad)], allow_old=False) == [f"{rel}:4 VLLM_DSA_VARLEN",
                                                          f"{rel}:9 DSA_VARLEN_TOPKK"]
