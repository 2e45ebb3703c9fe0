"""Hopper (sm_90) varlen paged MQA logits in CUDA C++ (``cuda/sm90_varlen_logits.cu``).

Same inputs, outputs and semantics as
:func:`vllm_dsa_varlen.ops.launcher.varlen_paged_mqa_logits`; the launcher
takes it on sm_90 for 32 and 64 heads (``hopper_kernel_for``) and the
portable kernel where this one cannot run.  CUDA C++ rather than Gluon: four
math warpgroups that move independently, each with its own ring, running one
copy of the math code, cannot be written in Gluon (docs/design.md).

Builds (:func:`defines_for`, :func:`shipped_builds`): four math warpgroups
(the default) or, with ``DSA_VARLEN_PIPELINE=1`` at 64 heads and the
float32 head sum, the pipelined one (:data:`PIPELINE`); page loads with an
L2 evict-first hint where a request's rows fit one row group; the head sum
on the CUDA cores in float32 (DeepGEMM's arithmetic, the default) or on the
tensor cores (``HEAD_SUM_TC``, ``DSA_VARLEN_HEAD_SUM=tf32``;
``reference.head_sum_tf32`` is its exact emulation); launched plainly or as
a programmatic dependent (:data:`PDL`); 64 or 32 heads (``HEADS=32``, from
``q``'s shape).  Each is compiled once per process by NVRTC (``sm_90a``) and
launched through the driver API, both through ``cuda-python``: no host
compiler, no build step; without ``cuda-python`` :func:`available` says why
and the launcher takes another kernel.  Launches go on PyTorch's current
stream, so CUDA graphs capture them; the TMA descriptors are
``__grid_constant__`` parameters, encoded once per tensor layout.

A launch is prepared once per layout of its arguments (:func:`prepare`: the
build, the grid, the strides, the descriptor dicts) and then called with the
tensors' data addresses alone (:class:`Prepared`), so an eager call does
little host work.

Schedule (:func:`plan`, once per step, no host sync: one launch of the
planner kernel, :mod:`.cuda_plan`, or its definition :func:`plan_torch`):
each run is split into chunks of two row groups (4 rows at 64 heads, 8 at
32); a chunk's items are its run's pages, each costing :func:`page_cost`;
CTA ``c`` of ``n`` takes the items, in row order, whose cost ends past ``c *
C // n`` and starts before ``(c + 1) * C // n`` of the step's total ``C``
(each output element written by one CTA: bitwise repeatable).
:func:`schedule_model` is the host mirror.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct
import threading

import torch

# Absolute: the benchmark imports another revision's ops/ under another name.
from vllm_dsa_varlen import settings
from vllm_dsa_varlen.settings import HEAD_SUM_ENV, PDL_ENV, PIPELINE_ENV  # read here

from .common import DIM, PAGE, capability, log_once, num_sms
from .cuda_binding import NVRTC_ENV  # noqa: F401  (the setting this kernel honours)
from .cuda_binding import (ARCH, INVALID_CONTEXT, compile_source, current_device, current_stream,
                           dependent_launch, launch_function, load_function, load_once, ok)
from .cuda_binding import driver as _driver
from .cuda_binding import nvrtc as _nvrtc
from .cuda_plan import COST, CTA_WORDS, TABLE_WORDS, page_cost, plan_device
from . import cuda_plan

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "sm90_varlen_logits.cu")
KERNEL_NAME = b"varlen_logits_sm90"
HEADS = 64            # the head count the launcher routes here (LAUNCHER_HEADS)
HEAD_COUNTS = (32, 64)  # the kernel's builds: a row group is 128 // heads rows
LAUNCHER_HEADS = (32, 64)  # where unsupported_reason lets the launcher take it
ROWS_MAX = 4          # rows per chunk at 64 heads (two row groups of two rows)
GMAX = 2
STAGES = 3            # pages in flight per ring (STAGES in the source)
MATH = 4
THREADS = 128 * (MATH + 1)


def _smem(math: int = MATH) -> int:
    """Dynamic shared memory with ``math`` math warpgroups (a ring each): 1 KB
    of alignment slack, the page rings, the double-buffered queries, the
    rings' scales, the weights, the mbarriers."""
    return (1024 + math * STAGES * PAGE * DIM + 2 * GMAX * 2 * HEADS * DIM
            + math * STAGES * PAGE * 4 + 2 * 2 * GMAX * HEADS * 4 + (2 * math * STAGES + 4) * 8)


