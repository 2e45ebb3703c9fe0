"""Compile the kernels for a GPU target without a GPU (``triton.compile`` with an
explicit ``GPUTarget``): what the CPU tests use to prove every variant builds
with the Triton installed.  Returns the compiled kernels (their ``asm`` holds
TTGIR / PTX, ``n_regs`` is unset without a driver)."""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _mangle(arg) -> str:
    from triton.runtime.jit import mangle_type
    return mangle_type(arg)


def compile_gluon_sm90(heads: int, rows_max: int, stages: int | None = None, consumers: int | None = None,
                       consumer_regs: int | None = None, maxnreg: int | None = None,
                       direct_store: bool | None = None, arch: int = 90,
                       wide: bool | None = None):
    """The sm_90 Gluon kernel for ``heads`` and ``rows_max`` as a launch with
    these parameters compiles it (:func:`gluon_paged_mqa_logits.kernel_config`;
    ``None`` takes the launch's defaults), built for ``sm_<arch>``."""
    from . import gluon_paged_mqa_logits as gk
    from triton.experimental.gluon._runtime import GluonASTSource

    rows, blocks, dim, page = 8, 4, gk.DIM, gk.PAGE
    _, kernel, consts, options = gk.kernel_config(
        heads, rows_max, dim=dim, page=page, stages=stages, consumers=consumers or gk.CONSUMERS,
        consumer_regs=consumer_regs, maxnreg=maxnreg,
        direct_store=gk.DIRECT_STORE if direct_store is None else direct_store, wide=wide)
    q = torch.empty((rows, 1, heads, dim), dtype=torch.float8_e4m3fn)
    kv = torch.empty((blocks, page, 1, dim + 4), dtype=torch.uint8)
    kv_desc, sc_desc, q_desc = gk.descriptors(q, kv)
    sig = {
        "kv_desc": _mangle(kv_desc), "sc_desc": _mangle(sc_desc), "q_desc": _mangle(q_desc),
        "w_ptr": "*fp32", "ctx_ptr": "*i32", "bt_ptr": "*i32", "ids_ptr": "*i32", "out_ptr": "*fp32",
        "sched_ptr": "*i32",
        "num_rows": "i32", "max_context_len": "i32", "bt_width": "i32", "stride_w": "i32",
        "stride_bt": "i32", "stride_out": "i32",
    }
    sig.update({name: "constexpr" for name in consts})
    src = GluonASTSource(kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4, **options})


def compile_plan_sm90(heads: int, rows_max: int, arch: int = 90):
    """The sm_90 kernel's schedule planner (:func:`gluon_paged_mqa_logits.plan`)
    for the structure a launch with ``heads`` and ``rows_max`` takes."""
    from . import gluon_paged_mqa_logits as gk
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = gk.plan_constexprs(heads, rows_max)
    sig = {"ids_ptr": "*i32", "ctx_ptr": "*i32", "sched_ptr": "*i32", "num_rows": "i32",
           "max_context_len": "i32", "bt_width": "i32"}
    sig.update({name: "constexpr" for name in consts})
    src = GluonASTSource(gk._plan_sm90, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


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


def compile_cuda_sm90(defines: tuple = ()) -> dict:
    """The sm_90 CUDA kernel's build with ``defines`` through NVRTC (``sm_90a``):
    its registers and spills as ptxas reports them."""
    import re

    from . import cuda_paged_mqa_logits as ck

    cubin, log = ck.compile_cubin(extra=("--ptxas-options=-v", *(f"-D{d}" for d in defines)))
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"cubin_bytes": len(cubin), "registers": int(regs.group(1)) if regs else None,
            "spills": (int(spills.group(1)) + int(spills.group(2))) if spills else None}


def main() -> int:
    """Compile every variant a server can use and print one JSON line per kernel:
    the sm_90 Gluon kernel for H 32/64 and every ROWS_MAX, the sm_90 CUDA
    kernel's builds (where NVRTC loads), the portable kernel for sm_89, sm_90,
    sm_100 and sm_120.  Exit status 1 on any failure."""
    import json
    import os

    from . import cuda_paged_mqa_logits as ck
    from . import gluon_paged_mqa_logits as gk
    from . import triton_paged_mqa_logits as portable

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1 (the interpreter replaces the JIT)")
    failed = 0
    try:
        ck._nvrtc()
        nvrtc = "ok"
    except OSError as exc:
        nvrtc = str(exc)
    report = {"triton": triton.__version__, "gluon": gk.available() or "ok", "nvrtc": nvrtc}
    print(json.dumps(report), flush=True)
    jobs = []
    if nvrtc == "ok":  # the builds the launcher takes (one per run-length hint class)
        jobs += [("cuda_sm90", ck.HEADS, ck.defines_for(n), {}) for n in (1, ck.ROWS_MAX)]
    if gk.available() is None:
        jobs += [("sm90", h, r, {}) for h in gk.HEADS for r in gk.variants(h, range(1, 17))]
        # the launch knobs (one math warpgroup; the shared-memory store path;
        # each structure where the launch takes the other)
        jobs += [("sm90", 64, 4, {"consumers": 1}), ("sm90", 64, 4, {"direct_store": False}),
                 ("sm90", 64, 4, {"wide": True}), ("sm90", 64, 2, {"wide": False})]
        # the schedule planner, once per (heads, rows_max) a launch can take
        jobs += [("plan", h, r, {}) for h in gk.HEADS for r in gk.variants(h, range(1, 17))]
    jobs += [("portable", h, arch, v) for h in (32, 64) for arch in (89, 90, 100, 120)
             for v in portable.portable_variants(h)]
    for job in jobs:
        row = {"kernel": job[0], "heads": job[1]}
        try:
            if job[0] == "cuda_sm90":
                row["defines"] = list(job[2])
                row.update(compile_cuda_sm90(job[2]))
                row["ok"] = row["spills"] == 0
                failed += not row["ok"]
                print(json.dumps(row), flush=True)
                continue
            if job[0] == "sm90":
                row["rows_max"], row["knobs"] = job[2], job[3]
                k = compile_gluon_sm90(job[1], job[2], **job[3])
            elif job[0] == "plan":
                row["rows_max"] = job[2]
                k = compile_plan_sm90(job[1], job[2])
            else:
                row["arch"], row["pairs"] = job[2], job[3]["PAIRS"]
                k = compile_portable(job[2], **job[3])
            ptx = k.asm["ptx"]
            row.update(ok=True, shared=k.metadata.shared, name=k.name,
                       wgmma="wgmma.mma_async" in ptx,
                       tma="cp.async.bulk.tensor" in ptx, setmaxnreg="setmaxnreg" in ptx,
                       local=".local" in ptx)
        except Exception as exc:  # noqa: BLE001 - report every failure, then fail
            failed += 1
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-2000:]}")
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
