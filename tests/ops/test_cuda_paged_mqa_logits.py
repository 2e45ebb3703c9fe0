"""The CUDA C++ sm_90 kernel (ops/cuda_paged_mqa_logits.py): its schedule
against a host model and its NVRTC build on the CPU; its logits against the
torch reference on an sm_90 GPU (poisoned outputs, repeats, CUDA-graph replay
with new contents), in both head-sum builds."""

from __future__ import annotations

import collections
import ctypes
import glob
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch

from vllm_dsa_varlen.bench.graph import capture_graph
from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
from vllm_dsa_varlen.ops import launcher
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask
from vllm_dsa_varlen.bench.workloads import make_decode_step, random_decode_step

from logits_checks import POISON, check_poisoned, launcher_args, rel_err, run_poisoned

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
NVRTC = None
try:
    ck._nvrtc()
except OSError as exc:  # pragma: no cover - depends on the environment
    NVRTC = str(exc)


def _random_step(seed: int):
    rnd = random.Random(seed)
    ids, ctx = [], []
    for req in range(rnd.randint(1, 40)):
        n = rnd.randint(1, 9)
        kv = rnd.choice([0, 1, 63, 64, 65, rnd.randint(0, 3000)])
        for j in range(n):
            ids.append(req * 3 + 7)
            ctx.append(max(0, kv - (n - 1 - j)) if rnd.random() < 0.8 else rnd.randint(-2, 3000))
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32).view(-1, 1),
            rnd.choice([64, 500, 3000, 5000]), rnd.choice([1, 8, 64]), rnd.choice([1, 3, 7, 132]))


@pytest.mark.parametrize("cost", [ck.COST, (5, 2), (1, 0), (3, 7), (3, 0, 4), (0, 1, 5)])
@pytest.mark.parametrize("seed, heads", [(seed, 64) for seed in range(60)]
                         + [(seed, 32) for seed in range(60, 90)])
def test_plan_walks_the_host_schedule(seed, heads, cost):
    """Each CTA's items, as the kernel walks the plan, are the host model's:
    every (chunk, page) of the step once, in order; the CTAs' shares of the
    step's cost differ by less than two items' cost (by at most one item in
    count when every page costs the same).  Chunks of 4 rows at 64 heads, 8
    at 32."""
    ids, ctx, max_len, width, programs = _random_step(seed)
    table, ctas = ck.plan(ids, ctx, max_len, width, heads, programs=programs, cost=cost)
    assert table.dtype == ctas.dtype == torch.int32
    assert tuple(table.shape) == (ids.shape[0], ck.TABLE_WORDS)
    assert tuple(ctas.shape) == (programs, ck.CTA_WORDS)
    got = ck.plan_items(table, ctas)
    assert got == ck.schedule_model(ids, ctx.view(-1), max_len, width, programs, cost=cost,
                                    heads=heads)
    rows_max, group = ck.rows_max_for(heads, 4), ck.rows_per_group(heads)
    assert max(n for share in got for _, n, _ in share) <= rows_max
    flat = [item for share in got for item in share]
    assert len(flat) == len(set(flat))
    costs = [sum(ck.page_cost(cost, n, group) for _, n, _ in share) for share in got]
    assert max(costs) - min(costs) < 2 * ck.page_cost(cost, rows_max, group)
    if cost[1:] in ((0,), (0, 0)):
        sizes = [len(share) for share in got]
        assert max(sizes) - min(sizes) <= 1


def test_page_cost_counts_rows_and_row_groups():
    assert [ck.page_cost((5, 2), n) for n in (1, 2, 3, 4)] == [7, 9, 11, 13]
    assert [ck.page_cost((3, 0, 4), n) for n in (1, 2, 3, 4)] == [7, 7, 11, 11]
    assert [ck.page_cost((3, 0, 4), n, 4) for n in (1, 4, 5, 8)] == [7, 7, 11, 11]
    assert [ck.rows_max_for(h, 4) for h in (64, 32)] == [4, 8]
    with pytest.raises(ValueError, match="heads"):
        ck.rows_per_group(16)
    for bad in [(1,), (1, 2, 3, 4), (0, 0), (-1, 2), (1.5, 2)]:
        with pytest.raises(ValueError, match="cost"):
            ck.page_cost(bad, 2)


def test_plan_refuses_other_chunk_sizes():
    ids, ctx, max_len, width, _ = _random_step(0)
    with pytest.raises(ValueError, match="rows_max"):
        ck.plan(ids, ctx, max_len, width, rows_max=8)
    with pytest.raises(ValueError, match="rows_max"):
        ck.plan(ids, ctx, max_len, width, heads=32, rows_max=4)
    with pytest.raises(ValueError, match="heads"):
        ck.plan(ids, ctx, max_len, width, heads=16)


def test_the_build_follows_the_run_length_hint():
    """Hints whose rows fit one row group (2 rows at 64 heads, 4 at 32: one row
    group per page) take the evict-first build, longer ones the default build
    (four math warpgroups); with ``pipeline`` the float32 head sum at 64 heads
    is pipelined (PIPELINE: three math warpgroups, two accumulators), the
    tensor-core one and 32 heads are not; the head sum adds its macro;
    launches of fewer than PIPELINE_MIN_ROWS rows are not pipelined."""
    pipe = ck.PIPELINE
    assert set(pipe) == {"NUM_MATH=3", "DUAL_ACC=4"}
    for pipeline, p in ((False, ()), (True, pipe)):
        assert [ck.defines_for(n, "fp32", pipeline=pipeline) for n in (1, 2, 3, 4, 8, 16)] == (
            [("EVICT_FIRST=1", *p)] * 2 + [p] * 4)
        assert [ck.defines_for(n, "fp32", heads=64, pipeline=pipeline) for n in (1, 2, 3)] == (
            [("EVICT_FIRST=1", *p)] * 2 + [p])
        assert [ck.defines_for(n, "fp32", heads=32, pipeline=pipeline)
                for n in (1, 2, 3, 4, 5, 8, 16)] == [("EVICT_FIRST=1",)] * 4 + [()] * 3
        assert [ck.defines_for(n, "tf32", pipeline=pipeline) for n in (1, 2, 3, 4)] == (
            [("EVICT_FIRST=1", "HEAD_SUM_TC=1")] * 2 + [("HEAD_SUM_TC=1",)] * 2)
        assert [ck.defines_for(n, "tf32", heads=32, pipeline=pipeline) for n in (4, 5)] == (
            [("EVICT_FIRST=1", "HEAD_SUM_TC=1"), ("HEAD_SUM_TC=1",)])
    with pytest.raises(ValueError, match="heads"):
        ck.defines_for(2, "fp32", heads=16)
    with pytest.raises(ValueError, match="head_sum"):
        ck.defines_for(4, "bf16")
    assert ck.smem_bytes(()) == ck.SMEM_BYTES
    assert ck.smem_bytes(("HEAD_SUM_TC=1",)) == ck.SMEM_BYTES + ck.HEAD_SUM_TC_BYTES
    assert ck.smem_bytes(("EVICT_FIRST=1", "HEAD_SUM_TC=1")) <= 227 * 1024
    assert ck.threads(pipe) == 512 and ck.smem_bytes(pipe) < ck.SMEM_BYTES
    # launches of fewer rows keep four math warpgroups
    few, many = ck.PIPELINE_MIN_ROWS - 1, ck.PIPELINE_MIN_ROWS
    assert [ck.defines_for(n, "fp32", rows=few, pipeline=True) for n in (1, 2, 3, 4)] == (
        [("EVICT_FIRST=1",)] * 2 + [()] * 2)
    assert [ck.defines_for(n, "fp32", rows=many, pipeline=True) for n in (2, 4)] == [
        ("EVICT_FIRST=1", *pipe), pipe]
    assert [ck.defines_for(n, "fp32", rows=many, pipeline=False) for n in (2, 4)] == [
        ("EVICT_FIRST=1",), ()]
    assert ck.defines_for(4, "tf32", rows=many, pipeline=True) == ("HEAD_SUM_TC=1",)
    assert ck.defines_for(5, "fp32", heads=32, rows=many, pipeline=True) == ()
    # a programmatic dependent launch adds PDL to whatever build the rest picks
    assert ck.PDL == ("PDL=1",)
    for args in [(1, "fp32"), (4, "fp32"), (4, "tf32"), (3, "fp32", 32), (8, "fp32", 32)]:
        for kw in ({}, {"rows": few}, {"rows": many}):
            for pipeline in (False, True):
                plain = ck.defines_for(*args, **kw, pipeline=pipeline, pdl=False)
                assert ck.defines_for(*args, **kw, pipeline=pipeline, pdl=True) == (
                    plain + ck.PDL)


