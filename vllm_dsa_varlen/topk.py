"""The indexer's decode top-k: this project's kernel in place of vLLM's where it serves.

vLLM's decode top-k (``persistent_topk``, ``cooperative_topk`` from its
``_C`` extension) reads the logits the indexer's decode kernel wrote, once
per layer.  :func:`.ops.cuda_topk.decode_topk` meets the same contract
(:func:`.ops.reference.topk_ref`) in one launch; BENCHMARKS.md times the two
side by side.  ``VLLM_DSA_VARLEN_TOPK``:

* ``own``: the project's top-k for every decode step on an sm_90 GPU where
  its kernel compiles and loads (NVRTC through ``cuda-python``), whatever
  kernel wrote the logits; vLLM's elsewhere and for calls it does not serve
  (:func:`serves`: float32 logits with unit column stride, one length per
  row, an int32 output of ``[rows, k]``);
* ``vllm``: vLLM's top-k always;
* ``auto`` (default): the project's top-k on sm_90 for the calls where it
  was measured faster than vLLM's (:func:`measured_faster`: outside
  CUDA-graph capture, more than 32 rows whose host bound on the lengths is
  :data:`LONG_ROWS` columns or more, and either rows that a CTA's stage holds
  whole or, past the rows the vLLM line gives its ``cooperative_topk`` (32
  in 0.27.1, 64 in 0.33.0), up to as many rows as SMs), vLLM's for the
  others.

``VLLM_DSA_VARLEN=off`` or ``stock`` keeps vLLM's too.  The decision per
process and device is made once (:func:`choose_topk`, pure; logged once),
the per-call check reads tensor metadata only (no sync, graph safe).  The
vLLM-line modules call :func:`dispatch` from their patched call sites.
Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from . import stats
from .config import MODE_ENV, read_mode
from .ops import cuda_topk
from .ops.common import num_sms

TOPK_ENV = "VLLM_DSA_VARLEN_TOPK"
TOPK_SETTINGS = ("auto", "vllm", "own")
CAPABILITY = (9, 0)
# Where ``auto`` takes the project's top-k, from its measurement beside vLLM
# 0.27.1's ``persistent_topk`` / ``cooperative_topk`` on the H200 on logits as
# the engine lays them out (rows max_model_len = 163840 wide, which picks
# vLLM's cooperative kernel up to 32 rows; one process, rounds interleaved;
# BENCHMARKS.md "One process", the decode top-k table).  More than 32 rows
# bounded at 32K columns or more: 0.57-0.79x vLLM's time up to as many rows as
# SMs (36-128 rows of 32K, 64K and 128K), 0.77-0.93x past them where one CTA
# stages a row whole (B64 L32K 2, 3, 1..4, 4 tokens); 0.94-1.93x on every
# other step timed (few rows, rows of 16K columns and fewer, more rows than
# SMs of 64K columns; the worst 32 rows of 8K, eager).
# Against vLLM 0.27.1 those wins are all against persistent_topk (its call takes
# cooperative_topk up to 32 rows).  vLLM 0.33.0's takes cooperative_topk up to 64 rows
# (its AUTO_COOPERATIVE_MAX_ROWS; its line hands that limit to dispatch as
# ``cooperative_rows``), and passes both ops the step's max_seq_len in eager steps:
# beside its own extension, 33-64 rows bounded at 42.6K: 0.92-0.94x its
# cooperative_topk; 64K-81K: 0.96-0.99x (level, left to it); 96-256 rows of 32K:
# 0.82-0.88x its persistent_topk; 8K-16K: 1.07-1.19x (h200-b425cab).  With the plan's
# bounded doubling (cuda_topk.launch_plan, 2e367fe), eager calls of 36-128 rows of 48K-96K
# took 0.53-0.93x vLLM 0.27.1's time (96 rows of 64K: 0.85x, 1.02x before; h200-9fb2ff6).
LONG_ROWS = 32768
COOPERATIVE_ROWS = 32  # vLLM 0.27.1's cooperative_topk serves up to this many rows


def measured_faster(rows: int, bound: int | None, sms: int,
                    cooperative_rows: int = COOPERATIVE_ROWS) -> bool:
    """Whether ``auto`` takes the project's top-k for a call of ``rows`` rows
    on a GPU of ``sms`` SMs whose lengths the host bounds by ``bound``
    (``None``: no bound known: the logits' width is none, vLLM sizes it for
    the longest context the engine allows, nor is anything inside a
    CUDA-graph capture, whose launch replays at other lengths): more rows
    than :data:`COOPERATIVE_ROWS`, bounded at :data:`LONG_ROWS` or more, and
    either rows one CTA stages whole or, past the rows vLLM's call gives its
    ``cooperative_topk`` (``cooperative_rows``), no more rows than SMs."""
    if bound is None or rows <= COOPERATIVE_ROWS or bound < LONG_ROWS:
        return False
    return bound <= cuda_topk.MAX_STAGE or cooperative_rows < rows <= sms


def auto_builds(sms: int) -> list[tuple[str, ...]]:
    """Every build :func:`.ops.cuda_topk.launch_plan` names, on ``sms`` SMs,
    for a call :func:`measured_faster` takes (what ``auto`` loads at start-up:
    no decode step compiles; every such call is bounded).  The plan stops
    depending on the rows past ``sms + 1``, and on the bound past
    ``SPREAD * MAX_STAGE`` (:func:`.ops.cuda_topk.launch_plan`); the bounds
    are tried every 256 columns up to it."""
    rows = range(COOPERATIVE_ROWS + 1, max(sms, COOPERATIVE_ROWS) + 2)
    most = cuda_topk.SPREAD * cuda_topk.MAX_STAGE
    bounds = sorted(set(range(LONG_ROWS, most, 256)) | {most})
    return list(dict.fromkeys(cuda_topk.launch_plan(r, b, sms, bounded=True)
                              for r in rows for b in bounds))


logger = logging.getLogger("vllm.dsa_varlen")


def read_topk(environ: Mapping[str, str] | None = None) -> str:
    """``VLLM_DSA_VARLEN_TOPK`` -> ``"auto"`` | ``"vllm"`` | ``"own"`` (unset
    or empty: ``"auto"``); ``ValueError`` naming the variable otherwise."""
    env = os.environ if environ is None else environ
    raw = env.get(TOPK_ENV)
    if raw is None or raw.strip() == "":
        return "auto"
    value = raw.strip().lower()
    if value not in TOPK_SETTINGS:
        raise ValueError(f"{TOPK_ENV}={raw!r} is not valid: expected one of "
                         f"{', '.join(TOPK_SETTINGS)} (default auto)")
    return value


@dataclass(frozen=True)
class TopkChoice:
    """Whether the project's top-k serves a device (``own``), for every call
    it serves or, under ``auto``, where :func:`measured_faster` (``per_call``),
    and why."""

    own: bool
    reason: str
    per_call: bool = False


def choose_topk(*, mode: str, setting: str, capability: tuple[int, int] | None,
                kernel_error: str | None) -> TopkChoice:
    """The top-k for a device (pure): vLLM's under ``VLLM_DSA_VARLEN=off`` /
    ``stock`` or ``VLLM_DSA_VARLEN_TOPK=vllm``, off sm_90, or where the
    kernel failed to compile or load (``kernel_error``); the project's
    otherwise, per call under ``auto``."""
    if mode in ("off", "stock"):
        return TopkChoice(False, f"{MODE_ENV}={mode}")
    if setting == "vllm":
        return TopkChoice(False, f"{TOPK_ENV}=vllm")
    if capability is None or tuple(capability) != CAPABILITY:
        cap = "unknown" if capability is None else f"sm_{capability[0]}{capability[1]}"
        return TopkChoice(False, f"the project's top-k kernel is built for sm_90 (device {cap})")
    if kernel_error is not None:
        return TopkChoice(False, f"the project's top-k kernel is unavailable: {kernel_error}")
    if setting == "auto":
        return TopkChoice(True, f"sm_90, {TOPK_ENV}=auto: the project's where measured faster "
                                f"(more than {COOPERATIVE_ROWS} rows bounded at {LONG_ROWS} "
                                f"columns or more: rows of up to {cuda_topk.MAX_STAGE} columns, "
                                f"or up to as many rows as SMs past vLLM's cooperative_topk "
                                f"rows; outside graph capture), vLLM's elsewhere",
                          per_call=True)
    return TopkChoice(True, f"sm_90, {TOPK_ENV}={setting}: one launch per layer (ops.cuda_topk)")


_choices: dict[int, TopkChoice] = {}
_lock = threading.Lock()
_forced: bool | None = None


def force(own: bool | None) -> None:
    """Override the per-device decision for the calls that follow (``None``:
    decide again): a harness stepping a stock engine and the plugin's in one
    process sets it per engine, since the decision is per process.  The
    kernel's layout check still applies."""
    global _forced
    _forced = own


