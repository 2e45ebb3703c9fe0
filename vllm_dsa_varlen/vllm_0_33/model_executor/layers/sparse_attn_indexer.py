"""Varlen kernel dispatch inside vLLM 0.33's and 0.34's sparse-attention indexer op.

The registered op looks its module globals up per call, so wrapping
``fp8_fp4_paged_mqa_logits`` (and GLM-5-Next's copy of the op) routes its
decode call: after a varlen build the call's arguments already are the
varlen layout (queries ``[R, 1, H, D]``, lengths ``[R, 1]``), and a schedule
tagged with run ids (:mod:`vllm_dsa_varlen.varlen_ids`) goes to the
project's kernel (FP8 cache only); an untagged call is stock's, ``indices``
passed through, so upstream's own SM100 varlen is untouched.  Wrapping
``get_indexer_topk`` puts the project's decode top-k first in line
(:mod:`vllm_dsa_varlen.topk`).  DeepSeek V4.1's latency-specialised decode
needs the MXFP4 cache, which no varlen step of the project's kernels serves.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any, Callable

import torch

from vllm_dsa_varlen import topk
from vllm_dsa_varlen.varlen_ids import first_rows, varlen_ids_of


@functools.cache
def _launcher():
    """:mod:`vllm_dsa_varlen.ops.launcher`, imported on the first varlen call
    (it loads Triton); its entry point is read per call (a module attribute)."""
    from vllm_dsa_varlen.ops import launcher

    return launcher


def own_logits(q: tuple[torch.Tensor, torch.Tensor | None], kv_cache: torch.Tensor,
               weights: torch.Tensor, context_lens: torch.Tensor,
               block_tables: torch.Tensor, ids: torch.Tensor, max_model_len: int,
               max_run_len: int, schedules: dict | None = None) -> torch.Tensor:
    """The project's varlen kernel (``ops.launcher``) on the indexer op's arguments, float32
    ``[R, max_model_len]``.  ``q``: ``(fp8 [R, 1, H, D], None)``;
    ``schedules``: the step's tag's schedule cache (planned by the first layer)."""
    q_values, q_scale = q
    if q_scale is not None or q_values.dtype != torch.float8_e4m3fn:
        raise RuntimeError(
            "vllm-dsa-varlen: the project's varlen backend serves the FP8 indexer cache only; "
            f"this step has {'MXFP4 (scaled) ' if q_scale is not None else ''}queries of "
            f"dtype {q_values.dtype}")
    return _launcher().varlen_paged_mqa_logits(q_values, kv_cache, weights, context_lens,
                                               block_tables, ids, max_model_len,
                                               max_run_len=max_run_len, schedule_cache=schedules)


_logged_dtypes: set[torch.dtype] = set()


def _fp32_for(logits_dtype: torch.dtype) -> None:
    """Log once per dtype that varlen steps write float32 logits where vLLM
    0.34's ``indexer_logits_dtype`` asked for another dtype: bf16 logits lose
    the top-k's boundary to ties (BENCHMARKS.md, "bf16 indexer logits")."""
    if logits_dtype == torch.float32 or logits_dtype in _logged_dtypes:
        return
    _logged_dtypes.add(logits_dtype)
    logging.getLogger("vllm.dsa_varlen").info(
        "vllm-dsa-varlen: indexer logits dtype %s asked: the project's varlen kernel writes "
        "float32 logits for the steps it runs (rounded to %s they keep under 99.9 %% of a row's "
        "top-k set); vLLM's top-k reads them as they are, stock's steps keep %s",
        logits_dtype, logits_dtype, logits_dtype)