# The once-per-process 0/1 switches of the build, by variable: (the module's
# name for it, its reader, the builds that show it, each as (got, want when
# on, want when off)).
SWITCHES = {
    "DSA_VARLEN_PIPELINE": (ck.PIPELINE_ENV, ck.read_pipeline, lambda: [
        (ck.defines_for(4, "fp32"), ck.PIPELINE, ()),
        (ck.defines_for(4, "fp32", rows=ck.PIPELINE_MIN_ROWS - 1), (), ())]),
    "DSA_VARLEN_PDL": (ck.PDL_ENV, ck.read_pdl, lambda: [
        (ck.defines_for(4, "fp32", pipeline=False), ck.PDL, ()),
        (ck.defines_for(1, "fp32", heads=32), ("EVICT_FIRST=1", *ck.PDL), ("EVICT_FIRST=1",))]),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_build_switches_are_read_once_and_checked(process_setting, name):
    """DSA_VARLEN_PIPELINE (the pipelined build where it applies) and
    DSA_VARLEN_PDL (every build launched as a programmatic dependent):
    unset, empty or 0 -> off (the default), 1 -> on, blanks ignored; read
    once; anything else -> ValueError naming the variable."""
    env, read, builds = SWITCHES[name]
    assert env == name
    for raw, want in [(None, False), ("", False), ("0", False), (" 0", False), ("1", True),
                      (" 1 ", True)]:
        process_setting(name, read, raw)
        assert read() is want
        for got, on, off in builds():
            assert got == (on if want else off)
    os.environ[name] = "0"  # read once: not seen without a cache clear
    assert read() is True
    for bad in ("2", "yes", "on", "true", "1,0"):
        process_setting(name, read, bad)
        with pytest.raises(ValueError, match=name):
            read()
        with pytest.raises(ValueError, match=name):
            ck.defines_for(4, "fp32")


@pytest.fixture
def head_sum_env(process_setting):
    """Set ``DSA_VARLEN_HEAD_SUM`` for one test (``process_setting``)."""
    return lambda value: process_setting(ck.HEAD_SUM_ENV, ck.read_head_sum, value)


def test_head_sum_env_is_read_once_and_checked(head_sum_env):
    """DSA_VARLEN_HEAD_SUM: unset or empty -> fp32 (the default), case and
    blanks ignored; read once (a later change is not seen until the cache is
    cleared); anything else -> ValueError naming the variable."""
    assert ck.HEAD_SUM_ENV == "DSA_VARLEN_HEAD_SUM"
    for raw, want in [(None, "fp32"), ("", "fp32"), ("fp32", "fp32"), (" TF32 ", "tf32")]:
        head_sum_env(raw)
        assert ck.read_head_sum() == want
        assert ck.defines_for(4) == (("HEAD_SUM_TC=1",) if want == "tf32" else ())
    os.environ[ck.HEAD_SUM_ENV] = "fp32"  # read once: not seen without a cache clear
    assert ck.read_head_sum() == "tf32"
    for bad in ("bf16", "tf", "fp32,tf32"):
        head_sum_env(bad)
        with pytest.raises(ValueError, match="DSA_VARLEN_HEAD_SUM"):
            ck.read_head_sum()
        with pytest.raises(ValueError, match="DSA_VARLEN_HEAD_SUM"):
            ck.defines_for(4)


BUILDS = [(hint, how, heads) for heads in ck.HEAD_COUNTS for how in ck.HEAD_SUMS
          for hint in (1, 8)]  # evict-first and default at either head count


@pytest.mark.skipif(NVRTC is not None, reason=f"no NVRTC here: {NVRTC}")
@pytest.mark.parametrize("hint, how, heads", BUILDS)
def test_nvrtc_builds_the_kernel_for_sm90a_without_spills(hint, how, heads):
    """The CUDA source compiles for sm_90a with the NVRTC this environment has
    (no GPU needed), to one kernel with no local memory, in each build the
    launcher takes (both head sums; 64 heads and launch's 32-head builds)."""
    defines = ck.defines_for(hint, how, heads=heads) + (
        () if heads == ck.HEADS else (f"HEADS={heads}",))
    assert ("EVICT_FIRST=1" in defines) == (hint == 1)
    cubin, log = ck.compile_cubin(extra=("--ptxas-options=-v", *(f"-D{d}" for d in defines)))
    assert cubin[:4] == b"\x7fELF"
    assert "varlen_logits_sm90" in log
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, log
    assert "serializ" not in log.lower(), log
    assert ck.smem_bytes(defines) <= 227 * 1024


@pytest.mark.parametrize("serial, named", [(False, False), (True, False), (True, True)])
def test_a_default_build_whose_wgmmas_serialise_is_made_without_half_mma(monkeypatch, serial,
                                                                          named):
    """build_cubin: where ptxas reports the wgmmas serialised, the default build
    is compiled again with HALF_MMA=0 (and says so); a build naming HALF_MMA is
    kept as asked; a clean log keeps the first cubin.  Each returns the defines
    its cubin was made with."""
    calls, said = [], []

    def fake(arch=ck.ARCH, extra=(), path=ck.SOURCE):
        calls.append(extra)
        log = "ptxas info: wgmma.mma_async instructions are serialized" if serial else "ok"
        return bytes([len(calls)]), log if len(calls) == 1 else "ok"
    monkeypatch.setattr(ck, "compile_cubin", fake)
    monkeypatch.setattr(ck, "log_once", said.append)
    defines = ("EVICT_FIRST=1",) + (("HALF_MMA=1",) if named else ())
    cubin, built = ck.build_cubin(defines)
    assert "--ptxas-options=-v" in calls[0] and "-DEVICT_FIRST=1" in calls[0]
    if not serial:
        assert (cubin, built) == (bytes([1]), defines) and len(calls) == 1 and not said
    elif named:
        assert (cubin, built) == (bytes([1]), defines) and len(calls) == 1
        assert "serialised" in said[0]
    else:
        assert cubin == bytes([2]) and calls[1] == ("-DEVICT_FIRST=1", "-DHALF_MMA=0")
        assert built == ("EVICT_FIRST=1", "HALF_MMA=0") and "HALF_MMA=0" in said[0]


@pytest.mark.parametrize("serial_after", [1, 2])
def test_a_pipelined_build_whose_wgmmas_serialise_gives_way_to_four_warpgroups(monkeypatch,
                                                                             serial_after):
    """build_cubin: the pipelined build (PIPELINE) serialised is made again
    without it (the four-warpgroup build, the same bits; itself down to
    HALF_MMA=0 if that serialises too), says so, and _load sizes the launch by
    the build it got: four math warpgroups' threads and shared memory."""
    calls, said, loaded = [], [], []

    def fake(arch=ck.ARCH, extra=(), path=ck.SOURCE):
        calls.append(extra)
        serial = len(calls) <= serial_after
        return bytes([len(calls)]), "wgmma serialized" if serial else "ok"

    def fake_load(driver, device, cubin, name, smem):
        loaded.append((cubin, smem))
        return "fn", "ctx", "module"
    monkeypatch.setattr(ck, "compile_cubin", fake)
    monkeypatch.setattr(ck, "log_once", said.append)
    monkeypatch.setattr(ck, "load_function", fake_load)
    monkeypatch.setattr(ck, "_driver", lambda: None)
    defines = ck.defines_for(4, "fp32", pipeline=True)
    assert set(ck.PIPELINE) <= set(defines)
    assert ck.threads(defines) == 512 and ck.smem_bytes(defines) < ck.SMEM_BYTES
    got = ck._load(None, defines)
    assert all(f"-D{d}" in calls[0] for d in ck.PIPELINE)
    assert not any(f"-D{d}" in calls[1] for d in ck.PIPELINE)
    want = () if serial_after == 1 else ("HALF_MMA=0",)
    assert len(calls) == 2 + (serial_after > 1)
    assert loaded == [(bytes([len(calls)]), ck.smem_bytes(want))] and ck.smem_bytes(want) == ck.SMEM_BYTES
    assert got.threads == ck.THREADS == 640
    assert "NUM_MATH=3" in said[0] and "instead" in said[0]


def _cuobjdump() -> str | None:
    """A cuobjdump: on PATH, in CUDA_HOME, or the one Triton ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    try:
        import triton
        bundled = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                         "bin", "cuobjdump"))
    except ImportError:  # pragma: no cover
        bundled = []
    for path in [os.path.join(home, "bin", "cuobjdump"), *bundled]:
        if os.access(path, os.X_OK):
            return path
    return None


CUOBJDUMP = _cuobjdump()


def _sass_ops(defines) -> collections.Counter:
    cubin, _ = ck.compile_cubin(extra=tuple(f"-D{d}" for d in defines))
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def _four_warpgroups(hint, head_sum, heads=ck.HEADS) -> tuple:
    """The launcher's build for the hint without the pipeline (PIPELINE)."""
    return ck.defines_for(hint, head_sum, heads=heads, pipeline=False)


@pytest.mark.skipif(NVRTC is not None or CUOBJDUMP is None,
                    reason=f"needs NVRTC and cuobjdump (NVRTC: {NVRTC})")
def test_pipelined_build_keeps_a_chain_in_flight_under_each_head_sum():
    """SASS of the pipelined build (the launcher's at 64 heads, float32): each
    QK chain is one fence and DIM / 32 = 4 wgmmas (m64n128, or m64n64 for a
    half group; ptxas did not serialise them: that would fence every
    wgmma), and the head sums wait
    with one chain still in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) as
    well as with none; the four-warpgroup build only ever waits for none."""
    def sass(defines):
        cubin, _ = ck.compile_cubin(extra=tuple(f"-D{d}" for d in defines))
        import tempfile
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            return subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True,
                                  text=True, check=True).stdout
    for hint in (1, 4):
        pipe, four = (sass(ck.defines_for(hint, "fp32", pipeline=True)),
                      sass(_four_warpgroups(hint, "fp32")))
        chains = len(re.findall(r"WARPGROUP\.ARRIVE", pipe))
        assert chains >= 8
        assert len(re.findall(r"QGMMA\.64x(?:128|64)x32", pipe)) == 4 * chains
        assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", pipe)
        assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", pipe)
        assert not re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", four)