SMEM_BYTES = _smem()  # four math warpgroups (the pipelined build: a ring fewer)
# HEAD_SUM_TC builds: each math warpgroup's double-buffered B fragments of its
# chunk's weights (8 lane classes x 9 float4 per row group; WT_BYTES in the source).
HEAD_SUM_TC_BYTES = MATH * 2 * GMAX * 8 * 9 * 16

# A step's pages are read once, so where a request's rows fit one row group
# (hints <= rows_per_group) the page loads carry an L2 evict-first hint, which
# keeps the step's other data in L2; with two groups per page it measured
# slower, so longer hints keep the default build (docs/design.md).
#
# The pipelined build (DSA_VARLEN_PIPELINE=1, :func:`read_pipeline`; 64
# heads, float32 head sum): three math warpgroups with two accumulators each,
# a row group's QK chain under the previous one's head sum, the same bits as
# the four-warpgroup build.  An opt-in: with the L2 left clean, as a decode
# step leaves it, it was not faster than the default (BENCHMARKS.md).
# Launches of fewer than PIPELINE_MIN_ROWS rows keep four warpgroups (a
# launch's row count is known on the host, in a capture too).
PIPELINE = ("NUM_MATH=3", "DUAL_ACC=4")
PIPELINE_MIN_ROWS = 64

# Programmatic dependent launch (DSA_VARLEN_PDL=1, :func:`read_pdl`): the
# kernel launched as vLLM 0.33 launches DeepGEMM's on Hopper, its CTAs set up
# under the previous kernel's tail; off by default, as it measured level with
# the plain launch (BENCHMARKS.md).
PDL = ("PDL=1",)

# The head sum (``read_head_sum``): "fp32" on the CUDA cores (the default build,
# DeepGEMM's arithmetic) or "tf32" on the tensor cores (HEAD_SUM_TC=1).
HEAD_SUMS = settings.HEAD_SUMS

_lock = threading.Lock()


def source(path: str = SOURCE) -> str:
    with open(path) as f:
        return f.read()


def compile_cubin(arch: str = ARCH, extra: tuple = (), path: str = SOURCE) -> tuple[bytes, str]:
    """Compile the kernel (or the CUDA source at ``path``) with NVRTC (no GPU
    needed); returns (cubin, log).  Raises ``RuntimeError`` with NVRTC's log
    on a compile error."""
    return compile_source(path, arch, extra)


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


_CODES = {ctypes.c_uint64: "Q", ctypes.c_int64: "q", ctypes.c_int32: "i"}


def _pack_format() -> struct.Struct:
    """The whole parameter block as one ``struct`` format, read off
    :class:`_Params`' own field offsets and sizes (so it cannot drift from
    them): each descriptor as its 128 raw bytes, each scalar in native byte
    order, the C padding between fields as pad bytes.  One ``pack_into`` then
    rewrites the block, at about half the host time of a write per field."""
    fmt, pos = "=", 0  # native byte order, standard sizes, no implicit alignment
    for name, kind in PARAMS:
        offset, size = getattr(_Params, name).offset, ctypes.sizeof(kind)
        if offset > pos:
            fmt += f"{offset - pos}x"
        fmt += _CODES.get(kind, f"{size}s")
        pos = offset + size
    return struct.Struct(fmt)


_PACK = _pack_format()


