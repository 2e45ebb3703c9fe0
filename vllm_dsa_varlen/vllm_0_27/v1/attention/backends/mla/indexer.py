"""Varlen decode for vLLM 0.27.1's ``DeepseekV32IndexerMetadataBuilder``.

Replaces, in ``vllm.v1.attention.backends.mla.indexer`` (see
:mod:`vllm_dsa_varlen.patches`):

* ``DeepseekV32IndexerMetadataBuilder.__init__`` (wrapped): after stock's
  init, decide the decode path once (:func:`vllm_dsa_varlen.config.choose_decode_path`)
  and log it.  When varlen: ``use_flattening = True`` -- stock ``build`` then
  splits with ``require_uniform=False`` (variable-length decodes stay decodes)
  and takes its flatten branch, in which it treats the per-row context lengths
  as a view of ``decode_seq_lens_buffer`` and applies DCP localisation and
  DeepSeek V4's ``//= compress_ratio`` to it *in place*, exactly as 0.27.1
  does -- and allocate the run-id buffer (int32, 8-byte aligned).
* ``DeepseekV32IndexerMetadataBuilder._prepare_decode_tensors`` (wrapped):
  varlen multi-token steps are planned by :func:`vllm_dsa_varlen.plan.plan_decode_rows`
  straight into stock's buffers (``decode_seq_lens_buffer``,
  ``expanded_block_table_buffer``): rows ``R = num_decode_tokens``, one token
  each (``decode_lens`` all 1, ``requires_padding`` False), so the indexer op
  reshapes decode queries to ``[R, 1, H, D]``.  Plain decode steps keep stock's
  result with ids ``arange(B)``.  Not varlen: stock, untouched.
* ``DeepseekV32IndexerMetadataBuilder.build`` (wrapped): marks the build (a
  thread-local) for the metadata hook below, and after stock's build hands the
  ids to the decode metadata (``indices``) and to the kernel call (a fresh view
  of ``scheduler_metadata_buffer`` tagged by :mod:`vllm_dsa_varlen.varlen_ids`).
* module global ``get_paged_mqa_logits_metadata``: during a varlen build,
  DeepGEMM's scheduler gets the step's ``indices``; the Triton backend needs no
  schedule (the buffer is left as it is).  Otherwise: stock's call.
* module global ``DeepSeekV32IndexerDecodeMetadata``: a subclass adding
  ``indices: int32 [R] | None``.

All buffers are preallocated, so addresses are stable across steps (CUDA
graphs capture the kernel call with the same id/length/block-table views that
later builds rewrite in place).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backends.mla import indexer as _ix

from vllm_dsa_varlen.config import DecodePath, choose_decode_path, read_backend, read_mode
from vllm_dsa_varlen.plan import DecodeRowBuffers, plan_decode_rows
from vllm_dsa_varlen.vllm_0_27.utils import deep_gemm as dsa_dg
from vllm_dsa_varlen.varlen_ids import attach_varlen_ids

logger = logging.getLogger("vllm.dsa_varlen")
_logged: set[str] = set()

# The builder whose build() is running on this thread (varlen builds only).
_building = threading.local()


@dataclass
class DeepSeekV32IndexerDecodeMetadata(_ix.DeepSeekV32IndexerDecodeMetadata):
    """Stock decode metadata plus ``indices``: int32 ``[R]`` run ids of the
    varlen layout (``None`` when the step is not varlen)."""

    indices: torch.Tensor | None = None


# --------------------------------------------------------------------------------------
# __init__
# --------------------------------------------------------------------------------------

def _capability() -> tuple[int, int] | None:
    cap = current_platform.get_device_capability()
    if cap is None:
        return None
    return (int(cap[0]), int(cap[1]))


def _triton_serves(builder: Any) -> bool:
    """Whether the Triton varlen kernel supports this builder's cache."""
    try:
        from vllm.triton_utils import HAS_TRITON

        from vllm_dsa_varlen.ops import triton_paged_mqa_logits as tk
    except Exception:  # noqa: BLE001 - Triton missing or broken: no Triton path
        return False
    if not HAS_TRITON:
        return False
    spec = builder.kv_cache_spec
    page = getattr(spec, "storage_block_size", getattr(spec, "block_size", None))
    head_size = getattr(spec, "head_size", None)
    if page not in tk.SUPPORTED_PAGES or head_size is None or head_size - 4 not in tk.SUPPORTED_DIMS:
        return False
    model_config = getattr(builder.vllm_config, "model_config", None)
    heads = getattr(getattr(model_config, "hf_config", None), "index_n_heads", None)
    return not isinstance(heads, int) or heads in tk.SUPPORTED_HEADS