@pytest.mark.skipif(NVRTC is not None or CUOBJDUMP is None,
                    reason=f"needs NVRTC and cuobjdump (NVRTC: {NVRTC})")
def test_32_head_builds_keep_their_head_sums():
    """HEADS=32: the tensor-core build has TF32 mma and no float32 FMNMX / FFMA,
    the default build the reverse; both keep one QK wgmma chain per copy."""
    tc = _sass_ops(ck.defines_for(4, "tf32", heads=32) + ("HEADS=32",))
    fp = _sass_ops(ck.defines_for(4, "fp32", heads=32) + ("HEADS=32",))
    assert tc["HMMA.1688.F32.TF32"] >= 2 * 16 and tc["FMNMX"] == tc["FFMA"] == 0
    assert not any(op.startswith("HMMA") for op in fp) and fp["FFMA"] >= 2 * 64
    assert tc["QGMMA.64x128x32.F32.E4M3.E4M3"] == fp["QGMMA.64x128x32.F32.E4M3.E4M3"] == 16


@pytest.mark.skipif(NVRTC is not None or CUOBJDUMP is None,
                    reason=f"needs NVRTC and cuobjdump (NVRTC: {NVRTC})")
def test_tensor_core_build_sums_heads_on_the_tensor_cores():
    """SASS of the HEAD_SUM_TC build: per row group copy (two groups unrolled,
    each a full and a half copy) 16 / 8 TF32 mma and 64 / 32 relu-and-round
    conversions, and no float32 FMNMX / FFMA left; the four-warpgroup float32
    build has no TF32 mma and its 64 / 32 FMNMX + FFMA per copy."""
    tc = _sass_ops(ck.defines_for(4, "tf32"))
    fp = _sass_ops(_four_warpgroups(4, "fp32"))
    assert tc["HMMA.1688.F32.TF32"] == 2 * (16 + 8)
    assert tc["F2FP.RELU.TF32.F32.PACK_B"] == 2 * (64 + 32)
    assert tc["FMNMX"] == 0 and tc["FFMA"] == 0
    assert not any(op.startswith("HMMA") for op in fp)
    assert fp["FMNMX"] == fp["FFMA"] == 2 * (64 + 32)
    # the QK wgmmas: a full copy m64n128, a half copy m64n64 (HALF_MMA, the default)
    assert tc["QGMMA.64x128x32.F32.E4M3.E4M3"] == fp["QGMMA.64x128x32.F32.E4M3.E4M3"] == 8
    assert tc["QGMMA.64x64x32.F32.E4M3.E4M3"] == fp["QGMMA.64x64x32.F32.E4M3.E4M3"] == 8


@pytest.mark.skipif(NVRTC is not None or CUOBJDUMP is None,
                    reason=f"needs NVRTC and cuobjdump (NVRTC: {NVRTC})")
@pytest.mark.parametrize("heads, head_sum, n64, n128", [
    (64, "fp32", 1, 1), (64, "tf32", 1, 1), (32, "fp32", 1, 2), (32, "tf32", 0, 2)])
