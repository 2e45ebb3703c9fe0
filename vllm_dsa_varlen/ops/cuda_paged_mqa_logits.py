"""Hopper (sm_90) varlen paged MQA logits in CUDA C++ (``cuda/sm90_varlen_logits.cu``).

Same inputs, outputs and semantics as
:func:`vllm_dsa_varlen.ops.launcher.varlen_paged_mqa_logits`; the launcher
takes it on sm_90 for 64 heads (``hopper_kernel_for``) and the Gluon kernel
(:mod:`.gluon_paged_mqa_logits`) where this one cannot run.

Why CUDA C++ and not Gluon (docs/kernel-notes.md, calls 31-39): the structure
that sets DeepGEMM's pace — four math warpgroups that move independently, each
with its own ring and its own arrive, running one copy of the math code — is
not expressible in Gluon (Triton 3.6-3.9): warpgroups sharing a partition move
in lockstep, warpgroups in partitions of their own are separate code copies.
In CUDA it measured 7-37 % faster than the Gluon kernel on every step (call 53).

Two builds: the default one, and for run-length hints up to 2 (one row group
per page) one whose page loads carry an L2 evict-first hint
(:func:`defines_for`; the launcher passes the hint).  The kernel is compiled
once per process and build by NVRTC (``sm_90a``), loaded and launched through
the driver API, both through NVIDIA's ``cuda-python`` (``cuda.bindings``,
installed with vLLM; the TMA descriptors' encode excepted, see
:func:`_encode`): no host compiler, no build step.  Without
``cuda-python`` the kernel says so (:func:`available`) and the launcher takes
another.  Launches are plain ``cuLaunchKernel`` calls on PyTorch's current
stream, so they are captured into CUDA graphs like any kernel; the TMA
descriptors are ``__grid_constant__`` parameters (copied at launch or
capture), encoded once per tensor layout.

Host time per launch (eager calls pay it on every layer): the kernel's
parameters live in one block per loaded build, rewritten in place (the TMA
descriptors come from a cache by layout) and handed to ``cuLaunchKernel`` by
address, so a launch builds no argument objects (:func:`launch`).

Schedule (:func:`plan`, torch operations on the GPU, no host sync, once per
step): each run is split into chunks of up to 4 rows (two wgmma row groups);
a chunk's items are its run's pages, each costing ``c0 + c1 * rows + c2 *
row groups`` of its chunk (:data:`COST`, :func:`page_cost`); CTA ``c`` of
``n`` takes the items, in row order, whose cost ends past ``c * C // n`` and
starts before ``(c + 1) * C // n`` of the step's total ``C`` (each output
element written by one CTA: bitwise repeatable).  :func:`schedule_model` is
the host mirror.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import threading

import torch

from .common import DIM, PAGE, capability, log_once, num_sms

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "sm90_varlen_logits.cu")
KERNEL_NAME = b"varlen_logits_sm90"
ARCH = "sm_90a"
HEADS = 64
ROWS_MAX = 4          # rows per chunk (two row groups of two rows)
GMAX = 2
STAGES = 3
MATH = 4
THREADS = 128 * (MATH + 1)
TABLE_WORDS = 8       # int32 per segment row of the plan
CTA_WORDS = 4         # int32 per CTA: first segment, item range [lo, hi)
# Dynamic shared memory (every build): 1 KB of alignment slack, the page rings,
# the double-buffered queries, the rings' scales, the weights, the mbarriers.
SMEM_BYTES = (1024 + MATH * STAGES * PAGE * DIM + 2 * GMAX * 2 * HEADS * DIM
              + MATH * STAGES * PAGE * 4 + 2 * 2 * GMAX * HEADS * 4 + (2 * MATH * STAGES + 4) * 8)
# A page's cost for the schedule's balance, c0 + c1 * rows + c2 * row groups of
# its chunk (page_cost): the CTAs' shares are equal in cost, not in pages, so a
# CTA that draws long runs does not finish last.  Each row group runs one full
# wgmma (a chunk's odd last row too), the epilogue follows the rows; from the
# H200 (call 48, cycles per page): ~610 with two rows, ~960 with three, ~1040
# with four.
COST = (3, 1, 4)

# The build by run-length hint (``defines_for``): a step's pages are read once,
# so with one row group per page (hints <= 2) the page loads carry an L2
# evict-first hint, which keeps the step's other data (queries, weights, block
# tables, logits) in L2: 2-token steps 1-8 % faster (call 50); with two groups
# per page large steps were 1-5 % slower (calls 41-42), so longer hints keep
# the default build.
EVICT_FIRST_MAX_RUN = 2

_lock = threading.Lock()


# ------------------------------------------------------ NVRTC, driver (cuda-python)

NVRTC_ENV = "VLLM_DSA_VARLEN_NVRTC"  # path of another NVRTC library to compile with


def _import(name: str):
    """``cuda.bindings.<name>`` or ``OSError`` saying what is missing."""
    try:
        return importlib.import_module(f"cuda.bindings.{name}")
    except ImportError as exc:
        raise OSError(f"cuda-python is not installed or too old (cuda.bindings.{name}: {exc}); "
                      "the sm_90 CUDA kernel compiles and launches through it "
                      "(pip install cuda-python)") from exc


@functools.lru_cache(maxsize=None)
def _nvrtc():
    """cuda-python's NVRTC module with a library loaded, or ``OSError`` why not.

    ``VLLM_DSA_VARLEN_NVRTC`` names another NVRTC library: it is loaded first,
    and cuda-python takes an NVRTC the process has loaded (by its soname,
    ``libnvrtc.so.13`` or ``.12``) before searching for one."""
    nvrtc = _import("nvrtc")
    path = os.environ.get(NVRTC_ENV)
    if path:
        try:
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
        except OSError as exc:
            raise OSError(f"{NVRTC_ENV}={path}: {exc}") from exc
    try:
        err, _, _ = nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - cuda-python found no NVRTC library
        raise OSError(f"no NVRTC library loads through cuda-python ({exc}); set {NVRTC_ENV} "
                      "to one") from exc
    if err:
        raise OSError(f"nvrtcVersion: {err!r}")
    return nvrtc


@functools.lru_cache(maxsize=None)
def _driver():
    """cuda-python's driver module with the driver loaded, or ``OSError`` why not."""
    driver = _import("driver")
    try:
        err, _ = driver.cuDriverGetVersion()
    except Exception as exc:  # noqa: BLE001 - no libcuda: no GPU driver here
        raise OSError(f"the CUDA driver does not load through cuda-python ({exc})") from exc
    if err:
        raise OSError(f"cuDriverGetVersion: {err!r}")
    return driver


