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
per chunk size, :func:`magic` numbers).  Compiled by NVRTC and loaded through
the driver like the logits kernel, once per process and device (:func:`load`;
``precompile`` reaches it through the launcher's first plan).
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

CHUNK_ROWS = 4           # rows per chunk of the 64-head logits kernel (its ROWS_MAX)
TABLE_WORDS = 8          # int32 per segment row of the plan
CTA_WORDS = 4            # int32 per CTA: first segment, item range [lo, hi)

# A page's cost for the schedule's balance, c0 + c1 * rows + c2 * row groups of
# its chunk (page_cost): the CTAs' shares are equal in cost, not in pages, so a
# CTA that draws long runs does not finish last.  Each row group runs one full
# wgmma (a chunk's odd last row too), the epilogue follows the rows; from the
# H200 (call 48, cycles per page): ~610 with two rows, ~960 with three, ~1040
# with four.
COST = (3, 1, 4)

_lock = threading.Lock()
_LOADED: dict = {}


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


def compile_cubin(arch: str = cb.ARCH, extra: tuple = ()) -> tuple[bytes, str]:
    """The planner built by NVRTC (no GPU needed): ``(cubin, log)``."""
    return cb.compile_source(SOURCE, arch, extra)


class _Loaded:
    """The planner loaded in one device's primary context (driver handles)."""

    def __init__(self, device: torch.device):
        cubin, _ = compile_cubin()
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


def load(device) -> _Loaded:
    """Compile (NVRTC) and load the planner for ``device`` once per process."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    got = _LOADED.get(index)
    if got is None:
        with _lock:
            got = _LOADED.get(index)
            if got is None:
                got = _LOADED[index] = _Loaded(torch.device("cuda", index))
    return got


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


def plan_device(indices, context_lens, max_context_len: int, bt_width: int, *,
                programs: int | None = None, cost=COST, out=None):
    """The step's schedule (``table int32 [R, 8]``, ``ctas int32 [programs,
    4]``; layout in :func:`cuda_paged_mqa_logits.plan_torch`) from one launch
    on the current stream.  ``indices``, ``context_lens``: the rows' run ids
    (int32) and context lengths (int32; other integers are converted, one more
    op) on the GPU, at most :data:`MAX_ROWS` rows; ``programs``: the logits
    kernel's grid (default: the device's SMs, at most :data:`MAX_PROGRAMS`);
    ``cost``: :data:`cuda_paged_mqa_logits.COST`'s form; ``out``: the two
    output tensors (e.g. :func:`allocate`'s), written in place."""
    if not indices.is_cuda:
        _fail("indices", "a CUDA tensor", indices.device)
    dev = indices.device
    rows = indices.numel()
    if indices.dtype != torch.int32:
        _fail("indices", "int32 run ids", indices.dtype)
    if rows > MAX_ROWS:
        _fail("indices", f"at most {MAX_ROWS} rows", rows)
    ids = _int32_rows(indices, "indices", rows)
    ctx = _int32_rows(context_lens, "context_lens", rows)
    if ctx.device != dev:
        _fail("context_lens", f"a tensor on {dev}", ctx.device)
    if programs is None:
        programs = num_sms(dev)
    if not 1 <= programs <= MAX_PROGRAMS:
        _fail("programs", f"1 to {MAX_PROGRAMS}", programs)
    if max_context_len < 0:
        _fail("max_context_len", ">= 0", max_context_len)
    if bt_width < 0:
        _fail("bt_width", ">= 0", bt_width)
    units = [page_cost(cost, n) for n in range(1, CHUNK_ROWS + 1)]
    cap = min(int(max_context_len), int(bt_width) * PAGE, _INT32_MAX)
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
    kern = load(dev)
    vals = [ctypes.c_uint64(ids.data_ptr()), ctypes.c_uint64(ctx.data_ptr()),
            ctypes.c_int32(rows), ctypes.c_int32(cap), ctypes.c_int32(programs),
            *[ctypes.c_int64(u) for u in units], ctypes.c_uint64(magic(programs)),
            *[ctypes.c_uint64(magic(u)) for u in units],
            ctypes.c_uint64(table.data_ptr()), ctypes.c_uint64(ctas.data_ptr())]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                                             for v in vals])
    with torch.cuda.device(dev):
        cb.launch_function(cb.driver(), kern.fn, kern.ctx, 1, THREADS, stage_bytes(rows),
                           torch.cuda.current_stream(dev).cuda_stream, ctypes.addressof(params))
    return table, ctas
