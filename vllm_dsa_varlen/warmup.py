"""Compile the varlen kernels (and the decode top-k's, where it is the
project's) a builder will launch when the builder is made.

Both vLLM lines' metadata builders call :func:`precompile_for` from their
``__init__`` when their decode path is the project's kernels, so no decode
step waits on a JIT compile (vLLM makes the builders before it captures CUDA
graphs or serves a request).  Each line passes the facts it reads from its
own config and KV-cache spec; nothing here imports vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.dsa_varlen")


def precompile_for(*, heads: int | None, head_size: int, page: int, device: Any,
                   max_run_len: int) -> float | None:
    """Compile the kernels for an indexer cache of ``page`` entries per block,
    ``head_size`` bytes per entry (fp8 values then one fp32 scale: D =
    ``head_size - 4``) and ``heads`` index heads (``None``: every supported
    count) on ``device`` (a CUDA device; other devices compile nothing and
    return ``None``), for run-length hints up to ``max_run_len`` (the
    builder's ``next_n``).  Returns the seconds taken; the time is logged by
    :func:`vllm_dsa_varlen.ops.launcher.precompile`.  Each vLLM line reads ``page``
    from its own KV-cache spec (0.27: ``storage_block_size``; 0.33:
    ``num_states``)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    from vllm_dsa_varlen.ops import launcher

    heads_options = launcher.SUPPORTED_HEADS if heads is None else (heads,)
    hints = tuple(n for n in (1, 2, 4, 8) if n < max_run_len) + (max(1, max_run_len),)
    took = sum(launcher.precompile(heads=h, dim=head_size - 4, page=page, device=device,
                                   max_run_lens=hints)
               for h in heads_options)
    if torch.cuda.is_available():  # the decode top-k's choice, and its builds where it is ours
        from vllm_dsa_varlen import topk

        topk.decide(device.index if device.index is not None else torch.cuda.current_device())
    return took
