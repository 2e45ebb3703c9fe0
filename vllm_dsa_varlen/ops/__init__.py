"""Paged MQA logits kernels (fp8 indexer cache, DeepGEMM's varlen semantics).

* :mod:`.reference` — the torch reference, the source of truth for tests;
* :mod:`.triton_paged_mqa_logits` — the launcher and the portable Triton kernel
  (any fp8 GPU and the CPU interpreter);
* :mod:`.cuda_paged_mqa_logits` — the sm_90 (Hopper) CUDA C++ kernel
  (NVRTC, driver API) the launcher takes on Hopper at 64 heads;
* :mod:`.gluon_paged_mqa_logits` — the sm_90 Gluon kernel, where the CUDA one
  cannot run (32 heads, no NVRTC);
* :func:`precompile` — compile every variant a server uses, up front.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("vllm.dsa_varlen")

__all__ = ["precompile"]


def precompile(*, heads: int, dim: int = 128, page: int = 64, device=None,
               max_run_lens=(1, 2, 4, 8), kv_block_stride: int | None = None,
               kernel: str | None = None) -> float:
    """Compile every kernel variant a server with ``heads`` indexer heads uses,
    so no decode step waits on a JIT compile; returns the seconds it took.

    The variants are the launcher's for each ``max_run_len`` hint in
    ``max_run_lens`` (the sm_90 kernel on Hopper, the portable kernel
    elsewhere, or as ``kernel`` forces).  Per-step integers (row count, logits
    width, block-table width and stride) are not specialised, so calls with any
    of them reuse these compilations.  ``kv_block_stride``: the serving cache's
    page stride in bytes when it is not ``page * (dim + 4)``.
    """
    import torch

    from . import triton_paged_mqa_logits as tk
    from .triton_paged_mqa_logits import varlen_paged_mqa_logits

    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device (kernels compile for a GPU), got {device}")
    start = time.perf_counter()
    stride = kv_block_stride or page * (dim + 4)
    blocks = 2
    pool = torch.zeros(blocks * stride, dtype=torch.uint8, device=device)
    kv_cache = pool.as_strided((blocks, page, 1, dim + 4), (stride, dim + 4, dim + 4, 1))
    # "auto" takes the portable kernel for eager calls and may take the sm_90
    # kernel inside a CUDA-graph capture (triton_paged_mqa_logits.auto_takes_sm90),
    # so both are compiled where the sm_90 kernel can serve this cache.
    if kernel is None or kernel == "auto":
        from . import cuda_paged_mqa_logits as ck
        from . import gluon_paged_mqa_logits as gk

        probe = torch.zeros((1, 1, heads, dim), device=device).to(torch.float8_e4m3fn)
        sm90 = tk.HOPPER_AUTO and (
            gk.unsupported_reason(probe, kv_cache) is None
            or (tk.CUDA_SM90 and ck.unsupported_reason(probe, kv_cache) is None))
        kernels = ["portable"] + (["sm90"] if sm90 else [])
    else:
        kernels = [kernel]
    for which in kernels:
        runs = [n for n in sorted(set(max_run_lens))
                if which != "sm90" or kernel == "sm90" or tk.hopper_run_len(n)]
        for n in runs:
            _compile_one(varlen_paged_mqa_logits, kv_cache, heads, dim, page, n, which, device)
    torch.cuda.synchronize(device)
    took = time.perf_counter() - start
    logger.info("vllm-dsa-varlen: indexer kernels compiled for H %d, D %d, page %d, run-length "
                "hints %s in %.2f s", heads, dim, page, tuple(sorted(set(max_run_lens))), took)
    return took


def _compile_one(launch, kv_cache, heads: int, dim: int, page: int, max_run_len: int,
                 kernel: str, device) -> None:
    """One call of ``launch`` (the launcher) with ``kernel`` forced: compiles that
    variant (its inputs are all zero-length contexts, so it computes nothing)."""
    import torch

    rows = max(64, max_run_len)
    q = torch.zeros((rows, 1, heads, dim), device=device).to(torch.float8_e4m3fn)
    weights = torch.zeros((rows, heads), dtype=torch.float32, device=device)
    ctx = torch.zeros((rows, 1), dtype=torch.int32, device=device)
    table = torch.zeros((rows, 32), dtype=torch.int32, device=device)
    ids = torch.zeros(rows, dtype=torch.int32, device=device)
    launch(q, kv_cache, weights, ctx, table, ids, page, max_run_len=max_run_len, kernel=kernel)