def decide(index: int) -> TopkChoice:
    """:func:`choose_topk` for device ``index`` from the environment, once per
    process (logged once)."""
    got = _choices.get(index)
    if got is not None:
        return got
    with _lock:
        got = _choices.get(index)
        if got is None:
            mode, setting = read_mode(), read_topk()
            capability = torch.cuda.get_device_capability(index)
            error = None
            if mode == "auto" and setting != "vllm" and tuple(capability) == CAPABILITY:
                try:  # every build the launch plan may take: no decode step compiles
                    builds = (auto_builds(num_sms(index)) if setting == "auto"
                              else cuda_topk.plan_builds())
                    for build in builds:
                        cuda_topk.load(torch.device("cuda", index), build)
                except Exception as exc:  # noqa: BLE001 - any failure: vLLM's top-k
                    error = f"{type(exc).__name__}: {exc}"
            got = _choices[index] = choose_topk(mode=mode, setting=setting,
                                                capability=capability, kernel_error=error)
            logger.log(logging.WARNING if error else logging.INFO,
                       "vllm-dsa-varlen: decode top-k on cuda:%d: %s (%s)", index,
                       "the project's" if got.own else "vLLM's", got.reason)
    return got


def layout_ok(logits, lengths, out, k) -> bool:
    """The call's tensors are laid out as the project's kernel takes them
    (metadata only, any device; the kernel's own rule,
    :func:`.ops.cuda_topk.layout_problem`), with an ``out`` to write: float32
    ``[R, W]`` logits with unit column stride, ``R`` integer lengths on the
    logits' device, int32 ``out`` of ``[R, k]`` with unit column stride
    there, ``k >= 1``."""
    return (isinstance(out, torch.Tensor)
            and cuda_topk.layout_problem(logits, lengths, k, out) is None)


