"""vllm_dsa_varlen/bench_launch.py (``vllm-dsa-varlen-bench --launch-host``): its
CPU mode, the CUDA kernel's launch on CPU tensors with the driver stubbed."""

import re

import pytest

from vllm_dsa_varlen import bench, bench_launch


def test_fake_launch_times_every_selected_case_and_prints_the_table(capsys):
    """``--launch-host --fake``: one table row per selected case (substrings,
    space- or comma-separated), each a positive host time per launch."""
    assert bench.main(["--launch-host", "--fake", "--calls", "1", "--cases", "B64 L8K,L32K"]) == 0
    out = capsys.readouterr().out
    assert "| case | launch (driver stubbed, CPU tensors) | host µs/call |" in out
    rows = re.findall(r"^\| (B\S+ L\S+ \S+) \| now \(cuda-python, parameter block\) \| "
                      r"([0-9.]+) \|$", out, re.M)
    assert [r[0] for r in rows] == ["B64 L8K 4tok", "B64 L32K 2tok"]
    assert all(float(us) > 0 for _, us in rows)


def test_without_a_gpu_the_launch_host_mode_takes_the_fake_launch(capsys, monkeypatch):
    monkeypatch.setattr(bench_launch.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--launch-host", "--calls", "1", "--cases", "B1 L8K"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no CUDA GPU: timing the fake launch (--fake)")
    assert "| B1 L8K 4tok | now (cuda-python, parameter block) |" in out


def test_fake_launch_records_one_driver_launch_per_call():
    """The stubs count what the timing loop does: one ``cuLaunchKernel`` per call."""
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.workloads import make_decode_step

    import torch

    step = make_decode_step([2, 3], [90, 140], heads=64)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    with bench_launch.stubbed(ck) as (fake, encodes, _):
        sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1],
                        programs=4)
        for _ in range(3):
            ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                      step.max_context_len, torch.empty(rows.num_rows, step.max_context_len),
                      schedule=sched)
    assert len(fake.launches) == 3 and len(encodes) == 2  # descriptors encoded once


@pytest.mark.parametrize("argv, message", [
    (["--launch-host", "--calls", "0", "--fake"], "--calls: expected an int >= 1"),
])
def test_bad_launch_host_arguments_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        bench.main(argv)


@pytest.mark.parametrize("argv, message", [
    (["--fake"], "--fake only with --launch-host"),
    (["--calls", "3"], "--calls only with --launch-host"),
    (["--base", "HEAD", "--cpu"], "--base only with --launch-host"),
    (["--rounds", "3", "--launch-host"], "--rounds only with --plan-timing"),
    (["--launch-host", "--plan-timing"], "not allowed with argument"),
])
def test_mode_options_need_their_mode(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
