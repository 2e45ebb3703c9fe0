"""benchmarks/sm90_ablation.py: its cuts still find their markers in the sm_90
module (a kernel edit that moves them fails here, not on the GPU), and each
ablated copy still compiles for sm_90 where this Triton has Gluon."""

import importlib.util
import os

import pytest

from vllm_dsa_varlen.ops import gluon_paged_mqa_logits as gk

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                     "sm90_ablation.py")
_spec = importlib.util.spec_from_file_location("sm90_ablation", _PATH)
ablation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablation)
SRC = open(gk.__file__).read()


def test_cuts_remove_what_they_name():
    assert ablation.ablated_source("real", SRC).count("warpgroup_mma(") == SRC.count("warpgroup_mma(")
    noepi = ablation.ablated_source("noepi", SRC)
    assert "gl.store(ptrs, logit" in SRC and "gl.store(ptrs, logit" not in noepi
    nomma = ablation.ablated_source("nomma", SRC)
    assert nomma.count("warpgroup_mma(a_tile") == 0 < SRC.count("warpgroup_mma(a_tile")
    with pytest.raises(ValueError, match="name"):
        ablation.ablated_source("nothing", SRC)
    with pytest.raises(ValueError, match="marker"):
        ablation.ablated_source("noepi", SRC.replace("    def _epilogue(", "    def _epi("))


_COMPILE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sm90_ablation", sys.argv[1])
ablation = importlib.util.module_from_spec(spec); spec.loader.exec_module(ablation)
from vllm_dsa_varlen import ops
from vllm_dsa_varlen.ops import compile_check
mod = ablation.load_variant(sys.argv[2])
sys.modules["vllm_dsa_varlen.ops.gluon_paged_mqa_logits"] = mod
ops.gluon_paged_mqa_logits = mod
for wide in (True,) if sys.argv[2] == "nomma" else (False, True):
    ptx = compile_check.compile_gluon_sm90(64, 4, wide=wide).asm["ptx"]
    print(wide, "wgmma.mma_async" in ptx)
"""


@pytest.mark.skipif(gk.available() is not None, reason="needs Gluon")
@pytest.mark.parametrize("name", ["noepi", "nomma"])
def test_ablated_copies_compile(name):
    """In a process without the interpreter (``triton.compile`` needs the JIT)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _COMPILE, _PATH, name], capture_output=True,
                          text=True, env=env, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    if name == "nomma":
        assert lines == ["True", "False"]          # the wide copy, no wgmma left
    else:
        assert lines == ["False", "True", "True", "True"]   # both structures keep the wgmma
