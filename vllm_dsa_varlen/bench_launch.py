"""``vllm-dsa-varlen-bench --launch-host``: host time per eager call of the
logits kernels, against CUDA-graph replay.

An eager call (vLLM's piecewise mode runs the indexer op outside the graphs in
every mixed prefill+decode step) pays the launcher's Python and the launch on
every layer of every step; a graph replay pays neither.  This measures both.

GPU (default): DeepSeek V3.2 decode steps (H 64, D 128, page 64), each path
called ``--calls`` times back to back without a sync, five rounds (median):

* ``host``  — µs per call until the call returns (perf_counter, no sync);
* ``wall``  — µs per call until the GPU is done (sync after the last call):
  host-bound when it follows ``host``, GPU-bound when it follows ``graph``;
* ``graph`` — µs per call of the same call captured in a CUDA graph and
  replayed (CUDA events, no L2 flush: back-to-back calls as a model runs);
* ``replay host`` — µs per ``graph.replay()`` on the host.

Paths: ``cuda launch`` (:func:`cuda_paged_mqa_logits.launch` alone, schedule
given), ``launcher sm90_cuda`` / ``portable`` (the public
launcher, schedule cache of the step prefilled as serving's first layer
leaves it), ``launcher auto`` as it stands (``EAGER_CUDA_SM90`` as set: its
eager and graph columns may be different kernels, as in serving) and with
``EAGER_CUDA_SM90 = True``; ``plan`` (the schedule, once per step).

``--fake`` (any machine, no GPU): :func:`cuda_paged_mqa_logits.launch` with
the driver calls stubbed (TMA encode, stream lookup, ``cuLaunchKernel``) on
CPU tensors: the argument building and packing alone, the launch as it is
now against the same stubs under the launch this replaced (git ``--base``).

    vllm-dsa-varlen-bench --launch-host [--calls 50] [--cases B1 B64]
    vllm-dsa-varlen-bench --launch-host --fake [--base c44e57d]
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import subprocess
import tempfile
import time
import types

import torch

from .bench_graph import capture_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALLS = 50  # calls per timed round unless --calls says otherwise


def _selected(cases) -> list:
    """Names of :data:`CASES` that contain one of ``cases`` (substrings; each may
    hold several, comma-separated), all of them when none is given."""
    wanted = [c for text in cases or [] for c in text.split(",") if c]
    return [name for name in CASES if not wanted or any(c in name for c in wanted)]


CASES = {  # name: (requests, tokens per request, context)
    "B1 L8K 4tok": (1, 4, 8192),
    "B16 L16K 4tok": (16, 4, 16384),
    "B64 L8K 4tok": (64, 4, 8192),
    "B128 L8K 4tok": (128, 4, 8192),
    "B64 L32K 2tok": (64, 2, 32768),
}


def _rounds(fn, calls: int, rounds: int = 5):
    """(host µs per call, wall µs per call), medians over ``rounds``."""
    host, wall = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


def _graph(fn, calls: int, rounds: int = 5):
    """(GPU µs per replayed call, host µs per replay) of ``fn`` in a CUDA graph."""
    graph = capture_graph(torch, fn)
    graph.replay()
    torch.cuda.synchronize()
    gpu, host = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            graph.replay()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3 / calls)
        host.append((t1 - t0) / calls * 1e6)
    return statistics.median(gpu), statistics.median(host)


def gpu_paths(step):
    """Name -> zero-argument call of every path this GPU has, on ``step``."""
    from .ops import cuda_paged_mqa_logits as ck
    from .ops import launcher

    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    args = (step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
            step.max_context_len)
    hint = int(step.decode_lens.max())
    out = torch.empty((rows.num_rows, step.max_context_len), device="cuda")
    paths = {}
    if ck.unsupported_reason(step.q, step.kv_cache, step.weights) is None:
        sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1])
        defines = ck.defines_for(hint)
        paths["cuda launch"] = lambda: ck.launch(*args, out, schedule=sched, defines=defines)
        paths["plan (once per step)"] = lambda: ck.plan(
            rows.indices, ctx, step.max_context_len, rows.block_table.shape[1])
        paths.update(driver_floor(ck, args, out, sched, defines))
    else:
        print(f"cuda: not timed ({ck.unsupported_reason(step.q, step.kv_cache, step.weights)})")
    kernels = ["sm90_cuda"] * ("cuda launch" in paths) + ["portable"]
    for kernel in kernels + ["auto"]:
        cache: dict = {}

        def call(kernel=kernel, cache=cache):
            launcher.varlen_paged_mqa_logits(*args, max_run_len=hint, kernel=kernel, out=out,
                                             schedule_cache=cache)
        paths[f"launcher {kernel}" + (" (as set)" if kernel == "auto" else "")] = call
    if "cuda launch" in paths:
        paths["launcher auto, EAGER_CUDA_SM90"] = call
    return paths


def driver_floor(ck, args, out, sched, defines) -> dict:
    """The floor under ``cuda launch``: ``cuLaunchKernel`` alone (and the
    current-stream lookup) with the parameter block a launch of the same call
    left (the same kernel, the same arguments), through cuda-python as the
    kernel launches, and through ctypes on ``libcuda`` for comparison."""
    import ctypes

    from vllm_dsa_varlen.ops.cuda_binding import launch_function

    kern = ck.launch(*args, out, schedule=sched, defines=defines)
    programs, index = ck.num_sms(args[0].device), args[0].device.index
    drv = ck._driver()
    lib = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    lib.restype = ctypes.c_int
    lib.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn = int(kern.fn)

    def by_ctypes():
        err = lib(fn, programs, 1, 1, ck.THREADS, 1, 1, kern.smem, ck._stream(index),
                  kern.params_addr, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel: {err}")
    return {"cuLaunchKernel alone (cuda-python)": lambda: launch_function(
                drv, kern.fn, kern.ctx, programs, ck.THREADS, kern.smem, ck._stream(index),
                kern.params_addr),
            "cuLaunchKernel alone (ctypes)": by_ctypes}


def run_gpu(args) -> list[tuple]:
    from .ops import launcher
    from .workloads import random_decode_step

    try:
        import cuda.bindings
        bindings = cuda.bindings.__version__
    except ImportError as exc:
        bindings = f"missing ({exc})"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuda-bindings {bindings}, "
          f"EAGER_CUDA_SM90 = {launcher.EAGER_CUDA_SM90}", flush=True)
    table = []
    calls = args.calls or CALLS
    for name in _selected(args.cases):
        reqs, tokens, context = CASES[name]
        step = random_decode_step(reqs, tokens, context, heads=64, device="cuda")
        for path, fn in gpu_paths(step).items():
            eager_flag = path.endswith("EAGER_CUDA_SM90")
            saved = launcher.EAGER_CUDA_SM90
            launcher.EAGER_CUDA_SM90 = saved or eager_flag
            try:
                fn()  # compile, load, plan into the step's cache
                torch.cuda.synchronize()
                host, wall = _rounds(fn, calls)
                gpu, replay_host = _graph(fn, calls)
            except Exception as exc:  # noqa: BLE001 - report, time the other paths
                print(f"{name} | {path}: failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            finally:
                launcher.EAGER_CUDA_SM90 = saved
            table.append((name, path, host, wall, gpu, replay_host))
            print(f"{name} | {path}: host {host:.1f} wall {wall:.1f} graph {gpu:.1f} "
                  f"replay host {replay_host:.1f}", flush=True)
    print("\n| case | path | host µs/call | wall µs/call | graph µs/call | replay host µs |")
    print("|---|---|---|---|---|---|")
    for name, path, host, wall, gpu, replay_host in table:
        print(f"| {name} | {path} | {host:.1f} | {wall:.1f} | {gpu:.1f} | {replay_host:.1f} |")
    return table


# ------------------------------------------------------------- fake launch (CPU)

class _FakeDriver:
    """cuda-python's driver module, for the launch only: records the launch."""

    def __init__(self):
        self.launches = []

    def cuLaunchKernel(self, *args):
        self.launches.append(args)
        return (0,)


