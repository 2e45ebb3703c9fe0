"""CUDA-graph timing helpers the benchmark's modes share (:mod:`.bench`,
:mod:`.bench_plan`, :mod:`.bench_launch`): ``torch`` is passed in, so
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