def decide_decode_path(builder: Any) -> DecodePath:
    """Gather the facts for :func:`choose_decode_path` from ``builder`` and the platform."""
    mode, backend = read_mode(), read_backend()
    is_cuda = bool(current_platform.is_cuda())
    on = mode != "off" and is_cuda
    caps = dsa_dg.current_caps() if on and _ix.has_deep_gemm() else None
    return choose_decode_path(
        is_cuda=is_cuda,
        capability=_capability() if is_cuda else None,
        deepgemm=caps,
        triton_ok=on and _triton_serves(builder),
        next_n=builder.num_speculative_tokens + 1,
        fp4_cache=bool(builder.use_fp4_indexer_cache),
        mode=mode,
        backend=backend,
    )


def _log_path(path: DecodePath) -> None:
    msg = f"vllm-dsa-varlen: DSA indexer decode path: {path.describe()}"
    if msg not in _logged:
        _logged.add(msg)
        logger.log(logging.WARNING if path.warning else logging.INFO, msg)


def _setup_varlen(builder: Any) -> None:
    path = decide_decode_path(builder)
    builder.decode_path = path
    builder.use_varlen = path.use_varlen
    builder.varlen_backend = path.backend
    builder._varlen_step_ids = None
    builder._varlen_step_max_run = 1
    builder._varlen_common = None
    _log_path(path)
    if not path.use_varlen:
        return
    builder.use_flattening = True
    max_rows = builder.decode_seq_lens_buffer.shape[0]
    # Context lengths and block-table rows are planned straight into stock's
    # buffers (stock post-processes them in place); only the ids are new.
    builder.varlen_rows = DecodeRowBuffers(
        indices=torch.zeros(max_rows, dtype=torch.int32, device=builder.device),
        context_lens=builder.decode_seq_lens_buffer,
        block_table=builder.expanded_block_table_buffer,
        arange=builder.arange_buffer,
    )
    builder.decode_indices_buffer = builder.varlen_rows.indices
    if builder.decode_indices_buffer.data_ptr() % 8:
        raise RuntimeError("decode_indices_buffer: DeepGEMM needs an 8-byte aligned start")


def wrap_init(original: Callable[..., None]) -> Callable[..., None]:
    """``__init__`` replacement: stock init, then :func:`_setup_varlen`."""

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _setup_varlen(self)

    return __init__


# --------------------------------------------------------------------------------------
# _prepare_decode_tensors
# --------------------------------------------------------------------------------------

def _decode_query_start_loc(builder: Any, query_start_loc: torch.Tensor, decode_lens: torch.Tensor,
                            num_decodes: int) -> torch.Tensor:
    """``[B + 1]`` query offsets of the decodes (stock passes only the first ``B``)."""
    common = builder._varlen_common
    if common is not None:
        return common.query_start_loc[: num_decodes + 1]
    return torch.cat([query_start_loc[:num_decodes],
                      query_start_loc[num_decodes - 1:num_decodes] + decode_lens[num_decodes - 1:]])


