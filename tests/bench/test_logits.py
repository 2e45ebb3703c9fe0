"""The benchmark (`vllm_dsa_varlen/bench/logits.py`): its CPU mode (the README's main job on a
machine without a GPU), its JSON, and the profiler option."""

import json
import os
import subprocess
import sys
import tomllib

import pytest

from vllm_dsa_varlen.bench import logits as bench


@pytest.mark.interpreter
def test_cpu_run_writes_json_and_trace(tmp_path, capsys):
    out, trace = tmp_path / "bench.json", tmp_path / "trace.json"
    assert bench.main(["--cpu", "--json", str(out), "--trace", str(trace)]) == 0
    printed = capsys.readouterr().out
    assert "no CUDA GPU" in printed  # says plainly what it ran
    data = json.loads(out.read_text())
    paths = {r["path"] for r in data["results"]}
    assert paths == {"reference (cpu)", "triton-varlen (interpreter)"}
    for row in data["results"]:
        assert float(row["note"].split("=")[1]) < 1e-5  # the kernel matched the reference
        assert row["useful_rows"] > 0 and row["plan_host_us"] > 0
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert any(n and "triton-varlen" in n for n in names)


def test_the_command_and_python_m_reach_main(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        script = tomllib.load(f)["project"]["scripts"][bench.PROG]
    assert script == f"{bench.__name__}:main"
    out = subprocess.run([sys.executable, "-m", "vllm_dsa_varlen.bench", "--help"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {bench.PROG} ") and "--plan-timing" in out.stdout


def test_variant_spec_parsing():
    assert bench.triton_variants(None) == [{}]
    assert bench.triton_variants("rows_per_dot=2,num_warps=4;groups=1") == [
        {"rows_per_dot": 2, "num_warps": 4}, {"groups": 1}]
    for bad in ("pages_per_split=8", "num_warps", "num_warps=4.5", "rows_per_dot=2;x=1"):
        with pytest.raises(ValueError, match="--variants"):
            bench.triton_variants(bad)


@pytest.mark.interpreter
def test_custom_cases_from_the_command_line(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--cpu", "--json", str(out), "--batch", "2", "3", "--context", "150",
                       "--tokens", "3", "--acceptance", "0.5"]) == 0
    data = json.loads(out.read_text())
    cases = sorted({r["case"] for r in data["results"]})
    assert cases == ["B2 L150 3tok acc0.5", "B3 L150 3tok acc0.5"]
    for row in data["results"]:
        assert float(row["note"].split("=")[1]) < 1e-5
        assert row["useful_rows"] <= 3 * int(row["case"].split()[0][1:])  # at most B x tokens


@pytest.mark.interpreter
def test_cpu_json_is_strict(tmp_path):
    """No bare NaN in bench.json (jq and JSON.parse reject it): the CPU run's
    unknown floors are written as null."""
    out = tmp_path / "bench.json"
    assert bench.main(["--cpu", "--json", str(out)]) == 0
    text = out.read_text()

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    data = json.loads(text, parse_constant=refuse)
    assert data["results"]
    assert all(r["floor_us"] is None and r["mem_floor_us"] is None for r in data["results"])


def test_strict_json_replaces_every_non_finite_float():
    value = {"a": float("nan"), "b": [1.0, float("inf"), {"c": float("-inf")}], "d": 2}
    assert bench.strict_json(value) == {"a": None, "b": [1.0, None, {"c": None}], "d": 2}


@pytest.mark.parametrize("flags", [["--profile"], ["--peer", "sm90"], ["--no-sm90"],
                                   ["--variants", "num_warps=8"], ["--profile", "--peer", "vdg"]])
def test_gpu_only_options_are_refused_on_the_cpu(flags, capsys, monkeypatch):
    """``--profile`` brackets kernel calls for Nsight Compute, ``--peer`` /
    ``--no-sm90`` / ``--variants`` pick GPU paths: on the CPU each is refused
    by name before anything runs."""
    monkeypatch.setattr(bench, "run_cpu", _never)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--cpu", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(f in err for f in flags if f.startswith("--")) and "needs a CUDA GPU" in err


def _never(*_args, **_kw):
    raise AssertionError("the run started")


# Each bad value, and the flag its error must name (argparse's exit status 2,
# before any run).
BAD_INPUT = [
    (["--batch", "0"], "--batch"), (["--batch", "x"], "--batch"),
    (["--context", "-5"], "--context"), (["--tokens", "0"], "--tokens"),
    (["--rep-ms", "0"], "--rep-ms"), (["--seed", "-1"], "--seed"),
    (["--tokens", "2", "--acceptance", "1.5"], "--acceptance"),
    (["--tokens", "2", "--acceptance", "x"], "--acceptance"),
    (["--tokens", "2", "--compress-ratio", "0"], "--compress-ratio"),
    (["--heads", "48"], "--heads"), (["--builds", "default", "--rounds", "0"], "--rounds"),
    (["--builds", "default", "--topk-lib", "x.so", "--layers", "0"], "--layers"),
    (["--launch-host", "--calls", "0"], "--calls"),
    (["--builds", "default", "--topk-lib", "x.so", "--topk-width", "0"], "--topk-width"),
    (["--builds", "default", "--topk-lib", "x.so", "--topk-cooperative-rows", "-1"],
     "--topk-cooperative-rows"),
    (["--variants", "pages_per_split=8"], "--variants"),
    (["--variants", "num_warps=x"], "--variants"),
    (["--plan-timing", "--cases", "1,2"], "--cases"),
    (["--builds", "default", "--cases", "64,0,8192"], "--cases"),
    (["--builds", "STAGES=4"], "--builds"),
    (["--builds", "default", "--topk-lib", "x.so", "--topk-builds", "SPLIT=8+MINB=1"],
     "--topk-builds"),
    (["--launch-host", "--cases", "no such case"], "--cases"),
    (["--json", "/no/such/folder/bench.json"], "--json"),
    (["--trace", "/no/such/folder/trace.json"], "--trace"),
    (["--merge", "/no/such/peer.json"], "--merge"),
    (["--acceptance", "0.5"], "--acceptance"), (["--variable"], "--variable"),
    (["--compress-ratio", "4"], "--compress-ratio"),
    (["--tokens", "3", "--acceptance", "0.5", "--variable"], "--acceptance"),
    (["--paths", "portable"], "--paths"), (["--launch-host", "--seed", "3"], "--seed"),
    (["--plan-timing", "--trace"], "--trace"), (["--launch-host", "--heads", "32"], "--heads"),
    (["--cpu", "--cases", "B64 L32K"], "--cases"),
    (["--cpu", "--tokens", "2", "--cases", "5tok"], "--cases"),
]


@pytest.mark.parametrize("argv, flag", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_every_bad_value_is_refused_naming_its_flag(argv, flag, capsys, monkeypatch):
    for mode in ("run_cpu", "run_gpu"):
        monkeypatch.setattr(bench, mode, _never)
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag}" in err or f"error: argument {flag}" in err, err
    assert "Traceback" not in err


def test_the_output_is_checked_before_the_run(tmp_path, capsys, monkeypatch):
    """A folder, or a file in a folder that is not there, is refused before
    the run; a writable one is taken."""
    monkeypatch.setattr(bench, "run_cpu", _never)
    for bad in (tmp_path, tmp_path / "missing" / "bench.json"):
        with pytest.raises(SystemExit):
            bench.main(["--cpu", "--json", str(bad)])
        assert "--json" in capsys.readouterr().err
    assert bench.check_output("--json", str(tmp_path / "bench.json")) == ""
    assert "does not exist" in bench.check_output("--trace", str(tmp_path / "a" / "b.json"))
    assert not (tmp_path / "a").exists()


def test_json_alone_writes_into_the_output_folder_it_makes(tmp_path, capsys, monkeypatch):
    """``--json`` alone, or ``--json bench-out/bench.json`` (the main job), in
    a fresh checkout: the folder bench-out/ is made and the results written
    there; another missing folder is not made."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "run_cpu", lambda args: ([], {"device": "cpu (interpreter)"}))
    assert bench.main(["--cpu", "--json"]) == 0
    assert json.loads((tmp_path / "bench-out" / "bench.json").read_text())["results"] == []
    (tmp_path / "bench-out" / "bench.json").unlink()
    (tmp_path / "bench-out").rmdir()
    assert bench.main(["--cpu", "--json", "bench-out/bench.json"]) == 0
    assert (tmp_path / "bench-out" / "bench.json").is_file()
    with pytest.raises(SystemExit):
        bench.main(["--cpu", "--json", "elsewhere/bench.json"])
    assert not (tmp_path / "elsewhere").exists()


def test_the_output_folder_is_git_ignored():
    """What the main job writes (bench-out/) is not left for git to add."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, ".gitignore")) as f:
        assert f"/{bench.OUT_DIR}/" in f.read().split()
    assert bench.DEFAULT_JSON.startswith(bench.OUT_DIR + os.sep)
    got = subprocess.run(["git", "check-ignore", "-q", bench.DEFAULT_JSON], cwd=root)
    if got.returncode == 128:  # not a git checkout (an sdist)
        pytest.skip("not a git checkout")
    assert got.returncode == 0


def test_cases_select_this_machines_cases():
    """--cases: substrings of the case names, over the custom cases when given,
    else over this machine's (GPU or CPU) built-in ones."""
    args = bench.build_parser().parse_args(["--cases", "B2", "L300"])
    assert [c.name for c in bench.selected_cases(args, gpu=False)] == [
        c.name for c in bench.CPU_CASES]
    args = bench.build_parser().parse_args(["--cases", "B2 "])
    assert [c.name for c in bench.selected_cases(args, gpu=False)] == ["tiny B2 L200 2tok"]
    args = bench.build_parser().parse_args(["--cases", "2tok"])
    assert [c.name for c in bench.selected_cases(args, gpu=True)] == [
        c.name for c in bench.GPU_CASES if "2tok" in c.name]
    args = bench.build_parser().parse_args(["--batch", "2", "5", "--tokens", "3",
                                            "--cases", "B5"])
    assert [c.name for c in bench.selected_cases(args, gpu=False)] == ["B5 L32768 3tok uniform"]


@pytest.mark.interpreter
def test_cpu_run_honours_cases(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--cpu", "--json", str(out), "--cases", "B2 L200"]) == 0
    assert {r["case"] for r in json.loads(out.read_text())["results"]} == {"tiny B2 L200 2tok"}


def test_the_variant_knobs_are_the_launchers():
    import inspect

    from vllm_dsa_varlen.ops.launcher import varlen_paged_mqa_logits

    params = inspect.signature(varlen_paged_mqa_logits).parameters
    assert all(params[k].kind == inspect.Parameter.KEYWORD_ONLY for k in bench.KNOBS)


@pytest.mark.gpu
def test_profile_brackets_one_call_per_kept_path(capsys, monkeypatch):
    """``--profile`` times nothing and opens the profiler once per (case, kept path),
    around exactly one call of that path."""
    import torch

    events = []
    cudart = torch.cuda.cudart()

    class Recorder:
        def cudaProfilerStart(self):
            events.append("start")
            return cudart.cudaProfilerStart()

        def cudaProfilerStop(self):
            events.append("stop")
            return cudart.cudaProfilerStop()

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Recorder())
    assert bench.main(["--profile", "--cases", "B1 L8K", "B16 L16K", "--paths", "portable"]) == 0
    printed = capsys.readouterr().out
    profiled = [line for line in printed.splitlines() if line.startswith("profiling: ")]
    # one line per selected case, in the benchmark's case order
    cases = [c.name for c in bench.GPU_CASES if "B1 L8K" in c.name or "B16 L16K" in c.name]
    assert len(cases) == 2
    assert profiled == [f"profiling: {name} | triton-portable" for name in cases]
    assert events == ["start", "stop"] * 2
    assert "measured: copy" not in printed  # nothing timed
