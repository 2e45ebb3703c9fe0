"""The launcher around both kernels (ops/launcher.py).

On the CPU: the kernel names it takes and refuses, the choice on CPU tensors,
the routes kept per call layout (what misses, bad calls after good ones), the
CUDA kernel's eager path with the driver stubbed (what the driver is handed,
against a parameter block built afresh), the pre-bound launch key,
precompile's contract.  Marked ``gpu``: precompile leaves nothing to compile
for new step sizes (any GPU); on an sm_90 GPU the launcher's sm_90 path (the
CUDA kernel, 32 and 64 heads) against the reference, bitwise repeatable at
serving sizes, replayed from a CUDA graph on new contents and batch
compositions, eager calls on kept routes as tensors move, a captured launch
after its caches are dropped, no host sync.
"""

import contextlib
import ctypes
import os
import signal
import types

import pytest
import torch

from vllm_dsa_varlen import settings
from vllm_dsa_varlen.bench import launch as host_time
from vllm_dsa_varlen.ops import common, launcher
from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
from vllm_dsa_varlen.ops import cuda_topk as ct
from vllm_dsa_varlen.ops import triton_paged_mqa_logits as portable
from vllm_dsa_varlen.ops.launcher import precompile
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, quantize_kv_fp8, valid_mask
from vllm_dsa_varlen.bench.workloads import make_decode_step, random_decode_step

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


@pytest.fixture
def kernel_env(monkeypatch):
    """Set ``DSA_VARLEN_KERNEL`` as a new process would read it (the
    setting is read once per process); the process's reading comes back after."""
    def set_env(value):
        monkeypatch.setenv(settings.KERNEL_ENV, value)
        launcher.kernel_setting.cache_clear()
    yield set_env
    monkeypatch.undo()
    launcher.kernel_setting.cache_clear()


def test_the_kernel_setting_is_read_and_checked(kernel_env):
    step = make_decode_step([2, 1], [70, 20], heads=64)
    kernel_env("sm90_gluon")
    with pytest.raises(ValueError, match=f"{settings.KERNEL_ENV}='sm90_gluon'.*retired"):
        launcher.varlen_paged_mqa_logits(*launcher_args(step))
    kernel_env("sm90")
    with pytest.raises(RuntimeError, match="sm_90 CUDA kernel cannot run"):
        launcher.varlen_paged_mqa_logits(*launcher_args(step))
    kernel_env("portable")
    assert launcher.resolve_kernel(None) == "portable"
    assert launcher.resolve_kernel("auto") == "auto"  # the argument wins over the setting


def test_the_kernel_setting_is_read_once_per_process(kernel_env):
    """A setting changed after the first call is not seen (a process reads it
    once: an environment read costs about a microsecond per call)."""
    kernel_env("portable")
    assert launcher.resolve_kernel(None) == "portable"
    os.environ[settings.KERNEL_ENV] = "sm90"  # undone by the fixture's monkeypatch
    assert launcher.resolve_kernel(None) == "portable"


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
    for kernel in ("auto", "sm90", "sm90_cuda"):
        assert launcher.hopper_kernel_for(step.q, step.kv_cache, kernel) is ck
    assert launcher.hopper_kernel_for(step.q, step.kv_cache, "portable") is None
    monkeypatch.setattr(ck, "unsupported_reason", lambda q, kv, w=None: "no NVRTC")
    assert launcher.hopper_kernel_for(step.q, step.kv_cache, "auto") is None
    with pytest.raises(RuntimeError, match="no NVRTC"):
        launcher.hopper_kernel_for(step.q, step.kv_cache, "sm90")


# ---------------------------------------------------------------- launcher (CPU)

# ---------------------------------------------------------------- routes (CPU)

@pytest.fixture
def new_routes(monkeypatch):
    """An empty route cache; the list of full checks made (one per new route)."""
    monkeypatch.setattr(launcher, "_ROUTES", {})
    made = []
    real = launcher.check_varlen_inputs
    monkeypatch.setattr(launcher, "check_varlen_inputs", lambda *a: made.append(a) or real(*a))
    return made