def _plan_varlen_rows(builder: Any, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      decode_lens: torch.Tensor, decode_lens_cpu: torch.Tensor,
                      query_start_loc: torch.Tensor, num_decodes: int, num_decode_tokens: int,
                      max_decode_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    """Plan ``R = num_decode_tokens`` one-token rows into the builder's buffers."""
    qsl = _decode_query_start_loc(builder, query_start_loc, decode_lens, num_decodes)
    uniform = (int(decode_lens_cpu.min()) == max_decode_len
               and num_decodes * max_decode_len == num_decode_tokens)
    if uniform:
        rows = plan_decode_rows(seq_lens, qsl, block_table, num_rows=num_decode_tokens,
                                uniform_len=max_decode_len, out=builder.varlen_rows)
    else:
        rows = plan_decode_rows(seq_lens, qsl, block_table, num_rows=num_decode_tokens,
                                num_tokens=int(decode_lens_cpu.sum()), out=builder.varlen_rows)
    one_token_each = builder.decode_lens_buffer[: rows.num_rows]
    one_token_each.fill_(1)
    builder._varlen_step_ids = rows.indices
    builder._varlen_step_max_run = max_decode_len
    return rows.context_lens, rows.block_table, one_token_each, rows.num_rows, False


def wrap_prepare_decode_tensors(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_prepare_decode_tensors`` replacement (see the module docstring).

    Returns stock's tuple ``(seq_lens, block_table, decode_lens, batch_size,
    requires_padding)``; varlen multi-token: ``(int32 [R], int32 [R, W],
    int32 [R] of 1, R, False)``."""

    @functools.wraps(original)
    def _prepare_decode_tensors(self, seq_lens, block_table, decode_lens, decode_lens_cpu,
                                query_start_loc, num_decodes, num_decode_tokens, use_native,
                                next_n, max_decode_len):
        if not getattr(self, "use_varlen", False) or max_decode_len <= 1:
            result = original(
                self, seq_lens=seq_lens, block_table=block_table, decode_lens=decode_lens,
                decode_lens_cpu=decode_lens_cpu, query_start_loc=query_start_loc,
                num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
                use_native=use_native, next_n=next_n, max_decode_len=max_decode_len)
            if getattr(self, "use_varlen", False):
                # Plain decode: one row per request, each its own run.
                self._varlen_step_ids = self.varlen_rows.arange[: result[3]]
                self._varlen_step_max_run = 1
            return result
        return _plan_varlen_rows(self, seq_lens, block_table, decode_lens, decode_lens_cpu,
                                 query_start_loc, num_decodes, num_decode_tokens, max_decode_len)

    return _prepare_decode_tensors


# --------------------------------------------------------------------------------------
# build and the metadata hook
# --------------------------------------------------------------------------------------

def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_size: int,
                                  num_sms: int) -> torch.Tensor:
    """Replacement for the indexer module's ``get_paged_mqa_logits_metadata``.

    ``context_lens``: int32 ``[B, next_n]``.  During a varlen build the
    DeepGEMM backend's scheduler gets the step's run ids; the Triton backend
    keeps the buffer as it is (its kernel needs no schedule).  Else: stock."""
    builder = getattr(_building, "builder", None)
    ids = None if builder is None else builder._varlen_step_ids
    if ids is None:
        return dsa_dg.get_paged_mqa_logits_metadata(context_lens, block_size, num_sms)
    if ids.shape[0] != context_lens.shape[0]:
        raise RuntimeError(f"varlen build: {ids.shape[0]} run ids for "
                           f"{context_lens.shape[0]} decode rows")
    if builder.varlen_backend == "deepgemm":
        return dsa_dg.get_paged_mqa_logits_metadata(context_lens, block_size, num_sms,
                                                    indices=ids)
    return builder.scheduler_metadata_buffer


def _hand_over_ids(builder: Any, metadata: Any) -> None:
    """Give the step's decode metadata its ids and a tagged schedule view."""
    ids, builder._varlen_step_ids = builder._varlen_step_ids, None
    decode = metadata.decode
    if decode is None or ids is None:
        return
    if ids.shape[0] != decode.seq_lens.shape[0]:
        raise RuntimeError(f"varlen build: {ids.shape[0]} run ids for "
                           f"{decode.seq_lens.shape[0]} decode rows")
    decode.schedule_metadata = attach_varlen_ids(builder.scheduler_metadata_buffer, ids,
                                                 builder.varlen_backend,
                                                 max(1, builder._varlen_step_max_run))
    decode.indices = ids


def wrap_build(original: Callable[..., Any]) -> Callable[..., Any]:
    """``build`` replacement: stock build inside a varlen-build mark, then
    :func:`_hand_over_ids`.  Not varlen: stock, untouched."""

    @functools.wraps(original)
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        if not getattr(self, "use_varlen", False):
            return original(self, common_prefix_len, common_attn_metadata, fast_build)
        self._varlen_step_ids = None
        self._varlen_common = common_attn_metadata
        outer = getattr(_building, "builder", None)
        _building.builder = self
        try:
            metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
        finally:
            _building.builder = outer
            self._varlen_common = None
        _hand_over_ids(self, metadata)
        return metadata

    return build