class _Loaded:
    """One build of the kernel loaded in a device's primary context (``fn``,
    ``ctx``: driver handles), with the parameter block its launches rewrite:
    ``params`` (packed whole by each launch, :data:`_PACK`) and the array of
    its fields' addresses (``params_addr``) that ``cuLaunchKernel`` reads;
    ``smem``: its dynamic shared memory; ``threads``: its CTA size;
    ``config``: the ``cuLaunchKernelEx`` configuration of a build launched as
    a programmatic dependent (:data:`PDL`), else ``None``.  ``lock``: one
    launch at a time fills the block (and sets ``config``'s stream)."""

    def __init__(self, fn, ctx, smem: int, threads: int = THREADS, config=None):
        self.fn, self.ctx, self.smem, self.threads = fn, ctx, smem, threads
        self.config = config
        self.params = _Params()
        base = ctypes.addressof(self.params)
        self._ptrs = (ctypes.c_void_p * len(PARAMS))(
            *[base + getattr(_Params, name).offset for name, _ in PARAMS])
        self.params_addr = ctypes.addressof(self._ptrs)
        self.lock = threading.Lock()


def build_cubin(defines: tuple) -> tuple[bytes, tuple]:
    """The cubin of the build with ``defines``, and the defines it was made
    with.  Where this NVRTC's ptxas reports a build's wgmmas serialised (NVRTC
    13.0 and 13.5 do not: the compile tests), another build with the same bits
    is made instead and that is logged once: the pipelined build
    (:data:`PIPELINE`) gives way to the four-warpgroup one; the 64-head
    default's HALF_MMA copies, which sit near the wgmma pipeline's register
    limit, to ``HALF_MMA=0`` (a chunk's half group paying its full wgmma).  A
    build that names HALF_MMA itself is kept as asked (logged when
    serialised)."""
    cubin, log = compile_cubin(extra=("--ptxas-options=-v", *(f"-D{d}" for d in defines)))
    if "serializ" not in log.lower():
        return cubin, defines
    if any(d.startswith("HALF_MMA=") for d in defines):
        log_once(f"vllm-dsa-varlen: ptxas serialised the wgmmas of the sm_90 build {defines}")
        return cubin, defines
    if set(PIPELINE) <= set(defines):
        plain = tuple(d for d in defines if d not in PIPELINE)
        log_once(f"vllm-dsa-varlen: ptxas serialised the wgmmas of the sm_90 build {defines}; "
                 f"built {plain} instead (the same results, slower on 2- and 4-token steps)")
        return build_cubin(plain)
    log_once(f"vllm-dsa-varlen: ptxas serialised the wgmmas of the sm_90 build {defines}; "
             "built with HALF_MMA=0 instead (the same results, slower on 3-token and "
             "variable steps)")
    plain = (*defines, "HALF_MMA=0")
    return compile_cubin(extra=tuple(f"-D{d}" for d in plain))[0], plain


def _load(device: torch.device, defines: tuple) -> _Loaded:
    """Compile (NVRTC) the build with ``defines`` (or the one :func:`build_cubin`
    makes instead) and load it on ``device``, with that build's shared memory
    and threads."""
    cubin, built = build_cubin(defines)
    smem = smem_bytes(built)
    fn, ctx, module = load_function(_driver(), device, cubin, KERNEL_NAME, smem)
    config = (dependent_launch(_driver(), num_sms(device), threads(built), smem)
              if set(PDL) <= set(built) else None)
    loaded = _Loaded(fn, ctx, smem, threads(built), config)
    loaded.module = module
    return loaded


_LOADED: dict = {}
_BY_DEVICE: dict = {}  # (torch.device, defines) -> _Loaded: the launch's lookup


def load(device, defines: tuple = ()) -> _Loaded:
    """Compile (NVRTC) and load the kernel for ``device`` once per process.
    Done by ``precompile`` at start-up, so no decode step waits on it.
    ``defines``: ``NAME=value`` macros of the source, one of
    :func:`shipped_builds` (the default build takes none)."""
    fast = isinstance(device, torch.device) and isinstance(defines, tuple)
    got = _BY_DEVICE.get((device, defines)) if fast else None
    if got is not None:
        return got
    got = load_once(_LOADED, _lock, device, tuple(defines), _load)
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


@functools.lru_cache(maxsize=256)
def _encode_shape(dims: tuple, strides: tuple, box: tuple) -> tuple:
    """The encode's arguments a layout fixes, as the ctypes arrays the driver
    reads (built once per layout: building them costs more than the encode)."""
    rank = len(dims)
    return (rank, (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
            (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)))


