"""Compile the kernels for a GPU target without a GPU: the portable Triton
kernel through ``triton.compile`` with an explicit ``GPUTarget`` (its ``asm``
holds TTGIR / PTX, ``n_regs`` is unset without a driver) and the query
preparation's (vLLM 0.33's ``fused_q``, vLLM 0.27's indexer query; sm_90), the
sm_90 CUDA kernel, its schedule planner and the decode top-k through NVRTC.
What the CPU tests use to prove every variant builds with the Triton and NVRTC
installed."""

from __future__ import annotations

import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_portable(arch: int, H: int, ROWS: int = 2, TILE_PAGES: int = 1, PER_ROW: bool = False,
                     PAIRS: int = 1, D: int = 128, PAGE: int = 64, num_warps: int = 4,
                     num_stages: int = 3):
    """The portable kernel (one compile-time variant) built for ``sm_<arch>``.
    Needs real JIT functions: run without ``TRITON_INTERPRET`` (see :func:`main`)."""
    from . import triton_paged_mqa_logits as portable

    fn = portable._varlen_paged_mqa_logits_kernel
    ptr = {"q_ptr": "*fp8e4nv", "kv_ptr": "*u8", "w_ptr": "*fp32", "ctx_ptr": "*i32",
           "bt_ptr": "*i32", "ids_ptr": "*i32", "out_ptr": "*fp32"}
    sig = dict(ptr)
    sig.update({n: "i32" for n in portable._PORTABLE_ARGS if n not in ptr})
    consts = dict(H=H, D=D, PAGE=PAGE, ROWS=ROWS, TILE_PAGES=TILE_PAGES, PER_ROW=PER_ROW,
                  PAIRS=PAIRS)
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def query_signature(fn, ptr: dict, consts: dict) -> dict:
    """``triton.compile``'s signature of a query-preparation kernel ``fn``: its
    ``consts`` constexpr, its pointers as ``ptr`` types them, the two float
    scales (``softmax_scale``, ``head_scale``) fp32, every other argument (the
    strides) i32."""
    return {n: "constexpr" if n in consts else ptr.get(
        n, "fp32" if n in ("softmax_scale", "head_scale") else "i32") for n in fn.arg_names}


def compile_fused_q(arch: int, blocks=None, *, quantize: bool = False, interleave: bool = False,
                    use_pdl: bool = True, index_heads: int = 64, q_heads: int = 64,
                    in_dtype: str = "bf16", fused: bool = True):
    """The query preparation's kernel (:mod:`.triton_fused_q`, one compile-time
    variant: DeepSeek-V3.2's dims) built for ``sm_<arch>``; ``blocks`` a
    :class:`~.triton_fused_q.Blocks` (default its default); ``fused``: the
    RoPE's fused forms (else every product rounded).  Needs real JIT
    functions, like :func:`compile_portable`."""
    from . import triton_fused_q as fq

    blocks = fq.Blocks() if blocks is None else blocks
    fn = fq._fused_q_blocks_kernel
    ptr = {"pos_ptr": "*i64", "index_q_ptr": f"*{in_dtype}", "index_cs_ptr": "*fp32",
           "index_q_fp8_ptr": "*fp8e4nv", "w_ptr": f"*{in_dtype}", "w_out_ptr": "*fp32",
           "q_pe_ptr": f"*{in_dtype}", "pe_cs_ptr": "*fp32", "ql_nope_ptr": f"*{in_dtype}",
           "q_scale_ptr": "*fp32", "mqa_ptr": "*fp8e4nv" if quantize else f"*{in_dtype}"}
    consts = dict(NUM_INDEX_HEADS=index_heads, INDEX_HEADS=blocks.index, INDEX_DIM=128,
                  INDEX_HALF=32, INTERLEAVE=interleave, NUM_Q_HEADS=q_heads, PE_HEADS=blocks.pe,
                  PE_HALF=32, NOPE_HEADS=blocks.nope, NOPE=512, NOPE_BLOCK=512,
                  QUANTIZE=quantize, USE_PDL=use_pdl, FP8_LIMIT=448.0, FUSED=fused)
    src = ASTSource(fn, query_signature(fn, ptr, consts), consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": blocks.warps, "num_stages": 1,
                                   **fq.COMPILE_OPTIONS})