def _ok(result, what: str):
    """The values of a cuda-python call (``(error, *values)``), or ``RuntimeError``."""
    err = result[0]
    if err:
        name = err
        try:
            got = _driver().cuGetErrorName(err)
            name = got[1].decode() if not got[0] else err
        except Exception:  # noqa: BLE001 - an NVRTC result, or no name
            pass
        raise RuntimeError(f"{what}: CUDA error {int(err)} ({name})")
    return result[1] if len(result) == 2 else result[1:]


def source() -> str:
    with open(SOURCE) as f:
        return f.read()


def compile_cubin(arch: str = ARCH, extra: tuple = ()) -> tuple[bytes, str]:
    """Compile the kernel with NVRTC (no GPU needed); returns (cubin, log).
    Raises ``RuntimeError`` with NVRTC's log on a compile error."""
    nvrtc = _nvrtc()
    prog = _ok(nvrtc.nvrtcCreateProgram(source().encode(), b"sm90_varlen_logits.cu", 0, [], []),
               "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", *[o.encode() for o in extra]]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = bytearray(size)
        _ok(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        text = bytes(log).split(b"\0", 1)[0].decode(errors="replace")
        if res:
            why = nvrtc.nvrtcGetErrorString(res)[1].decode()
            raise RuntimeError(f"NVRTC failed to compile {SOURCE} for {arch}: {why}\n{text}")
        cubin = bytearray(_ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize"))
        _ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin), text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@functools.lru_cache(maxsize=None)
def available() -> str | None:
    """``None`` when NVRTC and the driver load through cuda-python, else why not
    (logged once)."""
    try:
        _nvrtc()
        _driver()
    except OSError as exc:
        log_once(f"vllm-dsa-varlen: the sm_90 CUDA kernel is unavailable: {exc}")
        return str(exc)
    return None


# ----------------------------------------------------------- parameter block

class _TmaMap(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint64 * 16)]
    _pack_ = 8


