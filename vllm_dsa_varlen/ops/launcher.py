"""The varlen paged MQA logits launcher: the one entry point
(:func:`varlen_paged_mqa_logits`), its input checks, the choice of kernel and
:func:`precompile`.

Two kernels compute the same logits (semantics: :mod:`.reference`):

* :mod:`.cuda_paged_mqa_logits` — sm_90 CUDA C++ (NVRTC, driver API through
  ``cuda-python``), 32 and 64 heads: what "auto" takes on Hopper, inside CUDA
  graphs and eagerly;
* :mod:`.triton_paged_mqa_logits` — portable Triton, any fp8 GPU and the CPU
  interpreter; every other GPU, and Hopper where the CUDA kernel cannot run
  (no NVRTC / ``cuda-python``, other shapes).

The launcher checks every input (``ValueError`` naming the argument) and
picks a kernel from host-known facts only (device, shapes, whether a CUDA
graph is being captured), so the choice never synchronises with the GPU and
is graph safe; both are done once per call layout and kept (a route,
:func:`route_for`), with the CUDA kernel's launch prepared for that layout, so
an eager call on a known layout reads little more than its tensors' data
addresses.  The kernels import :mod:`.common`, never this module.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

# Absolute: the benchmark imports another revision's ops/ under another name.
from vllm_dsa_varlen import settings

from . import cuda_paged_mqa_logits as cuda_sm90
from . import triton_paged_mqa_logits as portable
from .common import CACHE_LIMIT, capability, fail, log_once

SUPPORTED_HEADS = (32, 64)
SUPPORTED_DIMS = (128,)
SUPPORTED_PAGES = (64,)
LOGITS_ALIGN = 128  # elements: keeps each logits row 512-byte aligned
LAST_COMPILED = [None]  # the last launch's compiled kernel (registers, spills: for the benchmark)
logger = logging.getLogger("vllm.dsa_varlen")


# ------------------------------------------------------------------ checks

def check_varlen_inputs(q, kv_cache, weights, context_lens, block_table, indices,
                        max_context_len) -> tuple[int, int, int, int]:
    """Validate shapes, dtypes and layout (no data-dependent checks, no host sync).

    Returns ``(R, H, D, page)``."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != 1:
        fail("q", "a [R, 1, H, D] tensor (varlen rows, next_n == 1)",
             tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__)
    rows, _, heads, dim = q.shape
    if q.dtype != torch.float8_e4m3fn:
        fail("q", "dtype torch.float8_e4m3fn", q.dtype)
    if heads not in SUPPORTED_HEADS:
        fail("q", f"head count H in {SUPPORTED_HEADS}", heads)
    if dim not in SUPPORTED_DIMS:
        fail("q", f"head dim D in {SUPPORTED_DIMS}", dim)
    if q.stride(3) != 1 or q.stride(2) != dim:
        fail("q", "heads and dims contiguous (stride(2) == D, stride(3) == 1)", q.stride())
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        fail("kv_cache", "uint8 [num_blocks, page, 1, D + 4]",
             f"{kv_cache.dtype} {tuple(kv_cache.shape)}")
    page = kv_cache.shape[1]
    if kv_cache.shape[3] != dim + 4:
        fail("kv_cache", f"last dim D + 4 = {dim + 4} (fp8 values + fp32 scale)",
             kv_cache.shape[3])
    if page not in SUPPORTED_PAGES:
        fail("kv_cache", f"page size in {SUPPORTED_PAGES}", page)
    if kv_cache.stride(0) < page * (dim + 4) or kv_cache.stride(0) % 4:
        fail("kv_cache", f"page stride >= {page * (dim + 4)} bytes and a multiple of 4",
             kv_cache.stride(0))
    if weights.dtype != torch.float32 or tuple(weights.shape) != (rows, heads):
        fail("weights", f"float32 [{rows}, {heads}]", f"{weights.dtype} {tuple(weights.shape)}")
    if weights.stride(1) != 1:
        fail("weights", "contiguous heads (stride(1) == 1)", weights.stride())
    if context_lens.dtype != torch.int32 or context_lens.numel() != rows or not (
            context_lens.dim() == 1 or (context_lens.dim() == 2 and context_lens.shape[1] == 1)):
        fail("context_lens", f"int32 [{rows}, 1] or [{rows}]",
             f"{context_lens.dtype} {tuple(context_lens.shape)}")
    if not context_lens.is_contiguous():
        fail("context_lens", "a contiguous tensor", context_lens.stride())
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != rows:
        fail("block_table", f"int32 [{rows}, W]", f"{block_table.dtype} {tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        fail("block_table", "stride(1) == 1", block_table.stride())
    if not isinstance(indices, torch.Tensor):
        fail("indices", "an int32 [R] tensor", type(indices).__name__)
    if indices.dtype != torch.int32:
        fail("indices", "dtype torch.int32", indices.dtype)
    if indices.dim() != 1 or indices.shape[0] != rows:
        fail("indices", f"shape [{rows}] (one id per row)", tuple(indices.shape))
    if not indices.is_contiguous():
        fail("indices", "a contiguous tensor", indices.stride())
    if indices.data_ptr() % 8:
        fail("indices", "an 8-byte aligned start address", hex(indices.data_ptr()))
    if not isinstance(max_context_len, int) or max_context_len < 1:
        fail("max_context_len", "an int >= 1", max_context_len)
    devices = {t.device for t in (q, kv_cache, weights, context_lens, block_table, indices)}
    if len(devices) != 1:
        fail("inputs", "all tensors on one device", sorted(str(d) for d in devices))
    return rows, heads, dim, page


def check_varlen_contents(context_lens, block_table, indices, max_context_len, page,
                          num_blocks) -> None:
    """Data-dependent checks (read tensors back, so eager debugging only: a launch
    stays free of host syncs for CUDA graphs).  The kernel itself never reads or
    writes outside its tensors whatever the contents: it clamps each run to the
    logits width and to the block table's capacity."""
    ctx = context_lens.reshape(-1)
    if ctx.numel() and int(ctx.min()) < 0:
        fail("context_lens", "values >= 0", int(ctx.min()))
    if ctx.numel() and int(ctx.max()) > max_context_len:
        fail("context_lens", f"values <= max_context_len = {max_context_len}", int(ctx.max()))
    capacity = block_table.shape[1] * page
    if ctx.numel() and int(ctx.max()) > capacity:
        fail("context_lens", f"values <= block_table width x page = {capacity} "
             "(context length beyond the block table)", int(ctx.max()))
    used = (ctx.long() + page - 1) // page
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    live = cols[None, :] < used[:, None]
    if live.any():
        vals = block_table[live]
        if int(vals.min()) < 0 or int(vals.max()) >= num_blocks:
            fail("block_table", f"block ids in [0, {num_blocks}) for pages in use",
                 (int(vals.min()), int(vals.max())))


# ------------------------------------------------------------ the call's route
#
# An eager call pays the launcher's Python on every layer of every step
# (vLLM runs the indexer op eagerly in every mixed prefill+decode step, 61
# layers of DeepSeek V3.2).  What the checks and the choice of kernel decide
# depends on the call's layout, not on its data: a route, made once per layout
# key (:func:`_route_key`) by the full checks, holds their outcome, and for
# the sm_90 CUDA kernel its prepared launch (:func:`.cuda_paged_mqa_logits.prepare`),
# so a call on a known layout only reads its tensors' data addresses.  The
# key holds everything a check or the choice reads (a changed shape, stride,
# dtype, device, alignment or option misses and is checked afresh); what
# depends on values (``max_context_len``, the logits' width against it) is
# checked on every call.  A call that fails a check raises before a route is
# kept, so no bad call ever finds one.  Settings a process reads once (the CUDA
# kernel's head sum, which picks its build) are not in the key: a process never
# sees them change.  Graph safe: a captured launch holds copies of its
# parameters (descriptors included), never a reference to a route.

_ROUTES: dict = {}


class _Route:
    """What the checks and the choice of kernel decided for one call layout:
    ``rows``, ``heads``, ``page``, ``num_blocks``; ``sm90`` (the CUDA
    kernel's module, or ``None``: the portable kernel) with ``launch`` (its
    :class:`.cuda_paged_mqa_logits.Prepared`), ``rows_max`` and
    ``bt_width``; ``out_width`` / ``out_stride`` (the given logits' width and
    row stride, ``None`` when the launcher allocates them); ``capturing``
    (whether the call is captured into a CUDA graph: part of the key)."""

    __slots__ = ("rows", "heads", "page", "num_blocks", "sm90", "launch", "rows_max",
                 "bt_width", "out_width", "out_stride", "capturing")


def _route_key(q, kv_cache, weights, context_lens, block_table, indices, out, kernel: str,
               max_run_len, knobs: bool, capturing: bool, aligned: int) -> tuple:
    """Everything the checks and the choice of kernel read, as one flat tuple:
    each tensor's shape, strides, dtype and device (and the types of the two
    arguments checked for being tensors), the addresses' alignment
    (``aligned``, from :func:`_alignment`), the kernel asked for, the portable
    tuning knobs' presence, the run-length hint (it picks the build), whether
    a capture is under way.  ``AttributeError`` when
    an argument is not a tensor (the checks then name it)."""
    return (type(q), q.shape, q.stride(), q.dtype, q.device,
            kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
            weights.shape, weights.stride(), weights.dtype, weights.device,
            context_lens.shape, context_lens.stride(), context_lens.dtype, context_lens.device,
            block_table.shape, block_table.stride(), block_table.dtype, block_table.device,
            type(indices), indices.shape, indices.stride(), indices.dtype, indices.device,
            None if out is None else (out.shape, out.stride(), out.dtype, out.device),
            aligned, kernel, knobs, max_run_len, capturing)


def _alignment(q_ptr: int, kv_ptr: int, w_ptr: int, ids_ptr: int) -> int:
    """The address bits the checks read: ``indices`` 8-byte aligned (checked),
    queries, cache and weights 16-byte aligned (the CUDA kernel's TMA)."""
    return ((q_ptr | kv_ptr | w_ptr) & 15) | ((ids_ptr & 7) << 4)


def _new_route(q, kv_cache, weights, context_lens, block_table, indices, max_context_len, out,
               kernel: str, max_run_len, knobs: bool, capturing: bool) -> _Route:
    """The full checks (``ValueError`` naming the argument) and the choice of
    kernel for a call layout not seen before; the CUDA kernel's launch
    prepared (its build loaded) where the choice is that kernel."""
    rows, heads, dim, page = check_varlen_inputs(q, kv_cache, weights, context_lens, block_table,
                                                 indices, max_context_len)
    route = _Route()
    route.rows, route.heads, route.page, route.num_blocks = rows, heads, page, kv_cache.shape[0]
    route.bt_width, route.capturing = block_table.shape[1], capturing
    route.out_width = route.out_stride = None
    if out is not None:
        check_out(out, rows, max_context_len, q.device)
        route.out_width, route.out_stride = out.shape[1], out.stride(0)
    route.sm90 = route.launch = route.rows_max = None
    if rows and (not knobs or kernel in ("sm90", "sm90_cuda")):
        route.sm90 = hopper_kernel_for(q, kv_cache, kernel, max_run_len, weights)
    if route.sm90 is not None:
        route.rows_max = route.sm90.rows_max_for(heads, max_run_len)
        route.launch = route.sm90.prepare(q, kv_cache, weights, block_table,
                                          route.sm90.defines_for(max_run_len, heads=heads,
                                                                 rows=rows))
    return route


def check_out(out, rows: int, max_context_len: int, device) -> None:
    """``ValueError`` naming ``out`` unless it is float32 ``[rows, >=
    max_context_len]`` with contiguous rows on ``device``."""
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 2
            or out.shape[0] != rows or out.shape[1] < max_context_len or out.stride(1) != 1
            or out.device != device):
        fail("out", f"float32 [{rows}, >= {max_context_len}] with stride(1) == 1 on {device}",
             f"{out.dtype} {tuple(out.shape)} on {out.device}"
             if isinstance(out, torch.Tensor) else type(out).__name__)


