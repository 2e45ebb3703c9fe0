"""The launcher around both kernels (ops/launcher.py).

On the CPU: the kernel names it takes and refuses, the choice on CPU tensors,
the cached layout checks, the pre-bound launch key, precompile's contract.
Marked ``gpu``: precompile leaves nothing to compile for new step sizes (any
GPU); on an sm_90 GPU the launcher's sm_90 path (the CUDA kernel, 32 and 64
heads) against the reference, bitwise repeatable at serving sizes, and
replayed from a CUDA graph on new contents and batch compositions.
"""

import pytest
import torch

from vllm_dsa_varlen.ops import common, launcher
from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
from vllm_dsa_varlen.ops import triton_paged_mqa_logits as portable
from vllm_dsa_varlen.ops.launcher import precompile
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask
from vllm_dsa_varlen.workloads import make_decode_step, random_decode_step

from logits_checks import POISON, StaticStep, check_poisoned, launcher_args, run_poisoned

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _needs_cuda_kernel():
    why = ck.available()
    if why is not None:
        pytest.skip(f"the sm_90 CUDA kernel cannot load here: {why}")


# ---------------------------------------------------------------- kernel names (CPU)

def test_cpu_tensors_take_the_portable_kernel_and_sm90_is_refused():
    step = make_decode_step([2, 1], [70, 20], heads=32)
    assert launcher.hopper_kernel_for(step.q, step.kv_cache, "auto") is None
    assert launcher.hopper_kernel_for(step.q, step.kv_cache, "portable") is None
    for kernel in ("sm90", "sm90_cuda"):
        with pytest.raises(RuntimeError, match="sm_90 CUDA kernel cannot run"):
            launcher.varlen_paged_mqa_logits(*launcher_args(step), kernel=kernel)
    with pytest.raises(ValueError, match="kernel"):
        launcher.varlen_paged_mqa_logits(*launcher_args(step), kernel="fastest")


def test_the_retired_gluon_kernel_name_is_refused_with_what_to_ask_for():
    """"sm90_gluon" names a kernel the package no longer has: a ValueError
    naming ``kernel`` that says so and names the sm_90 kernel left, whether
    the name comes as the argument, from the setting, or with a portable
    tuning knob (which otherwise skips the sm_90 choice)."""
    step = make_decode_step([2, 1], [70, 20], heads=64)
    assert "sm90_gluon" not in launcher.KERNELS
    for kw in ({}, {"rows_per_dot": 2}):
        with pytest.raises(ValueError, match=r"^kernel: .*'sm90_gluon'.*retired.*\"sm90\""):
            launcher.varlen_paged_mqa_logits(*launcher_args(step), kernel="sm90_gluon", **kw)
    with pytest.raises(ValueError, match="kernel"):
        launcher.hopper_kernel_for(step.q, step.kv_cache, "sm90_gluon")


def test_the_kernel_setting_is_read_and_checked(monkeypatch):
    step = make_decode_step([2, 1], [70, 20], heads=64)
    monkeypatch.setenv(launcher.KERNEL_ENV, "sm90_gluon")
    with pytest.raises(ValueError, match=f"kernel: .*from {launcher.KERNEL_ENV}.*retired"):
        launcher.varlen_paged_mqa_logits(*launcher_args(step))
    monkeypatch.setenv(launcher.KERNEL_ENV, "sm90")
    with pytest.raises(RuntimeError, match="sm_90 CUDA kernel cannot run"):
        launcher.varlen_paged_mqa_logits(*launcher_args(step))
    monkeypatch.setenv(launcher.KERNEL_ENV, "portable")
    assert launcher.resolve_kernel(None) == "portable"
    assert launcher.resolve_kernel("auto") == "auto"  # the argument wins over the setting