def _route(args, out=None, kernel="portable", hint=4, knobs=False):
    return launcher.route_for(*args, out, kernel, hint, knobs)


def _with(args, **changed):
    """``args`` (:func:`launcher_args`) with some arguments replaced, by name."""
    names = ("q", "kv_cache", "weights", "context_lens", "block_table", "indices",
             "max_context_len")
    return tuple(changed.get(n, a) for n, a in zip(names, args))


def _restrided(t, stride0):
    """``t``'s values in a tensor whose first stride is ``stride0`` (a new layout)."""
    buf = torch.zeros(t.shape[0] * stride0, dtype=t.dtype)
    out = buf.as_strided(t.shape, (stride0, *t.stride()[1:]))
    out.copy_(t)
    return out


def test_a_route_is_made_once_per_call_layout_whatever_the_addresses(new_routes):
    """Calls on one layout share a route: other data at other addresses, and
    another ``max_context_len``, check nothing again."""
    step = make_decode_step([2, 1, 3], [70, 20, 130], heads=64)
    args = launcher_args(step)
    first = _route(args)
    assert (first.rows, first.heads, first.page, first.sm90) == (6, 64, 64, None)
    assert _route(args) is first
    moved = tuple(a.clone() for a in args[:6]) + args[6:]
    assert all(m.data_ptr() != a.data_ptr() for m, a in zip(moved[:6], args[:6]))
    assert _route(moved) is first
    assert _route(_with(args, max_context_len=args[6] + 5)) is first
    assert len(new_routes) == 1


def _layout_changes(step):
    """Valid calls differing from ``step``'s in one tensor's layout or one option:
    name -> (launcher args, route_for's other arguments)."""
    args = launcher_args(step)
    q, kv, w, ctx, bt, ids, mcl = args
    wider = torch.cat([bt, torch.zeros_like(bt)], 1)[:, : bt.shape[1]]
    more_blocks = torch.cat([kv, kv[:1]])
    out = torch.empty(q.shape[0], mcl)
    return {
        "q rows (another step)": (launcher_args(make_decode_step([2, 2, 3], [70, 20, 130])), {}),
        "kv_cache shape": (_with(args, kv_cache=more_blocks), {}),
        "kv_cache page stride": (_with(args, kv_cache=_restrided(kv, kv.stride(0) + 64)), {}),
        "weights row stride": (_with(args, weights=_restrided(w, w.stride(0) + 4)), {}),
        "context_lens shape": (_with(args, context_lens=ctx.reshape(-1)), {}),
        "block_table stride": (_with(args, block_table=wider), {}),
        "q row stride": (_with(args, q=_restrided(q, q.stride(0) + 128)), {}),
        "out given": (args, {"out": out}),
        "out row stride": (args, {"out": torch.empty(q.shape[0], mcl + 64)[:, :mcl]}),
        "kernel": (args, {"kernel": "auto"}),
        "run-length hint": (args, {"hint": 1}),
        "tuning knobs": (args, {"knobs": True}),
    }


def test_every_layout_change_makes_a_new_route(new_routes):
    """A change of any tensor's shape or strides, of the given logits, of the
    kernel asked for, of the hint or of the tuning knobs' presence is checked
    afresh and gets a route of its own."""
    step = make_decode_step([2, 1, 3], [70, 20, 130], heads=64)
    first = _route(launcher_args(step))
    seen = [first]
    for name, (args, kw) in _layout_changes(step).items():
        got = _route(args, **kw)
        assert all(got is not r for r in seen), name
        seen.append(got)
        assert _route(args, **kw) is got, name   # and is kept
    assert len(new_routes) == len(seen)