def test_half_mma_build_runs_a_partial_groups_qk_over_its_present_rows(heads, head_sum, n64,
                                                                       n128):
    """SASS of the four-warpgroup default (HALF_MMA=1) against HALF_MMA=0, per row group (two
    unrolled) DIM / 32 = 4 wgmmas a copy: 64 heads: the half copy (a chunk's
    odd last row) m64n64, the full copy m64n128, the head sum HALF_MMA=0's;
    32 heads: a copy for one or two present rows (m64n64) beside the full and
    three-row copies (m64n128); the tensor-core head sum at 32 heads keeps its
    one partial copy."""
    extra = () if heads == ck.HEADS else (f"HEADS={heads}",)
    build = _four_warpgroups(4, head_sum, heads) + extra
    half = _sass_ops(build + ("HALF_MMA=1",))
    base = _sass_ops(build + ("HALF_MMA=0",))
    assert _sass_ops(build) == half
    assert base["QGMMA.64x128x32.F32.E4M3.E4M3"] == 2 * 2 * 4
    assert base["QGMMA.64x64x32.F32.E4M3.E4M3"] == 0
    assert half["QGMMA.64x64x32.F32.E4M3.E4M3"] == 2 * 4 * n64
    assert half["QGMMA.64x128x32.F32.E4M3.E4M3"] == 2 * 4 * n128
    assert half["HMMA.1688.F32.TF32"] == base["HMMA.1688.F32.TF32"]
    if heads == 64:
        assert half["FMNMX"] == base["FMNMX"] and half["FFMA"] == base["FFMA"]


def test_cpu_tensors_are_refused_and_named_kernels_checked():
    step = make_decode_step([2, 1], [70, 20], heads=64)
    assert ck.unsupported_reason(step.q, step.kv_cache) == "not an sm_90 GPU"
    args = (step.q, step.kv_cache, step.weights, step.rows.context_lens.view(-1, 1),
            step.rows.block_table, step.rows.indices, step.max_context_len)
    with pytest.raises(RuntimeError, match="sm90_cuda"):
        launcher.varlen_paged_mqa_logits(*args, kernel="sm90_cuda")
    with pytest.raises(ValueError, match="kernel: .*sm90_cuda"):
        launcher.varlen_paged_mqa_logits(*args, kernel="sm100")


# ------------------------------------------------- cuda-python, launch (CPU)

from vllm_dsa_varlen.bench import launch as host_time  # noqa: E402  (the stubbed driver)

_C_TYPES = {"TmaMap": 128, "long long": 8, "int": 4}


def _kernel_signature() -> list[tuple[str, int]]:
    """(name, bytes) of each parameter of the kernel, read from its source."""
    src = ck.source()
    start = src.index("(", src.index(ck.KERNEL_NAME.decode() + "("))
    params = src[start + 1:src.index(")", start)].split(",")
    out = []
    for p in params:
        words = [w for w in p.replace("*", " * ").split()
                 if w not in ("const", "__restrict__", "__grid_constant__")]
        name = words[-1]
        kind = "pointer" if "*" in words else " ".join(words[:-1])
        out.append((name, 8 if kind == "pointer" else _C_TYPES[kind]))
    return out


def test_parameter_block_matches_the_kernel_signature():
    """The launch's parameter block names the kernel's parameters in order, each
    of its size (cuLaunchKernel copies that many bytes from each address)."""
    assert [(n, ctypes.sizeof(t)) for n, t in ck.PARAMS] == _kernel_signature()


def test_one_pack_writes_what_the_fields_hold():
    """The launch's one-call packing (``_PACK``, read off ``_Params``' offsets)
    writes the bytes ctypes writes field by field, padding included, for
    extreme and random values."""
    assert ck._PACK.size <= ctypes.sizeof(ck._Params)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    limits = {ctypes.c_uint64: (0, 2**64 - 1), ctypes.c_int64: (-2**63, 2**63 - 1),
              ctypes.c_int32: (-2**31, 2**31 - 1)}
    for trial in range(50):
        maps = [bytes(torch.randint(0, 256, (128,), generator=gen, dtype=torch.uint8).tolist())
                for _ in range(2)]
        scalars = []
        for _, kind in ck.PARAMS[2:]:
            lo, hi = limits[kind]
            pick = trial % 3
            scalars.append(lo if pick == 0 else hi if pick == 1 else
                           lo + int(torch.randint(0, 2**62, (1,), generator=gen)) % (hi - lo))
        fields = ck._Params()
        ctypes.memmove(ctypes.addressof(fields.kv_map), maps[0], 128)
        ctypes.memmove(ctypes.addressof(fields.q_map), maps[1], 128)
        for (name, _), v in zip(ck.PARAMS[2:], scalars):
            setattr(fields, name, v)
        packed = ck._Params()
        ctypes.memset(ctypes.addressof(packed), 0, ctypes.sizeof(packed))
        ck._PACK.pack_into(packed, 0, *maps, *scalars)
        assert bytes(packed) == bytes(fields)


_ENCODE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                           ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                           ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                           ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_int)


@pytest.mark.parametrize("result", [0, 201, 700])
def test_encode_hands_the_driver_its_layout_and_returns_what_it_wrote(monkeypatch, result):
    """``cuTensorMapEncodeTiled`` (a callback in its place) gets the address, the
    layout's dims, strides, box and unit element strides (arrays built once
    per layout), uint8, 128-byte swizzle, a 64-byte aligned output; the
    descriptor is the 128 bytes written there.  No context: ``_NoContext``;
    another error: ``RuntimeError`` naming the layout."""
    seen = []

    def fake(out, dtype, rank, base, dims, strides, box, elems, interleave, swizzle, l2, fill):
        seen.append((out % 64, dtype, rank, base, [dims[i] for i in range(rank)],
                     [strides[i] for i in range(rank - 1)], [box[i] for i in range(rank)],
                     [elems[i] for i in range(rank)], interleave, swizzle, l2, fill))
        ctypes.memmove(out, bytes((base + i) % 256 for i in range(128)), 128)
        return result

    callback = _ENCODE(fake)
    monkeypatch.setattr(ck, "_encode_fn", lambda: callback)
    layout = ((128, 64, 900), (128, 8448), (128, 64, 1))
    for base in (1 << 40, (1 << 40) + 4096):
        if result == 201:
            with pytest.raises(ck._NoContext):
                ck._encode(base, *layout)
        elif result:
            with pytest.raises(RuntimeError, match=r"CUDA error 700 \(dims \[128, 64, 900\]"):
                ck._encode(base, *layout)
        else:
            assert ck._encode(base, *layout) == bytes((base + i) % 256 for i in range(128))
    assert seen == [(0, 0, 3, base, [128, 64, 900], [128, 8448], [128, 64, 1], [1, 1, 1],
                     0, 3, 2, 0) for base in (1 << 40, (1 << 40) + 4096)]


def test_descriptor_dicts_are_keyed_on_the_whole_layout():
    """A tensor's descriptors are found by address in the dict of its layout:
    the same layout at another address shares the dict (another entry), any
    change of shape, stride or element size takes another dict."""
    step = make_decode_step([2, 3], [90, 140], heads=64)
    kv, q = step.kv_cache, step.q
    base = ck.kv_descriptors(kv)
    assert ck.kv_descriptors(kv.clone()) is base
    assert ck.kv_descriptors(kv.view(torch.int8)) is base      # the same bytes
    bigger = torch.zeros(kv.shape[0] * (kv.stride(0) + 64), dtype=torch.uint8).as_strided(
        kv.shape, (kv.stride(0) + 64, *kv.stride()[1:]))
    others = [ck.kv_descriptors(kv[:-1]), ck.kv_descriptors(bigger)]
    qs = ck.q_descriptors(q, 2)
    assert ck.q_descriptors(q.clone(), 2) is ck.q_descriptors(q.view(torch.uint8), 2) is qs
    others += [ck.q_descriptors(q[:-1], 2),
               ck.q_descriptors(torch.zeros(q.shape, dtype=torch.bfloat16), 2)]
    assert len({id(d) for d in [base, qs, *others]}) == 2 + len(others)
    assert qs is not ck.q_descriptors(q[:, :, :32], 4)
    assert others[0].dims == (ck.DIM, ck.PAGE, kv.shape[0] - 1)
    assert others[1].strides == (ck.DIM, kv.stride(0) + 64)
    assert others[-1].strides == (ck.DIM, 2 * q.stride(0))  # bytes, not elements