def _route(original: Callable[..., Any], q, kv_cache, weights, context_lens, block_tables,
           schedule_metadata, max_model_len, indices, dtype_kwargs: dict) -> torch.Tensor:
    """A decode logits call: the project's varlen kernel for a step whose schedule
    carries run ids, else ``original`` with the arguments as given."""
    tag = varlen_ids_of(schedule_metadata)
    if tag is None:
        return original(q, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                        max_model_len=max_model_len, indices=indices, **dtype_kwargs)
    rows = q[0].shape[0]
    if q[0].dim() != 4 or q[0].shape[1] != 1 or rows > tag.ids.shape[0]:
        raise RuntimeError(
            f"vllm-dsa-varlen: varlen decode expects queries [R, 1, H, D] with R <= "
            f"{tag.ids.shape[0]} run ids, got {tuple(q[0].shape)}")
    if indices is not None and indices.data_ptr() != tag.ids.data_ptr():
        raise RuntimeError("vllm-dsa-varlen: the decode metadata's indices are not the "
                           "run ids its schedule carries")
    _fp32_for(dtype_kwargs.get("logits_dtype", torch.float32))
    ids = tag.ids
    if ids.shape[0] != rows or context_lens.shape[0] != rows or block_tables.shape[0] != rows:
        # Stock feeds a single dummy row when a decode batch has no tokens.
        ids, context_lens, block_tables = first_rows(rows, ids, context_lens, block_tables)
    return own_logits(q, kv_cache, weights, context_lens, block_tables, ids,
                      max_model_len, tag.max_run_len, tag.schedules)


def wrap_paged_mqa_logits(original: Callable[..., Any]) -> Callable[..., Any]:
    """Factory: the dispatching replacement of the op module's
    ``fp8_fp4_paged_mqa_logits`` around stock's ``original``, with its
    parameters: vLLM 0.34 added ``logits_dtype`` before ``indices``."""
    if "logits_dtype" in inspect.signature(original).parameters:
        @functools.wraps(original)
        def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables,
                                     schedule_metadata, max_model_len,
                                     logits_dtype=torch.float32, indices=None):
            """Paged MQA logits for the indexer's decode step (see the module
            docstring); ``logits_dtype``: what stock's kernel writes."""
            return _route(original, q, kv_cache, weights, context_lens, block_tables,
                          schedule_metadata, max_model_len, indices,
                          {"logits_dtype": logits_dtype})
    else:
        @functools.wraps(original)
        def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables,
                                     schedule_metadata, max_model_len, indices=None):
            """Paged MQA logits for the indexer's decode step (see the module
            docstring).  ``q``: ``(values [B, next_n, H, D], scales or None)``;
            ``context_lens`` int32 ``[B, next_n]``; a varlen step has ``next_n ==
            1`` and its run ids tagged on ``schedule_metadata``."""
            return _route(original, q, kv_cache, weights, context_lens, block_tables,
                          schedule_metadata, max_model_len, indices, {})

    return fp8_fp4_paged_mqa_logits


class _DecodeTopk:
    """vLLM's decode top-k module for one backend, called as the indexer op
    calls it, with the project's top-k first in line (:func:`vllm_dsa_varlen.topk.dispatch`).
    ``cooperative_rows``: up to how many rows stock's ``auto`` chain takes
    ``cooperative_topk``, read from the stock module's own module
    (``AUTO_COOPERATIVE_MAX_ROWS``, 64 in 0.33.0; 32 where it has none)."""

    def __init__(self, stock: Callable[..., Any]):
        self.stock = stock
        home = sys.modules.get(type(stock).__module__)
        limit = getattr(home, "AUTO_COOPERATIVE_MAX_ROWS", None)
        self.cooperative_rows = (limit if isinstance(limit, int) and not isinstance(limit, bool)
                                 else topk.COOPERATIVE_ROWS)

    def __call__(self, logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len):
        topk.dispatch(logits, seq_lens, topk_indices, topk_tokens,
                      lambda: self.stock(logits, seq_lens, next_n, topk_indices, topk_tokens,
                                         max_seq_len), bound=max_seq_len,
                      cooperative_rows=self.cooperative_rows)

    def __getattr__(self, name: str) -> Any:  # resolve_backend, ... of stock's module
        return getattr(self.stock, name)


def wrap_get_indexer_topk(original: Callable[[str], Any]) -> Callable[[str], Any]:
    """Factory: the op module's ``get_indexer_topk(backend)`` (stock caches
    one top-k module per backend) around stock's ``original``: the configured
    ``auto`` backend gets the project's top-k where it serves
    (:mod:`vllm_dsa_varlen.topk`); a backend the user named is stock's."""
    cache: dict[str, Any] = {}

    @functools.wraps(original)
    def get_indexer_topk(backend: str):
        got = cache.get(backend)
        if got is None:
            stock = original(backend)
            got = cache[backend] = _DecodeTopk(stock) if backend == "auto" else stock
        return got

    return get_indexer_topk