# The kernel's parameters in order (``varlen_logits_sm90`` in the source; a
# test reads the signature there and compares).  cuLaunchKernel copies each
# from the address it is given, by the kernel's own sizes and offsets.
PARAMS = (("kv_map", _TmaMap), ("q_map", _TmaMap),
          ("kv", ctypes.c_uint64), ("stride_block", ctypes.c_int64),
          ("w", ctypes.c_uint64), ("stride_w", ctypes.c_int32),
          ("ctx", ctypes.c_uint64), ("bt", ctypes.c_uint64), ("stride_bt", ctypes.c_int32),
          ("out", ctypes.c_uint64), ("stride_out", ctypes.c_int64),
          ("table", ctypes.c_uint64), ("ctas", ctypes.c_uint64), ("num_segs", ctypes.c_int32))


class _Params(ctypes.Structure):
    _fields_ = list(PARAMS)


class _Loaded:
    """One build of the kernel loaded in a device's primary context (``fn``,
    ``ctx``: driver handles), with the parameter block its launches rewrite:
    ``params`` and the array of its fields' addresses (``params_addr``) that
    ``cuLaunchKernel`` reads.  ``lock``: one launch at a time fills it."""

    def __init__(self, fn, ctx):
        self.fn, self.ctx = fn, ctx
        self.params = _Params()
        base = ctypes.addressof(self.params)
        self._ptrs = (ctypes.c_void_p * len(PARAMS))(
            *[base + getattr(_Params, name).offset for name, _ in PARAMS])
        self.params_addr = ctypes.addressof(self._ptrs)
        self.kv_map = self.q_map = None  # the descriptors the block holds now
        self.lock = threading.Lock()


def _load(device: torch.device, defines: tuple) -> _Loaded:
    """Compile (NVRTC) the build with ``defines`` and load it on ``device``."""
    cubin, _ = compile_cubin(extra=tuple(f"-D{d}" for d in defines))
    drv = _driver()
    with torch.cuda.device(device):
        torch.cuda.init()
        torch.empty(1, device=device)  # the primary context is current
        ctx = _ok(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        image = ctypes.create_string_buffer(cubin, len(cubin))
        module = _ok(drv.cuModuleLoadData(ctypes.addressof(image)), "cuModuleLoadData")
        fn = _ok(drv.cuModuleGetFunction(module, KERNEL_NAME), "cuModuleGetFunction")
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _ok(drv.cuFuncSetAttribute(fn, attr, SMEM_BYTES),
            "cuFuncSetAttribute(max dynamic shared memory)")
    loaded = _Loaded(fn, ctx)
    loaded.module = module
    return loaded


_LOADED: dict = {}
_BY_DEVICE: dict = {}  # (torch.device, defines) -> _Loaded: the launch's lookup


def load(device, defines: tuple = ()) -> _Loaded:
    """Compile (NVRTC) and load the kernel for ``device`` once per process.
    Done by ``precompile`` at start-up, so no decode step waits on it.
    ``defines``: ``NAME=value`` macros of the source (measured variants, e.g.
    ``MATH_REGS=112``; the default build takes none)."""
    fast = isinstance(device, torch.device) and isinstance(defines, tuple)
    got = _BY_DEVICE.get((device, defines)) if fast else None
    if got is not None:
        return got
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, tuple(defines))
    got = _LOADED.get(key)
    if got is None:
        with _lock:
            got = _LOADED.get(key)
            if got is None:
                got = _LOADED[key] = _load(torch.device("cuda", index), tuple(defines))
    if fast and device.index is not None:
        _BY_DEVICE[(device, defines)] = got
    return got


