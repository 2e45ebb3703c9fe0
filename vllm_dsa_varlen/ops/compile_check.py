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
                       direct_store: bool | None = None, arch: int = 90):
    """The sm_90 Gluon kernel for ``heads`` and ``rows_max``, built for ``sm_<arch>``."""
    from . import gluon_paged_mqa_logits as gk
    from triton.experimental.gluon._runtime import GluonASTSource

    rows, blocks, dim, page = 8, 4, gk.DIM, gk.PAGE
    q = torch.empty((rows, 1, heads, dim), dtype=torch.float8_e4m3fn)
    kv = torch.empty((blocks, page, 1, dim + 4), dtype=torch.uint8)
    kv_desc, sc_desc, q_desc = gk.descriptors(q, kv)
    sig = {
        "kv_desc": _mangle(kv_desc), "sc_desc": _mangle(sc_desc), "q_desc": _mangle(q_desc),
        "w_ptr": "*fp32", "ctx_ptr": "*i32", "bt_ptr": "*i32", "ids_ptr": "*i32", "out_ptr": "*fp32",
        "num_rows": "i32", "max_context_len": "i32", "bt_width": "i32", "stride_w": "i32",
        "stride_bt": "i32", "stride_out": "i32",
        "H": "constexpr", "D": "constexpr", "PAGE": "constexpr", "ROWS_MAX": "constexpr",
        "STAGES": "constexpr", "CONSUMERS": "constexpr", "CONSUMER_REGS": "constexpr",
        "DIRECT_STORE": "constexpr",
        "BLOCK_R": "constexpr", "num_warps": "constexpr",
    }
    consts = {"H": heads, "D": dim, "PAGE": page, "ROWS_MAX": rows_max,
              "STAGES": stages or gk.STAGES, "CONSUMERS": consumers or gk.CONSUMERS,
              "CONSUMER_REGS": consumer_regs or gk.CONSUMER_REGS,
              "DIRECT_STORE": gk.DIRECT_STORE if direct_store is None else direct_store,
              "BLOCK_R": gk.BLOCK_R, "num_warps": 4}
    options = {"num_warps": 4}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    src = GluonASTSource(gk._varlen_logits_sm90, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