def test_launch_fills_the_parameter_block_and_reuses_descriptors():
    """With the driver stubbed (CPU tensors): each launch writes this call's
    addresses, strides and row count where cuLaunchKernel reads them, on the
    current stream, with the build's grid, block and shared memory; the TMA
    descriptors are encoded once per layout and re-encoded when it changes."""
    steps = [make_decode_step([2, 3, 1], [90, 140, 7], heads=64, seed=s) for s in range(2)]
    with host_time.stubbed(ck) as (fake, encodes, loaded):
        for step in steps + steps:
            rows = step.rows
            ctx = rows.context_lens.view(-1, 1)
            out = torch.empty((rows.num_rows + 1, step.max_context_len + 9))[1:, 3:]
            table, ctas = ck.plan(rows.indices, ctx, step.max_context_len,
                                  rows.block_table.shape[1], programs=4)
            ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                      step.max_context_len, out, schedule=(table, ctas))
            *grid, stream, params, extra = fake.launches[-1][1:]
            assert fake.launches[-1][0] is loaded.fn and extra == 0
            assert grid == [4, 1, 1, ck.THREADS, 1, 1, ck.SMEM_BYTES] and stream == 0x5EED
            assert params == loaded.params_addr
            ptrs = (ctypes.c_void_p * len(ck.PARAMS)).from_address(params)
            got = {name: ctypes.cast(ptrs[i], ctypes.POINTER(t)).contents
                   for i, (name, t) in enumerate(ck.PARAMS)}
            want = dict(kv=step.kv_cache.data_ptr(), stride_block=step.kv_cache.stride(0),
                        w=step.weights.data_ptr(), stride_w=step.weights.stride(0),
                        ctx=ctx.data_ptr(), bt=rows.block_table.data_ptr(),
                        stride_bt=rows.block_table.stride(0), out=out.data_ptr(),
                        stride_out=out.stride(0), table=table.data_ptr(), ctas=ctas.data_ptr(),
                        num_segs=rows.num_rows)
            assert {k: got[k].value for k in want} == want
            assert got["kv_map"].bytes[0] == step.kv_cache.data_ptr()
            assert got["q_map"].bytes[0] == step.q.data_ptr()
        assert len(fake.launches) == 4
        assert sorted(encodes) == sorted(
            [(s.kv_cache.data_ptr(), (ck.DIM, ck.PAGE, s.kv_cache.shape[0]),
              (ck.DIM, s.kv_cache.stride(0)), (ck.DIM, ck.PAGE, 1)) for s in steps]
            + [(s.q.data_ptr(), (ck.DIM, ck.HEADS, s.num_rows), (ck.DIM, s.q.stride(0)),
                (ck.DIM, ck.HEADS, 2)) for s in steps])


@pytest.mark.skipif(NVRTC is not None, reason="no cuda-python here")
def test_a_pdl_build_launches_as_a_programmatic_dependent():
    """A build launched as a programmatic dependent (``_Loaded.config`` from
    ``cuda_binding.dependent_launch``; the driver stubbed, CPU tensors):
    ``cuLaunchKernelEx`` with that configuration (the programmatic-
    serialisation attribute set, the build's block and shared memory), this
    call's grid and current stream and the same parameter block a plain
    launch hands ``cuLaunchKernel``."""
    from cuda.bindings import driver as drv

    from vllm_dsa_varlen.ops import cuda_binding as cb

    config = cb.dependent_launch(drv, 7, ck.THREADS, ck.SMEM_BYTES)
    [attr] = config.attrs
    assert config.numAttrs == 1 and attr.value.programmaticStreamSerializationAllowed == 1
    assert attr.id == drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (ck.THREADS, 1, 1)
    assert (config.gridDimY, config.gridDimZ, config.sharedMemBytes) == (1, 1, ck.SMEM_BYTES)
    step = make_decode_step([2, 3, 1], [90, 140, 7], heads=64, seed=5)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    out = torch.empty((rows.num_rows, step.max_context_len))
    sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1],
                    programs=4)
    with host_time.stubbed(ck) as (fake, _, loaded):
        for cfg in (None, config):
            loaded.config = cfg
            ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                      step.max_context_len, out, schedule=sched)
    plain, dependent = fake.launches
    assert plain[0] is loaded.fn and plain[1:] == (4, 1, 1, ck.THREADS, 1, 1, ck.SMEM_BYTES,
                                                  0x5EED, loaded.params_addr, 0)
    assert dependent == ("ex", 4, 0x5EED, config, loaded.fn, loaded.params_addr, 0)


def test_a_non_contiguous_context_column_is_passed_as_a_copy():
    step = make_decode_step([2, 1], [70, 20], heads=64)
    rows = step.rows
    wide = torch.stack([rows.context_lens, rows.context_lens + 5], 1)[:, :1]  # stride (2, 1)
    seen = []
    with host_time.stubbed(ck) as (fake, _, loaded):
        def read_at_launch(*args):  # the copy lives until the launch returns
            addr = loaded.params.ctx
            seen.append((addr, list((ctypes.c_int32 * rows.num_rows).from_address(addr))))
            return (0,)
        fake.cuLaunchKernel = read_at_launch
        sched = ck.plan(rows.indices, wide, step.max_context_len, rows.block_table.shape[1],
                        programs=4)
        ck.launch(step.q, step.kv_cache, step.weights, wide, rows.block_table, rows.indices,
                  step.max_context_len, torch.empty(rows.num_rows, 80), schedule=sched)
    [(addr, values)] = seen
    assert addr != wide.data_ptr() and values == rows.context_lens.tolist()


def _clear_bindings():
    for fn in (ck._nvrtc, ck._driver, ck.available):
        fn.cache_clear()


