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

The launcher checks every input once per shape signature (``ValueError``
naming the argument), picks a kernel from host-known facts only (device,
shapes, whether a CUDA graph is being captured), so the choice never
synchronises with the GPU and is graph safe, and hands the checked inputs to
the kernel module's ``launch``.  The kernels import :mod:`.common`, never this
module.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import triton

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


# ------------------------------------------------------------ checks, cached
#
# An eager call pays for the Python checks on every layer of every step: they
# run once per shape signature (the tensors' shapes, strides, dtypes and
# device); the checks that depend on values run every call.

_CHECKED: dict = {}


def _signature(*tensors) -> tuple:
    return tuple((t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else
                 (type(t),) for t in tensors)


def checked_layout(q, kv_cache, weights, context_lens, block_table, indices,
                   max_context_len) -> tuple[int, int, int, int]:
    """:func:`check_varlen_inputs`, run once per shape signature; the checks that
    depend on values (``indices`` address, ``max_context_len``) run every call."""
    if not isinstance(max_context_len, int) or max_context_len < 1:
        fail("max_context_len", "an int >= 1", max_context_len)
    if isinstance(indices, torch.Tensor) and indices.data_ptr() % 8:
        fail("indices", "an 8-byte aligned start address", hex(indices.data_ptr()))
    key = _signature(q, kv_cache, weights, context_lens, block_table, indices)
    got = _CHECKED.get(key)
    if got is None:
        got = check_varlen_inputs(q, kv_cache, weights, context_lens, block_table, indices,
                                  max_context_len)
        if len(_CHECKED) >= CACHE_LIMIT:
            _CHECKED.clear()
        _CHECKED[key] = got
    return got


# ------------------------------------------------------------ kernel choice

KERNEL_ENV = "VLLM_DSA_VARLEN_KERNEL"  # "auto" (default), "portable", "sm90", "sm90_cuda"
KERNELS = ("auto", "portable", "sm90", "sm90_cuda")  # "sm90" and "sm90_cuda": the same kernel
# Names no longer taken, with what to ask for instead (a ValueError says so).
RETIRED_KERNELS = {"sm90_gluon": 'the sm_90 Gluon kernel was retired; "sm90" takes the sm_90 '
                                 'CUDA kernel'}
# "auto" takes the sm_90 CUDA kernel (ops/cuda_paged_mqa_logits.py) on Hopper
# wherever it can run (32 and 64 heads, NVRTC and cuda-python present): it
# measured faster than the portable kernel on every step, at every run length
# (BENCHMARKS.md, docs/design.md), so the longest-run hint does not change the
# choice (it picks the kernel's build: cuda_paged_mqa_logits.defines_for).
HOPPER_AUTO = True
# Eager calls (outside a CUDA-graph capture: vLLM's piecewise mode runs the
# indexer op eagerly in every mixed prefill+decode step).  True: "auto" takes
# the CUDA kernel eagerly too: its launch rewrites one parameter block in place,
# TMA descriptors cached by layout (cuda_paged_mqa_logits.launch), and on the
# H200 an eager call through this launcher cost 48-55 µs of host time against
# the portable kernel's 83-88, with less GPU time on every step timed
# (vllm-dsa-varlen-bench --launch-host).  False: the portable kernel for eager
# calls (as while a launch cost 55-230 µs).
EAGER_CUDA_SM90 = True


def resolve_kernel(kernel: str | None) -> str:
    """``kernel``, or ``VLLM_DSA_VARLEN_KERNEL`` when it is ``None`` (default
    "auto"), checked against :data:`KERNELS` (``ValueError`` naming
    ``kernel``, and the variable when the name came from it)."""
    source = ""
    if kernel is None:
        kernel = os.environ.get(KERNEL_ENV, "auto")
        source = f" (from {KERNEL_ENV})"
    if kernel not in KERNELS:
        retired = RETIRED_KERNELS.get(kernel)
        fail("kernel", " or ".join(f'"{k}"' for k in KERNELS),
             f"{kernel!r}{source}" + (f": {retired}" if retired else ""))
    return kernel


def graph_kernel(device, heads: int | None, dim: int = 128, page: int = 64) -> str:
    """The kernel "auto" takes inside a CUDA-graph capture for an indexer cache of
    this geometry on ``device`` (a builder-level fact, for the per-step policy):
    "cuda_sm90" or "portable".  ``heads=None`` (unknown) never claims the CUDA
    kernel, which serves 32 and 64 heads only."""
    device = torch.device(device)
    if (not HOPPER_AUTO or device.type != "cuda" or not torch.cuda.is_available()
            or torch.cuda.get_device_capability(device) != (9, 0)):
        return "portable"
    ck = cuda_sm90
    if (heads in ck.LAUNCHER_HEADS and (dim, page) == (ck.DIM, ck.PAGE)
            and ck.available() is None):
        return "cuda_sm90"
    return "portable"


def hopper_kernel_for(q, kv_cache, kernel: str | None, max_run_len: int = 4, weights=None,
                      capturing: bool | None = None):
    """The sm_90 CUDA kernel's module (:mod:`.cuda_paged_mqa_logits`, with
    ``rows_max_for``, ``plan``, ``schedule_key``, ``defines_for`` and
    ``launch``) when this call should take it, else ``None`` (the portable
    kernel).  ``kernel``: one of :data:`KERNELS` (``None``: the
    ``VLLM_DSA_VARLEN_KERNEL`` setting); "sm90" / "sm90_cuda" force the CUDA
    kernel (``RuntimeError`` where it cannot run); "auto" takes it where it
    can run, else the portable kernel with a log line on Hopper.
    ``max_run_len`` does not change the choice (every hint has a build).
    ``capturing``: whether the current stream is being captured (asked here
    when not given)."""
    kernel = resolve_kernel(kernel)
    if capturing is None:
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if kernel == "portable" or (
            kernel == "auto" and not (HOPPER_AUTO and (capturing or EAGER_CUDA_SM90))):
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
    ``kernel``: "auto" (default; env ``VLLM_DSA_VARLEN_KERNEL``) takes the sm_90
    CUDA kernel (:mod:`.cuda_paged_mqa_logits`) on Hopper inside CUDA graphs
    (and eagerly, with :data:`EAGER_CUDA_SM90`) where it can run, and the
    portable kernel (:mod:`.triton_paged_mqa_logits`) elsewhere or when a
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
    rows, heads, dim, page = checked_layout(
        q, kv_cache, weights, context_lens, block_table, indices, max_context_len)
    if validate_contents:
        check_varlen_contents(context_lens, block_table, indices, max_context_len, page,
                              kv_cache.shape[0])
    if out is None:
        width = triton.cdiv(max_context_len, LOGITS_ALIGN) * LOGITS_ALIGN
        out = torch.empty((rows, width), dtype=torch.float32, device=q.device)[:, :max_context_len]
    elif (out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] != rows
          or out.shape[1] < max_context_len or out.stride(1) != 1):
        fail("out", f"float32 [{rows}, >= {max_context_len}] with stride(1) == 1",
             f"{out.dtype} {tuple(out.shape)}")
    if rows == 0:
        return out
    kernel = resolve_kernel(kernel)
    knobs = (rows_per_dot is not None or groups is not None or per_row or tile_pages != 1
             or tiles_per_split is not None or num_warps != 4 or num_stages != 3)
    sm90 = capturing = None
    if not knobs or kernel in ("sm90", "sm90_cuda"):
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        sm90 = hopper_kernel_for(q, kv_cache, kernel, max_run_len, weights, capturing)
    if sm90 is not None:
        rows_max = sm90.rows_max_for(heads, max_run_len)
        if schedule is None and schedule_cache is not None:
            key = sm90.schedule_key(indices, context_lens, max_context_len, block_table.shape[1],
                                    heads, rows_max, capturing)
            schedule = schedule_cache.get(key)
            if schedule is None:
                schedule = schedule_cache[key] = sm90.plan(
                    indices, context_lens, max_context_len, block_table.shape[1], heads, rows_max)
        LAST_COMPILED[0] = sm90.launch(q, kv_cache, weights, context_lens, block_table, indices,
                                       max_context_len, out, rows_max=rows_max,
                                       schedule=schedule, defines=sm90.defines_for(max_run_len))
        return out
    LAST_COMPILED[0] = portable.launch(
        q, kv_cache, weights, context_lens, block_table, indices, max_context_len, out,
        max_run_len=max_run_len, rows_per_dot=rows_per_dot, groups=groups, per_row=per_row,
        tile_pages=tile_pages, tiles_per_split=tiles_per_split, num_warps=num_warps,
        num_stages=num_stages)
    return out


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
    # portable kernel elsewhere, for calls with a portable tuning knob, and for
    # eager calls without EAGER_CUDA_SM90: both are compiled where the CUDA
    # kernel can serve this cache.
    if kernel is not None:
        resolve_kernel(kernel)
    if kernel is None or kernel == "auto":
        probe = torch.zeros((1, 1, heads, dim), device=device).to(torch.float8_e4m3fn)
        sm90 = HOPPER_AUTO and cuda_sm90.unsupported_reason(probe, kv_cache) is None
        kernels = ["portable"] + (["sm90"] if sm90 else [])
    else:
        kernels = [kernel]
    for which in kernels:
        for n in sorted(set(max_run_lens)):
            _compile_one(varlen_paged_mqa_logits, kv_cache, heads, dim, page, n, which, device)
    torch.cuda.synchronize(device)
    took = time.perf_counter() - start
    logger.info("vllm-dsa-varlen: indexer kernels compiled for H %d, D %d, page %d, run-length "
                "hints %s in %.2f s", heads, dim, page, tuple(sorted(set(max_run_lens))), took)
    return took


def _compile_one(launch, kv_cache, heads: int, dim: int, page: int, max_run_len: int,
                 kernel: str, device) -> None:
    """One call of ``launch`` (the launcher) with ``kernel`` forced: compiles that
    variant (its inputs are all zero-length contexts, so it computes nothing)."""
    rows = max(64, max_run_len)
    q = torch.zeros((rows, 1, heads, dim), device=device).to(torch.float8_e4m3fn)
    weights = torch.zeros((rows, heads), dtype=torch.float32, device=device)
    ctx = torch.zeros((rows, 1), dtype=torch.int32, device=device)
    table = torch.zeros((rows, 32), dtype=torch.int32, device=device)
    ids = torch.zeros(rows, dtype=torch.int32, device=device)
    launch(q, kv_cache, weights, ctx, table, ids, page, max_run_len=max_run_len, kernel=kernel)
