"""Varlen decode for vLLM 0.27.1's ``DeepseekV32IndexerMetadataBuilder``.

The wrapped ``__init__`` decides the decode path once
(:func:`choose_decode_path`: DeepGEMM varlen on SM10x, else the project's
kernels, compared per step with stock's flattened or split path); a varlen
builder takes stock's flatten branch, which splits without the uniform rule
(variable decodes stay decodes) and applies DCP and DeepSeek V4's compression
to the rows in place.  ``_prepare_decode_tensors`` plans one row per token
and the run ids into stock's preallocated buffers (stable addresses for CUDA
graphs); ``build`` hands the ids to the decode metadata and, where the step
takes the varlen kernel, to the kernel call on a tagged view of the schedule;
the module's ``get_paged_mqa_logits_metadata`` gives DeepGEMM's scheduler the
ids.  ``get_cudagraph_support`` answers ``ALWAYS`` where every decode step
gets the varlen rows (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.mla import indexer as _ix

from vllm_dsa_varlen import config, policy, settings, stats, warmup
from vllm_dsa_varlen.config import DecodePath, LineFacts, log_decode_path
from vllm_dsa_varlen.patches import init_then
from vllm_dsa_varlen.plan import DecodeRowBuffers, make_ramp, plan_decode_rows
from vllm_dsa_varlen.vllm_0_27.utils import deep_gemm as dsa_dg
from vllm_dsa_varlen.varlen_ids import attach_varlen_ids, ids_hold, ids_written


# The builder whose build() is running on this thread (varlen builds only).
_building = threading.local()


@dataclass
class DeepSeekV32IndexerDecodeMetadata(_ix.DeepSeekV32IndexerDecodeMetadata):
    """Stock decode metadata plus ``indices``: int32 ``[R]`` run ids of the
    varlen layout (``None`` when the step's rows are stock's)."""

    indices: torch.Tensor | None = None


# --------------------------------------------------------------------------------------
# The decode-path decision (__init__, get_cudagraph_support)
# --------------------------------------------------------------------------------------

def line_facts(capability: tuple[int, int], *, deepgemm: dsa_dg.DeepGemmCaps | None,
               next_n: int) -> LineFacts:
    """What the 0.27 line adds to :func:`vllm_dsa_varlen.config.choose_decode_path`
    (pure): DeepGEMM varlen on SM10x with a DeepGEMM whose scheduler and kernel
    take run ids; else what stock runs for a multi-token step, which the
    project's kernels are compared with per step."""
    sm10x = capability[0] == config.SM100_MAJOR
    if not sm10x:
        refusal = f"DeepGEMM varlen needs SM10x (device is {config.fmt_cap(capability)})"
    elif deepgemm is None:
        refusal = "DeepGEMM is not installed"
    elif not deepgemm.varlen:
        refusal = ("the installed DeepGEMM's paged MQA logits take no `indices` "
                   "(vLLM 0.27.1's vendored 2.6.1 and 2.8.x do)")
    else:
        refusal = None
    if deepgemm is None:  # stock has no decode kernel: every step is the project's
        return LineFacts(refusal, "no DeepGEMM installed: stock has no decode kernel")
    if sm10x or next_n == 2:  # native [B, next_n] on uniform steps, prefill for the rest
        return LineFacts(refusal, "stock splits non-uniform steps to the prefill path",
                         per_step="split")
    return LineFacts(refusal, "stock flattens and re-reads the KV per token",
                     per_step="flattened")


def choose_decode_path(*, is_cuda: bool, capability: tuple[int, int] | None,
                       deepgemm: dsa_dg.DeepGemmCaps | None, own_ok: bool, next_n: int,
                       fp4_cache: bool, mode: str = "auto", backend: str = "auto") -> DecodePath:
    """A 0.27 builder's decode path (pure): the shared decision with this
    line's facts (:func:`line_facts`)."""
    return config.choose_decode_path(
        functools.partial(line_facts, deepgemm=deepgemm, next_n=next_n), is_cuda=is_cuda,
        capability=capability, own_ok=own_ok, next_n=next_n, fp4_cache=fp4_cache, mode=mode,
        backend=backend)


