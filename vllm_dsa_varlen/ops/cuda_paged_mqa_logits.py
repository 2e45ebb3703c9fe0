"""Hopper (sm_90) varlen paged MQA logits in CUDA C++ (``cuda/sm90_varlen_logits.cu``).

Same inputs, outputs and semantics as
:func:`vllm_dsa_varlen.ops.triton_paged_mqa_logits.varlen_paged_mqa_logits`;
the launcher there takes it on sm_90 for 64 heads (``hopper_kernel_for``) and
the Gluon kernel (:mod:`.gluon_paged_mqa_logits`) where this one cannot run.

Why CUDA C++ and not Gluon (docs/kernel-notes.md, calls 31-39): the structure
that sets DeepGEMM's pace — four math warpgroups that move independently, each
with its own ring and its own arrive, running one copy of the math code — is
not expressible in Gluon (Triton 3.6-3.9): warpgroups sharing a partition move
in lockstep, warpgroups in partitions of their own are separate code copies.
In CUDA it measured 7-37 % faster than the Gluon kernel on every step (call 53).

Two builds: the default one, and for run-length hints up to 2 (one row group
per page) one whose page loads carry an L2 evict-first hint
(:func:`defines_for`; the launcher passes the hint).  Each comes with the head
sum on the CUDA cores in float32 (DeepGEMM's arithmetic, the default) or on
the tensor cores (``HEAD_SUM_TC``: relu(q . k) rounded to TF32 against the
weights as two TF32 parts; ``reference.head_sum_tf32`` is its exact
emulation, :mod:`.head_sum_precision` the study of what it costs the top-k),
chosen once per process by ``VLLM_DSA_VARLEN_HEAD_SUM`` (:func:`read_head_sum`).
Heads: 64 (what the launcher routes here) and 32 (``HEADS=32`` builds,
taken from ``q``'s shape by :func:`launch`; a row group is then four rows x
32 heads in the same 64 x 128 wgmma and a chunk eight rows; the launcher keeps
32 heads on the Gluon kernel until this build is measured: :data:`LAUNCHER_HEADS`).
The kernel is compiled once per process and build by NVRTC (``sm_90a``; the library
PyTorch's CUDA wheels install, or a CUDA toolkit's) and loaded through the
driver API (ctypes): no host compiler, no build step.  Launches are plain
``cuLaunchKernel`` calls on PyTorch's current stream, so they are captured into
CUDA graphs like any kernel; the TMA descriptors are ``__grid_constant__``
parameters (copied at launch or capture), encoded once per tensor layout.

Schedule (:func:`plan`, once per step, no host sync: on the GPU one launch
of the planner kernel, :mod:`.cuda_plan`; its definition :func:`plan_torch`,
torch operations): each run is split into chunks of up to 4 rows (two wgmma
row groups); a chunk's items are its run's pages, each costing ``c0 + c1 *
rows + c2 * row groups`` of its chunk (:data:`COST`, :func:`page_cost`); CTA
``c`` of ``n`` takes the items, in row order, whose cost ends past ``c * C //
n`` and starts before ``(c + 1) * C // n`` of the step's total ``C`` (each
output element written by one CTA: bitwise repeatable).
:func:`schedule_model` is the host mirror.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import threading

import torch

from .triton_paged_mqa_logits import _num_sms  # SMs of a device: the launcher's own

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "sm90_varlen_logits.cu")
KERNEL_NAME = b"varlen_logits_sm90"
ARCH = "sm_90a"
HEADS = 64            # the head count the launcher routes here (LAUNCHER_HEADS)
# plan() takes the one-launch planner kernel (.cuda_plan) where it can serve.
# Off until the H200 has run tests/ops/test_cuda_plan.py on this version of the
# planner (an earlier version matched plan_torch bit for bit there); the
# planner itself is callable and tested either way.
PLAN_KERNEL = False
HEAD_COUNTS = (32, 64)  # the kernel's builds: a row group is 128 // heads rows
LAUNCHER_HEADS = (64,)  # where unsupported_reason lets the launcher take it
DIM = 128
PAGE = 64
ROWS_MAX = 4          # rows per chunk at 64 heads (two row groups of two rows)
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
# HEAD_SUM_TC builds: each math warpgroup's double-buffered B fragments of its
# chunk's weights (8 lane classes x 9 float4 per row group; WT_BYTES in the source).
HEAD_SUM_TC_BYTES = MATH * 2 * GMAX * 8 * 9 * 16
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

# The head sum (``read_head_sum``): "fp32" on the CUDA cores (the default build,
# DeepGEMM's arithmetic) or "tf32" on the tensor cores (HEAD_SUM_TC=1).
HEAD_SUM_ENV = "VLLM_DSA_VARLEN_HEAD_SUM"
HEAD_SUMS = ("fp32", "tf32")

_lock = threading.Lock()


# ------------------------------------------------------------- NVRTC, driver

def _nvrtc_candidates() -> list[str]:
    names = []
    env = os.environ.get("VLLM_DSA_VARLEN_NVRTC")
    if env:
        names.append(env)
    roots = [os.path.dirname(os.path.dirname(torch.__file__))]
    for root in roots:
        for pat in ("nvidia/cu13/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*",
                    "nvidia/cu12/lib/libnvrtc.so.*"):
            names += sorted(p for p in glob.glob(os.path.join(root, pat))
                            if "builtins" not in p and ".alt." not in p)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    names += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    names += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    return names


@functools.lru_cache(maxsize=None)
def _nvrtc():
    """The NVRTC library (ctypes), or the reasons none loads."""
    errors = []
    for name in _nvrtc_candidates():
        try:
            lib = ctypes.CDLL(name)
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            return lib
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise OSError("no NVRTC library loads (set VLLM_DSA_VARLEN_NVRTC to one): "
                  + "; ".join(errors[-3:]))


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    return lib


def _ck(res: int, what: str) -> None:
    if res != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(res, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUDA driver error {res} ({name.value})")


def source(path: str = SOURCE) -> str:
    with open(path) as f:
        return f.read()


def compile_cubin(arch: str = ARCH, extra: tuple = (), path: str = SOURCE) -> tuple[bytes, str]:
    """Compile the kernel (or the CUDA source at ``path``) with NVRTC (no GPU
    needed); returns (cubin, log).  Raises ``RuntimeError`` with NVRTC's log
    on a compile error."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    src = source(path).encode()
    res = lib.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(path).encode(), 0,
                                 None, None)
    if res:
        raise RuntimeError(f"nvrtcCreateProgram: {lib.nvrtcGetErrorString(res).decode()}")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17",
                *[o.encode() for o in extra]]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        res = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if res:
            raise RuntimeError(f"NVRTC failed to compile {path} for {arch}: "
                               f"{lib.nvrtcGetErrorString(res).decode()}\n{text}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        _ck_nvrtc(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw, text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _ck_nvrtc(lib, res, what):
    if res:
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(res).decode()}")


