"""Timing helpers the benchmark's modes share (:mod:`.logits`,
:mod:`.schedule`, :mod:`.launch`, :mod:`.builds`; the order of
rounds also ``benchmarks/e2e_decode.py``'s): ``torch`` is passed in, so
importing this module loads nothing."""

from __future__ import annotations


def capture_graph(torch, fn, copies: int = 1):
    """``fn`` captured ``copies`` times in one CUDA graph, after one eager run
    and one on a side stream (compiles, allocator warm-up), as capture needs."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(copies):
            fn()
    return graph


# What the L2 holds when a timed call starts (``--flush``): "zero" Triton's
# do_bench flush (a 256 MB buffer written: every line dirty); "read" the same
# buffer read (every line clean), as a decode step leaves it after the GEMMs
# that read the layer's weights.  "read" is the default: it reproduced the
# kernels' times traced in vLLM's engine, where "zero" moved them apart
# (BENCHMARKS.md, how it is measured).
FLUSHES = ("read", "zero")
FLUSH_BYTES = 256 << 20


def graph_replay_us(torch, do_bench, fn, rep_ms: int, flush: str = FLUSHES[0]) -> float:
    """Median µs of ``fn`` captured in a CUDA graph (:func:`capture_graph`) and
    replayed, the L2 flushed before every replay as ``flush`` says
    (:data:`FLUSHES`, the first the default, as ``--flush``'s; "zero" is
    ``do_bench``'s own)."""
    if flush not in FLUSHES:
        raise ValueError(f"flush: expected one of {FLUSHES}, got {flush!r}")
    graph = capture_graph(torch, fn)
    if flush == "zero":
        return do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median") * 1e3
    return read_flush_replay_us(torch, graph, rep_ms)


def read_flush_replay_us(torch, graph, rep_ms: int, warmup_ms: int = 25) -> float:
    """Median µs of ``graph``'s replays, each after a read of
    :data:`FLUSH_BYTES` (the L2 left holding clean lines), timed alone
    between two events; as many replays as fit ``rep_ms`` after
    ``warmup_ms`` of untimed ones."""
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    buf.zero_()
    sink = torch.empty((), dtype=torch.int32, device="cuda")

    def flush():
        torch.amax(buf, dim=0, out=sink)

    def timed(n: int) -> list:
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(n)]
        for start, end in pairs:
            flush()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in pairs]

    estimate_ms = max(sum(timed(5)) / 5, 1e-3)
    timed(max(1, int(warmup_ms / estimate_ms)))
    times = sorted(timed(max(1, int(rep_ms / estimate_ms))))
    return times[len(times) // 2] * 1e3


def order_cycle(n: int) -> int:
    """Rounds in one cycle of :func:`round_order` for ``n`` paths."""
    return n if n % 2 == 0 or n == 1 else 2 * n


def round_order(names: list, r: int, fixed: bool = False) -> list:
    """The order in which round ``r`` times ``names``: a balanced Latin square
    (Williams): over one cycle (:func:`order_cycle` rounds) every path runs
    once per round, leads equally often, and follows every other path equally
    often.  A timed path inherits the machine state its predecessor left (a
    large step timed right after light ones reads faster than the same binary
    timed after a large step), so only a balance of predecessors makes paths
    comparable.  ``fixed``: the given order every round (the control)."""
    n = len(names)
    if fixed or n < 2:
        return list(names)
    seq, lo, hi = [0], 1, n - 1
    while len(seq) < n:
        seq.append(lo)
        lo += 1
        if len(seq) < n:
            seq.append(hi)
            hi -= 1
    r %= order_cycle(n)
    row = [names[(j + r) % n] for j in seq]
    return row if r < n else row[::-1]
