"""The indexer's decode top-k over many CTAs per row (``cuda/row_select.cu``).

:func:`select_topk` meets the contract of :func:`.cuda_topk.decode_topk`
(int32 ``[R, k]``; a row with ``length <= k`` gets ``0 .. length - 1`` then
``-1``) and a stricter one: of the logits tied at the k-th value it takes the
lowest columns, so the selected set is :func:`.reference.topk_first_ties`'s
and the output is bitwise the same on every run.  Two launches, each reading
the logits once: a per-row histogram of the keys' top 11 bits, then the
select (the source says how); or one, the select, where the logits kernel's
``ROW_HIST=1`` build counted the histograms while it wrote the logits
(``counted``: a :func:`workspace` zeroed before it).

Graph safe: the build (columns per thread), grid and workspace follow from
the logits' shape; the workspace is zeroed by the caching allocator's
``torch.zeros`` on the current stream; no host sync.  Compiled by NVRTC and
loaded through the driver (:mod:`.cuda_binding`) once per process, device and
build.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from . import cuda_binding as cb
from . import cuda_topk as ct
from .common import num_sms

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "row_select.cu")
THREADS = 512
BINS = 2048
CAP = 8192                    # listed candidates per row (the source's CAP)
ITEMS_BUILDS = (4, 8, 16)     # columns per thread: a CTA's slice is THREADS * ITEMS
CTAS_PER_SM = 2               # the source's __launch_bounds__

_lock = threading.Lock()
_LOADED: dict = {}


def slices(width: int, items: int) -> int:
    """CTAs per row: slices of ``THREADS * items`` columns over ``width``."""
    return max(1, -(-int(width) // (THREADS * items)))


def plan_items(rows: int, width: int, sms: int) -> int:
    """Columns per thread for ``rows`` rows of ``width`` columns on ``sms``
    SMs (shape facts only): the fewest that still keep the grid within one
    wave (``CTAS_PER_SM`` CTAs an SM), else the most (fewest CTAs, each
    finding the row's threshold once)."""
    for items in ITEMS_BUILDS:
        if rows * slices(width, items) <= CTAS_PER_SM * sms:
            return items
    return ITEMS_BUILDS[-1]


def compile_cubin(items: int, extra: tuple = ()) -> tuple[bytes, str]:
    """The build of ``items`` columns per thread by NVRTC (no GPU needed):
    ``(cubin, log)``."""
    return cb.compile_source(SOURCE, cb.ARCH, (f"-DITEMS={int(items)}", *extra))


class _Loaded:
    def __init__(self, device: torch.device, items: int):
        cubin, _ = compile_cubin(items)
        drv = cb.driver()
        self.hist, self.ctx, self.hist_module = cb.load_function(drv, device, cubin,
                                                                 b"row_hist", 0)
        self.select, _, self.select_module = cb.load_function(drv, device, cubin,
                                                              b"row_select", 0)


def load(device, items: int) -> _Loaded:
    """Compile and load both kernels of a build on ``device``, once per
    process."""
    if items not in ITEMS_BUILDS:
        raise ValueError(f"items: expected one of {ITEMS_BUILDS}, got {items!r}")
    return cb.load_once(_LOADED, _lock, device, items, _Loaded)


def hist_args(logits: int, row_stride: int, lens: int, width: int, k: int, slices_: int,
              hist: int) -> dict:
    """``row_hist``'s parameters by name, in its order, as ctypes values."""
    c = ctypes
    return {"logits": c.c_uint64(logits), "row_stride": c.c_int64(row_stride),
            "lens": c.c_uint64(lens), "width": c.c_int32(width), "k": c.c_int32(k),
            "slices": c.c_int32(slices_), "hist": c.c_uint64(hist)}


def select_args(logits: int, row_stride: int, lens: int, width: int, k: int, slices_: int,
                hist: int, status: int, tickets: int, cand_keys: int, cand_cols: int,
                out: int, out_stride: int) -> dict:
    """``row_select``'s parameters by name, in its order, as ctypes values."""
    c = ctypes
    return {"logits": c.c_uint64(logits), "row_stride": c.c_int64(row_stride),
            "lens": c.c_uint64(lens), "width": c.c_int32(width), "k": c.c_int32(k),
            "slices": c.c_int32(slices_), "hist": c.c_uint64(hist),
            "status": c.c_uint64(status), "tickets": c.c_uint64(tickets),
            "cand_keys": c.c_uint64(cand_keys), "cand_cols": c.c_uint64(cand_cols),
            "out": c.c_uint64(out), "out_stride": c.c_int64(out_stride)}


def workspace_words(rows: int, slices_: int) -> int:
    """int32 words of the zeroed workspace: the rows' histograms (``rows x
    BINS``), their tickets, one pad word where that count is odd, then two
    words per row and slice (the slices' published counts, 8-byte aligned)."""
    head = rows * (BINS + 1)
    return head + (head & 1) + 2 * rows * slices_


def workspace(rows: int, width: int, device, items: int | None = None) -> torch.Tensor:
    """A zeroed workspace (int32) for :func:`select_topk` on ``rows`` rows of
    ``width`` columns (``items`` as it will be given; ``None``: the plan's)
    on ``device``: its first ``rows x BINS`` words (:func:`histograms`) are
    what a ``ROW_HIST=1`` build of the logits kernel counts into."""
    device = torch.device(device)
    if items is None:
        index = device.index if device.index is not None else cb.current_device()
        items = plan_items(rows, width, num_sms(index))
    return torch.zeros(workspace_words(rows, slices(width, items)), dtype=torch.int32,
                       device=device)


def histograms(ws: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows' histograms in a :func:`workspace`: int32 ``[rows, BINS]``."""
    return ws[:rows * BINS].view(rows, BINS)


def select_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int,
                out: torch.Tensor | None = None, items: int | None = None,
                counted: torch.Tensor | None = None) -> torch.Tensor:
    """The columns of each row's ``k`` largest logits (ties: the lowest
    columns), int32 ``[R, k]``, on the current stream.  ``logits``: float32
    ``[R, W]`` on an sm_90 GPU, unit column stride; ``lengths``: ``R``
    integers in any shape (clamped to ``[0, W]``); ``out``: int32 ``[R, k]``,
    unit column stride, written in place; ``items``: one of
    :data:`ITEMS_BUILDS`, ``None`` for :func:`plan_items`'s; ``counted``: a
    :func:`workspace` made for this call whose histograms the logits kernel
    counted while it wrote ``logits`` (a ``ROW_HIST=1`` build): one launch,
    else two (the histograms first).  ``ValueError`` naming the argument for
    bad input."""
    if not isinstance(logits, torch.Tensor) or not logits.is_cuda:
        ct._fail("logits", "a CUDA tensor", getattr(logits, "device", type(logits)))
    flat = ct.check_args(logits, lengths, k, out)
    if items is not None and (isinstance(items, bool) or items not in ITEMS_BUILDS):
        ct._fail("items", f"one of {ITEMS_BUILDS} or None", items)
    rows, width = logits.shape
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=logits.device)
    if rows == 0:
        return out
    index = logits.device.index
    if index is None:
        index = cb.current_device()
    if items is None:
        items = plan_items(rows, width, num_sms(index))
    s = slices(width, items)
    words = workspace_words(rows, s)
    if counted is None:
        ws = torch.zeros(words, dtype=torch.int32, device=logits.device)
    elif (not isinstance(counted, torch.Tensor) or counted.dtype != torch.int32
          or counted.device != logits.device or counted.dim() != 1
          or counted.numel() < words or not counted.is_contiguous()):
        ct._fail("counted", f"a workspace() of >= {words} int32 on {logits.device}",
                 f"{getattr(counted, 'dtype', type(counted))} "
                 f"{tuple(getattr(counted, 'shape', ()))}")
    else:
        ws = counted
    kern = load(torch.device("cuda", index), items)
    hist = ws.data_ptr()
    tickets = hist + 4 * BINS * rows
    head = rows * (BINS + 1)
    status = hist + 4 * (head + (head & 1))
    cand = torch.empty(2 * rows * CAP, dtype=torch.int32, device=logits.device)
    grid = rows * s
    sp = cb.ParamBlock(select_args(logits.data_ptr(), logits.stride(0), flat.data_ptr(), width, k,
                                   s, hist, status, tickets, cand.data_ptr(),
                                   cand.data_ptr() + 4 * rows * CAP, out.data_ptr(),
                                   out.stride(0) if rows > 1 else k))
    stream = cb.current_stream(index)
    drv = cb.driver()
    with torch.cuda.device(index):
        if counted is None:
            hp = cb.ParamBlock(hist_args(logits.data_ptr(), logits.stride(0), flat.data_ptr(),
                                         width, k, s, hist))
            cb.launch_function(drv, kern.hist, kern.ctx, grid, THREADS, 0, stream, hp.addr)
        cb.launch_function(drv, kern.select, kern.ctx, grid, THREADS, 0, stream, sp.addr)
    return out
