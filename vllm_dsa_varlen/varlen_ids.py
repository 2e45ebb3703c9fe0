"""How a decode step's run ids travel from the metadata builder to the kernel call.

The indexer op hands the kernel call fields of the decode metadata, not the
metadata, so the ids need a carrier among those arguments: the builder gives
each varlen step a fresh view of its graph-stable scheduler-metadata buffer
(same storage) tagged with the step's ids (:func:`attach_varlen_ids`), and
the kernel-call replacement reads the tag off the tensor it gets.  The tag
lives on the step's own tensor, so no other step can pick it up; untagged
calls take stock's path.  A builder also records what its id buffer holds
(:func:`ids_hold`, :class:`ids_written`), so a uniform step's ids are written
only when they change.  Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

_ATTR = "_vllm_dsa_varlen_ids"
_BOUND_ATTR = "_vllm_dsa_varlen_bound"
BACKENDS = ("deepgemm", "own")  # DeepGEMM with ids, or the project's kernels


class VarlenTag(NamedTuple):
    """``ids``: int32 ``[R]`` run ids; ``backend``: ``"deepgemm"`` | ``"own"``;
    ``max_run_len``: the step's longest run as the host knows it (a sizing hint
    for the project's kernel; correctness never depends on it); ``schedules``: the
    step's planned kernel schedules, filled by the first layer's call and read
    by the others (``varlen_paged_mqa_logits(schedule_cache=...)``);
    ``max_context``: the step's longest context as the host knows it (vLLM's
    ``max_seq_len``; a bound for the decode top-k, :func:`mark_bound`), or
    ``None``."""

    ids: torch.Tensor
    backend: str
    max_run_len: int = 1
    schedules: dict | None = None
    max_context: int | None = None


def attach_varlen_ids(schedule: torch.Tensor, ids: torch.Tensor, backend: str,
                      max_run_len: int = 1, max_context: int | None = None) -> torch.Tensor:
    """Return a fresh view of ``schedule`` (same storage) tagged with ``ids``.

    ``schedule``: the builder's scheduler-metadata buffer (any shape/dtype).
    ``ids``: int32 ``[R]``.  ``backend``: ``"deepgemm"`` or ``"own"``.
    ``max_run_len``: the step's longest request in tokens (>= 1);
    ``max_context``: the step's longest context (>= 1) or ``None``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32 or ids.dim() != 1:
        raise ValueError(f"ids: expected an int32 [R] tensor, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} "
                         f"{tuple(getattr(ids, 'shape', ()))}")
    if not isinstance(max_run_len, int) or max_run_len < 1:
        raise ValueError(f"max_run_len: expected an int >= 1, got {max_run_len!r}")
    if max_context is not None and (not isinstance(max_context, int) or max_context < 1):
        raise ValueError(f"max_context: expected an int >= 1 or None, got {max_context!r}")
    view = schedule.view(schedule.shape)
    setattr(view, _ATTR, VarlenTag(ids, backend, max_run_len, {}, max_context))
    return view


def varlen_ids_of(schedule: object) -> VarlenTag | None:
    """The tag :func:`attach_varlen_ids` put on ``schedule``, or ``None``."""
    return getattr(schedule, _ATTR, None)


def mark_bound(logits: torch.Tensor, bound: int | None) -> torch.Tensor:
    """Tag a step's decode logits (the tensor object the indexer hands its
    top-k) with the host's bound on its rows' lengths; returns ``logits``.
    Like the ids' tag, it lives on that step's own tensor object."""
    if bound is not None:
        setattr(logits, _BOUND_ATTR, bound)
    return logits


def bound_of(logits: object) -> int | None:
    """The bound :func:`mark_bound` put on ``logits``, or ``None``."""
    return getattr(logits, _BOUND_ATTR, None)


def first_rows(rows: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of a step's per-row tensors (run ids, context lengths, the per-row
    block table) cut to its first ``rows`` rows for a call of fewer query
    rows (stock's one dummy row of a decode batch without tokens); the tensor
    itself where it has ``rows`` rows or fewer (too few rows are for the
    kernel's checks to name).  Callers test for a cut first: a view made, or
    this call, costs host time on every layer."""
    return tuple([t if t.shape[0] <= rows else t[:rows] for t in tensors])


# --------------------------------------------------------------- the id buffer's record

def ids_hold(holder: Any, run_len: int, num_rows: int) -> bool:
    """Whether the id buffer of ``holder`` (a builder) already holds ``r //
    run_len`` for ``r < num_rows``, by its record of its own last write
    (``holder._varlen_ids_layout``: ``(n, rows)``; ``(0, 0)``: unknown)."""
    held_len, held_rows = holder._varlen_ids_layout
    return held_len == run_len and held_rows >= num_rows


class ids_written:  # noqa: N801 -- a context manager used as a function, as contextlib.suppress
    """Around a write of ``holder``'s id buffer: the record is cleared first (a
    write that fails leaves it unknown) and set to ``layout`` after (``(n,
    rows)``: ``ids[r] == r // n`` for ``r < rows``; ``None``: any other ids).
    ``skip``: no write happens, the record stands.  (A class, not a generator:
    builders enter it on every step, and a class makes fewer Python calls.)"""

    __slots__ = ("holder", "layout", "skip")

    def __init__(self, holder: Any, layout: tuple[int, int] | None, skip: bool = False):
        self.holder, self.layout, self.skip = holder, layout, skip

    def __enter__(self) -> None:
        if not self.skip:
            self.holder._varlen_ids_layout = (0, 0)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None and not self.skip and self.layout is not None:
            self.holder._varlen_ids_layout = self.layout
        return False