def test_without_cuda_python_the_kernel_says_why_once(monkeypatch, plugin_log):
    """No ``cuda.bindings``: NVRTC and the driver are unavailable, the reason
    names cuda-python, it is logged once, and the launcher's choice on a CPU
    tensor is unchanged (the portable kernel)."""
    for name in ("cuda.bindings.nvrtc", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    _clear_bindings()
    try:
        with pytest.raises(OSError, match="cuda-python"):
            ck._nvrtc()
        why = ck.available()
        assert "cuda-python" in why and ck.available() == why
        logged = [r.getMessage() for r in plugin_log if "cuda-python" in r.getMessage()]
        assert len(logged) == 1 and "sm_90 CUDA kernel is unavailable" in logged[0]
        step = make_decode_step([2, 1], [70, 20], heads=64)
        assert launcher.hopper_kernel_for(step.q, step.kv_cache, "auto") is None
    finally:
        monkeypatch.undo()
        _clear_bindings()


_NVRTC_OVERRIDE = """
import sys
from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
cubin, _ = ck.compile_cubin()
maps = open("/proc/self/maps").read()
print(cubin[:4] == b"\x7fELF", sys.argv[1] in maps)
"""


@pytest.mark.skipif(NVRTC is not None or not sys.platform.startswith("linux"),
                    reason=f"no NVRTC here: {NVRTC}")
def test_nvrtc_override_names_the_library_compiled_with(tmp_path):
    """``DSA_VARLEN_NVRTC``: cuda-python compiles with that library (a copy
    of this environment's NVRTC in another folder is the one mapped)."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    lib = load_nvidia_dynamic_lib("nvrtc").abs_path
    folder = os.path.dirname(lib)
    for name in os.listdir(folder):
        if name.startswith(("libnvrtc.so", "libnvrtc-builtins.so")):
            shutil.copy(os.path.join(folder, name), tmp_path / name)
    copy = str(tmp_path / os.path.basename(lib))
    env = dict(os.environ, DSA_VARLEN_NVRTC=copy)
    proc = subprocess.run([sys.executable, "-c", _NVRTC_OVERRIDE, copy], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True"]
    env[ck.NVRTC_ENV] = str(tmp_path / "missing.so")
    proc = subprocess.run([sys.executable, "-c", _NVRTC_OVERRIDE, copy], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "missing.so" in proc.stderr


# ---------------------------------------------------------------- GPU (sm_90)

SMALL = {
    "runs_1_to_9": ([1, 2, 3, 4, 5, 6, 7, 8, 9], [65, 130, 3, 64, 200, 129, 70, 191, 500]),
    "shorter_than_a_page": ([1, 1, 3, 2], [1, 63, 5, 64]),
    "shorter_than_the_run": ([4, 8, 3], [2, 5, 1]),
    "one_row": ([1], [1000]),
    "long_runs": ([12, 16], [700, 3000]),
}


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("padding", [0, 3])
@pytest.mark.parametrize("hint", ["longest", 1, 4])
def test_matches_reference_small(name, padding, hint):
    """Every build the launcher takes (the hint and the row count pick it:
    ``defines_for``) on every small step, whatever runs the step really has;
    the pipelined build on the same steps through ``launch``."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    lens, seqs = SMALL[name]
    step = make_decode_step(lens, seqs, heads=64, padding_rows=padding,
                            max_context_len=max(seqs) + 11, seed=len(name) + padding,
                            device="cuda")
    hint = max(lens) if hint == "longest" else hint
    check_poisoned(step, run_poisoned(step, kernel="sm90_cuda", max_run_len=hint))
    assert (torch.cuda.current_device(),
            ck.defines_for(hint, rows=step.rows.num_rows)) in ck._LOADED
    # the pipelined build, which the launcher takes from PIPELINE_MIN_ROWS rows
    check_poisoned(step, _launch_poisoned(step, hint, "fp32"))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_auto_takes_it_inside_captures_for_every_hint(monkeypatch):
    """Inside a CUDA-graph capture "auto" takes this kernel whatever the
    longest-run hint, and a step's schedule cache holds its plan.  (Graph
    replay on new contents and batch compositions, serving-size repeats:
    test_launcher.py with ``kernel="sm90"``, this kernel at 32 and 64 heads.)"""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    step = make_decode_step([4, 2, 3], [300, 200, 90], device="cuda")
    args = launcher_args(step)
    out = torch.full((step.rows.num_rows, step.max_context_len), POISON, device="cuda")
    launcher.varlen_paged_mqa_logits(*args, out=out, kernel="sm90_cuda")  # loaded outside capture
    cache = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        for hint in (1, 2, 3, 4, 5, 6, 7, 8, 16):
            assert launcher.hopper_kernel_for(step.q, step.kv_cache, "auto", hint,
                                              step.weights) is ck
        launcher.varlen_paged_mqa_logits(*args, out=out, max_run_len=4, schedule_cache=cache)
    assert [key[0] for key in cache] == ["cuda"]
    out.fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    padded = torch.full((out.shape[0] + 2, out.shape[1] + 40), POISON, device="cuda")
    padded[: out.shape[0], : out.shape[1]] = out
    check_poisoned(step, padded)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_bad_schedule_and_weights_are_refused():
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    step = make_decode_step([2, 3], [90, 140], heads=64, device="cuda")
    rows = step.rows
    out = torch.empty(rows.num_rows, step.max_context_len, device="cuda")
    args = (step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1), rows.block_table,
            rows.indices, step.max_context_len, out)
    table, ctas = ck.plan(rows.indices, rows.context_lens, step.max_context_len,
                          rows.block_table.shape[1])
    with pytest.raises(ValueError, match="schedule"):
        ck.launch(*args, schedule=(table[:-1], ctas))
    wide = torch.zeros(rows.num_rows, 128, device="cuda")[:, :64]
    wide.copy_(step.weights)
    with pytest.raises(ValueError, match="weights"):
        ck.launch(step.q, step.kv_cache, wide, *args[3:], schedule=(table, ctas))
    assert "weights" in ck.unsupported_reason(step.q, step.kv_cache, wide)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_no_host_sync_in_plan_and_launch(no_host_sync):
    """The GPU-side plan and the launch (after the kernel is loaded) never wait
    on the device: the step's facts stay on the GPU."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    step = random_decode_step(16, 3, 2048, heads=64, device="cuda", variable=True)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    out = torch.empty(rows.num_rows, step.max_context_len, device="cuda")
    ck.load(step.q.device)
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(2):  # the second call reuses the cached TMA descriptors
            sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1])
            ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                      step.max_context_len, out, schedule=sched)
    torch.cuda.synchronize()
    ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                               step.max_context_len, indices=rows.indices)
    mask = valid_mask(ctx, step.max_context_len, rows.indices)
    assert (out[mask] - ref[mask]).norm() / ref[mask].norm() < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_graph_kernel_names_what_auto_takes_in_a_capture():
    """The builder-level fact the per-step policy reads: the CUDA kernel at 64
    and 32 heads (where NVRTC loads), no claim for unknown heads."""
    want = "cuda_sm90" if NVRTC is None else "portable"
    assert launcher.graph_kernel("cuda", 64) == launcher.graph_kernel("cuda", 32) == want
    assert launcher.graph_kernel("cuda", None) == "portable"


# ------------------------------------------------ GPU (sm_90): the TF32 head sum

def _same_bits(a, b) -> bool:
    """Equal bit for bit, NaN where the other is NaN."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("padding", [0, 3])
@pytest.mark.parametrize("hint", ["longest", 1, 4])
def test_tensor_core_build_matches_reference_small(name, padding, hint, head_sum_env):
    """DSA_VARLEN_HEAD_SUM=tf32 takes the HEAD_SUM_TC build for every hint:
    on every small step every valid position is written (nothing else), close
    to its own emulation and to the fp32 reference, the same bits on a repeat."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    lens, seqs = SMALL[name]
    step = make_decode_step(lens, seqs, heads=64, padding_rows=padding,
                            max_context_len=max(seqs) + 11, seed=len(name) + padding + 100,
                            device="cuda")
    hint = max(lens) if hint == "longest" else hint
    head_sum_env("tf32")
    out = run_poisoned(step, kernel="sm90_cuda", max_run_len=hint)
    check_poisoned(step, out, head_sum="tf32")
    check_poisoned(step, out, head_sum="fp32")
    assert (torch.cuda.current_device(), ck.defines_for(hint, "tf32")) in ck._LOADED
    assert "HEAD_SUM_TC=1" in ck.defines_for(hint, "tf32")
    assert _same_bits(out, run_poisoned(step, kernel="sm90_cuda", max_run_len=hint))


def _integer_step(lens, seqs, seed, heads=64):
    """A step whose q . k the fp8 tensor cores add exactly: q integers +-(4..8)
    (one sign per row and head, so relu zeroes about half the heads), k
    integers -2..8 (exact in e4m3), scales 1, so |q . k| < 2**12 and every
    partial sum is an integer a 13-bit accumulator holds; ~40 % of q . k reach
    12 significant bits (TF32 keeps 11: rounded), so the TF32 head sum's
    rounding is all that separates the builds.  Weights N(0, 1 / 64), not TF32
    values (their low part matters)."""
    step = make_decode_step(lens, seqs, heads=heads, seed=seed, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows, blocks = step.num_rows, step.kv_cache.shape[0]
    mag = torch.randint(4, 9, (rows, 1, heads, 128), generator=gen, device="cuda").float()
    sign = torch.randint(0, 2, (rows, 1, heads, 1), generator=gen, device="cuda").float() * 2 - 1
    step.q = (mag * sign).to(torch.float8_e4m3fn)
    k = torch.randint(-2, 9, (blocks, 64 * 128), generator=gen, device="cuda").float()
    fused = step.kv_cache.view(blocks, -1)
    fused[:, :64 * 128] = k.to(torch.float8_e4m3fn).view(torch.uint8)
    fused[:, 64 * 128:] = torch.ones((blocks, 64), device="cuda").view(torch.uint8)
    step.weights = torch.randn((rows, heads), generator=gen, device="cuda") / 8
    return step


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_eager_auto_takes_it():
    """"auto" takes this kernel outside captures too; its eager logits match
    the reference."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    step = make_decode_step([4, 1, 3, 2], [300, 64, 1000, 65], heads=64, padding_rows=2,
                            device="cuda", seed=5)
    for hint in (1, 4, 8):
        assert launcher.hopper_kernel_for(step.q, step.kv_cache, "auto", hint, step.weights) is ck
    cache = {}
    check_poisoned(step, run_poisoned(step, max_run_len=4, schedule_cache=cache))
    assert [key[0] for key in cache] == ["cuda"] and not any(key[-1] for key in cache)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("lens, seqs", [([4, 3], [2100, 700]), ([1, 2, 8], [1500, 640, 3000]),
                                        ([9, 6, 5], [1100, 2000, 300])])