def route_for(q, kv_cache, weights, context_lens, block_table, indices, max_context_len, out,
              kernel: str, max_run_len, knobs: bool) -> _Route:
    """The call's route (:class:`_Route`): the kept one of its layout key, or
    a new one after the full checks; ``max_context_len`` and the given
    logits' width against it are checked on every call."""
    if not isinstance(max_context_len, int) or max_context_len < 1:
        fail("max_context_len", "an int >= 1", max_context_len)
    capturing = False
    try:
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        aligned = _alignment(q.data_ptr(), kv_cache.data_ptr(), weights.data_ptr(),
                             indices.data_ptr())
        key = _route_key(q, kv_cache, weights, context_lens, block_table, indices, out, kernel,
                         max_run_len, knobs, capturing, aligned)
    except AttributeError:  # not a tensor: the checks below name it
        key = None
    route = _ROUTES.get(key) if key is not None else None
    if route is None:
        route = _new_route(q, kv_cache, weights, context_lens, block_table, indices,
                           max_context_len, out, kernel, max_run_len, knobs, capturing)
        if key is not None:
            if len(_ROUTES) >= CACHE_LIMIT:
                _ROUTES.clear()
            _ROUTES[key] = route
    elif route.out_width is not None and route.out_width < max_context_len:
        check_out(out, route.rows, max_context_len, q.device)
    return route


