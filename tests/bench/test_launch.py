"""vllm_dsa_varlen/bench/launch.py (``vllm-dsa-varlen-bench --launch-host``): its
CPU mode, the CUDA kernel's launch on CPU tensors with the driver stubbed."""

import re

import pytest

from vllm_dsa_varlen.bench import launch as bench_launch
from vllm_dsa_varlen.bench import logits as bench


PATHS = ["prepared launch (addresses only)", "launch (schedule given)", "launcher sm90_cuda",
         "launcher auto", "launcher auto, no out", "indexer op 0.33 (glue + launcher)",
         "indexer op 0.27 (glue + launcher)", "top-k decode_topk"]


def _rows(out):
    return re.findall(r"^\| (B\S+ L\S+ \S+) \| ([^|]+) \| (\S+) \| ([0-9.]+) \| "
                      r"([0-9.]+)-([0-9.]+) \|$", out, re.M)


def test_fake_launch_times_every_selected_case_and_prints_the_table(capsys):
    """``--launch-host --fake``: one table row per selected case (substrings,
    space- or comma-separated) and path, each a positive host time per call
    inside its rounds' range."""
    assert bench.main(["--launch-host", "--fake", "--calls", "1", "--cases", "B64 L8K,L32K"]) == 0
    out = capsys.readouterr().out
    assert ("| case | path (driver stubbed, CPU tensors) | revision | host µs/call | rounds |"
            in out)
    rows = _rows(out)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (case, path, "now") for case in ("B64 L8K 4tok", "B64 L32K 2tok", "B16 L32K 1tok")
        for path in PATHS]
    assert all(0 < float(lo) <= float(us) <= float(hi) for *_, us, lo, hi in rows)