# ----------------------------------------------------------------- TMA maps
#
# cuTensorMapEncodeTiled is called through ctypes on the driver library, into
# a 64-byte aligned buffer: cuda-python's CUtensorMap keeps its 128 bytes
# inside a Python object, which is not 64-byte aligned (as the driver's type
# declares), and copies of it have crashed (cuda-python pull request 1692).

@functools.lru_cache(maxsize=None)
def _encode_fn():
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    return fn


def _encode(base: int, dims, strides, box) -> _TmaMap:
    """A 128-byte-swizzled uint8 TMA descriptor (driver ``cuTensorMapEncodeTiled``)."""
    raw = (ctypes.c_uint8 * (128 + 64))()
    addr = (ctypes.addressof(raw) + 63) & ~63
    rank = len(dims)
    d = (ctypes.c_uint64 * rank)(*dims)
    s = (ctypes.c_uint64 * (rank - 1))(*strides)
    b = (ctypes.c_uint32 * rank)(*box)
    e = (ctypes.c_uint32 * rank)(*([1] * rank))
    # uint8, no interleave, 128-byte swizzle, 128-byte L2 promotion, zero fill
    res = _encode_fn()(ctypes.c_void_p(addr), 0, rank, ctypes.c_void_p(base), d, s, b, e,
                       0, 3, 2, 0)
    if res:
        raise RuntimeError(f"cuTensorMapEncodeTiled: CUDA error {res} (dims {list(dims)}, "
                           f"strides {list(strides)}, box {list(box)})")
    out = _TmaMap()
    ctypes.memmove(ctypes.addressof(out), addr, 128)
    return out


_MAPS: dict = {}
_MAPS_LIMIT = 256


def _kv_map(kv_cache) -> _TmaMap:
    """The cache's descriptor: ``[blocks][page][D]`` bytes, one page per box."""
    base, blocks, stride = kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.stride(0)
    key = ("kv", base, blocks, stride)
    got = _MAPS.get(key)
    if got is None:
        got = _remember(key, _encode(base, [DIM, PAGE, blocks], [DIM, stride], [DIM, PAGE, 1]))
    return got


def _q_map(q) -> _TmaMap:
    """The queries' descriptor: ``[rows][H][D]`` bytes, two rows per box."""
    base, rows, stride = q.data_ptr(), q.shape[0], q.stride(0)
    key = ("q", base, rows, stride)
    got = _MAPS.get(key)
    if got is None:
        got = _remember(key, _encode(base, [DIM, HEADS, rows], [DIM, stride], [DIM, HEADS, 2]))
    return got


def _remember(key, value):
    if len(_MAPS) >= _MAPS_LIMIT:
        _MAPS.clear()
    _MAPS[key] = value
    return value


# ----------------------------------------------------------------- checks

def unsupported_reason(q, kv_cache, weights=None) -> str | None:
    """Why this kernel cannot take these tensors (``None``: it can)."""
    if not q.is_cuda or capability(q.device) != (9, 0):
        return "not an sm_90 GPU"
    if q.shape[2] != HEADS or q.shape[3] != DIM or kv_cache.shape[1] != PAGE:
        return f"shape outside H {HEADS}, D {DIM}, page {PAGE}"
    if kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        return "cache page stride or base not 16-byte aligned (TMA)"
    if q.stride(0) % 16 or q.data_ptr() % 16 or q.stride(2) != DIM or q.stride(3) != 1:
        return "queries not [R, 1, H, D] with 16-byte aligned rows and contiguous heads (TMA)"
    if weights is not None and not _weights_fit(weights):
        return "weights not contiguous [R, H] rows (one bulk copy per chunk)"
    why = available()
    if why is not None:
        return why
    return None


