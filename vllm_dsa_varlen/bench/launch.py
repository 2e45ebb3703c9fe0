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

Paths: ``cuLaunchKernel alone`` (the driver call and the stream lookup, with
a parameter block a launch left: the floor), ``prepared launch`` (a
:class:`cuda_paged_mqa_logits.Prepared` called with the data addresses, as the
launcher's kept route calls it), ``cuda launch``
(:func:`cuda_paged_mqa_logits.launch`, which prepares on every call; schedule
given), ``launcher sm90_cuda`` / ``portable`` / ``auto`` (the public launcher,
the step's schedule cache prefilled as serving's first layer leaves it;
``auto`` as set), ``launcher auto, no out`` (the logits
allocated by the launcher, as vLLM calls it), ``indexer op 0.33`` / ``0.27
(glue + launcher)`` (the indexer op's logits call of each vLLM line on a
tagged varlen step: the plugin's kernel-call replacement, then the launcher,
:func:`glue_paths`), ``plan`` (the schedule, once per step).  With
``--topk-lib`` (vLLM's ``_C`` extension) the decode top-k's eager call too
(:func:`topk_paths`): vLLM's op as 0.27.1's indexer calls it, the plugin's
:func:`.topk.dispatch` taking the project's kernel (``own``) and
:func:`.ops.cuda_topk.decode_topk` alone.  A short table ends the output: the
floor, the prepared launch and the launcher's ``auto`` per case against the
≤ 20 µs target.

``--fake`` (any machine, no GPU): the same launches on CPU tensors with the
driver calls stubbed (TMA encode, stream lookup, ``cuLaunchKernel``) and the
launcher taking the CUDA kernel's path (:func:`fake_hopper`): the host's
Python alone; beside them the indexer op's logits call of each vLLM line
(``indexer op 0.33`` / ``0.27 (glue + launcher)``: the kernel-call
replacement a varlen step runs per layer, then the launcher, logits
allocated) and the decode top-k's launch on the case's rows (``top-k
decode_topk``: logits 163840 wide, the context as the bound).
``--base REV`` times that revision's ``ops`` package beside this one, rounds
interleaved in one process: on the GPU its launcher (``auto``, logits given),
decode top-k (``decode_topk``) and indexer op calls beside this revision's, host µs per call,
median and range of 7 rounds (:func:`run_ab`).  ``REV``: a git revision, or a
folder holding a ``vllm_dsa_varlen/ops`` tree (a host without the git history:
``git archive REV vllm_dsa_varlen | tar -x -C DIR``).

    vllm-dsa-varlen-bench --launch-host [--calls 50] [--cases B1 B64] [--topk-lib <_C .so>]
    vllm-dsa-varlen-bench --launch-host [--fake] [--base HEAD~1]
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch

from .graph import capture_graph
from .workloads import launcher_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    "B16 L32K 1tok": (16, 1, 32768),  # an MTP drafter's eager step at B16
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
    from ..ops import cuda_paged_mqa_logits as ck
    from ..ops import launcher

    rows = step.rows
    args = launcher_args(step)
    ctx = args[3]
    hint = int(step.decode_lens.max())
    out = torch.empty((rows.num_rows, step.max_context_len), device="cuda")
    paths = {}
    if ck.unsupported_reason(step.q, step.kv_cache, step.weights) is None:
        sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1])
        defines = ck.defines_for(hint)
        paths.update(driver_floor(ck, args, out, sched, defines))
        go = ck.prepare(step.q, step.kv_cache, step.weights, rows.block_table, defines)
        ptrs = [t.data_ptr() for t in (step.q, step.kv_cache, step.weights, ctx,
                                       rows.block_table, out)]
        paths["prepared launch (addresses only)"] = lambda: go(
            *ptrs, out.stride(0), sched[0].data_ptr(), sched[1].data_ptr())
        paths["cuda launch"] = lambda: ck.launch(*args, out, schedule=sched, defines=defines)
        paths["plan (once per step)"] = lambda: ck.plan(
            rows.indices, ctx, step.max_context_len, rows.block_table.shape[1])
    else:
        print(f"cuda: not timed ({ck.unsupported_reason(step.q, step.kv_cache, step.weights)})")
    kernels = ["sm90_cuda"] * ("cuda launch" in paths) + ["portable", "auto"]
    for kernel in kernels:
        cache: dict = {}

        def call(kernel=kernel, cache=cache):
            launcher.varlen_paged_mqa_logits(*args, max_run_len=hint, kernel=kernel, out=out,
                                             schedule_cache=cache)
        paths[f"launcher {kernel}" + (" (as set)" if kernel == "auto" else "")] = call
    no_out: dict = {}
    paths["launcher auto, no out"] = lambda: launcher.varlen_paged_mqa_logits(
        *args, max_run_len=hint, schedule_cache=no_out)
    paths.update(glue_paths(this_ops(), step, hint))
    return paths