@pytest.mark.parametrize("hint", [1, 4])
@pytest.mark.parametrize("heads", ck.HEAD_COUNTS)
def test_tensor_core_build_is_its_emulation(lens, seqs, hint, heads):
    """Where q . k is exact (``_integer_step``: the fp32 build equals the fp32
    reference there), the HEAD_SUM_TC build equals reference(head_sum="tf32")
    to float32 accumulation error, element by element: relu(q . k) rounded to
    nearest TF32 (not truncated), the weights to ~22 bits (not one TF32), the
    A / B / D fragment layouts right for every head, row and token (64 heads,
    and 32 through launch's HEADS=32 build).  The alternatives differ from the
    emulation by far more than the bound."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    from vllm_dsa_varlen.ops.reference import round_tf32

    step = _integer_step(lens, seqs, seed=sum(seqs) + hint + heads, heads=heads)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    args = (step.q, step.kv_cache, step.weights, ctx, rows.block_table, step.max_context_len)

    def ref(head_sum, weights=None):
        a = list(args)
        if weights is not None:
            a[2] = weights
        return paged_mqa_logits_ref(*a, indices=rows.indices, head_sum=head_sum)

    mask = valid_mask(ctx, step.max_context_len, rows.indices)
    n = rows.num_rows
    outs = {}
    for how in ck.HEAD_SUMS:
        out = torch.full((n + 2, step.max_context_len + 40), POISON, device="cuda")
        ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                  step.max_context_len, out[:n], defines=ck.defines_for(hint, how, heads=heads))
        torch.cuda.synchronize()
        check_poisoned(step, out, head_sum=how)
        outs[how] = out[:n, : step.max_context_len]
    assert rel_err(outs["fp32"][mask], ref("fp32")[mask]) < 1e-6, "q . k not exact on this GPU"
    emu = ref("tf32")[mask].double()
    scale = ref("fp32", step.weights.abs())[mask].double()  # sum_h relu(q . k) |w|
    err = (outs["tf32"][mask].double() - emu).abs() / scale
    bound = 3e-6
    assert float(err.max()) < bound, f"max error {float(err.max()):.2e} of sum |terms|"
    # no rounding at all, or the weights as one TF32 value: both far outside the bound
    for other in (ref("fp32"), ref("tf32", round_tf32(step.weights))):
        gap = (other[mask].double() - emu).abs() / scale
        assert float(gap.max()) > 8 * bound


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_tensor_core_build_replays_in_a_graph_on_new_contents():
    """The HEAD_SUM_TC build captured in a CUDA graph: replays on new q,
    weights and cache contents (same buffers) match their emulation, twice
    the same bits."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    step = random_decode_step(12, 4, 1500, heads=64, device="cuda", variable=True, seed=3)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    out = torch.full((rows.num_rows + 2, step.max_context_len + 40), POISON, device="cuda")
    defines = ck.defines_for(4, "tf32")
    sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1])

    def call():
        ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                  step.max_context_len, out[: rows.num_rows], schedule=sched, defines=defines)

    graph = capture_graph(torch, call)  # run eagerly first: loaded outside the capture
    from vllm_dsa_varlen.ops.reference import quantize_kv_fp8

    for seed in (11, 12):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        step.q.copy_(torch.randn(step.q.shape, generator=gen, device="cuda").to(step.q.dtype))
        step.weights.copy_(torch.randn(step.weights.shape, generator=gen, device="cuda") / 8)
        blocks = step.kv_cache.shape[0]
        step.kv_cache.copy_(quantize_kv_fp8(
            torch.randn((blocks, 64, 128), generator=gen, device="cuda") * 3))
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        check_poisoned(step, out, head_sum="tf32")
        first = out.clone()
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert _same_bits(first, out)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("hint,heads,pipeline", [(4, 64, False), (4, 64, True), (2, 64, False),
                                                 (8, 32, False)])
