"""The patch registry: lines, apply / undo / idempotence, and the plugin entry point.

Runs against whichever vLLM line is installed (0.27, 0.33 or 0.34): ``LINE_PATCHES``
is that line's patch set, and every test applies, undoes and inspects it.
Version dispatch in ``register()`` is checked for every line without applying
another line's patches to the installed vLLM.
"""

import importlib
import logging
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

import vllm_dsa_varlen  # noqa: E402
from vllm_dsa_varlen import config, patches  # noqa: E402

LINE = patches.installed_line()
if LINE not in patches.LINES:
    pytest.skip(f"installed vLLM line {LINE} has no patch set", allow_module_level=True)
LINE_PATCHES = patches.for_line(LINE)


@pytest.fixture(autouse=True)
def clean_registry():
    patches.undo_all()
    yield
    patches.undo_all()


def _owner(patch):
    owner = importlib.import_module(patch.module)
    *parents, name = patch.attribute.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def _snapshot():
    """The raw stored value (or absence) of every patched attribute."""
    out = {}
    for patch in LINE_PATCHES:
        owner, name = _owner(patch)
        out[patch.key] = vars(owner).get(name, "<absent>")
    return out


def test_every_patch_is_documented_and_names_its_line():
    assert set(patches.LINES) == set(patches.PACKAGES) == {"0.27", "0.33", "0.34"}
    for line, release in patches.LINES.items():
        assert patches.line_of(release) == line
        line_patches = patches.for_line(line)
        assert line_patches, f"line {line} has no patches"
        keys = [p.key for p in line_patches]
        assert len(keys) == len(set(keys)), f"line {line}: a target is patched twice"
        for patch in line_patches:
            assert patch.upstream == release and patch.line == line, patch
            # A line's replacements live in that line's package (or are version-free).
            ours = patch.replacement.partition(":")[0]
            other = [f"vllm_dsa_varlen.{pkg}" for pkg in set(patches.PACKAGES.values())
                     if pkg != patches.PACKAGES[line]]
            assert not any(ours.startswith(o) for o in other), patch
    assert sum(len(patches.for_line(line)) for line in patches.LINES) == len(patches.PATCHES)
    for patch in patches.PATCHES:
        assert patch.reason.strip() and len(patch.reason) > 20, patch.key
        assert patch.module.startswith("vllm.")
        assert ":" in patch.replacement and patch.replacement.startswith("vllm_dsa_varlen.")
    for patch in LINE_PATCHES:  # the installed line's targets exist in the installed vLLM
        owner, name = _owner(patch)
        assert hasattr(owner, name), patch.key
        patches._resolve(patch.replacement)  # and its replacement imports


def test_line_of_versions():
    assert patches.line_of("0.33.0") == "0.33"
    assert patches.line_of("0.27.1.dev12+gabc") == "0.27"
    assert patches.line_of("1.0") == "1.0"
    assert patches.line_of("garbage") is None and patches.line_of("7") is None
    assert patches.for_line("0.28") == () and patches.for_line(None) == ()
    with pytest.raises(ValueError, match="line"):
        patches.apply_all(line="0.28")


def test_apply_applies_only_the_installed_line():
    applied = patches.apply_all()
    assert applied == [p.key for p in LINE_PATCHES]
    assert {p.line for p in patches.applied()} == {LINE}


def test_another_line_cannot_be_applied_on_top():
    other = next(line for line in patches.LINES if line != LINE)
    patches.apply_all()
    with pytest.raises(RuntimeError, match="undo_all"):
        patches.apply_all(line=other)
    assert {p.line for p in patches.applied()} == {LINE}


def test_apply_replaces_everything_and_undo_restores_exactly():
    before = _snapshot()
    applied = patches.apply_all()
    assert applied == [p.key for p in LINE_PATCHES]
    during = _snapshot()
    for key in before:
        assert during[key] is not before[key], f"{key} was not replaced"
    assert [p.key for p in patches.applied()] == applied
    assert patches.undo_all() == applied
    after = _snapshot()
    for key in before:
        assert after[key] is before[key], f"{key} not restored exactly"
    assert patches.applied() == []


def test_apply_is_idempotent():
    first = patches.apply_all()
    state = _snapshot()
    assert patches.apply_all() == []
    assert _snapshot() == state  # same objects, nothing wrapped twice
    assert len(patches.applied()) == len(first)
    for key, value in state.items():
        assert _snapshot()[key] is value


def test_wrapping_patches_call_the_original(monkeypatch):
    """A wrapped stock method still runs stock's code: the original is reached."""
    from vllm.v1.attention.backends.mla import indexer as ix

    stock_init = ix.DeepseekV32IndexerMetadataBuilder.__init__
    patches.apply_all()
    wrapped = ix.DeepseekV32IndexerMetadataBuilder.__init__
    assert wrapped is not stock_init and wrapped.__wrapped__ is stock_init
    assert patches.original(ix.__name__, "DeepseekV32IndexerMetadataBuilder.__init__") is stock_init


