#!/usr/bin/env python3
"""Check, on a machine without a GPU, that a staged vLLM tree imports as the GPU host would.

    python3.12 scripts/offline-gpu/check-staged-imports.py /tmp/offline-gpu/site

Run it with a Python that mirrors the GPU host's image (CPython 3.12, torch
2.11.0, Triton 3.6.0, numpy 2.5.2, transformers 5.17.0 and the image's other
packages, nothing more; torch's CUDA wheel imports without a GPU once the
nvidia-* library wheels it links are there), on the tree that
``scripts/offline-gpu-install.sh`` unpacked, so that a failure costs no GPU
time.  Three things stand in for the GPU host:

* a stub ``libcuda.so.1`` (built here with gcc; every entry point returns
  CUDA_ERROR_NO_DEVICE) so that vLLM's extensions, which link the driver,
  are loaded with every other symbol resolved (Python loads them RTLD_NOW:
  a torch symbol they need and torch 2.11 lacks fails here as it would there);
* NVML answers as one H200 (sm_90), so vLLM picks its CUDA platform and the
  Hopper branches of its modules;
* Triton's CUDA driver reports itself active, as it does where torch sees a GPU.

Then: the modules the offline engine, the DeepSeek V3.2 model and MTP drafter,
the FlashMLA-sparse and indexer backends, the sampler and the spec-decode
proposers need; this project's plugin (``DSA_VARLEN=auto``); the imports
written inside functions of every loaded vLLM module, followed to a fixpoint
(printed, not judged: most serve other platforms, models or options); and
``LLM(...)`` built as ``benchmarks/e2e_decode.py``'s child builds it (tiny
config, 4 layers, MTP k=3), which must stop at device initialisation.  Exit 0
when the modules import and ``LLM(...)`` gets that far.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import tempfile
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = """
vllm vllm.entrypoints.llm vllm.v1.engine.llm_engine vllm.v1.executor.uniproc_executor
vllm.model_executor.models.deepseek_v2 vllm.model_executor.models.deepseek_mtp
vllm.models.deepseek_v32 vllm.models.deepseek_v32.nvidia.model vllm.models.deepseek_v32.nvidia.mtp
vllm.models.deepseek_v32.attention vllm.models.deepseek_v32.nvidia.ops.fused_q_cutedsl
vllm.v1.attention.backends.mla.flashmla_sparse vllm.v1.attention.backends.mla.indexer
vllm.v1.attention.backends.mla.sparse_indexer vllm.v1.attention.ops.flashmla
vllm.model_executor.layers.sparse_attn_indexer vllm.model_executor.layers.indexer_topk
vllm.model_executor.kernels.attention.dsa.sparse_mqa_logits
vllm.v1.sample.sampler vllm.v1.sample.rejection_sampler
vllm.v1.spec_decode.eagle vllm.v1.spec_decode.llm_base_proposer
vllm.v1.worker.gpu_worker vllm.v1.worker.gpu_model_runner vllm.v1.worker.gpu.model_runner
vllm.v1.worker.gpu.spec_decode.mtp vllm.v1.worker.gpu.spec_decode.eagle
vllm.utils.deep_gemm vllm.third_party.deep_gemm vllm.device_allocator.cumem
vllm.model_executor.model_loader.dummy_loader
""".split()


def stub_driver(site: str, folder: str) -> None:
    """``folder/libcuda.so.1`` with every ``cu*`` symbol the tree's extensions import
    and every ``cu*`` name in the source of Triton's CUDA driver module (which
    Triton compiles, and links to the driver, on first use)."""
    import importlib.util
    import re

    names = set()
    triton = importlib.util.find_spec("triton")
    driver_c = os.path.join(os.path.dirname(triton.origin), "backends", "nvidia", "driver.c")
    if os.path.exists(driver_c):
        with open(driver_c) as f:
            names.update(re.findall(r"\b(cu[A-Z]\w*)\b", f.read()))
    for dirpath, _, files in os.walk(os.path.join(site, "vllm")):
        for f in files:
            if f.endswith(".so"):
                out = subprocess.run(["nm", "-D", "--undefined-only", os.path.join(dirpath, f)],
                                     capture_output=True, text=True, check=True).stdout
                names.update(w.split("@")[0] for line in out.splitlines() for w in line.split()[1:])
    src = os.path.join(folder, "stub.c")
    with open(src, "w") as f:
        for n in sorted(x for x in names if x[:2] == "cu" and x[2:3].isupper()):
            f.write(f"int {n}(void) {{ return 100; }}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    os.path.join(folder, "libcuda.so.1"), src], check=True)


def fake_h200() -> None:
    from triton.backends import backends

    from vllm.third_party import pynvml as n

    handle = object()
    for name, fn in {
        "nvmlInit": lambda *a, **k: None, "nvmlShutdown": lambda *a, **k: None,
        "nvmlDeviceGetCount": lambda: 1, "nvmlDeviceGetHandleByIndex": lambda i: handle,
        "nvmlDeviceGetHandleByUUID": lambda u: handle, "nvmlDeviceGetIndex": lambda h: 0,
        "nvmlDeviceGetCudaComputeCapability": lambda h: (9, 0),
        "nvmlDeviceGetName": lambda h: "NVIDIA H200",
        "nvmlDeviceGetUUID": lambda h: "GPU-00000000-0000-0000-0000-000000000000",
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(
            total=143771 << 20, free=143000 << 20, used=771 << 20),
        "nvmlDeviceGetNumaNodeId": lambda h: 0,
    }.items():
        setattr(n, name, fn)
    backends["nvidia"].driver.is_active = staticmethod(lambda: True)


def nested_imports(scanned: set, tried: set) -> dict[str, str]:
    """vLLM modules imported inside functions of the loaded vLLM modules, not loaded yet."""
    found = {}
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None) or ""
        if name in scanned or not name.startswith("vllm") or not path.endswith(".py"):
            continue
        scanned.add(name)
        with open(path) as f:
            tree = ast.parse(f.read())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
                    for _ in range(max(node.level - 1, 0)):
                        pkg = pkg.rpartition(".")[0]
                    targets = [f"{pkg}.{node.module}" if node.level else node.module]
                else:
                    continue
                for t in targets:
                    if t.startswith("vllm") and t not in sys.modules and t not in tried:
                        found.setdefault(t, f"{name}:{node.lineno}")
    return found


def build_llm() -> str:
    """``LLM(...)`` as the e2e benchmark's child builds it; where it stopped."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import e2e_decode as e2e

    out = tempfile.mkdtemp(prefix="e2e-check-")
    model = e2e.write_tiny_config(os.path.join(out, "model"), 4)
    args = e2e.build_parser().parse_args(["--child", "--mode", "plugin", "--k", "3",
                                          "--layers", "4", "--model", model, "--out", out])
    args.k = args.k[0]
    try:
        e2e.child(args)
    except Exception as exc:  # noqa: BLE001 - where it stopped is the result
        frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
        where = "device initialisation" if "init_device" in frames else "BEFORE the device"
        return f"{where}: {type(exc).__name__}: {exc}"
    return "no failure (a GPU is visible?)"