def _capability() -> tuple[int, int] | None:
    cap = current_platform.get_device_capability()
    if cap is None:
        return None
    return (int(cap[0]), int(cap[1]))


def _own_kernel_serves(vllm_config: Any, kv_cache_spec: Any) -> bool:
    """Whether the project's varlen kernel supports this cache and head count."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception:  # noqa: BLE001 - Triton missing or broken: no kernel of ours
        return False
    return HAS_TRITON and config.own_kernel_serves(
        page=_kernel_page(kv_cache_spec), head_size=getattr(kv_cache_spec, "head_size", None),
        heads=_index_heads(vllm_config))


def _kernel_page(kv_cache_spec: Any) -> int | None:
    """Indexer-cache entries per block, as the kernel sees them (DeepSeek V4's
    compressed cache: ``storage_block_size``)."""
    return getattr(kv_cache_spec, "storage_block_size", getattr(kv_cache_spec, "block_size", None))


def _index_heads(vllm_config: Any) -> int | None:
    """The model's indexer head count, when its config names one."""
    model_config = getattr(vllm_config, "model_config", None)
    heads = getattr(getattr(model_config, "hf_config", None), "index_n_heads", None)
    return heads if isinstance(heads, int) else None


def decide_decode_path_for(vllm_config: Any, kv_cache_spec: Any) -> DecodePath:
    """Gather the facts for :func:`choose_decode_path` from a vLLM config, the
    indexer's KV-cache spec, the settings and the platform (what the builder
    and its ``get_cudagraph_support`` classmethod both know)."""
    mode, backend = settings.get(settings.MODE_ENV), settings.get(settings.BACKEND_ENV)
    is_cuda = bool(current_platform.is_cuda())
    on = mode != "off" and is_cuda
    caps = dsa_dg.current_caps() if on and _ix.has_deep_gemm() else None
    spec = getattr(vllm_config, "speculative_config", None)
    next_n = 1 + (spec.num_speculative_tokens if spec else 0)
    return choose_decode_path(
        is_cuda=is_cuda,
        capability=_capability() if is_cuda else None,
        deepgemm=caps,
        own_ok=on and _own_kernel_serves(vllm_config, kv_cache_spec),
        next_n=next_n,
        fp4_cache=bool(vllm_config.attention_config.use_fp4_indexer_cache),
        mode=mode,
        backend=backend,
    )


def decide_decode_path(builder: Any) -> DecodePath:
    """:func:`decide_decode_path_for` of ``builder``'s config and cache spec."""
    return decide_decode_path_for(builder.vllm_config, builder.kv_cache_spec)


def every_step_varlen(path: DecodePath) -> bool:
    """Every decode step gets the varlen rows (the layout never switches)."""
    return path.use_varlen and path.per_step != "split"


def wrap_get_cudagraph_support(original: Callable[..., Any]) -> classmethod:
    """``get_cudagraph_support`` replacement (a classmethod): ``ALWAYS`` when
    :func:`every_step_varlen`, else stock's answer."""

    @functools.wraps(original)
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        if every_step_varlen(decide_decode_path_for(vllm_config, kv_cache_spec)):
            return AttentionCGSupport.ALWAYS
        return original(vllm_config, kv_cache_spec)

    return classmethod(get_cudagraph_support)


