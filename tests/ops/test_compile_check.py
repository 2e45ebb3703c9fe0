"""ops/compile_check.py: every kernel variant a server can take builds without a
GPU, with this environment's Triton (the portable kernel for four targets) and
NVRTC (the sm_90 CUDA kernel's builds and its schedule planner's, without
spills)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import sigterm_to_idle_child

from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
from vllm_dsa_varlen.ops import cuda_plan as cp
from vllm_dsa_varlen.ops import cuda_topk as ct


@pytest.fixture(scope="module")
def compiled_variants():
    """Every variant compiled by ``python -m vllm_dsa_varlen.ops.compile_check``
    in a process without ``TRITON_INTERPRET`` (the interpreter replaces the JIT
    functions that ``triton.compile`` needs)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "vllm_dsa_varlen.ops.compile_check"],
                          capture_output=True, text=True, env=env, cwd=root, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-2000:]
    return proc.returncode, rows[0], rows[1:]


def test_every_portable_variant_compiles(compiled_variants):
    """The portable kernel for 32 and 64 heads, each row-pairing variant, for
    sm_89, sm_90, sm_100 and sm_120, with no local memory."""
    rc, _, rows = compiled_variants
    failures = [r for r in rows if not r["ok"]]
    assert not failures, failures
    assert rc == 0
    portable = [r for r in rows if r["kernel"] == "portable"]
    assert {(r["heads"], r["arch"], r["pairs"]) for r in portable} == {
        (h, a, p) for h in (32, 64) for a in (89, 90, 100, 120) for p in (1, 2)}
    assert not any(r["local"] for r in portable)
    assert {r["kernel"] for r in rows} <= {"portable", "cuda_sm90", "cuda_plan_sm90",
                                           "cuda_topk", "fused_q", "indexer_q"}


def test_the_query_preparation_compiles_for_sm90(compiled_variants):
    """The query preparation's kernel (vLLM 0.33's fused_q on sm_90) at its
    default shape: bf16 and fp8 query, NeoX and interleaved RoPE, 64 and 128
    MLA heads (and one build with every RoPE product rounded), with no local
    memory."""
    _, _, rows = compiled_variants
    fq = [r for r in rows if r["kernel"] == "fused_q"]
    assert {(r["heads"], r["quantize"], r["interleave"]) for r in fq if r["fused"]} == {
        (h, q, i) for h in (64, 128) for q in (False, True) for i in (False, True)}
    assert [(r["heads"], r["quantize"]) for r in fq if not r["fused"]] == [(64, True)]
    assert all(r["ok"] and r["arch"] == 90 for r in fq), fq
    assert not any(r["local"] for r in fq)


def test_the_indexer_query_compiles_for_sm90(compiled_variants):
    """vLLM 0.27's indexer-query kernel at its default shape: NeoX and
    interleaved RoPE, float32 and bf16 RoPE tables (and one build with every
    RoPE product rounded), with no local memory."""
    _, _, rows = compiled_variants
    iq = [r for r in rows if r["kernel"] == "indexer_q"]
    assert {(r["interleave"], r["cs_dtype"]) for r in iq if r["fused"]} == {
        (i, c) for i in (False, True) for c in ("fp32", "bf16")}
    assert [r["interleave"] for r in iq if not r["fused"]] == [True]
    assert all(r["ok"] and r["arch"] == 90 for r in iq), iq
    assert not any(r["local"] for r in iq)


def test_the_query_kernels_negate_no_float(compiled_variants):
    """Neither query kernel negates a float in its IR (no ``arith.negf``, no
    subtraction from a zero constant) in any build: the RoPE's negated
    product is a product with -1, whose bytes are the same under every
    Triton (before 3.8 a unary minus compiled as ``0 - y``, +0 where vLLM's
    kernel gives -0)."""
    _, _, rows = compiled_variants
    query = [r for r in rows if r["kernel"] in ("fused_q", "indexer_q")]
    assert query and all(r["float_negations"] == 0 for r in query), \
        [(r["kernel"], r.get("float_negations")) for r in query]