TOPK_WIDTH = 163840  # the engine's logits: max_model_len columns


def topk_inputs(step, k: int = 2048):
    """An eager decode top-k call's tensors on the step's rows: ``logits``
    :data:`TOPK_WIDTH` wide (random in the step's longest row's columns,
    ``-inf`` past them), ``lens`` ``[R, 1]``, the output ``idx`` int32
    ``[R, k]``, vLLM's ``work`` space, ``longest`` (the bound an eager step
    passes) and ``k``."""
    lens = step.rows.context_lens.view(-1, 1).contiguous()
    n, longest = lens.shape[0], int(lens.max())
    logits = torch.full((n, TOPK_WIDTH), float("-inf"), device="cuda")
    logits[:, :longest] = torch.randn((n, longest), device="cuda")
    return types.SimpleNamespace(
        logits=logits, lens=lens, longest=longest, k=k,
        idx=torch.empty((n, k), dtype=torch.int32, device="cuda"),
        work=torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))


def topk_paths(t, ops) -> dict:
    """The decode top-k's eager calls on :func:`topk_inputs` ``t``, each
    writing ``t.idx``: vLLM's op through ``torch.ops._C`` as vLLM 0.27.1's
    indexer calls it in an eager step (``ops``: the extension's ops,
    ``--topk-lib``), :func:`.topk.dispatch` taking the project's kernel (the
    plugin's indexer under ``own``) and :func:`.ops.cuda_topk.decode_topk`
    alone."""
    from .. import topk
    from .builds import vllm_max_seq_len, vllm_topk_op
    from ..ops import cuda_topk

    which = vllm_topk_op(t.lens.shape[0], t.logits.stride(0), topk.COOPERATIVE_ROWS)
    op = getattr(ops, which)
    bound = vllm_max_seq_len(which, "0.27.1", t.longest, TOPK_WIDTH)

    def vllm_call():
        op(t.logits, t.lens, t.idx, t.work, t.k, bound)

    def own_call():
        topk.force(True)
        try:
            topk.dispatch(t.logits, t.lens, t.idx, t.k, vllm_call, bound=t.longest)
        finally:
            topk.force(None)
    return {f"top-k vLLM {which} (torch.ops)": vllm_call,
            "top-k dispatch, own (the plugin's call)": own_call,
            "top-k decode_topk alone": lambda: cuda_topk.decode_topk(
                t.logits, t.lens, t.k, out=t.idx, bound=t.longest)}


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
        err = lib(fn, programs, 1, 1, kern.threads, 1, 1, kern.smem, ck._stream(index),
                  kern.params_addr, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel: {err}")
    return {"cuLaunchKernel alone (cuda-python)": lambda: launch_function(
                drv, kern.fn, kern.ctx, programs, kern.threads, kern.smem, ck._stream(index),
                kern.params_addr),
            "cuLaunchKernel alone (ctypes)": by_ctypes}


def run_gpu(args) -> list[tuple]:
    from ..ops import launcher
    from .workloads import random_decode_step

    try:
        import cuda.bindings
        bindings = cuda.bindings.__version__
    except ImportError as exc:
        bindings = f"missing ({exc})"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuda-bindings {bindings}",
          flush=True)
    table = []
    calls = args.calls or CALLS
    ops = None
    if getattr(args, "topk_lib", None):
        from .builds import load_topk
        ops = load_topk(torch, args.topk_lib)
    for name in _selected(args.cases):
        reqs, tokens, context = CASES[name]
        step = random_decode_step(reqs, tokens, context, heads=64, device="cuda")
        paths = gpu_paths(step)
        if ops is not None:
            paths.update(topk_paths(topk_inputs(step), ops))
        for path, fn in paths.items():
            try:
                fn()  # compile, load, plan into the step's cache
                torch.cuda.synchronize()
                host, wall = _rounds(fn, calls)
                gpu, replay_host = _graph(fn, calls)
            except Exception as exc:  # noqa: BLE001 - report, time the other paths
                print(f"{name} | {path}: failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            table.append((name, path, host, wall, gpu, replay_host))
            print(f"{name} | {path}: host {host:.1f} wall {wall:.1f} graph {gpu:.1f} "
                  f"replay host {replay_host:.1f}", flush=True)
    print_markdown(("case", "path", "host µs/call", "wall µs/call", "graph µs/call",
                    "replay host µs"),
                   [(name, path, f"{host:.1f}", f"{wall:.1f}", f"{gpu:.1f}", f"{replay:.1f}")
                    for name, path, host, wall, gpu, replay in table])
    print_summary(table)
    if getattr(args, "base", ""):
        run_ab(args, base_ops(args.base))
    return table


def ab_paths(step, ops) -> dict:
    """The launcher's ``auto`` call (logits given, the step's schedule cache
    its own), the decode top-k's ``decode_topk`` (bounded by the step's
    longest row, as an eager step calls it) and the indexer op's logits call
    of each vLLM line (:func:`glue_paths`) of ``ops`` on ``step``."""
    args = launcher_args(step)
    hint = int(step.decode_lens.max())
    out = torch.empty((step.rows.num_rows, step.max_context_len), device="cuda")
    cache: dict = {}
    paths = {"launcher auto": lambda: ops.launcher.varlen_paged_mqa_logits(
        *args, max_run_len=hint, out=out, schedule_cache=cache)}
    if ops.ct is not None:
        t = topk_inputs(step)
        paths["top-k decode_topk"] = lambda: ops.ct.decode_topk(t.logits, t.lens, t.k, out=t.idx,
                                                                bound=t.longest)
    paths.update(glue_paths(ops, step, hint))
    return paths


def interleaved_us(fns: dict, calls: int, rounds: int = 7, sync=None) -> dict:
    """Host µs per call of each of ``fns`` (key -> zero-argument call), per
    round: every call timed once a round (``calls`` calls back to back,
    ``sync()`` before each where given), rounds interleaved.  Key -> list."""
    per = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per[key].append((time.perf_counter() - t0) / calls * 1e6)
    return per


def run_ab(args, base, rounds: int = 7) -> list[tuple]:
    """This revision's :func:`ab_paths` beside ``base``'s (:func:`base_ops`) in
    one process: every path of both timed once per round (``calls`` calls
    without a sync, host µs per call), rounds interleaved; median and range."""
    from .workloads import random_decode_step

    versions = {"now": this_ops(), args.base: base}
    calls = args.calls or CALLS
    table = []
    for name in _selected(args.cases):
        reqs, tokens, context = CASES[name]
        step = random_decode_step(reqs, tokens, context, heads=64, device="cuda")
        timed = {}
        for label, ops in versions.items():
            for path, fn in ab_paths(step, ops).items():
                fn()  # compile, load, plan into the step's cache
                timed[(path, label)] = fn
        per = interleaved_us(timed, calls, rounds, sync=torch.cuda.synchronize)
        table += [(name, path, label, statistics.median(us), min(us), max(us))
                  for (path, label), us in per.items()]
    print_markdown(("case", "path", "revision", "host µs/call", "rounds"),
                   [(n, p, lb, f"{us:.1f}", f"{lo:.1f}-{hi:.1f}") for n, p, lb, us, lo, hi in table],
                   title=f"one process, {rounds} rounds interleaved: this revision and {args.base}")
    return table


def print_markdown(header, rows, title: str | None = None) -> None:
    """A markdown table after a blank line (and ``title``, when given):
    ``header`` and ``rows`` of cells (strings, already formatted)."""
    print(f"\n{title}\n| " if title else "\n| ", end="")
    print(" | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


SUMMARY = ("cuLaunchKernel alone (cuda-python)", "prepared launch (addresses only)",
           "launcher auto (as set)", "launcher auto, no out")
TARGET_US = 20.0  # host µs per eager call through the launcher


def print_summary(table) -> None:
    """The short table: host µs per eager call of the driver call alone, the
    prepared launch, and the launcher's "auto" (logits given, and allocated
    by it), per case, with the target (:data:`TARGET_US`) met or not."""
    host = {(name, path): h for name, path, h, *_ in table}
    cases = list(dict.fromkeys(name for name, *_ in table))
    rows = []
    for name in cases:
        got = [host.get((name, p)) for p in SUMMARY]
        met = got[2] is not None and got[2] <= TARGET_US
        rows.append((name, *("–" if v is None else f"{v:.1f}" for v in got),
                     "yes" if met else "no"))
    print_markdown(("case", *SUMMARY, "target met"), rows,
                   title=f"host µs per eager call (target: launcher auto <= {TARGET_US:.0f})")


# ------------------------------------------------------------- fake launch (CPU)

class _FakeDriver:
    """cuda-python's driver module, for the launch only: records the launch."""

    def __init__(self):
        self.launches = []

    def cuLaunchKernel(self, *args):
        self.launches.append(args)
        return (0,)

    def cuLaunchKernelEx(self, config, *args):
        """Recorded as ``("ex", grid, stream, config, *args)``: the
        configuration's grid and stream as they stand at the call."""
        self.launches.append(("ex", config.gridDimX, int(config.hStream), config, *args))
        return (0,)


def fake_descriptor(base: int, dims, strides, box) -> list[int]:
    """The stubbed TMA encode's descriptor: its 16 words hold the address,
    dims, strides and box it was asked for (a pure function of them, so a test
    can build the descriptor a launch should pack)."""
    words = [base, *dims, *strides, *box]
    return words + [0] * (16 - len(words))


def _clear_caches(ops) -> None:
    """Empty what the launcher and the CUDA kernel's module cache per layout
    (the names of this revision or an earlier one)."""
    for mod, names in ((ops.launcher, ("_CHECKED", "_ROUTES")),
                       (ops.ck, ("_MAPS", "_DESCRIPTORS", "_PREPARED"))):
        for name in names:
            got = getattr(mod, name, None)
            if got is not None:
                got.clear()


@contextlib.contextmanager
def stubbed(ck):
    """``ck`` (the CUDA kernel's module, as it is now) launching on CPU tensors:
    the build's parameter block without a loaded kernel, the TMA encode, the
    stream lookup, the device query and ``cuLaunchKernel`` stubbed.  Yields the
    fake driver (its ``launches``), the list of encodes made and the build."""
    encodes = []
    fake = _FakeDriver()
    loaded = ck._Loaded(fn="varlen_logits_sm90", ctx=None, smem=ck.SMEM_BYTES)

    def encode(base, dims, strides, box):
        encodes.append((base, tuple(dims), tuple(strides), tuple(box)))
        m = ck._TmaMap()
        m.bytes[:] = fake_descriptor(base, dims, strides, box)
        return m

    names = ("load", "_driver", "_encode", "_stream", "_current_device")
    saved = {n: getattr(ck, n) for n in names if hasattr(ck, n)}
    saved_device = torch.cuda.current_device
    ck.load = lambda device, defines=(): loaded
    ck._driver = lambda: fake
    ck._encode = encode
    ck._stream = lambda index: 0x5EED
    if "_current_device" in saved:
        ck._current_device = lambda: None  # CPU tensors' device index
    torch.cuda.current_device = lambda: None
    for name in ("_MAPS", "_DESCRIPTORS", "_PREPARED"):
        if hasattr(ck, name):
            getattr(ck, name).clear()
    try:
        yield fake, encodes, loaded
    finally:
        for name, value in saved.items():
            setattr(ck, name, value)
        torch.cuda.current_device = saved_device
        for name in ("_MAPS", "_DESCRIPTORS", "_PREPARED"):
            if hasattr(ck, name):
                getattr(ck, name).clear()


@contextlib.contextmanager
def fake_hopper():
    """CPU tensors taken for an sm_90 GPU's by the launcher: ``Tensor.is_cuda``
    true, capability (9, 0), no capture under way (the real queries cost a
    little more on a GPU host: this fakes their answers, not their price)."""
    had = "is_cuda" in torch.Tensor.__dict__
    saved = (torch.Tensor.__dict__.get("is_cuda"), torch.cuda.get_device_capability,
             torch.cuda.is_current_stream_capturing)
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.is_current_stream_capturing = lambda: False
    try:
        yield
    finally:
        if had:
            torch.Tensor.is_cuda = saved[0]
        else:
            del torch.Tensor.is_cuda
        torch.cuda.get_device_capability, torch.cuda.is_current_stream_capturing = saved[1:]


@contextlib.contextmanager
def stubbed_launcher(ops, schedule):
    """The public launcher of ``ops`` (``.launcher``, ``.ck``: this revision's
    or another's) on CPU tensors through the CUDA kernel's path: the kernel's
    driver calls stubbed (:func:`stubbed`), the kernel available, ``plan``
    handing out ``schedule`` (a step's schedule is planned once per step, not
    per call), its caches emptied before and after.  Use inside
    :func:`fake_hopper`."""
    ck = ops.ck
    saved = (ck.available, ck.plan)
    _clear_caches(ops)
    with stubbed(ck) as got:
        ck.available = lambda: None
        ck.plan = lambda *a, **k: schedule
        try:
            yield got
        finally:
            ck.available, ck.plan = saved
            _clear_caches(ops)


# The indexer op's kernel-call replacements (the glue a vLLM step runs per layer),
# as ``ops`` namespace names: each calls ``vllm_dsa_varlen.ops.launcher``.
GLUE = {"g33": "vllm_dsa_varlen/vllm_0_33/model_executor/layers/sparse_attn_indexer.py",
        "g27": "vllm_dsa_varlen/vllm_0_27/model_executor/layers/sparse_attn_indexer.py"}


def this_ops():
    """This revision's ``ops`` namespace: ``.launcher``, ``.ck``, ``.ct`` and
    the indexer op's glue of each vLLM line (``.g33``, ``.g27``)."""
    from ..ops import cuda_paged_mqa_logits as ck
    from ..ops import cuda_topk as ct
    from ..ops import launcher
    from ..vllm_0_27.model_executor.layers import sparse_attn_indexer as g27
    from ..vllm_0_33.model_executor.layers import sparse_attn_indexer as g33

    return types.SimpleNamespace(launcher=launcher, ck=ck, ct=ct, g33=g33, g27=g27)


def base_ops(rev: str):
    """The ``ops`` package at git revision ``rev`` (one with ``ops/launcher.py``)
    or in the folder ``rev`` (its ``vllm_dsa_varlen/ops``), imported beside
    this one under another name: ``.launcher``, ``.ck`` and ``.ct``; with
    ``.g33`` / ``.g27`` the indexer op's glue of that revision (``None``
    where it has none), calling that revision's launcher (the glue's other
    imports are this revision's modules)."""
    tmp = tempfile.mkdtemp()
    name = "dsa_base_" + "".join(c if c.isalnum() else "_" for c in rev)
    folder = os.path.isdir(os.path.join(rev, "vllm_dsa_varlen", "ops"))  # not a revision
    if folder:
        shutil.copytree(os.path.join(rev, "vllm_dsa_varlen", "ops"),
                        os.path.join(tmp, "vllm_dsa_varlen", "ops"))
    else:
        tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "vllm_dsa_varlen/ops"],
                             capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
    os.rename(os.path.join(tmp, "vllm_dsa_varlen"), os.path.join(tmp, name))
    open(os.path.join(tmp, name, "__init__.py"), "w").close()
    written = set()
    for short, path in GLUE.items():
        if folder:
            src = (open(os.path.join(rev, path)).read()
                   if os.path.isfile(os.path.join(rev, path)) else None)
        else:
            got = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"],
                                 capture_output=True, text=True)
            src = got.stdout if got.returncode == 0 else None
        if src is not None:
            with open(os.path.join(tmp, name, f"{short}.py"), "w") as f:
                f.write(src.replace("vllm_dsa_varlen.ops", f"{name}.ops"))
            written.add(short)
    sys.path.insert(0, tmp)
    try:
        launcher = importlib.import_module(f"{name}.ops.launcher")
        ck = importlib.import_module(f"{name}.ops.cuda_paged_mqa_logits")
        try:
            ct = importlib.import_module(f"{name}.ops.cuda_topk")
        except ImportError:  # a revision before the decode top-k
            ct = None
        glue = {short: importlib.import_module(f"{name}.{short}") if short in written else None
                for short in GLUE}
    finally:
        sys.path.remove(tmp)
    return types.SimpleNamespace(launcher=launcher, ck=ck, ct=ct, **glue)


