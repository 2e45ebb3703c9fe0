"""Hopper (sm_90) varlen paged MQA logits in Triton Gluon.

Same inputs, outputs and semantics as
:func:`vllm_dsa_varlen.ops.launcher.varlen_paged_mqa_logits` (see
:mod:`vllm_dsa_varlen.ops.reference`); the launcher takes this kernel on sm_90
where the CUDA one cannot run and this one measured faster than the portable
kernel (``auto_takes_sm90``).

Structure (one launch, graph safe, no host sync):

* **Persistent grid**: ``CTAS_PER_SM`` programs per SM, whatever the batch.
* **Device-side schedule, planned once per step** (:func:`plan`, one small
  launch on the same grid): every program scans the run ids and context
  lengths (a prefix sum of each run's work items: pages x chunks of
  ``ROWS_MAX`` query rows) and stores its even share ``[c * T / n, (c + 1) *
  T / n)`` of the ``T`` items of the step; every launch of the step reads its
  three words and walks the runs that share covers (a run may be split
  between programs; each output element is written by exactly one program, so
  results are bitwise repeatable).  :func:`schedule_model` is the same
  arithmetic on the host, for tests.
* **Warp specialisation**, two structures (:func:`takes_wide` picks one per
  launch, from the row groups a segment holds):

  - *two-warpgroup* (two row groups per segment): a TMA warp, two math
    warpgroups taking alternate items (setmaxnreg 232 / 24), an idle default
    partition; each warpgroup runs both groups of its page, the second
    wgmma under the first group's epilogue;
  - *wide* (one row group per segment, or runs chunked from more): the TMA
    producer in the default partition, two math partitions of two
    warpgroups each (112 registers) taking alternate items; an item is
    ``2 / NG`` pages x ``NG`` groups as one wgmma tile in which every
    warpgroup holds one 64 x 128 accumulator.

  A ring slot's items all go to one math partition (``STAGES`` a multiple of
  their count): the slot's full barrier is waited on by parity, which only
  the consumer of the slot's previous item can do safely.
* **TMA** into a ``STAGES``-deep shared-memory ring with full/empty
  mbarriers: a page's fp8 values through a 3-D descriptor over the fused cache
  viewed as ``[blocks, page, D]`` (page id as coordinate, the cache's own page
  stride), its ``page`` fp32 scales through a 2-D descriptor over the same
  bytes viewed as ``[blocks, page * (D + 4) / 4]`` fp32; the segment's queries
  (one ``[G, H, D]`` box per group of ``G = 128 // H`` rows) into a double
  buffer released by both math warpgroups.
* **wgmma** with the KV tokens on M (64 per page) and ``G`` query rows x ``H``
  heads on N (= 128), A (the page) and B (the queries, K-major) from shared
  memory.
* **Epilogue in registers**: ``relu(acc) * w`` summed over each row's heads,
  times the token's scale (read from shared memory in the store layout),
  stored from the head-sum's own layout where the row may look; each row's
  limit (and, for up to two row groups, the weights) is loaded once per
  segment, so with up to two row groups a page costs no global load (four
  groups reload their weights per page) and no warpgroup barrier besides the
  one releasing its slot.

Nothing here runs on the CPU interpreter: correctness is tested on the GPU,
compilation for sm_90 on the CPU (``python -m vllm_dsa_varlen.ops.compile_check``).
"""

from __future__ import annotations

import logging

import torch
import triton

from .common import DIM, PAGE, capability, launch_bound, num_sms

logger = logging.getLogger(__name__)

try:  # Gluon and its Hopper pieces; any gap leaves the portable kernel in charge
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # The TMA load is ``async_copy_global_to_shared`` on 3.6, ``async_load`` later.
    _tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared")
    _MISSING = None
except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the Triton
    gluon = gl = None
    _MISSING = f"{type(exc).__name__}: {exc}"

PER_STEP_INTS = ("num_rows", "max_context_len", "bt_width", "stride_bt")  # never specialised
HEADS = (32, 64)
MMA_N = 128          # query rows x heads per wgmma
BLOCK_R = 1024       # rows scanned per step of the schedule pass
SCHED_WORDS = 4      # int32 words per program in a planned schedule (3 used)
CTAS_PER_SM = 1
STAGES = 6
CONSUMERS = 2
DIRECT_STORE = True
# Registers per thread by math warpgroups: (each math warpgroup's, after
# setmaxnreg; the launch's, for every warp).  The launch value times the CTA's
# threads (idle default warpgroup + math warpgroups + the TMA warp) must fit the
# 64 K register file; the math warpgroups' share is what is left once the
# default warpgroup and the TMA warp give theirs back (24 each).
REGISTERS = {1: (232, 128), 2: (232, 128)}
# The wide structure: 20 warps (the producer's warpgroup and two math partitions
# of two warpgroups) at the launch's 96 registers fill 60 K of the register
# file; the producer gives back to 24, so each math warp may take 112.
WIDE_REGISTERS = (112, 96)
WIDE_STAGES = 6


def available() -> str | None:
    """``None`` when this Triton has every Gluon piece the kernel uses, else why not."""
    return _MISSING