def _setup_varlen(builder: Any) -> None:
    path = decide_decode_path(builder)
    if path.use_varlen:
        # The varlen kernel a captured step runs: a fact of the builder, asked
        # once (the policy's kernel-gated rules read it; the log line names it).
        builder.varlen_graph_kernel = _graph_kernel(builder)
        if path.backend == "own":
            path = dataclasses.replace(path, kernel=builder.varlen_graph_kernel)
    builder.decode_path = path
    builder.use_varlen = path.use_varlen
    builder.varlen_backend = path.backend
    # Steps left to stock get padding requests' context lengths clamped at 0,
    # except when the plugin is switched off (then vLLM is exactly stock).
    builder.clamp_stock_padding = settings.get(settings.MODE_ENV) != "off"
    builder.stock_use_flattening = builder.use_flattening
    builder._varlen_step = False
    builder._varlen_step_ids = None
    builder._varlen_step_rows = 0
    builder._varlen_step_max_run = 1
    builder._varlen_final_ctx = None
    builder._varlen_common = None
    builder._varlen_step_lens = None
    builder._varlen_uniform_memo = None
    log_decode_path(path)
    if not path.use_varlen:
        return
    if path.per_step != "split":
        builder.use_flattening = True
    max_rows = builder.decode_seq_lens_buffer.shape[0]
    # Context lengths and block-table rows are planned straight into stock's
    # buffers (stock post-processes them in place); only the ids are new.
    builder.varlen_rows = DecodeRowBuffers(
        indices=torch.zeros(max_rows, dtype=torch.int32, device=builder.device),
        context_lens=builder.decode_seq_lens_buffer,
        block_table=builder.expanded_block_table_buffer,
        arange=builder.arange_buffer,
        ramp=make_ramp(builder.num_speculative_tokens + 1, builder.device),
    )
    builder.decode_indices_buffer = builder.varlen_rows.indices
    # What decode_indices_buffer holds, as (n, rows): ids[r] == r // n for r <
    # rows ((0, 0): unknown).  Only this module writes that buffer; every
    # write goes through ids_written.
    builder._varlen_ids_layout = (0, 0)
    # decode_lens of every varlen step: all ones, written here once and never
    # again (stock writes per-request lengths into its own decode_lens_buffer).
    builder.varlen_ones = torch.ones(max_rows, dtype=torch.int32, device=builder.device)
    if builder.decode_indices_buffer.data_ptr() % 8:
        raise RuntimeError("decode_indices_buffer: DeepGEMM needs an 8-byte aligned start")
    if path.backend == "own":
        # Every kernel variant a step can launch, compiled now (logged with the
        # time it took) so no decode step waits on a JIT compile.
        warmup.precompile_for(heads=_index_heads(builder.vllm_config),
                              head_size=builder.kv_cache_spec.head_size,
                              page=_kernel_page(builder.kv_cache_spec), device=builder.device,
                              max_run_len=builder.num_speculative_tokens + 1)


# ``__init__`` replacement: stock init, then _setup_varlen.
wrap_init = init_then(_setup_varlen)


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
    """Multi-token step: plan ``R = num_decode_tokens`` one-token rows into the
    builder's buffers.  A uniform step's ids (``r // n``) are rewritten only
    when the buffer does not already hold them (:func:`~vllm_dsa_varlen.varlen_ids.ids_hold`)."""
    uniform = (int(decode_lens_cpu.min()) == max_decode_len
               and num_decodes * max_decode_len == num_decode_tokens)
    if uniform:
        qsl = _decode_query_start_loc(builder, query_start_loc, decode_lens, num_decodes)
        ready = ids_hold(builder, max_decode_len, num_decode_tokens)
        with ids_written(builder, (max_decode_len, num_decode_tokens), skip=ready):
            rows = plan_decode_rows(seq_lens, qsl, block_table, num_rows=num_decode_tokens,
                                    uniform_len=max_decode_len, out=builder.varlen_rows,
                                    indices_ready=ready)
    else:
        qsl = _decode_query_start_loc(builder, query_start_loc, decode_lens, num_decodes)
        with ids_written(builder, None):
            rows = plan_decode_rows(seq_lens, qsl, block_table, num_rows=num_decode_tokens,
                                    num_tokens=int(decode_lens_cpu.sum()),
                                    out=builder.varlen_rows, decode_lens=decode_lens)
    one_token_each = builder.varlen_ones[: rows.num_rows]
    builder._varlen_step_ids = rows.indices
    builder._varlen_step_rows = rows.num_rows
    builder._varlen_step_max_run = max_decode_len
    return rows.context_lens, rows.block_table, one_token_each, rows.num_rows, False


def _plain_varlen_rows(builder: Any, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       decode_lens: torch.Tensor, decode_lens_cpu: torch.Tensor,
                       num_decodes: int, num_decode_tokens: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    """Plain step (every decode request has at most one token): ``R =
    num_decode_tokens`` rows, row ``r < B`` is request ``r``.

    Returns the *per-request* context lengths ``int32 [B]`` (a view of
    ``decode_seq_lens_buffer``, a request with no token seeing 0; entries
    ``B..R-1`` are zeroed) so stock's plain post-processing (DCP
    localisation, V4 division) applies to them as in 0.27.1;
    :func:`_final_context_lens` then takes the ``R``-row view.  Block-table
    rows ``int32 [R, W]`` (padding rows 0), ``decode_lens`` ``[R]`` of 1."""
    num_rows, num_reqs = num_decode_tokens, num_decodes
    num_real = int(decode_lens_cpu.sum())
    if num_real and int(decode_lens_cpu[:num_real].min()) != 1:
        raise RuntimeError(
            "vllm-dsa-varlen: plain decode step with a zero-token request before a real one "
            f"(decode_lens {decode_lens_cpu.tolist()}); graph padding comes last in vLLM 0.27.1")
    ctx = builder.decode_seq_lens_buffer
    per_request = ctx[:num_reqs]
    # decode_lens are 0 or 1 here: the product zeroes the requests with no token
    torch.mul(seq_lens, decode_lens[:num_reqs], out=per_request).clamp_(min=0)
    if num_rows > num_reqs:
        ctx[num_reqs:num_rows].zero_()
    width = block_table.shape[1]
    rows_bt = builder.expanded_block_table_buffer[:num_rows, :width]
    kept = min(num_reqs, num_rows)
    rows_bt[:kept].copy_(block_table[:kept])
    if kept < num_rows:
        rows_bt[kept:].zero_()
    ids = builder.decode_indices_buffer[:num_rows]
    # one run per row: ids[r] == r, i.e. the layout (1, R)
    ready = ids_hold(builder, 1, num_rows)
    with ids_written(builder, (1, num_rows), skip=ready):
        if not ready:
            ids.copy_(builder.arange_buffer[:num_rows])
    one_token_each = builder.varlen_ones[:num_rows]
    builder._varlen_step_ids = ids
    builder._varlen_step_rows = num_rows
    builder._varlen_step_max_run = 1
    return ctx[:num_reqs], rows_bt, one_token_each, num_rows, False


def _clamp_stock_padding(builder: Any, seq_lens: torch.Tensor) -> None:
    """Clamp stock's per-token context lengths at 0 in place (device op) when
    they live in the builder's buffer (graph-padding requests have ``seq_len
    == 0``, so stock's ``seq_len - n + j + 1`` goes negative)."""
    buf = builder.decode_seq_lens_buffer.untyped_storage()
    if seq_lens.numel() and seq_lens.untyped_storage().data_ptr() == buf.data_ptr():
        seq_lens.clamp_(min=0)


def wrap_prepare_decode_tensors(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_prepare_decode_tensors`` replacement (see the module docstring).

    Returns stock's tuple ``(seq_lens, block_table, decode_lens, batch_size,
    requires_padding)``; a varlen multi-token step: ``(int32 [R], int32 [R,
    W], int32 [R] of 1, R, False)``; a varlen plain step: ``(int32 [B]
    per-request lengths, int32 [R, W], int32 [R] of 1, R, False)``."""

    @functools.wraps(original)
    def _prepare_decode_tensors(self, seq_lens, block_table, decode_lens, decode_lens_cpu,
                                query_start_loc, num_decodes, num_decode_tokens, use_native,
                                next_n, max_decode_len):
        if not getattr(self, "_varlen_step", False):
            result = original(
                self, seq_lens=seq_lens, block_table=block_table, decode_lens=decode_lens,
                decode_lens_cpu=decode_lens_cpu, query_start_loc=query_start_loc,
                num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
                use_native=use_native, next_n=next_n, max_decode_len=max_decode_len)
            if use_native and next_n > 1 and getattr(self, "clamp_stock_padding", False):
                # only the native [B, next_n] lengths go negative (padding requests);
                # stock's flattened rows are >= 1 and padding rows 0
                _clamp_stock_padding(self, result[0])
            return result
        if max_decode_len <= 1:
            return _plain_varlen_rows(self, seq_lens, block_table, decode_lens, decode_lens_cpu,
                                      num_decodes, num_decode_tokens)
        return _plan_varlen_rows(self, seq_lens, block_table, decode_lens, decode_lens_cpu,
                                 query_start_loc, num_decodes, num_decode_tokens, max_decode_len)

    return _prepare_decode_tensors


# --------------------------------------------------------------------------------------
# build and the metadata hook
# --------------------------------------------------------------------------------------

def _final_context_lens(builder: Any, context_lens: torch.Tensor) -> torch.Tensor:
    """The step's per-row context lengths, int32 ``[R, 1]`` viewing
    ``decode_seq_lens_buffer[:R]``, from what stock's build produced.

    Multi-token steps already are that view.  Plain steps: stock kept the
    per-request lengths (``[B, 1]``, rows ``B..R-1`` zeroed by
    :func:`_plain_varlen_rows`), or -- DeepSeek V4 -- wrote ``R`` divided rows
    to ``expanded_seq_lens_buffer``, which are copied over so every varlen step
    hands the kernel the same buffer."""
    if builder._varlen_final_ctx is not None:
        return builder._varlen_final_ctx
    rows = builder._varlen_step_rows
    final = builder.decode_seq_lens_buffer[:rows]
    flat = context_lens.reshape(-1)
    if flat.data_ptr() != final.data_ptr():
        if flat.shape[0] != rows:
            raise RuntimeError(f"varlen build: {flat.shape[0]} context lengths for {rows} rows")
        final.copy_(flat)
    builder._varlen_final_ctx = final.unsqueeze(-1)
    return builder._varlen_final_ctx


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_size: int,
                                  num_sms: int) -> torch.Tensor:
    """Replacement for the indexer module's ``get_paged_mqa_logits_metadata``.

    ``context_lens``: int32 ``[B, next_n]``.  During a varlen build the
    scheduler sees the step's ``[R, 1]`` rows: with the step's run ids for
    the DeepGEMM backend; id-less (stock's flattened schedule) for the
    project's kernels compared per step with stock's flattened call; those
    kernels need no schedule (the buffer is left as it is).  Else: stock."""
    builder = getattr(_building, "builder", None)
    ids = None if builder is None else builder._varlen_step_ids
    if ids is None:
        return dsa_dg.get_paged_mqa_logits_metadata(context_lens, block_size, num_sms)
    rows = _final_context_lens(builder, context_lens)
    if ids.shape[0] != rows.shape[0]:
        raise RuntimeError(f"varlen build: {ids.shape[0]} run ids for "
                           f"{rows.shape[0]} decode rows")
    if builder.varlen_backend == "deepgemm":
        return dsa_dg.get_paged_mqa_logits_metadata(rows, block_size, num_sms, indices=ids)
    if builder.decode_path.per_step == "flattened":
        return dsa_dg.get_paged_mqa_logits_metadata(rows, block_size, num_sms)
    return builder.scheduler_metadata_buffer


def _decode_lens_cpu(common: Any, num_decodes: int) -> list[int]:
    """Host token counts of the first ``num_decodes`` requests (no device sync)."""
    # through numpy: less host time than torch slices and a subtraction
    return np.diff(common.query_start_loc_cpu.numpy()[: num_decodes + 1]).tolist()


def _step_decode_lens(builder: Any, common: Any, num_decodes: int) -> list[int]:
    """:func:`_decode_lens_cpu`, computed once per build: the result is kept
    on the builder for the build that is running (``build`` clears it when it
    starts and when it ends)."""
    memo = getattr(builder, "_varlen_step_lens", None)
    if memo is not None and memo[0] is common and memo[1] == num_decodes:
        return memo[2]
    lens = _decode_lens_cpu(common, num_decodes)
    builder._varlen_step_lens = (common, num_decodes, lens)
    return lens


def _uniform_unpadded(common: Any, num_decodes: int, num_decode_tokens: int,
                      builder: Any = None) -> bool:
    """Every request a decode of ``max_query_len`` tokens, no graph padding:
    :func:`vllm_dsa_varlen.policy.uniform_unpadded` (O(1), two host offsets).
    With ``builder``, the answer is kept for the build that is running (the
    step's facts, then its count ask the same; ``build`` clears it when it
    starts and when it ends, as vLLM's drafter rewrites ``common`` between
    builds)."""
    memo = getattr(builder, "_varlen_uniform_memo", None)
    key = (num_decodes, num_decode_tokens)
    if memo is not None and memo[0] is common and memo[1] == key:
        return memo[2]
    answer = policy.uniform_unpadded(common.num_reqs, common.max_query_len, num_decodes,
                                     num_decode_tokens, common.query_start_loc_cpu)
    if builder is not None:
        builder._varlen_uniform_memo = (common, key, answer)
    return answer


def step_facts(common: Any, num_decodes: int, num_decode_tokens: int,
               decode_lens: list[int] | None = None, builder: Any = None) -> policy.StepFacts:
    """:class:`vllm_dsa_varlen.policy.StepFacts` of a step's decode part, from
    host-known values only (``decode_lens``: the step's
    :func:`_decode_lens_cpu`, when the caller has them; ``builder``: the
    builder whose build is running, which keeps the uniformity answer).  O(1)
    on a uniform step without graph padding (the facts ``from_decode_lens``
    would find)."""
    max_context = max(0, int(common.max_seq_len))
    if _uniform_unpadded(common, num_decodes, num_decode_tokens, builder):
        return policy.StepFacts(rows=num_decode_tokens, requests=num_decodes,
                                max_run=common.max_query_len, uniform=True,
                                max_context=max_context, tokens=num_decode_tokens)
    if decode_lens is None:
        decode_lens = _decode_lens_cpu(common, num_decodes)
    return policy.StepFacts.from_decode_lens(decode_lens, rows=num_decode_tokens,
                                             max_context=max_context)


def _decode_splits(builder: Any, common: Any) -> tuple[tuple, tuple]:
    """Stock's decode/prefill split of a step (``require_uniform=True``, what
    stock does unless it flattens) and the split without that requirement."""
    split = _ix.split_decodes_and_prefills
    short_extends = not builder.use_pcp
    return tuple(split(common, decode_threshold=builder.decode_threshold, require_uniform=uniform,
                       treat_short_extends_as_decodes=short_extends)
                 for uniform in (True, False))


def _split_outcome(builder: Any, common: Any) -> str:
    """``per_step == "split"``: what this step does against stock's native path.

    A step stock would split (fewer decodes with ``require_uniform=True``) takes
    varlen when the policy says so.  Host values only.  Returns
    ``"stock_native"`` (stock would not split), ``"split_avoided"`` (varlen) or
    ``"stock_split"`` (left to stock)."""
    stock, ours = _decode_splits(builder, common)
    if ours[0] == stock[0]:
        return "stock_native"
    facts = step_facts(common, ours[0], ours[2], _step_decode_lens(builder, common, ours[0]),
                       builder)
    if policy.varlen_wins(facts, "split",
                          kernel=builder.varlen_graph_kernel):
        return "split_avoided"
    return "stock_split"


def _kernel_takes_varlen(builder: Any, common: Any, metadata: Any) -> bool:
    """Per step: whether the kernel call goes to the varlen kernel."""
    if builder.decode_path.per_step != "flattened":
        return True
    num_decodes, rows = metadata.num_decodes, metadata.num_decode_tokens
    kernel = builder.varlen_graph_kernel
    if _uniform_unpadded(common, num_decodes, rows, builder):
        # O(1) and kept per step shape where no rule reads contexts
        known = policy.uniform_step_wins(rows, common.max_query_len, "flattened", kernel)
        if known is not None:
            return known
        return policy.varlen_wins(step_facts(common, num_decodes, rows, None, builder),
                                  "flattened", kernel=kernel)
    facts = step_facts(common, num_decodes, rows, _step_decode_lens(builder, common, num_decodes))
    return policy.varlen_wins(facts, "flattened", kernel=kernel)


def _record_step(builder: Any, common: Any, metadata: Any, path: str | None) -> None:
    """Count a build that has decode requests (:mod:`vllm_dsa_varlen.stats`).

    ``path`` ``None``: stock's own path of a builder the plugin leaves stock
    (flattened, split, or native).  A stock call on one row per token is
    "flattened" only where requests carry several tokens (a plain step's rows
    are stock's native ones); graph-padding requests (no tokens) do not make a
    step variable.  O(1) on a uniform step without graph padding, else the
    requests' lengths are read."""
    num_decodes = getattr(metadata, "num_decodes", 0)
    if not num_decodes:
        return
    if common.max_query_len <= 1:
        lens = [1]  # one token per request: not variable (padding requests are not requests)
    elif _uniform_unpadded(common, num_decodes, metadata.num_decode_tokens, builder):
        lens = [common.max_query_len]  # (O(1): the requests' lengths, all equal)
    else:
        lens = [n for n in _step_decode_lens(builder, common, num_decodes) if n > 0] or [0]
    if path is None:
        if getattr(builder, "use_flattening", False):
            path = "stock_flattened"
        elif common.num_reqs > num_decodes and num_decodes > 0:
            # stock's decodes are a uniform prefix: a split shows as requests it
            # left out that a split without the uniform rule would keep
            stock, ours = _decode_splits(builder, common)
            path = "stock_split" if ours[0] != stock[0] else "stock_native"
        else:
            path = "stock_native"
    if path == "stock_flattened" and max(lens) <= 1:
        path = "stock_native"
    stats.record(path, variable=min(lens) != max(lens),
                 mixed=getattr(metadata, "num_prefills", 0) > 0)


def _graph_kernel(builder: Any) -> str:
    """The varlen kernel a captured decode step of this builder runs (the GPU,
    index heads and cache geometry decide; see ``launcher.graph_kernel``): the
    policy's rules measured with one kernel apply only when it runs."""
    from vllm_dsa_varlen.ops import launcher

    spec = builder.kv_cache_spec
    return launcher.graph_kernel(builder.device, _index_heads(builder.vllm_config),
                                 spec.head_size - 4, _kernel_page(spec))


def _hand_over_ids(builder: Any, metadata: Any, common: Any) -> None:
    """Give the step's decode metadata its rows, ids and (when the varlen
    kernel is chosen) a tagged schedule view.  Returns the step's path
    (``"varlen"`` or ``"stock_flattened"``; ``None`` without decodes)."""
    ids, builder._varlen_step_ids = builder._varlen_step_ids, None
    decode = metadata.decode
    if decode is None or ids is None:
        return None
    decode.seq_lens = _final_context_lens(builder, decode.seq_lens)
    if ids.shape[0] != decode.seq_lens.shape[0]:
        raise RuntimeError(f"varlen build: {ids.shape[0]} run ids for "
                           f"{decode.seq_lens.shape[0]} decode rows")
    decode.indices = ids
    if not _kernel_takes_varlen(builder, common, metadata):
        return "stock_flattened"
    decode.schedule_metadata = attach_varlen_ids(builder.scheduler_metadata_buffer, ids,
                                                 builder.varlen_backend,
                                                 max(1, builder._varlen_step_max_run),
                                                 _topk_bound(builder, common))
    return "varlen"


def _topk_bound(builder: Any, common: Any) -> int | None:
    """The step's longest row as the decode top-k sees it, from the host's
    ``max_seq_len`` (DeepSeek V4's ``compress_ratio`` applied as stock applies
    it), or ``None`` under decode context parallelism (local rows: the
    global length bounds them too loosely to size anything)."""
    if getattr(builder, "dcp_world_size", 1) > 1:
        return None
    return max(1, int(common.max_seq_len) // max(1, int(getattr(builder, "compress_ratio", 1))))


def _stock_only_step(builder: Any, common: Any) -> bool:
    """``per_step == "flattened"``: whether the step is left to stock's own
    build (no varlen rows, no ids, no per-step comparison).

    True for an all-decode step of several tokens per request (``1 <
    max_query_len <= next_n``, no PCP) whose *padded* token count
    (``num_actual_tokens``, the token count a FULL decode graph is keyed on
    and captured with; vLLM 0.27.1 passes the padded count there:
    ``v1/worker/gpu_model_runner.py`` builds with ``num_tokens_padded`` when
    ``pad_attn``, i.e. the runtime mode is FULL) is below
    :func:`vllm_dsa_varlen.policy.min_varlen_rows`: no rule can send such a
    step to varlen, at capture or at any replay of the graph of the same
    count, so the captured kernel is stock's flattened DeepGEMM call either
    way.  Stock's build then writes the rows of that call into the same
    buffers the plugin's rows use (``decode_seq_lens_buffer``,
    ``expanded_block_table_buffer``, ``scheduler_metadata_buffer``), one row
    per padded token (``num_reqs * max_query_len >= num_actual_tokens``: stock's
    uniform branch covers every token), padding rows with context 0.  Host
    ints only."""
    if builder.decode_path.per_step != "flattened" or builder.use_pcp:
        return False
    tokens, longest = common.num_actual_tokens, common.max_query_len
    if not 1 <= longest <= builder.decode_threshold or common.num_reqs * longest < tokens:
        return False
    if longest == 1:
        # Plain step: stock's rows are views of the step's own tensors, not the
        # builder's buffers, so it is left to stock only where no FULL graph
        # replays a batch of another shape for the same token count.
        return (not _full_graphs_replay_mixed_batches(builder)
                and policy.min_varlen_rows("flattened", kernel=builder.varlen_graph_kernel,
                                           max_run=1) is None)
    bound = policy.min_varlen_rows("flattened", kernel=builder.varlen_graph_kernel,
                                   max_run=builder.decode_threshold)
    return bound is None or tokens < bound


def _full_graphs_replay_mixed_batches(builder: Any) -> bool:
    """Whether a FULL CUDA graph may be replayed for a batch that is not a
    uniform ``next_n``-token decode (cudagraph mode ``FULL``; unknown: assumed).
    Under ``FULL_AND_PIECEWISE``, ``FULL_DECODE_ONLY``, ``PIECEWISE`` and
    ``NONE`` vLLM 0.27.1 captures and replays FULL graphs for uniform decode
    batches only (every request ``1 + num_speculative_tokens`` tokens), and the
    MTP drafter runs PIECEWISE graphs, outside which the indexer op runs."""
    mode = getattr(getattr(builder.vllm_config, "compilation_config", None),
                   "cudagraph_mode", None)
    memo = getattr(builder, "_varlen_mixed_full", None)
    if memo is not None and memo[0] is mode:  # asked on every build: the mode's answer kept
        return memo[1]
    answer = mode is None or mode.mixed_mode() == CUDAGraphMode.FULL
    builder._varlen_mixed_full = (mode, answer)
    return answer


def wrap_build(original: Callable[..., Any]) -> Callable[..., Any]:
    """``build`` replacement: decide the step, stock build inside a
    varlen-build mark, then :func:`_hand_over_ids`.  Not varlen: stock, untouched.
    Every build with decode requests counts its path (:mod:`vllm_dsa_varlen.stats`)."""

    @functools.wraps(original)
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self._varlen_step_lens = self._varlen_uniform_memo = None
        try:
            return _build(self, common_prefix_len, common_attn_metadata, fast_build)
        finally:
            self._varlen_step_lens = self._varlen_uniform_memo = None

    def _build(self, common_prefix_len, common_attn_metadata, fast_build):
        path = getattr(self, "decode_path", None)
        if path is None or not path.use_varlen:
            metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
            _record_step(self, common_attn_metadata, metadata, None)
            return metadata
        if _stock_only_step(self, common_attn_metadata):
            metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
            # stock's flattened call (native where every request has one token)
            _record_step(self, common_attn_metadata, metadata, "stock_flattened")
            return metadata
        split_mode = path.per_step == "split"
        outcome = _split_outcome(self, common_attn_metadata) if split_mode else None
        if split_mode and outcome != "split_avoided":
            metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
            _record_step(self, common_attn_metadata, metadata, outcome)
            return metadata
        self._varlen_step = True
        self._varlen_step_ids = None
        self._varlen_final_ctx = None
        self._varlen_common = common_attn_metadata
        if split_mode:
            self.use_flattening = True
        outer = getattr(_building, "builder", None)
        _building.builder = self
        try:
            metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
            taken = _hand_over_ids(self, metadata, common_attn_metadata)
            if taken is not None:
                _record_step(self, common_attn_metadata, metadata, outcome or taken)
        finally:
            _building.builder = outer
            self._varlen_step = False
            self._varlen_step_ids = None
            self._varlen_final_ctx = None
            self._varlen_common = None
            if split_mode:
                self.use_flattening = self.stock_use_flattening
        return metadata

    return build