@contextlib.contextmanager
def stubbed_topk(ct):
    """``ct`` (the decode top-k's module, this revision's or another's)
    launching on CPU tensors: its build's loading, the stream, device and SM
    queries and ``cuLaunchKernel`` stubbed.  Yields the fake driver."""
    fake = _FakeDriver()
    kern = types.SimpleNamespace(fn="decode_topk", ctx=None)
    saved = {n: getattr(ct, n) for n in ("load", "_stream", "_current_device", "num_sms")}
    saved_driver = ct.cb.driver
    saved_last = getattr(ct, "_last", None)  # the last launch's facts (a real build's)
    ct._last = None
    ct.load = lambda device, defines=(): kern
    ct._stream = lambda index: 0x5EED
    ct._current_device = lambda: None  # CPU tensors' device index
    ct.num_sms = lambda index: 132     # the H200's
    ct.cb.driver = lambda: fake
    try:
        yield fake
    finally:
        for name, value in saved.items():
            setattr(ct, name, value)
        ct.cb.driver = saved_driver
        ct._last = saved_last


def fake_topk_paths(ct, rows: int, bound: int) -> dict:
    """The decode top-k's launch (``decode_topk``, bounded as in an eager
    step) on the engine's layout: ``rows`` rows of logits 163840 wide, k 2048
    (CPU tensors, under :func:`stubbed_topk`)."""
    logits = torch.empty(rows, 163840)
    lens = torch.full((rows,), bound, dtype=torch.int32)
    out = torch.empty(rows, 2048, dtype=torch.int32)
    return {"top-k decode_topk": lambda: ct.decode_topk(logits, lens, 2048, out=out,
                                                        bound=bound)}