def test_pdl_build_waits_for_the_kernels_that_write_its_inputs(hint, heads, pipeline):
    """A build launched as a programmatic dependent (PDL), captured in a CUDA
    graph right after the kernels that write its queries, weights, cache and
    schedule (as a decode step's indexer writes them just before the logits),
    and run eagerly the same way: on each replay's new contents every valid
    position is written, nothing else, close to the reference, and the bits
    are the plain build's on the same inputs."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    from vllm_dsa_varlen.ops.reference import quantize_kv_fp8

    step = random_decode_step(40, hint, 3000, heads=heads, device="cuda", variable=True, seed=9)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    out = torch.full((rows.num_rows + 2, step.max_context_len + 40), POISON, device="cuda")
    plain = ck.defines_for(hint, "fp32", heads=heads, rows=rows.num_rows, pipeline=pipeline,
                           pdl=False)
    dependent = plain + ck.PDL
    new = {"q": torch.empty_like(step.q), "w": torch.empty_like(step.weights),
           "kv": torch.empty_like(step.kv_cache)}  # the sources the captured copies read

    def write_inputs(seed):  # fresh contents, copied in by the call's own kernels
        gen = torch.Generator(device="cuda").manual_seed(seed)
        new["q"].copy_(torch.randn(step.q.shape, generator=gen, device="cuda").to(step.q.dtype))
        new["w"].copy_(torch.randn(step.weights.shape, generator=gen, device="cuda") / 8)
        new["kv"].copy_(quantize_kv_fp8(torch.randn((step.kv_cache.shape[0], 64, 128),
                                                    generator=gen, device="cuda") * 3))

    sched = [None]

    def call(defines):
        step.kv_cache.copy_(new["kv"])
        step.weights.copy_(new["w"])
        sched[0] = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1],
                           heads)
        step.q.copy_(new["q"])  # the kernel right before the logits writes what they read
        ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                  step.max_context_len, out[: rows.num_rows], schedule=sched[0],
                  defines=defines)

    write_inputs(1)
    graph = capture_graph(torch, lambda: call(dependent))  # run eagerly first: loaded
    for seed in (21, 22, 23):
        write_inputs(seed)
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        check_poisoned(step, out)
        replayed = out.clone()
        out.fill_(POISON)
        call(plain)
        torch.cuda.synchronize()
        assert _same_bits(replayed, out)
        out.fill_(POISON)
        call(dependent)  # eager
        torch.cuda.synchronize()
        assert _same_bits(replayed, out)


# ------------------------------------------------ GPU (sm_90): 32 heads (launch only)

def _launch_poisoned(step, hint, how):
    """``launch`` of the hint's build for a large launch (64 heads, float32:
    pipelined; 32 heads take the HEADS=32 build) into a poisoned buffer 2
    rows and 40 columns larger than the logits."""
    rows = step.rows
    out = torch.full((rows.num_rows + 2, step.max_context_len + 40), POISON, device="cuda")
    ck.launch(step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1),
              rows.block_table, rows.indices, step.max_context_len, out[: rows.num_rows],
              defines=ck.defines_for(hint, how, heads=step.q.shape[2]))
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("padding", [0, 3])
@pytest.mark.parametrize("hint", [1, 4, 8])
@pytest.mark.parametrize("how", ck.HEAD_SUMS)
def test_32_heads_match_reference_small(name, padding, hint, how):
    """32 heads (row groups of four rows, chunks of eight; runs of 1..9 rows
    leave groups with 1..3 absent rows): every valid position written, nothing
    else, close to the reference (its emulation of the build's head sum and
    the fp32 one), the same bits on a repeat; the launcher routes 32 heads
    here (unsupported_reason)."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    lens, seqs = SMALL[name]
    step = make_decode_step(lens, seqs, heads=32, padding_rows=padding,
                            max_context_len=max(seqs) + 11, seed=len(name) + padding + 200,
                            device="cuda")
    out = _launch_poisoned(step, hint, how)
    check_poisoned(step, out, head_sum=how)
    check_poisoned(step, out, head_sum="fp32")
    assert (torch.cuda.current_device(),
            ck.defines_for(hint, how, heads=32) + ("HEADS=32",)) in ck._LOADED
    assert _same_bits(out, _launch_poisoned(step, hint, how))
    assert ck.unsupported_reason(step.q, step.kv_cache, step.weights) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_back_to_back_eager_launches_keep_their_own_arguments():
    """Launches queued without a sync in between, each on other tensors (other
    caches, queries, outputs, schedules, as layers and steps follow each
    other): the parameter block is rewritten by each call, and each launch
    computed with its own arguments (the driver copied them at launch)."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    steps = [random_decode_step(n, t, c, heads=64, device="cuda", seed=i, variable=True)
             for i, (n, t, c) in enumerate([(3, 4, 2000), (17, 2, 700), (1, 1, 5000),
                                            (40, 4, 300)])]
    outs = []
    for _ in range(2):
        for step in steps:
            rows = step.rows
            ctx = rows.context_lens.view(-1, 1)
            out = torch.full((rows.num_rows + 2, step.max_context_len + 40), POISON,
                             device="cuda")
            sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1])
            ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                      step.max_context_len, out[: rows.num_rows], schedule=sched)
            outs.append((step, out))
    torch.cuda.synchronize()
    for step, out in outs:
        check_poisoned(step, out)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_launch_from_a_thread_that_made_no_cuda_call():
    """A launch from a new thread (its current driver context may be unset)
    still runs on the tensors' device."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    import threading

    step = make_decode_step([2, 3], [90, 140], heads=64, device="cuda", seed=3)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1])
    out = torch.full((rows.num_rows + 2, step.max_context_len + 40), POISON, device="cuda")
    ck.load(step.q.device)
    torch.cuda.synchronize()
    failed = []

    def work():
        try:
            ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                      step.max_context_len, out[: rows.num_rows], schedule=sched)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not failed, failed
    check_poisoned(step, out)


# ------------------------------------------- the shipped builds (same arithmetic)

def _same_arithmetic_builds(heads):
    """The shipped builds at ``heads`` other than the default that sum in
    float32 as it does: evict-first, the pipelined build, PDL, HALF_MMA=0."""
    default = () if heads == ck.HEADS else (f"HEADS={heads}",)
    return [b for b in ck.shipped_builds() if ("HEADS=32" in b) == (heads == 32)
            and "HEAD_SUM_TC=1" not in b and b != default]


def test_the_shipped_builds_are_the_launchers():
    """shipped_builds: every build defines_for names at either head count for
    any hint, launch size and setting (HEADS=32 added), and the HALF_MMA=0
    twin of each four-warpgroup one; nothing else, no duplicates."""
    want = set()
    for heads in ck.LAUNCHER_HEADS:
        for hint in range(1, 12):
            for head_sum in ck.HEAD_SUMS:
                for rows in (1, 8, ck.PIPELINE_MIN_ROWS - 1, ck.PIPELINE_MIN_ROWS, 4096):
                    for pipeline in (False, True):
                        for pdl in (False, True):
                            want.add(ck.defines_for(hint, head_sum, heads, rows, pipeline, pdl)
                                     + (() if heads == ck.HEADS else (f"HEADS={heads}",)))
    want |= {b + ("HALF_MMA=0",) for b in want if ck.math_warpgroups(b) == ck.MATH}
    got = ck.shipped_builds()
    assert len(got) == len(set(got)) and set(got) == want


def test_shared_memory_follows_the_builds_rings():
    """smem_bytes: a ring per math warpgroup (STAGES slots of a page and its
    scales, two mbarriers each), so the pipelined build's three take one ring
    fewer; the tensor-core head sum adds its weight fragments; every shipped
    build fits sm_90's 227 KB and its threads are a producer and its math
    warpgroups."""
    ring = ck.STAGES * (ck.PAGE * ck.DIM + ck.PAGE * 4 + 2 * 8)
    assert ck.SMEM_BYTES - ck.smem_bytes(ck.PIPELINE) == ring
    assert ck.smem_bytes(("HEAD_SUM_TC=1",)) - ck.SMEM_BYTES == ck.HEAD_SUM_TC_BYTES
    assert ck.threads() == ck.THREADS == 640 and ck.threads(ck.PIPELINE) == 512
    for build in ck.shipped_builds():
        assert ck.smem_bytes(build) <= 227 * 1024, build


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("heads", ck.HEAD_COUNTS)
@pytest.mark.parametrize("shape", [(12, 4, 1500, True), (3, 1, 100, False), (40, 3, 9000, True),
                                   (130, 2, 700, False), (33, 4, 30000, False)])
def test_shipped_builds_write_the_default_builds_bits(shape, heads):
    """The shipped builds that sum in float32 (evict-first, pipelined, PDL,
    HALF_MMA=0: the same products summed in the same order) on steps where
    rings get no page, one page or many, chunks a half group, and CTAs
    several segments: each writes the default build's logits bit for bit,
    and nothing outside them (poisoned buffers 2 rows and 40 columns
    larger)."""
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")
    reqs, tokens, context, variable = shape
    step = random_decode_step(reqs, tokens, context, heads=heads, device="cuda",
                              variable=variable, seed=reqs + heads)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1], heads)
    outs = []
    for defines in [()] + [tuple(d for d in b if d != "HEADS=32")
                           for b in _same_arithmetic_builds(heads)]:
        out = torch.full((rows.num_rows + 2, step.max_context_len + 40), POISON, device="cuda")
        ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                  step.max_context_len, out[: rows.num_rows], schedule=sched, defines=defines)
        torch.cuda.synchronize()
        check_poisoned(step, out)
        outs.append(out)
    for out in outs[1:]:
        assert _same_bits(outs[0], out)