def compile_indexer_q(arch: int, *, heads: int | None = None, warps: int | None = None,
                      interleave: bool = False, num_heads: int = 64, cs_dtype: str = "fp32",
                      fused: bool = True):
    """The indexer query's kernel (:mod:`.triton_indexer_q`, vLLM 0.27's
    ``fused_indexer_q_rope_quant``; 128-dim heads, a 64-dim RoPE) built for
    ``sm_<arch>``; ``heads`` / ``warps`` per program default to the kernel's;
    ``fused`` as :func:`compile_fused_q`'s.  Needs real JIT functions, like
    :func:`compile_portable`."""
    from . import triton_indexer_q as iq

    fn = iq._indexer_q_kernel
    ptr = {"pos_ptr": "*i64", "q_ptr": "*bf16", "cs_ptr": f"*{cs_dtype}", "out_ptr": "*fp8e4nv",
           "w_ptr": "*bf16", "w_out_ptr": "*fp32"}
    consts = dict(NUM_HEADS=num_heads, HEADS=iq.INDEX_HEADS if heads is None else heads,
                  DIM=128, HALF=32, INTERLEAVE=interleave, FP8_LIMIT=448.0, FUSED=fused)
    src = ASTSource(fn, query_signature(fn, ptr, consts), consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": iq.NUM_WARPS if warps is None else warps,
                                   "num_stages": 1, **iq.COMPILE_OPTIONS})


def compile_cuda_sm90(defines: tuple = ()) -> dict:
    """The sm_90 CUDA kernel's build with ``defines`` through NVRTC (``sm_90a``):
    its registers, spills and whether its wgmmas were serialised, as ptxas
    reports them."""
    from . import cuda_paged_mqa_logits as ck

    return _ptxas_report(*ck.compile_cubin(
        extra=("--ptxas-options=-v", *(f"-D{d}" for d in defines))))


def compile_plan_sm90(heads: int) -> dict:
    """The schedule planner's build for ``heads`` heads through NVRTC
    (``sm_90a``): its registers and spills as ptxas reports them."""
    from . import cuda_plan as cp

    return _ptxas_report(*cp.compile_cubin(extra=("--ptxas-options=-v",), heads=heads))


def compile_topk(defines: tuple = ()) -> dict:
    """A build of the decode top-k kernel through NVRTC (``sm_90a``): its
    registers and spills as ptxas reports them."""
    from . import cuda_topk as ct

    return _ptxas_report(*ct.compile_cubin(
        extra=("--ptxas-options=-v", *(f"-D{d}" for d in defines))))


def float_negations(ttir: str) -> int:
    """How many float values a kernel's Triton IR negates: ``arith.negf``
    (Triton 3.8 and later compile a float's unary minus so) and ``arith.subf``
    from a zero constant (earlier Tritons' form of it, which gives +0 for +0).
    The query kernels negate none: their RoPE's bytes must not depend on which
    form a Triton emits (:data:`~.triton_fused_q.NEG_ONE`)."""
    zeros = set(re.findall(r"(%[\w.#]+) = arith\.constant (?:dense<)?-?0\.0+e\+00\b", ttir))
    subs = re.findall(r"arith\.subf (%[\w.#]+),", ttir)
    return ttir.count("arith.negf") + sum(lhs in zeros for lhs in subs)


def _ptxas_report(cubin: bytes, log: str) -> dict:
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"cubin_bytes": len(cubin), "registers": int(regs.group(1)) if regs else None,
            "spills": (int(spills.group(1)) + int(spills.group(2))) if spills else None,
            "serialized": "serializ" in log.lower()}


def main() -> int:
    """Compile every variant a server can use and print one JSON line per kernel:
    the sm_90 CUDA kernel's builds and its planner's (where NVRTC loads), the
    portable kernel for sm_89, sm_90, sm_100 and sm_120, the query
    preparation's kernels (vLLM 0.33's ``fused_q``, vLLM 0.27's indexer
    query) for sm_90.  Exit status 1 on any failure."""
    import json
    import os

    from . import cuda_paged_mqa_logits as ck
    from . import cuda_plan as cp
    from . import triton_paged_mqa_logits as portable

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1 (the interpreter replaces the JIT)")
    failed = 0
    try:
        ck._nvrtc()
        nvrtc = "ok"
    except OSError as exc:
        nvrtc = str(exc)
    report = {"triton": triton.__version__, "nvrtc": nvrtc}
    print(json.dumps(report), flush=True)
    jobs = []
    if nvrtc == "ok":  # every build the launcher can load, each setting's included
        jobs += [("cuda_sm90", 32 if "HEADS=32" in defines else ck.HEADS, defines, {})
                 for defines in ck.shipped_builds()]
        jobs += [("cuda_plan_sm90", h, cp.defines_for(h), {}) for h in cp.HEAD_COUNTS]
        from . import cuda_topk as ct

        jobs += [("cuda_topk", None, build, {}) for build in ct.plan_builds()]
    jobs += [("portable", h, arch, v) for h in (32, 64) for arch in (89, 90, 100, 120)
             for v in portable.portable_variants(h)]
    nvrtc_builds = {"cuda_sm90": lambda job: compile_cuda_sm90(job[2]),
                    "cuda_plan_sm90": lambda job: compile_plan_sm90(job[1]),
                    "cuda_topk": lambda job: compile_topk(job[2])}
    # the query preparation (vLLM 0.33 on sm_90): its default shape, each query
    # path and RoPE layout, 64 and 128 MLA heads
    jobs += [("fused_q", h, 90, {"quantize": qm, "interleave": il, "fused": True})
             for h in (64, 128) for qm in (False, True) for il in (False, True)]
    # vLLM 0.27's indexer query: its default shape, each RoPE layout and table dtype
    jobs += [("indexer_q", 64, 90, {"interleave": il, "cs_dtype": cs, "fused": True})
             for il in (False, True) for cs in ("fp32", "bf16")]
    # both with every RoPE product rounded (Triton not fusing by default)
    jobs += [("fused_q", 64, 90, {"quantize": True, "interleave": False, "fused": False}),
             ("indexer_q", 64, 90, {"interleave": True, "cs_dtype": "fp32", "fused": False})]
    for job in jobs:
        row = {"kernel": job[0], "heads": job[1]}
        try:
            if job[0] in nvrtc_builds:
                row["defines"] = list(job[2])
                row.update(nvrtc_builds[job[0]](job))
                row["ok"] = row["spills"] == 0
                failed += not row["ok"]
                print(json.dumps(row), flush=True)
                continue
            if job[0] in ("fused_q", "indexer_q"):
                row.update(arch=job[2], **job[3])
                k = (compile_fused_q(job[2], q_heads=job[1], **job[3]) if job[0] == "fused_q"
                     else compile_indexer_q(job[2], num_heads=job[1], **job[3]))
                row.update(ok=True, name=k.name, local=".local" in k.asm["ptx"],
                           float_negations=float_negations(k.asm["ttir"]))
                print(json.dumps(row), flush=True)
                continue
            row["arch"], row["pairs"] = job[2], job[3]["PAIRS"]
            k = compile_portable(job[2], **job[3])
            ptx = k.asm["ptx"]
            row.update(ok=True, shared=k.metadata.shared, name=k.name, local=".local" in ptx)
        except Exception as exc:  # noqa: BLE001 - report every failure, then fail
            failed += 1
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-2000:]}")
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
