"""Per-step decode-path counters: which path each indexer decode step took.

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

__all__ = ["PATHS", "record", "snapshot", "reset"]

# varlen: the varlen kernel (every varlen row of the decode-path table);
# stock_native: stock's native [B, next_n] DeepGEMM call (also plain 1-token steps);
# stock_flattened: stock's id-less DeepGEMM call on one row per token;
# split_avoided: a step stock would split to the prefill path, run as a varlen decode;
# stock_split: a step stock splits, left to stock by the per-step rules.
PATHS = ("varlen", "stock_native", "stock_flattened", "split_avoided", "stock_split")

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


def snapshot() -> dict[str, dict[str, int]]:
    """``{"steps" | "variable" | "mixed": {path: count}}`` (every path listed)."""
    with _lock:
        return {kind: {p: _counts[(kind, p)] for p in PATHS}
                for kind in ("steps", "variable", "mixed")}


def reset() -> None:
    with _lock:
        _counts.clear()
