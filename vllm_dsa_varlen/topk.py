"""The indexer's decode top-k: this project's kernel in place of vLLM's where it serves.

vLLM's decode top-k (``persistent_topk``, ``cooperative_topk``) reads the
logits the indexer's decode kernel wrote, once per layer;
:func:`.ops.cuda_topk.decode_topk` meets the same contract
(:func:`.ops.reference.topk_ref`) in one launch.  ``DSA_VARLEN_TOPK``
(:mod:`.settings`): ``own`` takes it on sm_90 for every call it serves,
``vllm`` never, ``auto`` (the default) where it was measured faster
(:func:`measured_faster`).  The choice per process and device is made once
(:func:`choose_topk`, pure; logged once); the per-call check reads tensor
metadata only (no sync, graph safe).  The vLLM lines call :func:`dispatch`
from their patched call sites.  Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from . import settings, stats
from .settings import MODE_ENV, TOPK_ENV
from .ops import cuda_topk
from .ops.common import num_sms

CAPABILITY = (9, 0)
# Where ``auto`` takes the project's top-k (measured_faster): calls like those
# where it was faster than vLLM 0.27.1's and 0.33.0's top-k; on the others timed
# (few or short rows, more long rows than SMs) it was level or slower
# (BENCHMARKS.md, "The decode top-k").
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
    """The top-k for a device (pure): vLLM's under ``DSA_VARLEN=off`` /
    ``stock`` or ``DSA_VARLEN_TOPK=vllm``, off sm_90, or where the
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
            mode, setting = settings.get(MODE_ENV), settings.get(TOPK_ENV)
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
    available: that reads the environment and queries the driver on every
    eager layer)."""
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
