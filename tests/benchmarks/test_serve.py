"""The serve benchmark's host side (no GPU, no server): its command lines as
vLLM's own parsers read them, the parsing of /metrics, client results and the
plugin's log lines, the identity comparison, the table and strict JSON."""

import contextlib
import importlib.util
import io
import json
import logging
import math
import os
import random
import re
import subprocess
import sys
import signal
import tarfile
import time
import types

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "serve.py")
_spec = importlib.util.spec_from_file_location("serve_bench", _PATH)
serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve)

from vllm_dsa_varlen import stats  # noqa: E402
from vllm_dsa_varlen.config import MODE_ENV  # noqa: E402

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _args(*extra):
    return serve.parse_args(["--out", "/tmp/unused", *extra])


# ----------------------------------------------------------------------------- commands

def test_each_mode_gets_its_value_of_the_mode_variable_and_a_multiprocess_engine():
    base = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PATH": "/bin", MODE_ENV: "off"}
    extra = {"DSA_VARLEN_TOPK": "own"}
    for mode, value in serve.MODE_VALUES.items():
        env = serve.server_env(mode, base, extra)
        assert env[MODE_ENV] == value and env["PATH"] == "/bin"
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # vLLM's default: its own process
        assert env["DSA_VARLEN_TOPK"] == "own"
    assert serve.server_env("plugin", base, {})[MODE_ENV] != serve.server_env("stock", base, {})[
        MODE_ENV]
    with pytest.raises(ValueError, match="mode"):
        serve.server_env("fast", base, {})


def test_a_variant_is_the_plugin_with_its_settings_over_env():
    from vllm_dsa_varlen import settings

    name, env = serve.parse_variant(f"noq:{settings.FUSED_Q_ENV}=off,{settings.TOPK_ENV}=vllm")
    assert (name, env) == ("noq", {settings.FUSED_Q_ENV: "off", settings.TOPK_ENV: "vllm"})
    got = serve.server_env("noq", {MODE_ENV: "stock"}, {settings.TOPK_ENV: "own"}, {name: env})
    assert got[MODE_ENV] == serve.MODE_VALUES["plugin"]
    assert got[settings.TOPK_ENV] == "vllm" and got[settings.FUSED_Q_ENV] == "off"
    args = _args("--variant", f"noq:{settings.FUSED_Q_ENV}=off", "--aa")
    assert args.modes == ["stock", "plugin", "noq", "control"]


@pytest.mark.parametrize("bad", ["noq", "noq:", "plugin:DSA_VARLEN_TOPK=vllm", "9x:DSA_VARLEN_TOPK=vllm",
                                 "x:DSA_VARLEN=stock", "x:DSA_VARLEN_TOPK=fast",
                                 "x:DSA_VARLEN_NOPE=1", "x:DSA_VARLEN_TOPK"])
def test_a_bad_variant_is_refused_naming_the_option(bad, capsys):
    with pytest.raises(SystemExit):
        _args("--variant", bad)
    assert "--variant" in capsys.readouterr().err


@pytest.fixture
def cpu_platform(monkeypatch):
    """vLLM's engine arguments read the device type: the CPU's platform here."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(platforms, "_current_platform", CpuPlatform())


def _serve_parser():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    except ImportError:  # where newer vLLMs keep it
        from vllm.entrypoints.common.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM")
@pytest.mark.parametrize("asynchronous", ["default", "on", "off"])
def test_vllm_serve_reads_the_server_command_as_meant(tmp_path, cpu_platform, asynchronous):
    from vllm.engine.arg_utils import AsyncEngineArgs

    k = random.randint(1, 4)
    args = _args("--k", str(k), "--concurrency", "3", "40", "--input-len", "5000",
                 "--range-ratio", "0.2", "--async-scheduling", asynchronous,
                 "--max-num-batched-tokens", "8192", "--serve-arg=--enforce-eager",
                 "--server-shutdown-timeout", str(drain := random.randint(1, 30)),
                 "--profile-steps", str(steps := random.randint(1, 60)))
    port = serve.free_port()
    cmd = serve.serve_command(args, str(tmp_path), port)
    assert cmd[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    ns = _serve_parser().parse_args(cmd[4:])
    assert (ns.model_tag, ns.host, ns.port) == (str(tmp_path), "127.0.0.1", port)
    engine = AsyncEngineArgs.from_cli_args(ns)
    assert engine.speculative_config == {"method": "mtp", "num_speculative_tokens": k,
                                         "attention_backend": "FLASHMLA_SPARSE"}
    assert engine.attention_config.sparse_mla_force_mqa is True
    assert engine.load_format == "dummy" and engine.max_num_seqs == 40
    assert engine.max_model_len >= int(5000 * 1.2) + int(128 * 1.2) + k
    assert engine.max_num_batched_tokens == 8192 and engine.enforce_eager
    assert engine.async_scheduling == {"default": None, "on": True, "off": False}[asynchronous]
    assert engine.shutdown_timeout == drain  # the engine core drains at the stop, not killed
    assert engine.profiler_config.max_iterations == steps
    assert engine.profiler_config.profiler == "torch"


def test_max_num_seqs_is_the_largest_concurrency_unless_given(tmp_path):
    points = random.sample(range(1, 200), 3)
    given = random.randint(1, 300)
    for extra, want in (([], max(points)), (["--max-num-seqs", str(given)], given)):
        cmd = serve.serve_command(_args("--concurrency", *map(str, points), "--identity", "0",
                                        "--identity-concurrency", "1", *extra),
                                  str(tmp_path), serve.free_port())
        assert cmd[cmd.index("--max-num-seqs") + 1] == str(want)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM")
def test_vllm_bench_serve_reads_every_point_as_meant(tmp_path):
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = _args("--rates", "2.5", "auto", "--rate-fractions", "0.5")
    points = serve.sweep_points(args)
    assert [p["id"] for p in points] == [
        f"L{n}-{x}" for n in (4096, 16384) for x in ("c1", "c8", "c32", "c64", "r0", "r1")]
    assert len({p["seed"] for p in points}) == len(points)  # fresh prompts per point
    serve.fill_rates(points, args)  # nothing measured yet: auto stays unset
    for p in points:
        if p["value"] is None:
            with pytest.raises(ValueError, match="point"):
                serve.bench_command(args, p, 1, "tok", str(tmp_path), "f.json", "stock")
            continue
        cmd = serve.bench_command(args, p, 8123, "/m", str(tmp_path), "f.json", "stock")
        ns = parser.parse_args(cmd[cmd.index("serve") + 1:])
        assert (ns.dataset_name, ns.random_input_len, ns.random_output_len) == (
            "random", p["input_len"], 128)
        assert (ns.seed, ns.num_prompts, ns.temperature) == (p["seed"], p["num_prompts"], 0.0)
        assert ns.ignore_eos and ns.save_result and ns.base_url == "http://127.0.0.1:8123"
        assert (ns.model, ns.tokenizer, ns.result_dir) == (serve.SERVED_NAME, "/m", str(tmp_path))
        assert ns.metric_percentiles == "50,90,99"
        if p["kind"] == "concurrency":
            assert ns.max_concurrency == p["value"] and ns.request_rate == math.inf
            assert p["num_prompts"] == max(16, 4 * p["value"])
        else:
            assert ns.max_concurrency is None and ns.request_rate == 2.5
            assert p["num_prompts"] == math.ceil(2.5 * 60)


def test_auto_rates_are_fractions_of_the_first_modes_throughput_at_the_top_concurrency():
    args = _args("--input-len", "100", "--concurrency", "4", "16", "--rate-fractions", "0.5", "0.8")
    points = serve.sweep_points(args)
    knee = random.uniform(1, 9)
    top = next(p for p in points if p["id"] == "L100-c16")
    top["runs"] = {"stock": {"client": {"request_throughput": knee}},
                   "plugin": {"client": {"request_throughput": 100.0}}}
    serve.fill_rates(points, args)
    rates = [p for p in points if p["kind"] == "rate"]
    assert [p["value"] for p in rates] == [round(knee * 0.5, 3), round(knee * 0.8, 3)]
    assert all(p["num_prompts"] == max(16, math.ceil(p["value"] * 60)) for p in rates)


def test_a_soak_alone_has_no_points_and_a_checkpoints_identity_prompts_leave_room():
    args = _args("--modes", "plugin", "--no-sweep", "--soak-minutes", "6")
    assert args.modes == ["plugin"] and serve.sweep_points(args) == []
    ours = serve.identity_longest(_args("--max-model-len", "5000", "--identity-tokens", "64"))
    theirs = serve.identity_longest(_args("--max-model-len", "5000", "--identity-tokens", "64",
                                          "--model", "/some/checkpoint"))
    assert ours == 5000 - 64 - 64 and theirs == ours // 4


def test_quick_is_small_and_what_is_given_wins():
    q = _args("--quick")
    assert q.input_len == [4096] and q.concurrency == [8, 32] and q.rates == []
    assert _args("--quick", "--concurrency", "4").concurrency == [4]
    assert _args("--aa").modes == ["stock", "plugin", "control"]


@pytest.mark.parametrize("bad,word", [(["--modes", "plugin", "stock"], "--modes"),
                                      (["--modes", "stock", "stock"], "--modes"),
                                      (["--rates", "fast"], "--rates"),
                                      (["--rates", "-1"], "--rates"),
                                      (["--rates", "auto", "auto", "auto"], "--rate-fractions"),
                                      (["--range-ratio", "1.5"], "--range-ratio"),
                                      (["--env", "NOEQUALS"], "--env"),
                                      (["--k", "0"], "--k"),
                                      (["--start-reserve", "-1"], "--start-reserve"),
                                      (["--min-share", "-1"], "--min-share"),
                                      (["--server-shutdown-timeout", "60"],
                                       "--server-shutdown-timeout"),
                                      (["--server-shutdown-timeout", "-1"],
                                       "--server-shutdown-timeout")])
def test_bad_arguments_are_refused_naming_them(bad, word, capsys):
    with pytest.raises(SystemExit):
        _args(*bad)
    assert word in capsys.readouterr().err


# ----------------------------------------------------------------------------- /metrics

@contextlib.contextmanager
def _prometheus():
    """Collectors registered in prometheus_client's default registry (where
    vLLM's live) inside the block, unregistered after it."""
    import prometheus_client as pc

    before = set(pc.REGISTRY._collector_to_names)
    try:
        yield pc
    finally:
        for c in set(pc.REGISTRY._collector_to_names) - before:
            pc.REGISTRY.unregister(c)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM")
def test_engine_counters_read_vllms_own_exposition():
    """vLLM's speculative-decoding metrics (its own class), the step histogram
    and request counters as vLLM names them, two engines: the counters read
    back are the sums of what was observed."""
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    rng = random.Random(3)
    k = rng.randint(2, 4)
    with _prometheus() as pc:
        labels = ["model_name", "engine"]
        per_engine = {0: ["m", "0"], 1: ["m", "1"]}
        spec = SpecDecodingProm(types.SimpleNamespace(num_speculative_tokens=k), labels,
                                per_engine)
        steps = pc.Histogram("vllm:iteration_tokens_total", "", labelnames=labels,
                             buckets=[1, 8, 64, 512])
        success = pc.Counter("vllm:request_success", "", labelnames=labels + ["finished_reason"])
        preempt = pc.Counter("vllm:num_preemptions", "", labelnames=labels)
        want = {"drafts": 0, "tokens": 0, "accepted": 0, "pos": [0] * k, "steps": 0, "ok": 0}

        def observe(n):
            for _ in range(n):
                engine = rng.randrange(2)
                s = SpecDecodingStats.new(k)
                for _ in range(rng.randint(1, 5)):
                    acc = rng.randint(0, k)
                    s.observe_draft(num_draft_tokens=k, num_accepted_tokens=acc)
                    want["drafts"] += 1
                    want["tokens"] += k
                    want["accepted"] += acc
                    for p in range(acc):
                        want["pos"][p] += 1
                spec.observe(s, engine)
                steps.labels("m", str(engine)).observe(rng.randint(1, 300))
                want["steps"] += 1
                reason = rng.choice(["length", "stop", "abort"])
                success.labels("m", str(engine), reason).inc()
                want["ok"] += 1
            preempt.labels("m", "0").inc(0)

        observe(rng.randint(5, 20))
        before = serve.engine_counters(serve.parse_prometheus(pc.generate_latest().decode()))
        snap = {k2: (list(v) if isinstance(v, list) else v) for k2, v in want.items()}
        observe(rng.randint(5, 20))
        after = serve.engine_counters(serve.parse_prometheus(pc.generate_latest().decode()))
    assert after["spec_drafts"] == want["drafts"] and after["spec_draft_tokens"] == want["tokens"]
    assert after["spec_accepted_tokens"] == want["accepted"]
    assert after["spec_accepted_per_pos"] == {str(p): float(n) for p, n in enumerate(want["pos"])}
    assert after["engine_steps"] == want["steps"] and after["requests_finished"] == want["ok"]
    assert after["preemptions"] == 0
    grew = serve.counters_growth(before, after)
    assert grew["spec_drafts"] == want["drafts"] - snap["drafts"]
    assert grew["engine_steps"] == want["steps"] - snap["steps"]
    assert grew["acceptance_rate"] == pytest.approx(
        (want["accepted"] - snap["accepted"]) / (want["tokens"] - snap["tokens"]))
    assert grew["acceptance_length"] == pytest.approx(
        1 + (want["accepted"] - snap["accepted"]) / (want["drafts"] - snap["drafts"]))
    assert after["generation_tokens"] is None  # not exposed here: unknown, not zero


def test_prometheus_parse_keeps_labels_and_skips_comments():
    text = ('# HELP x a\n# TYPE x counter\nx_total{a="1",b="q\\"r"} 3.0\nx_total{a="2"} 4\n'
            'y 1e3\nbad line\n')
    got = serve.parse_prometheus(text)
    assert got["x_total"] == [({"a": "1", "b": 'q\\"r'}, 3.0), ({"a": "2"}, 4.0)]
    assert got["y"] == [({}, 1000.0)] and len(got) == 2


# ----------------------------------------------------------------------------- client results

def _client_result(rng, n):
    """A result as `vllm bench serve --save-detailed` writes it (vLLM's keys)."""
    errors = [rng.choice(["", "", "", "ClientPayloadError: closed"]) for _ in range(n)]
    out = {"date": "20261206-040000", "backend": "vllm", "label": "stock", "model_id": "m",
           "num_prompts": n, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 8,
           "duration": rng.uniform(5, 50), "completed": n - sum(bool(e) for e in errors),
           "failed": sum(bool(e) for e in errors), "output_throughput": rng.uniform(100, 9000),
           "request_throughput": rng.uniform(1, 9), "input_lens": [4096] * n,
           "output_lens": [rng.randint(100, 128) for _ in range(n)],
           "ttfts": [rng.random() for _ in range(n)],
           "itls": [[rng.random() for _ in range(5)] for _ in range(n)],
           "latencies": [rng.random() for _ in range(n)], "start_times": list(range(n)),
           "queue_times": [0.0] * n, "generated_texts": ["a b"] * n, "errors": errors,
           "spec_decode_acceptance_length": 1.2, "spec_decode_per_position_acceptance_rates":
           [0.1, 0.05, 0.0]}
    for m in serve.METRICS:
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            out[f"{stat}_{m}_ms"] = rng.uniform(1, 100)
    return out


def test_a_client_result_is_kept_without_per_request_arrays():
    rng = random.Random(4)
    raw = _client_result(rng, 40)
    small = serve.shrink_client(raw)
    assert not any(isinstance(v, list) for k, v in small.items()
                   if k not in ("error_examples", "output_len_min_max"))
    assert small["error_count"] == raw["failed"]
    assert small["error_examples"] == sorted({e for e in raw["errors"] if e})
    assert small["output_len_min_max"] == [min(raw["output_lens"]), max(raw["output_lens"])]
    assert small["p99_itl_ms"] == raw["p99_itl_ms"] and small["failed"] == raw["failed"]
    assert len(json.dumps(small)) < len(json.dumps(raw)) / 3


# ----------------------------------------------------------------------------- the plugin's lines

class _VllmFormat(logging.Formatter):
    """vLLM's log line: the process tag, level, time, file, message."""

    def format(self, record):
        return (f"(EngineCore_DP0 pid={record.process}) {record.levelname} 12-06 04:00:00 "
                f"[stats.py:{record.lineno}] {record.getMessage()}")


@pytest.fixture
def engine_log(monkeypatch):
    """The plugin's counters in a fresh state, their lines captured as vLLM's
    engine core prints them; a fake wall clock."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_VllmFormat())
    log = logging.getLogger("vllm.dsa_varlen")
    old = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    stats.reset()
    for name, value in (("_version", 0), ("_logged_version", 0), ("_logged_at", -math.inf),
                        ("_last_step_at", None), ("_exit_pid", os.getpid()),
                        ("_final_written_pid", None)):
        monkeypatch.setattr(stats, name, value)
    clock = types.SimpleNamespace(t=1.8e9)
    monkeypatch.setattr(stats, "_clock", lambda: clock.t)
    yield clock, stream
    log.removeHandler(handler)
    log.setLevel(old)
    stats.reset()


def _burst(rng, clock, n):
    got = {k: dict.fromkeys(stats.PATHS, 0) for k in ("steps", "variable", "mixed")}
    for _ in range(n):
        clock.t += rng.uniform(0.005, 0.05)
        path = rng.choice(stats.PATHS)
        variable, mixed = rng.random() < 0.5, rng.random() < 0.2
        stats.record(path, variable=variable, mixed=mixed)
        got["steps"][path] += 1
        got["variable"][path] += variable
        got["mixed"][path] += mixed
    return got


@pytest.mark.parametrize("seed", range(3))
def test_per_point_counts_from_the_log_are_each_points_own(engine_log, seed):
    """Points (bursts of steps) separated by idle spells longer than the log
    interval: each point's counts read from the log lines equal the steps
    recorded in it, and are marked exact; the final line closes the last."""
    clock, stream = engine_log
    rng = random.Random(seed)
    windows, truth = [], []
    _burst(rng, clock, 30)  # the warm-up
    for _ in range(rng.randint(2, 5)):
        clock.t += stats.LOG_EVERY_S + rng.uniform(0.5, 3)  # the harness's gap
        t0 = clock.t
        truth.append(_burst(rng, clock, rng.randint(1, 400)))
        clock.t += rng.uniform(0.01, 0.5)  # the client's exit
        windows.append((t0, clock.t))
    stats._write_final_line()
    lines = serve.path_lines(stream.getvalue())
    assert lines and all(x["process"] == "EngineCore_DP0" for x in lines)
    for (t0, t1), want in zip(windows, truth):
        got = serve.path_growth(lines, t0, t1)
        assert got["exact"] and got["processes"] == 1
        assert {k: got[k] for k in want} == want


def test_a_point_without_an_idle_spell_before_it_is_not_called_exact(engine_log):
    clock, stream = engine_log
    rng = random.Random(8)
    _burst(rng, clock, 50)
    clock.t += stats.LOG_EVERY_S + 1
    _burst(rng, clock, 50)
    clock.t += 0.5  # too short a gap
    t0 = clock.t
    _burst(rng, clock, 50)
    t1 = clock.t
    clock.t += stats.LOG_EVERY_S + 1
    _burst(rng, clock, 5)
    got = serve.path_growth(serve.path_lines(stream.getvalue()), t0, t1)
    assert got["exact"] is False


def test_no_lines_no_counts():
    assert serve.path_growth([], 0.0, 1.0) is None


def test_log_health_counts_error_and_traceback_lines_per_process_before_and_after_the_stop():
    rng = random.Random(2)
    serving, shutdown = [], []
    want = {"serving": {}, "shutdown": {}}
    for part, lines in (("serving", serving), ("shutdown", shutdown)):
        for _ in range(200):
            proc = rng.choice(["APIServer", "EngineCore_DP0"])
            kind = rng.choice(["INFO", "WARNING", "ERROR", "DEBUG", "trace"])
            if kind == "trace":
                lines.append("Traceback (most recent call last):")
                want[part].setdefault("main", {"error": 0, "traceback": 0})["traceback"] += 1
                continue
            lines.append(f"({proc} pid=12) {kind} 12-06 04:00:00 [x.py:1] message "
                         f"{rng.random()} with the word error in it")
            if kind == "ERROR":
                want[part].setdefault(proc, {"error": 0, "traceback": 0})["error"] += 1
    text = "\n".join(serving) + "\n"
    got = serve.log_health(text + "\n".join(shutdown), stop_at=len(text))
    for part in ("serving", "shutdown"):
        assert got[part]["by_process"] == want[part]
        assert got[part]["lines"] == sum(v["error"] + v["traceback"]
                                         for v in want[part].values())


def test_the_plugin_path_lines_keep_their_process_and_leave_out_the_counts():
    text = ("(APIServer pid=1) INFO 12-06 [__init__.py:9] vllm-dsa-varlen: patched\n"
            "(EngineCore_DP0 pid=2) INFO 12-06 [config.py:9] vllm-dsa-varlen: DSA indexer "
            "decode path: varlen (triton): sm_90\n"
            "(EngineCore_DP0 pid=2) INFO 12-06 [config.py:9] vllm-dsa-varlen: DSA indexer "
            "decode path: varlen (triton): sm_90\n"
            f"(EngineCore_DP0 pid=2) INFO [stats.py:1] {stats.LINE}{{\"steps\": {{}}}}\n")
    assert serve.plugin_path_log(text) == [
        "[APIServer] vllm-dsa-varlen: patched",
        "[EngineCore_DP0] vllm-dsa-varlen: DSA indexer decode path: varlen (triton): sm_90"]


# ----------------------------------------------------------------------------- identity

def test_identity_requests_are_fixed_mixed_and_grouped():
    a = serve.identity_prompts(40, 4096, 3000, 5)
    assert a == serve.identity_prompts(40, 4096, 3000, 5)
    assert a != serve.identity_prompts(40, 4096, 3000, 6)
    lengths = {len(p.split()) for p in a}
    assert max(lengths) == 3000 and min(lengths) == 16 and len(lengths) >= 4
    for n, c in ((32, 8), (7, 3), (1, 4)):
        groups = serve.identity_groups(n, c)
        assert sorted(i for g in groups for i in g) == list(range(n))
        assert all(len(g) == 1 for g in groups[:n // 4])
        assert all(len(g) <= c for g in groups) and any(len(g) > 1 for g in groups) == (n > 1)


def _records(rng, n):
    out = []
    for _ in range(n):
        toks = [serve.serve_model.word(rng.randrange(3, 999)) for _ in range(rng.randint(3, 30))]
        tops = [{t: -0.1, "zz": -2.0} for t in toks]
        out.append({"text": " " + " ".join(toks), "tokens": [" " + t for t in toks],
                    "top_logprobs": [{" " + k: v for k, v in d.items()} for d in tops],
                    "finish_reason": "length"})
    return out


def test_logprob_gap_finds_the_first_moved_token_and_the_largest_move():
    rng = random.Random()
    for _ in range(50):
        a = _records(rng, 1)[0]
        for top in a["top_logprobs"]:  # dyadic values: each step below moves one exactly
            for tok in top:
                top[tok] = -rng.randint(1, 64) / 8
        b = json.loads(json.dumps(a))
        assert serve.logprob_gap(a, b) is None
        n = len(a["top_logprobs"])
        moved = sorted(rng.sample(range(n), rng.randint(1, n)))
        steps = {}
        for t in moved:
            tok = rng.choice(sorted(b["top_logprobs"][t]))
            steps[t] = rng.choice([-1, 1]) * 2.0 ** -rng.randint(1, 20)
            b["top_logprobs"][t][tok] += steps[t]
        want = {"token": moved[0], "most": max(abs(x) for x in steps.values())}
        assert serve.logprob_gap(a, b) == want
        b["top_logprobs"].append({" extra": -1.0})  # one more token: apart there, no shared value
        assert serve.logprob_gap(a, b) == want
        assert serve.logprob_gap(a, {**a, "top_logprobs": a["top_logprobs"][:-1]}) == {
            "token": n - 1, "most": 0.0}


def test_identity_comparison_finds_a_changed_text_and_where():
    rng = random.Random(6)
    ref = _records(rng, 32)
    same = json.loads(json.dumps(ref))
    assert serve.compare_identity(ref, same)["all_identical"]
    changed = json.loads(json.dumps(ref))
    i = rng.randrange(32)
    pos = rng.randrange(len(changed[i]["tokens"]))
    changed[i]["tokens"][pos] = " qqq"
    changed[i]["text"] = "".join(changed[i]["tokens"])
    changed[(i + 1) % 32] = {"error": "HTTPError: 500"}
    j = (i + 2) % 32  # a rounding step off in one logprob only: the text holds
    k = rng.randrange(len(changed[j]["top_logprobs"]))
    changed[j]["top_logprobs"][k] = {t: v - 2 ** -10 for t, v in changed[j]["top_logprobs"][k].items()}
    got = serve.compare_identity(ref, changed)
    assert not got["all_identical"] and got["identical"] == 30 and got["failed"] == 1
    assert got["logprobs_equal"] == 30  # the failed and the rounded one left out
    assert got["logprobs_apart"] == [{"request": j, "token": k, "most": 2 ** -10}]
    assert got["diverged"] == [{"request": i, "position": pos,
                                "ref_top2": sorted(ref[i]["top_logprobs"][pos].items(),
                                                   key=lambda kv: -kv[1]),
                                "other_top2": sorted(changed[i]["top_logprobs"][pos].items(),
                                                     key=lambda kv: -kv[1]),
                                "at_ref_tie": False}]
    tied = json.loads(json.dumps(ref))  # the reference's two best equal where the texts part
    tied[i]["top_logprobs"][pos] = {ref[i]["tokens"][pos]: -1.5, " qqq": -1.5}
    assert serve.compare_identity(tied, changed)["diverged"][0]["at_ref_tie"]
    with pytest.raises(ValueError, match="other"):
        serve.compare_identity(ref, ref[:3])


def test_a_completion_response_is_read_as_vllm_writes_it():
    resp = {"id": "cmpl-1", "object": "text_completion", "model": serve.SERVED_NAME,
            "choices": [{"index": 0, "text": " ab cd", "finish_reason": "length",
                         "logprobs": {"tokens": [" ab", " cd"], "token_logprobs": [-0.1, -0.2],
                                      "top_logprobs": [{" ab": -0.1}, {" cd": -0.2}],
                                      "text_offset": [0, 3]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    rec = serve.completion_record(resp)
    assert rec == {"text": " ab cd", "tokens": [" ab", " cd"],
                   "top_logprobs": [{" ab": -0.1}, {" cd": -0.2}], "finish_reason": "length"}


# ----------------------------------------------------------------------------- table, JSON

def test_the_table_compares_every_mode_with_stock_at_every_point(tmp_path):
    rng = random.Random(12)
    points = []
    for pid in ("L4096-c8", "L4096-c32"):
        runs = {}
        for mode in ("stock", "plugin", "control"):
            c = _client_result(rng, 4)
            runs[mode] = {"client": serve.shrink_client(c),
                          "engine": {"acceptance_length": rng.uniform(1, 2)},
                          "paths": None if mode != "plugin" else {
                              "steps": {p: rng.randrange(50) for p in stats.PATHS},
                              "variable": {p: rng.randrange(20) for p in stats.PATHS}}}
        points.append({"id": pid, "runs": runs})
    points.append({"id": "L4096-r0", "runs": {"stock": {"skipped": "time limit"}}})
    rows = serve.table_rows({"points": points})
    assert len(rows) == 7
    for r in rows:
        if r["mode"] == "stock" or r.get("skipped"):
            assert "x_tpot" not in r
            continue
        base = next(p for p in points if p["id"] == r["point"])["runs"]["stock"]["client"]
        mine = next(p for p in points if p["id"] == r["point"])["runs"][r["mode"]]["client"]
        assert r["x_tpot"] == pytest.approx(base["mean_tpot_ms"] / mine["mean_tpot_ms"])
        assert r["x_itl_p99"] == pytest.approx(base["p99_itl_ms"] / mine["p99_itl_ms"])
        assert r["x_tok_s"] == pytest.approx(mine["output_throughput"] / base["output_throughput"])
        assert r["tpot_p50"] == mine["median_tpot_ms"] and r["ttft_p99"] == mine["p99_ttft_ms"]
    plugin = [r for r in rows if r["mode"] == "plugin"]
    for r in plugin:  # the project's kernel: varlen steps and the splits it avoided
        paths = next(p for p in points if p["id"] == r["point"])["runs"]["plugin"]["paths"]
        steps, var = paths["steps"], paths["variable"]
        assert r["own_steps"] == steps["varlen"] + steps["split_avoided"]
        assert r["variable_own"] == var["varlen"] + var["split_avoided"]
        assert r["variable_steps"] == sum(var.values())
    text = serve.render_table(rows)
    for r in plugin:
        assert f"| {r['own_steps']} ({r['variable_own']} / {r['variable_steps']}) |" in text
    assert len(text.splitlines()) == 2 + len(rows) and "skipped: time limit" in text
    path = tmp_path / "out.json"
    serve.write_json(str(path), {"rows": rows, "nan": float("nan"), "inf": [math.inf]})

    def refuse(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    back = json.loads(path.read_text(), parse_constant=refuse)
    assert back["nan"] is None and back["inf"] == [None] and len(back["rows"]) == 7


def test_memory_flatness_ignores_the_warm_up():
    t = [(float(i), 1000.0 + (500 if i < 3 else 0) + (i % 2)) for i in range(20)]
    got = serve.memory_flatness(t, 0.2, 4)
    assert got["flat"] and got["range_mib"] == 1
    t[-1] = (19.0, 1300.0)
    assert not serve.memory_flatness(t, 0.2, 4)["flat"]
    assert serve.memory_flatness([(0.0, None)], 0.2, 4)["flat"] is None


def test_structured_completions_are_held_to_the_regex(monkeypatch):
    """A text with a word outside the regex, a failed request and an empty
    text are each counted; a text kept to it is not."""
    rng = random.Random()
    inside = [serve.serve_model.word(rng.randrange(0, 13)) for _ in range(rng.randint(1, 9))]
    outside = inside + ["z" + serve.serve_model.word(rng.randrange(0, 500))]
    rng.shuffle(outside)
    replies = iter([" ".join(inside), " ".join(outside), ""])

    def post(port, path, body, timeout):
        assert body["structured_outputs"] == {"regex": serve.STRUCTURED_REGEX}
        text = next(replies, None)
        if text is None:
            raise OSError("connection refused")
        return {"choices": [{"text": text, "finish_reason": "length"}]}
    monkeypatch.setattr(serve, "_post", post)
    recs = [serve.structured_completion(1, "a b", 8, 1) for _ in range(4)]
    assert [r.get("kept_to_regex") for r in recs] == [True, False, False, None]
    got = serve.structured_summary(recs)
    assert (got["sent"], got["failed"], got["broke_regex"]) == (4, 1, 2)
    assert got["words"] == 2 * len(inside) + 1 and "connection refused" in got["errors"][0]


def test_soak_consistency_holds_the_builds_to_k_plus_one_a_step():
    """k + 1 builds an engine step, within the tolerance either way: a few
    steps vLLM does not count pass; a lost counter or a doubled build does not."""
    rng = random.Random()
    k = rng.randint(1, 4)
    steps = rng.randint(2000, 8000)
    builds = (k + 1) * steps + rng.randint(-steps // 200, steps // 200)

    def soak(n):
        return {"paths": {"steps": {"varlen": n // 2, "stock_native": n - n // 2}, "exact": True},
                "engine": {"engine_steps": steps}}
    got = serve.soak_consistency(soak(builds), k)
    assert got["within_bounds"] and got["builds_per_step"] == builds / steps
    assert got["expected_per_step"] == k + 1
    assert serve.soak_consistency(soak(builds - steps), k)["within_bounds"] is False  # one lost
    assert serve.soak_consistency(soak(2 * builds), k)["within_bounds"] is False
    assert serve.soak_consistency({"paths": None, "engine": {}}, k)["within_bounds"] is None


def test_the_module_names_no_vllm_import_at_its_top():
    """The harness runs beside a server it does not import: vLLM stays out of
    its own process (the client and server are subprocesses)."""
    src = open(_PATH).read()
    assert "\nimport vllm" not in src and "\nfrom vllm " not in src and "\nfrom vllm." not in src


# ----------------------------------------------------------------------------- a whole run

@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A stand-in vLLM command line (``fake_vllm_cli.py``) first on the
    subprocesses' path, this checkout's plugin package after it."""
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    here = os.path.dirname(os.path.abspath(__file__))
    (pkg / "main.py").write_text(open(os.path.join(here, "fake_vllm_cli.py")).read())
    root = os.path.dirname(os.path.dirname(here))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), root]))
    monkeypatch.setenv("FAKE_LOG_EVERY_S", "0.3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return tmp_path


_SMALL = ["--config", "tiny", "--layers", "2", "--input-len", "40", "--output-len", "8",
          "--concurrency", "2", "4", "--waves", "1", "--min-prompts", "4", "--warmup-prompts",
          "2", "--gap", "0.6", "--identity", "8", "--identity-tokens", "6",
          "--identity-concurrency", "3", "--stop-timeout", "20", "--python", sys.executable]


def _strict(path):
    def refuse(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    with open(path) as f:
        return json.load(f, parse_constant=refuse)


def test_a_whole_run_against_a_stand_in_server(fake_vllm, capsys):
    """Every mode's server started, measured and stopped by SIGTERM; each
    point's client result, /metrics growth and (plugin) path counts equal to
    what the stand-in did in that point alone; auto rates shared; identity
    texts compared; the soak's streams closed mid-way; strict JSON, a table."""
    out = fake_vllm / "out"
    rc = serve.main(["--out", str(out), *_SMALL, "--aa", "--rates", "auto",
                     "--rate-fractions", "0.5", "--rate-seconds", "3", "--soak-minutes", "0.05",
                     "--soak-rate", "20", "--soak-input-len", "30", "--soak-output-len", "6",
                     "--soak-disconnects", "2", "--soak-sample-s", "0.5",
                     "--soak-structured", "1"])
    assert rc == 0
    got = _strict(out / "serve.json")
    assert list(got["servers"]) == ["stock", "plugin", "control"]
    steps = 2  # fake_vllm_cli.STEPS_PER_REQUEST
    for mode, info in got["servers"].items():
        assert info["stop"]["how"] == "SIGTERM" and info["stop"]["rc"] == 0, info["stop"]
        assert "cores_aborted" not in info["stop"]  # a core that heard the signal is left be
        assert info["health"]["serving"]["lines"] == 0
        assert info["env"][MODE_ENV] == serve.MODE_VALUES[mode]
        assert info["vllm_version"] == "0.0.fake"
        assert (info["path_lines"] > 0) is (mode == "plugin")
        assert info["final_path_line"] is (mode == "plugin")
    assert got["servers"]["plugin"]["plugin_log"] == [
        "[EngineCore_DP0] vllm-dsa-varlen: DSA indexer decode path: varlen (fake)"]
    ids = [p["id"] for p in got["points"]]
    assert ids == ["L40-c2", "L40-c4", "L40-r0"]
    rate = got["points"][2]
    c4 = got["points"][1]["runs"]["stock"]["client"]["request_throughput"]
    assert rate["value"] == round(0.5 * c4, 3)
    for p in got["points"]:
        for mode, run in p["runs"].items():
            c = run["client"]
            assert c["completed"] == p["num_prompts"] and c["failed"] == 0
            assert not any(isinstance(v, list) for k, v in c.items()
                           if k not in ("error_examples", "output_len_min_max"))
            eng = run["engine"]
            assert eng["requests_finished"] == p["num_prompts"]
            assert eng["engine_steps"] == steps * p["num_prompts"]
            assert eng["acceptance_length"] == pytest.approx(1 + 1 / steps)
            if mode == "plugin":
                assert run["paths"]["exact"] and run["paths"]["process"] == "EngineCore_DP0"
                assert run["paths"]["steps"]["varlen"] == steps * p["num_prompts"]
                assert run["paths"]["variable"]["varlen"] == p["num_prompts"]
            else:
                assert run["paths"] is None
    assert not os.path.exists(out / "raw" / "client-stock-L40-c2.json")  # shrunk, then removed
    assert _strict(out / "client-plugin-L40-c4.json")["completed"] == 4
    for mode in ("plugin", "control"):
        cmp = got["identity_vs_stock"][mode]
        assert cmp["all_identical"] and cmp["requests"] == 8
    soak = got["servers"]["plugin"]["soak"]
    assert soak["client"]["failed"] == 0 and soak["client"]["completed"] == soak["point"][
        "num_prompts"]
    assert [d["chunks_read"] for d in soak["disconnects"]] == [3, 3]
    st = soak["structured"]
    assert st["sent"] > 0 and st["failed"] == 0 and st["broke_regex"] == 0 and st["words"] > 0
    assert soak["consistency"]["within_bounds"] and soak["consistency"]["exact"], (soak["consistency"], st)
    assert soak["gpu_memory"]["samples"] >= 0
    rows = got["table"]
    assert len(rows) == 3 * 3 and all(r["failed"] == 0 for r in rows)
    table = capsys.readouterr().out
    assert "| L40-c4 | plugin |" in table and "identity plugin vs stock: 8/8 identical" in table
    assert re.search(r"\[plugin\] soak: .* variable steps \(async scheduling: default\)", table)


def test_structured_clients_run_beside_each_points_client(fake_vllm, capsys, monkeypatch):
    """--structured N: in every measured point (each mode's), N clients send
    regex-constrained completions while vLLM's client runs and stop with it;
    the run records what they sent, none failed or broke the regex, and the
    printed line says so; without the option a run has no such record."""
    monkeypatch.setenv("FAKE_TOKEN_S", "0.01")  # the client's run: about a second
    out = fake_vllm / "structured"
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "0",
                       "--concurrency", "4", "--output-len", "24", "--min-prompts", "16",
                       "--structured", "2"]) == 0
    got = _strict(out / "serve.json")
    for mode in ("stock", "plugin"):
        run = got["points"][0]["runs"][mode]
        st = run["structured"]
        assert st["clients"] == 2 and st["sent"] >= 2, st
        assert st["failed"] == 0 and st["broke_regex"] == 0 and st["words"] > 0, st
    printed = capsys.readouterr().out
    assert re.search(r"\[plugin\] L40-c4: .*; structured \d+ sent, 0 failed, 0 broke the regex",
                     printed), printed
    plain = fake_vllm / "plain"
    assert serve.main(["--out", str(plain), *_SMALL, "--rates", "--identity", "0",
                       "--concurrency", "2", "--modes", "plugin"]) == 0
    assert "structured" not in _strict(plain / "serve.json")["points"][0]["runs"]["plugin"]


def test_a_server_that_fails_and_a_time_limit_leave_a_result(fake_vllm, monkeypatch):
    """A server that exits before it is ready is recorded as such and the run
    goes on; points that would pass a server's share of the time limit are
    skipped (the measured ones first), every server stopped, the run within
    its limit."""
    monkeypatch.setenv("FAKE_FAIL_MODE", "auto")
    out = fake_vllm / "out"
    limit = 16
    t0 = time.time()
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "0",
                       "--concurrency", *map(str, range(1, 13)), "--stop-timeout", "4",
                       "--time-limit", str(limit), "--start-reserve", "1"]) == 0
    assert time.time() - t0 < limit + 4
    got = _strict(out / "serve.json")
    assert "exited with 1" in got["servers"]["plugin"]["failed"]
    assert got["servers"]["plugin"]["health"]["serving"]["by_process"] == {
        "APIServer": {"error": 1, "traceback": 0}}
    measured = ["client" in p["runs"]["stock"] for p in got["points"]]
    assert 0 < sum(measured) < len(measured) and measured == sorted(measured, reverse=True)
    assert all(p["runs"]["stock"].get("skipped") == "time limit"
               for p, m in zip(got["points"], measured) if not m)
    assert got["servers"]["stock"]["stop"]["how"] == "SIGTERM"