def test_graph_kernel_names_only_the_kernels_that_exist(monkeypatch):
    """Off Hopper (here: no GPU) "portable"; on an sm_90 device the CUDA kernel
    for 32 and 64 heads where it loads, the portable one for other geometries
    and unknown heads."""
    assert launcher.graph_kernel("cpu", 64) == "portable"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(ck, "available", lambda: None)
    assert [launcher.graph_kernel("cuda", h) for h in (32, 64)] == ["cuda_sm90"] * 2
    assert launcher.graph_kernel("cuda", None) == "portable"
    assert launcher.graph_kernel("cuda", 16) == "portable"
    assert launcher.graph_kernel("cuda", 64, 128, 32) == "portable"
    monkeypatch.setattr(ck, "available", lambda: "no NVRTC")
    assert launcher.graph_kernel("cuda", 64) == "portable"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(ck, "available", lambda: None)
    assert launcher.graph_kernel("cuda", 64) == "portable"


def test_auto_falls_back_to_the_portable_kernel_where_the_cuda_one_cannot_run(monkeypatch):
    """"auto" takes whatever ``unsupported_reason`` allows, and the portable
    kernel with the reason otherwise; "sm90" raises with it instead."""
    step = make_decode_step([2, 1], [70, 20], heads=64)
    monkeypatch.setattr(ck, "unsupported_reason", lambda q, kv, w=None: None)
    for capturing in (True, False):
        assert launcher.hopper_kernel_for(step.q, step.kv_cache, "auto",
                                          capturing=capturing) is ck
    monkeypatch.setattr(launcher, "EAGER_CUDA_SM90", False)
    assert launcher.hopper_kernel_for(step.q, step.kv_cache, "auto", capturing=False) is None
    assert launcher.hopper_kernel_for(step.q, step.kv_cache, "sm90", capturing=False) is ck
    monkeypatch.setattr(ck, "unsupported_reason", lambda q, kv, w=None: "no NVRTC")
    assert launcher.hopper_kernel_for(step.q, step.kv_cache, "auto", capturing=True) is None
    with pytest.raises(RuntimeError, match="no NVRTC"):
        launcher.hopper_kernel_for(step.q, step.kv_cache, "sm90", capturing=True)


# ---------------------------------------------------------------- launcher (CPU)

