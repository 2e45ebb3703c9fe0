"""NVRTC and the CUDA driver through NVIDIA's ``cuda-python`` (``cuda.bindings``):
what this project's CUDA C++ kernels need to be compiled, loaded and launched
with no host compiler and no build step (the sm_90 logits kernel,
:mod:`.cuda_paged_mqa_logits`, and its planner, :mod:`.cuda_plan`).  Knows no
kernel.  ``DSA_VARLEN_NVRTC`` names another NVRTC library.

NVRTC compiles and driver loads leave the process's stop signals as they
found them (:func:`keep_stop_signals`): NVRTC 13.0's compile re-installs
SIGTERM's handler with ``SA_RESTART`` (and without ``SA_ONSTACK``), and under
``SA_RESTART`` a thread asleep in a lock wait never returns to Python to run
its handler.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import logging
import os
import signal
import sys
import threading

import torch

# Absolute: the benchmark imports another revision's ops/ under another name.
from vllm_dsa_varlen import settings
from vllm_dsa_varlen.settings import NVRTC_ENV

ARCH = "sm_90a"
INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

logger = logging.getLogger("vllm.dsa_varlen")


def _import(name: str):
    """``cuda.bindings.<name>`` or ``OSError`` saying what is missing."""
    try:
        return importlib.import_module(f"cuda.bindings.{name}")
    except ImportError as exc:
        raise OSError(f"cuda-python is not installed or too old (cuda.bindings.{name}: {exc}); "
                      "the sm_90 CUDA kernels compile and launch through it "
                      "(pip install cuda-python)") from exc


@functools.lru_cache(maxsize=None)
def nvrtc():
    """cuda-python's NVRTC module with a library loaded, or ``OSError`` why not.

    ``DSA_VARLEN_NVRTC`` names another NVRTC library: it is loaded first,
    and cuda-python takes an NVRTC the process has loaded (by its soname,
    ``libnvrtc.so.13`` or ``.12``) before searching for one."""
    nvrtc = _import("nvrtc")
    try:
        path = settings.get(NVRTC_ENV)
    except ValueError as exc:  # register() refuses it at start-up; here: no NVRTC
        raise OSError(str(exc)) from None
    if path:
        try:
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
        except OSError as exc:
            raise OSError(f"{NVRTC_ENV}={path}: {exc}") from exc
    try:
        err, _, _ = nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - cuda-python found no NVRTC library
        raise OSError(f"no NVRTC library loads through cuda-python ({exc}); set {NVRTC_ENV} "
                      "to one") from exc
    if err:
        raise OSError(f"nvrtcVersion: {err!r}")
    return nvrtc


@functools.lru_cache(maxsize=None)
def driver():
    """cuda-python's driver module with the driver loaded, or ``OSError`` why not."""
    driver = _import("driver")
    try:
        err, _ = driver.cuDriverGetVersion()
    except Exception as exc:  # noqa: BLE001 - no libcuda: no GPU driver here
        raise OSError(f"the CUDA driver does not load through cuda-python ({exc})") from exc
    if err:
        raise OSError(f"cuDriverGetVersion: {err!r}")
    return driver


def ok(result, what: str):
    """The values of a cuda-python call (``(error, *values)``), or ``RuntimeError``."""
    err = result[0]
    if err:
        name = err
        try:
            got = driver().cuGetErrorName(err)
            name = got[1].decode() if not got[0] else err
        except Exception:  # noqa: BLE001 - an NVRTC result, or no name
            pass
        raise RuntimeError(f"{what}: CUDA error {int(err)} ({name})")
    return result[1] if len(result) == 2 else result[1:]



