"""The end-to-end benchmark's host-side logic (no GPU, no engine): prompts,
the comparison of two runs, the trace summary, the log facts."""

import argparse
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
import e2e_trace  # noqa: E402  (beside e2e_decode, on the path it set)
from e2e_runs import run_file  # noqa: E402


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


def test_log_facts_reads_captures_and_plugin_lines(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text(
        "INFO vllm-dsa-varlen: DSA indexer decode path: varlen (triton): sm_90\n"
        "INFO vllm-dsa-varlen: decode steps {\"pid\":1,\"steps\":{}}\n"
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 10%|#| 5/49\r"
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##| 49/49\n"
        "Capturing CUDA graphs (decode, FULL): 100%|##| 33/33\n"
        "INFO Graph capturing finished in 12 secs, took 1.2 GiB\n")
    facts = e2e.log_facts(str(log))
    assert facts["cuda_graphs_captured"] == {"mixed prefill-decode, PIECEWISE": 49,
                                             "decode, FULL": 33}
    assert facts["capture_log"] and "12 secs" in facts["capture_log"][0]
    assert facts["plugin_log"] == ["vllm-dsa-varlen: DSA indexer decode path: varlen (triton): sm_90"]
    assert facts["last_line"] == "INFO Graph capturing finished in 12 secs, took 1.2 GiB"


@pytest.mark.parametrize("recorded", [False, True])
@pytest.mark.parametrize("rc", [0, 1])
def test_a_failed_child_prints_why(tmp_path, monkeypatch, capsys, rc, recorded):
    """A child that exits non-zero has its reason printed beside its return
    code: the last line of the exception its run file records (a refusal
    names its argument there), else its log's last line; a clean one not."""
    args = e2e.build_parser().parse_args(["--out", str(tmp_path), "--k", "3"])
    word = f"[both k=3] --batch / --prompt: no case fits ({random.random()})"
    tail = f"INFO shutting down ({random.random()})"

    def fake_run(cmd, env, stdout, stderr):
        stdout.write(f"INFO engine\n{word}\n{tail}\n\n")
        if recorded:
            for m in e2e.child_modes("both"):
                (tmp_path / f"run-{m}-k3.json").write_text(json.dumps(
                    {"error": f"Traceback (most recent call last):\nSystemExit: {word}\n"}))
        return type("Done", (), {"returncode": rc})()

    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    result = {"runs": []}
    e2e.run_child(args, "both", 3, 0, result)
    out = capsys.readouterr().out
    assert f"rc {rc}" in out
    assert (word in out) is (bool(rc) and recorded)
    assert (tail in out) is (bool(rc) and not recorded)
    assert result["runs"][0]["last_line"] == tail


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
PARENT_ONLY = {"out", "model", "k", "repeats", "modes", "merge", "child", "mode", "repeat", "help",
               "same_process", "control",
               "topk"}  # reaches the child as DSA_VARLEN_TOPK (its own test)


def _child_start(monkeypatch, args, mode: str) -> tuple[list, dict]:
    """The command line and environment run_child starts the ``mode`` child
    with (k = 3, no process run)."""
    seen = {}

    def fake_run(cmd, env, stdout, stderr):
        seen["cmd"], seen["env"] = cmd, env
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    monkeypatch.setattr(e2e, "log_facts", lambda path: {})
    e2e.run_child(args, mode, 3, 0, {"runs": []})
    return seen["cmd"], seen["env"]


def _child_command(monkeypatch, args, mode: str) -> list:
    """The command line run_child starts the ``mode`` child with."""
    return _child_start(monkeypatch, args, mode)[0]


@pytest.mark.parametrize("choice", [None, "auto", "own", "vllm"])
def test_the_topk_choice_reaches_the_child_as_its_environment(tmp_path, monkeypatch, choice):
    """--topk sets DSA_VARLEN_TOPK for the child (the plugin's engine
    reads it; stock's keeps vLLM's by its own mode); without it the child
    inherits the environment's."""
    monkeypatch.setenv("DSA_VARLEN_TOPK", "inherited")
    argv = ["--out", str(tmp_path), "--model", "m"] + (["--topk", choice] if choice else [])
    _, env = _child_start(monkeypatch, e2e.build_parser().parse_args(argv), "plugin")
    assert env["DSA_VARLEN_TOPK"] == (choice or "inherited")
    assert env["DSA_VARLEN"] == e2e.MODES["plugin"]


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
        if action.nargs == 0:  # a switch: given, so the child must be given it too
            want[flag] = None
            argv.append(flag)
            continue
        if action.choices:
            value = list(action.choices)[-1]
        elif action.type is float:
            value = round(random.uniform(0.1, 0.9), 3)
        elif action.type is e2e.parse_case:
            value = f"{random.randint(1, 64)}x{random.randint(1, 9) * 4096}"
        elif action.type is e2e.parse_rule:
            value = f"flattened:min_run={random.randint(2, 8)},uniform=1"
        else:
            value = random.randint(2, 999)
        want[flag] = str(value)
        argv += [flag, str(value)] if action.nargs is None else [flag, str(value)]
    args = parser.parse_args(argv)
    cmd = _child_command(monkeypatch, args, "plugin")
    for flag, value in want.items():
        assert flag in cmd, flag
        if value is not None:
            i = cmd.index(flag)
            assert cmd[i + 1] == value, (flag, cmd[i + 1], value)


@pytest.mark.parametrize("seed", range(10))
def test_case_fits_bounds_the_longest_prompts_with_their_new_tokens(seed):
    rng = random.Random()
    batch, length = rng.randrange(1, 128), rng.choice([1024, 4096, 16384, 32768])
    new, k = rng.randrange(1, 256), rng.randrange(1, 4)
    need = batch * (int(1.3 * length) + new + k + 1)
    assert e2e.case_fits(batch, length, new, k, need)
    assert not e2e.case_fits(batch, length, new, k, need - 1)
    assert e2e.case_fits(batch, length, new, k, None)  # capacity unknown: run it


@pytest.mark.parametrize("seed", range(10))
def test_nothing_fits_only_when_every_case_is_too_large(tmp_path, seed):
    """nothing_fits names the arguments (and, with two engines, their share of
    the memory) exactly when no (batch, prompt) fits; else None."""
    rng = random.Random(seed)
    batches = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64], rng.randint(1, 4)))
    prompts = sorted(rng.sample([1024, 4096, 16384, 32768], rng.randint(1, 3)))
    args = e2e.build_parser().parse_args(
        ["--out", str(tmp_path), "--k", "3", "--batch", *map(str, batches),
         "--prompt", *map(str, prompts), "--new-tokens", "48"])
    args.k = 3
    least = batches[0] * (int(1.3 * prompts[0]) + 48 + 3 + 1)
    assert e2e.nothing_fits(args, least) is None
    assert e2e.nothing_fits(args, None) is None  # capacity unknown: run
    why = e2e.nothing_fits(args, least - 1, engines=2)
    assert why is not None and "--batch / --prompt" in why and f"{least - 1} tokens" in why
    assert "1/2 of --gpu-memory-utilization" in why and f"needs {least}" in why
    assert "engines" not in e2e.nothing_fits(args, least - 1)


