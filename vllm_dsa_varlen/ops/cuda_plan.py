"""The sm_90 CUDA kernel's per-step schedule in one launch (``cuda/sm90_plan.cu``).

:func:`plan_device` writes the schedule that
:func:`vllm_dsa_varlen.ops.cuda_paged_mqa_logits.plan_torch` builds from some
forty small torch operations — the same ``table`` and ``ctas``, bit for bit —
from one launch of one CTA of 1024 threads: block-wide scans over the step's
rows (each thread a contiguous share of them), so any row count up to
:data:`MAX_ROWS` is one launch.  Graph safe: the grid is fixed and the shared
memory a function of the row count (:func:`stage_bytes`), nothing depends on
tensor contents; no host sync; into preallocated outputs when given.  The
launcher precomputes what the kernel would otherwise divide for (a page's cost
per chunk size, :func:`magic` numbers; :func:`kernel_args`).  One build per
head count of the logits kernel (:data:`HEAD_COUNTS`): the head count sets its
chunk, two row groups of ``128 // heads`` rows (:func:`chunk_rows`: 4 rows at
64 heads, 8 at 32), and a page's cost per chunk size (:func:`page_cost`).
Compiled by NVRTC and loaded through the driver like the logits kernel, once
per process, device and head count (:func:`load`; ``precompile`` reaches it
through the launcher's first plan).
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from . import cuda_binding as cb
from .common import PAGE, num_sms

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "sm90_plan.cu")
KERNEL_NAME = b"plan_sm90"
THREADS = 1024
MAX_PROGRAMS = THREADS   # one thread per CTA of the logits kernel in the last step
STAGE_ROWS = 8192        # steps of up to this many rows are staged in shared memory
TABLE_ROWS = 4096        # steps of up to this many rows build the table in shared memory
MAX_ROWS = THREADS * 32  # rows per thread: one bit each in a 32-bit mask
_INT32_MAX = 2**31 - 1

HEADS = 64               # the default build (no macro)
HEAD_COUNTS = (64, 32)   # the builds: HEADS=<h>, as the logits kernel's
TABLE_WORDS = 8          # int32 per segment row of the plan
CTA_WORDS = 4            # int32 per CTA: first segment, item range [lo, hi)

# A page's cost for the schedule's balance, c0 + c1 * rows + c2 * row groups of
# its chunk (page_cost): the CTAs' shares are equal in cost, not in pages, so a
# CTA that draws long runs does not finish last.  Each row group runs one full
# wgmma (a chunk's odd last row too), the epilogue follows the rows; the
# weights follow the kernel's measured cycles per page (docs/design.md).
COST = (3, 1, 4)

_lock = threading.Lock()
_LOADED: dict = {}
_PARAMS: dict = {}  # (heads, cost, programs) -> _Params

# Both run on every launch (module names, so a test can stand in for them).
_stream = cb.current_stream
_current_device = cb.current_device


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


def group_rows(heads: int) -> int:
    """Rows of one of the logits kernel's row groups at ``heads`` heads (its
    wgmma's 128 columns are rows x heads): 2 at 64 heads, 4 at 32."""
    if heads not in HEAD_COUNTS:
        _fail("heads", " or ".join(map(str, HEAD_COUNTS)), heads)
    return 128 // heads


def chunk_rows(heads: int) -> int:
    """Rows per chunk at ``heads`` heads: the logits kernel's two row groups
    (the planner's ``ROWS_MAX``; ``cuda_paged_mqa_logits.rows_max_for``)."""
    return 2 * group_rows(heads)


def defines_for(heads: int) -> tuple[str, ...]:
    """The build's macros at ``heads`` heads (the default build takes none)."""
    group_rows(heads)
    return () if heads == HEADS else (f"HEADS={heads}",)


def compile_cubin(arch: str = cb.ARCH, extra: tuple = (), heads: int = HEADS
                  ) -> tuple[bytes, str]:
    """The planner's build for ``heads`` heads by NVRTC (no GPU needed):
    ``(cubin, log)``."""
    macros = tuple(f"-D{d}" for d in defines_for(heads))
    return cb.compile_source(SOURCE, arch, macros + tuple(extra))


class _Loaded:
    """The planner's build for ``heads`` loaded in one device's primary
    context (driver handles)."""

    def __init__(self, device: torch.device, heads: int):
        cubin, _ = compile_cubin(heads=heads)
        most = max(stage_bytes(TABLE_ROWS), stage_bytes(STAGE_ROWS))
        self.fn, self.ctx, self.module = cb.load_function(cb.driver(), device, cubin,
                                                          KERNEL_NAME, most)


