"""Compile the varlen kernels a builder will launch when the builder is made.

Both vLLM lines' metadata builders call :func:`precompile_for` from their
``__init__`` when their decode path is the project's (Triton / sm_90) kernel,
so no decode step waits on a JIT compile (vLLM creates the builders before it
captures CUDA graphs or serves a request).  The facts come from the vLLM
config and the indexer's KV-cache spec by attribute name; nothing here imports
vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.dsa_varlen")


def kernel_shape(vllm_config: Any, kv_cache_spec: Any) -> tuple[tuple[int, ...], int, int]:
    """``(head counts, head dim, page)`` the indexer kernel will see: the model's
    ``index_n_heads`` when the config names it (else every supported count),
    ``head_size - 4`` (fp8 values then one fp32 scale per token) and the
    cache's page size."""
    from vllm_dsa_varlen.ops import triton_paged_mqa_logits as tk

    page = getattr(kv_cache_spec, "storage_block_size", getattr(kv_cache_spec, "block_size", None))
    dim = getattr(kv_cache_spec, "head_size") - 4
    model_config = getattr(vllm_config, "model_config", None)
    heads = getattr(getattr(model_config, "hf_config", None), "index_n_heads", None)
    return ((heads,) if isinstance(heads, int) else tk.SUPPORTED_HEADS), dim, page


def precompile_for(vllm_config: Any, kv_cache_spec: Any, device: Any,
                   max_run_len: int) -> float | None:
    """Compile the kernels for this cache on ``device`` (a CUDA device; other
    devices compile nothing and return ``None``), for run-length hints up to
    ``max_run_len`` (the builder's ``next_n``).  Returns the seconds taken; the
    time is logged by :func:`vllm_dsa_varlen.ops.precompile`."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    from vllm_dsa_varlen.ops import precompile

    heads_options, dim, page = kernel_shape(vllm_config, kv_cache_spec)
    hints = tuple(n for n in (1, 2, 4, 8) if n < max_run_len) + (max(1, max_run_len),)
    return sum(precompile(heads=heads, dim=dim, page=page, device=device, max_run_lens=hints)
               for heads in heads_options)