def fake_paths(ops, step, out, hint: int) -> dict:
    """Name -> zero-argument call of each timed path of ``ops`` on ``step``
    (CPU tensors, under :func:`stubbed_launcher`; the prepared launch where
    the revision has one)."""
    rows = step.rows
    args = launcher_args(step)
    caches = [{}, {}, {}]
    call = ops.launcher.varlen_paged_mqa_logits
    paths = {}
    if hasattr(ops.ck, "prepare"):
        go = ops.ck.prepare(step.q, step.kv_cache, step.weights, rows.block_table)
        table, ctas = ops.ck.plan()
        ptrs = [t.data_ptr() for t in args[:5]] + [out.data_ptr(), out.stride(0),
                                                   table.data_ptr(), ctas.data_ptr()]
        paths["prepared launch (addresses only)"] = lambda: go(*ptrs)
    paths.update({
        "launch (schedule given)": lambda: ops.ck.launch(*args, out, schedule=ops.ck.plan()),
        "launcher sm90_cuda": lambda: call(*args, max_run_len=hint, kernel="sm90_cuda", out=out,
                                           schedule_cache=caches[0]),
        "launcher auto": lambda: call(*args, max_run_len=hint, out=out, schedule_cache=caches[1]),
        "launcher auto, no out": lambda: call(*args, max_run_len=hint, schedule_cache=caches[2]),
    })
    paths.update(glue_paths(ops, step, hint))
    return paths


