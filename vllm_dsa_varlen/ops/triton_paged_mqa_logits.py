"""The portable varlen paged MQA logits kernel (Triton ``tl``): any fp8 GPU and
the CPU interpreter.  :mod:`.launcher` checks the inputs and takes this kernel
wherever an sm_90 one does not serve; :func:`launch` runs it on checked inputs.

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

Output: float32 ``[R, max_context_len]``; every column below ``min(row
context, run KV length)`` is written, the rest is left as it was allocated.

Work split: one program per (row, KV split).  A program whose row does not start
a run exits at once; the run's first row walks the run, holds up to ``ROWS`` of
its rows' queries in registers, and scores them all with one ``tl.dot`` per KV
page of its split, so each page is read once per run (runs longer than
``ROWS`` take further passes).  The grid
depends only on shapes (``R`` and ``max_context_len``) and nothing is read back
to the host, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import fail, launch_bound, num_sms


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


def default_split(num_rows: int, max_context_len: int, page: int, tile_pages: int,
                  max_run_len: int, num_sms: int) -> int:
    """KV tiles per program: enough programs to fill the GPU (about three per SM
    over the runs there are at least), 2 to 32 tiles."""
    tiles = triton.cdiv(triton.cdiv(max_context_len, page), tile_pages)
    runs = max(1, triton.cdiv(num_rows, max(1, max_run_len)))
    return max(min(2, tiles), min(32, triton.cdiv(runs * tiles, 3 * num_sms)))


_PORTABLE_ARGS = ("q_ptr", "kv_ptr", "w_ptr", "ctx_ptr", "bt_ptr", "ids_ptr", "out_ptr",
                  "num_rows", "max_context_len", "bt_width", "tiles_per_split",
                  "stride_q", "stride_kv_block", "stride_w", "stride_bt", "stride_out")


def launch(q, kv_cache, weights, context_lens, block_table, indices, max_context_len, out, *,
           max_run_len: int = 4, rows_per_dot: int | None = None, groups: int | None = None,
           per_row: bool = False, tile_pages: int = 1, tiles_per_split: int | None = None,
           num_warps: int = 4, num_stages: int = 3):
    """Launch on checked inputs (:mod:`.launcher` checks them) into ``out``;
    returns the compiled kernel.  Tuning knobs: ``rows_per_dot`` (rows
    stacked per ``tl.dot``, default 2), ``groups`` (row groups held at once:
    runs of up to ``groups * rows_per_dot`` rows read each tile once; default
    1 when ``max_run_len`` fits one group, else 2), ``per_row`` (one dot per
    row instead), ``tile_pages`` (pages per dot), ``tiles_per_split``
    (default :func:`default_split`), ``num_warps``, ``num_stages``."""
    rows, _, heads, dim = q.shape
    page = kv_cache.shape[1]
    if rows_per_dot is None:
        rows_per_dot = 2
    if rows_per_dot not in (1, 2, 4, 8):
        fail("rows_per_dot", "1, 2, 4 or 8", rows_per_dot)
    if groups is None:
        groups = 1 if max_run_len <= rows_per_dot else 2
    if groups not in (1, 2):
        fail("groups", "1 or 2", groups)
    if tile_pages not in (1, 2):
        fail("tile_pages", "1 or 2", tile_pages)
    if tiles_per_split is None:
        tiles_per_split = default_split(rows, max_context_len, page, tile_pages, max_run_len,
                                        num_sms(q.device))
    num_splits = triton.cdiv(triton.cdiv(triton.cdiv(max_context_len, page), tile_pages),
                             tiles_per_split)
    grid = (rows, num_splits)
    args = (q, kv_cache, weights, context_lens, block_table, indices, out,
            rows, max_context_len, block_table.shape[1], tiles_per_split,
            q.stride(0), kv_cache.stride(0), weights.stride(0), block_table.stride(0), out.stride(0))
    constexprs = dict(H=heads, D=dim, PAGE=page, ROWS=rows_per_dot, TILE_PAGES=tile_pages,
                      PER_ROW=bool(per_row), PAIRS=groups)
    if not q.is_cuda:  # the interpreter: nothing to bind
        return _varlen_paged_mqa_logits_kernel[grid](
            *args, **constexprs, num_warps=num_warps, num_stages=num_stages)
    return launch_bound(_varlen_paged_mqa_logits_kernel, grid, args, constexprs,
                        dict(num_warps=num_warps, num_stages=num_stages),
                        set(PER_STEP_INTS) | set(PER_STEP_PTRS), _PORTABLE_ARGS)


def portable_variants(heads: int, max_run_lens=(1, 2, 4, 8)) -> list[dict]:
    """The portable kernel's compile-time variants a server with ``heads`` uses
    (default knobs; the ``max_run_len`` hint picks one or two row groups)."""
    groups = sorted({1 if n <= 2 else 2 for n in max_run_lens})
    return [dict(H=heads, ROWS=2, TILE_PAGES=1, PER_ROW=False, PAIRS=g) for g in groups]