def stage_bytes(rows: int) -> int:
    """Dynamic shared memory of a step of ``rows`` rows (the kernel's layout):
    its ids and context lengths (one padding word per 32) when it has up to
    :data:`STAGE_ROWS`, and its table (one padding 16-byte slot per 8) when
    up to :data:`TABLE_ROWS`; none above (global memory).  A function of the
    shape alone: graph safe."""
    if rows > STAGE_ROWS:
        return 0
    words = (2 * (rows + rows // 32 + 1) + 3) & ~3
    last = 2 * rows - 1  # the table's last 16-byte chunk
    slots = last + (last >> 3) + 1 if rows and rows <= TABLE_ROWS else 0
    return 4 * words + 16 * slots


def magic(d: int) -> int:
    """floor((2^64 - 1) / d): the kernel divides by ``d`` with a multiply."""
    return (2**64 - 1) // d


def load(device, heads: int = HEADS) -> _Loaded:
    """Compile (NVRTC) and load the planner's build for ``heads`` heads on
    ``device`` once per process."""
    group_rows(heads)
    return cb.load_once(_LOADED, _lock, device, heads, _Loaded)


def allocate(rows: int, programs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Output buffers for :func:`plan_device`: ``(table int32 [rows, 8], ctas
    int32 [programs, 4])``."""
    return (torch.empty((rows, TABLE_WORDS), dtype=torch.int32, device=device),
            torch.empty((programs, CTA_WORDS), dtype=torch.int32, device=device))


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _int32_rows(t: torch.Tensor, name: str, rows: int) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.shape[0] != rows:
        _fail(name, f"{rows} values (one per row)", tuple(t.shape))
    if flat.dtype != torch.int32:
        if flat.dtype.is_floating_point or flat.dtype == torch.bool:
            _fail(name, "an integer tensor", flat.dtype)
        flat = flat.to(torch.int32)
    return flat if flat.stride(0) == 1 else flat.contiguous()


def kernel_args(ids: int, ctx: int, rows: int, max_context_len: int, bt_width: int,
                programs: int, table: int, ctas: int, *, heads: int = HEADS, cost=COST,
                cut_items: int = 0) -> dict:
    """The kernel's parameters by name, in its order (``plan_sm90`` in the
    source; a test reads the signature there and compares), as the ctypes
    values ``cuLaunchKernel`` copies: the addresses of the ids, context
    lengths, table and ctas (given as ints), the row count, the KV lengths'
    cap (the least of ``max_context_len``, ``bt_width`` pages and int32's
    largest), the CTA count, ``cut_items`` (plan_torch's: 0, or the most
    items a step has where runs are cut to row groups); ``unit``: a page's
    cost in a chunk of 1 .. :func:`chunk_rows` rows (:func:`page_cost` with
    the head count's row groups; the source's ``ByRows<i64>``); ``magic_p``, ``magic``:
    :func:`magic` of the CTA count and of each cost."""
    group = group_rows(heads)
    units = [page_cost(cost, n, group) for n in range(1, 2 * group + 1)]
    cap = min(int(max_context_len), int(bt_width) * PAGE, _INT32_MAX)
    c = ctypes
    return {"ids_g": c.c_uint64(ids), "ctx_g": c.c_uint64(ctx), "rows": c.c_int32(rows),
            "cap": c.c_int32(cap), "programs": c.c_int32(programs),
            "cut_items": c.c_int32(min(max(int(cut_items), 0), _INT32_MAX)),
            "unit": (c.c_int64 * len(units))(*units), "magic_p": c.c_uint64(magic(programs)),
            "magic": (c.c_uint64 * len(units))(*[magic(u) for u in units]),
            "table": c.c_uint64(table), "ctas": c.c_uint64(ctas)}


class _Params(cb.ParamBlock):
    """The planner's parameter block for one (head count, cost, CTA count):
    :func:`kernel_args`' values made once (the page costs and the magic
    numbers are fixed by these).  A launch sets only the addresses, the row
    count and the KV cap (:meth:`set`)."""

    __slots__ = ()

    def __init__(self, heads: int, cost, programs: int, cut_items: int = 0):
        super().__init__(kernel_args(0, 0, 0, 0, 0, programs, 0, 0, heads=heads, cost=cost,
                                     cut_items=cut_items))

    def set(self, ids: int, ctx: int, rows: int, max_context_len: int, bt_width: int,
            table: int, ctas: int) -> None:
        """This launch's values (as :func:`kernel_args` makes them)."""
        v = self.vals
        v["ids_g"].value, v["ctx_g"].value = ids, ctx
        v["rows"].value = rows
        v["cap"].value = min(int(max_context_len), int(bt_width) * PAGE, _INT32_MAX)
        v["table"].value, v["ctas"].value = table, ctas


def _params(heads: int, cost, programs: int, cut_items: int = 0) -> _Params:
    key = (heads, tuple(cost), programs, cut_items)
    got = _PARAMS.get(key)
    if got is None:
        with _lock:
            got = _PARAMS.get(key)
            if got is None:
                got = _PARAMS[key] = _Params(heads, cost, programs, cut_items)
    return got


def _int32_address(t: torch.Tensor, name: str, rows: int) -> tuple[int, torch.Tensor | None]:
    """``t``'s data address as ``rows`` contiguous int32 values (any shape
    holding one value per row, e.g. ``[R]`` or ``[R, 1]``) without a view;
    another integer dtype or layout is converted first (the converted tensor
    is returned so it outlives the launch)."""
    if t.dtype == torch.int32 and t.numel() == rows and t.is_contiguous():
        return t.data_ptr(), None
    flat = _int32_rows(t, name, rows)
    return flat.data_ptr(), flat


def plan_device(indices, context_lens, max_context_len: int, bt_width: int, *,
                heads: int = HEADS, programs: int | None = None, cost=COST, out=None,
                cut_items: int = 0):
    """The step's schedule (``table int32 [R, 8]``, ``ctas int32 [programs,
    4]``; layout in :func:`cuda_paged_mqa_logits.plan_torch`) from one launch
    on the current stream.  ``indices``, ``context_lens``: the rows' run ids
    (int32) and context lengths (int32; other integers are converted, one more
    op) on the GPU, at most :data:`MAX_ROWS` rows; ``heads``: the logits
    kernel's (:data:`HEAD_COUNTS`; it sets the chunk); ``programs``: the
    logits kernel's grid (default: the device's SMs, at most
    :data:`MAX_PROGRAMS`); ``cost``: :data:`cuda_paged_mqa_logits.COST`'s
    form; ``out``: the two output tensors (e.g. :func:`allocate`'s), written
    in place; ``cut_items``: :func:`cuda_paged_mqa_logits.plan_torch`'s."""
    group_rows(heads)
    if not indices.is_cuda:
        _fail("indices", "a CUDA tensor", indices.device)
    dev = indices.device
    rows = indices.numel()
    if indices.dtype != torch.int32:
        _fail("indices", "int32 run ids", indices.dtype)
    if rows > MAX_ROWS:
        _fail("indices", f"at most {MAX_ROWS} rows", rows)
    ids, ids_kept = _int32_address(indices, "indices", rows)
    if context_lens.device != dev:
        _fail("context_lens", f"a tensor on {dev}", context_lens.device)
    ctx, ctx_kept = _int32_address(context_lens, "context_lens", rows)
    if programs is None:
        programs = num_sms(dev)
    if not 1 <= programs <= MAX_PROGRAMS:
        _fail("programs", f"1 to {MAX_PROGRAMS}", programs)
    if max_context_len < 0:
        _fail("max_context_len", ">= 0", max_context_len)
    if bt_width < 0:
        _fail("bt_width", ">= 0", bt_width)
    if out is None:
        table, ctas = allocate(rows, programs, dev)
    else:
        table, ctas = out
        for name, t, shape in (("table", table, (rows, TABLE_WORDS)),
                               ("ctas", ctas, (programs, CTA_WORDS))):
            if (t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous()
                    or t.device != dev or t.data_ptr() % 16):
                _fail("out", f"{name} contiguous int32 {list(shape)} on {dev}, 16-byte aligned",
                      f"{t.dtype} {tuple(t.shape)} on {t.device}")
    kern = load(dev, heads)
    if not isinstance(cut_items, int) or isinstance(cut_items, bool) or cut_items < 0:
        _fail("cut_items", "an int >= 0", cut_items)
    block = _params(heads, cost, programs, cut_items)
    index = dev.index if dev.index is not None else _current_device()
    with block.lock:
        block.set(ids, ctx, rows, max_context_len, bt_width, table.data_ptr(), ctas.data_ptr())
        if _current_device() == index:
            _launch(kern, rows, _stream(index), block.addr)
        else:
            with torch.cuda.device(index):
                _launch(kern, rows, _stream(index), block.addr)
    # converted copies lived until the launch was queued: their memory is
    # reused only by work queued after it on this stream
    del ids_kept, ctx_kept
    return table, ctas


def _launch(kern: _Loaded, rows: int, stream: int, params_addr: int) -> None:
    cb.launch_function(cb.driver(), kern.fn, kern.ctx, 1, THREADS, stage_bytes(rows), stream,
                       params_addr)