# ------------------------------------------------------------ kernel choice

# "auto" takes the sm_90 CUDA kernel wherever it can run, in a CUDA-graph capture
# and eagerly: it was faster than the portable kernel on every step timed, with
# its launch prepared once per call layout (BENCHMARKS.md).
KERNELS = settings.KERNELS  # "sm90" and "sm90_cuda": the same kernel
# Names no longer taken, with what to ask for instead (a ValueError says so).
RETIRED_KERNELS = settings.RETIRED_KERNELS


@functools.lru_cache(maxsize=None)
def kernel_setting() -> str:
    """``DSA_VARLEN_KERNEL`` (default "auto"), read once per process: every
    call asks, on every layer of every eager step."""
    return settings.get(settings.KERNEL_ENV)


def resolve_kernel(kernel: str | None) -> str:
    """``kernel``, or the ``DSA_VARLEN_KERNEL`` setting when it is ``None``
    (:func:`kernel_setting`, checked by the settings), checked against
    :data:`KERNELS` (``ValueError`` naming ``kernel``)."""
    if kernel is None:
        return kernel_setting()
    if kernel not in KERNELS:
        retired = RETIRED_KERNELS.get(kernel)
        fail("kernel", " or ".join(f'"{k}"' for k in KERNELS),
             repr(kernel) + (f": {retired}" if retired else ""))
    return kernel