def test_fake_launch_times_a_base_revision_beside(capsys):
    """``--base REV``: the launcher and launch of that revision's ``ops``
    package, imported beside this one and timed in the same rounds."""
    assert bench.main(["--launch-host", "--fake", "--calls", "1", "--cases", "B1 ",
                       "--base", "HEAD"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [(r[1], r[2]) for r in rows if r[2] == "now"] == [(p, "now") for p in PATHS]
    base = [r[1] for r in rows if r[2] == "HEAD"]
    assert PATHS[1:] == [p for p in base if p != PATHS[0]]  # no prepared launch before it came


def test_a_base_folder_imports_its_ops_beside_this_ones(tmp_path):
    """``--base DIR``: a folder holding ``vllm_dsa_varlen/ops`` (a host without
    the git history) gives that tree's modules under another package name,
    not this revision's, with their own build caches."""
    import os
    import shutil

    from vllm_dsa_varlen.ops import cuda_topk, launcher

    shutil.copytree(os.path.join(bench_launch.ROOT, "vllm_dsa_varlen", "ops"),
                    tmp_path / "vllm_dsa_varlen" / "ops")
    marker = tmp_path / "vllm_dsa_varlen" / "ops" / "cuda_topk.py"
    marker.write_text(marker.read_text() + "\nFROM_THE_FOLDER = True\n")
    base = bench_launch.base_ops(str(tmp_path))
    assert base.ct is not cuda_topk and base.launcher is not launcher
    assert base.ct.__name__.startswith("dsa_base_") and base.ct.FROM_THE_FOLDER
    assert not hasattr(cuda_topk, "FROM_THE_FOLDER") and base.ct._LOADED is not cuda_topk._LOADED


def test_a_base_folders_glue_calls_that_folders_launcher(tmp_path):
    """``--base DIR``: the indexer op's glue of that tree, its ``ops`` imports
    pointed at that tree's package (so the base glue times the base launcher)."""
    import os
    import shutil

    for path in ["vllm_dsa_varlen/ops", *bench_launch.GLUE.values()]:
        src = os.path.join(bench_launch.ROOT, path)
        if os.path.isdir(src):
            shutil.copytree(src, tmp_path / path)
        else:
            os.makedirs(os.path.dirname(tmp_path / path), exist_ok=True)
            shutil.copy(src, tmp_path / path)
    base = bench_launch.base_ops(str(tmp_path))
    assert base.g33 is not None and base.g27 is not None
    assert base.g33._launcher() is base.launcher and base.g27._launcher() is base.launcher
    only_ops = tmp_path / "only-ops"
    shutil.copytree(tmp_path / "vllm_dsa_varlen" / "ops", only_ops / "vllm_dsa_varlen" / "ops")
    bare = bench_launch.base_ops(str(only_ops))
    assert bare.g33 is None and bare.g27 is None  # a tree without the glue: no glue paths


def test_glue_paths_run_the_lines_glue_then_one_launch_each_call():
    """The indexer op paths call each line's kernel-call replacement with a
    tagged varlen step and reach the launcher: one stubbed ``cuLaunchKernel``
    per call, float32 logits ``[R, longest]``."""
    import torch

    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.bench.workloads import random_decode_step

    ops = bench_launch.this_ops()
    step = random_decode_step(3, 4, 300, heads=64)
    rows = step.rows
    sched = ck.plan_torch(rows.indices, rows.context_lens.view(-1, 1), step.max_context_len,
                          rows.block_table.shape[1], programs=4)
    with bench_launch.fake_hopper(), bench_launch.stubbed_launcher(ops, sched) as (fake, *_):
        paths = bench_launch.glue_paths(ops, step, 4)
        assert sorted(paths) == sorted(PATHS[5:7])
        for name, fn in paths.items():
            before = len(fake.launches)
            logits = fn()
            assert len(fake.launches) == before + 1, name
            assert logits.dtype == torch.float32
            assert tuple(logits.shape) == (rows.num_rows, step.max_context_len), name


def test_without_a_gpu_the_launch_host_mode_takes_the_fake_launch(capsys, monkeypatch):
    monkeypatch.setattr(bench_launch.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--launch-host", "--calls", "1", "--cases", "B1 L8K"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no CUDA GPU: timing the fake launch (--fake)")
    assert "| B1 L8K 4tok | launcher auto | now |" in out


def test_the_fake_leaves_torch_and_the_modules_as_they_were():
    """The stubs come off: ``Tensor.is_cuda``, the device queries and the
    kernel module's functions are the real ones again, its caches empty."""
    import types

    import torch
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.ops import launcher

    before = (ck.load, ck.plan, ck.available, ck._encode, torch.cuda.get_device_capability,
              torch.cuda.is_current_stream_capturing, torch.cuda.current_device)
    ops = types.SimpleNamespace(launcher=launcher, ck=ck)
    with bench_launch.fake_hopper(), bench_launch.stubbed_launcher(ops, None):
        assert torch.zeros(1).is_cuda
    assert not torch.zeros(1).is_cuda
    assert (ck.load, ck.plan, ck.available, ck._encode, torch.cuda.get_device_capability,
            torch.cuda.is_current_stream_capturing, torch.cuda.current_device) == before
    assert not ck._DESCRIPTORS and not launcher._ROUTES
    from vllm_dsa_varlen.ops import cuda_topk as ct

    before = (ct.load, ct._stream, ct._current_device, ct.num_sms, ct.cb.driver, ct._last)
    with bench_launch.fake_hopper(), bench_launch.stubbed_topk(ct) as fake:
        ct.decode_topk(torch.zeros(3, 5000), torch.full((3,), 4000), 7)
        assert len(fake.launches) == 1
        assert ct._last is not None and ct._last.kern.fn == "decode_topk"  # the stub's build
    assert (ct.load, ct._stream, ct._current_device, ct.num_sms, ct.cb.driver,
            ct._last) == before


def test_fake_launch_records_one_driver_launch_per_call():
    """The stubs count what the timing loop does: one ``cuLaunchKernel`` per call."""
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.bench.workloads import make_decode_step

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
    (["--launch-host", "--calls", "0", "--fake"], "argument --calls: expected an int >= 1"),
    (["--launch-host", "--fake", "--cases", "B3"], "--cases: 'B3' matches none"),
])
def test_bad_launch_host_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--fake"], "--fake only with --launch-host"),
    (["--calls", "3"], "--calls only with --launch-host"),
    (["--base", "HEAD", "--cpu"], "--base only with --launch-host"),
    (["--rounds", "3", "--launch-host"], "--rounds only with --plan-timing"),
    (["--launch-host", "--fake", "--topk-lib", "x.so"],
     "--topk-lib only with --builds or --launch-host (GPU)"),
    (["--launch-host", "--plan-timing"], "not allowed with argument"),
])
def test_mode_options_need_their_mode(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_the_gpu_summary_names_each_case_and_the_target(capsys):
    """The short table that ends a GPU run: one row per case, the floor, the
    prepared launch and the launcher's "auto" (given logits and its own), "–"
    for a path not timed, the target met only at <= 20 µs through "auto"."""
    table = [("B1", "cuLaunchKernel alone (cuda-python)", 6.0, 0, 0, 0),
             ("B1", "prepared launch (addresses only)", 8.0, 0, 0, 0),
             ("B1", "launcher auto (as set)", 19.9, 0, 0, 0),
             ("B1", "launcher auto, no out", 22.0, 0, 0, 0),
             ("B64", "launcher auto (as set)", 20.1, 0, 0, 0),
             ("B64", "launcher portable", 9.0, 0, 0, 0)]
    bench_launch.print_summary(table)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2] == "| B1 | 6.0 | 8.0 | 19.9 | 22.0 | yes |"
    assert lines[-1] == "| B64 | – | – | 20.1 | – | no |"
    assert "target: launcher auto <= 20" in lines[-5]