if _MISSING is None:
    _SCHED_WORDS = gl.constexpr(SCHED_WORDS)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _seg_pages(ids_ptr, ctx_ptr, r, num_rows, kv_cap, run_first,
                   PAGE: gl.constexpr, ROWS_MAX: gl.constexpr):
        """Work items (pages x row chunks of ``ROWS_MAX``) of the run ending at
        each row of ``r``, 0 for rows that end no run; ``run_first`` is each
        row's run's first row (carried across blocks of rows by the caller)."""
        ok = r < num_rows
        idr = gl.load(ids_ptr + r, mask=ok, other=0)
        idn = gl.load(ids_ptr + r + 1, mask=(r + 1) < num_rows, other=0)
        end = ok & (((r + 1) >= num_rows) | (idn != idr))
        kv = gl.load(ctx_ptr + r, mask=end, other=0)
        kv = gl.minimum(gl.maximum(kv, 0), kv_cap)
        chunks = (r - run_first + ROWS_MAX) // ROWS_MAX
        return gl.where(end, (kv + PAGE - 1) // PAGE * chunks, 0), end

    @gluon.jit
    def _max(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _run_first(ids_ptr, r, num_rows, carry):
        """First row of each row's run (``carry``: the last block's answer for
        its last row, -1 before the first block)."""
        ok = r < num_rows
        idr = gl.load(ids_ptr + r, mask=ok, other=0)
        idp = gl.load(ids_ptr + r - 1, mask=ok & (r > 0), other=0)
        starts = gl.where(ok & ((r == 0) | (idp != idr)), r, -1)
        return gl.maximum(gl.associative_scan(starts, 0, _max), carry)

    @gluon.jit
    def _run_at(ids_ptr, ctx_ptr, start, num_rows, kv_cap, PAGE: gl.constexpr, NW: gl.constexpr):
        """The run starting at row ``start``: (last row, KV length, pages).
        Reads the ids 32 rows at a time (one load latency for runs up to 32 rows)."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        offs = gl.arange(0, 32, layout=lay)
        rid = gl.load(ids_ptr + start)
        base = start + 1
        win = gl.load(ids_ptr + base + offs, mask=base + offs < num_rows, other=rid + 1)
        diff = gl.min(gl.where(win != rid, offs, 32), axis=0)
        while diff == 32:
            base += 32
            win = gl.load(ids_ptr + base + offs, mask=base + offs < num_rows, other=rid + 1)
            diff = gl.min(gl.where(win != rid, offs, 32), axis=0)
        end = base + diff - 1
        kv = gl.minimum(gl.maximum(gl.load(ctx_ptr + end), 0), kv_cap)
        return end, kv, (kv + PAGE - 1) // PAGE

    @gluon.jit
    def _next_run(ids_ptr, ctx_ptr, end, num_rows, kv_cap, PAGE: gl.constexpr, NW: gl.constexpr):
        """The first run with pages after the run ending at row ``end``:
        (first row, last row, KV length, pages)."""
        start = end + 1
        end, kv, pages = _run_at(ids_ptr, ctx_ptr, start, num_rows, kv_cap, PAGE, NW)
        while pages == 0:
            start = end + 1
            end, kv, pages = _run_at(ids_ptr, ctx_ptr, start, num_rows, kv_cap, PAGE, NW)
        return start, end, kv, pages

    @gluon.jit
    def _my_share(ids_ptr, ctx_ptr, num_rows, kv_cap, PAGE: gl.constexpr, ROWS_MAX: gl.constexpr,
                  BLOCK_R: gl.constexpr, num_warps: gl.constexpr):
        """This program's work items: (count, last row of the first run, item
        offset in that run).  Two passes over the ids: the step's total, then
        the run holding this program's first item."""
        layout: gl.constexpr = gl.BlockedLayout([BLOCK_R // (32 * num_warps)], [32], [num_warps], [0])
        offs = gl.arange(0, BLOCK_R, layout=layout)
        total = 0
        first = -1
        for base in range(0, num_rows, BLOCK_R):
            rf = _run_first(ids_ptr, base + offs, num_rows, first)
            items, _ = _seg_pages(ids_ptr, ctx_ptr, base + offs, num_rows, kv_cap, rf, PAGE, ROWS_MAX)
            total += gl.sum(items, axis=0)
            first = gl.max(rf, axis=0)
        cta = gl.program_id(0)
        n = gl.num_programs(0)
        lo = (cta.to(gl.int64) * total // n).to(gl.int32)
        hi = ((cta.to(gl.int64) + 1) * total // n).to(gl.int32)
        first_end = num_rows
        first_off = 0
        if hi > lo:
            carry = 0
            first = -1
            for base in range(0, num_rows, BLOCK_R):
                r = base + offs
                rf = _run_first(ids_ptr, r, num_rows, first)
                items, end = _seg_pages(ids_ptr, ctx_ptr, r, num_rows, kv_cap, rf, PAGE, ROWS_MAX)
                cum = gl.associative_scan(items, 0, _add) + carry
                hit = end & (cum > lo) & (r < first_end)
                e = gl.min(gl.where(hit, r, num_rows), axis=0)
                if e < first_end:
                    first_end = e
                    first_off = lo - gl.sum(gl.where(r == e, cum - items, 0), axis=0)
                carry += gl.sum(items, axis=0)
                first = gl.max(rf, axis=0)
        return hi - lo, first_end, first_off

    @gluon.jit
    def _planned_share(sched_ptr):
        """This program's share as :func:`_plan_sm90` wrote it."""
        base = sched_ptr + gl.program_id(0) * _SCHED_WORDS
        return gl.load(base), gl.load(base + 1), gl.load(base + 2)

    @gluon.jit(do_not_specialize=("num_rows", "max_context_len", "bt_width"))
    def _plan_sm90(ids_ptr, ctx_ptr, sched_ptr, num_rows, max_context_len, bt_width,
                   PAGE: gl.constexpr, PR: gl.constexpr, ROWS_MAX: gl.constexpr,
                   BLOCK_R: gl.constexpr, num_warps: gl.constexpr):
        """The step's schedule, once per step: program ``c`` of the main
        kernel's grid gets its share (count, last row of its first run, item
        offset in that run; items of ``PR`` pages x ``ROWS_MAX`` rows) in
        ``sched_ptr[c, 0:3]``.  Launched on the main kernel's grid."""
        kv_cap = gl.minimum(max_context_len, bt_width * PAGE)
        n_items, first_end, first_off = _my_share(ids_ptr, ctx_ptr, num_rows, kv_cap, PR * PAGE,
                                                  ROWS_MAX, BLOCK_R, num_warps)
        base = sched_ptr + gl.program_id(0) * _SCHED_WORDS
        gl.store(base, n_items)
        gl.store(base + 1, first_end)
        gl.store(base + 2, first_off)

    @gluon.jit
    def _cursor_init(ids_ptr, ctx_ptr, first_end, first_off, kv_cap, PAGE: gl.constexpr,
                     ROWS_MAX: gl.constexpr, NW: gl.constexpr):
        """Cursor (first row, last row, KV length, pages, row chunk, page) at
        item ``first_off`` of the run ending at row ``first_end``."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        offs = gl.arange(0, 32, layout=lay)
        rid = gl.load(ids_ptr + first_end)
        kv = gl.minimum(gl.maximum(gl.load(ctx_ptr + first_end), 0), kv_cap)
        top = first_end - 1                      # rows top, top - 1, ... top - 31
        win = gl.load(ids_ptr + top - offs, mask=top - offs >= 0, other=rid + 1)
        diff = gl.min(gl.where(win != rid, offs, 32), axis=0)
        while diff == 32:
            top -= 32
            win = gl.load(ids_ptr + top - offs, mask=top - offs >= 0, other=rid + 1)
            diff = gl.min(gl.where(win != rid, offs, 32), axis=0)
        start = top - diff + 1
        pages = (kv + PAGE - 1) // PAGE
        return start, first_end, kv, pages, first_off // pages * ROWS_MAX, first_off % pages

    @gluon.jit
    def _cursor_step(ids_ptr, ctx_ptr, num_rows, kv_cap, start, end, kv, pages, chunk, pg, seg,
                     q_full, q_empty, PAGE: gl.constexpr, ROWS_MAX: gl.constexpr,
                     RELEASE: gl.constexpr, NW: gl.constexpr):
        """Advance a cursor by one work item; a new segment (run x row chunk)
        bumps ``seg``.  With ``RELEASE`` (math warpgroups) the old segment's
        query buffer is released, after waiting for it to have been loaded:
        a warpgroup may step over whole segments it has no item of, and
        releasing only loaded buffers keeps every warpgroup's arrivals in
        segment order on each buffer's barriers (one phase per segment)."""
        pg += 1
        if pg == pages:
            pg = 0
            chunk += ROWS_MAX
            if start + chunk > end:
                start, end, kv, pages = _next_run(ids_ptr, ctx_ptr, end, num_rows, kv_cap, PAGE, NW)
                chunk = 0
            if RELEASE:
                mbarrier.wait(q_full.index(seg % 2), (seg // 2) & 1)
                mbarrier.arrive(q_empty.index(seg % 2), count=1)
            seg += 1
        return start, end, kv, pages, chunk, pg, seg

    @gluon.jit
    def _consumer_cursor(ids_ptr, ctx_ptr, num_rows, kv_cap, n_items, first_end, first_off,
                         q_full, q_empty, WHICH: gl.constexpr, PAGE: gl.constexpr,
                         ROWS_MAX: gl.constexpr, NW: gl.constexpr):
        """Math partition ``WHICH``'s cursor at its first item (releasing the
        query buffers of segments stepped over): ``(start, end, kv, pages,
        chunk, pg, seg, pos)``, ``pos`` the item it is at."""
        start, end, kv, pages, chunk, pg = _cursor_init(ids_ptr, ctx_ptr, first_end, first_off,
                                                        kv_cap, PAGE, ROWS_MAX, NW)
        seg = 0
        pos = 0
        for _w in gl.static_range(WHICH):
            if WHICH < n_items:
                start, end, kv, pages, chunk, pg, seg = _cursor_step(
                    ids_ptr, ctx_ptr, num_rows, kv_cap, start, end, kv, pages, chunk, pg, seg,
                    q_full, q_empty, PAGE, ROWS_MAX, True, NW)
                pos = WHICH
        return start, end, kv, pages, chunk, pg, seg, pos

    @gluon.jit
    def _next_item(ids_ptr, ctx_ptr, num_rows, kv_cap, start, end, kv, pages, chunk, pg, seg, pos,
                   q_full, q_empty, i, WHICH: gl.constexpr, CONSUMERS: gl.constexpr,
                   PAGE: gl.constexpr, ROWS_MAX: gl.constexpr, NW: gl.constexpr):
        """A math partition's cursor moved on to its item ``i`` (``CONSUMERS``
        items after its previous one; at its first item, ``WHICH``, it is there
        already), releasing the query buffers of the segments it passes."""
        if i > WHICH:
            for _c in gl.static_range(CONSUMERS):
                start, end, kv, pages, chunk, pg, seg = _cursor_step(
                    ids_ptr, ctx_ptr, num_rows, kv_cap, start, end, kv, pages, chunk, pg, seg,
                    q_full, q_empty, PAGE, ROWS_MAX, True, NW)
            pos = i
        return start, end, kv, pages, chunk, pg, seg, pos

    @gluon.jit
    def _cursor_finish(ids_ptr, ctx_ptr, num_rows, kv_cap, n_items, start, end, kv, pages, chunk,
                       pg, seg, pos, q_full, q_empty, PAGE: gl.constexpr, ROWS_MAX: gl.constexpr,
                       NW: gl.constexpr):
        """Walk a math partition's cursor from item ``pos`` to the last item,
        releasing the query buffer of every segment passed: the producer reuses
        a buffer only once every math partition has released it, also one whose
        last item came earlier."""
        while pos + 1 < n_items:
            start, end, kv, pages, chunk, pg, seg = _cursor_step(
                ids_ptr, ctx_ptr, num_rows, kv_cap, start, end, kv, pages, chunk, pg, seg,
                q_full, q_empty, PAGE, ROWS_MAX, True, NW)
            pos += 1

    @gluon.jit
    def _bt_window(bt_ptr, stride_bt, start, p0, pages, seg, bt_seg, bt_base, blocks, blocks_next,
                   offs_b):
        """Block ids of the segment's pages around page ``p0``, 32 at a time
        (``blocks``, from page ``bt_base``) with the next 32 prefetched, so no
        TMA issue waits on a dependent block-table load inside a segment;
        reloaded when the segment (``seg``) changes.  Returns the new
        ``(bt_seg, bt_base, blocks, blocks_next)``."""
        if bt_seg != seg:
            bt_seg = seg
            bt_base = p0
            row_bt = bt_ptr + start.to(gl.int64) * stride_bt
            blocks = gl.load(row_bt + p0 + offs_b, mask=p0 + offs_b < pages, other=0)
            blocks_next = gl.load(row_bt + p0 + 32 + offs_b, mask=p0 + 32 + offs_b < pages,
                                  other=0)
        elif p0 - bt_base >= 32:
            bt_base += 32
            blocks = blocks_next
            row_bt = bt_ptr + start.to(gl.int64) * stride_bt
            blocks_next = gl.load(row_bt + bt_base + 32 + offs_b,
                                  mask=bt_base + 32 + offs_b < pages, other=0)
        return bt_seg, bt_base, blocks, blocks_next

    @gluon.jit
    def _load_w(w_ptr, stride_w, row_g, end, N: gl.constexpr, H: gl.constexpr,
                col_layout: gl.constexpr):
        """Weights of rows ``row_g ..`` in the accumulator's column layout (0 past the run)."""
        offs_n = gl.arange(0, N, layout=col_layout)
        w_row = row_g + offs_n // H
        return gl.load(w_ptr + w_row.to(gl.int64) * stride_w + offs_n % H, mask=w_row <= end,
                       other=0.0)

    @gluon.jit
    def _row_limits(ctx_ptr, row_g, end, kv, G: gl.constexpr, layout: gl.constexpr):
        """How far each of the ``G`` rows ``row_g ..`` may look (0 past the run),
        in ``layout`` (a 1-D slice of the store layout)."""
        rows = row_g + gl.arange(0, G, layout=layout)
        ok = rows <= end
        return gl.where(ok, gl.minimum(gl.load(ctx_ptr + rows, mask=ok, other=0), kv), 0)

    @gluon.jit
    def _epilogue(acc, w, r_lim, sc_tile, out_ptr, stride_out, row_g, cols, G: gl.constexpr,
                  H: gl.constexpr, PAGE: gl.constexpr, out_layout: gl.constexpr):
        """relu(acc) * w summed over each row's heads, times the token scale
        (read from the page's shared-memory scales in the store layout), stored
        where each row may look (``r_lim``, in the store layout's row slice)."""
        sw = gl.maximum(acc, 0.0) * gl.expand_dims(w, 0)
        logit = gl.convert_layout(gl.sum(gl.reshape(sw, [PAGE, G, H]), axis=2), out_layout)
        scale = sc_tile.load(gl.SliceLayout(1, out_layout))
        offs_t = gl.arange(0, PAGE, layout=gl.SliceLayout(1, out_layout))
        offs_g = gl.arange(0, G, layout=gl.SliceLayout(0, out_layout))
        logit = logit * gl.expand_dims(scale, 1)
        c = cols + offs_t
        keep = gl.expand_dims(c, 1) < gl.expand_dims(r_lim, 0)
        rows = (row_g + offs_g).to(gl.int64)
        ptrs = out_ptr + gl.expand_dims(rows * stride_out, 0) + gl.expand_dims(c, 1)
        gl.store(ptrs, logit, mask=keep)

    @gluon.jit
    def _group(kv_tile, q_smem, qi, zero, w, r_lim, sc_tile, out_ptr, stride_out, row_g, end, cols,
               G: gl.constexpr, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
               out_layout: gl.constexpr):
        """One row group (query buffer ``qi``, rows ``row_g ..``) against one page."""
        N: gl.constexpr = G * H
        qg = q_smem.index(qi).reshape([N, D]).permute((1, 0))
        acc = warpgroup_mma(kv_tile, qg, zero, use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if row_g <= end:
            _epilogue(acc, w, r_lim, sc_tile, out_ptr, stride_out, row_g, cols, G, H, PAGE,
                      out_layout)

    @gluon.jit
    def _pair(kv_tile, q_smem, qi, zero, wa, wb, ra, rb, sc_tile, out_ptr, stride_out, row_g, end,
              cols, G: gl.constexpr, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
              out_layout: gl.constexpr):
        """Row groups ``qi`` and ``qi + 1`` (rows ``row_g ..``) against one page:
        the second wgmma runs under the first group's epilogue."""
        N: gl.constexpr = G * H
        qa = q_smem.index(qi).reshape([N, D]).permute((1, 0))
        acc0 = warpgroup_mma(kv_tile, qa, zero, use_acc=False, is_async=True)
        qc = q_smem.index(qi + 1).reshape([N, D]).permute((1, 0))
        acc1 = warpgroup_mma(kv_tile, qc, zero, use_acc=False, is_async=True)
        r0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0,))
        _epilogue(r0, wa, ra, sc_tile, out_ptr, stride_out, row_g, cols, G, H, PAGE, out_layout)
        r1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1,))
        if row_g + G <= end:
            _epilogue(r1, wb, rb, sc_tile, out_ptr, stride_out, row_g + G, cols, G, H, PAGE,
                      out_layout)

    @gluon.jit
    def _consumer(w_ptr, ctx_ptr, ids_ptr, out_ptr, num_rows, kv_cap, stride_w, stride_out,
                  n_items, first_end, first_off, kv_smem, sc_smem, q_smem, full, empty, q_full,
                  q_empty, started, WHICH: gl.constexpr, CONSUMERS: gl.constexpr, H: gl.constexpr,
                  D: gl.constexpr, PAGE: gl.constexpr, ROWS_MAX: gl.constexpr, G: gl.constexpr,
                  STAGES: gl.constexpr, DIRECT_STORE: gl.constexpr):
        """Math warpgroup ``WHICH`` of ``CONSUMERS``: items ``WHICH``, ``WHICH +
        CONSUMERS``, ...; for each, every row group of the segment against the
        page (wgmma, epilogue, store).  With up to two row groups per segment
        their weights and row limits stay in registers for the whole segment."""
        N: gl.constexpr = G * H
        NG: gl.constexpr = ROWS_MAX // G
        gl.static_assert(STAGES % CONSUMERS == 0, "STAGES: a multiple of CONSUMERS (see launch)")
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        zero = gl.zeros([PAGE, N], gl.float32, mma_layout)
        if DIRECT_STORE:  # store from the head-sum's own layout (no shared-memory shuffle)
            out_layout: gl.constexpr = gl.sum(gl.reshape(zero, [PAGE, G, H]), axis=2).type.layout
        else:
            out_layout: gl.constexpr = gl.BlockedLayout([PAGE * G // 128, 1], [32 // G, G], [4, 1],
                                                        [0, 1])
        row_layout: gl.constexpr = gl.SliceLayout(0, out_layout)
        w0 = gl.zeros([N], gl.float32, col_layout)
        w1 = gl.zeros([N], gl.float32, col_layout)
        r0 = gl.zeros([G], gl.int32, row_layout)
        r1 = gl.zeros([G], gl.int32, row_layout)
        r2 = gl.zeros([G], gl.int32, row_layout)
        r3 = gl.zeros([G], gl.int32, row_layout)
        w_seg = -1
        _all_started(started)
        start, end, kv, pages, chunk, pg, seg, pos = _consumer_cursor(
            ids_ptr, ctx_ptr, num_rows, kv_cap, n_items, first_end, first_off, q_full, q_empty,
            WHICH, PAGE, ROWS_MAX, 4)
        for i in range(WHICH, n_items, CONSUMERS):
            start, end, kv, pages, chunk, pg, seg, pos = _next_item(
                ids_ptr, ctx_ptr, num_rows, kv_cap, start, end, kv, pages, chunk, pg, seg, pos,
                q_full, q_empty, i, WHICH, CONSUMERS, PAGE, ROWS_MAX, 4)
            slot = i % STAGES
            qb = seg % 2
            row0 = start + chunk
            cols = pg * PAGE
            if w_seg != seg:  # row limits (and, up to two row groups, weights) once per segment
                r0 = _row_limits(ctx_ptr, row0, end, kv, G, row_layout)
                if NG >= 2:
                    r1 = _row_limits(ctx_ptr, row0 + G, end, kv, G, row_layout)
                if NG == 4:
                    r2 = _row_limits(ctx_ptr, row0 + 2 * G, end, kv, G, row_layout)
                    r3 = _row_limits(ctx_ptr, row0 + 3 * G, end, kv, G, row_layout)
                if NG <= 2:
                    w0 = _load_w(w_ptr, stride_w, row0, end, N, H, col_layout)
                    if NG == 2:
                        w1 = _load_w(w_ptr, stride_w, row0 + G, end, N, H, col_layout)
                w_seg = seg
            mbarrier.wait(q_full.index(qb), (seg // 2) & 1)
            mbarrier.wait(full.index(slot), (i // STAGES) & 1)
            kv_tile = kv_smem.index(slot).reshape([PAGE, D])
            sc_tile = sc_smem.index(slot).reshape([PAGE])
            # Every row group of the segment's buffer, as straight-line wgmmas
            # with fixed buffer indices: a wgmma under a runtime branch does not
            # lower on Triton 3.6 (docs/design.md); a group holding no row
            # of the run is computed and not stored.
            if NG == 1:
                _group(kv_tile, q_smem, qb, zero, w0, r0, sc_tile, out_ptr, stride_out, row0, end,
                       cols, G, H, D, PAGE, out_layout)
            elif NG == 2:
                _pair(kv_tile, q_smem, qb * 2, zero, w0, w1, r0, r1, sc_tile, out_ptr, stride_out,
                      row0, end, cols, G, H, D, PAGE, out_layout)
            else:  # four row groups: two pairs, weights per page (no room to keep them)
                gl.static_assert(NG == 4, "ROWS_MAX: at most four row groups")
                wa = _load_w(w_ptr, stride_w, row0, end, N, H, col_layout)
                wb = _load_w(w_ptr, stride_w, row0 + G, end, N, H, col_layout)
                _pair(kv_tile, q_smem, qb * NG, zero, wa, wb, r0, r1, sc_tile, out_ptr, stride_out,
                      row0, end, cols, G, H, D, PAGE, out_layout)
                wa = _load_w(w_ptr, stride_w, row0 + 2 * G, end, N, H, col_layout)
                wb = _load_w(w_ptr, stride_w, row0 + 3 * G, end, N, H, col_layout)
                _pair(kv_tile, q_smem, qb * NG + 2, zero, wa, wb, r2, r3, sc_tile, out_ptr,
                      stride_out, row0 + 2 * G, end, cols, G, H, D, PAGE, out_layout)
            # Every read of the slot (wgmma, scale loads) is complete here; the
            # arrive orders them before the producer's next TMA into it.
            mbarrier.arrive(empty.index(slot), count=1)
        _cursor_finish(ids_ptr, ctx_ptr, num_rows, kv_cap, n_items, start, end, kv, pages, chunk,
                       pg, seg, pos, q_full, q_empty, PAGE, ROWS_MAX, 4)

    @gluon.jit
    def _producer(kv_desc, sc_desc, q_desc, bt_ptr, ids_ptr, ctx_ptr, num_rows, kv_cap, stride_bt,
                  n_items, first_end, first_off, kv_smem, sc_smem, q_smem, full, empty, q_full,
                  q_empty, started, PAGE: gl.constexpr, D: gl.constexpr, ROWS_MAX: gl.constexpr,
                  PR: gl.constexpr, STAGES: gl.constexpr, NW: gl.constexpr, WIDE: gl.constexpr):
        """TMA partition (``NW`` warps; one thread issues): the run's query rows
        once per segment, then the ``PR`` pages of every item into its ring
        slot.  ``WIDE``: the wide kernel's shared-memory layout (a segment's
        query rows as one ``[ROWS_MAX, H, D]`` buffer, a slot as ``PR`` pages);
        a segment's last item may then hold fewer pages, and its missing pages
        repeat the segment's last page (read, computed, never stored)."""
        _all_started(started)
        G: gl.constexpr = q_desc.block_type.shape[0]
        NG: gl.constexpr = ROWS_MAX // G
        SCALE_COL: gl.constexpr = PAGE * D // 4
        ITEM: gl.constexpr = PR * PAGE
        start, end, kv, items, chunk, it = _cursor_init(ids_ptr, ctx_ptr, first_end, first_off,
                                                        kv_cap, ITEM, ROWS_MAX, NW)
        seg = 0
        loaded = -1
        # Block ids, one per lane (every warp holds the whole window).
        bt_lay: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        offs_b = gl.arange(0, 32, layout=bt_lay)
        bt_seg = -1
        bt_base = 0
        blocks = gl.zeros([32], gl.int32, bt_lay)
        blocks_next = gl.zeros([32], gl.int32, bt_lay)
        for i in range(n_items):
            if i > 0:
                start, end, kv, items, chunk, it, seg = _cursor_step(
                    ids_ptr, ctx_ptr, num_rows, kv_cap, start, end, kv, items, chunk, it, seg,
                    q_full, q_empty, ITEM, ROWS_MAX, False, NW)
            if seg != loaded:
                qb = seg % 2
                mbarrier.wait(q_empty.index(qb), ((seg // 2) & 1) ^ 1)
                mbarrier.expect(q_full.index(qb), NG * q_desc.block_type.nbytes)
                for g in gl.static_range(NG):
                    if WIDE:
                        q_dst = q_smem.index(qb).slice(g * G, G)
                    else:
                        q_dst = q_smem.index(qb * NG + g)
                    _tma_load(q_desc, [start + chunk + g * G, 0, 0], q_full.index(qb), q_dst)
                loaded = seg
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            if WIDE:
                pages = (kv + PAGE - 1) // PAGE
            else:
                gl.static_assert(PR == 1)
                pages = items
            p0 = it * PR
            bt_seg, bt_base, blocks, blocks_next = _bt_window(
                bt_ptr, stride_bt, start, p0, pages, seg, bt_seg, bt_base, blocks, blocks_next,
                offs_b)
            mbarrier.expect(full.index(slot),
                            PR * (kv_desc.block_type.nbytes + sc_desc.block_type.nbytes))
            for j in gl.static_range(PR):
                if WIDE:
                    pj = gl.minimum(p0 + j, pages - 1)
                    kv_dst = kv_smem.index(slot).slice(j, 1)
                    sc_dst = sc_smem.index(slot).slice(j, 1)
                else:
                    pj = p0
                    kv_dst = kv_smem.index(slot)
                    sc_dst = sc_smem.index(slot)
                block = gl.sum(gl.where(offs_b == pj - bt_base, blocks, 0), axis=0)
                _tma_load(kv_desc, [block, 0, 0], full.index(slot), kv_dst)
                _tma_load(sc_desc, [block, SCALE_COL], full.index(slot), sc_dst)

    @gluon.jit
    def _wide_consumer(w_ptr, ctx_ptr, ids_ptr, out_ptr, num_rows, kv_cap, stride_w, stride_out,
                       n_items, first_end, first_off, kv_smem, sc_smem, q_smem, full, empty,
                       q_full, q_empty, started, WHICH: gl.constexpr, CONSUMERS: gl.constexpr,
                       H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                       ROWS_MAX: gl.constexpr, G: gl.constexpr, PR: gl.constexpr,
                       STAGES: gl.constexpr):
        """Math partition ``WHICH`` of ``CONSUMERS`` in the wide kernel: two
        warpgroups, items ``WHICH``, ``WHICH + CONSUMERS``, ...  An item is
        ``PR`` pages x ``NG`` row groups (``PR * NG == 2``) as one
        ``[PR * 64, NG * 128]`` wgmma tile, split so that each warpgroup holds
        one 64 x 128 accumulator (one page against one row group): the two
        run side by side, and each sums its own heads."""
        NG: gl.constexpr = ROWS_MAX // G
        M: gl.constexpr = PR * PAGE      # tokens per item (the tile's M)
        N: gl.constexpr = NG * G * H
        gl.static_assert(PR * NG == 2, "wide kernel: two warpgroups per item")
        gl.static_assert(STAGES % CONSUMERS == 0, "STAGES: a multiple of CONSUMERS (see launch)")
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4 * PR, NG], instr_shape=[16, G * H, 32])
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        zero = gl.zeros([M, N], gl.float32, mma_layout)
        out_layout: gl.constexpr = gl.sum(gl.reshape(zero, [M, ROWS_MAX, H]), axis=2).type.layout
        row_layout: gl.constexpr = gl.SliceLayout(0, out_layout)
        w = gl.zeros([N], gl.float32, col_layout)
        r_lim = gl.zeros([ROWS_MAX], gl.int32, row_layout)
        w_seg = -1
        _all_started(started)
        start, end, kv, items, chunk, it, seg, pos = _consumer_cursor(
            ids_ptr, ctx_ptr, num_rows, kv_cap, n_items, first_end, first_off, q_full, q_empty,
            WHICH, M, ROWS_MAX, 4 * PR * NG)
        for i in range(WHICH, n_items, CONSUMERS):
            start, end, kv, items, chunk, it, seg, pos = _next_item(
                ids_ptr, ctx_ptr, num_rows, kv_cap, start, end, kv, items, chunk, it, seg, pos,
                q_full, q_empty, i, WHICH, CONSUMERS, M, ROWS_MAX, 4 * PR * NG)
            slot = i % STAGES
            qb = seg % 2
            row0 = start + chunk
            if w_seg != seg:  # row limits and weights once per segment
                r_lim = _row_limits(ctx_ptr, row0, end, kv, ROWS_MAX, row_layout)
                w = _load_w(w_ptr, stride_w, row0, end, N, H, col_layout)
                w_seg = seg
            mbarrier.wait(q_full.index(qb), (seg // 2) & 1)
            mbarrier.wait(full.index(slot), (i // STAGES) & 1)
            a_tile = kv_smem.index(slot).reshape([M, D])
            sc_tile = sc_smem.index(slot).reshape([M])
            b_tile = q_smem.index(qb).reshape([N, D]).permute((1, 0))
            acc = warpgroup_mma(a_tile, b_tile, zero, use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _epilogue(acc, w, r_lim, sc_tile, out_ptr, stride_out, row0, it * M, ROWS_MAX, H, M,
                      out_layout)
            # Every read of the slot (wgmma, scale loads) is complete here.
            mbarrier.arrive(empty.index(slot), count=1)
        _cursor_finish(ids_ptr, ctx_ptr, num_rows, kv_cap, n_items, start, end, kv, items, chunk,
                       it, seg, pos, q_full, q_empty, M, ROWS_MAX, 4 * PR * NG)

    @gluon.jit(do_not_specialize=PER_STEP_INTS)
    def _varlen_logits_sm90_wide(
        kv_desc, sc_desc, q_desc, w_ptr, ctx_ptr, bt_ptr, ids_ptr, out_ptr, sched_ptr,
        num_rows, max_context_len, bt_width, stride_w, stride_bt, stride_out,
        H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, ROWS_MAX: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """The wide structure: the TMA producer in the default partition
        (``num_warps`` warps), two math partitions of two warpgroups each (one
        64 x 128 accumulator per warpgroup); an item is ``PR = 2 / NG`` pages of
        one row chunk (``NG``: row groups of ``ROWS_MAX``, 1 or 2)."""
        G: gl.constexpr = q_desc.block_type.shape[0]
        NG: gl.constexpr = ROWS_MAX // G
        gl.static_assert(NG * G == ROWS_MAX)
        gl.static_assert(NG <= 2, "wide kernel: at most two row groups per segment")
        PR: gl.constexpr = 2 // NG
        kv_cap = gl.minimum(max_context_len, bt_width * PAGE)
        n_items, first_end, first_off = _planned_share(sched_ptr)
        if n_items > 0:
            # A ring slot is one item: PR pages, read as one [PR * PAGE, D] tile
            # (the wgmma's A operand), and their scales as one [PR * PAGE] vector.
            kv_smem = gl.allocate_shared_memory(kv_desc.dtype, [STAGES, PR, PAGE, D],
                                                kv_desc.layout)
            sc_smem = gl.allocate_shared_memory(sc_desc.dtype, [STAGES, PR, PAGE], sc_desc.layout)
            q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, ROWS_MAX, H, D], q_desc.layout)
            full, empty, q_full, q_empty, started = _barriers(STAGES, 2)
            gl.warp_specialize([
                (_producer, (kv_desc, sc_desc, q_desc, bt_ptr, ids_ptr, ctx_ptr, num_rows,
                             kv_cap, stride_bt, n_items, first_end, first_off, kv_smem, sc_smem,
                             q_smem, full, empty, q_full, q_empty, started, PAGE, D, ROWS_MAX,
                             PR, STAGES, num_warps, True)),
                (_wide_consumer, (w_ptr, ctx_ptr, ids_ptr, out_ptr, num_rows, kv_cap, stride_w,
                                  stride_out, n_items, first_end, first_off, kv_smem, sc_smem,
                                  q_smem, full, empty, q_full, q_empty, started, 0, 2, H, D, PAGE,
                                  ROWS_MAX, G, PR, STAGES)),
                (_wide_consumer, (w_ptr, ctx_ptr, ids_ptr, out_ptr, num_rows, kv_cap, stride_w,
                                  stride_out, n_items, first_end, first_off, kv_smem, sc_smem,
                                  q_smem, full, empty, q_full, q_empty, started, 1, 2, H, D, PAGE,
                                  ROWS_MAX, G, PR, STAGES)),
            ], [4 * PR * NG, 4 * PR * NG], [CONSUMER_REGS, CONSUMER_REGS])

    @gluon.jit
    def _barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """The ring's full/empty mbarriers (one arrival each: the TMA bytes, or
        the one math partition that took the slot's item), the query double
        buffer's (each released by every math partition), and the start
        barrier (every worker partition checks in), initialised and fenced."""
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(full.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for s in gl.static_range(2):
            mbarrier.init(q_full.index(s), count=1)
            mbarrier.init(q_empty.index(s), count=CONSUMERS)
        started = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(started, count=CONSUMERS + 1)
        fence_async_shared()
        return full, empty, q_full, q_empty, started

    @gluon.jit
    def _idle():
        pass

    @gluon.jit
    def _all_started(started):
        """Every worker partition checks in before any does work: a partition
        that runs ahead could otherwise reuse scratch shared memory still holding
        another partition's captured arguments (seen on Triton 3.6 as bad
        pointers in the second math warpgroup)."""
        mbarrier.arrive(started, count=1)
        mbarrier.wait(started, 0)

    @gluon.jit(do_not_specialize=PER_STEP_INTS)
    def _varlen_logits_sm90(
        kv_desc, sc_desc, q_desc, w_ptr, ctx_ptr, bt_ptr, ids_ptr, out_ptr, sched_ptr,
        num_rows, max_context_len, bt_width, stride_w, stride_bt, stride_out,
        H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, ROWS_MAX: gl.constexpr,
        STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        DIRECT_STORE: gl.constexpr, num_warps: gl.constexpr,
    ):
        G: gl.constexpr = q_desc.block_type.shape[0]      # query rows per wgmma
        NG: gl.constexpr = ROWS_MAX // G                  # row groups per segment
        gl.static_assert(NG * G == ROWS_MAX)
        kv_cap = gl.minimum(max_context_len, bt_width * PAGE)
        n_items, first_end, first_off = _planned_share(sched_ptr)
        if n_items > 0:
            kv_smem = gl.allocate_shared_memory(kv_desc.dtype, [STAGES] + kv_desc.block_type.shape,
                                                kv_desc.layout)
            sc_smem = gl.allocate_shared_memory(sc_desc.dtype, [STAGES] + sc_desc.block_type.shape,
                                                sc_desc.layout)
            q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * NG] + q_desc.block_type.shape,
                                               q_desc.layout)
            full, empty, q_full, q_empty, started = _barriers(STAGES, CONSUMERS)
            # The default partition stays idle: every role runs in a worker
            # partition (work in the default partition was seen to corrupt the
            # workers' captured arguments on Triton 3.6, and a producer there
            # faulted with four math warpgroups: docs/design.md).
            if CONSUMERS == 2:
                gl.warp_specialize([
                    (_idle, ()),
                    (_consumer, (w_ptr, ctx_ptr, ids_ptr, out_ptr, num_rows, kv_cap, stride_w,
                                 stride_out, n_items, first_end, first_off, kv_smem, sc_smem, q_smem,
                                 full, empty, q_full, q_empty, started, 0, 2, H, D, PAGE, ROWS_MAX, G,
                                 STAGES, DIRECT_STORE)),
                    (_consumer, (w_ptr, ctx_ptr, ids_ptr, out_ptr, num_rows, kv_cap, stride_w,
                                 stride_out, n_items, first_end, first_off, kv_smem, sc_smem, q_smem,
                                 full, empty, q_full, q_empty, started, 1, 2, H, D, PAGE, ROWS_MAX, G,
                                 STAGES, DIRECT_STORE)),
                    (_producer, (kv_desc, sc_desc, q_desc, bt_ptr, ids_ptr, ctx_ptr, num_rows,
                                 kv_cap, stride_bt, n_items, first_end, first_off, kv_smem, sc_smem,
                                 q_smem, full, empty, q_full, q_empty, started, PAGE, D, ROWS_MAX, 1,
                                 STAGES, 1, False)),
                ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
            else:
                gl.static_assert(CONSUMERS == 1, "CONSUMERS: 1 or 2")
                gl.warp_specialize([
                    (_idle, ()),
                    (_consumer, (w_ptr, ctx_ptr, ids_ptr, out_ptr, num_rows, kv_cap, stride_w,
                                 stride_out, n_items, first_end, first_off, kv_smem, sc_smem, q_smem,
                                 full, empty, q_full, q_empty, started, 0, 1, H, D, PAGE, ROWS_MAX, G,
                                 STAGES, DIRECT_STORE)),
                    (_producer, (kv_desc, sc_desc, q_desc, bt_ptr, ids_ptr, ctx_ptr, num_rows,
                                 kv_cap, stride_bt, n_items, first_end, first_off, kv_smem, sc_smem,
                                 q_smem, full, empty, q_full, q_empty, started, PAGE, D, ROWS_MAX, 1,
                                 STAGES, 1, False)),
                ], [4, 1], [CONSUMER_REGS, 24])


# ----------------------------------------------------------------------- host


def layouts(heads: int):
    """Shared-memory layouts of the three TMA boxes (page values, page scales,
    one query group)."""
    kv = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)
    sc = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    q = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)
    return kv, sc, q


def rows_per_mma(heads: int) -> int:
    return MMA_N // heads


def descriptors(q, kv_cache):
    """TMA descriptors over the fused cache (values, scales) and the queries."""
    rows, _, heads, dim = q.shape
    blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    stride_b = kv_cache.stride(0)
    kv_l, sc_l, q_l = layouts(heads)
    values = kv_cache.view(torch.float8_e4m3fn)
    kv_desc = TensorDescriptor(values, [blocks, page, dim], [stride_b, dim, 1], [1, page, dim], kv_l)
    words = kv_cache.view(torch.float32)  # [blocks, page, 1, (D + 4) / 4]
    sc_desc = TensorDescriptor(words, [blocks, page * (dim + 4) // 4], [stride_b // 4, 1], [1, page],
                               sc_l)
    g = rows_per_mma(heads)
    q3 = q.view(torch.float8_e4m3fn)
    q_desc = TensorDescriptor(q3, [rows, heads, dim], [q.stride(0), dim, 1], [g, heads, dim], q_l)
    return kv_desc, sc_desc, q_desc


def unsupported_reason(q, kv_cache) -> str | None:
    """Why the sm_90 path cannot take these tensors (``None``: it can)."""
    if _MISSING is not None:
        return f"Triton {triton.__version__} lacks a Gluon piece ({_MISSING})"
    if not q.is_cuda or capability(q.device)[0] != 9:
        return "not an sm_90 GPU"
    if q.shape[2] not in HEADS or q.shape[3] != DIM or kv_cache.shape[1] != PAGE:
        return f"shape outside H {HEADS}, D {DIM}, page {PAGE}"
    if kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        return "cache page stride or base not 16-byte aligned (TMA)"
    if q.stride(0) % 16 or q.data_ptr() % 16:
        return "query row stride or base not 16-byte aligned (TMA)"
    return None


def rows_max_for(heads: int, max_run_len: int) -> int:
    """Query rows held per segment, from the host's longest-run hint: the
    smallest of 2, 4, 8 (at least one wgmma group) covering it.  Longer runs
    are split into chunks of this many rows (each chunk re-reads the pages)."""
    g = rows_per_mma(heads)
    for rows in (2, 4, 8):
        if rows >= g and rows >= max_run_len:
            return rows
    return 8


def variants(heads: int, max_run_lens=(1, 2, 4, 8)) -> list[int]:
    """``ROWS_MAX`` values a server with these run-length hints compiles."""
    return sorted({rows_max_for(heads, n) for n in max_run_lens})


_ARGS = ("kv_desc", "sc_desc", "q_desc", "w_ptr", "ctx_ptr", "bt_ptr", "ids_ptr", "out_ptr",
         "sched_ptr", "num_rows", "max_context_len", "bt_width", "stride_w", "stride_bt",
         "stride_out")
_PLAN_ARGS = ("ids_ptr", "ctx_ptr", "sched_ptr", "num_rows", "max_context_len", "bt_width")


def registers(consumers: int) -> tuple[int, int]:
    """(math warpgroup registers, launch registers) for ``consumers`` math warpgroups."""
    if consumers not in REGISTERS:
        raise ValueError(f"consumers: expected one of {sorted(REGISTERS)}, got {consumers}")
    return REGISTERS[consumers]


def takes_wide(heads: int, rows_max: int) -> bool:
    """The structure the launch takes by default (H200, docs/design.md):
    the wide one wherever a segment does not hold exactly two row groups (one
    group, as in 2-token steps at 64 heads, or runs chunked from more than two
    groups), the two-warpgroup one for two row groups per segment, where the
    wide one measured ~10 % slower."""
    return rows_max // rows_per_mma(heads) != 2


def wide_rows_max(heads: int, rows_max: int) -> int:
    """``rows_max`` as the wide structure holds it: at most two row groups per
    segment (longer runs are split into chunks of this many rows)."""
    return min(rows_max, 2 * rows_per_mma(heads))


def _structure(heads: int, rows_max: int, wide: bool | None) -> tuple[bool, int, int]:
    """(wide, rows held per segment, pages per item) of a launch."""
    wide = takes_wide(heads, rows_max) if wide is None else bool(wide)
    if not wide:
        return False, rows_max, 1
    held = wide_rows_max(heads, rows_max)
    return True, held, 2 // (held // rows_per_mma(heads))


def plan(indices, context_lens, max_context_len: int, bt_width: int, heads: int, rows_max: int,
         *, wide: bool | None = None, ctas_per_sm: int = CTAS_PER_SM):
    """The step's schedule for :func:`launch` (int32 ``[programs, SCHED_WORDS]``,
    one small launch on the main kernel's grid): every launch of the step with
    the same ids, context lengths, ``max_context_len``, block-table width,
    heads, ``rows_max`` and structure can take it (``launch(schedule=...)``)
    instead of scheduling in every program of every call.  Graph safe: written
    by the GPU, read by the GPU."""
    programs = num_sms(indices.device.index or 0) * ctas_per_sm
    sched = torch.empty((programs, SCHED_WORDS), dtype=torch.int32, device=indices.device)
    args = (indices, context_lens, sched, indices.shape[0], max_context_len, bt_width)
    launch_bound(_plan_sm90, (programs,), args, plan_constexprs(heads, rows_max, wide), {},
                 {"num_rows", "max_context_len", "bt_width"}, _PLAN_ARGS)
    return sched


def plan_constexprs(heads: int, rows_max: int, wide: bool | None = None) -> dict:
    """The planner's compile-time parameters for a launch's structure (in its
    parameter order), as :func:`plan` launches it and the compile check builds it."""
    _, held, pr = _structure(heads, rows_max, wide)
    return dict(PAGE=PAGE, PR=pr, ROWS_MAX=held, BLOCK_R=BLOCK_R, num_warps=4)


def schedule_key(indices, context_lens, max_context_len: int, bt_width: int, heads: int,
                 rows_max: int, capturing: bool) -> tuple:
    """What a planned schedule depends on, for a per-step cache: the step's
    tensors (by address: their contents are the step's), the integers, the
    structure, and whether a CUDA graph is being captured (a schedule planned
    outside a capture is not replayed by it, and one planned inside is only
    refreshed by the graph's replays)."""
    wide, held, pr = _structure(heads, rows_max, None)
    return (indices.data_ptr(), indices.shape[0], context_lens.data_ptr(), max_context_len,
            bt_width, wide, held, pr, heads, capturing)


def kernel_config(heads: int, rows_max: int, *, dim: int = DIM, page: int = PAGE,
                  stages: int | None = None, consumers: int = CONSUMERS,
                  consumer_regs: int | None = None, maxnreg: int | None = None,
                  direct_store: bool = DIRECT_STORE, wide: bool | None = None):
    """What a launch with these parameters compiles: ``(wide, kernel,
    constexprs in the kernel's parameter order, options)`` — the one source for
    :func:`launch` and the compile check.  Parameters as :func:`launch` takes
    them; refuses a ``rows_max`` or ring depth the kernels cannot take."""
    if rows_max % rows_per_mma(heads) or rows_max not in (2, 4, 8):
        raise ValueError(f"rows_max: expected 2, 4 or 8 and a multiple of {rows_per_mma(heads)} "
                         f"(query rows per wgmma at H {heads}), got {rows_max}")
    wide, held, _ = _structure(heads, rows_max, wide)
    stages = stages or (WIDE_STAGES if wide else STAGES)
    if stages % (2 if wide else consumers):
        # Item i + stages reuses item i's slot; its wait on the slot's full
        # barrier is a parity wait, which passes one phase early unless item
        # i's own phase has completed.  The consumer that took item i has waited
        # for it; another consumer may not have (TMA completions are unordered),
        # so a slot's items must all go to one consumer.
        raise ValueError(f"stages: expected a multiple of the math partitions "
                         f"({2 if wide else consumers}), got {stages}")
    regs, launch_regs = WIDE_REGISTERS if wide else registers(consumers)
    constexprs = dict(H=heads, D=dim, PAGE=page, STAGES=stages,
                      CONSUMER_REGS=consumer_regs or regs, num_warps=4, ROWS_MAX=held)
    if wide:
        kernel = _varlen_logits_sm90_wide
    else:
        kernel = _varlen_logits_sm90
        constexprs.update(CONSUMERS=consumers, DIRECT_STORE=bool(direct_store))
    # Launches bind constexprs by position after the runtime arguments: the
    # kernel's own parameter order.
    names = [a.name for a in kernel.params if a.is_constexpr]
    return (wide, kernel, {n: constexprs[n] for n in names},
            {"maxnreg": maxnreg or launch_regs})


def launch(q, kv_cache, weights, context_lens, block_table, indices, max_context_len, out, *,
           rows_max: int = 4, stages: int | None = None, ctas_per_sm: int = CTAS_PER_SM,
           consumers: int = CONSUMERS, consumer_regs: int | None = None,
           maxnreg: int | None = None, direct_store: bool = DIRECT_STORE,
           wide: bool | None = None, schedule=None):
    """Launch the sm_90 kernel on checked inputs (:mod:`.launcher` checks them);
    the grid depends on the GPU alone.  ``consumer_regs`` / ``maxnreg``
    (math-warpgroup and launch registers): ``None`` takes :data:`REGISTERS`
    for ``consumers`` (:data:`WIDE_REGISTERS` for the wide structure); a launch
    without a register cap is not offered (the partitions' setmaxnreg needs
    one).  ``wide`` (default :func:`takes_wide`): the wide structure, which
    holds at most two row groups per segment (:func:`wide_rows_max`) and
    ignores ``consumers`` and ``direct_store``.  ``schedule``: the step's
    :func:`plan` (made here, one more launch, when not given)."""
    rows, _, heads, dim = q.shape
    wide, kernel, constexprs, options = kernel_config(
        heads, rows_max, dim=dim, page=kv_cache.shape[1], stages=stages, consumers=consumers,
        consumer_regs=consumer_regs, maxnreg=maxnreg, direct_store=direct_store, wide=wide)
    grid = (num_sms(q.device.index or 0) * ctas_per_sm,)
    if schedule is None:
        schedule = plan(indices, context_lens, max_context_len, block_table.shape[1], heads,
                        rows_max, wide=wide, ctas_per_sm=ctas_per_sm)
    elif (schedule.dtype != torch.int32 or tuple(schedule.shape) != (grid[0], SCHED_WORDS)
          or schedule.device != q.device):
        raise ValueError(f"schedule: expected int32 [{grid[0]}, {SCHED_WORDS}] on {q.device} "
                         f"(plan()), got {schedule.dtype} {tuple(schedule.shape)} on "
                         f"{schedule.device}")
    kv_desc, sc_desc, q_desc = descriptors(q, kv_cache)
    args = (kv_desc, sc_desc, q_desc, weights, context_lens, block_table, indices, out, schedule,
            rows, max_context_len, block_table.shape[1],
            weights.stride(0), block_table.stride(0), out.stride(0))
    return launch_bound(kernel, grid, args, constexprs, options, set(PER_STEP_INTS), _ARGS)


def schedule_model(indices, context_lens, max_context_len: int, bt_width: int, rows_max: int,
                   num_programs: int, page: int = PAGE,
                   pages_per_item: int = 1) -> list[list[tuple[int, int, int, int]]]:
    """Host mirror of the kernel's device-side schedule, for tests: each
    program's work items as ``(run first row, run last row, row chunk, item)``.

    Items are every ``pages_per_item`` pages (the wide structure's ``PR``; a
    run's last item may hold fewer) of every row chunk (``rows_max`` rows) of
    every run; program ``c`` of ``n`` takes items ``[c * T // n, (c + 1) * T //
    n)`` of the ``T`` in run order.  Same arithmetic as ``_plan_sm90`` /
    ``_cursor_*`` (a run's KV length is its last row's context, clamped to
    ``[0, min(max_context_len, bt_width * page)]``)."""
    from .reference import run_spans

    item = page * pages_per_item
    runs = []
    for r, e, kv in run_spans(indices, context_lens, min(max_context_len, bt_width * page)):
        items = -(-kv // item)
        for chunk in range(0, e - r + 1, rows_max):
            for it in range(items):
                runs.append((r, e, chunk, it))
    total = len(runs)
    return [runs[c * total // num_programs:(c + 1) * total // num_programs]
            for c in range(num_programs)]