@contextlib.contextmanager
def stubbed(ck):
    """``ck`` (the CUDA kernel's module, as it is now) launching on CPU tensors:
    the build's parameter block without a loaded kernel, the TMA encode, the
    stream lookup, the device query and ``cuLaunchKernel`` stubbed.  Yields the
    fake driver (its ``launches``) and the list of encodes made."""
    encodes = []
    fake = _FakeDriver()
    loaded = ck._Loaded(fn="varlen_logits_sm90", ctx=None, smem=ck.SMEM_BYTES)

    def encode(base, dims, strides, box):
        encodes.append((base, tuple(dims), tuple(strides), tuple(box)))
        m = ck._TmaMap()
        m.bytes[0], m.bytes[1] = base, len(encodes)
        return m

    saved = (ck.load, ck._driver, ck._encode, ck._stream, torch.cuda.current_device)
    ck.load = lambda device, defines=(): loaded
    ck._driver = lambda: fake
    ck._encode = encode
    ck._stream = lambda index: 0x5EED
    torch.cuda.current_device = lambda: None  # CPU tensors' device index
    ck._MAPS.clear()
    try:
        yield fake, encodes, loaded
    finally:
        ck.load, ck._driver, ck._encode, ck._stream, torch.cuda.current_device = saved
        ck._MAPS.clear()