@pytest.mark.gpu
def test_topk_paths_call_vllms_op_as_its_eager_step_does_and_ours_meets_the_contract():
    """``--launch-host --topk-lib``'s top-k paths on a drafter-like step (16
    rows of one token): vLLM's op gets the 0.27.1 eager call's arguments
    (``cooperative_topk`` up to 32 rows, the step's longest row as
    ``max_seq_len``), and the plugin's dispatch and ``decode_topk`` write the
    reference's top-k into the shared output, poisoned before each."""
    import types

    import torch
    from vllm_dsa_varlen import topk
    from vllm_dsa_varlen.ops.common import capability
    from vllm_dsa_varlen.ops.reference import topk_selection_ok
    from vllm_dsa_varlen.bench.workloads import random_decode_step

    if capability(torch.device("cuda")) != (9, 0):
        pytest.skip("the project's top-k kernel is built for sm_90")
    seen = []

    def cooperative_topk(logits, lens, idx, work, k, max_seq_len):
        seen.append((logits.shape, tuple(lens.shape), tuple(idx.shape), k, max_seq_len))

    ops = types.SimpleNamespace(cooperative_topk=cooperative_topk)
    step = random_decode_step(16, 1, 4096, heads=64, device="cuda", seed=5)
    t = bench_launch.topk_inputs(step)
    paths = bench_launch.topk_paths(t, ops)
    assert list(paths) == ["top-k vLLM cooperative_topk (torch.ops)",
                           "top-k dispatch, own (the plugin's call)", "top-k decode_topk alone"]
    lens = step.rows.context_lens
    assert t.logits.shape == (16, bench_launch.TOPK_WIDTH) and t.longest == int(lens.max())
    paths["top-k vLLM cooperative_topk (torch.ops)"]()
    assert seen == [((16, bench_launch.TOPK_WIDTH), (16, 1), (16, 2048), 2048, t.longest)]
    for name in ("top-k dispatch, own (the plugin's call)", "top-k decode_topk alone"):
        t.idx.fill_(-7)
        paths[name]()
        torch.cuda.synchronize()
        assert topk_selection_ok(t.logits, lens, 2048, t.idx) == [], name
    assert len(seen) == 1  # the dispatch took the project's kernel, not vLLM's op
    assert topk._forced is None


@pytest.mark.gpu
def test_gpu_base_times_both_revisions_in_one_process(capsys):
    """``--launch-host --base REV`` on the GPU ends with the one-process table:
    the launcher's ``auto``, ``decode_topk`` and the indexer op's logits call
    of each line of this revision and the base's, each a positive host time
    inside its rounds' range."""
    import torch
    from vllm_dsa_varlen.ops.common import capability

    if capability(torch.device("cuda")) != (9, 0):
        pytest.skip("the CUDA kernels are built for sm_90")
    assert bench.main(["--launch-host", "--calls", "2", "--cases", "B16 L32K",
                       "--base", bench_launch.ROOT]) == 0
    out = capsys.readouterr().out
    rows = _rows(out[out.index("one process, 7 rounds interleaved"):])
    assert [(r[1], r[2]) for r in rows] == [
        (p, who) for who in ("now", bench_launch.ROOT)
        for p in ("launcher auto", "top-k decode_topk", *PATHS[5:7])]
    assert all(0 < float(lo) <= float(us) <= float(hi) for *_, us, lo, hi in rows)