@pytest.mark.parametrize("n", range(1, 8))
def test_median_round_is_the_middle_tpot(n):
    rng = random.Random()
    rounds = [{"tpot_ms": rng.uniform(5, 30), "i": i} for i in range(n)]
    mid = e2e.median_round(rounds)
    below = sum(r["tpot_ms"] < mid["tpot_ms"] for r in rounds)
    above = sum(r["tpot_ms"] > mid["tpot_ms"] for r in rounds)
    assert below == (n - 1) // 2 and above == n // 2


def test_case_rounds_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        e2e.main(["--out", str(tmp_path), "--case-rounds", "0"])


class FakeEngine:
    """vLLM's engine as the benchmark drives it: requests emit one token per
    step (the first with their prefill), tokens a function of the prompt;
    ``path``: every step counted on the decode-path counters as that path;
    ``log``: a list shared by engines, of ``(name, request id)`` as added."""

    def __init__(self, capacity_tokens: int, path: str | None = None, log=None, name="",
                 prefill_steps: int = 0):
        from types import SimpleNamespace

        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(
            num_gpu_blocks=capacity_tokens // 64, block_size=64))
        self.live, self.added, self.path = {}, [], path
        self.log, self.name = log, name
        # prefill_steps > 0: a prompt not seen before waits that many steps
        # behind every unseen prompt added before it (chunked prefill, one
        # request at a time), a seen one (prefix cache) none
        self.prefill_steps, self.seen, self.queue = prefill_steps, set(), 0

    def add_request(self, rid, prompt, params):
        ids = prompt["prompt_token_ids"]
        self.added.append((rid, len(ids)))
        if self.log is not None:
            self.log.append((self.name, rid))
        wait = 0
        if self.prefill_steps and tuple(ids) not in self.seen:
            self.seen.add(tuple(ids))
            self.queue += self.prefill_steps
            wait = self.queue
        self.live[rid] = [params.max_tokens, sum(ids) % 1000, wait]

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        from types import SimpleNamespace

        outs = []
        self.queue = max(0, self.queue - 1)
        for rid, state in list(self.live.items()):
            if state[2] > 1:  # still prefilling
                state[2] -= 1
                outs.append(SimpleNamespace(request_id=rid, num_cached_tokens=0, outputs=[
                    SimpleNamespace(token_ids=[], logprobs=None)]))
                continue
            state[2] = 0
            state[0] -= 1
            state[1] = (state[1] * 31 + 7) % 1000
            outs.append(SimpleNamespace(request_id=rid, num_cached_tokens=0, outputs=[
                SimpleNamespace(token_ids=[state[1]], logprobs=None)]))
            if state[0] == 0:
                del self.live[rid]
        if self.path:
            from vllm_dsa_varlen import stats

            stats.record(self.path, variable=False, mixed=False)
        return outs


@pytest.mark.parametrize("rounds", [1, 3])
def test_run_cases_measures_fitting_cases_in_rounds_and_skips_the_rest(rounds, tmp_path):
    pytest.importorskip("vllm")
    rng = random.Random()
    new = rng.randrange(4, 12)
    args = e2e.build_parser().parse_args(
        ["--out", str(tmp_path), "--batch", "1", "4", "16", "--prompt", "1024", "4096",
         "--new-tokens", str(new), "--case-rounds", str(rounds), "--warm-tokens", "2"])
    args.k = 3
    # room for 16 requests at 1K but only 4 at 4K
    capacity = 16 * (int(1.3 * 1024) + new + 4)
    engine = FakeEngine(capacity + 64)

    def prompts_of(length, first=0, count=16):
        return [e2e.prompt_ids(i, length, 4096) for i in range(first, first + count)]

    timer = type("T", (), {"take": lambda self: {"calls": 0}})()
    result = {"cases": []}
    jit0 = e2e.run_cases([("plugin", engine, result)], args, prompts_of, timer,
                         lambda: {"jit": 1})
    assert jit0 == {"jit": 1}
    got = {(c["batch"], c["prompt"]): c for c in result["cases"]}
    assert list(got) == [(1, 1024), (4, 1024), (16, 1024), (1, 4096), (4, 4096), (16, 4096)]
    assert "skipped" in got[16, 4096] and all("skipped" not in c for key, c in got.items()
                                               if key != (16, 4096))
    # nothing of the skipped case reached the engine: at most 4 requests at 4K
    assert max(sum(1 for rid, n in engine.added if rid.startswith(tag) and n > 2000)
               for tag in ("prefill-L4096", "warm-B16-L4096")) <= 4
    for key, case in got.items():
        if "skipped" in case:
            continue
        assert len(case["rounds"]) == rounds and case["rounds_tokens_equal"]
        assert case["tpot_ms"] == e2e.median_round(case["rounds"])["tpot_ms"]
        assert len(case["tokens"]) == key[0] and all(len(t) == new for t in case["tokens"])
        assert case["decode_steps"] == new - 1 and case["step_ms_median"] >= 0
        assert all(set(r["gpu_before"]) == {"sm_clock_mhz", "power_w", "temperature_c"}
                   for r in case["rounds"])


def test_build_timer_counts_calls_per_token_count_of_the_step(monkeypatch):
    """The build timer wraps whatever ``build`` is installed, passes its
    result through, and splits its calls by the step's token count."""
    from types import SimpleNamespace

    ix = pytest.importorskip("vllm.v1.attention.backends.mla.indexer")
    cls = ix.DeepseekV32IndexerMetadataBuilder
    seen = []
    monkeypatch.setattr(cls, "build", lambda self, cpl, cm, fast_build=False: (
        seen.append((cpl, cm.num_actual_tokens, fast_build)), -cm.num_actual_tokens)[1])
    timer = e2e.BuildTimer()
    counts = [random.choice((5, 64, 192)) for _ in range(30)]
    for t in counts:
        assert cls.build(object(), 0, SimpleNamespace(num_actual_tokens=t)) == -t
    assert seen == [(0, t, False) for t in counts]
    out = timer.take()
    assert out["calls"] == 30 and out["us_per_call"] > 0
    assert {int(k): v["calls"] for k, v in out["by_tokens"].items()} == {
        t: counts.count(t) for t in set(counts)}
    assert timer.take() == {"calls": 0, "us_per_call": None, "by_tokens": {}}


def test_cpu_lists_parse_to_sets_and_bad_ones_are_refused():
    for _ in range(50):
        cpus = sorted(random.sample(range(64), random.randint(1, 12)))
        text = ",".join(str(c) for c in cpus)
        assert e2e.parse_cpus(text) == set(cpus)
    assert e2e.parse_cpus("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    for bad in ("", "a", "3-1", "1-", "-2", "1,,2", "0-3;5"):
        with pytest.raises(ValueError):
            e2e.parse_cpus(bad)
    with pytest.raises(SystemExit):
        e2e.main(["--out", "/tmp/x", "--cpus", "7-2"])


class _FakeTimer:
    def __init__(self):
        self.n = 0

    def take(self):
        self.n += 1
        return {"calls": 2, "us_per_call": float(self.n),
                "by_tokens": {"24": {"calls": 2, "us_per_call": float(self.n)}}}


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_cases_alternate_and_keep_each_engines_own_counters(rounds):
    """Two engines in one process: every case's rounds alternate (stock,
    plugin / plugin, stock, ...), each engine's counters and build() times are
    its own rounds', a case that does not fit one engine is skipped for it."""
    from types import SimpleNamespace

    from vllm_dsa_varlen import stats

    stats.reset()
    args = SimpleNamespace(prompt=[64, 128], batch=[1, 3], new_tokens=5, warm_tokens=2,
                           case_rounds=rounds, k=2, mode="both")
    stock, plugin = {"cases": []}, {"cases": []}
    # the plugin's engine holds fewer tokens: B3 x 128 does not fit it
    added = []
    engines = [("stock", FakeEngine(10**6, "stock_flattened", added, "stock"), stock),
               ("plugin", FakeEngine(3 * 167 + 64, "varlen", added, "plugin"), plugin)]
    timer = _FakeTimer()
    e2e.run_cases(engines, args, lambda length, first=0, count=3: [
        e2e.prompt_ids(i, length, 4096) for i in range(first, first + count)], timer,
        lambda: {"jit": 0})
    # the measured rounds in the order they reached the engines
    log = []
    for name, rid in added:
        key = (name, rid.rsplit("-", 1)[0])
        if rid.startswith("B") and (not log or log[-1] != key):
            log.append(key)
    measured = [(length, b) for length in args.prompt for b in args.batch]
    want_log = []
    for length, b in measured:
        live = ["stock"] + (["plugin"] if (length, b) != (128, 3) else [])
        for rnd in range(rounds):
            want_log += [(m, f"B{b}-L{length}-r{rnd}")
                         for m in (live if rnd % 2 == 0 else live[::-1])]
    assert log == want_log
    for result, path in ((stock, "stock_flattened"), (plugin, "varlen")):
        for case in result["cases"]:
            if (case["prompt"], case["batch"]) == (128, 3) and result is plugin:
                assert "skipped" in case
                continue
            steps = sum(r["decode_steps"] + r["prefill_steps"] for r in case["rounds"])
            assert case["paths"]["steps"] == {**dict.fromkeys(case["paths"]["steps"], 0),
                                              path: steps}
            assert len(case["rounds"]) == rounds and case["rounds_tokens_equal"]
            assert case["indexer_build"]["calls"] == 2 * rounds
        assert [(c["prompt"], c["batch"]) for c in result["cases"]] == measured


def test_merged_build_times_weigh_each_window_by_its_calls():
    takes = [{"calls": random.randint(0, 9), "us_per_call": random.uniform(1, 500),
              "by_tokens": {"8": {"calls": 1, "us_per_call": random.uniform(1, 9)}}}
             for _ in range(6)]
    for t in takes:
        if not t["calls"]:
            t["us_per_call"] = None
    got = e2e.merge_builds(takes)
    calls = sum(t["calls"] for t in takes)
    assert got["calls"] == calls
    if calls:
        assert got["us_per_call"] == pytest.approx(
            sum(t["calls"] * t["us_per_call"] for t in takes if t["calls"]) / calls)
    assert got["by_tokens"]["8"]["calls"] == 6
    assert got["by_tokens"]["8"]["us_per_call"] == pytest.approx(
        sum(t["by_tokens"]["8"]["us_per_call"] for t in takes) / 6)


def test_same_process_needs_both_modes():
    with pytest.raises(SystemExit):
        e2e.main(["--out", "/tmp/x", "--same-process", "--modes", "plugin"])


def _publish_module():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "publish_e2e.py")
    spec = importlib.util.spec_from_file_location("publish_e2e", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("second", ["plugin", "control"])
@pytest.mark.parametrize("same_tokens", [True, False, "case"])
def test_the_kept_copy_is_small_and_reproduces_the_summaries(tmp_path, same_tokens, second):
    """A synthetic run folder (stock's and the plugin's runs, or stock's and
    its --control twin's): the kept copy drops the identity run's top-2 unless
    the pair's tokens differ (in the identity run or a case), keeps the kernel events (the summary reproduces
    from them) and counts the host events per name."""
    import lzma

    pub = _publish_module()
    out, dest = tmp_path / "out", tmp_path / "kept"
    out.mkdir()
    rng = random.Random()
    names = ["varlen_logits_sm90", "void deep_gemm::sm90_fp8_paged_mqa_logits<1u>", "gemm_x",
             "cooperative_topk_cs4"]
    for mode in ("stock", second):
        events = [{"cat": "kernel", "name": rng.choice(names), "ts": i, "dur": rng.uniform(1, 50),
                   "args": {"correlation": i}} for i in range(200)]
        events += [{"cat": rng.choice(pub.HOST_CATEGORIES), "name": rng.choice("abc"), "ts": i,
                    "dur": 1.5} for i in range(50)] + [{"cat": "ac2g", "name": "flow", "ts": 0}]
        with gzip.open(out / f"trace-{mode}-k2.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)
        differ = mode != "stock" and same_tokens is not True
        tokens = [[1, 2, 4]] if differ and same_tokens is False else [[1, 2, 3]]
        case_tokens = [[5, 6, 8]] if differ and same_tokens == "case" else [[5, 6, 7]]
        run = {"mode": mode, "identity": {"tokens": tokens, "top2": [[[[1, -0.1], [2, -0.2]]]]},
               "cases": [{"batch": 1, "prompt": 64, "tokens": case_tokens}],
               "trace": {"file": f"trace-{mode}-k2.json.gz", "steps": 3}}
        (out / f"run-{mode}-k2.json").write_text(json.dumps(run))
        (out / f"log-{mode}-k2.txt").write_text("log " * 100)
    (out / "e2e.json").write_text("{}")
    written = pub.publish(str(out), str(dest))
    assert sorted(os.path.basename(p) for p in written) == sorted(
        ["e2e.json.xz", f"log-{second}-k2.txt.xz", "log-stock-k2.txt.xz",
         f"run-{second}-k2.json.xz", "run-stock-k2.json.xz", f"trace-{second}-k2.kernels.json.xz",
         "trace-stock-k2.kernels.json.xz", "trace-host-ops.json"])
    for mode in ("stock", second):
        run = json.loads(lzma.open(dest / f"run-{mode}-k2.json.xz").read())
        assert ("top2" in run["identity"]) is (same_tokens is not True)
        kept = json.loads(lzma.open(dest / f"trace-{mode}-k2.kernels.json.xz").read())
        full = json.load(gzip.open(out / f"trace-{mode}-k2.json.gz", "rt"))
        assert e2e_trace.summarize_from_events(kept["traceEvents"], 3) == \
            e2e_trace.summarize_from_events(full["traceEvents"], 3)
        assert all(set(ev) == {"cat", "name", "dur", "ts"} for ev in kept["traceEvents"])
        assert "gpu_busy_fraction" in e2e_trace.summarize_from_events(kept["traceEvents"], 3)
    hosts = json.loads((dest / "trace-host-ops.json").read_text())
    assert sum(c for c, _ in hosts["trace-stock-k2"].values()) == 50


def test_engines_in_one_process_keep_their_own_graphs_and_workspace(monkeypatch):
    """vLLM's CUDA-graph memory profiling at an engine's start clears every
    graph wrapper in the process and a new engine replaces the workspace
    manager: an engine built beside another keeps the other's captured graphs
    and registry entries, and each engine's calls run with its own workspace."""
    cuda_graph = pytest.importorskip("vllm.compilation.cuda_graph")
    workspace = pytest.importorskip("vllm.v1.worker.workspace")
    import weakref

    classes = [cuda_graph.CUDAGraphWrapper]
    try:
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper

        classes.append(BreakableCUDAGraphWrapper)
    except ImportError:
        pass
    for cls in classes:
        monkeypatch.setattr(cls, "_all_instances", weakref.WeakSet())
    monkeypatch.setattr(workspace, "_manager", None)

    class Wrapper:  # a graph wrapper double: captured graphs, cleared by clear_graphs
        def __init__(self, cls):
            self.graphs, self.cls = None, cls
            cls._all_instances.add(self)

        def clear_graphs(self):
            self.graphs = None

    seen = []

    class Engine:
        def __init__(self, manager):
            self.manager = manager
            self.vllm_config = "config"

        def step(self):
            seen.append((self, workspace._manager, topk._forced))
            return []

    def make():  # an engine start as vLLM's: profile (clear all), then capture
        wrappers = [Wrapper(cls) for cls in classes for _ in range(random.randint(1, 3))]
        for cls in classes:
            cls.clear_all_graphs()
        for w in wrappers:
            w.graphs = "captured"
        manager = object()
        workspace._manager = manager
        return type("LLM", (), {"llm_engine": Engine(manager), "wrappers": wrappers})()

    from vllm_dsa_varlen import topk

    first = e2e.OwnEngine(make, own_topk=False)
    second = e2e.OwnEngine(make)
    assert all(w.graphs == "captured" for w in first.llm.wrappers + second.llm.wrappers)
    for cls in classes:  # every engine's wrappers back in their class's registry
        assert set(cls._all_instances) == {
            w for w in first.llm.wrappers + second.llm.wrappers if w.cls is cls}
    assert first.vllm_config == "config"
    for own in random.choices([first, second], k=6):
        own.step()
    assert all(mgr is engine.manager for engine, mgr, _ in seen)
    assert {engine for engine, _, _ in seen} <= {first.engine, second.engine}
    # each engine's top-k choice in force during its calls: vLLM's for the
    # first, the plugin's own decision for the second
    assert all(forced is (False if engine is first.engine else None)
               for engine, _, forced in seen)
    topk.reset()


def test_a_graph_mode_vllm_lowered_is_named_and_one_it_kept_is_not():
    """--graph-mode full with an attention backend that captures uniform batches
    only runs FULL_AND_PIECEWISE (vLLM 0.27.1 on the H200): the merged result
    says which run and what it ran; runs that got what they asked say nothing."""
    lowered = {"graph_mode": "full", "cudagraph_mode": "CUDAGraphMode.FULL_AND_PIECEWISE"}
    kept = {"graph_mode": "default", "cudagraph_mode": "CUDAGraphMode.FULL_AND_PIECEWISE"}
    none = {"graph_mode": "none", "cudagraph_mode": "CUDAGraphMode.FULL_DECODE_ONLY"}
    notes = e2e.graph_mode_notes({"stock": lowered, "plugin": kept, "other": none})
    assert len(notes) == 1 and notes[0].startswith("stock: --graph-mode full")
    assert notes[0].endswith("FULL_AND_PIECEWISE")
    assert e2e.graph_mode_notes({"stock": {"graph_mode": "full"}}) == []  # mode unknown


@pytest.mark.parametrize("seed", range(3))
def test_a_k_entry_names_each_modes_vllm_version(seed):
    """e2e.json says which vLLM ran each mode (a run whose run files are lost
    still places in the grid)."""
    rng = random.Random(seed)
    versions = {m: rng.choice(["0.27.1", "0.33.0"]) for m in ("stock", "plugin")}
    runs = {m: {"vllm": v, "init_s": rng.uniform(1, 9), "jit": {}, "cases": []}
            for m, v in versions.items()}
    entry = e2e.k_entry(runs, [runs])
    assert entry["vllm"] == versions
    assert e2e.k_entry({"stock": runs["stock"]}, [])["vllm"] == {"stock": versions["stock"]}


def test_control_is_a_same_process_option(tmp_path):
    with pytest.raises(SystemExit):
        e2e.main(["--out", str(tmp_path), "--control"])


@pytest.mark.parametrize("control", [False, True])
def test_same_process_control_runs_stocks_engine_twice_and_compares_the_pair(
        tmp_path, monkeypatch, control, capsys):
    """--same-process --control: one child process of mode ``control`` whose
    engines are stock's twice (the second named "control", both with
    DSA_VARLEN=stock); e2e.json says so, compares stock with the control
    in the plugin's columns and names it in the table; the grid refuses such a
    folder.  Without --control: the child runs stock and the plugin."""
    rng = random.Random()
    tpot = {m: [rng.uniform(9, 20) for _ in range(3)] for m in ("stock", "plugin", "control")}
    seen = []

    def fake_run(cmd, env, stdout, stderr):
        mode = cmd[cmd.index("--mode") + 1]
        out, k = cmd[cmd.index("--out") + 1], cmd[cmd.index("--k") + 1]
        seen.append(mode)
        for m in e2e.child_modes(mode):
            run = run_file([[1, 2, 3]])
            run["cases"][0].update(tpot_ms=tpot[m][0], rounds=[{"tpot_ms": t} for t in tpot[m]])
            run.update(init_s=1.0, jit={}, mode=m, control=mode == e2e.CONTROL)
            with open(os.path.join(out, f"run-{m}-k{k}.json"), "w") as f:
                json.dump(run, f)
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    monkeypatch.setattr(e2e, "log_facts", lambda path: {})
    argv = ["--out", str(tmp_path), "--model", "m", "--k", "2", "--batch", "3", "--prompt",
            "4096", "--same-process"] + (["--control"] if control else [])
    assert e2e.main(argv) == 0
    second = "control" if control else "plugin"
    assert seen == [e2e.CONTROL if control else e2e.BOTH]
    assert e2e.child_modes(seen[0]) == ("stock", second)
    assert e2e.ENGINE_ENV["control"] == e2e.MODES["stock"] == "stock"
    got = json.load(open(tmp_path / "e2e.json"))
    assert got["control"] is control
    entry = got["per_k"]["2"]
    assert entry["second"] == second
    row = entry["comparison"]["rows"][0]
    assert (row["stock_tpot_ms"], row["plugin_tpot_ms"]) == (tpot["stock"][0], tpot[second][0])
    assert row["round_tpot_ms"] == [tpot["stock"], tpot[second]]
    out = capsys.readouterr().out
    assert f"| {second} TPOT ms (rounds) |" in out
    for m in ("stock", second):  # each engine's reported TPOT and its rounds' range
        assert (f"| {tpot[m][0]:.2f} ({min(tpot[m]):.2f}-{max(tpot[m]):.2f}) |") in out
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "e2e_cells.py")
    spec = importlib.util.spec_from_file_location("e2e_cells", path)
    cells = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cells)
    if control:
        with pytest.raises(SystemExit, match="A/A control"):
            cells.folder_cells(str(tmp_path))
    else:
        _, got_cells = cells.folder_cells(str(tmp_path))
        pairs = [a / b for a, b in zip(tpot["stock"], tpot["plugin"])]
        assert got_cells[0]["pairs"] == pytest.approx(pairs)


class _StepTimer:
    """A build timer fed by the fake engines: every step of an engine "builds"
    once, at that engine's own cost, so a take attributed to the wrong engine's
    step shows as the other's cost."""

    def __init__(self):
        self.calls, self.us = 0, 0.0

    def build(self, us: float) -> None:
        self.calls += 1
        self.us += us

    def take(self):
        out = {"calls": self.calls, "us_per_call": self.us / self.calls if self.calls else None,
               "by_tokens": ({"24": {"calls": self.calls, "us_per_call": self.us / self.calls}}
                             if self.calls else {})}
        self.calls, self.us = 0, 0.0
        return out


class _SteppingEngine(FakeEngine):
    def __init__(self, *a, timer, cost, steps, **kw):
        super().__init__(*a, **kw)
        self.timer, self.cost, self.step_log = timer, cost, steps

    def step(self):
        self.timer.build(self.cost)
        self.step_log.append(self.name)
        return super().step()


@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_lockstep_rounds_alternate_steps_and_keep_each_engines_own_builds_and_counters(rounds):
    """--lockstep: within a round the two engines step in turn (the round's first
    engine first, the first alternating by round as in the round order), each
    engine's build() times and counters are its own steps', and its figures
    and tokens are what it would produce alone."""
    from types import SimpleNamespace

    from vllm_dsa_varlen import stats

    stats.reset()
    rng = random.Random()
    new = rng.randrange(3, 9)
    args = SimpleNamespace(prompt=[64], batch=[2], new_tokens=new, warm_tokens=2,
                           case_rounds=rounds, k=2, mode="both", lockstep=True)
    timer, steps = _StepTimer(), []
    costs = {"stock": rng.uniform(100, 200), "plugin": rng.uniform(300, 400)}
    results = {"stock": {"cases": []}, "plugin": {"cases": []}}
    paths = {"stock": "stock_flattened", "plugin": "varlen"}
    engines = [(m, _SteppingEngine(10**6, paths[m], None, m, timer=timer, cost=costs[m],
                                   steps=steps), results[m]) for m in ("stock", "plugin")]
    prompts_of = lambda length, first=0, count=2: [  # noqa: E731
        e2e.prompt_ids(i, length, 4096) for i in range(first, first + count)]
    e2e.run_cases(engines, args, prompts_of, timer, lambda: {"jit": 0})
    # the measured steps: after the warm-up's (every engine's warm-up first)
    warm = len(steps) - rounds * 2 * new
    measured = steps[warm:]
    for rnd in range(rounds):
        first, second = ("stock", "plugin") if rnd % 2 == 0 else ("plugin", "stock")
        assert measured[rnd * 2 * new:(rnd + 1) * 2 * new] == [first, second] * new
    alone = e2e._run_case(FakeEngine(10**6), prompts_of(64), new, "alone")
    for mode, result in results.items():
        (case,) = result["cases"]
        assert len(case["rounds"]) == rounds and case["rounds_tokens_equal"]
        assert case["tokens"] == [alone[1][r] for r in alone[0]]
        assert case["indexer_build"]["calls"] == rounds * new
        assert case["indexer_build"]["us_per_call"] == pytest.approx(costs[mode])
        assert case["paths"]["steps"][paths[mode]] == rounds * new
        assert sum(case["paths"]["steps"].values()) == rounds * new
        assert all(r["decode_steps"] == new - 1 for r in case["rounds"])


def test_lockstep_is_a_same_process_option_and_reaches_the_child(tmp_path):
    with pytest.raises(SystemExit):
        e2e.main(["--out", str(tmp_path), "--lockstep"])
    args = e2e.build_parser().parse_args(["--out", str(tmp_path), "--same-process",
                                          "--lockstep"])
    assert args.lockstep


@pytest.mark.parametrize("control", [False, True])
def test_a_lockstep_child_passes_the_checks_and_runs_in_lockstep(tmp_path, monkeypatch, control):
    """The command a one-process lockstep parent hands its child is accepted
    by the child's own argument checks (the child has no --same-process: its
    mode says it) and reaches child() with lockstep on; a one-engine child
    given --lockstep is refused."""
    argv = ["--out", str(tmp_path), "--same-process", "--lockstep", "--k", "3"]
    parser = e2e.build_parser()
    args = parser.parse_args(argv + (["--control"] if control else []))
    mode = e2e.CONTROL if control else e2e.BOTH
    child_argv = _child_command(monkeypatch, args, mode)[2:]
    ran = {}
    monkeypatch.setattr(e2e, "child", lambda a: ran.setdefault("args", a))
    assert e2e.main(child_argv) == 0
    assert ran["args"].lockstep and ran["args"].mode == mode
    one_engine = list(child_argv)
    one_engine[one_engine.index("--mode") + 1] = "plugin"
    with pytest.raises(SystemExit):
        e2e.main(one_engine)


def test_gc_clock_counts_collections_and_pauses_per_generation():
    import gc

    clock = e2e.GcClock()
    gc_was = gc.isenabled()
    gc.disable()  # only the collections made here
    try:
        clock.take()
        n = random.randint(1, 4)
        for _ in range(n):
            gc.collect(2)
        got = clock.take()
        assert got["collections"] == [0, 0, n] and all(ms >= 0 for ms in got["ms"])
        assert got["ms"][2] > 0
        assert clock.take() == {"collections": [0, 0, 0], "ms": [0.0, 0.0, 0.0]}  # reset
    finally:
        clock.close()
        if gc_was:
            gc.enable()
    assert clock._callback not in gc.callbacks
    a = {"collections": [1, 2, 3], "ms": [0.5, 1.0, 2.0]}
    assert e2e.add_gc(None, a) == a and e2e.add_gc(a, a) == {"collections": [2, 4, 6],
                                                            "ms": [1.0, 2.0, 4.0]}


@pytest.mark.parametrize("lockstep", [True, False])
def test_each_collection_counts_toward_the_engine_whose_step_ran_it(lockstep):
    """The collector clocked, rounds alternating or steps in lockstep: a
    collection inside one engine's step counts toward that engine's rounds,
    never the other's."""
    import gc
    from types import SimpleNamespace

    from vllm_dsa_varlen import stats

    class Collecting(FakeEngine):
        def step(self):
            if self.name == "plugin":
                gc.collect(0)
            return super().step()

    stats.reset()
    new = random.randint(3, 7)
    args = SimpleNamespace(prompt=[64], batch=[2], new_tokens=new, warm_tokens=1,
                           case_rounds=2, k=2, mode="both", lockstep=lockstep)
    results = {"stock": {"cases": []}, "plugin": {"cases": []}}
    engines = [(m, Collecting(10**6, None, None, m), results[m]) for m in ("stock", "plugin")]
    clock = e2e.GcClock()
    gc_was = gc.isenabled()
    gc.disable()  # only the fake engine's own collections
    try:
        e2e.run_cases(engines, args, lambda length, first=0, count=2: [
            e2e.prompt_ids(i, length, 4096) for i in range(first, first + count)],
            _FakeTimer(), lambda: {"jit": 0}, clock)
    finally:
        clock.close()
        if gc_was:
            gc.enable()
    (stock,), (plugin,) = results["stock"]["cases"], results["plugin"]["cases"]
    assert stock["gc"]["collections"] == [0, 0, 0]
    assert plugin["gc"]["collections"][0] == 2 * new  # every step of both rounds
    assert all(r["gc"]["collections"][0] == new for r in plugin["rounds"])


@pytest.mark.parametrize("choice", ["default", "on", "off"])
def test_async_scheduling_reaches_the_engine_arguments_only_when_asked(tmp_path, choice):
    """--async-scheduling on/off sets vLLM's async_scheduling; default leaves it
    to vLLM (no key), so an unchanged command runs what vLLM would."""
    args = e2e.build_parser().parse_args(["--out", str(tmp_path), "--k", "2",
                                          "--async-scheduling", choice])
    args.k = args.k[0]
    kwargs = e2e.engine_kwargs(args)
    if choice == "default":
        assert "async_scheduling" not in kwargs
    else:
        assert kwargs["async_scheduling"] is (choice == "on")


@pytest.mark.parametrize("seed", range(8))
def test_trace_cases_largest_is_one_window_and_every_is_each_fitting_case(tmp_path, seed):
    """--trace-cases largest: one window at the longest prompt that fits, at
    --trace-batch or its largest fitting batch; every: each fitting (batch,
    prompt) once, the largest last, each with its own file suffix."""
    rng = random.Random(seed)
    batches = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64], rng.randint(1, 4)))
    prompts = sorted(rng.sample([1024, 4096, 16384, 32768], rng.randint(1, 3)))
    argv = ["--out", str(tmp_path), "--k", "2", "--batch", *map(str, batches),
            "--prompt", *map(str, prompts), "--new-tokens", "32"]
    args = e2e.build_parser().parse_args(argv)
    args.k = 2
    capacity = rng.choice([None, rng.randint(10_000, 3_000_000)])
    fits = {(b, x) for b in batches for x in prompts if e2e.case_fits(b, x, 32, 2, capacity)}
    args.trace_cases = "every"
    every = e2e.trace_cases(args, capacity)
    args.trace_cases = "largest"
    (one,) = e2e.trace_cases(args, capacity)
    if fits:
        assert {(b, x) for b, x, _ in every} == fits and len(every) == len(fits)
        assert len({s for _, _, s in every}) == len(every)
        assert (every[-1][0], every[-1][1]) == max(fits, key=lambda c: (c[1], c[0]))
    else:  # nothing fits: the one window of "largest"
        assert every == [one]
    if fits:
        longest = max(x for _, x in fits)
        assert one == (max(b for b, x in fits if x == longest), longest, "")
    args.trace_batch = 3
    assert e2e.trace_cases(args, capacity)[0][0] == 3