def _weights_fit(weights) -> bool:
    """A chunk's weights are one bulk copy: contiguous 16-byte aligned ``[R, H]`` rows."""
    return weights.stride(1) == 1 and weights.stride(0) == HEADS and weights.data_ptr() % 16 == 0


def defines_for(max_run_len: int) -> tuple[str, ...]:
    """The build the launcher takes for a run-length hint (:data:`EVICT_FIRST_MAX_RUN`)."""
    return ("EVICT_FIRST=1",) if max_run_len <= EVICT_FIRST_MAX_RUN else ()


def rows_max_for(heads: int, max_run_len: int) -> int:
    """Rows per chunk (fixed: the kernel holds two row groups of two rows)."""
    return ROWS_MAX


# --------------------------------------------------------------- schedule

def plan(indices, context_lens, max_context_len: int, bt_width: int, heads: int = HEADS,
         rows_max: int = ROWS_MAX, *, programs: int | None = None, cost=COST):
    """The step's schedule (torch operations on the device; no host sync, graph
    safe): ``(table int32 [R, 8], ctas int32 [programs, 4])``.

    ``table`` rows, chunks with work first (in row order), then the rest:
    (first row, rows, KV length, first item, items, block-table row, 0, 0);
    ``ctas``: (first segment, item range lo, hi, 0): CTA ``c`` of ``n`` takes
    the items whose cost (:func:`page_cost` of the chunk's rows, per page)
    ends past ``c * C // n`` and starts before ``(c + 1) * C // n`` of the
    step's total ``C`` (:data:`COST`).  A run's KV length is its last
    row's context length clamped to ``[0, min(max_context_len, bt_width *
    page)]``; its block-table row is its first row."""
    if rows_max != ROWS_MAX:
        raise ValueError(f"rows_max: this kernel holds {ROWS_MAX} rows per chunk, got {rows_max}")
    if heads != HEADS:
        raise ValueError(f"heads: this kernel serves {HEADS} heads, got {heads}")
    dev = indices.device
    if programs is None:
        programs = num_sms(dev)
    ids = indices.view(-1)
    ctx = context_lens.reshape(-1).to(torch.int32)
    rows = ids.shape[0]
    r = torch.arange(rows, device=dev, dtype=torch.int32)
    change = ids[1:] != ids[:-1]
    one = torch.ones(1, dtype=torch.bool, device=dev)
    starts = torch.cat([one, change])
    ends = torch.cat([change, one])
    first = torch.cummax(torch.where(starts, r, 0), 0).values
    last = torch.flip(torch.cummin(torch.flip(torch.where(ends, r, rows), (0,)), 0).values, (0,))
    cap = min(int(max_context_len), int(bt_width) * PAGE)
    kv = ctx[last.long()].clamp(0, cap)
    pages = (kv + PAGE - 1) // PAGE
    chunk = ((r - first) % rows_max) == 0
    n_rows = torch.minimum(last - r + 1, torch.full_like(r, rows_max))
    work = chunk & (pages > 0)
    items = torch.where(work, pages, 0)
    ends_at = torch.cumsum(items, 0, dtype=torch.int64)
    total = ends_at[-1:]
    off = (ends_at - items).to(torch.int32)
    order = torch.argsort(torch.where(work, r, r + rows), stable=True)
    zero = torch.zeros_like(r)
    table = torch.stack([r, n_rows, kv, off, items, first, zero, zero], 1)[order]
    # rows without work: first item past every range, no items (walks stop there)
    table[:, 3] = torch.where(work[order], table[:, 3], total.to(torch.int32).expand(rows))
    off_end = table[:, 3].to(torch.int64) + table[:, 4]
    # CTA boundaries: equal shares of the step's cost, each at an item boundary
    unit = torch.where(work, page_cost(cost, n_rows), 0).to(torch.int64)[order]
    seg_cost = unit * table[:, 4]
    cost_end = torch.cumsum(seg_cost, 0)
    cost_off = cost_end - seg_cost
    c = torch.arange(programs + 1, device=dev, dtype=torch.int64)
    x = c * cost_end[-1:] // programs
    s = torch.searchsorted(cost_end, x, right=True).clamp_max(rows - 1)
    inside = (x - cost_off[s]) // unit[s].clamp_min(1)  # the first item whose cost ends past x
    bound = torch.where(x >= cost_end[-1:], total,
                        table[s, 3].to(torch.int64) + torch.minimum(inside, table[s, 4]))
    lo, hi = bound[:-1], bound[1:]
    seg0 = torch.searchsorted(off_end, lo, right=True)
    ctas = torch.stack([seg0, lo, hi, torch.zeros_like(lo)], 1).to(torch.int32)
    return table.contiguous(), ctas.contiguous()


