"""Varlen kernel dispatch inside vLLM 0.27.1's sparse-attention indexer op.

The registered op captured ``sparse_attn_indexer`` itself, which looks its
module globals up per call.  Replacing ``fp8_fp4_paged_mqa_logits`` routes the
decode call: after a varlen build its arguments already are the varlen
layout (queries ``[R, 1, H, D]``, lengths ``[R, 1]``) and the run ids ride on
the schedule tensor (:mod:`vllm_dsa_varlen.varlen_ids`): tagged ``deepgemm``,
DeepGEMM with ``indices``; tagged ``own``, the project's kernel (FP8 cache
only); untagged, stock's call through the DeepGEMM adapter.  The decode top-k
after it is reached through the module global ``torch``:
:func:`torch_with_own_topk` sends its two top-k ops to
:func:`vllm_dsa_varlen.topk.dispatch`, with the step's bound the logits carry.
"""

from __future__ import annotations

import functools

import torch

from vllm_dsa_varlen import topk
from vllm_dsa_varlen.vllm_0_27.utils import deep_gemm as dsa_dg
from vllm_dsa_varlen.vllm_0_27.utils.deep_gemm import mask_beyond
from vllm_dsa_varlen.varlen_ids import bound_of, first_rows, mark_bound, varlen_ids_of


@functools.cache
def _launcher():
    """:mod:`vllm_dsa_varlen.ops.launcher`, imported on the first varlen call
    (it loads Triton); its entry point is read per call (a module attribute)."""
    from vllm_dsa_varlen.ops import launcher

    return launcher


def _own_logits(q, kv_cache, weights, context_lens, block_tables, ids, max_model_len,
                clean_logits, max_run_len, schedules=None):
    q_values, q_scale = q
    if q_scale is not None or q_values.dtype != torch.float8_e4m3fn:
        raise RuntimeError(
            "vllm-dsa-varlen: the project's varlen backend serves the FP8 indexer cache only; "
            f"this step has {'MXFP4 (scaled) ' if q_scale is not None else ''}queries of "
            f"dtype {q_values.dtype} (an MXFP4 cache needs the DeepGEMM backend on SM100)")
    logits = _launcher().varlen_paged_mqa_logits(q_values, kv_cache, weights, context_lens,
                                                 block_tables, ids, max_model_len,
                                                 max_run_len=max_run_len,
                                                 schedule_cache=schedules)
    if clean_logits:
        mask_beyond(logits, context_lens)
    return logits


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor,
    max_model_len: int,
    clean_logits: bool,
) -> torch.Tensor:
    """Paged MQA logits for the indexer's decode step, float32 ``[rows, max_model_len]``.

    ``q``: ``(values [B, next_n, H, D'], scales or None)``; ``weights``
    ``[B * next_n, H]``; ``context_lens`` int32 ``[B, next_n]``;
    ``block_tables`` int32 ``[B, W]``.  A varlen step has ``next_n == 1`` and
    its run ids tagged on ``schedule_metadata``."""
    tag = varlen_ids_of(schedule_metadata)
    if tag is None:
        return dsa_dg.fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables,
                                               schedule_metadata, max_model_len, clean_logits)
    rows = q[0].shape[0]
    if q[0].dim() != 4 or q[0].shape[1] != 1 or rows > tag.ids.shape[0]:
        raise RuntimeError(
            f"vllm-dsa-varlen: varlen decode expects queries [R, 1, H, D] with R <= "
            f"{tag.ids.shape[0]} run ids, got {tuple(q[0].shape)}")
    ids = tag.ids
    if ids.shape[0] != rows:  # stock feeds a single dummy row when a decode batch has no tokens
        ids = ids[:rows]
    if tag.backend == "deepgemm":
        logits = dsa_dg.fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens,
                                                 block_tables, schedule_metadata, max_model_len,
                                                 clean_logits, indices=ids)
    else:
        if context_lens.shape[0] != rows or block_tables.shape[0] != rows:
            context_lens, block_tables = first_rows(rows, context_lens, block_tables)
        logits = _own_logits(q, kv_cache, weights, context_lens, block_tables, ids,
                             max_model_len, clean_logits, tag.max_run_len, tag.schedules)
    # The decode top-k after it gets the step's max_seq_len from this tag (stock's
    # persistent_topk call passes the logits' width).
    return mark_bound(logits, tag.max_context)


class _TopkOps:
    """``torch.ops._C`` as the indexer op sees it: its two decode top-k ops
    (``(logits, seq_lens, topk_indices, workspace, k, max_seq_len)``) go
    through :func:`vllm_dsa_varlen.topk.dispatch`; the rest is ``_C``'s."""

    def __init__(self, ops):
        self._ops = ops

    def persistent_topk(self, logits, seq_lens, topk_indices, workspace, k, max_seq_len):
        # Stock passes the logits' width here (max_model_len), no bound on this step's rows;
        # a varlen step's logits carry its max_seq_len (varlen_ids.mark_bound).
        topk.dispatch(logits, seq_lens, topk_indices, k, lambda: self._ops._C.persistent_topk(
            logits, seq_lens, topk_indices, workspace, k, max_seq_len), bound=bound_of(logits))

    def cooperative_topk(self, logits, seq_lens, topk_indices, workspace, k, max_seq_len):
        topk.dispatch(logits, seq_lens, topk_indices, k, lambda: self._ops._C.cooperative_topk(
            logits, seq_lens, topk_indices, workspace, k, max_seq_len), bound=max_seq_len)

    def __getattr__(self, name):
        return getattr(self._ops._C, name)


class _Ops:
    def __init__(self, ops):
        self._C = _TopkOps(ops)
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)


class _Torch:
    """``torch`` for the indexer op's module: ``ops._C``'s decode top-k ops
    dispatched (:class:`_TopkOps`), every other attribute torch's."""

    def __init__(self, torch_module):
        self._torch = torch_module
        self.ops = _Ops(torch_module.ops)

    def __getattr__(self, name):
        return getattr(self._torch, name)


def torch_with_own_topk(original):
    """Factory: the module global ``torch`` of vLLM 0.27.1's indexer op
    module, replaced by :class:`_Torch` around the original."""
    return _Torch(original)