def test_per_case_traces_are_kept_with_their_own_step_counts(tmp_path):
    """publish_e2e keeps every per-case trace of a run (--trace-cases every),
    each summary reproduced from its kernel events with the step count its run
    recorded for that file."""
    import lzma

    pub = _publish_module()
    out, dest = tmp_path / "out", tmp_path / "kept"
    out.mkdir()
    rng = random.Random()
    traces = []
    for i, (b, steps) in enumerate(((1, 2), (8, 5))):
        name = f"trace-plugin-k2-b{b}-4k.json.gz"
        events = [{"cat": "kernel", "name": rng.choice(["varlen_logits_sm90", "gemm_x"]),
                   "ts": j, "dur": rng.uniform(1, 50)} for j in range(60)]
        with gzip.open(out / name, "wt") as f:
            json.dump({"traceEvents": events}, f)
        traces.append({"file": name, "steps": steps, "batch": b, "prompt": 4096})
    run = {"mode": "plugin", "trace": traces[-1], "traces": traces}
    (out / "run-plugin-k2.json").write_text(json.dumps(run))
    (out / "e2e.json").write_text("{}")
    pub.publish(str(out), str(dest))
    for t in traces:
        kept = json.loads(lzma.open(dest / t["file"].replace(".json.gz", ".kernels.json.xz")).read())
        full = json.load(gzip.open(out / t["file"], "rt"))
        assert e2e_trace.summarize_from_events(kept["traceEvents"], t["steps"]) == \
            e2e_trace.summarize_from_events(full["traceEvents"], t["steps"])