def test_layout_checks_run_once_per_shape_signature(monkeypatch):
    step = make_decode_step([2, 1], [70, 20], heads=32)
    calls = []
    real = launcher.check_varlen_inputs
    monkeypatch.setattr(launcher, "check_varlen_inputs", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(launcher, "_CHECKED", {})
    for _ in range(3):
        launcher.checked_layout(*launcher_args(step))
    assert len(calls) == 1
    other = make_decode_step([3, 2], [90, 20], heads=32)
    launcher.checked_layout(*launcher_args(other))
    assert len(calls) == 2
    # bad inputs are still refused, cached or not
    args = list(launcher_args(step))
    args[2] = args[2].double()
    with pytest.raises(ValueError, match="weights"):
        launcher.checked_layout(*args)
    args = list(launcher_args(step))
    with pytest.raises(ValueError, match="max_context_len"):
        launcher.checked_layout(*args[:-1], 0)
    buf = torch.zeros(args[5].numel() + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="8-byte aligned"):
        launcher.checked_layout(*args[:5], buf[1:], args[6])


def test_prebound_launch_key_separates_specialisations():
    """The cached compiled kernel is reused only for arguments Triton would
    specialise the same way (integer == 1 / % 16, tensor 16-byte alignment)."""
    a = torch.zeros(64, dtype=torch.float32)
    assert common._spec(a) == common._spec(torch.zeros(8, dtype=torch.float32))
    assert common._spec(a) != common._spec(a[1:])
    assert common._spec(a) != common._spec(a.int())
    assert common._spec(32) == common._spec(48) != common._spec(33) != common._spec(1)


def test_per_step_integers_are_not_specialised():
    """Row count, logits width and block-table width/stride change every step:
    the portable kernel may not compile a variant per value."""
    assert {"num_rows", "max_context_len", "bt_width", "stride_bt"} <= set(portable.PER_STEP_INTS)
    assert "tiles_per_split" in portable.PER_STEP_INTS


def test_schedule_key_separates_what_a_plan_depends_on():
    """A per-step cache hands a planned schedule only to calls it was planned
    for: same tensors, integers and structure, and the same side of a CUDA
    graph capture."""
    ids = torch.zeros(8, dtype=torch.int32)
    ctx = torch.zeros((8, 1), dtype=torch.int32)
    key = ck.schedule_key(ids, ctx, 700, 9, 64, 4, False)
    assert key == ck.schedule_key(ids, ctx, 700, 9, 64, 4, False)
    others = [ck.schedule_key(ids, ctx, 700, 9, 64, 4, True),     # inside a capture
              ck.schedule_key(ids, ctx, 701, 9, 64, 4, False),
              ck.schedule_key(ids, ctx, 700, 10, 64, 4, False),
              ck.schedule_key(ids, ctx, 700, 9, 32, 8, False),
              ck.schedule_key(ids.clone(), ctx, 700, 9, 64, 4, False),
              ck.schedule_key(ids, ctx.clone(), 700, 9, 64, 4, False),
              ck.schedule_key(ids[:6], ctx, 700, 9, 64, 4, False)]
    assert all(k != key for k in others)


def test_precompile_needs_a_gpu_and_a_known_kernel():
    with pytest.raises(ValueError, match="device"):
        precompile(heads=64, device="cpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="kernel"):
            precompile(heads=64, device="cuda", kernel="sm90_gluon")


# ---------------------------------------------------------------- GPU

def _compiled(fn):
    return sum(len(c[0]) for c in fn.device_caches.values())


@pytest.mark.gpu
def test_no_compile_after_precompile_for_new_step_sizes():
    """After precompile, steps with new row counts, logits widths and block-table
    widths compile nothing (the portable kernel's cache and the CUDA kernel's
    loaded builds do not grow), eager or captured into a CUDA graph."""
    heads = 64
    took = precompile(heads=heads, device="cuda")
    assert took > 0
    fns = [portable._varlen_paged_mqa_logits_kernel]
    before = [_compiled(f) for f in fns]
    cuda_builds = dict(ck._LOADED)  # the CUDA kernel: NVRTC builds loaded by precompile
    if HOPPER and ck.available() is None:
        assert cuda_builds, "precompile did not build the CUDA sm_90 kernel"

    for i, (reqs, tokens, ctx_len, width_pad) in enumerate(
            [(3, 1, 300, 0), (17, 2, 5000, 3), (33, 3, 2000, 1), (5, 4, 9000, 7), (2, 8, 100, 2),
             (129, 1, 70, 5)]):
        step = random_decode_step(reqs, tokens, ctx_len, heads=heads, seed=i, device="cuda",
                                  max_context_len=ctx_len * 2 + 17 * i)
        rows = step.rows
        bt = torch.cat([rows.block_table, torch.zeros((rows.num_rows, width_pad), dtype=torch.int32,
                                                      device="cuda")], dim=1)
        out = launcher.varlen_paged_mqa_logits(step.q, step.kv_cache, step.weights,
                                               rows.context_lens.view(-1, 1), bt, rows.indices,
                                               step.max_context_len, max_run_len=tokens)
        torch.cuda.synchronize()
        mask = valid_mask(rows.context_lens.view(-1, 1), step.max_context_len, rows.indices)
        ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights,
                                   rows.context_lens.view(-1, 1), bt, step.max_context_len,
                                   indices=rows.indices)
        assert (out[mask] - ref[mask]).norm() / ref[mask].norm() < 1e-3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = launcher.varlen_paged_mqa_logits(
                step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1), bt,
                rows.indices, step.max_context_len, max_run_len=tokens)
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert (captured[mask] - ref[mask]).norm() / ref[mask].norm() < 1e-3
    assert [_compiled(f) for f in fns] == before
    assert ck._LOADED == cuda_builds


