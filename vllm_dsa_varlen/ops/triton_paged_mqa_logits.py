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

import torch
import triton
import triton.language as tl

SUPPORTED_HEADS = (32, 64)
SUPPORTED_DIMS = (128,)
SUPPORTED_PAGES = (64,)
LOGITS_ALIGN = 128  # elements: keeps each logits row 512-byte aligned


@triton.jit
def _varlen_paged_mqa_logits_kernel(
    q_ptr, kv_ptr, w_ptr, ctx_ptr, bt_ptr, ids_ptr, out_ptr,
    num_rows, max_context_len,
    stride_q, stride_kv_block, stride_w, stride_bt, stride_out,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    ROWS: tl.constexpr, PAGES_PER_SPLIT: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    row0 = tl.program_id(0)
    split = tl.program_id(1)
    run_id = tl.load(ids_ptr + row0)
    if row0 > 0:
        if tl.load(ids_ptr + row0 - 1) == run_id:
            return  # not the first row of its run
    # Walk the run to its last row.
    run_len = 1
    while row0 + run_len < num_rows and tl.load(ids_ptr + row0 + run_len) == run_id:
        run_len += 1
    kv_len = tl.minimum(tl.load(ctx_ptr + row0 + run_len - 1), max_context_len)
    page_begin = split * PAGES_PER_SPLIT
    page_end = tl.minimum(page_begin + PAGES_PER_SPLIT, tl.cdiv(kv_len, PAGE))
    if page_begin >= page_end:
        return

    offs_m = tl.arange(0, ROWS * H)        # (row-in-chunk, head) flattened
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, PAGE)
    offs_r = tl.arange(0, ROWS)
    bt_row = bt_ptr + row0.to(tl.int64) * stride_bt
    # Rows in chunks of ROWS; a run longer than ROWS re-reads its split's pages
    # once per extra chunk (choose ROWS >= the usual run length).
    for chunk in range(0, run_len, ROWS):
        m_row = chunk + offs_m // H                                   # row within run
        m_ok = m_row < run_len
        rows_m = (row0 + m_row).to(tl.int64)
        q = tl.load(q_ptr + rows_m[:, None] * stride_q + (offs_m % H)[:, None] * D
                    + offs_d[None, :], mask=m_ok[:, None], other=0.0)    # [ROWS*H, D]
        w = tl.load(w_ptr + rows_m * stride_w + offs_m % H, mask=m_ok, other=0.0)
        r_in_run = chunk + offs_r
        r_ok = r_in_run < run_len
        rows_r = (row0 + r_in_run).to(tl.int64)
        row_ctx = tl.minimum(tl.load(ctx_ptr + rows_r, mask=r_ok, other=0), kv_len)
        out_rows = out_ptr + rows_r * stride_out
        for page in range(page_begin, page_end):
            block = tl.load(bt_row + page).to(tl.int64)
            page_ptr = kv_ptr + block * stride_kv_block
            k = tl.load((page_ptr + offs_t[:, None] * D + offs_d[None, :]).to(
                tl.pointer_type(tl.float8e4nv)))                      # [PAGE, D]
            scale = tl.load((page_ptr + PAGE * D + offs_t * 4).to(
                tl.pointer_type(tl.float32)))                         # [PAGE]
            cols = page * PAGE + offs_t
            if TRANSPOSED:
                s = tl.dot(k, tl.trans(q))                            # [PAGE, ROWS*H]
                s = tl.maximum(s, 0.0) * w[None, :]
                logits = tl.trans(tl.sum(tl.reshape(s, (PAGE, ROWS, H)), axis=2))
            else:
                s = tl.dot(q, tl.trans(k))                            # [ROWS*H, PAGE]
                s = tl.maximum(s, 0.0) * w[:, None]
                logits = tl.sum(tl.reshape(s, (ROWS, H, PAGE)), axis=1)
            logits = logits * scale[None, :]                          # [ROWS, PAGE]
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
    if max_context_len > block_table.shape[1] * page:
        _fail("max_context_len", f"<= block_table width x page = {block_table.shape[1] * page} "
              "(context length beyond the block table)", max_context_len)
    devices = {t.device for t in (q, kv_cache, weights, context_lens, block_table, indices)}
    if len(devices) != 1:
        _fail("inputs", "all tensors on one device", sorted(str(d) for d in devices))
    return rows, heads, dim, page


def check_varlen_contents(context_lens, block_table, indices, max_context_len, page,
                          num_blocks) -> None:
    """Data-dependent checks (reads tensors back: eager debugging only)."""
    ctx = context_lens.reshape(-1)
    if ctx.numel() and int(ctx.min()) < 0:
        _fail("context_lens", "values >= 0", int(ctx.min()))
    if ctx.numel() and int(ctx.max()) > max_context_len:
        _fail("context_lens", f"values <= max_context_len = {max_context_len}", int(ctx.max()))
    used = (ctx.long() + page - 1) // page
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    live = cols[None, :] < used[:, None]
    if live.any():
        vals = block_table[live]
        if int(vals.min()) < 0 or int(vals.max()) >= num_blocks:
            _fail("block_table", f"block ids in [0, {num_blocks}) for pages in use",
                  (int(vals.min()), int(vals.max())))


def varlen_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    max_context_len: int,
    *,
    rows_per_dot: int | None = None,
    pages_per_split: int = 8,
    num_warps: int = 8,
    num_stages: int = 2,
    transposed: bool = False,
    out: torch.Tensor | None = None,
    validate_contents: bool = False,
) -> torch.Tensor:
    """Varlen paged MQA logits, float32 ``[R, max_context_len]`` (see module doc).

    ``rows_per_dot``: rows scored per ``tl.dot`` (default 4: MTP runs of up to
    4 tokens read each page once).  ``transposed``: score ``K @ Q^T`` instead of
    ``Q @ K^T`` (tuning knob).
    ``out``: optional float32 ``[R, >= max_context_len]`` to write into.
    ``validate_contents``: also run the data-dependent checks (host sync).
    """
    rows, heads, dim, page = check_varlen_inputs(
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
    if rows_per_dot is None:
        rows_per_dot = 4
    if rows_per_dot not in (1, 2, 4, 8):
        _fail("rows_per_dot", "1, 2, 4 or 8", rows_per_dot)
    num_splits = triton.cdiv(triton.cdiv(max_context_len, page), pages_per_split)
    grid = (rows, num_splits)
    _varlen_paged_mqa_logits_kernel[grid](
        q, kv_cache, weights, context_lens, block_table, indices, out,
        rows, max_context_len,
        q.stride(0), kv_cache.stride(0), weights.stride(0), block_table.stride(0), out.stride(0),
        H=heads, D=dim, PAGE=page, ROWS=rows_per_dot, PAGES_PER_SPLIT=pages_per_split,
        TRANSPOSED=bool(transposed),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