def graph_kernel(device, heads: int | None, dim: int = 128, page: int = 64) -> str:
    """The kernel "auto" takes inside a CUDA-graph capture for an indexer cache of
    this geometry on ``device`` (a builder-level fact, for the per-step policy):
    "cuda_sm90" or "portable".  ``heads=None`` (unknown) never claims the CUDA
    kernel, which serves 32 and 64 heads only."""
    device = torch.device(device)
    if (device.type != "cuda" or not torch.cuda.is_available()
            or torch.cuda.get_device_capability(device) != (9, 0)):
        return "portable"
    ck = cuda_sm90
    if (heads in ck.LAUNCHER_HEADS and (dim, page) == (ck.DIM, ck.PAGE)
            and ck.available() is None):
        return "cuda_sm90"
    return "portable"


def hopper_kernel_for(q, kv_cache, kernel: str | None, max_run_len: int = 4, weights=None):
    """The sm_90 CUDA kernel's module (:mod:`.cuda_paged_mqa_logits`, with
    ``rows_max_for``, ``plan``, ``schedule_key``, ``defines_for`` and
    ``launch``) when this call should take it, else ``None`` (the portable
    kernel).  ``kernel``: one of :data:`KERNELS` (``None``: the
    ``DSA_VARLEN_KERNEL`` setting); "sm90" / "sm90_cuda" force the CUDA
    kernel (``RuntimeError`` where it cannot run); "auto" takes it where it
    can run, in a CUDA-graph capture and eagerly alike, else the portable
    kernel with a log line on Hopper.  ``max_run_len`` does not change the
    choice (every hint has a build)."""
    kernel = resolve_kernel(kernel)
    if kernel == "portable":
        return None
    why = cuda_sm90.unsupported_reason(q, kv_cache, weights)
    if why is None:
        return cuda_sm90
    if kernel != "auto":
        raise RuntimeError(f"kernel={kernel!r} requested but the sm_90 CUDA kernel cannot "
                           f"run: {why}")
    if q.is_cuda and capability(q.device)[0] == 9:
        log_once(f"vllm-dsa-varlen: portable Triton kernel on this Hopper GPU ({why})")
    return None