def _cost3(cost) -> tuple[int, int, int]:
    if len(cost) not in (2, 3) or any(int(c) != c or c < 0 for c in cost) or not any(cost):
        raise ValueError(f"cost: expected (c0, c1) or (c0, c1, c2), non-negative integers "
                         f"not all zero, got {cost}")
    return (int(cost[0]), int(cost[1]), int(cost[2]) if len(cost) == 3 else 0)


def page_cost(cost, rows):
    """A page's cost in the schedule's balance for a chunk of ``rows`` rows:
    ``c0 + c1 * rows + c2 * row groups`` (``cost`` = (c0, c1) or (c0, c1, c2)).
    ``rows``: an int (the host model) or an integer tensor (:func:`plan`)."""
    c0, c1, c2 = _cost3(cost)
    return c0 + c1 * rows + c2 * ((rows + 1) // 2)


def schedule_key(indices, context_lens, max_context_len: int, bt_width: int, heads: int,
                 rows_max: int, capturing: bool) -> tuple:
    """What a planned schedule depends on (see the Gluon module's ``schedule_key``)."""
    return ("cuda", indices.data_ptr(), indices.shape[0], context_lens.data_ptr(),
            max_context_len, bt_width, rows_max, heads, capturing)


def schedule_model(indices, context_lens, max_context_len: int, bt_width: int,
                   num_programs: int, cost=COST) -> list[list[tuple[int, int, int]]]:
    """Host mirror of :func:`plan`, for tests: each CTA's items as ``(chunk
    first row, chunk rows, page)`` in the order the CTA numbers them."""
    from .reference import run_spans

    items = []
    for r, e, kv in run_spans(indices, context_lens, min(max_context_len, bt_width * PAGE)):
        for c in range(r, e + 1, ROWS_MAX):
            items += [(c, min(ROWS_MAX, e - c + 1), p) for p in range(-(-kv // PAGE))]
    # item i takes cost [ends[i] - unit_i, ends[i]); CTA c's first item is the
    # first whose cost ends past c * C // n
    ends, acc = [], 0
    for _, n, _ in items:
        acc += page_cost(cost, n)
        ends.append(acc)
    bounds = []
    for c in range(num_programs + 1):
        x = c * acc // num_programs
        bounds.append(next((i for i, e in enumerate(ends) if e > x), len(items)))
    return [items[bounds[c]:bounds[c + 1]] for c in range(num_programs)]


def plan_items(table, ctas) -> list[list[tuple[int, int, int]]]:
    """Each CTA's items as the kernel walks a plan (host, for tests)."""
    table = table.cpu().tolist()
    out = []
    for seg0, lo, hi, _ in ctas.cpu().tolist():
        got = []
        for k in range(seg0, len(table)):
            first, n, _, off, items, _, _, _ = table[k]
            if off >= hi:
                break
            got += [(first, n, p) for p in range(max(lo - off, 0), min(hi - off, items))]
        out.append(got)
    return out


# ------------------------------------------------------------------- launch

# The current stream's raw handle without building a torch.cuda.Stream (the
# private getter Triton's launcher uses too; the public route where it is gone).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(index: int) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def launch(q, kv_cache, weights, context_lens, block_table, indices, max_context_len, out, *,
           rows_max: int = ROWS_MAX, schedule=None, defines: tuple = ()):
    """Launch on checked inputs (:mod:`.launcher` checks them); ``schedule``:
    the step's :func:`plan` (made here when not given); ``defines``: a
    measured variant's macros (:func:`load`).

    Host work per call: the build's parameter block is rewritten in place
    (the TMA descriptors from their cache by layout) and passed to
    ``cuLaunchKernel`` by address; nothing else is built."""
    rows = q.shape[0]
    dev = q.device
    kern = load(dev, defines)
    if schedule is None:
        schedule = plan(indices, context_lens, max_context_len, block_table.shape[1])
    table, ctas = schedule
    programs = num_sms(dev)
    if (table.dtype != torch.int32 or tuple(table.shape) != (rows, TABLE_WORDS)
            or ctas.dtype != torch.int32 or tuple(ctas.shape) != (programs, CTA_WORDS)):
        raise ValueError(f"schedule: expected (int32 [{rows}, {TABLE_WORDS}], int32 "
                         f"[{programs}, {CTA_WORDS}]) from plan(), got "
                         f"{[(t.dtype, tuple(t.shape)) for t in schedule]}")
    if not _weights_fit(weights):
        raise ValueError(f"weights: expected contiguous fp32 [R, {HEADS}] (16-byte aligned), got "
                         f"strides {weights.stride()}")
    kv_map = _kv_map(kv_cache)
    q_map = _q_map(q)
    ctx = context_lens
    if not ctx.is_contiguous():  # [R, 1] or [R]: contiguous means one int per row
        ctx = ctx.reshape(-1).contiguous()
    index = dev.index
    with kern.lock:
        p = kern.params
        if kern.kv_map is not kv_map:
            p.kv_map = kv_map
            kern.kv_map = kv_map
        if kern.q_map is not q_map:
            p.q_map = q_map
            kern.q_map = q_map
        p.kv = kv_cache.data_ptr()
        p.stride_block = kv_cache.stride(0)
        p.w = weights.data_ptr()
        p.stride_w = weights.stride(0)
        p.ctx = ctx.data_ptr()
        p.bt = block_table.data_ptr()
        p.stride_bt = block_table.stride(0)
        p.out = out.data_ptr()
        p.stride_out = out.stride(0)
        p.table = table.data_ptr()
        p.ctas = ctas.data_ptr()
        p.num_segs = rows
        if torch.cuda.current_device() == index:
            _launch(kern, programs, _stream(index))
        else:
            with torch.cuda.device(index):
                _launch(kern, programs, _stream(index))
    return kern


def _launch(kern: _Loaded, programs: int, stream: int) -> None:
    """``cuLaunchKernel`` of ``kern`` with its parameter block as it stands; a
    thread whose current driver context is not the device's primary one (no
    CUDA call made on it yet) gets it and retries."""
    drv = _driver()
    args = (kern.fn, programs, 1, 1, THREADS, 1, 1, SMEM_BYTES, stream, kern.params_addr, 0)
    (err,) = drv.cuLaunchKernel(*args)
    if err == _INVALID_CONTEXT:
        _ok(drv.cuCtxSetCurrent(kern.ctx), "cuCtxSetCurrent")
        (err,) = drv.cuLaunchKernel(*args)
    if err:
        _ok((err,), "cuLaunchKernel")


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT
