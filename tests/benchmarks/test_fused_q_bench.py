"""benchmarks/fused_q_bench.py on the CPU: its cases and its timing loop with
the GPU's graph capture and events stood in for (the timings themselves need a
GPU), so that a device run does not find a broken harness.  What is checked:
each case's label and bytes moved, every implementation timed once per round,
and the byte comparison against the first ("vllm") implementation, which must
count the bytes an implementation gets wrong."""

from __future__ import annotations

import importlib.util
import os
import time
import types

import pytest
import torch

from vllm_dsa_varlen.ops import triton_indexer_q as iq

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "fused_q_bench.py")
_spec = importlib.util.spec_from_file_location("fused_q_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


class _Graph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


class _Event:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


@pytest.fixture
def no_gpu_timing(monkeypatch):
    monkeypatch.setattr(bench, "capture_graph", lambda torch_, fn, copies: _Graph(fn))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


@pytest.mark.interpreter
def test_indexer_q_cases_and_the_byte_comparison(no_gpu_timing, monkeypatch):
    """The indexer-query cases with the project's kernel standing for vLLM's
    function (CUDA-only) and one implementation that flips a weight's sign:
    the comparison counts exactly that byte range as differing."""
    sai = pytest.importorskip("vllm.model_executor.layers.sparse_attn_indexer")
    monkeypatch.setattr(sai, "fused_indexer_q_rope_quant", lambda *a: iq.indexer_q(*a),
                        raising=False)
    args = types.SimpleNamespace(kernel="indexer_q", tokens=[3], heads=[16],
                                 blocks=["4/1", "1/1"], rounds=2, copies=1, replays=1)
    (label, impls, moved), = list(bench.indexer_q_cases(args, torch.device("cpu")))
    assert label == {"path": "indexer", "heads": 16, "tokens": 3}
    assert moved == bench.indexer_q_bytes({"q": torch.empty(3, 16, 128)}) == 3 * 16 * (128 * 3 + 6)
    assert list(impls) == ["vllm", "ours 4/1", "ours 1/1"]

    def wrong():
        q8, w = impls["ours 4/1"]()
        w[1, 2] = -w[1, 2]
        return q8, w

    impls["wrong"] = wrong
    equal, differing, times = bench.time_case(impls, bench.OUTPUTS["indexer_q"], args)
    assert equal == {"vllm": True, "ours 4/1": True, "ours 1/1": True, "wrong": False}
    assert differing["wrong"] == {"q_fp8": 0, "weights_out": 1}  # the sign byte of one float
    assert all(len(v) == 2 and all(t >= 0 for t in v) for v in times.values())


def test_blocks_are_parsed_or_refused_by_name():
    assert bench.parse_indexer_blocks("8/2") == (8, 2)
    blocks, pdl = bench.parse_blocks("4/16/2/2/1", False)
    assert (blocks.index, blocks.pe, blocks.nope, blocks.warps, pdl) == (4, 16, 2, 2, True)
    for bad, parse in (("8", bench.parse_indexer_blocks), ("4/8/2", lambda t: bench.parse_blocks(t, False))):
        with pytest.raises(SystemExit, match="--blocks"):
            parse(bad)