@pytest.mark.parametrize("asked", [None, "on", "off"])
def test_lockstep_turns_async_scheduling_off_unless_asked_on(tmp_path, monkeypatch, asked):
    """Under --lockstep the engines' steps must each end with their own GPU
    work: async scheduling goes off by default (the child is handed "off"), and
    an explicit choice stands; without --lockstep the default is vLLM's."""
    seen = {}
    monkeypatch.setattr(e2e, "parent", lambda a: seen.setdefault("args", a) and 0)
    extra = [] if asked is None else ["--async-scheduling", asked]
    e2e.main(["--out", str(tmp_path), "--same-process", "--lockstep", *extra])
    assert seen.pop("args").async_scheduling == (asked or "off")
    e2e.main(["--out", str(tmp_path), "--same-process", *extra])
    assert seen.pop("args").async_scheduling == (asked or "default")


@pytest.mark.parametrize("seed", range(3))
def test_a_profiled_window_is_the_whole_batch_decoding_past_its_prefill(tmp_path, seed):
    """A profiled window starts once every request of the case decodes (its
    prompts prefilled first), so each profiled step has the whole batch
    decoding, even where a prefill takes many steps per request; the window
    keeps the decode-path counts of its steps and its trace file."""
    from types import SimpleNamespace

    from vllm_dsa_varlen import stats

    pytest.importorskip("vllm")
    rng = random.Random(seed)
    batch, steps = rng.randint(6, 16), rng.randint(1, 4)
    new = e2e.TRACE_SETTLE + steps + rng.randint(1, 6)
    args = e2e.build_parser().parse_args(
        ["--out", str(tmp_path), "--new-tokens", str(new), "--trace-steps", str(steps)])
    args.k = 2
    engine = FakeEngine(10**8, path="varlen", prefill_steps=rng.randint(2, 4))

    def prompts_of(length, first=0, count=16):
        return [e2e.prompt_ids(i, length, 4096) for i in range(first, first + count)]

    fake_torch = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None))
    stats.reset()
    w = e2e._trace_window(args, "plugin", engine, prompts_of, fake_torch, batch, 1024, "-x")
    assert w["decoding"] == [batch] * steps
    assert w["paths"]["varlen"] == steps and w["batch"] == batch and w["prompt"] == 1024
    assert (tmp_path / w["file"]).exists() and w["steps"] == steps
    assert not engine.has_unfinished_requests()
    # the same engine without the prefill first: the window would start with
    # requests still prefilling (what this guards against)
    late = FakeEngine(10**8, prefill_steps=3)
    stepper = e2e._Stepper(late, prompts_of(2048, count=batch), new, "t")
    for _ in range(e2e.TRACE_SETTLE):
        stepper.step()
    assert not all(stepper.tokens[r] for r in stepper.ids)