def test_a_slow_first_start_keeps_its_measurements(fake_vllm, monkeypatch):
    """The first server's (cold) start may take more than an equal share of
    the time limit: it waits past that share, into what the later server's
    start reserve leaves, and both servers still measure their identity pass
    and first point; the run stays within its limit."""
    monkeypatch.setenv("FAKE_START_S", "stock=10")
    out = fake_vllm / "out"
    limit = 26
    t0 = time.time()
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "4",
                       "--concurrency", "2", "--stop-timeout", "4", "--gap", "0.3",
                       "--time-limit", str(limit), "--start-reserve", "3"]) == 0
    assert time.time() - t0 < limit + 4
    got = _strict(out / "serve.json")
    stock, plugin = got["servers"]["stock"], got["servers"]["plugin"]
    assert "failed" not in stock and stock["startup_s"] >= 10
    for info in (stock, plugin):
        assert info["identity"]["requests"] == 4 and info["identity"]["failed"] == 0
    assert all("client" in got["points"][0]["runs"][m] for m in ("stock", "plugin"))
    assert got["identity_vs_stock"]["plugin"]["all_identical"]


def _installed_stand_in(tmp_path):
    """An unpacked offline tree whose site folder holds the stand-in vLLM."""
    here = os.path.dirname(os.path.abspath(__file__))
    target = tmp_path / "offline"
    pkg = target / "site" / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "main.py").write_text(open(os.path.join(here, "fake_vllm_cli.py")).read())
    (target / "site" / ".complete").write_text("")
    (target / "parts").mkdir()
    (target / "parts" / "MANIFEST").write_text("")
    return target


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_device_script_runs_a_preset_from_an_installed_tree(tmp_path):
    """benchmarks/serve_device.sh on an unpacked tree (the stand-in vLLM in
    its site folder): the plugin's entry point declared, the run inside the
    time limit; under $OUT/serve a few files (a device call brings back a
    handful): the results, the table, the output, and the logs packed
    without the model."""
    target, root = _installed_stand_in(tmp_path), _ROOT
    out = tmp_path / "out"
    stale = tmp_path / "work" / "serve" / "client-stock-old.json"  # an earlier call's
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    env = dict(os.environ, OFFLINE_GPU=str(target), OUT=str(out), WORK=str(tmp_path / "work"),
               TIME_LIMIT="120",
               STOP_MARGIN="5", FAKE_LOG_EVERY_S="0.3", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", "benchmarks/serve_device.sh", "-", *_SMALL[:-2], "--rates",
                           "--identity", "4"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=200)
    assert done.returncode == 0, done.stderr
    assert "serve.py rc=0" in done.stdout and "| L40-c4 | plugin |" in done.stdout
    got = _strict(out / "serve" / "serve.json")
    assert got["args"]["time_limit"] <= 120 - 5
    assert got["servers"]["stock"]["dropped_env"] == []  # the script unset it already
    assert got["points"][1]["runs"]["plugin"]["paths"]["steps"]["varlen"] == 2 * 4
    assert (out / "serve" / "table.txt").read_text().startswith("| point |")
    back = sorted(p.name for p in (out / "serve").iterdir())
    assert back == ["logs.tar.xz", "serve-stdout.txt", "serve.json", "table.txt"], back
    with tarfile.open(out / "serve" / "logs.tar.xz") as tar:
        packed = {os.path.normpath(n) for n in tar.getnames()}
    assert {"server-stock.log", "server-plugin.log", "gpu-before.txt"} <= packed, packed
    assert not any(n.startswith("model-") for n in packed), packed
    assert stale.name not in packed and (tmp_path / "work" / "serve" / "model-tiny").is_dir()
    entry = (target / "site" / "vllm_dsa_varlen-0.0.0.dist-info" / "entry_points.txt").read_text()
    assert "vllm.general_plugins" in entry


