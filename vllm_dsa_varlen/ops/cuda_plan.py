"""The sm_90 CUDA kernel's per-step schedule in one launch (``cuda/sm90_plan.cu``).

:func:`plan_device` writes the schedule that
:func:`vllm_dsa_varlen.ops.cuda_paged_mqa_logits.plan_torch` builds from some
forty small torch operations — the same ``table`` and ``ctas``, bit for bit —
from one launch of one CTA of 1024 threads: block-wide scans over the step's
rows (each thread a contiguous share of them), so any row count is one launch
with a fixed grid and fixed shared memory.  Graph safe (nothing about the
launch depends on tensor contents), no host sync, into preallocated outputs
when given.  Compiled by NVRTC and loaded through the driver like the logits
kernel, once per process and device (:func:`load`; ``precompile`` does it at
start-up through the launcher).
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from . import cuda_paged_mqa_logits as ck

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "sm90_plan.cu")
KERNEL_NAME = b"plan_sm90"
THREADS = 1024
MAX_PROGRAMS = THREADS   # one thread per CTA of the logits kernel in the last step
_INT32_MAX = 2**31 - 1

_lock = threading.Lock()
_LOADED: dict = {}


def compile_cubin(arch: str = ck.ARCH, extra: tuple = ()) -> tuple[bytes, str]:
    """The planner built by NVRTC (no GPU needed): ``(cubin, log)``."""
    return ck.compile_cubin(arch, extra, path=SOURCE)


class _Loaded:
    """The planner loaded in one device's primary context."""

    def __init__(self, device: torch.device):
        cubin, _ = compile_cubin()
        drv = ck._driver()
        with torch.cuda.device(device):
            torch.cuda.init()
            torch.empty(1, device=device)  # the primary context is current
            self.module = ctypes.c_void_p()
            ck._ck(drv.cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
            self.fn = ctypes.c_void_p()
            ck._ck(drv.cuModuleGetFunction(ctypes.byref(self.fn), self.module, KERNEL_NAME),
                   "cuModuleGetFunction")


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
    return (torch.empty((rows, ck.TABLE_WORDS), dtype=torch.int32, device=device),
            torch.empty((programs, ck.CTA_WORDS), dtype=torch.int32, device=device))


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
                programs: int | None = None, cost=ck.COST, out=None):
    """The step's schedule (``table int32 [R, 8]``, ``ctas int32 [programs,
    4]``; layout in :func:`cuda_paged_mqa_logits.plan_torch`) from one launch
    on the current stream.  ``indices``, ``context_lens``: the rows' run ids (int32)
    and context lengths (int32; other integers are converted, one more op) on
    the GPU;
    ``programs``: the logits kernel's grid (default: the device's SMs, at most
    :data:`MAX_PROGRAMS`); ``cost``: :data:`cuda_paged_mqa_logits.COST`'s form;
    ``out``: the two output tensors (e.g. :func:`allocate`'s), written in
    place."""
    if not indices.is_cuda:
        _fail("indices", "a CUDA tensor", indices.device)
    dev = indices.device
    rows = indices.numel()
    if indices.dtype != torch.int32:
        _fail("indices", "int32 run ids", indices.dtype)
    ids = _int32_rows(indices, "indices", rows)
    ctx = _int32_rows(context_lens, "context_lens", rows)
    if ctx.device != dev:
        _fail("context_lens", f"a tensor on {dev}", ctx.device)
    if programs is None:
        programs = ck._num_sms(dev)
    if not 1 <= programs <= MAX_PROGRAMS:
        _fail("programs", f"1 to {MAX_PROGRAMS}", programs)
    if max_context_len < 0:
        _fail("max_context_len", ">= 0", max_context_len)
    if bt_width < 0:
        _fail("bt_width", ">= 0", bt_width)
    c0, c1, c2 = ck._cost3(cost)
    cap = min(int(max_context_len), int(bt_width) * ck.PAGE, _INT32_MAX)
    if out is None:
        table, ctas = allocate(rows, programs, dev)
    else:
        table, ctas = out
        for name, t, shape in (("table", table, (rows, ck.TABLE_WORDS)),
                               ("ctas", ctas, (programs, ck.CTA_WORDS))):
            if (t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous()
                    or t.device != dev or t.data_ptr() % 16):
                _fail("out", f"{name} contiguous int32 {list(shape)} on {dev}, 16-byte aligned",
                      f"{t.dtype} {tuple(t.shape)} on {t.device}")
    kern = load(dev)
    vals = [ctypes.c_uint64(ids.data_ptr()), ctypes.c_uint64(ctx.data_ptr()),
            ctypes.c_int32(rows), ctypes.c_int32(cap), ctypes.c_int32(programs),
            ctypes.c_int64(c0), ctypes.c_int64(c1), ctypes.c_int64(c2),
            ctypes.c_uint64(table.data_ptr()), ctypes.c_uint64(ctas.data_ptr())]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                                             for v in vals])
    stream = torch.cuda.current_stream(dev).cuda_stream
    with torch.cuda.device(dev):
        ck._ck(ck._driver().cuLaunchKernel(kern.fn, 1, 1, 1, THREADS, 1, 1, 0,
                                           ctypes.c_void_p(stream), params, None),
               "cuLaunchKernel")
    return table, ctas