SMALL = {
    # decode lens, seq lens, padding rows, heads
    "runs_1_to_8_h32": ([1, 2, 3, 4, 5, 6, 7, 8], [65, 130, 3, 64, 200, 129, 70, 191], 0, 32),
    "runs_1_to_8_h64": ([8, 7, 6, 5, 4, 3, 2, 1], [65, 130, 9, 64, 200, 129, 70, 191], 0, 64),
    "shorter_than_a_page": ([1, 1, 3, 2], [1, 63, 5, 64], 0, 64),
    "shorter_than_the_run": ([4, 8, 3], [2, 5, 1], 0, 64),
    "graph_padding": ([2, 2, 2, 2], [90, 0, 150, 0], 3, 64),
    "longer_than_a_chunk": ([9, 12], [700, 3000], 0, 64),
}


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("hint", [1, 4, 8])
@pytest.mark.parametrize("name", list(SMALL))
def test_sm90_matches_reference_small(name, hint):
    _needs_cuda_kernel()
    lens, seqs, pad, heads = SMALL[name]
    step = make_decode_step(lens, seqs, heads=heads, padding_rows=pad,
                            max_context_len=max(seqs) + 11, seed=len(name) + hint, device="cuda")
    check_poisoned(step, run_poisoned(step, kernel="sm90", max_run_len=hint))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", [(64, 4, 8192, None, 64), (64, 4, 8192, 0.7, 64),
                                  (32, 2, 16384, None, 64), (96, 3, 4096, 0.5, 32),
                                  (8, 8, 20000, 0.8, 64), (1, 4, 8192, None, 64),
                                  (200, 1, 3000, None, 64), (64, 4, 8192, None, 32)])
def test_sm90_serving_sizes_repeatable(case):
    _needs_cuda_kernel()
    num_reqs, tokens, context, acceptance, heads = case
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    step = random_decode_step(num_reqs, tokens, context, acceptance=acceptance, heads=heads,
                              seed=seed, device="cuda")
    hint = int(step.decode_lens.max())
    first = run_poisoned(step, kernel="sm90", max_run_len=hint)
    mask = check_poisoned(step, first)
    r = step.num_rows
    for _ in range(20):
        again = run_poisoned(step, kernel="sm90", max_run_len=hint)
        assert torch.equal(again[:r, : step.max_context_len][mask],
                           first[:r, : step.max_context_len][mask]), "not bitwise repeatable"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("heads", [64, 32])
def test_sm90_graph_replay_with_new_contents_and_compositions(heads):
    _needs_cuda_kernel()
    num_reqs, tokens, max_len = 24, 4, 6000
    steps = [random_decode_step(num_reqs, tokens, 4000, acceptance=a, variable=v, heads=heads,
                                seed=s, device="cuda", max_context_len=max_len, extra_blocks=40)
             for s, a, v in ((1, None, False), (2, 0.6, False), (3, None, True), (4, 0.3, False))]
    buf = StaticStep(steps, num_reqs * tokens, heads, max_len)
    q, w, ctx, bt, ids, kv, out = buf.q, buf.w, buf.ctx, buf.bt, buf.ids, buf.kv, buf.out
    load = buf.load

    def call(dst, cache=None):
        launcher.varlen_paged_mqa_logits(q, kv, w, ctx, bt, ids, max_len, out=dst,
                                         max_run_len=tokens, kernel="sm90", schedule_cache=cache)

    load(steps[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(out)
    torch.cuda.current_stream().wait_stream(side)
    # Two "layers" in one graph sharing a step's schedule cache, as the builder's
    # tag makes them: the first plans inside the capture, the second reads it.
    cache = {}
    second = torch.empty_like(out)
    call(out, cache)                      # eager: planned outside any capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out, cache)
        call(second, cache)
    assert len(cache) == 2                # one plan outside, one inside the capture
    for step in steps[1:] + steps[:1]:
        load(step)
        out.fill_(POISON)
        second.fill_(POISON)
        graph.replay()
        eager = torch.full_like(out, POISON)
        call(eager)
        torch.cuda.synchronize()
        mask = valid_mask(ctx, max_len, ids)
        assert torch.equal(out[mask], eager[mask])
        assert torch.equal(second[mask], eager[mask])
        assert torch.isnan(out[~mask]).all() and torch.isnan(second[~mask]).all()
        n = step.num_rows
        ref = paged_mqa_logits_ref(q[:n], kv, w[:n], ctx[:n], bt[:n], max_len, indices=ids[:n])
        m = mask[:n]
        assert (out[:n][m] - ref[m]).norm() / ref[m].norm() < 1e-3
