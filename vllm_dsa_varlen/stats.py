"""Per-step decode-path counters: which path each indexer decode step took
(and which decode top-k each dispatched call took).

The builders record one entry per metadata build that has decode requests
(host values only: a dict increment, no device work), so a run can say how
many decode steps took the varlen kernel, stock's native or flattened
DeepGEMM call, or avoided stock's split, and how many of those steps were
variable (requests with different token counts) or mixed (prefills in the
same step, where vLLM runs the indexer op outside the piecewise CUDA graphs).
The end-to-end benchmark reads them from the engine's process
(``benchmarks/e2e_decode.py``).  Nothing here imports vLLM.
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["PATHS", "TOPK", "record", "record_topk", "snapshot", "reset"]

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

_lock = threading.Lock()
_counts: Counter = Counter()


def record(path: str, *, variable: bool, mixed: bool) -> None:
    """Count one decode step's path (``path`` one of :data:`PATHS`)."""
    if path not in PATHS:
        raise ValueError(f"path: expected one of {', '.join(PATHS)}, got {path!r}")
    with _lock:
        _counts[("steps", path)] += 1
        if variable:
            _counts[("variable", path)] += 1
        if mixed:
            _counts[("mixed", path)] += 1


def record_topk(own: bool, captured: bool) -> None:
    """Count one decode top-k call decided by the dispatch (:data:`TOPK`)."""
    key = ("own_" if own else "vllm_") + ("captured" if captured else "eager")
    with _lock:
        _counts[("topk", key)] += 1


def snapshot() -> dict[str, dict[str, int]]:
    """``{"steps" | "variable" | "mixed": {path: count}, "topk": {call: count}}``
    (every path and call kind listed)."""
    with _lock:
        got = {kind: {p: _counts[(kind, p)] for p in PATHS}
               for kind in ("steps", "variable", "mixed")}
        got["topk"] = {c: _counts[("topk", c)] for c in TOPK}
        return got


def reset() -> None:
    with _lock:
        _counts.clear()
