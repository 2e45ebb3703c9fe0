"""The indexer query's preparation in vLLM 0.27.1's DeepSeek-V3.2 indexer.

The indexer layer calls the module global ``fused_indexer_q_rope_quant`` once
per layer (RoPE, fp8 quantization of the indexer's query, the weights'
scaling); vLLM's Triton kernel launches a one-warp program per token and
head, bound by how fast programs start.  :func:`wrap_fused_indexer_q_rope_quant`
replaces it (:mod:`vllm_dsa_varlen.patches`): where
:func:`vllm_dsa_varlen.config.choose_fused_q` picks the project's kernel
(decided once), a call it takes goes to
:func:`vllm_dsa_varlen.ops.triton_indexer_q.launch` (the same arithmetic,
fewer and wider programs), every other call to vLLM's.  Traced by
``torch.compile`` like the function it replaces, it reads no setting and
logs nothing per call.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from vllm_dsa_varlen import config, settings
from vllm_dsa_varlen.ops import triton_indexer_q

logger = logging.getLogger("vllm.dsa_varlen")


def make_fused_indexer_q_rope_quant(original: Callable[..., Any], *, serves: bool,
                                    heads: int = triton_indexer_q.INDEX_HEADS,
                                    warps: int = triton_indexer_q.NUM_WARPS) -> Callable[..., Any]:
    """vLLM 0.27.1's ``fused_indexer_q_rope_quant`` signature, served by the
    project's kernel where it ``serves`` and takes the inputs, by ``original``
    otherwise."""

    @functools.wraps(original)
    def fused_indexer_q_rope_quant(positions: torch.Tensor, q: torch.Tensor,
                                   cos_sin_cache: torch.Tensor, weights: torch.Tensor,
                                   softmax_scale: float, head_scale: float,
                                   is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if serves and triton_indexer_q.input_problem(positions, q, cos_sin_cache, weights) is None:
            return triton_indexer_q.launch(positions, q, cos_sin_cache, weights, softmax_scale,
                                           head_scale, is_neox, heads=heads, warps=warps)
        return original(positions, q, cos_sin_cache, weights, softmax_scale, head_scale, is_neox)

    fused_indexer_q_rope_quant.__vllm_dsa_varlen_original__ = original
    return fused_indexer_q_rope_quant


def _platform() -> tuple[bool, tuple[int, int] | None]:
    """(is CUDA, device capability)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False, None
    cap = current_platform.get_device_capability()
    return True, None if cap is None else (int(cap[0]), int(cap[1]))


def wrap_fused_indexer_q_rope_quant(original: Callable[..., Any]) -> Callable[..., Any]:
    """The patch's factory: decide once (:func:`config.choose_fused_q`), log the
    decision, and return the dispatching function (which calls ``original``
    on every call where the project's kernel does not serve)."""
    is_cuda, capability = _platform()
    serves, why = config.choose_fused_q(is_cuda=is_cuda, capability=capability,
                                        setting=settings.get(settings.FUSED_Q_ENV),
                                        mode=settings.get(settings.MODE_ENV))
    blocks = settings.get(settings.FUSED_Q_BLOCKS_ENV)
    heads, warps = ((triton_indexer_q.INDEX_HEADS, triton_indexer_q.NUM_WARPS) if blocks is None
                    else (blocks[0], blocks[3]))
    logger.info("vllm-dsa-varlen: DeepSeek-V3.2 indexer query preparation "
                "(fused_indexer_q_rope_quant): %s%s", why,
                f" ({heads} heads per program, {warps} warps)" if serves else "")
    return make_fused_indexer_q_rope_quant(original, serves=serves, heads=heads, warps=warps)
