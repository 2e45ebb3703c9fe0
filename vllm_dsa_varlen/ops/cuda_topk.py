"""The indexer's decode top-k in one launch (``cuda/decode_topk.cu``).

:func:`decode_topk` writes, per row, the columns of the ``k`` largest
logits among the row's first ``lengths[r]`` (an exact radix select, each
row over a cluster of 1, 2 or 4 CTAs; the source says how), the contract of vLLM's
decode top-k ops (``persistent_topk``, ``cooperative_topk``): int32
``[R, k]``, no order, a row with ``length <= k`` gets ``0 .. length - 1`` and
then ``-1``; ties at the k-th value broken arbitrarily.
:func:`.reference.topk_ref` defines it.

Graph safe: the build (CTAs per row, threads per CTA, the candidate list or
none, registers per thread), the grid and the shared memory follow from
shape facts and an optional host bound on the lengths (:func:`launch_plan`,
:func:`stage_for`), nothing from tensor contents; no host sync.  The result
is right for any lengths (a slice longer than the stage is read from global
memory in every pass); only the speed depends on the plan.  Lengths past the width are clamped to it, negative
ones to 0 (the kernel cannot raise).  Compiled by NVRTC and loaded through
the driver (:mod:`.cuda_binding`) once per process, device and build.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import torch

from . import cuda_binding as cb
from .common import num_sms

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "decode_topk.cu")
KERNEL_NAME = b"decode_topk"
THREADS = 1024
BINS = 2048
BARS = 16                            # mbarriers, one per CHUNK staged columns
CHUNK = 4096
HEADER_BYTES = 4 * (BINS + 2 * 32 + 16) + 8 * BARS  # histogram, scan scratch, words, barriers
CAND = 4096                          # listed candidates after the stage: keys, then columns
MAX_SMEM = 227 * 1024                # sm_90's dynamic shared memory per CTA
SM_SMEM = 228 * 1024                 # shared memory per SM (each CTA also takes 1 KB)
MAX_STAGE = (MAX_SMEM - HEADER_BYTES - 8 * CAND) // 16 * 4  # staged columns, a multiple of 4
MAX_STAGE_UNLISTED = (MAX_SMEM - HEADER_BYTES) // 16 * 4     # the same for LIST=0 builds
SPREAD = 4                           # CTAs per row that spreading few rows goes up to
assert MAX_STAGE_UNLISTED <= BARS * CHUNK  # every chunk of a staged slice has a barrier

_lock = threading.Lock()
_LOADED: dict = {}

_stream = cb.current_stream
_current_device = cb.current_device


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def stage_for(longest: int, split: int = 1, with_list: bool = True) -> int:
    """Columns a CTA may stage in shared memory when rows of up to
    ``longest`` columns are split over ``split`` CTAs: the slice of the
    longest row (``longest / split`` rounded up to 4), at most
    :data:`MAX_STAGE` (``with_list``: a build with the candidate list,
    ``LIST=1``; :func:`listed`) or :data:`MAX_STAGE_UNLISTED`."""
    return min(_slice(longest, split), MAX_STAGE if with_list else MAX_STAGE_UNLISTED)


def _slice(longest: int, split: int) -> int:
    """Columns of the longest row's slice over ``split`` CTAs: ``longest /
    split`` rounded up to 4."""
    return ((int(longest) + split - 1) // split + 3) // 4 * 4


def smem_bytes(longest: int, split: int = 1, with_list: bool = True) -> int:
    """Dynamic shared memory of a launch whose stage is
    :func:`stage_for` ``(longest, split, with_list)``."""
    return (HEADER_BYTES + 4 * stage_for(longest, split, with_list)
            + (8 * CAND if with_list else 0))


def _macro(defines: tuple, name: str, default: int) -> int:
    for d in defines:
        key, _, value = d.partition("=")
        if key == name:
            return int(value)
    return default


def split_of(defines: tuple = ()) -> int:
    """CTAs per row of a build (``SPLIT=c`` among its ``defines``; 1
    without)."""
    return _macro(defines, "SPLIT", 1)


def threads_of(defines: tuple = ()) -> int:
    """Threads per CTA of a build (``THREADS=t``; 1024 without)."""
    return _macro(defines, "THREADS", THREADS)


def minb_of(defines: tuple = ()) -> int:
    """CTAs per SM a build's registers must allow (``MINB=m``, the source's
    ``__launch_bounds__``; 1 without)."""
    return _macro(defines, "MINB", 1)


def listed(defines: tuple = ()) -> bool:
    """Whether a build lists the threshold bin's keys in CTA 0 (``LIST=1``,
    the default) rather than narrowing over the slices to the end
    (``LIST=0``, no candidate list in shared memory)."""
    return _macro(defines, "LIST", 1) != 0


def compile_cubin(arch: str = cb.ARCH, extra: tuple = ()) -> tuple[bytes, str]:
    """The kernel by NVRTC (no GPU needed): ``(cubin, log)``."""
    return cb.compile_source(SOURCE, arch, tuple(extra))


class _Loaded:
    def __init__(self, device: torch.device, defines: tuple = ()):
        cubin, _ = compile_cubin(extra=tuple(f"-D{d}" for d in defines))
        self.fn, self.ctx, self.module = cb.load_function(cb.driver(), device, cubin,
                                                          KERNEL_NAME, MAX_SMEM)


def load(device, defines: tuple = ()) -> _Loaded:
    """Compile (NVRTC) and load the kernel on ``device`` once per process
    and build (``defines``: the source's ``-D`` macros, e.g. ``("SPLIT=2",
    "MINB=1")``; none: one CTA per row)."""
    return cb.load_once(_LOADED, _lock, device, tuple(defines), _Loaded)


def launch_plan(rows: int, longest: int, sms: int, bounded: bool = False) -> tuple[str, ...]:
    """The build for a call, from shape facts (graph safe; the result is
    right for any lengths, only its speed depends on this): ``rows`` and
    ``longest``, the longest row expected (the logits' width or a host bound
    on the lengths), on ``sms`` SMs.  ``SPLIT``: CTAs per row, doubled up to
    :data:`SPREAD` while twice as many CTAs still fit on the SMs at once
    (rows from ~SMs / 2 up get one CTA each: more cost more in per-CTA work
    than they spread); ``MINB=2`` (registers for two
    CTAs per SM) where there are more CTAs than SMs and two CTAs' shared
    memory fits an SM.  More rows than SMs, each CTA's rows in flight per SM
    set by shared memory: of at most ~12.1K columns, :data:`SHORT_ROWS` (four
    per SM); of ~18.4K-26.6K columns, where the candidate list leaves room
    for one CTA only, :data:`MID_ROWS` (two; faster there, slower on fewer
    or longer rows).  One CTA a row at one per SM over a staged longest
    row of at least :data:`SAMPLE_FROM` columns: ``SAMPLED`` (a threshold
    from a sample first).  ``bounded``: ``longest`` is a
    host bound on the lengths (an eager step's ``max_seq_len``), not the
    logits' width; then ``SPLIT`` doubles once more where that stages a slice
    the spread leaves past :data:`MAX_STAGE` (read from global memory in
    every pass) and the grid stays within :func:`_doubled_grid_fits`
    (:func:`_stages_when_doubled`; under a width, rows are mostly far
    shorter, and splitting them further was slower).  The measurements behind
    each bound: BENCHMARKS.md, the decode top-k."""
    split = 1
    while split < SPREAD and rows * split * 2 <= sms:
        split *= 2
    if (bounded and split < SPREAD and _doubled_grid_fits(rows, split, sms)
            and _stages_when_doubled(longest, split)):
        split *= 2
    if split == 1 and rows > sms:
        if _fit(4, smem_bytes(longest, 1, False)):
            return SHORT_ROWS
        if _fit(2, smem_bytes(longest, 1, False)) and not _fit(2, smem_bytes(longest)):
            return MID_ROWS
    two = rows * split > sms and _fit(2, smem_bytes(longest, split))
    if split == 1 and not two and SAMPLE_FROM <= _slice(longest, 1) <= MAX_STAGE:
        return SAMPLED
    return (f"SPLIT={split}", f"MINB={2 if two else 1}")


def _doubled_grid_fits(rows: int, split: int, sms: int) -> bool:
    """Whether ``rows`` rows over ``2 * split`` CTAs each stay within two
    waves of ``sms`` CTAs for pairs, one and a half for clusters of four
    (where doubling, each row's slice staged, was faster than the plan's
    split)."""
    return rows * split * 2 <= (2 * sms if split == 1 else sms * 3 // 2)


def _stages_when_doubled(longest: int, split: int) -> bool:
    """Whether the longest row's slice over ``split`` CTAs is past the stage
    and over ``2 * split`` within it."""
    return _slice(longest, split) > MAX_STAGE >= _slice(longest, 2 * split)


def _fit(ctas: int, smem: int) -> bool:
    """Whether ``ctas`` CTAs of ``smem`` bytes of shared memory fit an SM."""
    return ctas * (smem + 1024) <= SM_SMEM


# Many rows of few columns: no candidate list (LIST=0), so that four (512 threads, 32
# registers) or two (1024 threads) CTAs' slices fit an SM's shared memory at once.
SHORT_ROWS = ("SPLIT=1", "THREADS=512", "LIST=0", "MINB=4")
MID_ROWS = ("SPLIT=1", "THREADS=1024", "LIST=0", "MINB=2")


# One CTA a row that first histograms a sample of a staged row for a threshold
# below the k-th key (the source's SAMPLE).  The plan takes it where it would
# give one CTA a row at one per SM and the longest row is staged and at least
# SAMPLE_FROM long (measured faster there; shorter rows and split rows measured
# slower).
SAMPLED = ("SPLIT=1", "MINB=1", "SAMPLE=1")
SAMPLE_FROM = 32768


def plan_builds() -> list[tuple[str, ...]]:
    """Every build :func:`launch_plan` can name (what a server loads at
    start-up, so no decode step compiles)."""
    splits = [1 << i for i in range(SPREAD.bit_length())]
    return ([(f"SPLIT={s}", "MINB=1") for s in splits] + [("SPLIT=1", "MINB=2")]
            + [SHORT_ROWS, MID_ROWS, SAMPLED])


def kernel_args(logits: int, row_stride: int, lens: int, width: int, k: int, out: int,
                out_stride: int, stage: int) -> dict:
    """The kernel's parameters by name, in its order (``decode_topk`` in the
    source; a test compares), as the ctypes values ``cuLaunchKernel`` copies."""
    c = ctypes
    return {"logits": c.c_uint64(logits), "row_stride": c.c_int64(row_stride),
            "lens": c.c_uint64(lens), "width": c.c_int32(width), "k": c.c_int32(k),
            "out": c.c_uint64(out), "out_stride": c.c_int64(out_stride),
            "stage": c.c_int32(stage)}


class _Params(cb.ParamBlock):
    """The kernel's parameter block (:func:`kernel_args`' values).  Every
    build takes the same parameters, so one block serves every launch, which
    sets them all (:meth:`set`)."""

    __slots__ = ()

    def __init__(self):
        super().__init__(kernel_args(0, 0, 0, 0, 0, 0, 0, 0))

    def set(self, logits: int, row_stride: int, lens: int, width: int, k: int, out: int,
            out_stride: int, stage: int) -> None:
        """This launch's values (as :func:`kernel_args` makes them)."""
        v = self.vals
        v["logits"].value, v["row_stride"].value, v["lens"].value = logits, row_stride, lens
        v["width"].value, v["k"].value = width, k
        v["out"].value, v["out_stride"].value, v["stage"].value = out, out_stride, stage


