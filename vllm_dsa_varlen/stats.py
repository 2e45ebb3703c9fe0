"""Per-step decode-path counters: which path each indexer decode step took
(and which decode top-k each dispatched call took).

The builders record one entry per metadata build with decode requests (a
dict increment on the host), so a run can say how many decode steps took the
varlen kernel, stock's native or flattened call, or avoided stock's split,
and how many were variable or mixed with prefills.  The offline benchmark
reads them in its own process; a server's engine core writes them to its log
as one line (:data:`LINE`, parsed by :func:`parse_line` in
``benchmarks/serve.py``) at most every :data:`LOG_EVERY_S` seconds and at
exit.  Nothing here imports vLLM.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.util
import os
import threading
import time
from collections import Counter

__all__ = ["PATHS", "TOPK", "LINE", "LOG_EVERY_S", "record", "record_topk", "snapshot",
           "reset", "parse_line"]

# varlen: the varlen kernel (every varlen row of the decode-path table);
# stock_native: stock's native [B, next_n] DeepGEMM call (also plain 1-token steps);
# stock_flattened: stock's id-less DeepGEMM call on one row per token;
# split_avoided: a step stock would split to the prefill path, run as a varlen decode;
# stock_split: a step stock splits, left to stock by the per-step rules.
PATHS = ("varlen", "stock_native", "stock_flattened", "split_avoided", "stock_split")
# The decode top-k calls the project's dispatch decided (topk.dispatch, where the
# project's top-k serves the device): the project's or vLLM's, run eagerly or
# recorded into a CUDA graph (counted once per capture, not per replay).
TOPK = ("own_eager", "own_captured", "vllm_eager", "vllm_captured")

# The log line: this prefix, then one JSON object: the process id, ``t`` (when
# the line was written), ``as_of`` (when the last step it counts was
# recorded), ``final`` (written at exit) and :func:`snapshot`'s counts.
LINE = "vllm-dsa-varlen: decode steps "
# vLLM logs its own engine stats every 10 s by default; the same pace here.
LOG_EVERY_S = 10.0

logger = logging.getLogger("vllm.dsa_varlen")
_clock = time.time  # wall time, comparable across processes; replaced in tests

_lock = threading.Lock()
_counts: Counter = Counter()
# The log's state in this process: the counts' version (one per record, or
# reset), the version and time of the last line, when the last step was
# recorded, and the process whose exit writes the final line.
_version = 0
_logged_version = 0
_logged_at = float("-inf")
_last_step_at: float | None = None
_exit_pid: int | None = None
_final_written_pid: int | None = None


def record(path: str, *, variable: bool, mixed: bool) -> None:
    """Count one decode step's path (``path`` one of :data:`PATHS`).

    Host work only: a clock read, and at most every :data:`LOG_EVERY_S`
    seconds one log line holding the counts *before* this step, so after an
    idle spell of that length the line written at the next step is exactly
    what ran before it."""
    global _version, _logged_version, _logged_at, _last_step_at
    if path not in PATHS:
        raise ValueError(f"path: expected one of {', '.join(PATHS)}, got {path!r}")
    now = _clock()
    line = None
    with _lock:
        if _exit_pid != os.getpid():
            _arm_final_line()
        if _version != _logged_version and now - _logged_at >= LOG_EVERY_S:
            line = _line(now, final=False)
            _logged_version, _logged_at = _version, now
        _counts[("steps", path)] += 1
        if variable:
            _counts[("variable", path)] += 1
        if mixed:
            _counts[("mixed", path)] += 1
        _version += 1
        _last_step_at = now
    if line is not None:
        logger.info("%s", line)


def record_topk(own: bool, captured: bool) -> None:
    """Count one decode top-k call decided by the dispatch (:data:`TOPK`)."""
    key = ("own_" if own else "vllm_") + ("captured" if captured else "eager")
    with _lock:
        _counts[("topk", key)] += 1


def snapshot() -> dict[str, dict[str, int]]:
    """``{"steps" | "variable" | "mixed": {path: count}, "topk": {call: count}}``
    (every path and call kind listed)."""
    with _lock:
        return _snapshot_locked()


def reset() -> None:
    global _version
    with _lock:
        _counts.clear()
        _version += 1


def _snapshot_locked() -> dict[str, dict[str, int]]:
    got = {kind: {p: _counts[(kind, p)] for p in PATHS} for kind in ("steps", "variable", "mixed")}
    got["topk"] = {c: _counts[("topk", c)] for c in TOPK}
    return got


def _line(now: float, *, final: bool) -> str:
    payload = {"pid": os.getpid(), "t": now, "as_of": _last_step_at, "final": final,
               **_snapshot_locked()}
    return LINE + json.dumps(payload, separators=(",", ":"))


def _arm_final_line() -> None:
    """Have this process write the final line when it exits (called at its
    first record).  ``atexit`` serves a normal exit; a forked
    ``multiprocessing`` child (vLLM's engine core may be one) leaves through
    ``os._exit`` after running its finalizers, so one is registered too."""
    global _exit_pid
    _exit_pid = os.getpid()
    atexit.register(_write_final_line)
    multiprocessing.util.Finalize(None, _write_final_line, exitpriority=0)


def _write_final_line() -> None:
    """The final line, once per process, holding every count."""
    global _final_written_pid
    with _lock:
        if _final_written_pid == os.getpid() or _exit_pid != os.getpid():
            return
        _final_written_pid = os.getpid()
        line = _line(_clock(), final=True)
    logger.info("%s", line)


def parse_line(text: str) -> dict | None:
    """The counts a log line holds (:data:`LINE`), or ``None`` for any other
    line; text before the prefix (a process tag, a time) is ignored."""
    at = text.find(LINE)
    if at < 0:
        return None
    try:
        got = json.loads(text[at + len(LINE):].strip())
    except ValueError:
        return None
    return got if isinstance(got, dict) and "steps" in got else None
