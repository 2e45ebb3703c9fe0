"""Decode-row planning: one pure function that turns a decode batch into rows.

The varlen layout flattens a decode step to one row per query token and ties
the rows of one request together with a run id (:class:`DecodeRows`).
:func:`plan_decode_rows` is its single source: the vLLM builders, the kernel
tests and the benchmark all call it.  It issues device ops only, so the
uniform path never synchronises with the host and can run under CUDA-graph
capture; host-side facts (row counts, uniformity) come in as Python ints, as
vLLM has them on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeRows:
    """Rows of one decode step in the varlen layout.  Request ``b`` of the step
    carries ``n_b`` query tokens and ``seq_lens[b]`` tokens of KV including them.

    ``indices``: int32 ``[R]`` run ids: a request is a maximal run of equal
    adjacent ids; real rows carry their request's index ``b``, padding rows
    ids of their own.  ``context_lens``: int32 ``[R]``, the ``j``-th token's
    causal context ``seq_lens[b] - n_b + j + 1``, clamped at 0 (graph-padding
    requests have ``seq_len == 0``).  ``block_table``: int32 ``[R, W]``, the
    request's block-table row on each of its rows (a kernel reads the run's
    first).  ``num_rows``: ``R``.
    """

    indices: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    num_rows: int


@dataclass
class DecodeRowBuffers:
    """Preallocated outputs for :func:`plan_decode_rows` (stable addresses).

    ``indices`` int32 ``[N]`` must start 8-byte aligned (DeepGEMM scans the
    ids two at a time); ``context_lens`` int32 ``[N]``; ``block_table`` int32
    ``[N, W]``; ``arange`` int32 ``[>= N]`` holding ``0..N-1``; ``ramp``
    (optional, read only) int32 ``[M]`` holding ``-(M-1)..0``: its last ``n``
    entries are the per-token offsets ``j - n + 1`` of an ``n``-token request,
    so a uniform step with ``n <= M`` needs no op to make them.
    """

    indices: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    arange: torch.Tensor
    ramp: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_rows: int, block_table_width: int,
                 device: torch.device | str) -> "DecodeRowBuffers":
        return cls(
            indices=torch.zeros(max_rows, dtype=torch.int32, device=device),
            context_lens=torch.zeros(max_rows, dtype=torch.int32, device=device),
            block_table=torch.zeros((max_rows, block_table_width), dtype=torch.int32,
                                    device=device),
            arange=torch.arange(max_rows, dtype=torch.int32, device=device),
            ramp=make_ramp(max_rows, device),
        )


def make_ramp(length: int, device: torch.device | str) -> torch.Tensor:
    """int32 ``[length]`` holding ``-(length-1)..0`` (``DecodeRowBuffers.ramp``)."""
    return torch.arange(1 - length, 1, dtype=torch.int32, device=device)


def _check_inputs(seq_lens, query_start_loc, block_table, num_rows, uniform_len):
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected a 1-D tensor [B], got shape {tuple(seq_lens.shape)}")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(
            f"query_start_loc: expected shape [{num_reqs + 1}] (B + 1), "
            f"got {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table: expected a 2-D tensor with at least {num_reqs} rows, "
            f"got shape {tuple(block_table.shape)}")
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc),
                    ("block_table", block_table)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected an integer tensor, got {t.dtype}")
    if num_rows < 0:
        raise ValueError(f"num_rows: expected >= 0, got {num_rows}")
    if uniform_len is not None:
        if uniform_len < 1:
            raise ValueError(f"uniform_len: expected >= 1, got {uniform_len}")
        if num_rows != num_reqs * uniform_len:
            raise ValueError(
                f"num_rows: a uniform batch of {num_reqs} requests x {uniform_len} "
                f"tokens has {num_reqs * uniform_len} rows, got {num_rows}")


def plan_decode_rows(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_rows: int,
    uniform_len: int | None = None,
    num_tokens: int | None = None,
    out: DecodeRowBuffers | None = None,
    indices_ready: bool = False,
    decode_lens: torch.Tensor | None = None,
) -> DecodeRows:
    """Flatten a decode batch into varlen rows.

    Args:
        seq_lens: int ``[B]``, KV length of each request including its new tokens.
        query_start_loc: int ``[B + 1]``, cumulative query-token offsets (may
            start at a non-zero offset; only differences are used).
        block_table: int32 ``[>= B, W]``, one block-table row per request.
        num_rows: ``R``, the number of rows to produce.
        num_tokens: for a variable batch, the total query tokens
            ``sum(n_b)`` as the host knows it (default ``R``); rows past it are
            padding rows (ids of their own, context 0, block-table row of 0s).
        uniform_len: every request has exactly this many tokens
            (``R == B * uniform_len``): ids are ``r // uniform_len``, computed
            without any data-dependent shape.
        out: buffers to write into (e.g. a CUDA-graph-stable workspace); fresh
            tensors when ``None``.
        indices_ready: uniform batches only: ``out.indices[:num_rows]``
            already holds this step's ids ``r // uniform_len`` (the caller
            knows it wrote them and nothing else has since); they are not
            rewritten.
        decode_lens: int ``[B]``, ``query_start_loc[1:] - query_start_loc[:-1]``
            when the caller already has them on the device (saves that op).

    Returns:
        :class:`DecodeRows` whose tensors are views of ``out`` when given.
    """
    _check_inputs(seq_lens, query_start_loc, block_table, num_rows, uniform_len)
    if indices_ready and (uniform_len is None or out is None):
        raise ValueError("indices_ready: only for a uniform batch planned into `out`")
    width = block_table.shape[1]
    if out is None:
        out = DecodeRowBuffers.allocate(num_rows, width, seq_lens.device)
    else:
        _check_out(out, num_rows, width)
    ids = out.indices[:num_rows]
    ctx = out.context_lens[:num_rows]
    rows_bt = out.block_table[:num_rows, :width]
    if num_rows:
        seq = seq_lens.to(torch.int32)
        if uniform_len is not None:
            _uniform_rows(seq, block_table, out, ids, ctx, rows_bt, uniform_len, indices_ready)
        else:
            _variable_rows(seq, query_start_loc, block_table, out, ids, ctx, rows_bt, num_tokens,
                           decode_lens)
    return DecodeRows(ids, ctx, rows_bt, num_rows)


def _check_out(out: DecodeRowBuffers, num_rows: int, width: int) -> None:
    """``ValueError`` naming the buffer of ``out`` too small for ``num_rows``
    rows of a block table ``width`` wide."""
    for name in ("indices", "context_lens", "block_table", "arange"):
        held = getattr(out, name).shape[0]
        if held < num_rows:
            raise ValueError(f"out.{name}: holds {held} rows, {num_rows} needed")
    if out.block_table.shape[1] < width:
        raise ValueError(f"out.block_table: width {out.block_table.shape[1]} < block_table width "
                         f"{width}")


def _uniform_rows(seq, block_table, out, ids, ctx, rows_bt, n: int, indices_ready: bool) -> None:
    """Every request has ``n`` tokens: request b's rows are rows b*n .. b*n+n-1,
    so every output is a broadcast over a ``[B, n]`` view (no index tensor)."""
    num_reqs, width = seq.shape[0], rows_bt.shape[1]
    if not indices_ready:
        torch.div(out.arange[:ids.shape[0]], n, rounding_mode="floor", out=ids)
    ramp = out.ramp
    if ramp is not None and ramp.shape[0] >= n:
        ramp = ramp[ramp.shape[0] - n:]
    else:
        ramp = out.arange[:n] - (n - 1)
    torch.add(seq.unsqueeze(1), ramp, out=ctx.view(num_reqs, n))
    ctx.clamp_min_(0)
    rows_bt.view(num_reqs, n, width).copy_(block_table[:num_reqs].unsqueeze(1))


def _variable_rows(seq, query_start_loc, block_table, out, ids, ctx, rows_bt,
                   num_tokens: int | None, decode_lens) -> None:
    """Variable lengths: the first ``num_tokens`` rows are real (their request
    index by repeat_interleave, sized from the host so no sync is needed); any
    rows after them are padding rows with ids of their own, context 0 and a
    block-table row of zeros."""
    num_rows, num_reqs = ids.shape[0], seq.shape[0]
    num_real = num_rows if num_tokens is None else num_tokens
    if not 0 <= num_real <= num_rows:
        raise ValueError(f"num_tokens: expected 0..{num_rows}, got {num_tokens}")
    qsl = query_start_loc.to(torch.int32)
    real_ids, real_ctx, real_bt = ids[:num_real], ctx[:num_real], rows_bt[:num_real]
    # The request of each real row (int32 [num_real]).
    if decode_lens is None:
        decode_lens = qsl[1:] - qsl[:-1]
    elif decode_lens.shape != (num_reqs,):
        raise ValueError(f"decode_lens: expected shape ({num_reqs},), "
                         f"got {tuple(decode_lens.shape)}")
    req = torch.repeat_interleave(decode_lens, output_size=num_real)
    real_ids.copy_(req)
    # Row r of request b (global row index r) sees seq_b - n_b + (r - start_b) + 1
    # tokens, start_b = qsl_b - qsl_0; with n_b = qsl_{b+1} - qsl_b that is
    # (seq_b - qsl_{b+1} + qsl_0) + (r + 1): one per-request offset, gathered.
    offset = torch.sub(seq, qsl[1:])
    offset.add_(qsl[:1])
    torch.index_select(offset, 0, req, out=real_ctx)
    rows = out.arange[:num_rows]
    if out.arange.shape[0] > num_real:
        real_ctx.add_(out.arange[1:num_real + 1])  # r + 1
    else:
        real_ctx.add_(rows[:num_real]).add_(1)
    real_ctx.clamp_min_(0)
    if real_bt.is_contiguous() and block_table.dtype == real_bt.dtype:
        torch.index_select(block_table, 0, req, out=real_bt)
    else:
        real_bt.copy_(block_table.index_select(0, req))
    if num_real < num_rows:
        torch.add(rows[num_real:], num_reqs, out=ids[num_real:])
        ctx[num_real:].zero_()
        rows_bt[num_real:].zero_()


def run_starts(indices: torch.Tensor) -> torch.Tensor:
    """Bool ``[R]``: row ``r`` starts a run (``r == 0`` or its id differs from
    row ``r - 1``'s)."""
    starts = torch.ones_like(indices, dtype=torch.bool)
    if indices.numel() > 1:
        starts[1:] = indices[1:] != indices[:-1]
    return starts


def run_ends(indices: torch.Tensor) -> torch.Tensor:
    """Bool ``[R]``: row ``r`` ends a run (``r == R - 1`` or its id differs from
    row ``r + 1``'s)."""
    ends = torch.ones_like(indices, dtype=torch.bool)
    if indices.numel() > 1:
        ends[:-1] = indices[:-1] != indices[1:]
    return ends