_PARAMS = _Params()


def layout_problem(logits, lengths, k, out) -> tuple[str, str, object] | None:
    """The first way :func:`decode_topk`'s arguments are not laid out as the
    kernel takes them, as ``(argument, expected, got)``, or ``None``
    (metadata only, any device: their device being a GPU is not checked)."""
    if not isinstance(logits, torch.Tensor):
        return "logits", "a tensor", type(logits)
    if logits.dtype != torch.float32 or logits.dim() != 2:
        return "logits", "float32 [rows, width]", f"{logits.dtype} {tuple(logits.shape)}"
    if logits.shape[1] and logits.stride(1) != 1:
        return "logits", "unit column stride", logits.stride()
    rows, width = logits.shape
    if width >= 2**31 or (rows and logits.stride(0) < width):
        return "logits", "rows of fewer than 2^31 columns, not overlapping", logits.stride()
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < 2**31:
        return "k", "an int >= 1", k
    if not isinstance(lengths, torch.Tensor) or lengths.device != logits.device:
        return "lengths", f"a tensor on {logits.device}", getattr(lengths, "device",
                                                                   type(lengths))
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.is_complex():
        return "lengths", "an integer tensor", lengths.dtype
    if lengths.numel() != rows:
        return "lengths", f"{rows} values (one per row)", tuple(lengths.shape)
    if out is not None:
        if (not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or out.dim() != 2
                or out.shape[0] != rows or out.shape[1] != k or out.device != logits.device
                or (k > 1 and out.stride(1) != 1) or (rows > 1 and out.stride(0) < k)):
            return ("out", f"int32 [{rows}, {k}] on {logits.device}, unit column stride",
                    f"{getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))} "
                    f"stride {out.stride() if isinstance(out, torch.Tensor) else None}")
    return None


