"""The step's query preparation in vLLM 0.33's DeepSeek-V3.2 attention layer.

The layer calls the module global ``fused_q`` once per layer (RoPE and fp8
quantization of the indexer's query, the indexer weights' scaling, the MLA
query's RoPE); on Hopper vLLM's Triton kernel launches a one-warp program per
token, part and head, bound by how fast programs start.  :func:`wrap_fused_q`
replaces it (:mod:`vllm_dsa_varlen.patches`): where
:func:`vllm_dsa_varlen.config.choose_fused_q` picks the project's kernel
(decided once), a call it takes goes to
:func:`vllm_dsa_varlen.ops.triton_fused_q.launch` (bit-equal outputs, fewer and
wider programs), every other call to vLLM's.  Traced by ``torch.compile``
like the function it replaces, it reads no setting and logs nothing per call.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from vllm_dsa_varlen import config, settings
from vllm_dsa_varlen.ops import triton_fused_q

logger = logging.getLogger("vllm.dsa_varlen")


def _platform() -> tuple[bool, tuple[int, int] | None, bool]:
    """(is CUDA, device capability, programmatic dependent launch supported)."""
    from vllm.platforms import current_platform

    is_cuda = bool(current_platform.is_cuda())
    cap = current_platform.get_device_capability() if is_cuda else None
    capability = None if cap is None else (int(cap[0]), int(cap[1]))
    return is_cuda, capability, bool(is_cuda and current_platform.is_arch_support_pdl())


def make_fused_q(original: Callable[..., Any], *, serves: bool, use_pdl: bool,
                 blocks: triton_fused_q.Blocks = triton_fused_q.Blocks()) -> Callable[..., Any]:
    """vLLM 0.33.0's ``fused_q`` signature, served by the project's kernel
    where it ``serves`` and takes the call (an indexer layer, inputs it
    accepts), by ``original`` otherwise."""

    @functools.wraps(original)
    def fused_q(positions: torch.Tensor, q_pe: torch.Tensor, q_pe_cos_sin_cache: torch.Tensor,
                index_q: torch.Tensor | None, index_q_cos_sin_cache: torch.Tensor | None,
                ql_nope: torch.Tensor, q_scale: torch.Tensor, index_weights: torch.Tensor | None,
                index_weights_softmax_scale: float, index_weights_head_scale: float,
                has_indexer: bool = True, index_rope_interleave: bool = False,
                quantize_mqa: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        args = (positions, q_pe, q_pe_cos_sin_cache, index_q, index_q_cos_sin_cache, ql_nope,
                q_scale, index_weights)
        if (serves and has_indexer and index_q is not None and index_q_cos_sin_cache is not None
                and index_weights is not None
                and triton_fused_q.input_problem(*args, quantize_mqa=quantize_mqa) is None):
            return triton_fused_q.launch(
                *args, index_weights_softmax_scale, index_weights_head_scale,
                index_rope_interleave=index_rope_interleave, quantize_mqa=quantize_mqa,
                use_pdl=use_pdl, blocks=blocks)
        return original(*args, index_weights_softmax_scale, index_weights_head_scale,
                        has_indexer=has_indexer, index_rope_interleave=index_rope_interleave,
                        quantize_mqa=quantize_mqa)

    fused_q.__vllm_dsa_varlen_original__ = original
    return fused_q


def wrap_fused_q(original: Callable[..., Any]) -> Callable[..., Any]:
    """The patch's factory: decide once (:func:`config.choose_fused_q`), log the
    decision, and return the dispatching function (which calls ``original``
    on every call where the project's kernel does not serve)."""
    is_cuda, capability, use_pdl = _platform()
    serves, why = config.choose_fused_q(is_cuda=is_cuda, capability=capability,
                                        setting=settings.get(settings.FUSED_Q_ENV),
                                        mode=settings.get(settings.MODE_ENV))
    blocks = settings.get(settings.FUSED_Q_BLOCKS_ENV)
    blocks = triton_fused_q.Blocks() if blocks is None else triton_fused_q.Blocks(*blocks)
    logger.info("vllm-dsa-varlen: DeepSeek-V3.2 query preparation (fused_q): %s%s", why,
                f" (heads per program {blocks.index}/{blocks.pe}/{blocks.nope}, "
                f"{blocks.warps} warps)" if serves else "")
    return make_fused_q(original, serves=serves, use_pdl=use_pdl, blocks=blocks)