def _stock_unreached(*args, **kwargs):
    raise AssertionError("a tagged varlen step reached stock's kernel call")


def glue_paths(ops, step, hint: int) -> dict:
    """The indexer op's logits call of each vLLM line as a varlen step makes it
    (the decode metadata's tagged schedule, queries ``[R, 1, H, D]``, lengths
    ``[R, 1]``, the logits allocated): the glue of ``ops`` (``.g33``,
    ``.g27``; absent ones skipped) and its launcher, one tag per path (its
    schedule cache filled by the first call, as by a step's first layer)."""
    from ..varlen_ids import attach_varlen_ids

    q, kv, w, ctx, bt, ids, longest = launcher_args(step)
    metadata = torch.zeros(132, 2, dtype=torch.int32, device=q.device)  # the schedule buffer
    paths = {}
    g33, g27 = getattr(ops, "g33", None), getattr(ops, "g27", None)
    if g33 is not None:
        call = g33.wrap_paged_mqa_logits(_stock_unreached)
        tag = attach_varlen_ids(metadata, ids, "own", hint, longest)
        paths["indexer op 0.33 (glue + launcher)"] = (
            lambda: call((q, None), kv, w, ctx, bt, tag, longest, indices=ids))
    if g27 is not None:
        tag27 = attach_varlen_ids(metadata, ids, "own", hint, longest)
        paths["indexer op 0.27 (glue + launcher)"] = (
            lambda: g27.fp8_fp4_paged_mqa_logits((q, None), kv, w, ctx, bt, tag27, longest,
                                                 False))
    return paths