def test_the_device_script_detaches_a_run_longer_than_a_call_and_attaches_to_it(tmp_path):
    """RUN_S beyond TIME_LIMIT: serve.py runs in a session of its own (what
    the device keeps past a call's end while the machine is warm), the call
    returns at its limit saying so, and an --attach call waits for the run
    and brings back the same few files, serve.py's whole time given."""
    target = _installed_stand_in(tmp_path)
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, OFFLINE_GPU=str(target), OUT=str(out), WORK=str(work),
               TIME_LIMIT="12", RUN_S="150", STOP_MARGIN="5", FAKE_LOG_EVERY_S="0.3",
               FAKE_START_S="stock=8")
    env.pop("PYTHONPATH", None)
    first = subprocess.run(["bash", "benchmarks/serve_device.sh", "-", *_SMALL[:-2], "--rates",
                            "--identity", "4"], cwd=_ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert "detached: serve.py still running" in first.stdout, first.stdout
    pid = int((work / "serve" / "pid").read_text())
    assert os.getsid(pid) == pid != os.getsid(0)  # its own session
    assert not (out / "serve" / "serve.json").exists()
    env["TIME_LIMIT"] = "200"
    second = subprocess.run(["bash", "benchmarks/serve_device.sh", "--attach"], cwd=_ROOT, env=env,
                            capture_output=True, text=True, timeout=260)
    assert second.returncode == 0, second.stderr
    assert "serve.py rc=0" in second.stdout and "| L40-c4 | plugin |" in second.stdout
    got = _strict(out / "serve" / "serve.json")
    assert 150 - 5 - 12 <= got["args"]["time_limit"] <= 150 - 5
    back = sorted(p.name for p in (out / "serve").iterdir())
    assert back == ["logs.tar.xz", "serve-stdout.txt", "serve.json", "table.txt"], back


def test_a_short_budget_drops_the_aa_control_before_the_comparison(fake_vllm):
    """Where the time left cannot give three servers ``--min-share`` each,
    stock and the plugin share it without the control, which is then not
    started (said why); both of them measure their identity pass and point.
    The same call with time for all three runs the control too."""
    args = [*_SMALL, "--rates", "--identity", "4", "--concurrency", "2", "--stop-timeout", "4",
            "--gap", "0.3", "--aa", "--start-reserve", "3"]
    out = fake_vllm / "short"
    assert serve.main(["--out", str(out), *args, "--time-limit", "30", "--min-share", "20"]) == 0
    got = _strict(out / "serve.json")
    assert "time limit" in got["servers"]["control"]["skipped"]
    assert got["points"][0]["runs"]["control"] == {"skipped": "time limit"}
    for mode in ("stock", "plugin"):
        assert got["servers"][mode]["identity"]["requests"] == 4
        assert "client" in got["points"][0]["runs"][mode]
    out = fake_vllm / "long"
    assert serve.main(["--out", str(out), *args, "--time-limit", "90", "--min-share", "12"]) == 0
    got = _strict(out / "serve.json")
    assert all("client" in got["points"][0]["runs"][m] for m in ("stock", "plugin", "control"))


def test_budget_shares_without_the_optional_server_only_when_short():
    b = serve.Budget(100.0, start_reserve=10.0)
    b.end = time.time() + 100.0  # 100 s left, 3 servers, 2 s stop reserve each
    three = b.share(3, 2.0) - time.time()
    assert three == pytest.approx((100 - 6 - 20) / 3, abs=0.5)
    assert b.share(3, 2.0, optional=1, least=20.0) - time.time() == pytest.approx(three, abs=0.5)
    two = b.share(3, 2.0, optional=1, least=30.0) - time.time()
    assert two == pytest.approx((100 - 4 - 10) / 2, abs=0.5)
    assert b.fits(2.0, 80.0) and not b.fits(2.0, 90.0)


def test_an_engine_core_deaf_to_sigterm_leaves_its_stacks(fake_vllm, monkeypatch):
    """A plugin server whose engine core never logs the stop signal: 2 s
    before vLLM's drain would end, SIGABRT makes its fault handler write
    every thread's stack into the log (where the main thread was), and the
    stop names the pid; stock's server, which stops, is left alone."""
    monkeypatch.setenv("FAKE_DEAF_MODE", "auto")
    out = fake_vllm / "deaf"
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "0",
                       "--concurrency", "2", "--server-shutdown-timeout", "3"]) == 0
    got = _strict(out / "serve.json")
    stop = got["servers"]["plugin"]["stop"]
    assert stop["how"] == "SIGTERM" and stop["rc"] == -signal.SIGABRT, stop
    assert len(stop["cores_aborted"]) == 1 and 1.0 <= stop["seconds"] < 5, stop  # drain - 2
    text = (out / "server-plugin.log").read_text()
    assert "Fatal Python error: Aborted" in text and "serve_forever" in text
    assert f"pid={stop['cores_aborted'][0]})" in text
    assert "cores_aborted" not in got["servers"]["stock"]["stop"]
    # how each core stood towards SIGTERM: the deaf one ignores it, stock's handles it
    pid = str(stop["cores_aborted"][0])
    assert stop["cores_at_abort"][pid]["ignored"] and not stop["cores_at_abort"][pid]["handled"]
    assert stop["cores_before_stop"][pid]["ignored"]
    (before,) = got["servers"]["stock"]["stop"]["cores_before_stop"].values()
    assert before["handled"] and not before["main_blocks"] and not before["pending_process"]


def test_the_diagnostics_stacks_profile_and_sync_sites(fake_vllm, monkeypatch, tmp_path,
                                                        capsys):
    """--py-spy: each engine core's stacks over every measured point;
    --profile-steps: a profiled window after the points, summarised per step
    (its trace removed); VLLM_GPU_SYNC_CHECK's warnings read as sync sites."""
    here = os.path.dirname(os.path.abspath(__file__))
    exe = tmp_path / "py-spy"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {os.path.join(here, 'fake_py_spy.py')} "
                   '"$@"\n')
    exe.chmod(0o755)
    site = f"vllm_dsa_varlen/plan.py:{random.randint(1, 300)}"
    monkeypatch.setenv("FAKE_SYNC_WARN", "/venv/lib/python3.12/site-packages/" + site)
    out = fake_vllm / "diag"
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "0",
                       "--concurrency", "2", "--py-spy", str(exe),
                       "--profile-steps", "50", "--profile-delay", "0"]) == 0
    got = _strict(out / "serve.json")
    (point,) = got["points"]
    for mode in ("stock", "plugin"):
        info = got["servers"][mode]
        cmd = info["cmd"]
        cfg = json.loads(cmd[cmd.index("--profiler-config") + 1])
        assert cfg["max_iterations"] == 50 and cfg["torch_profiler_dir"].endswith(f"trace-{mode}")
        (stacks,) = point["runs"][mode]["stacks"].values()
        assert stacks["engine_thread"].startswith("thread (10260)")
        prof = info["profile"]
        assert prof["client_rc"] == 0 and not os.path.exists(cfg["torch_profiler_dir"])
        steps = 2 * 2  # one wave of concurrency 2, fake_vllm_cli.STEPS_PER_REQUEST each
        assert prof["steps"] == steps and prof["gpu_us_per_step"] == pytest.approx(100.0)
        assert prof["by_class_us_per_step"]["topk"] == pytest.approx(30.0)
        assert prof["syncs_per_step"] == {"cudaStreamSynchronize": {"calls": 1.0, "us": 15.0}}
        assert prof["syncs_under"] == {"aten::item": steps}
        file, line = site.split(":")
        assert [(x["file"], x["line"], x["plugin"]) for x in info["sync_sites"]] == \
            [(file, int(line), True)]
    printed = capsys.readouterr().out
    for mode in ("stock", "plugin"):
        assert f"[{mode}] sync sites: {site}" in printed
        assert (f"[{mode}] L40-c2 engine thread: plugin 20%, waiting 10%; "
                "step (vllm/v1/engine/core.py) 90%, execute_model") in printed
        assert f"[{mode}] profile: 4 steps, GPU 100 us a step (other 70, topk 30)" in printed
        assert "1.0 host syncs a step" in printed