def test_trace_only_needs_profiled_steps_refuses_lockstep_and_traces_every_case(tmp_path):
    with pytest.raises(SystemExit):
        e2e.main(["--out", str(tmp_path), "--trace-only", "--trace-steps", "0"])
    with pytest.raises(SystemExit):
        e2e.main(["--out", str(tmp_path), "--trace-only", "--same-process", "--lockstep"])
    args = e2e.build_parser().parse_args(["--out", str(tmp_path), "--trace-only", "--batch",
                                          "1", "8", "--prompt", "4096", "16384"])
    args.k = 3
    assert [(b, x) for b, x, _ in e2e.trace_cases(args, None)] == \
        [(1, 4096), (8, 4096), (1, 16384), (8, 16384)]
    args.trace_skip = [(8, 4096), (1, 16384)]
    assert [(b, x) for b, x, _ in e2e.trace_cases(args, None)] == [(1, 4096), (8, 16384)]


def test_trace_skip_takes_bxl_cases_and_reaches_the_child(tmp_path, monkeypatch):
    for bad in ("32", "x4096", "32x", "0x4096", "ax4096"):
        with pytest.raises(SystemExit):
            e2e.build_parser().parse_args(["--out", str(tmp_path), "--trace-skip", bad])
    args = e2e.build_parser().parse_args(["--out", str(tmp_path), "--model", "m", "--trace-only",
                                          "--trace-skip", "32x32768", "64x16384"])
    assert args.trace_skip == [(32, 32768), (64, 16384)]
    cmd = _child_command(monkeypatch, args, "plugin")
    i = cmd.index("--trace-skip")
    assert cmd[i + 1:i + 3] == ["32x32768", "64x16384"] and "--trace-only" in cmd
    child = e2e.build_parser().parse_args(cmd[2:])
    assert child.trace_skip == args.trace_skip