def test_failed_apply_rolls_back(monkeypatch):
    before = _snapshot()
    broken = patches.Patch("vllm.utils.deep_gemm", "no_such_function_here",
                           "vllm_dsa_varlen.config:platform_refusal",
                           "a patch whose target does not exist, to test rollback",
                           upstream=patches.LINES[LINE])
    with pytest.raises(AttributeError, match="no_such_function_here"):
        patches.apply_all(LINE_PATCHES[:3] + (broken,))
    assert patches.applied() == []
    assert _snapshot() == before


def test_undo_restores_an_attribute_that_was_inherited(monkeypatch):
    """A patch of an attribute the owner only inherits is undone by deleting it."""
    from vllm.v1.attention.backends.mla import indexer as ix

    cls = ix.DeepseekV32IndexerMetadataBuilder
    assert "get_cudagraph_support" in vars(cls) and "_init_reorder_batch_threshold" not in vars(cls)
    patch = patches.Patch(ix.__name__, "DeepseekV32IndexerMetadataBuilder._init_reorder_batch_threshold",
                          "vllm_dsa_varlen.config:platform_refusal",
                          "inherited-attribute test patch",
                          upstream=patches.LINES[LINE])
    patches.apply_all((patch,))
    assert "_init_reorder_batch_threshold" in vars(cls)
    patches.undo_all()
    assert "_init_reorder_batch_threshold" not in vars(cls)


def test_register_applies_once_and_is_safe_to_repeat(monkeypatch):
    monkeypatch.delenv(config.MODE_ENV, raising=False)
    monkeypatch.delenv(config.BACKEND_ENV, raising=False)
    vllm_dsa_varlen.register()
    state = _snapshot()
    assert len(patches.applied()) == len(LINE_PATCHES)
    vllm_dsa_varlen.register()
    vllm_dsa_varlen.register()
    assert _snapshot() == state and len(patches.applied()) == len(LINE_PATCHES)