def _bad_calls(step):
    """Calls that must fail, each with the argument its ValueError names."""
    args = launcher_args(step)
    q, kv, w, ctx, bt, ids, mcl = args
    misaligned = torch.zeros(ids.numel() + 1, dtype=torch.int32)[1:]
    return [
        ("weights", _with(args, weights=w.double()), {}),
        ("weights", _with(args, weights=w.t().contiguous().t()), {}),
        ("q", _with(args, q=q.float()), {}),
        ("q", _with(args, q=q[:, :, :48]), {}),
        ("kv_cache", _with(args, kv_cache=kv.view(torch.int8)), {}),
        ("kv_cache", _with(args, kv_cache=_restrided(kv, kv.stride(0) + 2)), {}),
        ("context_lens", _with(args, context_lens=torch.stack([ctx, ctx], 1)[:, :, 0]), {}),
        ("context_lens", _with(args, context_lens=ctx.long()), {}),
        ("block_table", _with(args, block_table=bt.t().contiguous().t()), {}),
        ("indices", _with(args, indices=misaligned.copy_(ids)), {}),
        ("indices", _with(args, indices=ids.tolist()), {}),
        ("indices", _with(args, indices=ids.long()), {}),
        ("max_context_len", _with(args, max_context_len=0), {}),
        ("max_context_len", _with(args, max_context_len=float(mcl)), {}),
        ("inputs", _with(args, weights=w.to("meta")), {}),
        ("out", args, {"out": torch.empty(q.shape[0], mcl, dtype=torch.float64)}),
        ("out", args, {"out": torch.empty(q.shape[0], mcl - 1)}),
        ("out", args, {"out": torch.empty(q.shape[0], mcl, device="meta")}),
        ("out", args, {"out": "logits"}),
    ]


@pytest.mark.parametrize("which", range(19))
def test_a_bad_argument_after_a_good_call_still_raises_naming_it(new_routes, which):
    """A kept route never lets a bad call through: each bad variant of a call
    whose good twin has a route raises the ValueError naming the argument, every
    time, and the good call still finds its route."""
    step = make_decode_step([2, 1, 3], [70, 20, 130], heads=64)
    bad = _bad_calls(step)
    assert len(bad) == 19
    name, args, kw = bad[which]
    first = _route(launcher_args(step))
    for _ in range(2):
        with pytest.raises(ValueError, match=f"^{name}: "):
            _route(args, **kw)
    assert _route(launcher_args(step)) is first


def test_logits_narrower_than_a_later_call_asks_are_refused_on_a_kept_route(new_routes):
    """The given logits' width is checked against every call's
    ``max_context_len``, route kept or not."""
    step = make_decode_step([2, 1, 3], [70, 20, 130], heads=64)
    args = launcher_args(step)
    out = torch.empty(step.rows.num_rows, args[6])
    first = _route(args, out=out)
    with pytest.raises(ValueError, match="^out: "):
        _route(_with(args, max_context_len=args[6] + 1), out=out)
    assert _route(_with(args, max_context_len=args[6] - 1), out=out) is first
    assert len(new_routes) == 1


def test_the_entry_point_keeps_routes_and_computes_the_same_logits(new_routes, device):
    """Through the public entry (portable kernel; the CPU's interpreter where
    there is no GPU): repeated calls on one layout check once and compute the
    reference's logits, new data at new addresses included."""
    step = make_decode_step([2, 1, 3], [70, 20, 130], heads=64, device=device)
    rows = step.rows
    for seed in range(2):
        other = make_decode_step([2, 1, 3], [70, 20, 130], heads=64, seed=seed + 1, device=device)
        for s in (step, other):
            args = launcher_args(s)
            got = launcher.varlen_paged_mqa_logits(*args, kernel="portable")
            ref = paged_mqa_logits_ref(*args[:5], s.max_context_len, indices=rows.indices)
            mask = valid_mask(args[3], s.max_context_len, rows.indices)
            # the interpreter sums as the reference does; the GPU's fp8 dot otherwise
            tol = 1e-5 if device.type == "cpu" else 1e-3
            assert (got[mask] - ref[mask]).norm() / ref[mask].norm() < tol
    assert len(new_routes) == 1


