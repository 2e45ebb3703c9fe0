"""warmup: the shape a builder's kernels see, and precompile's device rule."""

from types import SimpleNamespace

import pytest
import torch

from vllm_dsa_varlen import ops, warmup
from vllm_dsa_varlen.ops import triton_paged_mqa_logits as tk


def _cfg(heads):
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(index_n_heads=heads)))


def test_kernel_shape_from_config_and_spec():
    spec = SimpleNamespace(block_size=64, head_size=132)
    assert warmup.kernel_shape(_cfg(32), spec) == ((32,), 128, 64)
    # The storage page wins over the logical block size (DeepSeek V4's compressed cache).
    v4 = SimpleNamespace(block_size=256, storage_block_size=64, head_size=132)
    assert warmup.kernel_shape(_cfg(64), v4) == ((64,), 128, 64)
    # Head count unknown: every supported count.
    assert warmup.kernel_shape(SimpleNamespace(), spec)[0] == tk.SUPPORTED_HEADS


def test_cpu_device_compiles_nothing(monkeypatch):
    monkeypatch.setattr(ops, "precompile", lambda **kw: pytest.fail("compiled on the CPU"))
    spec = SimpleNamespace(block_size=64, head_size=132)
    assert warmup.precompile_for(_cfg(64), spec, torch.device("cpu"), 4) is None


@pytest.mark.parametrize("next_n,hints", [(1, (1,)), (2, (1, 2)), (3, (1, 2, 3)),
                                          (4, (1, 2, 4)), (6, (1, 2, 4, 6)), (9, (1, 2, 4, 8, 9))])
def test_cuda_device_compiles_every_hint_bucket(monkeypatch, next_n, hints):
    """The hints cover every kernel variant a step with 1..next_n tokens selects."""
    seen = []
    monkeypatch.setattr(ops, "precompile", lambda **kw: seen.append(kw) or 0.5)
    spec = SimpleNamespace(block_size=64, head_size=132)
    took = warmup.precompile_for(_cfg(64), spec, "cuda:0", next_n)
    assert took == 0.5
    assert [kw["max_run_lens"] for kw in seen] == [hints]
    assert seen[0]["heads"] == 64 and seen[0]["dim"] == 128 and seen[0]["page"] == 64
    # Every run length 1..next_n falls in a bucket that was compiled.
    from vllm_dsa_varlen.ops import gluon_paged_mqa_logits as gk
    for n in range(1, next_n + 1):
        assert any(gk.rows_max_for(64, n) == gk.rows_max_for(64, h) for h in hints)
        assert any((n <= 2) == (h <= 2) for h in hints)
