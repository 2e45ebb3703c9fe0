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


def test_profile_needs_a_gpu():
    """``--profile`` brackets kernel calls for Nsight Compute; on the CPU it refuses plainly."""
    with pytest.raises(SystemExit, match="--profile: needs a CUDA GPU"):
        bench.main(["--cpu", "--profile"])


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
