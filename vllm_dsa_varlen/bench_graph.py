"""Timing helpers the benchmark's modes share (:mod:`.bench`,
:mod:`.bench_plan`, :mod:`.bench_launch`, :mod:`.bench_builds`; the order of
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


def graph_replay_us(torch, do_bench, fn, rep_ms: int) -> float:
    """Median µs of ``fn`` captured in a CUDA graph (:func:`capture_graph`) and
    replayed (``do_bench`` flushes the L2 before every run)."""
    graph = capture_graph(torch, fn)
    return do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def order_cycle(n: int) -> int:
    """Rounds in one cycle of :func:`round_order` for ``n`` paths."""
    return n if n % 2 == 0 or n == 1 else 2 * n


def round_order(names: list, r: int, fixed: bool = False) -> list:
    """The order in which round ``r`` times ``names``: a balanced Latin square
    (Williams): over one cycle (:func:`order_cycle` rounds) every path runs
    once per round, leads equally often, and follows every other path equally
    often.  A timed path inherits the machine state its predecessor left (on
    the H200 a large step timed right after the light schedule timings read
    3-5 % faster than the same binary timed after a large step), so only a
    balance of predecessors makes paths comparable.  ``fixed``: the given
    order every round (the control)."""
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
