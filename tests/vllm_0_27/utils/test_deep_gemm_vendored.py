"""Capability detection against the DeepGEMM vLLM 0.27.1 ships (``vllm/third_party/deep_gemm``).

The vendored extension (DeepGEMM 2.6.1) is a CUDA build, but its pybind
functions -- and so the signatures :func:`detect_caps` reads from their
``__doc__`` -- exist as soon as the module is initialised, which needs no
GPU.  On a CPU machine the loader is satisfied like this, in a subprocess
(nothing leaks into the test process):

* the shared libraries it links that this machine lacks (``ldd`` says "not
  found" even with torch's own ``lib/`` on the search path: e.g.
  ``libtorch_cuda.so``, ``libc10_cuda.so``, ``libnvrtc.so.13``) are stood in
  for by *empty* shared objects compiled with ``gcc`` into a temp dir;
* the module is loaded with lazy binding (``RTLD_LAZY``): its CUDA / cuBLASLt
  function symbols are resolved only when called, and nothing here calls
  them.  (Python's default ``RTLD_NOW`` fails on ``cublasLtMatmulDescCreate``,
  which no stand-in defines.)

Skipped, with the reason, where the ``.so``, ``ldd`` or ``gcc`` is missing or
the module still does not load.
"""

import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_deep_gemm import FakeDeepGemm

from vllm_dsa_varlen.vllm_0_27.utils import deep_gemm as dsa_dg

FUNCS = ("fp8_fp4_paged_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_fp4_mqa_logits")

_PROBE = r"""
import dataclasses, importlib.util, json, os, sys
import torch  # loads libtorch / libc10 first, as `import deep_gemm` would
sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_LOCAL)
spec = importlib.util.spec_from_file_location("_C", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
from vllm_dsa_varlen.vllm_0_27.utils import deep_gemm as dsa_dg
paged, meta, prefill = (getattr(module, n) for n in %r)
caps = dsa_dg.detect_caps(paged, meta, prefill)
print(json.dumps({
    "docs": {f.__name__: f.__doc__.strip().splitlines()[0] for f in (paged, meta, prefill)},
    "names": {f.__name__: dsa_dg.param_names(f) for f in (paged, meta, prefill)},
    "caps": dataclasses.asdict(caps),
}))
""" % (FUNCS,)


def _vendored_so() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    root = Path(list(spec.submodule_search_locations)[0]) / "third_party" / "deep_gemm"
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        so = root / f"_C{suffix}"
        if so.exists():
            return so
    pytest.skip(f"no vendored DeepGEMM extension for this Python under {root}")


def _missing_libraries(so: Path, torch_lib: str) -> list[str]:
    """Shared libraries ``so`` links that the loader cannot find (torch's own
    ``lib/`` counted as found: importing torch loads them)."""
    if shutil.which("ldd") is None:
        pytest.skip("ldd is not available to list the extension's libraries")
    env = dict(os.environ, LD_LIBRARY_PATH=torch_lib)
    out = subprocess.run(["ldd", str(so)], capture_output=True, text=True, env=env).stdout
    return re.findall(r"^\s*(\S+) => not found", out, flags=re.M)


@pytest.fixture(scope="module")
def vendored(tmp_path_factory):
    """What the probe read from the vendored functions (``docs``, ``names``, ``caps``)."""
    so = _vendored_so()
    torch_lib = str(Path(torch.__file__).parent / "lib")
    missing = _missing_libraries(so, torch_lib)
    stubs = tmp_path_factory.mktemp("deep_gemm_stubs")
    if missing:
        if shutil.which("gcc") is None:
            pytest.skip(f"gcc is not available to build stand-ins for {missing}")
        empty = stubs / "empty.c"
        empty.write_text("/* an empty stand-in library */\n")
        for name in missing:
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(stubs / name), str(empty),
                            f"-Wl,-soname,{name}"], check=True, capture_output=True)
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join([str(stubs), torch_lib]),
               PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    run = subprocess.run([sys.executable, "-c", _PROBE, str(so)], capture_output=True,
                         text=True, env=env, timeout=300)
    if run.returncode != 0:
        why = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else run.returncode
        pytest.skip(f"the vendored DeepGEMM did not load with stand-ins for {missing}: {why}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["stand_ins"] = missing
    return result


def test_vendored_signatures_are_the_documented_ones(vendored):
    """The pybind signatures vLLM 0.27.1 ships (printed for the record)."""
    for doc in vendored["docs"].values():
        print(doc)
    names = {k: tuple(v) for k, v in vendored["names"].items()}
    assert names["get_paged_mqa_logits_metadata"] == (
        "context_lens", "block_kv", "num_sms", "indices")
    assert names["fp8_fp4_paged_mqa_logits"] == (
        "q", "kv_cache", "weights", "context_lens", "block_table", "schedule_meta",
        "max_context_len", "clean_logits", "logits_dtype", "indices")
    assert "indices: torch.Tensor | None = None" in vendored["docs"]["fp8_fp4_paged_mqa_logits"]
    assert "clean_logits: bool = False" in vendored["docs"]["fp8_fp4_paged_mqa_logits"]


def test_detection_finds_varlen_in_the_vendored_deepgemm(vendored):
    """A default install (vLLM 0.27.1 + its vendored DeepGEMM) has DeepGEMM varlen:
    both functions take ids, and the kernel keeps ``clean_logits`` (fp32 logits)."""
    caps = dsa_dg.DeepGemmCaps(**vendored["caps"])
    assert caps.signatures_known and caps.varlen
    assert caps.paged_clean_logits and caps.prefill_clean_logits


def test_the_double_models_the_vendored_signatures(vendored):
    """The test double's default generation has exactly the shipped argument names
    (and so the same detected capabilities)."""
    fake = FakeDeepGemm()
    for name in FUNCS:
        assert dsa_dg.param_names(getattr(fake, name)) == tuple(vendored["names"][name]), name
    got = dsa_dg.detect_caps(fake.fp8_fp4_paged_mqa_logits, fake.get_paged_mqa_logits_metadata,
                             fake.fp8_fp4_mqa_logits)
    assert got == dsa_dg.DeepGemmCaps(**vendored["caps"])
