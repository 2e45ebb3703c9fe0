"""benchmarks/serve_diag.py: sync sites from a log, a process's stand towards
SIGTERM, py-spy stacks per thread, a profiled window's summary."""

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))
import serve_diag  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _warning(path: str, line: int) -> str:
    return warnings.formatwarning("called a synchronizing CUDA operation (Triggered internally "
                                  "at /pytorch/c10/cuda/CUDAFunctions.cpp:178.)",
                                  UserWarning, path, line)


def test_sync_sites_are_read_as_pythons_warnings_module_prints_them():
    rng = random.Random()
    site = "/opt/venv/lib/python3.12/site-packages/"
    ours = (site + "vllm_dsa_varlen/vllm_0_27/v1/attention/backends/mla/indexer.py",
            rng.randint(1, 900))
    theirs = (site + "vllm/v1/worker/gpu_model_runner.py", rng.randint(1, 9000))
    n = rng.randint(1, 4)
    text = "".join(["(EngineCore pid=41) INFO 12-06 [core.py:1] started\n",
                    *(f"(EngineCore pid=41) {_warning(*ours)}" for _ in range(n)),
                    # warnings captured into logging: the record's own file:line first
                    f"(EngineCore_DP0 pid=42) WARNING 12-06 17:00:00 [warnings.py:110] "
                    f"{_warning(*theirs)}",
                    "(APIServer pid=40) WARNING something else entirely\n"])
    got = serve_diag.sync_sites(text)
    assert got == [
        {"process": "EngineCore", "file": ours[0].split("site-packages/")[1], "line": ours[1],
         "reports": n, "plugin": True},
        {"process": "EngineCore_DP0", "file": "vllm/v1/worker/gpu_model_runner.py",
         "line": theirs[1], "reports": 1, "plugin": False}]
    assert serve_diag.sync_sites("no warnings here\n") == []