def check_args(logits: torch.Tensor, lengths: torch.Tensor, k: int,
               out: torch.Tensor | None) -> torch.Tensor:
    """Validate :func:`decode_topk`'s arguments but their device being a GPU
    (:func:`layout_problem`; ``ValueError`` naming the argument); returns the
    lengths as contiguous int32, one value per row (:func:`_flat`: the tensor
    itself where it is so, else converted)."""
    problem = layout_problem(logits, lengths, k, out)
    if problem is not None:
        _fail(*problem)
    return _flat(lengths)


def _flat(lengths: torch.Tensor) -> torch.Tensor:
    """``lengths`` as contiguous int32 values, one per row: the tensor itself
    where it already is (the launch reads its address only; a reshaped view
    costs host time on every call), else converted."""
    if lengths.dtype == torch.int32 and lengths.is_contiguous():
        return lengths
    flat = lengths.reshape(-1)
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    return flat


def decode_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int,
                out: torch.Tensor | None = None, defines: tuple | None = None,
                bound: int | None = None) -> torch.Tensor:
    """The columns of each row's ``k`` largest logits, int32 ``[R, k]``, from
    one launch on the current stream.  ``logits``: float32 ``[R, W]`` on an
    sm_90 GPU, unit column stride (any row stride); ``lengths``: an integer
    tensor of ``R`` values (e.g. ``[R]``, ``[R, 1]`` or ``[B, next_n]`` with
    ``B * next_n == R``: row ``r`` reads ``lengths.reshape(-1)[r]``); ``out``:
    int32 ``[R, k]``, unit column stride (e.g. a view of a wider buffer),
    written in place; ``defines``: a build (:func:`load`: ``SPLIT=c``,
    ``THREADS=t``, ``LIST=0|1``, ``MINB=m``: one of :func:`plan_builds`),
    ``None`` for :func:`launch_plan`'s;
    ``bound``: a host-known bound on the lengths (e.g.
    vLLM's ``max_seq_len``) that sizes the plan and the stage in place of the
    width (speed only: longer rows are still right, read from global memory)."""
    if defines is not None:
        _facts(tuple(defines))
    if not isinstance(logits, torch.Tensor) or not logits.is_cuda:
        _fail("logits", "a CUDA tensor", getattr(logits, "device", type(logits)))
    flat = check_args(logits, lengths, k, out)
    if out is None:
        out = torch.empty((logits.shape[0], k), dtype=torch.int32, device=logits.device)
    return _launch(logits, flat, k, out, defines, bound)