# ------------------------------------- the CUDA kernel's eager path, driver stubbed (CPU)

def _fresh_pack(q, kv, w, ctx, bt, out, table, ctas) -> list[bytes]:
    """The parameter block a launch on these tensors must hand the driver,
    built field by field through ctypes (not by the launch's own packing):
    each parameter's bytes, in the kernel's order."""
    heads = q.shape[2]
    p = ck._Params()
    p.kv_map.bytes[:] = host_time.fake_descriptor(kv.data_ptr(), (128, 64, kv.shape[0]),
                                                  (128, kv.stride(0)), (128, 64, 1))
    p.q_map.bytes[:] = host_time.fake_descriptor(q.data_ptr(), (128, heads, q.shape[0]),
                                                 (128, q.stride(0)), (128, heads, 128 // heads))
    p.kv, p.stride_block, p.w, p.stride_w = kv.data_ptr(), kv.stride(0), w.data_ptr(), w.stride(0)
    p.ctx, p.bt, p.stride_bt = ctx.data_ptr(), bt.data_ptr(), bt.stride(0)
    p.out, p.stride_out = out.data_ptr(), out.stride(0)
    p.table, p.ctas, p.num_segs = table.data_ptr(), ctas.data_ptr(), q.shape[0]
    base = ctypes.addressof(p)
    return [ctypes.string_at(base + getattr(ck._Params, n).offset, ctypes.sizeof(t))
            for n, t in ck.PARAMS]


def _handed_to_driver(launch) -> list[bytes]:
    """What ``cuLaunchKernel`` reads for a recorded launch: each parameter's
    bytes at the address its pointer array gives."""
    ptrs = (ctypes.c_void_p * len(ck.PARAMS)).from_address(launch[9])
    return [ctypes.string_at(ptrs[i], ctypes.sizeof(t)) for i, (_, t) in enumerate(ck.PARAMS)]


@contextlib.contextmanager
def _stubbed_sm90(schedule):
    """The launcher taking the CUDA kernel on CPU tensors, the driver stubbed
    (:mod:`vllm_dsa_varlen.bench.launch`); yields (driver, encodes, build)."""
    ops = types.SimpleNamespace(launcher=launcher, ck=ck)
    with host_time.fake_hopper(), host_time.stubbed_launcher(ops, schedule) as got:
        yield got


def _moving_calls(step):
    """Eager calls of one step as serving makes them, layer after layer: new
    queries and weights, other KV caches of the layout, a cache reallocated at a
    new address, a cache of another layout at an old address, logits given or
    not: (name, q, kv_cache, weights, out or None)."""
    q, kv, w = step.q, step.kv_cache, step.weights
    rows, mcl = step.rows.num_rows, step.max_context_len
    other_kv = kv.clone()
    return [("first", q, kv, w, None),
            ("again", q, kv, w, None),
            ("new q and weights", q.clone(), kv, w.clone(), None),
            ("another layer's cache", q, other_kv, w, None),
            ("back to the first", q, kv, w, None),
            ("cache reallocated", q, kv.clone(), w, None),
            ("fewer blocks, same address", q, kv[:-1], w, None),
            ("another page stride, same address",
             q, kv.view(-1)[: kv.shape[0] // 2 * 2 * kv.stride(0)].as_strided(
                 (kv.shape[0] // 2, *kv.shape[1:]), (2 * kv.stride(0), *kv.stride()[1:])), w, None),
            ("logits given", q, kv, w, torch.empty(rows, mcl)),
            ("wider logits given", q, kv, w, torch.empty(rows, mcl + 128)[:, :mcl])]


@pytest.fixture(params=[None, "1"])
def pipeline(request, process_setting):
    """DSA_VARLEN_PIPELINE unset or 1 for one test (``process_setting``)."""
    process_setting(ck.PIPELINE_ENV, ck.read_pipeline, request.param)
    return request.param


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("heads, hint, evict", [(64, 1, True), (64, 2, True), (64, 3, False),
                                               (64, 4, False), (32, 2, True), (32, 4, True),
                                               (32, 5, False), (32, 8, False)])
def test_the_launcher_asks_for_the_build_of_its_hint_and_head_count(heads, hint, evict, big,
                                                                     pipeline):
    """The launcher's route loads the build ``defines_for`` gives the call's
    run-length hint at its head count and row count: evict-first where a
    request's rows fit one row group (2 rows at 64 heads, 4 at 32), with
    DSA_VARLEN_PIPELINE=1 pipelined at 64 heads from PIPELINE_MIN_ROWS
    rows (unset: four warpgroups), ``HEADS=32`` at 32 heads."""
    reps = ck.PIPELINE_MIN_ROWS // (hint + 1) + 1 if big else 1
    step = make_decode_step([hint, 1] * reps, [300, 70] * reps, heads=heads)
    assert (step.rows.num_rows >= ck.PIPELINE_MIN_ROWS) == big
    rows = step.rows
    ctx, bt, ids = rows.context_lens.view(-1, 1), rows.block_table, rows.indices
    schedule = ck.plan_torch(ids, ctx, step.max_context_len, bt.shape[1], heads, programs=4)
    asked = []
    with _stubbed_sm90(schedule) as (fake, _, loaded):
        stub = ck.load  # the stub's loader; restored with it
        ck.load = lambda device, defines=(): asked.append(tuple(defines)) or stub(device, defines)
        launcher.varlen_paged_mqa_logits(step.q, step.kv_cache, step.weights, ctx, bt, ids,
                                         step.max_context_len, max_run_len=hint,
                                         schedule_cache={})
        assert fake.launches and fake.launches[-1][0] == loaded.fn
    pipe = ck.PIPELINE if heads == 64 and big and pipeline else ()
    assert asked == [(("EVICT_FIRST=1",) if evict else ()) + pipe
                     + (("HEADS=32",) if heads == 32 else ())]
    assert ck.defines_for(hint, "fp32", heads=heads,
                          rows=step.rows.num_rows) == asked[0][:len(pipe) + evict]


@pytest.mark.parametrize("heads", [64, 32])
def test_eager_sm90_calls_hand_the_driver_a_fresh_pack(heads):
    """Through the launcher's kept routes, prepared launches and descriptor
    caches, every call hands ``cuLaunchKernel`` the bytes a block built afresh
    for that call holds (descriptors for the call's addresses and layouts
    included), on the build's grid and the current stream; each descriptor is
    encoded once per (address, layout)."""
    step = make_decode_step([2, 1, 3, 4], [70, 20, 130, 300], heads=heads)
    rows = step.rows
    ctx, bt, ids = rows.context_lens.view(-1, 1), rows.block_table, rows.indices
    mcl = step.max_context_len
    table, ctas = ck.plan_torch(ids, ctx, mcl, bt.shape[1], heads, programs=4)
    cache = {}
    with _stubbed_sm90((table, ctas)) as (fake, encodes, loaded):
        for name, q, kv, w, out in _moving_calls(step):
            got = launcher.varlen_paged_mqa_logits(q, kv, w, ctx, bt, ids, mcl, max_run_len=4,
                                                   out=out, schedule_cache=cache)
            assert out is None or got is out
            fn, grid, _, _, block, _, _, smem, stream, params, extra = fake.launches[-1]
            assert (fn, grid, block, smem, stream, params, extra) == (
                loaded.fn, 4, ck.THREADS, loaded.smem, 0x5EED, loaded.params_addr, 0), name
            assert _handed_to_driver(fake.launches[-1]) == _fresh_pack(
                q, kv, w, ctx, bt, got, table, ctas), name
        assert len(fake.launches) == len(_moving_calls(step))
        assert len(encodes) == len(set(encodes))  # one encode per (address, layout)
        addresses = {e[0] for e in encodes}
        # caches: 3 addresses, 5 (address, layout) pairs; queries: 2 addresses
        assert len(encodes) == 7 and len(addresses) == 5


def test_a_bad_call_on_the_sm90_path_still_raises(monkeypatch):
    """After good calls, a schedule of the wrong shape or a bad argument still
    raises the ValueError naming it, and launches nothing."""
    step = make_decode_step([2, 1, 3], [70, 20, 130], heads=64)
    rows = step.rows
    args = launcher_args(step)
    sched = ck.plan_torch(rows.indices, args[3], step.max_context_len, rows.block_table.shape[1],
                          programs=4)
    with _stubbed_sm90(sched) as (fake, _, _):
        launcher.varlen_paged_mqa_logits(*args, schedule=sched)
        launcher.varlen_paged_mqa_logits(*args, schedule_cache={})
        with pytest.raises(ValueError, match="^schedule: "):
            launcher.varlen_paged_mqa_logits(*args, schedule=(sched[0][:-1], sched[1]))
        with pytest.raises(ValueError, match="^schedule: "):
            launcher.varlen_paged_mqa_logits(*args, schedule=sched[0])
        for name, bad, kw in _bad_calls(step):
            with pytest.raises(ValueError, match=f"^{name}: "):
                launcher.varlen_paged_mqa_logits(*bad, **kw)
        assert len(fake.launches) == 2


def test_evicted_descriptors_are_encoded_again(monkeypatch):
    """With room for one descriptor per layout, calls alternating between two
    caches re-encode each time and still pack the right one."""
    monkeypatch.setattr(ck, "_MAPS_LIMIT", 1)
    monkeypatch.setattr(ck, "_LAYOUTS_LIMIT", 1)  # and one layout: the registry restarts too
    step = make_decode_step([2, 3], [70, 130], heads=64)
    rows = step.rows
    ctx, bt, ids = rows.context_lens.view(-1, 1), rows.block_table, rows.indices
    mcl = step.max_context_len
    sched = ck.plan_torch(ids, ctx, mcl, bt.shape[1], programs=4)
    caches = [step.kv_cache, step.kv_cache.clone()]
    with _stubbed_sm90(sched) as (fake, encodes, _):
        for i in range(4):
            kv = caches[i % 2]
            out = launcher.varlen_paged_mqa_logits(step.q, kv, step.weights, ctx, bt, ids, mcl)
            assert _handed_to_driver(fake.launches[-1]) == _fresh_pack(
                step.q, kv, step.weights, ctx, bt, out, *sched)
        kv_encodes = [e[0] for e in encodes if e[3] == (128, 64, 1)]  # a page per box
        assert kv_encodes == [c.data_ptr() for c in caches] * 2


@pytest.mark.parametrize("mcl", [1, 127, 128, 129, 2000, 2048])
def test_allocated_logits_rows_start_512_byte_aligned(mcl):
    """The launcher's own logits: ``[R, max_context_len]`` float32, contiguous
    rows whose stride is the width rounded up to 128 elements (512 bytes)."""
    out = launcher.new_logits(5, mcl, torch.device("cpu"))
    assert out.dtype == torch.float32 and tuple(out.shape) == (5, mcl)
    assert out.stride(1) == 1 and out.stride(0) % 128 == 0 and 0 <= out.stride(0) - mcl < 128
    out.fill_(1.0)  # every element addressable
    assert launcher.new_logits(0, mcl, torch.device("cpu")).shape == (0, mcl)


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


# ------------------------------------------------ GPU (sm_90): eager calls on kept routes

def _fresh_kv(like, gen):
    """A KV cache of ``like``'s shape with fresh random contents, newly allocated."""
    blocks, page, _, width = like.shape
    k = torch.randn((blocks, page, width - 4), generator=gen, device="cuda")
    return quantize_kv_fp8(k)


def _check_against_reference(q, kv, w, ctx, bt, ids, mcl, out, poisoned: bool) -> None:
    """Every valid position of ``out`` against the reference (relative error);
    where ``out`` was poisoned, nothing else written."""
    torch.cuda.synchronize()
    ref = paged_mqa_logits_ref(q, kv, w, ctx, bt, mcl, indices=ids)
    mask = valid_mask(ctx, mcl, ids)
    got = out[:, :mcl]
    assert torch.isfinite(got[mask]).all()
    assert (got[mask] - ref[mask]).norm() / ref[mask].norm() < 1e-3
    if poisoned:
        assert torch.isnan(got[~mask]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("heads", [64, 32])
def test_eager_calls_on_kept_routes_follow_their_tensors(heads):
    """Eager calls as serving makes them ("auto", the CUDA kernel eagerly; one
    schedule cache per step shared by its layers; each layer its own KV cache
    of one layout; fresh queries and weights on every call; logits allocated
    by the launcher, or given and poisoned), on fresh random inputs, against
    the reference: kept routes, prepared launches and cached descriptors hand
    every launch its own tensors, after a cache is reallocated at a new address,
    when an old address comes back with other contents, when another layout
    sits at a known address, and on steps of other row counts."""
    _needs_cuda_kernel()
    launcher._ROUTES.clear()  # the routes counted at the end are this test's
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for s, (reqs, tokens, context) in enumerate([(12, 4, 3000), (5, 2, 9000), (12, 4, 3000)]):
        step = random_decode_step(reqs, tokens, context, heads=heads, seed=seed + s,
                                  device="cuda", variable=True)
        rows = step.rows
        ctx, bt, ids = rows.context_lens.view(-1, 1), rows.block_table, rows.indices
        mcl = step.max_context_len
        layers = [_fresh_kv(step.kv_cache, gen) for _ in range(3)]
        cache = {}

        def call(kv, given: bool):
            q = torch.randn(step.q.shape, generator=gen, device="cuda").to(torch.float8_e4m3fn)
            w = torch.randn(step.weights.shape, generator=gen, device="cuda") / heads ** 0.5
            out = (torch.full((rows.num_rows, mcl + 40), POISON, device="cuda")[:, :mcl]
                   if given else None)
            got = launcher.varlen_paged_mqa_logits(q, kv, w, ctx, bt, ids, mcl,
                                                   max_run_len=tokens, out=out,
                                                   schedule_cache=cache)
            assert isinstance(launcher.LAST_COMPILED[0], ck._Loaded) and cache  # the CUDA kernel
            _check_against_reference(q, kv, w, ctx, bt, ids, mcl, got, given)

        for _ in range(2):
            for kv in layers:
                call(kv, given=False)
                call(kv, given=True)
        old = layers[0].data_ptr()
        layers[0] = _fresh_kv(step.kv_cache, gen)   # reallocated while the old one lives
        assert layers[0].data_ptr() != old
        call(layers[0], given=False)
        del layers[1]
        again = _fresh_kv(step.kv_cache, gen)       # the allocator may hand the address back
        call(again, given=True)
        call(layers[0], given=True)
        # another layout at a known address: every other page of a pool, then all of it
        blocks, stride = step.kv_cache.shape[0], step.kv_cache.stride(0)
        pool = torch.empty(2 * blocks * stride, dtype=torch.uint8, device="cuda")
        every_other = pool.as_strided(step.kv_cache.shape,
                                      (2 * stride, *step.kv_cache.stride()[1:]))
        every_other.copy_(_fresh_kv(step.kv_cache, gen))
        dense = pool[: blocks * stride].view(step.kv_cache.shape)
        call(every_other, given=True)
        dense.copy_(_fresh_kv(step.kv_cache, gen))
        call(dense, given=True)
        call(every_other, given=False)              # partly rewritten through dense
    assert len(launcher._ROUTES) < 64


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_a_captured_launch_keeps_its_own_parameters():
    """A graph captured through the launcher replays its own call after the
    routes and descriptors it was captured with are dropped and the parameter
    block is rewritten by eager calls on other tensors (the graph holds copies
    of every parameter)."""
    _needs_cuda_kernel()
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    step = random_decode_step(16, 4, 4000, heads=64, seed=seed, device="cuda", variable=True)
    other = random_decode_step(9, 2, 2500, heads=64, seed=seed + 1, device="cuda")
    args = launcher_args(step)
    out = torch.full((step.rows.num_rows, step.max_context_len + 40), POISON,
                     device="cuda")[:, : step.max_context_len]
    launcher.varlen_paged_mqa_logits(*args, out=out, max_run_len=4)   # loaded before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        launcher.varlen_paged_mqa_logits(*args, out=out, max_run_len=4, schedule_cache={})
    launcher._ROUTES.clear()
    ck._DESCRIPTORS.clear()
    for _ in range(3):
        run_poisoned(other, max_run_len=2)
    out.fill_(POISON)
    graph.replay()
    _check_against_reference(*args, out, poisoned=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_no_host_sync_in_eager_launcher_calls(no_host_sync):
    """An eager call through the launcher (schedule planned by the step's first
    call, logits allocated or given) never waits on the device, on a new route
    or a kept one."""
    _needs_cuda_kernel()
    step = random_decode_step(16, 3, 2048, heads=64, device="cuda", variable=True, seed=5)
    args = launcher_args(step)
    out = torch.empty(step.rows.num_rows, step.max_context_len, device="cuda")
    launcher.varlen_paged_mqa_logits(*args, out=out)   # the build loaded
    launcher._ROUTES.clear()
    torch.cuda.synchronize()
    with no_host_sync():
        cache = {}
        for _ in range(2):
            launcher.varlen_paged_mqa_logits(*args, schedule_cache=cache)
            launcher.varlen_paged_mqa_logits(*args, out=out, schedule_cache=cache)
    _check_against_reference(*args, out, poisoned=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_the_serving_path_leaves_the_signal_handling_alone(sigterm_kept):
    """What the plugin's engine core runs beyond stock's, in its main thread:
    the precompile, the driver's module loads, an eager call, a graph capture
    and replay, the decode top-k, the query kernel.  None may leave SIGTERM
    blocked there, replace vLLM's handler in Python's table, or leave a C-level
    action under which that handler no longer runs while the core sleeps in
    its input queue's wait (it would not hear a server's stop); that is tried
    after each stage, so a failure names the stage.  The C-level action
    itself may change: Triton's compiler (LLVM) installs its own, which hands
    the signal on to the handler before it (stock vLLM compiles Triton
    kernels too)."""
    _needs_cuda_kernel()
    from query_checks import fused_q_inputs
    from vllm_dsa_varlen.ops import triton_fused_q as fq

    with sigterm_kept(exact=False) as heard:

        def stage(name):
            torch.cuda.synchronize()
            assert heard(), f"after {name}, SIGTERM no longer reaches the waiting main thread"

        precompile(heads=64)
        stage("the precompile")
        step = random_decode_step(8, 3, 3000, heads=64, device="cuda", variable=True,
                                  seed=int(torch.randint(0, 2**31 - 1, (1,))))
        args = launcher_args(step)
        out = torch.full((step.rows.num_rows, step.max_context_len), POISON, device="cuda")
        launcher.varlen_paged_mqa_logits(*args, out=out)
        stage("the eager logits call")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            launcher.varlen_paged_mqa_logits(*args, out=out, schedule_cache={})
        out.fill_(POISON)
        graph.replay()
        stage("the graph capture and replay")
        rows, width = step.rows.num_rows, step.max_context_len
        lens = torch.full((rows,), width, dtype=torch.int32, device="cuda")
        picked = torch.empty((rows, 2048), dtype=torch.int32, device="cuda")
        ct.launch_checked(torch.randn(rows, width, device="cuda"), lens, 2048, picked, bound=width)
        stage("the decode top-k")
        fq.fused_q(**fused_q_inputs(5, device=torch.device("cuda"),
                                    seed=int(torch.randint(0, 2**31 - 1, (1,)))),
                   index_rope_interleave=False, quantize_mqa=False)
        stage("the query kernel")
    _check_against_reference(*args, out, poisoned=True)