def load_function(drv, device: torch.device, cubin: bytes, name: bytes, smem: int):
    """Load ``cubin`` (through ``drv``, :func:`driver`) in ``device``'s primary context and allow its kernel
    ``name`` ``smem`` bytes of dynamic shared memory: ``(function, context,
    module)`` driver handles (the module is kept alive with the function)."""
    with keep_stop_signals("the CUDA driver's module load"), torch.cuda.device(device):
        torch.cuda.init()
        torch.empty(1, device=device)  # the primary context is current
        ctx = ok(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        image = ctypes.create_string_buffer(cubin, len(cubin))
        module = ok(drv.cuModuleLoadData(ctypes.addressof(image)), "cuModuleLoadData")
        fn = ok(drv.cuModuleGetFunction(module, name), "cuModuleGetFunction")
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        ok(drv.cuFuncSetAttribute(fn, attr, smem),
            "cuFuncSetAttribute(max dynamic shared memory)")
    return fn, ctx, module


# The current stream's raw handle without building a torch.cuda.Stream, and the
# current device without torch.cuda.current_device()'s lazy-init check (the
# private getters Triton's launcher uses too; the public routes where they are
# gone).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def current_stream(index: int) -> int:
    """The raw handle of device ``index``'s current stream."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def current_device() -> int:
    """The current CUDA device's index."""
    if _GET_DEVICE is not None:
        return _GET_DEVICE()
    return torch.cuda.current_device()


def load_once(cache: dict, lock, device, build, make):
    """``cache[(index, build)]`` for ``device``'s index, made on first use by
    ``make(torch.device("cuda", index), build)`` under ``lock`` (checked
    again there): a kernel's build compiled and loaded once per process and
    device, whichever thread asks first."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, build)
    got = cache.get(key)
    if got is None:
        with lock:
            got = cache.get(key)
            if got is None:
                got = cache[key] = make(torch.device("cuda", index), build)
    return got


class SigAction(ctypes.Structure):
    """``struct sigaction`` of glibc and musl on Linux: the handler, the mask
    (1024 bits), the flags (C's ``int``, read unsigned: ``SA_RESETHAND`` is
    the top bit), the restorer."""
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16),
                ("flags", ctypes.c_uint), ("restorer", ctypes.c_void_p)]


@functools.lru_cache(maxsize=None)
def _libc():
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def signal_action(signum: int) -> SigAction | None:
    """The process's C-level action for ``signum`` as the kernel delivers it
    (``None`` off Linux).  Python's ``signal.getsignal`` reports only its own
    table: a native library that calls ``sigaction`` itself replaces the C
    handler behind it, and the Python handler then never runs."""
    libc = _libc()
    got = SigAction()
    if libc is None or libc.sigaction(signum, None, ctypes.byref(got)) != 0:
        return None
    return got


_told: set = set()  # (what, signal) pairs already logged at info in this process


@contextlib.contextmanager
def keep_stop_signals(what: str):
    """Native work (``what``) that must not take the stop signals from
    Python: vLLM 0.34's engine core installs its SIGTERM handler before it
    builds the engine, so before this project compiles and loads its
    kernels, and stops only through that handler.  Where the block changed
    the C-level action (handler or flags) of a signal that Python handles,
    while Python's table stayed the same, the action is set back, logged
    (info) the first time for each ``what`` and signal, then at debug."""
    saved = {s: (signal.getsignal(s), signal_action(s)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, (python, before) in saved.items():
            if before is None or not callable(python) or signal.getsignal(signum) is not python:
                continue  # not Python's handler, or Python itself changed it
            now = signal_action(signum)
            if now is None or (now.handler, now.flags) == (before.handler, before.flags):
                continue
            _libc().sigaction(signum, ctypes.byref(before), None)
            name = signal.Signals(signum).name
            log = logger.debug if (what, name) in _told else logger.info
            _told.add((what, name))
            log("vllm-dsa-varlen: %s changed the process's %s action (handler %#x, flags %#x; "
                "was %#x, %#x); set back, as vLLM stops its engine core through it", what, name,
                now.handler or 0, now.flags, before.handler or 0, before.flags)


class ParamBlock:
    """A kernel's parameter values (``vals``: ctypes objects by name, in the
    kernel's order) made once, beside the pointer array ``cuLaunchKernel``
    reads (``addr``).  A launch sets the values and hands ``addr`` over; the
    driver copies them at the call, so one block serves every launch
    (``lock``: one launch at a time fills it)."""

    __slots__ = ("vals", "array", "addr", "lock")

    def __init__(self, vals: dict):
        self.vals = vals
        self.array = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals.values()])
        self.addr = ctypes.addressof(self.array)
        self.lock = threading.Lock()


def dependent_launch(drv, grid: int, block: int, smem: int):
    """A ``cuLaunchKernelEx`` configuration (1-D grid and block) that launches
    a kernel as a programmatic dependent of the one before it on the stream
    (``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: it may start
    before that kernel has finished, so it must ``griddepcontrol.wait`` before
    reading what that kernel writes).  Made once per kernel build; each launch
    sets its grid and stream (:func:`launch_function`).  Stream capture keeps the
    dependency as a programmatic graph edge."""
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = drv.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = smem
    config.attrs = [attr]
    config.numAttrs = 1
    return config


def launch_function(drv, fn, ctx, grid: int, block: int, smem: int, stream: int,
                    params_addr: int, config=None) -> None:
    """``cuLaunchKernel`` of ``fn`` (1-D grid and block) with the parameter
    pointer array at ``params_addr``, or ``cuLaunchKernelEx`` with ``config``
    (:func:`dependent_launch`, made for this block and shared memory; the grid
    and stream set here); a thread whose current driver context is not the device's
    primary one ``ctx`` (no CUDA call made on it yet) gets it and retries."""
    if config is None:
        launch, args, what = drv.cuLaunchKernel, (fn, grid, 1, 1, block, 1, 1, smem, stream,
                                                  params_addr, 0), "cuLaunchKernel"
    else:
        config.gridDimX, config.hStream = grid, stream
        launch, args, what = drv.cuLaunchKernelEx, (config, fn, params_addr, 0), "cuLaunchKernelEx"
    (err,) = launch(*args)
    if err == INVALID_CONTEXT:
        ok(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        (err,) = launch(*args)
    if err:
        ok((err,), what)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def compile_source(path: str, arch: str = ARCH, extra: tuple = (),
                   ptx: bool = False) -> tuple[bytes, str]:
    """Compile the CUDA source at ``path`` with NVRTC for ``arch`` (no GPU
    needed); returns (cubin, log), or with ``ptx`` (PTX text, log) for arch's
    virtual architecture.  Raises ``RuntimeError`` with NVRTC's log on a
    compile error."""
    with keep_stop_signals("NVRTC's compile"):
        return _compile(nvrtc(), path, arch, extra, ptx)


def _compile(nv, path: str, arch: str, extra: tuple, ptx: bool) -> tuple[bytes, str]:
    prog = ok(nv.nvrtcCreateProgram(_read(path).encode(),
                                        os.path.basename(path).encode(), 0, [], []),
               "nvrtcCreateProgram")
    target = arch.replace("sm_", "compute_") if ptx else arch
    try:
        opts = [f"--gpu-architecture={target}".encode(), b"-std=c++17",
                *[o.encode() for o in extra]]
        (res,) = nv.nvrtcCompileProgram(prog, len(opts), opts)
        size = ok(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = bytearray(size)
        ok(nv.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        text = bytes(log).split(b"\0", 1)[0].decode(errors="replace")
        if res:
            why = nv.nvrtcGetErrorString(res)[1].decode()
            raise RuntimeError(f"NVRTC failed to compile {path} for {arch}: {why}\n{text}")
        if ptx:
            code = bytearray(ok(nv.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize"))
            ok(nv.nvrtcGetPTX(prog, code), "nvrtcGetPTX")
            return bytes(code).split(b"\0", 1)[0], text
        cubin = bytearray(ok(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize"))
        ok(nv.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin), text
    finally:
        nv.nvrtcDestroyProgram(prog)