def launch_checked(logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor,
                   bound: int | None = None) -> torch.Tensor:
    """:func:`decode_topk` with the launch plan's build for a call whose
    layout the caller has checked (:func:`layout_problem` gave ``None``,
    ``out`` given, ``logits`` on a CUDA device): :func:`.topk.dispatch`'s
    call, which checks it to choose the kernel; not checked again here."""
    return _launch(logits, _flat(lengths), k, out, None, bound)


def _values(defines: tuple) -> tuple[int, int, bool, int, int]:
    """A build's SPLIT, THREADS, LIST, MINB and SAMPLE (absent ones at their
    defaults)."""
    return (split_of(defines), threads_of(defines), listed(defines), minb_of(defines),
            _macro(defines, "SAMPLE", 0))


def is_planned(defines: tuple) -> bool:
    """Whether ``defines`` make one of :func:`plan_builds` (absent macros at
    their defaults): the only builds the source compiles."""
    known = all(d.partition("=")[0] in ("SPLIT", "THREADS", "LIST", "MINB", "SAMPLE")
                for d in defines)
    return known and _values(tuple(defines)) in {_values(b) for b in plan_builds()}


@functools.lru_cache(maxsize=None)
def _facts(defines: tuple) -> tuple[int, int, bool]:
    """A build's CTAs per row, threads per CTA and candidate list, checked
    (once per build): ``ValueError`` naming ``defines`` unless
    :func:`is_planned`."""
    if not is_planned(defines):
        _fail("defines", f"one of plan_builds() {plan_builds()}", defines)
    return _values(defines)[:3]


