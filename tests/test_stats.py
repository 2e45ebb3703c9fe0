"""The decode-path counters: what is recorded is what is read back."""

import json
import os
import random
import subprocess
import sys

import pytest

from vllm_dsa_varlen import stats


def test_counts_follow_the_records():
    stats.reset()
    rng = random.Random(7)
    want = {k: dict.fromkeys(stats.PATHS, 0) for k in ("steps", "variable", "mixed")}
    want["topk"] = dict.fromkeys(stats.TOPK, 0)
    for _ in range(200):
        path = rng.choice(stats.PATHS)
        variable, mixed = rng.random() < 0.3, rng.random() < 0.2
        stats.record(path, variable=variable, mixed=mixed)
        want["steps"][path] += 1
        want["variable"][path] += variable
        want["mixed"][path] += mixed
        own, captured = rng.random() < 0.5, rng.random() < 0.5
        stats.record_topk(own, captured)
        want["topk"][("own_" if own else "vllm_") + ("captured" if captured else "eager")] += 1
    assert stats.snapshot() == want
    stats.reset()
    assert all(v == 0 for kind in stats.snapshot().values() for v in kind.values())


def test_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path"):
        stats.record("varlen_fast", variable=False, mixed=False)


class _Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _lines(records) -> list[dict]:
    got = [stats.parse_line(r.getMessage()) for r in records]
    return [g for g in got if g is not None]


@pytest.fixture
def fresh_log(monkeypatch):
    """Counts and the log's state as in a process that recorded nothing yet;
    no exit hook registered by the test process."""
    stats.reset()
    for name, value in (("_version", 0), ("_logged_version", 0), ("_logged_at", float("-inf")),
                        ("_last_step_at", None), ("_exit_pid", os.getpid()),
                        ("_final_written_pid", None)):
        monkeypatch.setattr(stats, name, value)
    clock = _Clock(1.7e9 + random.random())
    monkeypatch.setattr(stats, "_clock", clock)
    yield clock
    stats.reset()


def test_the_log_line_comes_at_most_every_interval_and_holds_the_counts_before_its_step(
        fresh_log, plugin_log):
    """Steps at random times: a line is written at a step iff the counts
    changed since the last line and at least LOG_EVERY_S passed; it holds
    exactly the steps recorded before that step, with the time of the last."""
    rng = random.Random(11)
    clock = fresh_log
    want = {k: dict.fromkeys(stats.PATHS, 0) for k in ("steps", "variable", "mixed")}
    expected, last_line_at, last_step_at, changed = [], float("-inf"), None, False
    for _ in range(300):
        clock.t += rng.choice([0.01, 0.5, 3.0, stats.LOG_EVERY_S + rng.random()])
        if changed and clock.t - last_line_at >= stats.LOG_EVERY_S:
            expected.append({"t": clock.t, "as_of": last_step_at,
                             "steps": dict(want["steps"]), "variable": dict(want["variable"]),
                             "mixed": dict(want["mixed"])})
            last_line_at, changed = clock.t, False
        path = rng.choice(stats.PATHS)
        variable, mixed = rng.random() < 0.4, rng.random() < 0.3
        stats.record(path, variable=variable, mixed=mixed)
        want["steps"][path] += 1
        want["variable"][path] += variable
        want["mixed"][path] += mixed
        last_step_at, changed = clock.t, True
    got = _lines(plugin_log)
    assert len(got) == len(expected) > 10
    for line, exp in zip(got, expected):
        assert line["pid"] == os.getpid() and line["final"] is False
        assert {k: line[k] for k in exp} == exp


def test_an_idle_spell_makes_the_next_line_the_exact_boundary(fresh_log, plugin_log):
    """After LOG_EVERY_S without steps, the first step of the next burst
    writes a line with the first burst's counts, stamped with its last step."""
    clock = fresh_log
    n = random.randint(5, 50)
    for _ in range(n):
        clock.t += 0.02
        stats.record("varlen", variable=True, mixed=False)
    end_of_burst = clock.t
    before = len(_lines(plugin_log))
    clock.t += stats.LOG_EVERY_S + 0.5
    stats.record("stock_native", variable=False, mixed=False)
    line = _lines(plugin_log)[before:]
    assert len(line) == 1
    assert line[0]["as_of"] == end_of_burst < line[0]["t"] == clock.t
    assert line[0]["steps"]["varlen"] == line[0]["variable"]["varlen"] == n
    assert line[0]["steps"]["stock_native"] == 0


def test_the_exit_line_has_every_count_once(fresh_log, plugin_log):
    for _ in range(7):
        stats.record("split_avoided", variable=True, mixed=True)
    stats.record_topk(True, False)
    stats._write_final_line()
    stats._write_final_line()  # atexit and multiprocessing's finalizer both call it
    final = [g for g in _lines(plugin_log) if g["final"]]
    assert len(final) == 1
    assert final[0]["steps"]["split_avoided"] == final[0]["mixed"]["split_avoided"] == 7
    assert final[0]["topk"]["own_eager"] == 1


def test_no_exit_line_from_a_process_that_recorded_nothing(fresh_log, plugin_log, monkeypatch):
    monkeypatch.setattr(stats, "_exit_pid", None)
    stats._write_final_line()
    assert _lines(plugin_log) == []


_CHILD = """
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="(X pid=%(process)d) %(message)s")
from vllm_dsa_varlen import stats
def work(n):
    for i in range(n):
        stats.record("varlen" if i % 3 else "stock_flattened", variable=i % 2 == 0, mixed=False)
if sys.argv[1] == "fork":
    import multiprocessing as mp
    p = mp.get_context("fork").Process(target=work, args=(int(sys.argv[2]),))
    p.start(); p.join(); sys.exit(p.exitcode)
work(int(sys.argv[2]))
"""


@pytest.mark.parametrize("how", ["plain", "fork"])
def test_a_process_writes_its_final_line_when_it_exits(how, tmp_path):
    """A process that recorded steps writes the final line at exit, also a
    forked multiprocessing child (which leaves through os._exit)."""
    n = random.randint(3, 40)
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(script), how, str(n)], capture_output=True,
                          text=True, timeout=120, cwd=root,
                          env=dict(os.environ, PYTHONPATH=root))
    assert done.returncode == 0, done.stderr
    lines = [stats.parse_line(x) for x in done.stdout.splitlines()]
    final = [x for x in lines if x and x["final"]]
    assert len(final) == 1
    assert sum(final[0]["steps"].values()) == n
    assert final[0]["steps"]["stock_flattened"] == len(range(0, n, 3))
    assert final[0]["variable"]["varlen"] + final[0]["variable"]["stock_flattened"] == len(
        range(0, n, 2))


def test_parse_line_reads_only_the_counts_line():
    line = stats.LINE + json.dumps({"pid": 3, "t": 2.0, "as_of": 1.0, "final": False,
                                    "steps": {"varlen": 4}})
    assert stats.parse_line("(EngineCore_DP0 pid=3) INFO 01-01 00:00:00 [stats.py:9] " + line)[
        "steps"] == {"varlen": 4}
    assert stats.parse_line("vllm-dsa-varlen: DSA indexer decode path: varlen") is None
    assert stats.parse_line(stats.LINE + "{not json") is None
