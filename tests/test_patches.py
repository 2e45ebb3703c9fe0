"""The patch registry: apply / undo / idempotence, and the plugin entry point."""

import importlib
import logging
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

import vllm_dsa_varlen  # noqa: E402
from vllm_dsa_varlen import config, patches  # noqa: E402


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
    for patch in patches.PATCHES:
        owner, name = _owner(patch)
        out[patch.key] = vars(owner).get(name, "<absent>")
    return out


def test_every_patch_is_documented_and_targets_vllm_0_27_1():
    keys = [p.key for p in patches.PATCHES]
    assert len(keys) == len(set(keys)), "a target is patched twice"
    for patch in patches.PATCHES:
        assert patch.reason.strip() and len(patch.reason) > 20, patch.key
        assert patch.upstream == "0.27.1"
        assert patch.module.startswith("vllm.")
        owner, name = _owner(patch)  # the target exists in the installed vLLM
        assert hasattr(owner, name), patch.key
        assert ":" in patch.replacement and patch.replacement.startswith("vllm_dsa_varlen.")


def test_apply_replaces_everything_and_undo_restores_exactly():
    before = _snapshot()
    applied = patches.apply_all()
    assert applied == [p.key for p in patches.PATCHES]
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
                           "vllm_dsa_varlen.vllm_0_27.utils.deep_gemm:fp8_fp4_paged_mqa_logits",
                           "a patch whose target does not exist, to test rollback")
    with pytest.raises(AttributeError, match="no_such_function_here"):
        patches.apply_all(patches.PATCHES[:3] + (broken,))
    assert patches.applied() == []
    assert _snapshot() == before


def test_undo_restores_an_attribute_that_was_inherited(monkeypatch):
    """A patch of an attribute the owner only inherits is undone by deleting it."""
    from vllm.v1.attention.backends.mla import indexer as ix

    cls = ix.DeepseekV32IndexerMetadataBuilder
    assert "get_cudagraph_support" in vars(cls) and "_init_reorder_batch_threshold" not in vars(cls)
    patch = patches.Patch(ix.__name__, "DeepseekV32IndexerMetadataBuilder._init_reorder_batch_threshold",
                          "vllm_dsa_varlen.config:read_mode", "inherited-attribute test patch")
    patches.apply_all((patch,))
    assert "_init_reorder_batch_threshold" in vars(cls)
    patches.undo_all()
    assert "_init_reorder_batch_threshold" not in vars(cls)


def test_register_applies_once_and_is_safe_to_repeat(monkeypatch):
    monkeypatch.delenv(config.MODE_ENV, raising=False)
    monkeypatch.delenv(config.BACKEND_ENV, raising=False)
    vllm_dsa_varlen.register()
    state = _snapshot()
    assert len(patches.applied()) == len(patches.PATCHES)
    vllm_dsa_varlen.register()
    vllm_dsa_varlen.register()
    assert _snapshot() == state and len(patches.applied()) == len(patches.PATCHES)


@pytest.mark.parametrize("version", ["0.28.0", "0.26.2", "1.0.0", "garbage"])
def test_register_on_another_vllm_warns_and_patches_nothing(monkeypatch, plugin_log, version):
    import vllm

    monkeypatch.delenv(config.MODE_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", version)
    before = _snapshot()
    vllm_dsa_varlen.register()
    assert patches.applied() == [] and _snapshot() == before
    warnings = [r for r in plugin_log if r.levelno == logging.WARNING]
    assert warnings and version in warnings[0].getMessage()


@pytest.mark.parametrize("version", ["0.27.1", "0.27.0", "0.27.1.dev12+gabc", "0.27.2rc1"])
def test_register_accepts_the_0_27_series(monkeypatch, version):
    import vllm

    monkeypatch.delenv(config.MODE_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", version)
    vllm_dsa_varlen.register()
    assert len(patches.applied()) == len(patches.PATCHES)


def test_register_off_patches_nothing(monkeypatch, plugin_log):
    monkeypatch.setenv(config.MODE_ENV, "off")
    before = _snapshot()
    vllm_dsa_varlen.register()
    assert patches.applied() == [] and _snapshot() == before
    assert any("off" in r.getMessage() for r in plugin_log)


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

targets = {p.module for p in patches.PATCHES}
vllm_dsa_varlen.register()
vllm_dsa_varlen.register()
assert not targets & set(sys.modules), targets & set(sys.modules)  # nothing imported early
assert patches.applied() == [] and len(patches.pending()) == len(patches.PATCHES)

# vLLM may set this after the plugins were loaded (VllmConfig does for DeepSeek V4);
# the indexer op's decorator reads it when its module is imported.
os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
import vllm.model_executor.layers.sparse_attn_indexer as sai
from vllm_dsa_varlen.vllm_0_27.model_executor.layers import sparse_attn_indexer as ours
assert sai.fp8_fp4_paged_mqa_logits is ours.fp8_fp4_paged_mqa_logits
assert hasattr(sai.sparse_attn_indexer, "__wrapped__"), "eager-break decorator bypassed"
import vllm.v1.attention.backends.mla.indexer as ix
assert ix.DeepseekV32IndexerMetadataBuilder.build.__wrapped__ is not None
assert patches.pending() == [] and len(patches.applied()) == len(patches.PATCHES)
assert not any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path)
assert sai.__loader__.get_source("vllm.model_executor.layers.sparse_attn_indexer")
patches.undo_all()
assert sai.fp8_fp4_paged_mqa_logits is not ours.fp8_fp4_paged_mqa_logits
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
    patches.apply_all(patches.PATCHES[:2])
    state = _snapshot()
    assert patches.apply_all(defer_unimported=True)  # the rest: their modules are imported
    assert patches.pending() == []
    for patch in patches.PATCHES[:2]:
        assert _snapshot()[patch.key] is state[patch.key]
    assert len(patches.applied()) == len(patches.PATCHES)


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
            "assert len(patches.pending()) + len(patches.applied()) == len(patches.PATCHES); "
            "import vllm.v1.attention.backends.mla.indexer as ix; "
            "assert hasattr(ix.DeepseekV32IndexerMetadataBuilder.build, '__wrapped__'); print('ok')")
    env = {k: v for k, v in os.environ.items() if k not in (config.MODE_ENV, config.BACKEND_ENV)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
