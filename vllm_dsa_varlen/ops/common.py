"""What the logits kernels share: the cache geometry they are built for, the
GPU's SM count, the argument-error helper and the cached launch of a compiled
Triton kernel.

Every kernel module imports this one (and :mod:`.reference` where it needs
the host model); none imports :mod:`.launcher`, which imports them all.
"""

from __future__ import annotations

import functools
import logging

import torch

PAGE = 64   # KV entries per cache block, every kernel
DIM = 128   # head dim, every kernel
logger = logging.getLogger("vllm.dsa_varlen")


def fail(arg: str, expected: str, got) -> None:
    """Raise the project's ``ValueError`` for a bad argument: its name, what was
    expected, what came."""
    raise ValueError(f"{arg}: expected {expected}, got {got}")


def is_pow2(n: int) -> bool:
    """Whether ``n`` is a positive power of two."""
    return n > 0 and n & (n - 1) == 0


def check_out_tensor(name: str, x, shape: tuple, dtype) -> None:
    """``ValueError`` naming ``name`` unless the caller's output ``x`` is
    ``dtype`` of ``shape`` with a unit last stride."""
    if tuple(x.shape) != shape or x.dtype != dtype or x.stride(-1) != 1:
        fail(name, f"{dtype} {shape} with a unit last stride",
             f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")


_logged: set = set()


def log_once(msg: str) -> None:
    """Log ``msg`` at INFO the first time it comes (fallback notices: once per
    process, not once per layer and step)."""
    if msg not in _logged:
        _logged.add(msg)
        logger.info(msg)


@functools.lru_cache(maxsize=None)
def num_sms(device) -> int:
    """SMs of a CUDA device (a ``torch.device`` or an index); 4 for the CPU
    interpreter, so the portable kernel's work split stays small there."""
    if isinstance(device, int):
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


_CAPABILITY: dict = {}


def capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of a CUDA tensor's device, looked up
    once per device (a launch asks on every call)."""
    got = _CAPABILITY.get(device)
    if got is None:
        got = torch.cuda.get_device_capability(device)
        if device.index is not None:
            _CAPABILITY[device] = got
    return got


# ------------------------------------------------------------ bound launches
#
# Triton binds a call's arguments (specialisation key, signature) on every
# launch through ``kernel[grid](...)``: tens of microseconds of host time per
# call, on every layer of every eager step.  launch_bound pays it once per
# specialisation key and launches the compiled kernel directly afterwards.

_BOUND: dict = {}
CACHE_LIMIT = 4096


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
    compiled = _BOUND.get(key)
    if compiled is not None:  # a compiled kernel launches on a 3-D grid
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *constexprs.values())
        return compiled
    compiled = kernel[grid](*args, **constexprs, **options)
    if compiled is not None and hasattr(compiled, "function"):
        if len(_BOUND) >= CACHE_LIMIT:
            _BOUND.clear()
        _BOUND[key] = compiled
    return compiled
