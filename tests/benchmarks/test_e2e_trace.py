"""benchmarks/e2e_trace.py: profiled windows read back (the kernels' classes
and the indexer's share per step, the window table)."""

import gzip
import importlib.util
import json
import os
import random

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "e2e_trace.py")
_spec = importlib.util.spec_from_file_location("e2e_trace", _PATH)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_trace_summary_classifies_kernels_per_step(tmp_path):
    events = [
        {"cat": "kernel", "name": "varlen_logits_sm90", "dur": 40.0},
        {"cat": "kernel", "name": "varlen_plan_sm90", "dur": 6.0},
        {"cat": "kernel", "name": "void persistent_topk_kernel<...>", "dur": 20.0},
        {"cat": "kernel", "name": "void deep_gemm::sm90_fp8_paged_mqa_logits<...>", "dur": 30.0},
        {"cat": "kernel", "name": "ampere_bf16_gemm", "dur": 104.0},
        {"cat": "cpu_op", "name": "varlen_logits_sm90", "dur": 999.0},  # not a kernel
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = e2e.summarize_trace(str(path), steps=2)
    assert s["gpu_us_per_step"] == pytest.approx(100.0)
    assert s["indexer_us_per_step"] == pytest.approx(48.0)
    assert s["indexer_share"] == pytest.approx(0.48)
    assert s["plan_us_per_step"] == pytest.approx(3.0)
    assert s["by_class_us_per_step"]["logits_deepgemm"] == pytest.approx(15.0)


@pytest.mark.parametrize("seed", range(5))
def test_the_window_span_and_busy_fraction_count_overlaps_once(seed):
    """A window's span per step and the fraction some kernel ran, against a
    microsecond timeline marked kernel by kernel (random, overlapping,
    gapped kernels; host events ignored)."""
    rng = random.Random(seed)
    events, marked = [], set()
    for _ in range(rng.randint(1, 40)):
        ts, dur = rng.randint(0, 2000), rng.randint(1, 150)
        events.append({"cat": "kernel", "name": f"k{rng.randint(0, 5)}", "ts": ts, "dur": dur})
        marked.update(range(ts, ts + dur))
    events.append({"cat": "cpu_op", "name": "host", "ts": 5000, "dur": 10})
    kernels = [e for e in events if e["cat"] == "kernel"]
    first = min(e["ts"] for e in kernels)
    span = max(e["ts"] + e["dur"] for e in kernels) - first
    steps = rng.randint(1, 4)
    s = e2e.summarize_from_events(events, steps)
    assert s["window_us_per_step"] == pytest.approx(span / steps)
    assert s["gpu_busy_fraction"] == pytest.approx(len(marked) / span)
    assert "window_us_per_step" not in e2e.summarize_from_events(
        [{"cat": "kernel", "name": "k", "dur": 3.0}], 1)  # no timestamps: no window


@pytest.mark.parametrize("seed", range(3))
def test_the_share_table_lists_every_window_with_its_modes_figures(seed):
    """The printed window table: a line per traced (k, batch, prompt), each
    mode's share and times from its own window, the plugin's path counts."""
    rng = random.Random(seed)
    cases = rng.sample([(b, x) for b in (1, 8, 32, 64) for x in (4096, 16384, 32768)], 4)

    def w(b, x):
        return {"batch": b, "prompt": x, "indexer_share": rng.uniform(0.05, 0.5),
                "indexer_us_per_step": rng.uniform(100, 3000),
                "gpu_us_per_step": rng.uniform(5000, 30000),
                "paths": {"varlen": rng.randint(0, 3), "stock_native": rng.randint(0, 3)},
                "decoding": [b] * 3,
                **({"gpu_busy_fraction": rng.uniform(0.3, 1.0)} if rng.random() < 0.7 else {})}
    traces = {m: [w(b, x) for b, x in cases] for m in ("stock", "plugin")}
    text = e2e.share_table({"per_k": {"2": {"traces": traces}}})
    for i, (b, x) in enumerate(cases):
        line = [s for s in text.splitlines() if s.startswith(f"| 2 | {b} | {x // 1024}K |")]
        assert len(line) == 1
        cols = [c.strip() for c in line[0].split("|")[1:-1]]
        s, p = traces["stock"][i], traces["plugin"][i]
        assert cols[3] == f"{100 * s['indexer_share']:.0f} % / {100 * p['indexer_share']:.0f} %"
        assert cols[5] == f"{s['gpu_us_per_step'] / 1e3:.2f} / {p['gpu_us_per_step'] / 1e3:.2f}"
        want = ", ".join(f"{k} {n}" for k, n in p["paths"].items() if n) or "-"
        assert cols[6] == want and cols[7] == f"{b} {b} {b} / {b} {b} {b}"
        busy = [f"{100 * t['gpu_busy_fraction']:.0f} %" if "gpu_busy_fraction" in t else "-"
                for t in (s, p)]  # windows before the field: "-"
        assert cols[8] == " / ".join(busy)