def run_fake(args) -> list[tuple]:
    """Host µs per call of each fake path, this revision's and ``args.base``'s
    (same process, rounds interleaved: every path of every revision timed once
    per round), median of 7 rounds of ``calls * 20`` calls."""
    from ..ops import cuda_paged_mqa_logits as ck
    from .workloads import random_decode_step

    torch.set_num_threads(1)
    versions = {"now": this_ops()}
    if args.base:
        versions[args.base] = base_ops(args.base)
    table = []
    calls = (args.calls or CALLS) * 20
    for name in _selected(args.cases):
        reqs, tokens, context = CASES[name]
        step = random_decode_step(reqs, tokens, min(context, 2048), heads=64)
        rows = step.rows
        sched = ck.plan_torch(rows.indices, rows.context_lens.view(-1, 1), step.max_context_len,
                              rows.block_table.shape[1], programs=4)
        out = torch.empty((rows.num_rows, step.max_context_len))
        timed = {}
        with contextlib.ExitStack() as stack:
            stack.enter_context(fake_hopper())
            for label, ops in versions.items():
                stack.enter_context(stubbed_launcher(ops, sched))
                paths = fake_paths(ops, step, out, tokens)
                if ops.ct is not None:
                    stack.enter_context(stubbed_topk(ops.ct))
                    paths.update(fake_topk_paths(ops.ct, reqs * tokens, context))
                for path, fn in paths.items():
                    fn()
                    timed[(path, label)] = fn
            got = interleaved_us(timed, calls)
        for (path, label), per in got.items():
            us = statistics.median(per)
            table.append((name, path, label, us, min(per), max(per)))
            print(f"{name} | {path} | {label}: {us:.2f} µs per call "
                  f"(rounds {min(per):.2f}-{max(per):.2f})", flush=True)
    print_markdown(("case", "path (driver stubbed, CPU tensors)", "revision", "host µs/call",
                    "rounds"),
                   [(name, path, label, f"{us:.2f}", f"{lo:.2f}-{hi:.2f}")
                    for name, path, label, us, lo, hi in table])
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