def _encode(base: int, dims: tuple, strides: tuple, box: tuple) -> bytes:
    """A 128-byte-swizzled uint8 TMA descriptor (driver ``cuTensorMapEncodeTiled``),
    its 128 bytes."""
    raw = (ctypes.c_uint8 * (128 + 64))()
    addr = (ctypes.addressof(raw) + 63) & ~63
    rank, d, s, b, e = _encode_shape(dims, strides, box)
    # uint8, no interleave, 128-byte swizzle, 128-byte L2 promotion, zero fill
    res = _encode_fn()(ctypes.c_void_p(addr), 0, rank, ctypes.c_void_p(base), d, s, b, e,
                       0, 3, 2, 0)
    if res == INVALID_CONTEXT:
        raise _NoContext("cuTensorMapEncodeTiled: no current driver context in this thread")
    if res:
        raise RuntimeError(f"cuTensorMapEncodeTiled: CUDA error {res} (dims {list(dims)}, "
                           f"strides {list(strides)}, box {list(box)})")
    return ctypes.string_at(addr, 128)


class _NoContext(RuntimeError):
    """The calling thread has no current driver context (it made no CUDA call yet)."""


class _Descriptors(dict):
    """The TMA descriptors of one tensor layout, by data address, as the bytes
    a launch packs.  ``dims``, ``strides`` and ``box`` (what the layout fixes)
    are every field of a descriptor but its address, so a launch finds its
    descriptor by ``data_ptr()`` alone in its layout's dict: a layer's KV cache
    never moves while serving (one encode per layer and process), and the
    queries come back at the few addresses the allocator hands out.  A
    captured launch holds its own copy (``cuLaunchKernel`` copies the
    parameters), so dropping an entry never touches a graph."""

    def __init__(self, dims: tuple, strides: tuple, box: tuple):
        super().__init__()
        self.dims, self.strides, self.box = dims, strides, box

    def encode(self, base: int, ctx) -> bytes:
        """The descriptor of the tensor at ``base``, encoded and kept; a
        thread with no current driver context is given ``ctx`` (the device's
        primary one) first."""
        try:
            got = _encode(base, self.dims, self.strides, self.box)
        except _NoContext:  # a thread's first CUDA call
            ok(_driver().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            got = _encode(base, self.dims, self.strides, self.box)
        if len(self) >= _MAPS_LIMIT:
            self.clear()
        self[base] = packed = bytes(got)
        return packed


_DESCRIPTORS: dict = {}  # (dims, strides, box) -> _Descriptors of that layout
# Kept before starting afresh: addresses per layout, and layouts (the queries'
# layout changes with every step's row count; a cleared registry costs the
# KV caches' layout one encode per layer again, hence room for many).
_MAPS_LIMIT = 256
_LAYOUTS_LIMIT = 4096


def _descriptors(dims: tuple, strides: tuple, box: tuple) -> _Descriptors:
    """The descriptor dict of one layout (made on first use)."""
    key = (dims, strides, box)
    got = _DESCRIPTORS.get(key)
    if got is None:
        if len(_DESCRIPTORS) >= _LAYOUTS_LIMIT:
            _DESCRIPTORS.clear()
        got = _DESCRIPTORS[key] = _Descriptors(dims, strides, box)
    return got


def kv_descriptors(kv_cache) -> _Descriptors:
    """The cache's layout: ``[blocks][page][D]`` bytes, one page per box."""
    stride = kv_cache.stride(0) * kv_cache.dtype.itemsize
    return _descriptors((DIM, PAGE, kv_cache.shape[0]), (DIM, stride), (DIM, PAGE, 1))


def q_descriptors(q, group: int) -> _Descriptors:
    """The queries' layout: ``[rows][H][D]`` bytes, a row group per box."""
    heads, stride = q.shape[2], q.stride(0) * q.dtype.itemsize
    return _descriptors((DIM, heads, q.shape[0]), (DIM, stride), (DIM, heads, group))


# ----------------------------------------------------------------- checks

def unsupported_reason(q, kv_cache, weights=None) -> str | None:
    """Why the launcher cannot route these tensors here (``None``: it can);
    :data:`LAUNCHER_HEADS` only (:func:`launch` also takes 32 heads)."""
    if not q.is_cuda or capability(q.device) != (9, 0):
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


def defines_for(max_run_len: int, head_sum: str | None = None,
                heads: int = HEADS, rows: int | None = None,
                pipeline: bool | None = None, pdl: bool | None = None) -> tuple[str, ...]:
    """The build the launcher takes for a run-length hint (evict-first where a
    request's rows fit one row group of ``heads``: :func:`rows_per_group`) and
    head sum (``"fp32"`` or ``"tf32"``; default: :func:`read_head_sum`); with
    ``pipeline`` (default: :func:`read_pipeline`) the float32 one at 64 heads
    pipelined, :data:`PIPELINE`, on launches of at least
    :data:`PIPELINE_MIN_ROWS` query rows (``rows`` ``None``: a large launch);
    with ``pdl`` (default: :func:`read_pdl`) launched as a programmatic
    dependent (:data:`PDL`); before :func:`prepare` adds ``HEADS=32`` for 32
    heads."""
    head_sum = read_head_sum() if head_sum is None else head_sum
    if head_sum not in HEAD_SUMS:
        raise ValueError(f"head_sum: expected one of {HEAD_SUMS}, got {head_sum!r}")
    pipeline = read_pipeline() if pipeline is None else pipeline
    pdl = read_pdl() if pdl is None else pdl
    group = rows_per_group(heads)
    pipelined = pipeline and group == 2 and (rows is None or rows >= PIPELINE_MIN_ROWS)
    return (("EVICT_FIRST=1",) if max_run_len <= group else ()) + (
        ("HEAD_SUM_TC=1",) if head_sum == "tf32" else PIPELINE if pipelined else ()) + (
        PDL if pdl else ())


def shipped_builds() -> list[tuple[str, ...]]:
    """Every build the launcher can load, as :func:`load` gets its defines:
    :func:`defines_for` at each head count over the run-length hint classes,
    head sums, launch sizes and the pipeline and PDL settings (``HEADS=32``
    added as :func:`prepare` adds it), then each four-warpgroup build's
    ``HALF_MMA=0`` twin, what :func:`build_cubin` makes where ptxas
    serialises its wgmmas."""
    builds: list[tuple[str, ...]] = []
    for heads in LAUNCHER_HEADS:
        extra = () if heads == HEADS else (f"HEADS={heads}",)
        for hint in (1, rows_max_for(heads, 1)):  # within one row group, and past it
            for head_sum in HEAD_SUMS:
                for rows in (1, PIPELINE_MIN_ROWS):
                    for pipeline in (False, True):
                        for pdl in (False, True):
                            build = defines_for(hint, head_sum, heads, rows, pipeline,
                                                pdl) + extra
                            if build not in builds:
                                builds.append(build)
    return builds + [(*b, "HALF_MMA=0") for b in builds if not set(PIPELINE) <= set(b)]


@functools.lru_cache(maxsize=None)
def read_pdl() -> bool:
    """``DSA_VARLEN_PDL`` (read once per process): the launcher's builds
    launched as programmatic dependents (:data:`PDL`), or plain launches."""
    return settings.get(PDL_ENV)


@functools.lru_cache(maxsize=None)
def read_pipeline() -> bool:
    """``DSA_VARLEN_PIPELINE`` (read once per process): the pipelined build
    where it applies (:func:`defines_for`), or the four-warpgroup one."""
    return settings.get(PIPELINE_ENV)


@functools.lru_cache(maxsize=None)
def read_head_sum() -> str:
    """``DSA_VARLEN_HEAD_SUM`` (read once per process): ``"fp32"`` (DeepGEMM's
    float32 arithmetic) or ``"tf32"`` (the tensor-core head sum)."""
    return settings.get(HEAD_SUM_ENV)


def _define(defines: tuple, name: str, default: int) -> int:
    """The value of ``name=n`` in ``defines`` (the last one), else ``default``."""
    values = [int(d.partition("=")[2]) for d in defines if d.startswith(name + "=")]
    return values[-1] if values else default


def math_warpgroups(defines: tuple = ()) -> int:
    """Math warpgroups of a build: :data:`MATH`, or the pipelined build's ``NUM_MATH=3``."""
    return _define(defines, "NUM_MATH", MATH)


def threads(defines: tuple = ()) -> int:
    """Threads per CTA of a build: a producer and its math warpgroups."""
    return 128 * (math_warpgroups(defines) + 1)


def smem_bytes(defines: tuple = ()) -> int:
    """Dynamic shared memory of a build (:data:`SMEM_BYTES`; more with
    ``HEAD_SUM_TC=1``; a ring fewer in the pipelined build)."""
    math = math_warpgroups(defines)
    return _smem(math) + (HEAD_SUM_TC_BYTES * math // MATH if "HEAD_SUM_TC=1" in defines else 0)


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

# Small steps planned a CTA item per row group (``plan_torch``'s ``cut_items``):
# up to this many items (chunk pages) per CTA of the grid, by head count.  On
# small steps a request's row groups in items of their own spread the work over
# more CTAs; from a few thousand pages the cut costs more than it spreads
# (BENCHMARKS.md, docs/design.md).
CUT_PER_PROGRAM = {64: 8, 32: 8}


def cut_items_for(heads: int, programs: int) -> int:
    """The serving plan's ``cut_items`` on a grid of ``programs`` CTAs."""
    return CUT_PER_PROGRAM.get(heads, 0) * programs


def plan(indices, context_lens, max_context_len: int, bt_width: int, heads: int = HEADS,
         rows_max: int | None = None, *, programs: int | None = None, cost=COST,
         cut_items: int | None = None):
    """The step's schedule: ``(table int32 [R, 8], ctas int32 [programs, 4])``
    as :func:`plan_torch` defines it.  On the GPU (int32 run ids, NVRTC
    present) one launch of the planner kernel's build for ``heads``
    (:func:`.cuda_plan.plan_device`: plan_torch's schedule bit for bit, a
    launch instead of some forty), else :func:`plan_torch`.
    ``cut_items``: :func:`plan_torch`'s (default: :data:`CUT_PER_PROGRAM`
    times the CTAs).  No host sync, graph safe."""
    rows_max = _check_structure(heads, rows_max)
    grid = programs if programs is not None else num_sms(indices.device)  # once a step
    if cut_items is None:
        cut_items = cut_items_for(heads, grid)
    if indices.is_cuda and indices.dtype == torch.int32 and available() is None:
        if ((programs is None or programs <= cuda_plan.MAX_PROGRAMS)
                and indices.numel() <= cuda_plan.MAX_ROWS):
            return plan_device(indices, context_lens, max_context_len, bt_width, heads=heads,
                               programs=grid, cost=cost, cut_items=cut_items)
    return plan_torch(indices, context_lens, max_context_len, bt_width, heads, rows_max,
                      programs=grid, cost=cost, cut_items=cut_items)


def _check_structure(heads: int, rows_max: int | None) -> int:
    """The chunk size for ``heads`` (``rows_max`` checked against it)."""
    want = GMAX * rows_per_group(heads)
    if rows_max is not None and rows_max != want:
        raise ValueError(f"rows_max: at {heads} heads this kernel holds {want} rows per "
                         f"chunk, got {rows_max}")
    return want


def plan_torch(indices, context_lens, max_context_len: int, bt_width: int, heads: int = HEADS,
               rows_max: int | None = None, *, programs: int | None = None, cost=COST,
               cut_items: int = 0):
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
    size, :func:`rows_max_for` ``heads`` (the default).

    ``cut_items`` > 0: where the step's items (chunk pages) number at most
    that, every run of more than ``g`` and at most ``rows_max`` rows (one
    chunk, over both its row groups of ``g`` rows) is planned as runs of
    ``g`` rows (the last the shorter), a CTA item per row group, each with
    the run's KV length (each row masked as before); decided on
    the device, so a captured plan replays right for any step
    (:data:`CUT_PER_PROGRAM`)."""
    rows_max = _check_structure(heads, rows_max)
    group = rows_per_group(heads)
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

    def bounds(starts, ends):  # each row's run's first and last row
        return (torch.cummax(torch.where(starts, r, 0), 0).values,
                torch.flip(torch.cummin(torch.flip(torch.where(ends, r, rows), (0,)), 0).values,
                           (0,)))

    first, last = bounds(starts, ends)
    cap = min(int(max_context_len), int(bt_width) * PAGE)
    kv = ctx[last.long()].clamp(0, cap)  # the run's (a cut piece keeps it)
    if cut_items > 0:
        chunk_pages = torch.where(((r - first) % rows_max) == 0, (kv + PAGE - 1) // PAGE, 0)
        cutting = chunk_pages.sum() <= cut_items
        pos, length = r - first, last - first + 1
        cut = cutting & (length > group) & (length <= rows_max)
        starts = starts | (cut & (pos % group == 0))
        ends = ends | (cut & (pos % group == group - 1))
        first, last = bounds(starts, ends)
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


def schedule_key(indices, context_lens, max_context_len: int, bt_width: int, heads: int,
                 rows_max: int, capturing: bool) -> tuple:
    """What a planned schedule depends on, for a per-step cache: the step's
    tensors (by address: their contents are the step's), the integers, the
    structure, and whether a CUDA graph is being captured (a schedule planned
    outside a capture is not replayed by it, and one planned inside is only
    refreshed by the graph's replays)."""
    return ("cuda", indices.data_ptr(), indices.shape[0], context_lens.data_ptr(),
            max_context_len, bt_width, rows_max, heads, capturing)


def schedule_model(indices, context_lens, max_context_len: int, bt_width: int,
                   num_programs: int, cost=COST, heads: int = HEADS, cut_items: int | None = None
                   ) -> list[list[tuple[int, int, int]]]:
    """Host mirror of :func:`plan`, for tests: each CTA's items as ``(chunk
    first row, chunk rows, page)`` in the order the CTA numbers them
    (``cut_items`` as :func:`plan` takes it)."""
    from .reference import run_spans

    group = rows_per_group(heads)
    chunk = GMAX * group
    cap = min(max_context_len, bt_width * PAGE)
    if cut_items is None:
        cut_items = cut_items_for(heads, num_programs)
    spans = run_spans(indices, context_lens, cap)
    pages = sum(-(-kv // PAGE) * len(range(r, e + 1, chunk)) for r, e, kv in spans)
    if cut_items > 0 and pages <= cut_items:
        def pieces(r, e, kv):  # a run filling more than one row group of a chunk: its groups
            if not group < e - r + 1 <= chunk:
                return [(r, e, kv)]
            return [(p, min(p + group - 1, e), kv) for p in range(r, e + 1, group)]

        spans = [piece for span in spans for piece in pieces(*span)]
    items = []
    for r, e, kv in spans:
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

# Both run on every launch (module names, so a test can stand in for them).
_stream = current_stream
_current_device = current_device


class Prepared:
    """A launch of one build on one layout of its arguments (their shapes,
    strides and dtypes): what the parameter block takes from the layout (the
    row count, the cache's, weights' and block table's strides), the grid, and
    the descriptor dicts of the queries' and the cache's layouts.  A call
    passes the data addresses only (:meth:`__call__`), so a caller that keeps
    one per layout (the launcher does) reads no shape or stride per launch.
    :func:`prepare` makes one."""

    __slots__ = ("kern", "index", "programs", "rows", "stride_block", "stride_w", "stride_bt",
                 "q_maps", "kv_maps")

    def __call__(self, q: int, kv: int, w: int, ctx: int, bt: int, out: int, stride_out: int,
                 table: int, ctas: int) -> None:
        """Launch on the tensors at these data addresses on the device's current
        stream; ``stride_out``: the logits' row stride (left open by the
        layout: the launcher allocates each step's logits at its own width).
        The block is packed whole and handed to ``cuLaunchKernel``, which
        copies it (the next launch may rewrite it at once; a capture keeps
        its own copy)."""
        kern = self.kern
        q_map = self.q_maps.get(q) or self.q_maps.encode(q, kern.ctx)
        kv_map = self.kv_maps.get(kv) or self.kv_maps.encode(kv, kern.ctx)
        index = self.index
        with kern.lock:
            _PACK.pack_into(kern.params, 0, kv_map, q_map, kv, self.stride_block, w,
                            self.stride_w, ctx, bt, self.stride_bt, out, stride_out, table, ctas,
                            self.rows)
            if _current_device() == index:
                _launch(kern, self.programs, _stream(index))
            else:
                with torch.cuda.device(index):
                    _launch(kern, self.programs, _stream(index))


def prepare(q, kv_cache, weights, block_table, defines: tuple = ()) -> Prepared:
    """The launch of the build ``defines`` (its ``HEADS=32`` twin for 32-head
    queries) on these tensors' layout, loading the build on first use
    (:func:`load`).  Inputs as :mod:`.launcher` checks them."""
    heads = q.shape[2]
    group = rows_per_group(heads)
    if heads != HEADS:
        defines = tuple(defines) + (f"HEADS={heads}",)
    dev = q.device
    got = Prepared()
    got.kern = load(dev, defines)
    got.index, got.programs, got.rows = dev.index, num_sms(dev), q.shape[0]
    got.stride_block, got.stride_w = kv_cache.stride(0), weights.stride(0)
    got.stride_bt = block_table.stride(0)
    got.q_maps, got.kv_maps = q_descriptors(q, group), kv_descriptors(kv_cache)
    return got


def check_schedule(schedule, rows: int, programs: int) -> None:
    """``ValueError`` naming ``schedule`` unless it is :func:`plan`'s format for
    ``rows`` rows and ``programs`` CTAs."""
    table = ctas = None
    if isinstance(schedule, (tuple, list)) and len(schedule) == 2:
        table, ctas = schedule
    if not (isinstance(table, torch.Tensor) and isinstance(ctas, torch.Tensor)
            and table.dtype == torch.int32 and table.shape == (rows, TABLE_WORDS)
            and ctas.dtype == torch.int32 and ctas.shape == (programs, CTA_WORDS)):
        got = ([(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
                for t in schedule] if isinstance(schedule, (tuple, list)) else
               type(schedule).__name__)
        raise ValueError(f"schedule: expected (int32 [{rows}, {TABLE_WORDS}], int32 "
                         f"[{programs}, {CTA_WORDS}]) from plan(), got {got}")


def launch(q, kv_cache, weights, context_lens, block_table, indices, max_context_len, out, *,
           rows_max: int | None = None, schedule=None, defines: tuple = ()):
    """Launch on checked inputs (:mod:`.launcher` checks them); ``schedule``:
    the step's :func:`plan` (made here when not given); ``defines``: a
    build's macros (:func:`load`).  32 heads (``q [R, 1, 32, D]``)
    take the ``HEADS=32`` build of ``defines``.  Returns the build launched.

    Prepares the launch on every call (:func:`prepare`); the launcher keeps
    its preparations per call layout instead."""
    rows, heads = q.shape[0], q.shape[2]
    _check_structure(heads, rows_max)
    if not _weights_fit(weights, heads):
        raise ValueError(f"weights: expected contiguous fp32 [R, {heads}] (16-byte aligned), got "
                         f"strides {weights.stride()}")
    go = prepare(q, kv_cache, weights, block_table, defines)
    if schedule is None:
        schedule = plan(indices, context_lens, max_context_len, block_table.shape[1], heads)
    check_schedule(schedule, rows, go.programs)
    table, ctas = schedule
    ctx = context_lens
    if not ctx.is_contiguous():  # [R, 1] or [R]: contiguous means one int per row
        ctx = ctx.reshape(-1).contiguous()
    go(q.data_ptr(), kv_cache.data_ptr(), weights.data_ptr(), ctx.data_ptr(),
       block_table.data_ptr(), out.data_ptr(), out.stride(0), table.data_ptr(), ctas.data_ptr())
    return go.kern


def _launch(kern: _Loaded, programs: int, stream: int) -> None:
    """``kern`` launched with its parameter block as it stands (as a
    programmatic dependent where its build says so: ``kern.config``)."""
    launch_function(_driver(), kern.fn, kern.ctx, programs, kern.threads, kern.smem, stream,
                    kern.params_addr, kern.config)