@pytest.mark.parametrize("seed", range(3))
def test_merge_rebuilds_the_windows_of_a_process_stopped_before_its_run_file(tmp_path, seed):
    """--merge with one mode's run file missing but its per-case trace files
    and log present: that mode's windows are rebuilt from the traces (each
    summary as summarize_trace gives it, batch and prompt from the file name,
    vLLM version and graph mode from the log); the merge says the run is
    incomplete (non-zero exit); a trace of another k or mode is not taken."""
    rng = random.Random(seed)
    out = tmp_path / "out"
    out.mkdir()
    cases = rng.sample([(b, x) for b in (1, 8, 32, 64) for x in (4096, 16384, 32768)], 3)
    for b, x in cases + [(2, 4096)]:
        k = 3 if (b, x) != (2, 4096) else 2
        events = [{"cat": "kernel", "name": rng.choice(["varlen_logits_sm90", "gemm_x", "topk_y"]),
                   "ts": j, "dur": rng.uniform(1, 50)} for j in range(40)]
        with gzip.open(out / f"trace-plugin-k{k}-b{b}-{x // 1024}k.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)
    (out / "log-plugin-k3.txt").write_text(
        "INFO Initializing a V1 LLM engine (v0.27.1) with config: ... "
        "'cudagraph_mode': <CUDAGraphMode.FULL_DECODE_ONLY: (2, 0)>, ...\n")
    stock = {"mode": "stock", "k": 3, "cases": [], "init_s": 1.0, "jit": {}, "vllm": "0.27.1",
             "traces": [{"batch": 1, "prompt": 4096, "indexer_share": 0.1}]}
    (out / "run-stock-k3.json").write_text(json.dumps(stock))
    rc = e2e.main(["--out", str(out), "--merge", "--k", "3", "--trace-steps", "3"])
    assert rc != 0
    got = json.loads((out / "e2e.json").read_text())
    entry = got["per_k"]["3"]
    windows = entry["traces"]["plugin"]
    assert sorted((w["batch"], w["prompt"]) for w in windows) == sorted(cases)
    for w in windows:
        want = e2e_trace.summarize_trace(str(out / w["file"]), 3)
        assert {k: w[k] for k in want} == json.loads(json.dumps(want))
    assert entry["vllm"]["plugin"] == "0.27.1"
    assert entry["cudagraph_mode"]["plugin"] == "FULL_DECODE_ONLY"
    assert entry["traces"].get("stock") is None or entry["traces"]["stock"] == stock["traces"]


@pytest.mark.parametrize("skip", [False, True])
def test_no_mixed_window_leaves_the_window_out_and_keeps_the_identity_run(tmp_path, skip):
    """``--no-mixed-window``: no mixed-window request reaches the engine and the
    result has no window; the identity run still runs (the tokens' evidence)."""
    pytest.importorskip("vllm")
    rng = random.Random()
    batch, new = rng.choice([2, 4, 8]), rng.randrange(3, 9)
    argv = ["--out", str(tmp_path), "--batch", str(batch), "--prompt", "1024",
            "--new-tokens", str(new), "--trace-steps", "0"]
    args = e2e.build_parser().parse_args(argv + (["--no-mixed-window"] if skip else []))
    engine = FakeEngine(1 << 20)

    def prompts_of(length, first=0, count=batch):
        return [e2e.prompt_ids(i, length, 4096) for i in range(first, first + count)]

    result = {}
    e2e._after_cases(args, "plugin", engine, result, prompts_of, None)
    mixed = [rid for rid, _ in engine.added if rid.startswith("mixed-")]
    assert ("mixed_window" in result) is (not skip)
    assert (not mixed) is skip
    if not skip:
        assert len(mixed) == 2 * max(1, batch // 2)
    assert len(result["identity"]["tokens"]) == batch
    assert all(len(t) == new for t in result["identity"]["tokens"])


def test_a_rule_parses_to_the_policys_fields_and_bad_ones_are_refused():
    """--rule STOCK:field=value,...: a Rule's keyword arguments (ints, a float,
    uniform 0/1, a kernel name), noted with its text; unknown stock kinds,
    fields, bad values and the reserved fields refused, naming the item."""
    from vllm_dsa_varlen import policy

    got = e2e.parse_rule("native:min_run=4,max_run_le=4,min_rows=256,uniform=1,"
                         "kernel=cuda_sm90,min_tokens_per_request=2.5")
    assert got == {"stock": "native", "min_run": 4, "max_run_le": 4, "min_rows": 256,
                   "uniform": True, "kernel": "cuda_sm90", "min_tokens_per_request": 2.5,
                   "note": "native:min_run=4,max_run_le=4,min_rows=256,uniform=1,"
                           "kernel=cuda_sm90,min_tokens_per_request=2.5"}
    assert policy.Rule(**got).matches(policy.StepFacts(rows=256, requests=64, max_run=4,
                                                       uniform=True), "cuda_sm90")
    assert e2e.parse_rule("split") == {"stock": "split", "note": "split"}
    for bad, named in [("padded:min_run=1", "STOCK"), ("native:min_rows=x", "min_rows"),
                       ("native:uniform=yes", "uniform"), ("native:rows=3", "rows=3"),
                       ("native:note=x", "note=x"), ("native:min_run", "min_run")]:
        with pytest.raises(argparse.ArgumentTypeError, match=named):
            e2e.parse_rule(bad)


def test_rules_reach_the_child_and_extend_its_table(tmp_path, monkeypatch):
    """--rule (repeatable) reaches the child's command as given, and the child
    appends each to the plugin's table before an engine starts (the table the
    builders read at call time), keeping the rest."""
    from vllm_dsa_varlen import policy

    texts = ["native:min_run=4,max_run_le=4,min_rows=256,uniform=1,kernel=cuda_sm90",
             "flattened:min_run=3,max_run_le=3,min_rows=8"]
    argv = ["--out", str(tmp_path), "--model", "m"] + [a for t in texts for a in ("--rule", t)]
    args = e2e.build_parser().parse_args(argv)
    cmd = _child_command(monkeypatch, args, "plugin")
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--rule"] == texts
    assert cmd[1].endswith("e2e_decode.py")
    child_args = e2e.build_parser().parse_args(cmd[2:])
    assert child_args.child and [r["note"] for r in child_args.rule] == texts
    monkeypatch.setattr(policy, "MEASURED", policy.MEASURED)  # restored after the test
    before = policy.MEASURED
    table = e2e.add_rules(child_args.rule)
    assert policy.MEASURED is table and table[:len(before)] == before
    assert [(r.stock, r.min_run, r.min_rows, r.uniform, r.kernel) for r in table[len(before):]] == [
        ("native", 4, 256, True, "cuda_sm90"), ("flattened", 3, 8, None, None)]
    assert e2e.add_rules([]) is table


def test_a_child_stopped_by_sigterm_still_writes_what_it_measured(tmp_path, monkeypatch):
    """`timeout` ends a run with SIGTERM, often in the profiled window after the
    cases: the run file keeps the cases and says why it stopped."""
    import signal

    args = e2e.build_parser().parse_args(["--out", str(tmp_path), "--modes", "plugin", "--k", "3"])
    args.mode, args.repeat, args.rule, args.k = "plugin", 0, [], 3
    previous = signal.getsignal(signal.SIGTERM)

    def measured_then_stopped(args, results):
        results["plugin"]["cases"] = [{"batch": 64, "tpot_ms": 22.5}]
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal did not stop the child")

    monkeypatch.setattr(e2e, "_child", measured_then_stopped)
    try:
        with pytest.raises(SystemExit, match="signal"):
            e2e.child(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    with open(tmp_path / "run-plugin-k3.json") as f:
        run = json.load(f)
    assert run["cases"] == [{"batch": 64, "tpot_ms": 22.5}]
    assert "stopped by signal" in run["error"]


def test_same_process_engines_keep_vllms_query_kernels_unless_told():
    """Both engines of one process share the query wrappers' one decision:
    unset, it is made ``off`` (stock's engine stays stock's); set, it is kept
    and the line says it holds for both."""
    env = {}
    line = e2e.same_process_query_prep(env)
    assert env == {"DSA_VARLEN_FUSED_Q": "off"} and "=off for both engines" in line
    for value in ("on", "auto", "off"):
        env = {"DSA_VARLEN_FUSED_Q": value}
        line = e2e.same_process_query_prep(env)
        assert env == {"DSA_VARLEN_FUSED_Q": value}
        assert f"={value} as set, for both engines" in line


@pytest.mark.parametrize("seed", range(3))
def test_stock_alone_repeated_is_an_aa_pair(tmp_path, seed, capsys):
    """``--modes stock --repeats N``: the table compares stock's processes
    pairwise (repeat 0 against 1, 2 against 3), the second in the plugin's
    columns; one stock process alone compares nothing."""
    rng = random.Random(seed)
    tpots = [rng.uniform(5, 15) for _ in range(4)]
    for rep, t in enumerate(tpots):
        run = run_file([[rng.randrange(100) for _ in range(4)]] * 2)
        run["cases"][0]["tpot_ms"] = t
        run.update(init_s=1.0, jit={})
        name = f"run-stock-k3{'' if rep == 0 else f'-r{rep}'}.json"
        (tmp_path / name).write_text(json.dumps(run))
    assert e2e.main(["--out", str(tmp_path), "--k", "3", "--modes", "stock", "--repeats", "4",
                     "--merge"]) == 0
    out = capsys.readouterr().out
    entry = json.loads((tmp_path / "e2e.json").read_text())["per_k"]["3"]
    assert entry["second"] == e2e.STOCK_AGAIN
    row = entry["comparison"]["rows"][0]
    assert row["speedup"] == pytest.approx(tpots[0] / tpots[1])
    rep = entry["repeats"][0]
    assert rep["tpot_ms"] == [list(p) for p in zip(tpots[::2], tpots[1::2])] or \
        rep["tpot_ms"] == list(zip(tpots[::2], tpots[1::2]))
    assert rep["gain_median"] == pytest.approx((tpots[0] / tpots[1] + tpots[2] / tpots[3]) / 2)
    assert f"{e2e.STOCK_AGAIN} tok/s" in out
    one = e2e.k_entry({"stock": json.loads((tmp_path / "run-stock-k3.json").read_text())},
                      [{"stock": json.loads((tmp_path / "run-stock-k3.json").read_text())}])
    assert "comparison" not in one


@pytest.mark.parametrize("short", [True, False])
def test_a_kv_cache_far_too_small_skips_the_processes_left_for_that_k(tmp_path, monkeypatch,
                                                                      capsys, short):
    """A child refused because its smallest case needs over 1.1x its KV cache
    stops the parent from starting that k's other processes (recorded as
    skipped, the run's exit non-zero); a near miss does not (another mode's
    engine might get those tokens), nor does it touch the next k."""
    child = e2e.build_parser().parse_args(["--out", str(tmp_path), "--k", "3", "--batch", "64",
                                            "--prompt", "32768"])
    child.k = 3  # one k, as main() gives a child
    need = e2e.case_tokens(64, 32768, child.new_tokens, 3)
    cap = int(need / (random.uniform(1.2, 3.0) if short else random.uniform(1.0, 1.09)))
    word = f"[stock k=3] {e2e.nothing_fits(child, cap)}"  # the child's own refusal
    assert str(need) in word
    started = []

    def fake_run(cmd, env, stdout, stderr):
        mode, k = cmd[cmd.index("--mode") + 1], int(cmd[cmd.index("--k") + 1])
        rep = int(cmd[cmd.index("--repeat") + 1])
        started.append((mode, k, rep))
        name = f"run-{mode}-k{k}{'' if rep == 0 else f'-r{rep}'}.json"
        (tmp_path / name).write_text(json.dumps(
            {"error": f"Traceback (most recent call last):\nSystemExit: {word}\n"}
            if k == 3 else dict(run_file([[1, 2]]), init_s=1.0, jit={})))
        return type("Done", (), {"returncode": 1 if k == 3 else 0})()

    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    rc = e2e.main(["--out", str(tmp_path), "--k", "3", "1", "--repeats", "2",
                   "--model", str(tmp_path)])
    assert rc == 1
    k3 = [s for s in started if s[1] == 3]
    assert len(k3) == (1 if short else 4)
    assert len([s for s in started if s[1] == 1]) == 4
    runs = json.loads((tmp_path / "e2e.json").read_text())["runs"]
    skipped = [r for r in runs if r["rc"] == "skipped"]
    assert len(skipped) == (3 if short else 0)
    assert all(str(need) in r["skipped"] for r in skipped)