def _child(code: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code + "\nprint('ready', flush=True)\n"
                          "import time\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_a_process_that_blocks_sigterm_shows_it_pending_and_one_that_handles_it_does_not():
    blocked = _child("import signal, threading\n"
                     "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
                     "threading.Thread(target=lambda: __import__('time').sleep(60), "
                     "daemon=True).start()")
    handled = _child("import signal\nsignal.signal(signal.SIGTERM, lambda *a: None)")
    try:
        os.kill(blocked.pid, signal.SIGTERM)
        os.kill(handled.pid, signal.SIGTERM)
        time.sleep(0.3)
        b = serve_diag.signal_state(blocked.pid)
        h = serve_diag.signal_state(handled.pid)
        assert b["main_blocks"] and b["threads"] == 2, b
        # the helper thread inherited the mask: no thread takes it, so it stays pending
        assert b["pending_process"] and b["threads_not_blocking"] == [], b
        assert not b["handled"] and not b["ignored"]
        assert not h["main_blocks"] and h["handled"] and not h["pending_process"], h
        assert h["threads"] == 1 and len(h["threads_not_blocking"]) == 1
    finally:
        for p in (blocked, handled):
            p.kill()
            p.wait()
    assert serve_diag.signal_state(blocked.pid) is None  # gone


def _raw(stacks):
    return "".join(";".join(frames) + f" {n}\n" for frames, n in stacks)


def test_collapsed_stacks_are_summed_per_thread_inclusive_and_self():
    rng = random.Random()
    busy, ours, waiting, other = (rng.randint(1, 200) for _ in range(4))
    main = "thread (4101): MainThread"
    loop = ["<module> (<string>:1)", "run_busy_loop (/x/site-packages/vllm/v1/engine/core.py:9)"]
    text = _raw([
        ([main, *loop, "step (/x/site-packages/vllm/v1/engine/core.py:40)"], busy),
        ([main, *loop, "step (/x/site-packages/vllm/v1/engine/core.py:41)",
          "build (/x/site-packages/vllm_dsa_varlen/plan.py:3)"], ours),
        ([main, *loop, "get (/usr/lib/python3.12/queue.py:171)",
          "wait (/usr/lib/python3.12/threading.py:355)"], waiting),
        (["thread (4102): Thread-1 (run)", "run (/usr/lib/python3.12/threading.py:1010)",
          "wait (/usr/lib/python3.12/threading.py:355)"], other)])
    got = serve_diag.collapsed_summary(text + "garbage line without a count\n")
    assert got["engine_thread"] == main
    m = got["threads"][main]
    total = busy + ours + waiting
    assert m["samples"] == total
    assert m["plugin_share"] == round(ours / total, 4)
    assert m["idle_share"] == round(waiting / total, 4)
    inclusive = dict(map(tuple, m["inclusive"]))
    assert inclusive["run_busy_loop (vllm/v1/engine/core.py)"] == 1.0
    assert inclusive["step (vllm/v1/engine/core.py)"] == round((busy + ours) / total, 4)
    self_ = dict(map(tuple, m["self"]))
    assert self_["build (vllm_dsa_varlen/plan.py)"] == round(ours / total, 4)
    assert got["threads"]["thread (4102): Thread-1 (run)"]["idle_share"] == 1.0


def test_the_sampler_interrupts_py_spy_and_reads_its_file(tmp_path):
    fake = [sys.executable, os.path.join(HERE, "fake_py_spy.py")]
    exe = tmp_path / "py-spy"
    exe.write_text("#!/bin/sh\nexec " + " ".join(fake) + ' "$@"\n')
    exe.chmod(0o755)
    sampler = serve_diag.StackSampler(str(exe), str(tmp_path), rate=50)
    sampler.start([4242], "plugin-L40-c2")
    time.sleep(0.5)
    got = sampler.finish()
    one = got["4242"]
    assert one["file"] == "pyspy-plugin-L40-c2-4242.txt" and one["rc"] == 0
    main = one["engine_thread"]
    assert main.startswith("thread (10260)")
    assert one["threads"][main]["plugin_share"] == 0.2
    assert one["threads"][main]["idle_share"] == 0.1
    bad = serve_diag.StackSampler(str(tmp_path / "missing"), str(tmp_path))
    with pytest.raises(OSError):
        bad.start([1], "x")


def test_a_profiled_window_is_summarised_per_step():
    rng = random.Random()
    steps = rng.randint(2, 9)
    syncs_per_step = rng.randint(0, 3)
    events = []
    for i in range(steps):
        t = 10_000.0 * i
        events.append({"ph": "X", "cat": "user_annotation", "name":
                       f"execute_context_{i % 2}({i})_generation_8(32)", "ts": t, "dur": 900.0,
                       "tid": 1})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::_local_scalar_dense",
                       "ts": t + 100, "dur": 400.0, "tid": 1})
        for j in range(syncs_per_step):
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize",
                           "ts": t + 150 + j, "dur": 50.0, "tid": 1})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                       "ts": t + 600, "dur": 5.0, "tid": 1})
        events.append({"cat": "kernel", "name": "varlen_logits_sm90", "ts": t + 1000,
                       "dur": 300.0})
        events.append({"cat": "kernel", "name": "gemm", "ts": t + 1400, "dur": 600.0})
    got = serve_diag.summarize_profile(events)
    assert got["steps"] == steps
    assert got["step_kinds"] == {"execute_context_0_generation_8": (steps + 1) // 2,
                                 **({"execute_context_1_generation_8": steps // 2}
                                    if steps > 1 else {})}
    assert got["gpu_us_per_step"] == pytest.approx(900.0)
    assert got["by_class_us_per_step"]["logits_varlen"] == pytest.approx(300.0)
    if syncs_per_step:
        assert got["syncs_per_step"] == {"cudaStreamSynchronize": {
            "calls": float(syncs_per_step), "us": 50.0 * syncs_per_step}}
        assert got["syncs_under"] == {"aten::_local_scalar_dense": steps * syncs_per_step}
    else:
        assert got["syncs_per_step"] == {} and got["syncs_under"] == {}
    assert got["host_ops_us_per_step"] == {"aten::_local_scalar_dense": 400.0}


def test_the_newest_trace_is_taken_once_written(tmp_path):
    assert serve_diag.wait_for_trace(str(tmp_path), timeout=0.3, settle=0.1) is None
    sub = tmp_path / "worker"
    sub.mkdir()
    old = sub / "a.pt.trace.json.gz"
    with gzip.open(old, "wt") as f:
        json.dump({"traceEvents": []}, f)
    os.utime(old, (time.time() - 100, time.time() - 100))
    new = sub / "b.pt.trace.json.gz"
    with gzip.open(new, "wt") as f:
        json.dump({"traceEvents": [{"cat": "kernel", "name": "k", "dur": 1.0}]}, f)
    assert serve_diag.wait_for_trace(str(tmp_path), timeout=5, settle=0.1) == str(new)
    assert serve_diag.read_trace(str(new)) == [{"cat": "kernel", "name": "k", "dur": 1.0}]


def test_the_profiler_config_is_one_vllms_profiler_takes(tmp_path):
    pytest.importorskip("vllm")
    from vllm.config import ProfilerConfig

    steps, delay = random.randint(1, 99), random.randint(0, 50)
    cfg = ProfilerConfig(**serve_diag.profiler_config(str(tmp_path / "t"), steps, delay))
    assert cfg.profiler == "torch" and os.path.isabs(cfg.torch_profiler_dir)
    assert (cfg.max_iterations, cfg.delay_iterations) == (steps, delay)
    assert not cfg.torch_profiler_with_stack and cfg.ignore_frontend


def test_the_summary_says_what_failed_and_puts_the_plugins_sync_sites_first():
    n = random.randint(6, 9)
    theirs = [{"process": "EngineCore", "file": f"vllm/x{i}.py", "line": i, "reports": 1,
               "plugin": False} for i in range(n)]
    ours = {"process": "EngineCore", "file": "vllm_dsa_varlen/plan.py", "line": 3, "reports": 1,
            "plugin": True}
    result = {"servers": {"plugin": {"sync_sites": theirs + [ours],
                                     "profile": {"skipped": "time limit"}}},
              "points": [{"id": "L4096-c32", "runs": {"plugin": {"stacks": {
                  "77": {"rc": 1, "error": "Permission Denied: try running as root"}}}}}]}
    got = serve_diag.summary_lines(result)
    assert got[0].startswith("[plugin] sync sites: vllm_dsa_varlen/plan.py:3; vllm/x0.py:0")
    assert got[0].endswith(f"(+{n + 1 - 5})")
    assert got[1] == "[plugin] py-spy on 77: Permission Denied: try running as root"
    assert got[2] == "[plugin] profile: time limit"
    assert serve_diag.summary_lines({"servers": {"stock": {}}, "points": []}) == []