def serves(logits, lengths, out, k) -> bool:
    """:func:`layout_ok` on a CUDA device."""
    return isinstance(logits, torch.Tensor) and logits.is_cuda and layout_ok(logits, lengths,
                                                                            out, k)


def capturing(logits) -> bool:
    """Whether a CUDA graph capture is under way for this call: CUDA
    ``logits`` and the current stream capturing (not asking whether CUDA is
    available: that reads the environment and queries the driver, ~1 µs, on
    every eager layer)."""
    return getattr(logits, "is_cuda", False) and torch.cuda.is_current_stream_capturing()


def dispatch(logits, lengths, out, k, stock: Callable[[], object],
             bound: int | None = None, cooperative_rows: int = COOPERATIVE_ROWS) -> None:
    """The decode top-k of ``logits`` into ``out``: the project's kernel
    where it serves this device and call, else ``stock()`` (vLLM's call,
    its own arguments).  ``bound``: the call's host bound on the lengths
    (vLLM's ``max_seq_len`` argument; sizes the kernel's launch plan and
    feeds :func:`measured_faster`; ignored inside a CUDA-graph capture);
    ``cooperative_rows``: up to how many rows the vLLM line's call takes
    ``cooperative_topk`` (feeds :func:`measured_faster`)."""
    if _forced is False:
        stock()
        return
    known = None
    if _forced is None:  # the decision made for this device: no layout check where it is vLLM's
        device = getattr(logits, "device", None)
        known = _choices.get(getattr(device, "index", None))
        if known is not None and not known.own:
            stock()
            return
    captured = capturing(logits)
    if captured or not (isinstance(bound, int) and not isinstance(bound, bool) and bound >= 1):
        # A graph replays the launch at other lengths: no bound there (vLLM captures
        # with max_seq_len = max_model_len, which bounds nothing).
        bound = None
    takes = None  # auto's rule for this call, once asked
    if known is not None and known.per_call:
        takes = _rule_takes(logits, bound, cooperative_rows)
        if not takes:  # auto leaves it to vLLM: no layout check either
            stats.record_topk(False, captured)
            stock()
            return
    if serves(logits, lengths, out, k):
        choice = known if known is not None or _forced is not None else decide(
            _index_of(logits))
        own = bool(_forced or (choice.own and (not choice.per_call or (
            takes if takes is not None else _rule_takes(logits, bound, cooperative_rows)))))
        stats.record_topk(own, captured)
        if own:
            cuda_topk.launch_checked(logits, lengths, k, out, bound=bound)
            return
    stock()


def _index_of(logits) -> int:
    index = logits.device.index
    return torch.cuda.current_device() if index is None else index


def _rule_takes(logits, bound: int | None, cooperative_rows: int) -> bool:
    """:func:`measured_faster` for a call on these 2-D logits (tensor
    metadata only): the bound clamped to their width, the longest row the
    plan sizes for."""
    shape = getattr(logits, "shape", ())
    if bound is None or len(shape) != 2:
        return False
    return measured_faster(shape[0], min(bound, shape[1]), num_sms(_index_of(logits)),
                           cooperative_rows)


def reset() -> None:
    """Forget the per-device decisions (tests; a changed environment)."""
    global _forced
    with _lock:
        _choices.clear()
        _forced = None