@pytest.mark.parametrize("version", ["0.28.0", "0.26.2", "0.32.1", "0.35.0", "1.0.0", "garbage"])
def test_register_on_another_vllm_warns_and_patches_nothing(monkeypatch, plugin_log, version):
    import vllm

    monkeypatch.delenv(config.MODE_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", version)
    before = _snapshot()
    vllm_dsa_varlen.register()
    assert patches.applied() == [] and _snapshot() == before
    warnings = [r for r in plugin_log if r.levelno == logging.WARNING]
    assert warnings and version in warnings[0].getMessage()
    # it names the lines it has patches for: the registry's, as SUPPORTED_LINES
    assert all(f"{line}.x" in warnings[0].getMessage() for line in patches.LINES)
    assert vllm_dsa_varlen.SUPPORTED_LINES == tuple(
        tuple(int(p) for p in line.split(".")) for line in patches.LINES) == ((0, 27), (0, 33), (0, 34))


@pytest.mark.parametrize("version,line", [
    ("0.27.1", "0.27"), ("0.27.0", "0.27"), ("0.27.1.dev12+gabc", "0.27"), ("0.27.2rc1", "0.27"),
    ("0.33.0", "0.33"), ("0.33.1", "0.33"), ("0.33.0rc2", "0.33"), ("0.33.1.dev3+gdef", "0.33"),
    ("0.34.0", "0.34"), ("0.34.1", "0.34"), ("0.34.0rc1", "0.34"),
])
def test_register_dispatches_on_the_vllm_line(monkeypatch, version, line):
    """register() asks for the patches of the running vLLM's line (recorded,
    so another line's patches never touch the installed vLLM)."""
    import vllm

    asked = []
    monkeypatch.delenv(config.MODE_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.setattr(patches, "apply_all", lambda **kw: asked.append(kw))
    # the installed source is one line's: the other line's would differ from it
    monkeypatch.setattr(patches, "upstream_differences", lambda line, api_only=False: [])
    vllm_dsa_varlen.register()
    assert asked == [dict(line=line, defer_unimported=True)]
    assert patches.for_line(line)


def test_register_applies_the_installed_lines_patches(monkeypatch):
    monkeypatch.delenv(config.MODE_ENV, raising=False)
    vllm_dsa_varlen.register()
    assert [p.key for p in patches.applied() + patches.pending()] == [p.key for p in LINE_PATCHES]


def test_register_off_patches_nothing(monkeypatch, plugin_log):
    monkeypatch.setenv(config.MODE_ENV, "off")
    before = _snapshot()
    vllm_dsa_varlen.register()
    assert patches.applied() == [] and _snapshot() == before
    assert any("off" in r.getMessage() for r in plugin_log)


def test_register_stock_applies_only_the_deepgemm_api_adapters(monkeypatch, plugin_log):
    """``DSA_VARLEN=stock``: the baseline mode applies the line's DeepGEMM
    API adapters and nothing else (no builder patch), and says so."""
    monkeypatch.setenv(config.MODE_ENV, "stock")
    before = _snapshot()
    vllm_dsa_varlen.register()
    keys = [p.key for p in patches.applied() + patches.pending()]
    want = [p.key for p in LINE_PATCHES if p.api]
    assert keys == want
    assert all(".indexer:" not in k for k in keys)  # no builder patch
    after = _snapshot()
    assert {k for k in before if before[k] is not after[k]} <= set(want)
    assert any("stock" in r.getMessage() for r in plugin_log)
    patches.undo_all()
    assert _snapshot() == before


def test_api_patches_are_call_adapters_only():
    """Only DeepGEMM call sites are marked ``api``: the deep_gemm wrappers and the
    indexer op's module globals that name them, never a builder or metadata class."""
    for p in patches.PATCHES:
        if p.api:
            assert p.module.endswith(("utils.deep_gemm", "sparse_attn_indexer")), p.key
            assert "mqa_logits" in p.attribute, p.key


def test_register_rejects_bad_settings(monkeypatch):
    monkeypatch.setenv(config.MODE_ENV, "yes")
    with pytest.raises(ValueError, match=config.MODE_ENV):
        vllm_dsa_varlen.register()
    monkeypatch.setenv(config.MODE_ENV, "auto")
    monkeypatch.setenv(config.BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match=config.BACKEND_ENV):
        vllm_dsa_varlen.register()
    assert patches.applied() == []


DEFERRED = r"""
import os, sys
import vllm_dsa_varlen
from vllm_dsa_varlen import patches

line_patches = patches.for_line(patches.installed_line())
targets = {p.module for p in line_patches}
vllm_dsa_varlen.register()
vllm_dsa_varlen.register()
assert not targets & set(sys.modules), targets & set(sys.modules)  # nothing imported early
assert patches.applied() == [] and len(patches.pending()) == len(line_patches)

# vLLM may set this after the plugins were loaded (VllmConfig does for DeepSeek V4);
# the indexer op's decorator reads it when its module is imported.
os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
import vllm.model_executor.layers.sparse_attn_indexer as sai
stock_call = patches.original(sai.__name__, "fp8_fp4_paged_mqa_logits")
sai_patch = next(p for p in line_patches
                 if p.module == sai.__name__ and p.attribute == "fp8_fp4_paged_mqa_logits")
assert sai.fp8_fp4_paged_mqa_logits is patches.replacement_of(sai_patch)
assert sai.fp8_fp4_paged_mqa_logits is not stock_call
assert hasattr(sai.sparse_attn_indexer, "__wrapped__"), "eager-break decorator bypassed"
import vllm.v1.attention.backends.mla.indexer as ix
assert ix.DeepseekV32IndexerMetadataBuilder.build.__wrapped__ is not None
for name in {p.module for p in line_patches}:
    __import__(name)
assert patches.pending() == [] and len(patches.applied()) == len(line_patches)
assert not any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path)
assert sai.__loader__.get_source("vllm.model_executor.layers.sparse_attn_indexer")
patches.undo_all()
assert sai.fp8_fp4_paged_mqa_logits is stock_call
print("ok")
"""


def test_register_defers_patches_until_their_module_is_imported():
    import os
    import pathlib

    root = pathlib.Path(vllm_dsa_varlen.__file__).parent.parent
    env = {k: v for k, v in os.environ.items()
           if k not in (config.MODE_ENV, config.BACKEND_ENV, "VLLM_USE_BREAKABLE_CUDAGRAPH")}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", DEFERRED], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_deferred_and_eager_application_do_not_double_apply():
    patches.apply_all(LINE_PATCHES[:2])
    state = _snapshot()
    assert patches.apply_all(defer_unimported=True)  # the rest: their modules are imported
    assert patches.pending() == []
    for patch in LINE_PATCHES[:2]:
        assert _snapshot()[patch.key] is state[patch.key]
    assert len(patches.applied()) == len(LINE_PATCHES)


def test_importing_the_package_does_not_import_vllm():
    import os
    import pathlib

    root = pathlib.Path(vllm_dsa_varlen.__file__).parent.parent
    code = ("import sys, vllm_dsa_varlen, vllm_dsa_varlen.config, vllm_dsa_varlen.plan, "
            "vllm_dsa_varlen.varlen_ids, vllm_dsa_varlen.patches, vllm_dsa_varlen.ops.reference; "
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "PYTHONPATH": str(root)})


def test_entry_point_is_declared():
    import pathlib
    import tomllib

    root = pathlib.Path(vllm_dsa_varlen.__file__).parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["dsa_varlen"]
    module, _, func = target.partition(":")
    assert getattr(importlib.import_module(module), func) is vllm_dsa_varlen.register


def test_vllm_plugin_loader_runs_register():
    """vLLM's own loader finds the installed entry point and runs register()."""
    import importlib.metadata as md
    import os

    eps = [e for e in md.entry_points(group="vllm.general_plugins")
           if e.value == "vllm_dsa_varlen:register"]
    if not eps:
        pytest.skip("package not installed (run scripts/setup.sh): no entry point to load")
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm_dsa_varlen import patches; "
            "n = len(patches.for_line(patches.installed_line())); "
            "assert len(patches.pending()) + len(patches.applied()) == n; "
            "import vllm.v1.attention.backends.mla.indexer as ix; "
            "assert hasattr(ix.DeepseekV32IndexerMetadataBuilder.build, '__wrapped__'); print('ok')")
    env = {k: v for k, v in os.environ.items() if k not in (config.MODE_ENV, config.BACKEND_ENV)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_init_then_runs_stock_init_first_then_the_setup():
    order = []

    class Stock:
        def __init__(self, a, *, b=0):
            """stock's docstring"""
            order.append(("init", a, b))
            self.a = a

    def setup(obj):
        order.append(("setup", obj.a))

    wrapped = patches.init_then(setup)(Stock.__init__)
    assert wrapped.__doc__ == "stock's docstring" and wrapped.__wrapped__ is Stock.__init__
    obj = Stock.__new__(Stock)
    wrapped(obj, 3, b=4)
    assert order == [("init", 3, 4), ("setup", 3)]


def test_every_patch_has_one_recorded_shape():
    """SHAPES holds one entry per patch of each line, and nothing else."""
    for line in patches.LINES:
        assert set(patches.SHAPES[line]) == {p.key for p in patches.for_line(line)}, line
    assert set(patches.SHAPES) == set(patches.LINES)


def test_the_installed_vllm_has_what_its_lines_patches_expect():
    assert patches.upstream_differences(LINE) == []
    assert patches.upstream_differences(LINE, api_only=True) == []


@pytest.mark.parametrize("mode", ["auto", "stock"])
def test_register_leaves_a_differing_vllm_stock_and_names_the_difference(monkeypatch, plugin_log,
                                                                         mode):
    """A release of the line whose source changed what one patch relies on (a
    parameter added to a patched function here) is left unpatched: nothing
    applied or pending, every attribute stock's, a warning naming the target
    and both shapes."""
    from vllm_dsa_varlen import upstream

    target = next((p for p in LINE_PATCHES if p.api or mode == "auto"), None)
    if target is None:
        pytest.skip(f"vLLM {LINE}'s stock mode applies no patch: nothing to compare")
    real = upstream.shape
    changed = {}

    def shape(module, attribute):
        got = real(module, attribute)
        if f"{module}:{attribute}" == target.key:
            got = changed[target.key] = got.replace(")", ", new_arg)", 1)
        return got

    monkeypatch.setenv(config.MODE_ENV, mode)
    monkeypatch.setattr(upstream, "shape", shape)
    before = _snapshot()
    vllm_dsa_varlen.register()
    assert patches.applied() == [] and patches.pending() == [] and _snapshot() == before
    warnings = [r.getMessage() for r in plugin_log if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and target.key in warnings[0] and changed[target.key] in warnings[0]
    assert patches.SHAPES[LINE][target.key] in warnings[0]


def test_the_registry_printout_says_whether_the_installed_vllm_would_be_patched(monkeypatch):
    assert "has what every patch" in patches.describe_installed()
    monkeypatch.setattr(patches, "upstream_differences",
                        lambda line, api_only=False: [f"{LINE_PATCHES[0].key}: changed"])
    said = patches.describe_installed()
    assert "not patched" in said and f"- {LINE_PATCHES[0].key}: changed" in said


@pytest.mark.parametrize("module,first", [("vllm_dsa_varlen.patches", "| module |"),
                                          ("vllm_dsa_varlen.settings", "| variable |")])
def test_the_registry_and_the_settings_print_as_modules_without_a_warning(module, first):
    """``python -m`` of either prints its table, and nothing on stderr (the
    package does not import them first, which would make runpy warn)."""
    import os
    import pathlib

    root = pathlib.Path(vllm_dsa_varlen.__file__).parent.parent
    out = subprocess.run([sys.executable, "-W", "default", "-m", module], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0 and out.stdout.startswith(first), out.stderr[-2000:]
    assert "Warning" not in out.stderr, out.stderr[-2000:]