def test_a_core_that_heard_sigterm_and_tears_down_slowly_is_left_be(fake_vllm, monkeypatch):
    """The plugin's core logs vLLM's line on SIGTERM, after a banner of
    multi-byte characters, then takes past the abort point to exit: the stop
    finds the line (the log's byte and character offsets differ) and aborts
    nothing; the shutdown's lines are told apart from the serving's."""
    monkeypatch.setenv("FAKE_SLOW_STOP", "auto=2.5")
    out = fake_vllm / "slow"
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "0",
                       "--concurrency", "2", "--server-shutdown-timeout", "3"]) == 0
    got = _strict(out / "serve.json")
    for mode, info in got["servers"].items():
        stop = info["stop"]
        assert stop["how"] == "SIGTERM" and stop["rc"] == 0, (mode, stop)
        assert "cores_aborted" not in stop, (mode, stop)
    assert got["servers"]["plugin"]["stop"]["seconds"] >= 2.5
    text = (out / "server-plugin.log").read_text()
    assert "Fatal Python error" not in text and "\u2588" in text


def test_an_exited_core_is_not_aborted(tmp_path):
    """An engine core the log names that has exited (a zombie its parent has
    not reaped yet) is not counted as deaf to the stop signal."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 10
    while time.time() < deadline:  # exited, not reaped: /proc shows it as a zombie
        state = serve.serve_diag.signal_state(child.pid)
        if state and state["main_state"].startswith("Z"):
            break
        time.sleep(0.05)
    log = tmp_path / "server.log"
    log.write_text(f"\u2588\u2584 banner\n(EngineCore_DP0 pid={child.pid}) INFO started\n")
    server = serve.Server(["true"], {}, str(log))
    server.stop_offset = 0
    try:
        with open(log, "a") as server._logf:
            aborted, states = server._abort_deaf_cores()
        assert aborted == [] and states[str(child.pid)]["main_state"].startswith("Z"), states
    finally:
        child.wait()


def test_the_stop_reserve_is_the_servers_drain_not_half_the_kill_timeout():
    import argparse

    args = argparse.Namespace(stop_timeout=60.0, server_shutdown_timeout=10)
    assert serve.stop_reserve(args) == 10 + serve.STOP_SLACK_S
    args.server_shutdown_timeout = 0
    assert serve.stop_reserve(args) == serve.STOP_SLACK_S
    args.stop_timeout, args.server_shutdown_timeout = 8.0, 7
    assert serve.stop_reserve(args) == 8.0  # never past the kill
    # A first server up with 297 s left and a 90 s start to come, needing 19 s
    # (warm-up) + 27 s (identity) + 30.5 s (a point's guess): the drain's reserve
    # leaves room for all three, half the kill timeout did not.
    b = serve.Budget(297.0, start_reserve=90.0)
    need = 19 + 27 + 30.5
    args = argparse.Namespace(stop_timeout=60.0, server_shutdown_timeout=10)
    assert b.share(2, serve.stop_reserve(args)) - time.time() > need
    assert b.share(2, 60.0 / 2) - time.time() < need  # the half-timeout reserve did not fit


def test_a_variant_server_is_measured_and_compared_with_stock(fake_vllm, capsys):
    from vllm_dsa_varlen import settings

    out = fake_vllm / "variant"
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "4",
                       "--concurrency", "2", "--variant", f"vq:{settings.TOPK_ENV}=vllm"]) == 0
    got = _strict(out / "serve.json")
    assert list(got["servers"]) == ["stock", "plugin", "vq"]
    assert got["servers"]["vq"]["env"] == {MODE_ENV: serve.MODE_VALUES["plugin"],
                                           settings.TOPK_ENV: "vllm"}
    assert got["servers"]["vq"]["path_lines"] > 0  # the plugin's engine core, counting
    assert "client" in got["points"][0]["runs"]["vq"]
    assert got["identity_vs_stock"]["vq"]["requests"] == 4
    assert "| L40-c2 | vq |" in capsys.readouterr().out


def test_rounds_keep_every_server_up_and_take_turns(fake_vllm, capsys):
    """--rounds: one server per mode, all up before the first measured run
    and stopped after the last; in each round every mode runs each point, the
    first to run rotating; fresh prompts: one seed per round, the same for
    every mode in it; each run's path counts its own; the table's x figures
    are the medians of the same-round ratios, with their range."""
    out = fake_vllm / "rounds"
    modes = ["stock", "plugin", "control"]
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "4",
                       "--concurrency", "2", "--aa", "--rounds", "3"]) == 0
    got = _strict(out / "serve.json")
    assert list(got["servers"]) == modes
    for mode in modes:
        with open(out / f"server-{mode}.log") as f:
            assert f.read().count("engine core starting") == 1  # started once
        assert got["servers"][mode]["stop"]["how"] == "SIGTERM"
        assert got["servers"][mode]["identity"]["requests"] == 4
    point = got["points"][0]
    rounds = point["rounds"]
    assert len(rounds) == 3
    firsts, seeds = [], []
    for r, runs in enumerate(rounds):
        assert sorted(runs) == sorted(modes)
        order = sorted(modes, key=lambda m: runs[m]["t0"])
        firsts.append(order[0])
        # one mode's run ends before the next one's begins: the servers take turns
        assert all(runs[a]["t1"] <= runs[b]["t0"] for a, b in zip(order, order[1:]))
        if r:
            assert min(x["t0"] for x in runs.values()) >= max(
                x["t1"] for x in rounds[r - 1].values())
        round_seeds = {m: runs[m]["client"]["fake_seed"] for m in modes}
        assert len(set(round_seeds.values())) == 1
        seeds.append(round_seeds["stock"])
        for m in modes:
            assert runs[m]["client"]["completed"] == point["num_prompts"]
            assert (runs[m]["paths"] is not None) is (m == "plugin")
            if m == "plugin":  # each run's own steps, not the server's running total
                assert runs[m]["paths"]["steps"]["varlen"] == 2 * point["num_prompts"]
    assert firsts == modes  # rotated: each mode first once
    assert len(set(seeds)) == 3
    first_run = min(x["t0"] for runs in rounds for x in runs.values())
    last_run = max(x["t1"] for runs in rounds for x in runs.values())
    for info in got["servers"].values():  # up before the first round, stopped after the last
        assert info["ready_at"] < first_run and info["stop"]["at"] > last_run
    # the median-TPOT round's run, and the same-round ratios
    for mode in modes:
        tpots = [runs[mode]["client"]["mean_tpot_ms"] for runs in rounds]
        assert point["runs"][mode]["client"]["mean_tpot_ms"] == sorted(tpots)[1]
        assert tpots[point["runs"][mode]["round"]] == sorted(tpots)[1]
    for mode in ("plugin", "control"):
        each = sorted(runs["stock"]["client"]["mean_tpot_ms"] / runs[mode]["client"]["mean_tpot_ms"]
                      for runs in rounds)
        x = point["x_rounds"][mode]["x_tpot"]
        assert x["each"] == pytest.approx(each)
        assert (x["median"], x["min"], x["max"]) == pytest.approx((each[1], each[0], each[2]))
        row = next(r for r in got["table"] if r["mode"] == mode)
        assert row["x_tpot"] == pytest.approx(each[1])
        assert row["x_tpot_range"] == pytest.approx([each[0], each[2]])
    printed = capsys.readouterr().out
    assert f"{each[1]:.3f} [{each[0]:.3f}, {each[2]:.3f}]" in printed


@pytest.mark.parametrize("seed", [5, 6])
def test_pick_rounds_against_a_plain_reference(seed):
    """The median run per mode and each mode's same-round ratios against
    stock, on random figures with a round a mode has no result in."""
    import statistics

    rng = random.Random(seed)
    n = rng.randrange(2, 7)

    def run():
        return {"client": {"mean_tpot_ms": rng.uniform(5, 20), "p99_itl_ms": rng.uniform(10, 40),
                           "output_throughput": rng.uniform(100, 900)}}

    rounds = [{"stock": run(), "plugin": run()} for _ in range(n)]
    gap = rng.randrange(n)
    rounds[gap]["plugin"] = {"skipped": "time limit"}
    point = {"rounds": rounds}
    serve.pick_rounds(point)
    done = [r for r in rounds if "client" in r["plugin"]]
    for mode, kept in (("stock", rounds), ("plugin", done)):
        tpots = sorted(r[mode]["client"]["mean_tpot_ms"] for r in kept)
        assert point["runs"][mode]["client"]["mean_tpot_ms"] == tpots[(len(tpots) - 1) // 2]
    for name, key, stock_over in (("x_tpot", "mean_tpot_ms", True),
                                  ("x_itl_p99", "p99_itl_ms", True),
                                  ("x_tok_s", "output_throughput", False)):
        vals = [(r["stock"]["client"][key] / r["plugin"]["client"][key]) ** (1 if stock_over else -1)
                for r in done]
        got = point["x_rounds"]["plugin"][name]
        assert got["rounds"] == len(done) == n - 1
        assert got["median"] == pytest.approx(statistics.median(vals))
        assert (got["min"], got["max"]) == pytest.approx((min(vals), max(vals)))


@pytest.mark.parametrize("bad", [["--rounds", "-1"], ["--rounds", "2", "--soak-minutes", "1"]])
def test_rounds_refuse_what_runs_on_one_server_at_a_time(bad, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--out", "x", *bad])
    assert "--rounds" in capsys.readouterr().err


def test_rounds_share_the_gpu_memory_and_profile_each_server_after_them(fake_vllm):
    """Each server gets its part of the memory; with --profile-steps each has
    its own profiled window, after the last round, one server at a time."""
    out = fake_vllm / "mem"
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "0",
                       "--concurrency", "2", "--rounds", "2", "--gpu-memory-utilization",
                       "0.8", "--profile-steps", "50", "--profile-delay", "0"]) == 0
    got = _strict(out / "serve.json")
    last_run = max(x["t1"] for runs in got["points"][0]["rounds"] for x in runs.values())
    windows = []
    for info in got["servers"].values():
        cmd = info["cmd"]
        assert float(cmd[cmd.index("--gpu-memory-utilization") + 1]) == pytest.approx(0.4)
        prof = info["profile"]
        assert prof["client_rc"] == 0 and prof["steps"] == 2 * 2  # one wave of concurrency 2
        assert prof["window"][0] >= last_run
        windows.append(prof["window"])
    windows.sort()
    assert windows[0][1] <= windows[1][0]  # one server's window after the other's


def test_rounds_with_a_server_that_fails_stop_the_others_and_say_why(fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_MODE", "auto")
    out = fake_vllm / "rounds-fail"
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "0",
                       "--concurrency", "2", "--aa", "--rounds", "2"]) == 0
    got = _strict(out / "serve.json")
    assert "before it was ready" in got["servers"]["plugin"]["failed"]
    assert got["servers"]["control"] == {"skipped": "plugin's server is not up"}
    assert got["servers"]["stock"]["stop"]["how"] == "SIGTERM"  # the one up is stopped
    assert "rounds" not in got["points"][0]


def test_servers_started_together_come_up_in_one_starts_wait(fake_vllm, monkeypatch):
    """--start-together: every server launched before any is waited for, so
    three servers of 2.5 s each are up in about one start's time, not three;
    each gets the same fixed KV cache (--kv-cache-gib as vLLM's bytes); the
    rounds then run as before."""
    monkeypatch.setenv("FAKE_START_S", "auto=2.5,stock=2.5")
    out = fake_vllm / "together"
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "0",
                       "--concurrency", "2", "--aa", "--rounds", "2", "--start-together",
                       "--kv-cache-gib", "1.5"]) == 0
    got = _strict(out / "serve.json")
    servers = got["servers"]
    assert list(servers) == ["stock", "plugin", "control"]
    ready = [info["ready_at"] for info in servers.values()]
    assert max(ready) - min(ready) < 2.0, ready  # one after another: 2.5 s apart at least
    for info in servers.values():
        assert info["startup_s"] >= 2.5
        cmd = info["cmd"]
        assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(int(1.5 * 2**30))
        assert info["stop"]["how"] == "SIGTERM"
    assert len(got["points"][0]["rounds"]) == 2


def test_servers_started_together_stop_when_one_fails(fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_MODE", "auto")
    out = fake_vllm / "together-fail"
    assert serve.main(["--out", str(out), *_SMALL, "--rates", "--identity", "0",
                       "--concurrency", "2", "--rounds", "2", "--start-together",
                       "--kv-cache-gib", "1"]) == 0
    got = _strict(out / "serve.json")
    assert "before it was ready" in got["servers"]["plugin"]["failed"]
    stock = got["servers"]["stock"]
    assert stock["skipped"] == "plugin's server is not up" and stock["stop"]["how"] == "SIGTERM"
    assert "rounds" not in got["points"][0]


@pytest.mark.parametrize("bad,flag", [(["--start-together", "--kv-cache-gib", "2"],
                                       "--start-together"),
                                      (["--rounds", "2", "--start-together"], "--start-together"),
                                      (["--kv-cache-gib", "0"], "--kv-cache-gib")])
def test_start_together_needs_rounds_and_a_fixed_kv_cache(bad, flag, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--out", "x", *bad])
    assert flag in capsys.readouterr().err


def test_a_start_interrupted_while_the_server_comes_up_stops_it(fake_vllm, monkeypatch):
    args = serve.parse_args(["--out", str(fake_vllm / "intr"), *_SMALL, "--rates"])
    os.makedirs(args.out, exist_ok=True)
    model, _ = serve._model_folder(args)
    procs = []

    def interrupted(self, port, timeout):
        procs.append(self.proc)
        time.sleep(0.5)
        raise KeyboardInterrupt

    monkeypatch.setattr(serve.Server, "wait_ready", interrupted)
    result = {"servers": {}}
    with pytest.raises(KeyboardInterrupt):
        serve.start_server(args, "plugin", model, result, time.time() + 30)
    (proc,) = procs
    assert proc.poll() is not None  # gone, not left running
    assert result["servers"]["plugin"]["stop"]["how"] in ("SIGTERM", "exited by itself")


def _live(mode, per_point_s=0.0, seconds_at=None):
    live = serve.Live(mode, None, {}, 0, "")
    live.per_point_s, live.seconds_at = per_point_s, dict(seconds_at or {})
    return live


def test_a_points_expected_time_scales_the_nearest_smaller_run_by_its_prompts():
    """A run's expected seconds: the latest run with the most prompts up to
    the point's, scaled by the prompt count (c64 after c32: twice), never
    under the longest run so far; with nothing known, that longest run."""
    rng = random.Random()
    small, big = rng.randint(4, 32), rng.randint(40, 100)
    s_small, s_big = rng.uniform(1, 10), rng.uniform(11, 40)
    live = _live("stock", per_point_s=s_big, seconds_at={small: s_small, big: s_big})
    assert serve.expected_s(live, {"num_prompts": 2 * big}) == pytest.approx(2 * s_big)
    assert serve.expected_s(live, {"num_prompts": big}) == pytest.approx(s_big)
    assert serve.expected_s(live, {"num_prompts": small}) == pytest.approx(s_big)  # the floor
    slow = _live("stock", per_point_s=1.0, seconds_at={small: 1.0})
    assert serve.expected_s(slow, {"num_prompts": 3 * small}) == pytest.approx(3.0)
    assert serve.expected_s(slow, {"num_prompts": small // 2}) == pytest.approx(1.0)
    assert serve.expected_s(_live("stock", per_point_s=7.0), {"num_prompts": 64}) == 7.0


def test_a_round_runs_a_point_on_every_server_or_on_none(monkeypatch):
    """Side by side, a point starts only where the time left holds every
    server's run of it (as expected from its prompts); otherwise each is
    skipped, none half-measured; the runs go in the round's order."""
    ran = []
    monkeypatch.setattr(serve, "measure_on",
                        lambda args, live, point, model, deadline, vocab:
                        ran.append(live.mode) or {"client": {}})
    args = serve.parse_args(["--out", "x", "--prompts", "fresh", "--gap", "1"])
    order = [_live(m, 20.0, {64: 20.0}) for m in ("plugin", "stock")]
    point = {"num_prompts": 128}  # 40 s a server expected, + the gap
    now = time.time()
    assert serve.measure_side_by_side(args, order, point, "m", now + 80, 1) == {
        "plugin": {"skipped": "time limit"}, "stock": {"skipped": "time limit"}}
    assert ran == []
    got = serve.measure_side_by_side(args, order, point, "m", now + 90, 1)
    assert ran == ["plugin", "stock"] and all("client" in r for r in got.values())