def main() -> int:
    site = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "/tmp/offline-gpu/site")
    if "CHECK_STAGED_CHILD" not in os.environ:
        # everything the check writes (stub, caches, the tiny model, Triton's
        # builds against the stub) stays in one folder, removed at the end
        with tempfile.TemporaryDirectory(prefix="check-staged-") as work:
            stub_driver(site, work)
            path = [ROOT, site]
            dsl = os.path.join(site, "nvidia_cutlass_dsl", "dsl_packages")
            if os.path.isdir(dsl):
                path.append(dsl)
            env = dict(os.environ, CHECK_STAGED_CHILD="1", PYTHONPATH=os.pathsep.join(path),
                       LD_LIBRARY_PATH=work, TMPDIR=work, VLLM_CACHE_ROOT=work,
                       TRITON_CACHE_DIR=os.path.join(work, "triton"),
                       VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_FLASHINFER_SAMPLER="0",
                       DSA_VARLEN="auto")
            cmd = [sys.executable, os.path.abspath(__file__), site]
            return subprocess.run(cmd, env=env).returncode

    fake_h200()
    from vllm.platforms import current_platform

    print(f"platform: {type(current_platform).__name__}, sm_"
          f"{current_platform.get_device_capability().to_int()}")
    failed = []
    for m in MODULES:
        try:
            importlib.import_module(m)
        except Exception as exc:  # noqa: BLE001
            failed.append(m)
            print(f"FAIL {m}: {type(exc).__name__}: {exc}")
    from vllm import LLM, SamplingParams  # noqa: F401

    import vllm_dsa_varlen

    vllm_dsa_varlen.register()
    loaded = sorted(k for k, v in sys.modules.items() if k.startswith("vllm")
                    and (getattr(v, "__file__", None) or "").endswith(".so"))
    print(f"{len(MODULES) - len(failed)}/{len(MODULES)} modules import; plugin registered; "
          f"extensions loaded: {', '.join(loaded)}")

    stop = build_llm()
    print(f"LLM(...) stopped at {stop}")

    scanned, tried = set(), set()
    print("imports inside functions that fail (most serve other platforms, models, options):")
    while found := nested_imports(scanned, tried):
        for m, where in sorted(found.items()):
            tried.add(m)
            try:
                importlib.import_module(m)
            except BaseException as exc:  # noqa: BLE001 - report and go on
                first = str(exc).splitlines()[0] if str(exc) else ""
                print(f"  {m} <- {where}: {type(exc).__name__}: {first[:160]}")
    print(f"LLM(...) stopped at {stop}")
    return 0 if not failed and stop.startswith("device") else 1


if __name__ == "__main__":
    sys.exit(main())
