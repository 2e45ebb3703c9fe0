"""warmup.precompile_for: the device rule and the run-length hints it compiles."""

import pytest
import torch

from vllm_dsa_varlen import warmup
from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
from vllm_dsa_varlen.ops import launcher


def test_cpu_device_compiles_nothing(monkeypatch):
    monkeypatch.setattr(launcher, "precompile", lambda **kw: pytest.fail("compiled on the CPU"))
    assert warmup.precompile_for(heads=64, head_size=132, page=64, device=torch.device("cpu"),
                                 max_run_len=4) is None


@pytest.mark.parametrize("next_n,hints", [(1, (1,)), (2, (1, 2)), (3, (1, 2, 3)),
                                          (4, (1, 2, 4)), (6, (1, 2, 4, 6)), (9, (1, 2, 4, 8, 9))])
def test_cuda_device_compiles_every_hint_bucket(monkeypatch, next_n, hints):
    """The hints cover every kernel variant a step with 1..next_n tokens selects."""
    seen = []
    monkeypatch.setattr(launcher, "precompile", lambda **kw: seen.append(kw) or 0.5)
    took = warmup.precompile_for(heads=64, head_size=132, page=64, device="cuda:0",
                                 max_run_len=next_n)
    assert took == 0.5
    assert [kw["max_run_lens"] for kw in seen] == [hints]
    assert (seen[0]["heads"], seen[0]["dim"], seen[0]["page"]) == (64, 128, 64)
    for n in range(1, next_n + 1):  # the sm_90 kernel's builds and portable row groups
        for heads in ck.LAUNCHER_HEADS:
            assert any(ck.defines_for(n, "fp32", heads=heads)
                       == ck.defines_for(h, "fp32", heads=heads) for h in hints)
        assert any((n <= 2) == (h <= 2) for h in hints)


def test_unknown_head_count_compiles_every_supported_count(monkeypatch):
    seen = []
    monkeypatch.setattr(launcher, "precompile", lambda **kw: seen.append(kw["heads"]) or 0.25)
    took = warmup.precompile_for(heads=None, head_size=132, page=64, device="cuda",
                                 max_run_len=2)
    assert seen == list(launcher.SUPPORTED_HEADS) and took == 0.25 * len(launcher.SUPPORTED_HEADS)