def _base_module(rev: str):
    """The CUDA kernel's module at git revision ``rev``, its imports stubbed
    (it only needs to build its arguments here)."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:vllm_dsa_varlen/ops/"
                          "cuda_paged_mqa_logits.py"], capture_output=True, text=True, check=True)
    text = src.stdout.replace("from .triton_paged_mqa_logits import _num_sms",
                              "from vllm_dsa_varlen.ops.common import num_sms as _num_sms")
    text = text.replace("from .", "from vllm_dsa_varlen.ops.")
    path = os.path.join(tempfile.mkdtemp(), "cuda_base.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("cuda_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def stubbed_base(old):
    """The replaced ctypes launch on CPU tensors, the same calls stubbed."""
    lib = types.SimpleNamespace(cuLaunchKernel=lambda *a: 0)
    saved = (old.load, old._driver, old._encode, torch.cuda.current_stream, torch.cuda.device)
    old.load = lambda device, defines=(): types.SimpleNamespace(fn=None)
    old._driver = lambda: lib
    old._encode = lambda base, dims, strides, box: old._TmaMap()
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0x5EED)
    torch.cuda.device = lambda device: contextlib.nullcontext()
    try:
        yield
    finally:
        old.load, old._driver, old._encode, torch.cuda.current_stream, torch.cuda.device = saved


def run_fake(args) -> list[tuple]:
    from .ops import cuda_paged_mqa_logits as ck
    from .workloads import random_decode_step

    torch.set_num_threads(1)
    table = []
    calls = args.calls or CALLS
    for name in _selected(args.cases):
        reqs, tokens, context = CASES[name]
        step = random_decode_step(reqs, tokens, min(context, 2048), heads=64)
        rows = step.rows
        ctx = rows.context_lens.view(-1, 1)
        out = torch.empty((rows.num_rows, step.max_context_len))
        callers = {"now (cuda-python, parameter block)": (ck, stubbed(ck))}
        if args.base:
            old = _base_module(args.base)
            callers[f"{args.base} (ctypes)"] = (old, stubbed_base(old))
        for label, (mod, stubs) in callers.items():
            with stubs:
                sched = mod.plan(rows.indices, ctx, step.max_context_len,
                                 rows.block_table.shape[1], programs=4)

                def call(mod=mod, sched=sched):
                    mod.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                               rows.indices, step.max_context_len, out, schedule=sched)
                call()
                per = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    for _ in range(calls * 20):
                        call()
                    per.append((time.perf_counter() - t0) / (calls * 20) * 1e6)
            table.append((name, label, statistics.median(per)))
            print(f"{name} | {label}: {statistics.median(per):.2f} µs per launch", flush=True)
    print("\n| case | launch (driver stubbed, CPU tensors) | host µs/call |")
    print("|---|---|---|")
    for name, label, us in table:
        print(f"| {name} | {label} | {us:.2f} |")
    return table


def run(args) -> int:
    """The ``--launch-host`` mode (``args``: ``calls``, ``cases``, ``fake``,
    ``base``, ``cpu``): the GPU table, or the fake launch's (``--fake``, or no
    GPU)."""
    if args.calls is not None and args.calls < 1:
        raise ValueError(f"--calls: expected an int >= 1, got {args.calls}")
    if args.fake or args.cpu or not torch.cuda.is_available():
        if not args.fake:
            print("no CUDA GPU: timing the fake launch (--fake)")
        run_fake(args)
    else:
        run_gpu(args)
    return 0