def test_float_negations_counts_both_forms_of_a_unary_minus():
    """The count the test above asks to be zero, on IR of each form (Triton
    3.8+'s ``negf``, earlier ``0 - y``) and of a plain difference."""
    from vllm_dsa_varlen.ops.compile_check import float_negations

    new = "%r = arith.negf %x : tensor<8x32xf32>"
    old = ("%cst_3 = arith.constant dense<0.000000e+00> : tensor<8x32xf32>\n"
           "%r = arith.subf %cst_3, %x : tensor<8x32xf32>")
    plain = ("%cst_3 = arith.constant dense<0.000000e+00> : tensor<8x32xf32>\n"
             "%r = arith.subf %a, %cst_3 : tensor<8x32xf32>\n%s = arith.subf %a, %b : f32")
    assert (float_negations(new), float_negations(old), float_negations(plain)) == (1, 1, 0)


def test_the_cuda_builds_compile_without_spills(compiled_variants):
    """The sm_90 CUDA kernel through NVRTC in every build it ships (64 and 32
    heads, each run-length hint class, head sum, pipeline and PDL setting,
    and the HALF_MMA=0 builds made where ptxas serialises), with no spills
    and no serialised wgmmas, where NVRTC loads."""
    _, head, rows = compiled_variants
    if head["nvrtc"] != "ok":
        pytest.skip(f"no NVRTC here: {head['nvrtc']}")
    cuda = [r for r in rows if r["kernel"] == "cuda_sm90"]
    assert sorted(tuple(r["defines"]) for r in cuda) == sorted(ck.shipped_builds())
    assert all(r["heads"] == (32 if "HEADS=32" in r["defines"] else 64) for r in cuda)
    assert set(ck.LAUNCHER_HEADS) == {32, 64}
    assert all(r["ok"] and r["spills"] == 0 and r["cubin_bytes"] > 0 and not r["serialized"]
               for r in cuda), cuda
    topk = [r for r in rows if r["kernel"] == "cuda_topk"]  # every build the top-k's plan takes
    assert sorted(tuple(r["defines"]) for r in topk) == sorted(ct.plan_builds())
    assert all(r["ok"] and r["spills"] == 0 and 0 < r["registers"] <= 64 for r in topk), topk
    minb2 = [r for r in topk if "MINB=2" in r["defines"]]  # two 1024-thread CTAs per SM
    assert minb2 and all(r["registers"] <= 32 for r in minb2), minb2


def test_the_planner_builds_for_both_head_counts_without_spills(compiled_variants):
    """The sm_90 schedule planner through NVRTC at 64 and 32 heads (the
    logits kernel's head counts), with no spills, in the 64 registers a
    thread of its 1024-thread CTA has, where NVRTC loads."""
    _, head, rows = compiled_variants
    if head["nvrtc"] != "ok":
        pytest.skip(f"no NVRTC here: {head['nvrtc']}")
    plan = [r for r in rows if r["kernel"] == "cuda_plan_sm90"]
    assert sorted((r["heads"], r["defines"]) for r in plan) == [(32, ["HEADS=32"]), (64, [])]
    assert sorted(cp.HEAD_COUNTS) == sorted(ck.LAUNCHER_HEADS)
    assert all(r["ok"] and r["spills"] == 0 and 0 < r["registers"] <= 64 and r["cubin_bytes"] > 0
               for r in plan), plan


def test_nvrtc_compiles_leave_the_signal_handling_alone(sigterm_kept):
    """The engine core compiles these kernels in its main thread at start-up;
    a compile that left SIGTERM blocked there, or replaced vLLM's handler,
    would leave that handler unrun at a server's stop (a process-directed
    signal goes to a thread that does not block it, and the main thread
    sleeps on)."""
    with sigterm_kept():
        ck.compile_cubin()
        cp.compile_cubin(heads=32)
        ct.compile_cubin()


_COMPILE_THEN_IDLE = """
import queue, signal, sys
signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))  # as vLLM 0.34's core: before the work
from vllm_dsa_varlen.ops import compile_check
compile_check.compile_portable(90, 64)  # Triton: its LLVM compiles in this process
print("waiting", flush=True)
queue.Queue().get()  # idle, as the engine core's busy loop waits for input
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's sigaction")
def test_a_triton_compile_leaves_sigterm_heard_though_it_installs_its_own_action():
    """Why the stop-signal guard stays off Triton's compiles: Triton's LLVM
    installs its own SIGTERM action in the process (so the C-level action
    is not kept), but that handler sets the previous one back and raises the
    signal again, without SA_RESTART: a core idle in its input queue still
    exits through vLLM's handler at once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    said, code = sigterm_to_idle_child(_COMPILE_THEN_IDLE, timeout=10, env=env, cwd=root)
    assert said == "waiting"
    assert code == 7
