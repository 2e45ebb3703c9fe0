"""benchmarks/topk_profile.py: its arguments (the launches themselves need an
sm_90 GPU and a profiler; the kernel's tests are tests/ops/test_cuda_topk.py)."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "topk_profile.py")
_spec = importlib.util.spec_from_file_location("topk_profile", _PATH)
topk_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(topk_profile)


@pytest.mark.parametrize("reps", ["0", "-3"])
def test_reps_below_one_is_refused_by_name(reps, capsys):
    with pytest.raises(SystemExit):
        topk_profile.main(["--reps", reps])
    assert "--reps" in capsys.readouterr().err



@pytest.mark.parametrize("argv, message", [
    (["--builds", "SPLIT=8+MINB=1"], "--builds 'SPLIT=8+MINB=1': not a build the top-k plans"),
    (["--builds", "default", "THREADS=256"], "--builds 'THREADS=256'"),
    (["--cases", "64,4"], "--cases: expected requests,tokens,context"),
])
def test_bad_builds_and_cases_are_refused_by_name(argv, message, capsys):
    """Refused before any GPU work, naming the flag."""
    with pytest.raises(SystemExit) as exc:
        topk_profile.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