class _Call:
    """What a launch takes from its shape facts (device, rows, the longest
    row, whether bounded, the build asked for): the loaded build, grid,
    threads, shared memory and stage."""

    __slots__ = ("key", "kern", "grid", "threads", "smem", "stage")

    def __init__(self, key: tuple):
        index, rows, longest, bounded, defines = key
        if defines is None:
            defines = launch_plan(rows, longest, num_sms(index), bounded=bounded)
        split, self.threads, lists = _facts(defines)
        self.key = key
        self.kern = load(torch.device("cuda", index), defines)
        self.stage = stage_for(longest, split, lists)
        self.grid, self.smem = rows * split, smem_bytes(longest, split, lists)


# The last launch's facts: a decode step calls the top-k once per layer with the
# same shape and bound, so every layer after the first finds them here.
_last: _Call | None = None


def _launch(logits: torch.Tensor, flat: torch.Tensor, k: int, out: torch.Tensor,
            defines, bound) -> torch.Tensor:
    global _last
    rows, width = logits.shape
    if rows == 0:
        return out
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)
                              or bound < 1):
        _fail("bound", "an int >= 1 (a host bound on the lengths) or None", bound)
    index = logits.device.index
    if index is None:
        index = _current_device()
    key = (index, rows, width if bound is None else min(width, bound), bound is not None,
           None if defines is None else tuple(defines))
    call = _last
    if call is None or call.key != key:
        call = _last = _Call(key)
    params = _PARAMS
    with params.lock:
        params.set(logits.data_ptr(), logits.stride(0), flat.data_ptr(), width, k,
                   out.data_ptr(), out.stride(0) if rows > 1 else k, call.stage)
        kern = call.kern
        if _current_device() == index:
            cb.launch_function(cb.driver(), kern.fn, kern.ctx, call.grid, call.threads,
                               call.smem, _stream(index), params.addr)
        else:
            with torch.cuda.device(index):
                cb.launch_function(cb.driver(), kern.fn, kern.ctx, call.grid, call.threads,
                                   call.smem, _stream(index), params.addr)
    return out