def varlen_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    max_context_len: int,
    *,
    max_run_len: int = 4,
    rows_per_dot: int | None = None,
    per_row: bool = False,
    groups: int | None = None,
    tile_pages: int = 1,
    tiles_per_split: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    kernel: str | None = None,
    out: torch.Tensor | None = None,
    validate_contents: bool = False,
    schedule_cache: dict | None = None,
    schedule: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen paged MQA logits, float32 ``[R, max_context_len]`` (see module doc).

    ``max_run_len``: a hint (the host knows the longest request's token count)
    used to size the work split; any run length is handled correctly.
    ``kernel``: "auto" (default; env ``DSA_VARLEN_KERNEL``) takes the sm_90
    CUDA kernel (:mod:`.cuda_paged_mqa_logits`) on Hopper where it can run,
    and the portable kernel (:mod:`.triton_paged_mqa_logits`) elsewhere or when a
    portable tuning knob is given; "portable" and "sm90" (= "sm90_cuda")
    force one.
    Tuning knobs of the portable kernel: ``rows_per_dot`` (rows stacked per
    ``tl.dot``, default 2),
    ``groups`` (row groups held at once: runs of up to ``groups *
    rows_per_dot`` rows read each tile once; default 1 when ``max_run_len``
    fits one group, else 2), ``per_row`` (one dot per row
    instead), ``tile_pages`` (pages per dot),
    ``tiles_per_split`` (default :func:`.triton_paged_mqa_logits.default_split`),
    ``num_warps``,
    ``num_stages``.  ``out``: optional float32 ``[R, >= max_context_len]``.
    ``validate_contents``: also run the data-dependent checks (host sync).
    ``schedule_cache``: a dict that lives as long as the decode step (the
    builder's per-step tag carries one): the sm_90 kernel's schedule is planned
    by the step's first call and read by every later one (every layer) instead
    of being recomputed in every call; without it each sm_90 call plans its own
    (one more launch).  ``schedule``: the step's sm_90 schedule planned by the
    caller (:func:`.cuda_paged_mqa_logits.plan`,
    with this call's ids, context lengths, ``max_context_len``, block-table
    width, heads and ``rows_max_for(heads, max_run_len)``), as DeepGEMM takes
    its schedule metadata; used when an sm_90 kernel runs.
    """
    kernel = resolve_kernel(kernel)
    knobs = (rows_per_dot is not None or groups is not None or per_row or tile_pages != 1
             or tiles_per_split is not None or num_warps != 4 or num_stages != 3)
    route = route_for(q, kv_cache, weights, context_lens, block_table, indices, max_context_len,
                      out, kernel, max_run_len, knobs)
    rows = route.rows
    if validate_contents:
        check_varlen_contents(context_lens, block_table, indices, max_context_len, route.page,
                              route.num_blocks)
    if out is None:
        out = new_logits(rows, max_context_len, q.device)
    if rows == 0:
        return out
    if route.launch is not None:
        _launch_sm90(route, q, kv_cache, weights, context_lens, block_table, indices,
                     max_context_len, out, schedule_cache, schedule)
        return out
    LAST_COMPILED[0] = portable.launch(
        q, kv_cache, weights, context_lens, block_table, indices, max_context_len, out,
        max_run_len=max_run_len, rows_per_dot=rows_per_dot, groups=groups, per_row=per_row,
        tile_pages=tile_pages, tiles_per_split=tiles_per_split, num_warps=num_warps,
        num_stages=num_stages)
    return out


def new_logits(rows: int, max_context_len: int, device) -> torch.Tensor:
    """Float32 logits ``[rows, max_context_len]``, each row starting 512-byte
    aligned: the row stride rounded up to :data:`LOGITS_ALIGN` elements, made
    by one ``empty_strided`` (cheaper on the host than ``empty`` and a slice)."""
    width = -(-max_context_len // LOGITS_ALIGN) * LOGITS_ALIGN
    return torch.empty_strided((rows, max_context_len), (width, 1), dtype=torch.float32,
                               device=device)


def _launch_sm90(route: _Route, q, kv_cache, weights, context_lens, block_table, indices,
                 max_context_len: int, out, schedule_cache, schedule) -> None:
    """The CUDA kernel on a checked call: the step's schedule (given and
    checked, or from the step's cache, or planned), then the route's prepared
    launch on the tensors' data addresses."""
    sm90, launch = route.sm90, route.launch
    if schedule is not None:
        sm90.check_schedule(schedule, route.rows, launch.programs)
    elif schedule_cache is not None:
        key = sm90.schedule_key(indices, context_lens, max_context_len, route.bt_width,
                                route.heads, route.rows_max, route.capturing)
        schedule = schedule_cache.get(key)
        if schedule is None:
            schedule = schedule_cache[key] = sm90.plan(
                indices, context_lens, max_context_len, route.bt_width, route.heads,
                route.rows_max)
    else:
        schedule = sm90.plan(indices, context_lens, max_context_len, route.bt_width,
                             route.heads, route.rows_max)
    table, ctas = schedule
    stride_out = route.out_stride if route.out_stride is not None else out.stride(0)
    launch(q.data_ptr(), kv_cache.data_ptr(), weights.data_ptr(), context_lens.data_ptr(),
           block_table.data_ptr(), out.data_ptr(), stride_out, table.data_ptr(), ctas.data_ptr())
    LAST_COMPILED[0] = launch.kern


# ------------------------------------------------------------- precompile

def precompile(*, heads: int, dim: int = 128, page: int = 64, device=None,
               max_run_lens=(1, 2, 4, 8), kv_block_stride: int | None = None,
               kernel: str | None = None) -> float:
    """Compile every kernel variant a server with ``heads`` indexer heads uses,
    so no decode step waits on a JIT compile; returns the seconds it took.

    The variants are the launcher's for each ``max_run_len`` hint in
    ``max_run_lens`` (the sm_90 kernel on Hopper, the portable kernel
    elsewhere, or as ``kernel`` forces).  Per-step integers (row count, logits
    width, block-table width and stride) are not specialised, so calls with any
    of them reuse these compilations.  ``kv_block_stride``: the serving cache's
    page stride in bytes when it is not ``page * (dim + 4)``.
    """
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device (kernels compile for a GPU), got {device}")
    start = time.perf_counter()
    stride = kv_block_stride or page * (dim + 4)
    blocks = 2
    pool = torch.zeros(blocks * stride, dtype=torch.uint8, device=device)
    kv_cache = pool.as_strided((blocks, page, 1, dim + 4), (stride, dim + 4, dim + 4, 1))
    # "auto" takes the sm_90 CUDA kernel where it can serve this cache and the
    # portable kernel elsewhere and for calls with a portable tuning knob: both
    # are compiled where the CUDA kernel can serve this cache.
    if kernel is not None:
        resolve_kernel(kernel)
    if kernel is None or kernel == "auto":
        probe = torch.zeros((1, 1, heads, dim), device=device).to(torch.float8_e4m3fn)
        sm90 = cuda_sm90.unsupported_reason(probe, kv_cache) is None
        kernels = ["portable"] + (["sm90"] if sm90 else [])
    else:
        kernels = [kernel]
    many = cuda_sm90.PIPELINE_MIN_ROWS
    for which in kernels:
        # with the pipeline on the sm_90 kernel's build follows the row count
        # too: a launch of few rows and one of many
        by_rows = which != "portable" and cuda_sm90.read_pipeline()
        for n in sorted(set(max_run_lens)):
            for rows in sorted({n, max(many, n)} if by_rows else {max(many, n)}):
                _compile_one(varlen_paged_mqa_logits, kv_cache, heads, dim, page, n, which,
                             device, rows)
    torch.cuda.synchronize(device)
    took = time.perf_counter() - start
    logger.info("vllm-dsa-varlen: indexer kernels compiled for H %d, D %d, page %d, run-length "
                "hints %s in %.2f s", heads, dim, page, tuple(sorted(set(max_run_lens))), took)
    return took


def _compile_one(launch, kv_cache, heads: int, dim: int, page: int, max_run_len: int,
                 kernel: str, device, rows: int) -> None:
    """One call of ``launch`` (the launcher) on ``rows`` query rows with
    ``kernel`` forced: compiles that variant (its inputs are all zero-length
    contexts, so it computes nothing)."""
    q = torch.zeros((rows, 1, heads, dim), device=device).to(torch.float8_e4m3fn)
    weights = torch.zeros((rows, heads), dtype=torch.float32, device=device)
    ctx = torch.zeros((rows, 1), dtype=torch.int32, device=device)
    table = torch.zeros((rows, 32), dtype=torch.int32, device=device)
    ids = torch.zeros(rows, dtype=torch.int32, device=device)
    launch(q, kv_cache, weights, ctx, table, ids, page, max_run_len=max_run_len, kernel=kernel)
