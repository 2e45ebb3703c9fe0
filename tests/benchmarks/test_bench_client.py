"""benchmarks/bench_client.py through serve.py's BenchClient, with a stand-in
for vLLM's command line (a ``vllm.entrypoints.cli.main`` module whose
``main()`` reads ``sys.argv``)."""

import importlib.util
import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))

import serve  # noqa: E402

STAND_IN = '''
import os, sys, time
with open(os.environ["IMPORTS_FILE"], "a") as f:
    f.write("imported\\n")
{extra}

def main():
    what = sys.argv[3]
    print("out-" + what, flush=True)
    os.write(2, ("err-" + what + "\\n").encode())  # the descriptor itself, as C code writes
    if what.startswith("exit"):
        sys.exit(int(what[4:]))
    if what == "raise":
        raise RuntimeError("boom-" + what)
    if what == "sleep":
        time.sleep(30)
    return None
'''


@pytest.fixture
def client(tmp_path, monkeypatch):
    def make(extra=""):
        pkg = tmp_path / "site" / "vllm" / "entrypoints" / "cli"
        pkg.mkdir(parents=True, exist_ok=True)
        for d in (pkg, pkg.parent, pkg.parent.parent):
            (d / "__init__.py").write_text("")
        (pkg / "main.py").write_text(STAND_IN.format(extra=extra))
        monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
        monkeypatch.setenv("IMPORTS_FILE", str(tmp_path / "imports.txt"))
        made = serve.BenchClient(sys.executable, str(tmp_path / "worker.log"))
        made.start()
        return made

    made = []
    yield lambda extra="": made.append(make(extra)) or made[-1]
    for c in made:
        c.stop()


def _cmd(what):
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", what]


def test_runs_share_one_import_and_keep_their_own_output(client, tmp_path):
    c = client()
    words = [f"w{random.randrange(10 ** 6)}" for _ in range(3)]
    for w in words:
        log = tmp_path / f"{w}.log"
        assert c.run(_cmd(w), str(log), 30) == 0
        text = log.read_text()
        assert f"out-{w}" in text and f"err-{w}" in text
        assert not any(f"-{o}" in text for o in words if o != w)
    assert (tmp_path / "imports.txt").read_text().count("imported") == 1


def test_exit_codes_and_exceptions_are_the_runs_and_the_worker_goes_on(client, tmp_path):
    c = client()
    code = random.randint(2, 9)
    assert c.run(_cmd(f"exit{code}"), str(tmp_path / "a.log"), 30) == code
    assert c.run(_cmd("raise"), str(tmp_path / "b.log"), 30) == 1
    assert "RuntimeError: boom-raise" in (tmp_path / "b.log").read_text()
    assert c.run(_cmd("fine"), str(tmp_path / "c.log"), 30) == 0
    assert (tmp_path / "imports.txt").read_text().count("imported") == 1


def test_a_run_past_its_time_kills_the_worker_and_the_next_starts_another(client, tmp_path):
    c = client()
    assert c.run(_cmd("fine"), str(tmp_path / "a.log"), 30) == 0
    assert c.run(_cmd("sleep"), str(tmp_path / "b.log"), 1.5) == "timeout"
    assert c.proc is None
    assert c.run(_cmd("again"), str(tmp_path / "c.log"), 30) == 0
    assert "out-again" in (tmp_path / "c.log").read_text()
    assert (tmp_path / "imports.txt").read_text().count("imported") == 2


def test_a_worker_that_cannot_import_vllm_says_why(client, tmp_path):
    c = client(extra="raise ImportError('no vllm here')")
    got = c.run(_cmd("fine"), str(tmp_path / "a.log"), 30)
    assert isinstance(got, str) and "no vllm here" in got
    assert "no vllm here" in (tmp_path / "a.log").read_text()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_vllms_own_command_line_runs_twice_in_one_worker(tmp_path):
    """The installed vLLM's CLI entry point, called in-process as the worker
    does, parses ``bench serve`` twice (``--help``: no server needed)."""
    c = serve.BenchClient(sys.executable, str(tmp_path / "worker.log"))
    try:
        for i in range(2):
            log = tmp_path / f"help{i}.log"
            assert c.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
                          "--help=max-concurrency"], str(log), 300) == 0
            assert "max-concurrency" in log.read_text().split("Disabling Triton")[-1]
    finally:
        c.stop()
