"""The end-to-end benchmark's host-side logic (no GPU, no engine): prompts,
the comparison of two runs, the trace summary, the log facts."""

import gzip
import importlib.util
import json
import os
import random

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "e2e_decode.py")
_spec = importlib.util.spec_from_file_location("e2e_decode", _PATH)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_prompts_are_the_same_in_every_process_and_differ_between_requests():
    a = [e2e.prompt_ids(i, 4096, 4096) for i in range(8)]
    b = [e2e.prompt_ids(i, 4096, 4096) for i in range(8)]
    assert a == b
    assert len({tuple(p) for p in a}) == 8
    for p in a:
        assert 0.7 * 4096 <= len(p) <= 1.3 * 4096
        assert min(p) >= 2 and max(p) < 4096  # no bos / eos ids, inside the vocab


def test_tiny_config_has_the_real_indexer_and_the_asked_layers(tmp_path):
    path = e2e.write_tiny_config(str(tmp_path / "m"), 61)
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["num_hidden_layers"] == 61 and cfg["num_nextn_predict_layers"] == 1
    assert (cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]) == (64, 128, 2048)
    assert cfg["first_k_dense_replace"] >= 61  # dense MLPs in every layer


def _run(tokens):
    return {"k": 3, "cases": [{"batch": len(tokens), "prompt": 4096, "tokens_per_s": 100.0,
                               "tpot_ms": 2.0, "tokens": tokens,
                               "paths": {k: dict.fromkeys(("varlen",), 0)
                                         for k in ("steps", "variable", "mixed")}}]}


@pytest.mark.parametrize("seed", range(20))
def test_first_divergence_finds_the_first_differing_token(seed):
    rng = random.Random(seed)
    a = [[rng.randrange(100) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    b = [list(x) for x in a]
    assert e2e.first_divergence(a, b) is None
    r = rng.randrange(6)
    pos = rng.randrange(len(a[r]))
    b[r][pos] = a[r][pos] + 1
    for later in range(r + 1, 6):  # later requests differ too: the first one is reported
        b[later][0] += 1
    assert e2e.first_divergence(a, b) == {"request": r, "position": pos, "stock": a[r][pos],
                                          "plugin": a[r][pos] + 1}
    b = [list(x) for x in a]
    b[r] = b[r][:-1]
    assert e2e.first_divergence(a, b)["position"] == len(a[r]) - 1


def test_compare_reports_speed_and_identity():
    stock, plugin = _run([[1, 2, 3]]), _run([[1, 2, 4]])
    plugin["cases"][0]["tpot_ms"] = 1.6
    row = e2e.compare(stock, plugin)["rows"][0]
    assert row["speedup"] == pytest.approx(2.0 / 1.6)
    assert not row["tokens_identical"] and row["first_divergence"]["position"] == 2


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


def test_log_facts_reads_captures_and_plugin_lines(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text(
        "INFO vllm-dsa-varlen: DSA indexer decode path: varlen (triton): sm_90\n"
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 10%|#| 5/49\r"
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##| 49/49\n"
        "Capturing CUDA graphs (decode, FULL): 100%|##| 33/33\n"
        "INFO Graph capturing finished in 12 secs, took 1.2 GiB\n")
    facts = e2e.log_facts(str(log))
    assert facts["cuda_graphs_captured"] == {"mixed prefill-decode, PIECEWISE": 49,
                                             "decode, FULL": 33}
    assert facts["capture_log"] and "12 secs" in facts["capture_log"][0]
    assert facts["plugin_log"] == ["vllm-dsa-varlen: DSA indexer decode path: varlen (triton): sm_90"]


def test_repeat_spread_pairs_each_repeats_processes():
    def run(tpots):
        return {"cases": [{"batch": 8, "prompt": 4096, "tpot_ms": t} for t in tpots]}

    repeats = [{"stock": run([10.0, 20.0]), "plugin": run([12.5, 16.0])},
               {"stock": run([11.0, 21.0]), "plugin": run([11.0, 20.0])},
               {"stock": run([9.0, 20.0]), "plugin": None}]  # a failed process: skipped
    out = e2e.repeat_spread(repeats)
    assert [len(x["tpot_ms"]) for x in out] == [2, 2]
    assert out[0]["gain_min"] == pytest.approx(0.8) and out[0]["gain_max"] == pytest.approx(1.0)
    assert out[0]["gain_median"] == pytest.approx(0.9)
    assert out[1]["gain_median"] == pytest.approx((1.25 + 1.05) / 2)


def test_host_probe_measures_something():
    assert 0.0 < e2e.host_probe_us(200) < 1e5


@pytest.mark.parametrize("k", [1, 2, 3])
def test_capture_sizes_cover_every_case_and_shrinking_batches(k):
    batches = random.sample([1, 2, 4, 8, 16, 24, 32, 48, 64], 3)
    sizes = e2e.capture_sizes(batches, k)
    assert sizes == sorted(set(sizes))
    assert all(b * (k + 1) in sizes for b in batches)  # every measured decode step
    top = max(batches) * (k + 1)
    assert max(sizes) == top
    # any smaller step pads to a graph at most twice its size
    for n in range(1, top + 1):
        assert min(s for s in sizes if s >= n) < 2 * n or n == 1


# options only the parent process reads (the child gets its k, mode and repeat
# from run_child itself)
PARENT_ONLY = {"out", "model", "k", "repeats", "modes", "merge", "child", "mode", "repeat", "help"}


def test_every_engine_option_reaches_the_engine_process(tmp_path, monkeypatch):
    """run_child hands the child process every option that shapes the engine
    run, with the value given (a new option left out of its list would
    silently run the engine with the default)."""
    parser = e2e.build_parser()
    dests = {a.dest for a in parser._actions} - PARENT_ONLY
    argv = ["--out", str(tmp_path), "--model", "m"]
    want = {}
    for action in parser._actions:
        if action.dest not in dests:
            continue
        flag = action.option_strings[0]
        if action.choices:
            value = list(action.choices)[-1]
        elif action.type is float:
            value = round(random.uniform(0.1, 0.9), 3)
        else:
            value = random.randint(2, 999)
        want[flag] = str(value)
        argv += [flag, str(value)] if action.nargs is None else [flag, str(value)]
    args = parser.parse_args(argv)
    seen = {}

    def fake_run(cmd, env, stdout, stderr):
        seen["cmd"] = cmd
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    monkeypatch.setattr(e2e, "log_facts", lambda path: {})
    e2e.run_child(args, "plugin", 3, 0, {"runs": []})
    cmd = seen["cmd"]
    for flag, value in want.items():
        assert flag in cmd, flag
        i = cmd.index(flag)
        assert cmd[i + 1] == value, (flag, cmd[i + 1], value)