def available() -> str | None:
    """``None`` when NVRTC and the driver load, else why not."""
    try:
        _nvrtc()
        _driver()
    except OSError as exc:
        return str(exc)
    return None


class _Loaded:
    """The kernel loaded in one device's primary context."""

    def __init__(self, device: torch.device, defines: tuple = ()):
        cubin, _ = compile_cubin(extra=tuple(f"-D{d}" for d in defines))
        self.smem = smem_bytes(defines)
        with torch.cuda.device(device):
            torch.cuda.init()
            torch.empty(1, device=device)  # the primary context is current
            self.module = ctypes.c_void_p()
            _ck(_driver().cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
            self.fn = ctypes.c_void_p()
            _ck(_driver().cuModuleGetFunction(ctypes.byref(self.fn), self.module, KERNEL_NAME),
                "cuModuleGetFunction")
            _ck(_driver().cuFuncSetAttribute(self.fn, 8, self.smem),
                "cuFuncSetAttribute(max dynamic shared memory)")


_LOADED: dict = {}


def load(device, defines: tuple = ()) -> _Loaded:
    """Compile (NVRTC) and load the kernel for ``device`` once per process.
    Done by ``precompile`` at start-up, so no decode step waits on it.
    ``defines``: ``NAME=value`` macros of the source (measured variants, e.g.
    ``MATH_REGS=112``; the default build takes none)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, tuple(defines))
    got = _LOADED.get(key)
    if got is None:
        with _lock:
            got = _LOADED.get(key)
            if got is None:
                got = _LOADED[key] = _Loaded(torch.device("cuda", index), tuple(defines))
    return got


# ----------------------------------------------------------------- TMA maps

class _TmaMap(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint64 * 16)]
    _pack_ = 8


_MAPS: dict = {}
_MAPS_LIMIT = 256


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
    _ck(_driver().cuTensorMapEncodeTiled(ctypes.c_void_p(addr), 0, rank, ctypes.c_void_p(base),
                                         d, s, b, e, 0, 3, 2, 0), "cuTensorMapEncodeTiled")
    out = _TmaMap()
    ctypes.memmove(ctypes.addressof(out), addr, 128)
    return out


def _map(kind: str, base: int, dims, strides, box) -> _TmaMap:
    key = (kind, base, tuple(dims), tuple(strides))
    got = _MAPS.get(key)
    if got is None:
        if len(_MAPS) >= _MAPS_LIMIT:
            _MAPS.clear()
        got = _MAPS[key] = _encode(base, dims, strides, box)
    return got


# ----------------------------------------------------------------- checks

def unsupported_reason(q, kv_cache, weights=None) -> str | None:
    """Why the launcher cannot route these tensors here (``None``: it can);
    :data:`LAUNCHER_HEADS` only (:func:`launch` also takes 32 heads)."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "not an sm_90 GPU"
    if q.shape[2] not in LAUNCHER_HEADS or q.shape[3] != DIM or kv_cache.shape[1] != PAGE:
        return f"shape outside H {HEADS}, D {DIM}, page {PAGE}"
    if kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        return "cache page stride or base not 16-byte aligned (TMA)"
    if q.stride(0) % 16 or q.data_ptr() % 16 or q.stride(2) != DIM or q.stride(3) != 1:
        return "queries not [R, 1, H, D] with 16-byte aligned rows and contiguous heads (TMA)"
    if weights is not None and not _weights_fit(weights, q.shape[2]):
        return "weights not contiguous [R, H] rows (one bulk copy per chunk)"
    why = available()
    if why is not None:
        return why
    return None


def _weights_fit(weights, heads: int = HEADS) -> bool:
    """A chunk's weights are one bulk copy: contiguous 16-byte aligned ``[R, H]`` rows."""
    return weights.stride(1) == 1 and weights.stride(0) == heads and weights.data_ptr() % 16 == 0


def defines_for(max_run_len: int, head_sum: str | None = None) -> tuple[str, ...]:
    """The build the launcher takes for a run-length hint (:data:`EVICT_FIRST_MAX_RUN`)
    and head sum (``"fp32"`` or ``"tf32"``; default: :func:`read_head_sum`)."""
    head_sum = read_head_sum() if head_sum is None else head_sum
    if head_sum not in HEAD_SUMS:
        raise ValueError(f"head_sum: expected one of {HEAD_SUMS}, got {head_sum!r}")
    return (("EVICT_FIRST=1",) if max_run_len <= EVICT_FIRST_MAX_RUN else ()) + (
        ("HEAD_SUM_TC=1",) if head_sum == "tf32" else ())


@functools.lru_cache(maxsize=None)
def read_head_sum() -> str:
    """``VLLM_DSA_VARLEN_HEAD_SUM`` (read once per process): ``"fp32"`` (unset or
    empty: the default; DeepGEMM's float32 arithmetic) or ``"tf32"`` (the
    tensor-core head sum).  ``ValueError`` naming the variable otherwise."""
    raw = os.environ.get(HEAD_SUM_ENV, "")
    value = raw.strip().lower() or HEAD_SUMS[0]
    if value not in HEAD_SUMS:
        raise ValueError(f"{HEAD_SUM_ENV}={raw!r} is not valid: expected one of "
                         f"{', '.join(HEAD_SUMS)} (default {HEAD_SUMS[0]})")
    return value


def smem_bytes(defines: tuple = ()) -> int:
    """Dynamic shared memory of a build (:data:`SMEM_BYTES`, more with ``HEAD_SUM_TC=1``)."""
    return SMEM_BYTES + (HEAD_SUM_TC_BYTES if "HEAD_SUM_TC=1" in defines else 0)


def rows_per_group(heads: int) -> int:
    """Rows of a row group: the wgmma's 128 columns are rows x ``heads``."""
    if heads not in HEAD_COUNTS:
        raise ValueError(f"heads: this kernel serves {' or '.join(map(str, HEAD_COUNTS))} heads, "
                         f"got {heads}")
    return 128 // heads


def rows_max_for(heads: int, max_run_len: int) -> int:
    """Rows per chunk (fixed per head count: the kernel holds two row groups)."""
    return GMAX * rows_per_group(heads)


# --------------------------------------------------------------- schedule

def plan(indices, context_lens, max_context_len: int, bt_width: int, heads: int = HEADS,
         rows_max: int | None = None, *, programs: int | None = None, cost=COST):
    """The step's schedule: ``(table int32 [R, 8], ctas int32 [programs, 4])``
    as :func:`plan_torch` defines it.  With :data:`PLAN_KERNEL` on the GPU
    (64 heads, int32 run ids, NVRTC present) one launch of the planner kernel
    (:func:`.cuda_plan.plan_device`), else :func:`plan_torch`.  No host sync,
    graph safe."""
    rows_max = _check_structure(heads, rows_max)
    if (PLAN_KERNEL and heads == HEADS and indices.is_cuda and indices.dtype == torch.int32
            and available() is None):
        from .cuda_plan import MAX_PROGRAMS, MAX_ROWS, plan_device

        if (programs is None or programs <= MAX_PROGRAMS) and indices.numel() <= MAX_ROWS:
            return plan_device(indices, context_lens, max_context_len, bt_width,
                               programs=programs, cost=cost)
    return plan_torch(indices, context_lens, max_context_len, bt_width, heads, rows_max,
                      programs=programs, cost=cost)


def _check_structure(heads: int, rows_max: int | None) -> int:
    """The chunk size for ``heads`` (``rows_max`` checked against it)."""
    want = GMAX * rows_per_group(heads)
    if rows_max is not None and rows_max != want:
        raise ValueError(f"rows_max: at {heads} heads this kernel holds {want} rows per "
                         f"chunk, got {rows_max}")
    return want


def plan_torch(indices, context_lens, max_context_len: int, bt_width: int, heads: int = HEADS,
               rows_max: int | None = None, *, programs: int | None = None, cost=COST):
    """The step's schedule from torch operations on the tensors' device (some
    forty small ones; no host sync, graph safe; the definition
    :func:`.cuda_plan.plan_device` matches bit for bit): ``(table int32 [R,
    8], ctas int32 [programs, 4])``.

    ``table`` rows, chunks with work first (in row order), then the rest:
    (first row, rows, KV length, first item, items, block-table row, 0, 0);
    ``ctas``: (first segment, item range lo, hi, 0): CTA ``c`` of ``n`` takes
    the items whose cost (:func:`page_cost` of the chunk's rows, per page)
    ends past ``c * C // n`` and starts before ``(c + 1) * C // n`` of the
    step's total ``C`` (:data:`COST`).  A run's KV length is its last
    row's context length clamped to ``[0, min(max_context_len, bt_width *
    page)]``; its block-table row is its first row.  ``rows_max``: the chunk
    size, :func:`rows_max_for` ``heads`` (the default)."""
    rows_max = _check_structure(heads, rows_max)
    group = rows_per_group(heads)
    dev = indices.device
    if programs is None:
        programs = _num_sms(dev)
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
    unit = torch.where(work, page_cost(cost, n_rows, group), 0).to(torch.int64)[order]
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


def page_cost(cost, rows, rows_per_group: int = 2):
    """A page's cost in the schedule's balance for a chunk of ``rows`` rows:
    ``c0 + c1 * rows + c2 * row groups`` (``cost`` = (c0, c1) or (c0, c1, c2);
    a row group is ``rows_per_group`` rows: 2 at 64 heads, 4 at 32).
    ``rows``: an int (the host model) or an integer tensor (:func:`plan`)."""
    c0, c1, c2 = _cost3(cost)
    return c0 + c1 * rows + c2 * ((rows + rows_per_group - 1) // rows_per_group)


def schedule_key(indices, context_lens, max_context_len: int, bt_width: int, heads: int,
                 rows_max: int, capturing: bool) -> tuple:
    """What a planned schedule depends on (see the Gluon module's ``schedule_key``)."""
    return ("cuda", indices.data_ptr(), indices.shape[0], context_lens.data_ptr(),
            max_context_len, bt_width, rows_max, heads, capturing)


def schedule_model(indices, context_lens, max_context_len: int, bt_width: int,
                   num_programs: int, cost=COST, heads: int = HEADS
                   ) -> list[list[tuple[int, int, int]]]:
    """Host mirror of :func:`plan`, for tests: each CTA's items as ``(chunk
    first row, chunk rows, page)`` in the order the CTA numbers them."""
    from .reference import run_spans

    group = rows_per_group(heads)
    chunk = GMAX * group
    items = []
    for r, e, kv in run_spans(indices, context_lens, min(max_context_len, bt_width * PAGE)):
        for c in range(r, e + 1, chunk):
            items += [(c, min(chunk, e - c + 1), p) for p in range(-(-kv // PAGE))]
    # item i takes cost [ends[i] - unit_i, ends[i]); CTA c's first item is the
    # first whose cost ends past c * C // n
    ends, acc = [], 0
    for _, n, _ in items:
        acc += page_cost(cost, n, group)
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

def launch(q, kv_cache, weights, context_lens, block_table, indices, max_context_len, out, *,
           rows_max: int | None = None, schedule=None, defines: tuple = ()):
    """Launch on checked inputs (the portable launcher checks them); ``schedule``:
    the step's :func:`plan` (made here when not given); ``defines``: a
    measured variant's macros (:func:`load`).  32 heads (``q [R, 1, 32, D]``)
    take the ``HEADS=32`` build of ``defines``."""
    rows, heads = q.shape[0], q.shape[2]
    group = rows_per_group(heads)
    if rows_max is not None and rows_max != GMAX * group:
        raise ValueError(f"rows_max: at {heads} heads this kernel holds {GMAX * group} rows per "
                         f"chunk, got {rows_max}")
    dev = q.device
    if heads != HEADS:
        defines = tuple(defines) + (f"HEADS={heads}",)
    kern = load(dev, defines)
    if schedule is None:
        schedule = plan(indices, context_lens, max_context_len, block_table.shape[1], heads)
    table, ctas = schedule
    programs = _num_sms(dev)
    if (table.dtype != torch.int32 or tuple(table.shape) != (rows, TABLE_WORDS)
            or ctas.dtype != torch.int32 or tuple(ctas.shape) != (programs, CTA_WORDS)):
        raise ValueError(f"schedule: expected (int32 [{rows}, {TABLE_WORDS}], int32 "
                         f"[{programs}, {CTA_WORDS}]) from plan(), got "
                         f"{[(t.dtype, tuple(t.shape)) for t in schedule]}")
    if not _weights_fit(weights, heads):
        raise ValueError(f"weights: expected contiguous fp32 [R, {heads}] (16-byte aligned), got "
                         f"strides {weights.stride()}")
    blocks = kv_cache.shape[0]
    kv_map = _map("kv", kv_cache.data_ptr(), [DIM, PAGE, blocks], [DIM, kv_cache.stride(0)],
                  [DIM, PAGE, 1])
    q_map = _map("q", q.data_ptr(), [DIM, heads, rows], [DIM, q.stride(0)], [DIM, heads, group])
    ctx = context_lens.reshape(-1)
    if ctx.stride(0) != 1:
        ctx = ctx.contiguous()
    vals = [kv_map, q_map, ctypes.c_uint64(kv_cache.data_ptr()), ctypes.c_int64(kv_cache.stride(0)),
            ctypes.c_uint64(weights.data_ptr()), ctypes.c_int32(weights.stride(0)),
            ctypes.c_uint64(ctx.data_ptr()), ctypes.c_uint64(block_table.data_ptr()),
            ctypes.c_int32(block_table.stride(0)), ctypes.c_uint64(out.data_ptr()),
            ctypes.c_int64(out.stride(0)), ctypes.c_uint64(table.data_ptr()),
            ctypes.c_uint64(ctas.data_ptr()), ctypes.c_int32(rows)]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                                             for v in vals])
    stream = torch.cuda.current_stream(dev).cuda_stream
    with torch.cuda.device(dev):
        _ck(_driver().cuLaunchKernel(kern.fn, programs, 1, 1, THREADS, 1, 1, kern.smem,
                                     ctypes.c_void_p(stream), params, None), "cuLaunchKernel")
    return kern
