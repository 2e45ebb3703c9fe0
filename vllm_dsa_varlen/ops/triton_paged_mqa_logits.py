"""Triton varlen paged MQA logits (fp8 KV cache), DeepGEMM's varlen semantics.

Inputs (see :mod:`vllm_dsa_varlen.ops.reference` for the maths):

* ``q``            float8_e4m3fn ``[R, 1, H, D]`` — one row per query token;
* ``kv_cache``     uint8 ``[num_blocks, page, 1, D + 4]`` — fused fp8 pages,
  ``page * D`` values then ``page`` fp32 scales (only ``stride(0)`` is used);
* ``weights``      float32 ``[R, H]``;
* ``context_lens`` int32 ``[R, 1]`` or ``[R]`` — each row's own context length;
* ``block_table``  int32 ``[R, W]`` — the run's first row is read;
* ``indices``      int32 ``[R]`` — a request is a maximal run of equal ids;
  its KV length is its last row's context length;
* ``max_context_len`` — logits width.

Output: float32 ``[R, max_context_len]`` (row stride padded to 128 elements);
every column below ``min(row context, run KV length)`` is written, the rest is
left as it was allocated.

Work split: one program per (row, KV split).  A program whose row does not start
a run exits at once; the run's first row walks the run, holds up to ``ROWS`` of
its rows' queries in registers, and scores them all with one ``tl.dot`` per KV
page of its split, so each page is read once per run (runs longer than
``ROWS`` take further passes).  The grid
depends only on shapes (``R`` and ``max_context_len``) and nothing is read back
to the host, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

SUPPORTED_HEADS = (32, 64)
SUPPORTED_DIMS = (128,)
SUPPORTED_PAGES = (64,)
LOGITS_ALIGN = 128  # elements: keeps each logits row 512-byte aligned
LAST_COMPILED = [None]  # the last launch's compiled kernel (registers, spills: for the benchmark)
logger = logging.getLogger("vllm.dsa_varlen")


@triton.jit
def _load_kv_tile(kv_ptr, bt_row, tile, num_pages, stride_kv_block, offs_n, offs_d,
                  D: tl.constexpr, PAGE: tl.constexpr, TILE_PAGES: tl.constexpr):
    """KV tile ``tile`` (``TILE_PAGES`` pages): fp8 values [BN, D], fp32 scales [BN].
    Pages at or past ``num_pages`` read block 0 (their columns are not stored).
    """
    if TILE_PAGES == 1:
        block = tl.load(bt_row + tile).to(tl.int64)
        page_ptr = kv_ptr + block * stride_kv_block
        tok_ptr = page_ptr + offs_n * D
        scale_ptr = page_ptr + PAGE * D + offs_n * 4
    else:
        page_idx = tile * TILE_PAGES + offs_n // PAGE
        block = tl.load(bt_row + page_idx, mask=page_idx < num_pages, other=0).to(tl.int64)
        page_ptr = kv_ptr + block * stride_kv_block
        tok_ptr = page_ptr + (offs_n % PAGE) * D
        scale_ptr = page_ptr + PAGE * D + (offs_n % PAGE) * 4
    k = tl.load((tok_ptr[:, None] + offs_d[None, :]).to(tl.pointer_type(tl.float8e4nv)))
    scale = tl.load(scale_ptr.to(tl.pointer_type(tl.float32)))
    return k, scale


# Integers that change from step to step must not select a new compiled variant
# (Triton specialises integers equal to 1 or divisible by 16, and pointers by
# 16-byte alignment): a new variant in the middle of serving is a JIT compile.
# Strides stay specialised: they are fixed by the serving buffers and their
# divisibility is what lets the page loads vectorise.
PER_STEP_INTS = ("num_rows", "max_context_len", "bt_width", "tiles_per_split", "stride_bt")
PER_STEP_PTRS = ("ctx_ptr", "ids_ptr")


@triton.jit(do_not_specialize=PER_STEP_INTS, do_not_specialize_on_alignment=PER_STEP_PTRS)
def _varlen_paged_mqa_logits_kernel(
    q_ptr, kv_ptr, w_ptr, ctx_ptr, bt_ptr, ids_ptr, out_ptr,
    num_rows, max_context_len, bt_width, tiles_per_split,
    stride_q, stride_kv_block, stride_w, stride_bt, stride_out,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    ROWS: tl.constexpr, TILE_PAGES: tl.constexpr,
    PER_ROW: tl.constexpr, PAIRS: tl.constexpr,
):
    row0 = tl.program_id(0)
    split = tl.program_id(1)
    run_id = tl.load(ids_ptr + row0)
    if row0 > 0:
        if tl.load(ids_ptr + row0 - 1) == run_id:
            return  # not the first row of its run
    # Walk the run to its last row.  Loads past row R are masked: the ids may be
    # a view of a longer buffer whose next element repeats the last id.
    run_len = 1
    nxt = tl.load(ids_ptr + row0 + 1, mask=row0 + 1 < num_rows, other=run_id + 1)
    while nxt == run_id:
        run_len += 1
        nxt = tl.load(ids_ptr + row0 + run_len, mask=row0 + run_len < num_rows, other=run_id + 1)
    # Never past the logits width nor the block table's capacity (memory safety;
    # a context longer than the block table is invalid input, caught by
    # check_varlen_contents when asked for).
    kv_len = tl.minimum(tl.minimum(tl.load(ctx_ptr + row0 + run_len - 1), max_context_len),
                        bt_width * PAGE)
    BN: tl.constexpr = PAGE * TILE_PAGES
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(kv_len, BN))
    if tile_begin >= tile_end:
        return
    num_pages = tl.cdiv(kv_len, PAGE)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    offs_h = tl.arange(0, H)
    bt_row = bt_ptr + row0.to(tl.int64) * stride_bt
    if PER_ROW:
        # One dot per row: no padded rows for short runs.
        for tile in range(tile_begin, tile_end):
            k, scale = _load_kv_tile(kv_ptr, bt_row, tile, num_pages, stride_kv_block, offs_n, offs_d,
                                     D, PAGE, TILE_PAGES)
            cols = tile * BN + offs_n
            for chunk in range(0, run_len, ROWS):
                for r in tl.static_range(ROWS):
                    if chunk + r < run_len:
                        row = (row0 + chunk + r).to(tl.int64)
                        q = tl.load(q_ptr + row * stride_q + offs_h[:, None] * D + offs_d[None, :])
                        w = tl.load(w_ptr + row * stride_w + offs_h)
                        row_ctx = tl.minimum(tl.load(ctx_ptr + row), kv_len)
                        s = tl.dot(k, tl.trans(q))                        # [BN, H]
                        logits = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1) * scale
                        tl.store(out_ptr + row * stride_out + cols, logits, mask=cols < row_ctx)
    else:
        # ROWS rows stacked per dot, and up to PAIRS such groups held at once
        # so a run of up to PAIRS * ROWS rows reads each tile once; longer
        # runs take further passes over the split's tiles.
        offs_m = tl.arange(0, ROWS * H)    # (row-in-group, head) flattened
        offs_r = tl.arange(0, ROWS)
        for chunk in range(0, run_len, PAIRS * ROWS):
            qa, wa, ok_a, ctx_a, out_a = _load_rows(
                q_ptr, w_ptr, ctx_ptr, out_ptr, row0, chunk, run_len, kv_len,
                stride_q, stride_w, stride_out, offs_m, offs_r, offs_d, H, D)
            if PAIRS > 1:
                has_b = chunk + ROWS < run_len
                qb, wb, ok_b, ctx_b, out_b = _load_rows(
                    q_ptr, w_ptr, ctx_ptr, out_ptr, row0, chunk + ROWS, run_len, kv_len,
                    stride_q, stride_w, stride_out, offs_m, offs_r, offs_d, H, D)
            for tile in range(tile_begin, tile_end):
                k, scale = _load_kv_tile(kv_ptr, bt_row, tile, num_pages, stride_kv_block,
                                         offs_n, offs_d, D, PAGE, TILE_PAGES)
                cols = tile * BN + offs_n
                _score_rows(k, scale, cols, qa, wa, ok_a, ctx_a, out_a, BN, ROWS, H)
                if PAIRS > 1:
                    if has_b:
                        _score_rows(k, scale, cols, qb, wb, ok_b, ctx_b, out_b, BN, ROWS, H)

@triton.jit
def _load_rows(q_ptr, w_ptr, ctx_ptr, out_ptr, row0, first, run_len, kv_len,
               stride_q, stride_w, stride_out, offs_m, offs_r, offs_d,
               H: tl.constexpr, D: tl.constexpr):
    """Queries [ROWS*H, D], weights [ROWS*H], row mask, row context lengths and
    output row pointers of run rows ``first .. first + ROWS - 1``."""
    m_row = first + offs_m // H
    m_ok = m_row < run_len
    rows_m = (row0 + m_row).to(tl.int64)
    q = tl.load(q_ptr + rows_m[:, None] * stride_q + (offs_m % H)[:, None] * D
                + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    w = tl.load(w_ptr + rows_m * stride_w + offs_m % H, mask=m_ok, other=0.0)
    r_ok = first + offs_r < run_len
    rows_r = (row0 + first + offs_r).to(tl.int64)
    row_ctx = tl.minimum(tl.load(ctx_ptr + rows_r, mask=r_ok, other=0), kv_len)
    return q, w, r_ok, row_ctx, out_ptr + rows_r * stride_out


@triton.jit
def _score_rows(k, scale, cols, q, w, r_ok, row_ctx, out_rows,
                BN: tl.constexpr, ROWS: tl.constexpr, H: tl.constexpr):
    """Score ROWS rows against one KV tile and store their logits."""
    s = tl.dot(k, tl.trans(q))                                        # [BN, ROWS*H]
    s = tl.maximum(s, 0.0) * w[None, :]
    logits = tl.trans(tl.sum(tl.reshape(s, (BN, ROWS, H)), axis=2)) * scale[None, :]
    keep = r_ok[:, None] & (cols[None, :] < row_ctx[:, None])
    tl.store(out_rows[:, None] + cols[None, :], logits, mask=keep)


def _fail(arg: str, expected: str, got) -> None:
    raise ValueError(f"{arg}: expected {expected}, got {got}")


def check_varlen_inputs(q, kv_cache, weights, context_lens, block_table, indices,
                        max_context_len) -> tuple[int, int, int, int]:
    """Validate shapes, dtypes and layout (no data-dependent checks, no host sync).

    Returns ``(R, H, D, page)``."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != 1:
        _fail("q", "a [R, 1, H, D] tensor (varlen rows, next_n == 1)",
              tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__)
    rows, _, heads, dim = q.shape
    if q.dtype != torch.float8_e4m3fn:
        _fail("q", "dtype torch.float8_e4m3fn", q.dtype)
    if heads not in SUPPORTED_HEADS:
        _fail("q", f"head count H in {SUPPORTED_HEADS}", heads)
    if dim not in SUPPORTED_DIMS:
        _fail("q", f"head dim D in {SUPPORTED_DIMS}", dim)
    if q.stride(3) != 1 or q.stride(2) != dim:
        _fail("q", "heads and dims contiguous (stride(2) == D, stride(3) == 1)", q.stride())
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        _fail("kv_cache", "uint8 [num_blocks, page, 1, D + 4]",
              f"{kv_cache.dtype} {tuple(kv_cache.shape)}")
    page = kv_cache.shape[1]
    if kv_cache.shape[3] != dim + 4:
        _fail("kv_cache", f"last dim D + 4 = {dim + 4} (fp8 values + fp32 scale)",
              kv_cache.shape[3])
    if page not in SUPPORTED_PAGES:
        _fail("kv_cache", f"page size in {SUPPORTED_PAGES}", page)
    if kv_cache.stride(0) < page * (dim + 4) or kv_cache.stride(0) % 4:
        _fail("kv_cache", f"page stride >= {page * (dim + 4)} bytes and a multiple of 4",
              kv_cache.stride(0))
    if weights.dtype != torch.float32 or tuple(weights.shape) != (rows, heads):
        _fail("weights", f"float32 [{rows}, {heads}]", f"{weights.dtype} {tuple(weights.shape)}")
    if weights.stride(1) != 1:
        _fail("weights", "contiguous heads (stride(1) == 1)", weights.stride())
    if context_lens.dtype != torch.int32 or context_lens.numel() != rows or not (
            context_lens.dim() == 1 or (context_lens.dim() == 2 and context_lens.shape[1] == 1)):
        _fail("context_lens", f"int32 [{rows}, 1] or [{rows}]",
              f"{context_lens.dtype} {tuple(context_lens.shape)}")
    if not context_lens.is_contiguous():
        _fail("context_lens", "a contiguous tensor", context_lens.stride())
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != rows:
        _fail("block_table", f"int32 [{rows}, W]", f"{block_table.dtype} {tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        _fail("block_table", "stride(1) == 1", block_table.stride())
    if not isinstance(indices, torch.Tensor):
        _fail("indices", "an int32 [R] tensor", type(indices).__name__)
    if indices.dtype != torch.int32:
        _fail("indices", "dtype torch.int32", indices.dtype)
    if indices.dim() != 1 or indices.shape[0] != rows:
        _fail("indices", f"shape [{rows}] (one id per row)", tuple(indices.shape))
    if not indices.is_contiguous():
        _fail("indices", "a contiguous tensor", indices.stride())
    if indices.data_ptr() % 8:
        _fail("indices", "an 8-byte aligned start address", hex(indices.data_ptr()))
    if not isinstance(max_context_len, int) or max_context_len < 1:
        _fail("max_context_len", "an int >= 1", max_context_len)
    devices = {t.device for t in (q, kv_cache, weights, context_lens, block_table, indices)}
    if len(devices) != 1:
        _fail("inputs", "all tensors on one device", sorted(str(d) for d in devices))
    return rows, heads, dim, page


def check_varlen_contents(context_lens, block_table, indices, max_context_len, page,
                          num_blocks) -> None:
    """Data-dependent checks (read tensors back, so eager debugging only: a launch
    stays free of host syncs for CUDA graphs).  The kernel itself never reads or
    writes outside its tensors whatever the contents: it clamps each run to the
    logits width and to the block table's capacity."""
    ctx = context_lens.reshape(-1)
    if ctx.numel() and int(ctx.min()) < 0:
        _fail("context_lens", "values >= 0", int(ctx.min()))
    if ctx.numel() and int(ctx.max()) > max_context_len:
        _fail("context_lens", f"values <= max_context_len = {max_context_len}", int(ctx.max()))
    capacity = block_table.shape[1] * page
    if ctx.numel() and int(ctx.max()) > capacity:
        _fail("context_lens", f"values <= block_table width x page = {capacity} "
              "(context length beyond the block table)", int(ctx.max()))
    used = (ctx.long() + page - 1) // page
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    live = cols[None, :] < used[:, None]
    if live.any():
        vals = block_table[live]
        if int(vals.min()) < 0 or int(vals.max()) >= num_blocks:
            _fail("block_table", f"block ids in [0, {num_blocks}) for pages in use",
                  (int(vals.min()), int(vals.max())))


def default_split(num_rows: int, max_context_len: int, page: int, tile_pages: int,
                  max_run_len: int, num_sms: int) -> int:
    """KV tiles per program: enough programs to fill the GPU (about three per SM
    over the runs there are at least), 2 to 32 tiles."""
    tiles = triton.cdiv(triton.cdiv(max_context_len, page), tile_pages)
    runs = max(1, triton.cdiv(num_rows, max(1, max_run_len)))
    return max(min(2, tiles), min(32, triton.cdiv(runs * tiles, 3 * num_sms)))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# ------------------------------------------------------------ launch-cost cache
#
# An eager call pays for the Python checks and for Triton's argument binding on
# every layer of every step.  Both are cached: the layout checks per shape
# signature (the tensors' shapes, strides, dtypes and device), and the compiled
# kernel per specialisation key, launched directly on later calls.

_CHECKED: dict = {}
_BOUND: dict = {}
_CACHE_LIMIT = 4096
PREBOUND = True  # launch cached compiled kernels directly (set False to always go through the JIT)


def _signature(*tensors) -> tuple:
    return tuple((t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else
                 (type(t),) for t in tensors)


def checked_layout(q, kv_cache, weights, context_lens, block_table, indices,
                   max_context_len) -> tuple[int, int, int, int]:
    """:func:`check_varlen_inputs`, run once per shape signature; the checks that
    depend on values (``indices`` address, ``max_context_len``) run every call."""
    if not isinstance(max_context_len, int) or max_context_len < 1:
        _fail("max_context_len", "an int >= 1", max_context_len)
    if isinstance(indices, torch.Tensor) and indices.data_ptr() % 8:
        _fail("indices", "an 8-byte aligned start address", hex(indices.data_ptr()))
    key = _signature(q, kv_cache, weights, context_lens, block_table, indices)
    got = _CHECKED.get(key)
    if got is None:
        got = check_varlen_inputs(q, kv_cache, weights, context_lens, block_table, indices,
                                  max_context_len)
        if len(_CHECKED) >= _CACHE_LIMIT:
            _CHECKED.clear()
        _CHECKED[key] = got
    return got


def _spec(v) -> tuple:
    """What Triton specialises an argument on (integers: == 1 and % 16;
    tensors: 16-byte alignment)."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool):
        return (bool, v)
    if isinstance(v, int):
        return (int, v == 1, v % 16 == 0)
    return (type(v), getattr(v, "__mangle__", lambda: None)())


def launch_bound(kernel, grid, args: tuple, constexprs: dict, options: dict, unspecialized: set,
                 names: tuple):
    """Launch ``kernel`` on ``grid``: through the JIT the first time for a
    specialisation key, then straight through the compiled kernel (no argument
    binding).  ``args`` are the runtime arguments in order (``names``), whose
    members in ``unspecialized`` do not enter the key."""
    key = (kernel, grid[1:] if len(grid) > 1 else (), tuple(sorted(constexprs.items())),
           tuple(sorted(options.items())),
           tuple(_spec(v) if n not in unspecialized else None for n, v in zip(names, args)))
    compiled = _BOUND.get(key) if PREBOUND else None
    if compiled is not None:  # a compiled kernel launches on a 3-D grid
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *constexprs.values())
        return compiled
    compiled = kernel[grid](*args, **constexprs, **options)
    if PREBOUND and not isinstance(compiled, type(None)) and hasattr(compiled, "function"):
        if len(_BOUND) >= _CACHE_LIMIT:
            _BOUND.clear()
        _BOUND[key] = compiled
    return compiled


_PORTABLE_ARGS = ("q_ptr", "kv_ptr", "w_ptr", "ctx_ptr", "bt_ptr", "ids_ptr", "out_ptr",
                  "num_rows", "max_context_len", "bt_width", "tiles_per_split",
                  "stride_q", "stride_kv_block", "stride_w", "stride_bt", "stride_out")

# ------------------------------------------------------------ sm_90 dispatch

KERNEL_ENV = "VLLM_DSA_VARLEN_KERNEL"  # "auto" (default), "portable", "sm90", "sm90_cuda", "sm90_gluon"
KERNELS = ("auto", "portable", "sm90", "sm90_cuda", "sm90_gluon")
# The sm_90 path takes the CUDA C++ kernel (ops/cuda_paged_mqa_logits.py) where
# it can run (64 heads, NVRTC present) and the Gluon kernel elsewhere on sm_90:
# the CUDA kernel measured faster than the Gluon one and than the portable one
# on every step, at every run length (BENCHMARKS.md, docs/kernel-notes.md calls
# 31-39), so inside a capture "auto" takes it whatever the longest-run hint;
# the Gluon kernel keeps its own rule (auto_takes_sm90).
CUDA_SM90 = True
HOPPER_AUTO = True  # "auto" takes the sm_90 Gluon kernel on Hopper where it measured faster
# Where "auto" takes the sm_90 kernel (H200, docs/results/h200-v7b): runs of up to
# 4 tokens (hint), or a hint of exactly 8, at any row count.  A hint of 8 splits
# runs into chunks of 4 rows (the wide structure), which measured faster than the
# portable kernel on 8-token and 1..8-token steps (96.0 vs 104.0, 73.7 vs 86.7 µs)
# but not on 6-token ones (95.0 vs 94.1: a 2-row chunk pays for 4), so other hints
# above 4 keep the portable kernel.  With its schedule planned once per step the
# sm_90 kernel is also the faster one on a handful of rows (B1: 9.4 vs 11.5 µs).
HOPPER_MAX_RUN_LEN = 4
HOPPER_RUN_LENS_ABOVE = (8,)
HOPPER_MIN_ROWS = 1


def hopper_run_len(max_run_len: int) -> bool:
    """Whether "auto" may take the sm_90 kernel for this longest-run hint."""
    return max_run_len <= HOPPER_MAX_RUN_LEN or max_run_len in HOPPER_RUN_LENS_ABOVE
_logged: set = set()


def _log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        logger.info(msg)


def auto_takes_sm90(rows: int, max_run_len: int, capturing: bool = True) -> bool:
    """Whether "auto" takes the sm_90 kernel for a step of ``rows`` rows whose
    longest run is ``max_run_len`` (host-known, so the choice is graph safe).

    ``capturing``: the call is being captured into a CUDA graph.  An eager call
    of the sm_90 kernel costs about 50-250 µs of host time (measured in three
    H200 runs; its TMA descriptors are encoded per launch), more than the portable
    kernel's whole eager call on small steps (BENCHMARKS.md, eager table), and
    the launcher cannot see a step's KV length without a host sync, so eager
    calls take the portable kernel; a graph replay pays no host time."""
    return (HOPPER_AUTO and capturing and hopper_run_len(max_run_len)
            and rows >= HOPPER_MIN_ROWS)


def graph_kernel(device, heads: int | None, dim: int = 128, page: int = 64) -> str:
    """The kernel "auto" takes inside a CUDA-graph capture for an indexer cache of
    this geometry on ``device`` (a builder-level fact, for the per-step policy):
    "cuda_sm90", "gluon_sm90" or "portable".  ``heads=None`` (unknown) never
    claims the CUDA kernel, which serves 64 heads only."""
    device = torch.device(device)
    if (not HOPPER_AUTO or device.type != "cuda" or not torch.cuda.is_available()
            or torch.cuda.get_device_capability(device) != (9, 0)):
        return "portable"
    from . import cuda_paged_mqa_logits as ck
    from . import gluon_paged_mqa_logits as gk

    if (CUDA_SM90 and (heads, dim, page) == (ck.HEADS, ck.DIM, ck.PAGE)
            and ck.available() is None):
        return "cuda_sm90"
    if gk.available() is None and heads in gk.HEADS and dim == gk.DIM and page == gk.PAGE:
        return "gluon_sm90"
    return "portable"


def hopper_kernel_for(q, kv_cache, kernel: str | None, max_run_len: int = 4, weights=None):
    """The sm_90 module (:mod:`.cuda_paged_mqa_logits` or
    :mod:`.gluon_paged_mqa_logits`, both with ``rows_max_for``, ``plan``,
    ``schedule_key`` and ``launch``) when this call should take an sm_90
    kernel, else ``None`` (the portable kernel).  ``kernel``: one of
    :data:`KERNELS`; "sm90" takes the CUDA kernel where it can run, else the
    Gluon one; "sm90_cuda" / "sm90_gluon" force one."""
    kernel = kernel or os.environ.get(KERNEL_ENV, "auto")
    if kernel not in KERNELS:
        _fail("kernel", " or ".join(f'"{k}"' for k in KERNELS), kernel)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if kernel == "portable" or (kernel == "auto" and not (HOPPER_AUTO and capturing)):
        return None
    if kernel == "sm90_cuda" or (kernel in ("auto", "sm90") and CUDA_SM90):
        from . import cuda_paged_mqa_logits as ck

        why = ck.unsupported_reason(q, kv_cache, weights)
        if why is None:
            return ck
        if kernel == "sm90_cuda":
            raise RuntimeError(f"kernel='sm90_cuda' requested but the CUDA sm_90 kernel cannot "
                               f"run: {why}")
        if q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0):
            _log_once(f"vllm-dsa-varlen: Gluon sm_90 kernel, not the CUDA one ({why})")
    if kernel == "auto" and not auto_takes_sm90(q.shape[0], max_run_len, capturing):
        return None
    from . import gluon_paged_mqa_logits as gk

    why = gk.unsupported_reason(q, kv_cache)
    if why is None:
        return gk
    if kernel in ("sm90", "sm90_gluon"):
        raise RuntimeError(f"kernel='{kernel}' requested but the sm_90 kernel cannot run: {why}")
    if torch.cuda.get_device_capability(q.device)[0] == 9:
        _log_once(f"vllm-dsa-varlen: portable Triton kernel on this Hopper GPU ({why})")
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
    CUDA kernel (:mod:`.cuda_paged_mqa_logits`; the Gluon one,
    :mod:`.gluon_paged_mqa_logits`, where it cannot run) on Hopper inside CUDA
    graphs and this portable kernel elsewhere or when a portable tuning knob is
    given; "portable", "sm90" (CUDA, else Gluon), "sm90_cuda" and
    "sm90_gluon" force one.
    Tuning knobs of the portable kernel: ``rows_per_dot`` (rows stacked per
    ``tl.dot``, default 2),
    ``groups`` (row groups held at once: runs of up to ``groups *
    rows_per_dot`` rows read each tile once; default 1 when ``max_run_len``
    fits one group, else 2), ``per_row`` (one dot per row
    instead), ``tile_pages`` (pages per dot),
    ``tiles_per_split`` (default :func:`default_split`), ``num_warps``,
    ``num_stages``.  ``out``: optional float32 ``[R, >= max_context_len]``.
    ``validate_contents``: also run the data-dependent checks (host sync).
    ``schedule_cache``: a dict that lives as long as the decode step (the
    builder's per-step tag carries one): the sm_90 kernel's schedule is planned
    by the step's first call and read by every later one (every layer) instead
    of being recomputed in every call; without it each sm_90 call plans its own
    (one more launch).  ``schedule``: the step's sm_90 schedule planned by the
    caller (the ``plan`` of the sm_90 module :func:`hopper_kernel_for` picks,
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
        _fail("out", f"float32 [{rows}, >= {max_context_len}] with stride(1) == 1",
              f"{out.dtype} {tuple(out.shape)}")
    if rows == 0:
        return out
    knobs = (rows_per_dot is not None or groups is not None or per_row or tile_pages != 1
             or tiles_per_split is not None or num_warps != 4 or num_stages != 3)
    gk = (None if knobs and kernel not in ("sm90", "sm90_cuda", "sm90_gluon")
          else hopper_kernel_for(q, kv_cache, kernel, max_run_len, weights))
    if gk is not None:
        rows_max = gk.rows_max_for(heads, max_run_len)
        if schedule is None and schedule_cache is not None:
            key = gk.schedule_key(indices, context_lens, max_context_len, block_table.shape[1],
                                  heads, rows_max, torch.cuda.is_current_stream_capturing())
            schedule = schedule_cache.get(key)
            if schedule is None:
                schedule = schedule_cache[key] = gk.plan(
                    indices, context_lens, max_context_len, block_table.shape[1], heads, rows_max)
        build = getattr(gk, "defines_for", None)  # the CUDA kernel: a build per hint
        extra = {} if build is None else {"defines": build(max_run_len)}
        LAST_COMPILED[0] = gk.launch(q, kv_cache, weights, context_lens, block_table, indices,
                                     max_context_len, out, rows_max=rows_max, schedule=schedule,
                                     **extra)
        return out
    if rows_per_dot is None:
        rows_per_dot = 2
    if rows_per_dot not in (1, 2, 4, 8):
        _fail("rows_per_dot", "1, 2, 4 or 8", rows_per_dot)
    if groups is None:
        groups = 1 if max_run_len <= rows_per_dot else 2
    if groups not in (1, 2):
        _fail("groups", "1 or 2", groups)
    if tile_pages not in (1, 2):
        _fail("tile_pages", "1 or 2", tile_pages)
    if tiles_per_split is None:
        tiles_per_split = default_split(rows, max_context_len, page, tile_pages, max_run_len,
                                        _num_sms(q.device))
    num_splits = triton.cdiv(triton.cdiv(triton.cdiv(max_context_len, page), tile_pages),
                             tiles_per_split)
    grid = (rows, num_splits)
    args = (q, kv_cache, weights, context_lens, block_table, indices, out,
            rows, max_context_len, block_table.shape[1], tiles_per_split,
            q.stride(0), kv_cache.stride(0), weights.stride(0), block_table.stride(0), out.stride(0))
    constexprs = dict(H=heads, D=dim, PAGE=page, ROWS=rows_per_dot, TILE_PAGES=tile_pages,
                      PER_ROW=bool(per_row), PAIRS=groups)
    if not q.is_cuda:  # the interpreter: nothing to bind
        LAST_COMPILED[0] = _varlen_paged_mqa_logits_kernel[grid](
            *args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        return out
    LAST_COMPILED[0] = launch_bound(_varlen_paged_mqa_logits_kernel, grid, args, constexprs,
                                    dict(num_warps=num_warps, num_stages=num_stages),
                                    set(PER_STEP_INTS) | set(PER_STEP_PTRS), _PORTABLE_ARGS)
    return out


def portable_variants(heads: int, max_run_lens=(1, 2, 4, 8)) -> list[dict]:
    """The portable kernel's compile-time variants a server with ``heads`` uses
    (default knobs; the ``max_run_len`` hint picks one or two row groups)."""
    groups = sorted({1 if n <= 2 else 2 for n in max_run_lens})
    return [dict(H=heads, ROWS=2, TILE_PAGES=1, PER_ROW=False, PAIRS=g) for g in groups]
