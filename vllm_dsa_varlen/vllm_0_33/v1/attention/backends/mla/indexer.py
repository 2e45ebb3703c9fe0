"""Varlen decode for vLLM 0.33's and 0.34's ``DeepseekV32IndexerMetadataBuilder``.

Stock leaves SM100 with DeepGEMM varlen already (left alone here); elsewhere
it flattens every step to one row per token without run ids, or runs
DeepGEMM's native ``[B, next_n]`` kernel and splits non-uniform steps to the
prefill path.  The wrapped ``__init__`` decides once whether the project's
varlen kernel serves the builder (:func:`choose_decode_path`); the wrapped
``build`` classifies each step from host-known facts (:func:`classify_step`,
:func:`vllm_dsa_varlen.policy.varlen_wins`) and, for a varlen step, runs
stock's flatten branch with the rows and run ids planned into stock's own
buffers (``_prepare_decode_tensors``), the ids handed to the kernel call on a
tagged view of the schedule.  Decisions a CUDA graph replays use only facts
its key fixes; nothing here reads device memory (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from vllm.config import CUDAGraphMode
from vllm.platforms import current_platform
from vllm.v1.attention.backends.mla import indexer as _ix

from vllm_dsa_varlen import config, policy, settings, stats, warmup
from vllm_dsa_varlen.config import DecodePath, LineFacts, log_decode_path
from vllm_dsa_varlen.patches import init_then
from vllm_dsa_varlen.plan import DecodeRowBuffers, plan_decode_rows
from vllm_dsa_varlen.policy import StepFacts, uniform_unpadded, varlen_wins
from vllm_dsa_varlen.varlen_ids import attach_varlen_ids, ids_hold, ids_written, varlen_ids_of


# --------------------------------------------------------------------------------------
# The builder-level decision (pure)
# --------------------------------------------------------------------------------------

def line_facts(capability: tuple[int, int], *, upstream_varlen: bool, flattening: bool,
               next_n: int) -> LineFacts:
    """What the 0.33 line adds to :func:`vllm_dsa_varlen.config.choose_decode_path`
    (pure): vLLM's own varlen (SM100 with DeepGEMM) is left alone, and the
    project's kernels are compared per step with what stock runs for the step,
    also under a forced backend.  ``flattening``: stock flattens every step."""
    cap = config.fmt_cap(capability)
    deepgemm = (f"vLLM 0.33 drives DeepGEMM varlen itself, on SM100 with DeepGEMM only "
                f"(device is {cap})")
    if upstream_varlen:
        return LineFacts(deepgemm, "", upstream=(
            f"upstream varlen: vLLM 0.33 runs DeepGEMM's varlen kernel itself on {cap} "
            "(run ids built on the device); left as is"))
    stock = ("stock flattens every step (one row per token, KV re-read per token)"
             if flattening else
             f"stock runs DeepGEMM's native [B, {next_n}] kernel on uniform steps and splits "
             "non-uniform ones to the prefill path")
    return LineFacts(deepgemm, stock, per_step="each", forced_per_step="each")


def choose_decode_path(*, is_cuda: bool, capability: tuple[int, int] | None,
                       upstream_varlen: bool, own_ok: bool, next_n: int, fp4_cache: bool,
                       flattening: bool, mode: str = "auto", backend: str = "auto") -> DecodePath:
    """A 0.33 builder's decode path (pure): the shared decision with this
    line's facts (:func:`line_facts`)."""
    return config.choose_decode_path(
        functools.partial(line_facts, upstream_varlen=upstream_varlen, flattening=flattening,
                          next_n=next_n),
        is_cuda=is_cuda, capability=capability, own_ok=own_ok, next_n=next_n,
        fp4_cache=fp4_cache, mode=mode, backend=backend)


# --------------------------------------------------------------------------------------
# __init__
# --------------------------------------------------------------------------------------

def _capability() -> tuple[int, int] | None:
    cap = current_platform.get_device_capability()
    if cap is None:
        return None
    return (int(cap[0]), int(cap[1]))


def _index_heads(builder: Any) -> int | None:
    model_config = getattr(builder.vllm_config, "model_config", None)
    heads = getattr(getattr(model_config, "hf_config", None), "index_n_heads", None)
    return heads if isinstance(heads, int) else None


def _graph_kernel(builder: Any) -> str:
    """The varlen kernel a captured decode step of this builder runs (the GPU,
    index heads and cache geometry decide; see ``launcher.graph_kernel``): the
    policy's rules measured with one kernel apply only when it runs."""
    from vllm_dsa_varlen.ops import launcher

    spec = builder.kv_cache_spec
    return launcher.graph_kernel(builder.device, _index_heads(builder), spec.head_size - 4,
                                 spec.num_states)


def _own_kernel_serves(builder: Any) -> bool:
    """Whether the project's varlen kernel supports this builder's cache (pages of
    ``num_states`` entries of ``head_size`` bytes) and index head count."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception:  # noqa: BLE001 - Triton missing or broken: no kernel of ours
        return False
    spec = builder.kv_cache_spec
    return HAS_TRITON and config.own_kernel_serves(
        page=getattr(spec, "num_states", None), head_size=getattr(spec, "head_size", None),
        heads=_index_heads(builder))


def decide_decode_path(builder: Any) -> DecodePath:
    """Gather the facts for :func:`choose_decode_path` from ``builder``, the
    settings and the platform."""
    mode, backend = settings.get(settings.MODE_ENV), settings.get(settings.BACKEND_ENV)
    is_cuda = bool(current_platform.is_cuda())
    on = mode != "off" and is_cuda
    return choose_decode_path(
        is_cuda=is_cuda,
        capability=_capability() if is_cuda else None,
        upstream_varlen=bool(builder.supports_varlen),
        own_ok=on and _own_kernel_serves(builder),
        next_n=builder.num_speculative_tokens + 1,
        fp4_cache=bool(builder.indexer_uses_fp4),
        flattening=bool(builder.use_flattening),
        mode=mode,
        backend=backend,
    )


def _setup_varlen(builder: Any) -> None:
    path = decide_decode_path(builder)
    if path.use_varlen:
        # The varlen kernel a captured step runs: a fact of the builder, asked
        # once (the policy's kernel-gated rules read it; the log line names it).
        builder.varlen_graph_kernel = _graph_kernel(builder)
        path = dataclasses.replace(path, kernel=builder.varlen_graph_kernel)
    builder.decode_path = path
    builder.use_varlen = path.use_varlen
    builder.varlen_backend = path.backend
    builder._varlen_planning = False
    builder._varlen_step_ids = None
    builder._varlen_common = None
    builder._varlen_ids_layout = (0, 0)
    builder.last_step_choice = None
    builder.last_step_stock_only = False
    log_decode_path(path)
    if not path.use_varlen:
        return
    # Rows are planned straight into stock's buffers (stock post-processes the
    # context lengths in place); the ids go to stock's own id buffer.
    builder.varlen_rows = DecodeRowBuffers(
        indices=builder.decode_indices_buffer,
        context_lens=builder.decode_seq_lens_buffer,
        block_table=builder.expanded_block_table_buffer,
        arange=builder.arange_buffer,
    )
    if builder.decode_indices_buffer.data_ptr() % 8:
        raise RuntimeError("decode_indices_buffer: run ids need an 8-byte aligned start")
    # vLLM 0.34 sizes the block-table buffer for decode tokens only
    # (max_num_seqs * next_n rows), fewer than the other buffers hold.
    builder.varlen_max_rows = min(int(b.shape[0]) for b in (
        builder.decode_indices_buffer, builder.decode_seq_lens_buffer,
        builder.expanded_block_table_buffer, builder.decode_lens_buffer))
    if path.backend == "own":
        # Every kernel variant a step can launch, compiled now (logged with the
        # time it took) so no decode step waits on a JIT compile.
        warmup.precompile_for(heads=_index_heads(builder),
                              head_size=builder.kv_cache_spec.head_size,
                              page=builder.kv_cache_spec.num_states, device=builder.device,
                              max_run_len=builder.num_speculative_tokens + 1)


# ``__init__`` replacement: stock init, then _setup_varlen.
wrap_init = init_then(_setup_varlen)


# --------------------------------------------------------------------------------------
# Per step: what stock would run, and whether varlen runs instead
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepChoice:
    """A decode step's classification.

    ``facts``: what :func:`vllm_dsa_varlen.policy.varlen_wins` was asked about;
    ``stock``: what stock 0.33.0 runs for the step (``"native"`` |
    ``"flattened"`` | ``"split"``); ``varlen``: the project's varlen kernel runs
    it; ``plan``: the build lays out varlen rows and ids (whenever varlen runs
    or stock's layout is flattened anyway)."""

    facts: StepFacts
    stock: str
    varlen: bool
    plan: bool


def _split(builder: Any, cm: Any, require_uniform: bool) -> tuple[int, int]:
    """(decode requests, decode tokens) as stock's split counts them."""
    num_decodes, _, num_decode_tokens, _ = _ix.split_decodes_and_prefills(
        cm, decode_threshold=builder.decode_threshold, require_uniform=require_uniform,
        treat_short_extends_as_decodes=not builder.use_pcp)
    return num_decodes, num_decode_tokens


def classify_step(builder: Any, cm: Any) -> StepChoice | None:
    """Classify the decode part of a step from host-known facts (CPU query
    offsets, counts); ``None`` when the step has no decode.

    0-token (graph-padding) requests do not make a step non-uniform (stock's
    split treats them the same way).  Facts are
    :meth:`~vllm_dsa_varlen.policy.StepFacts.from_decode_lens` of the step
    (padding requests are not requests; rows include padding rows), except for
    a native step, which is described by its CUDA-graph key (see the module
    docstring)."""
    if cm.num_actual_tokens == 0:
        return None
    num_decodes, rows = _split(builder, cm, require_uniform=False)
    if num_decodes == 0:
        return None
    max_context = max(0, int(cm.max_seq_len))
    longest = cm.max_query_len
    plain_uniform = uniform_unpadded(cm.num_reqs, longest, num_decodes, rows,
                                     cm.query_start_loc_cpu)
    if plain_uniform:
        # (O(1): what from_query_starts would find)
        lens_facts = StepFacts(rows=rows, requests=num_decodes, max_run=longest, uniform=True,
                               max_context=max_context, tokens=rows)
    else:
        lens_facts = StepFacts.from_query_starts(cm.query_start_loc_cpu[: num_decodes + 1],
                                                 rows=rows, max_context=max_context)
    max_run, uniform = lens_facts.max_run, lens_facts.uniform
    if max_run == 0:  # only graph-padding requests: nothing to choose
        return None
    if builder.use_flattening:
        stock = "flattened"
    elif not uniform and _split(builder, cm, require_uniform=True)[0] < num_decodes:
        stock = "split"
    elif _native_serves(builder, max_run):
        stock = "native"
    else:
        stock = "flattened"
    if stock == "native":
        # A native step may replay a FULL graph of a uniform key: decide from
        # the key's facts only -- padded rows and requests (0-token padding
        # requests counted, as the key's request count does), no context length.
        facts = StepFacts(rows=rows, requests=min(num_decodes, rows), max_run=max_run,
                          uniform=uniform, max_context=0)
    else:
        facts = lens_facts
    if stock == "flattened" and _left_to_stock(builder, cm, max_run):
        return StepChoice(facts, stock, varlen=False, plan=False)
    kernel = builder.varlen_graph_kernel
    # a uniform step without padding: kept per step shape where no rule reads contexts
    varlen = (policy.uniform_step_wins(rows, max_run, stock, kernel)
              if plain_uniform and stock != "native" else None)
    if varlen is None:
        varlen = varlen_wins(facts, stock, kernel=kernel)
    return StepChoice(facts, stock, varlen, plan=varlen or stock == "flattened")


def _native_serves(builder: Any, max_run: int) -> bool:
    """Whether stock's native kernel takes a uniform step of ``max_run``-token
    requests (one token each, or up to ``next_n`` where DeepGEMM has the size)."""
    next_n = builder.num_speculative_tokens + 1
    return max_run <= 1 or (max_run <= next_n and _ix._supports_native_decode(max_run))


def _left_to_stock(builder: Any, cm: Any, max_run: int) -> bool:
    """For a step stock flattens: whether no rule can send it to varlen, so it
    is left to stock's own build (no rows, no ids, no comparison).

    True when the token count the builder sees (``num_actual_tokens``; under
    a FULL graph vLLM 0.33.0 passes the graph's padded count, at capture and
    at replay, from both model runners and the drafter: ``v1/worker/
    gpu_model_runner.py`` ``num_actual_tokens=num_tokens_padded``,
    ``v1/worker/gpu/model_states/default.py`` ``num_tokens_after_padding``
    and ``v1/worker/gpu/spec_decode/speculator.py`` ``batch_desc.num_tokens``
    when the mode is FULL) is below
    :func:`vllm_dsa_varlen.policy.min_varlen_rows` for runs of up to
    ``next_n`` tokens -- or of up to the step's longest request ``max_run``
    where no FULL graph replays batches of other per-request lengths
    (:func:`_full_graphs_replay_mixed_batches`: otherwise a graph's key fixes
    ``max_run``).  ``rows <= num_actual_tokens``, so no rule matches such a
    step.  The capture and every replay of a graph decide alike; the captured
    call is stock's flattened DeepGEMM call, whose context lengths, block-table
    rows and schedule are views of the builder's buffers that stock's build
    refreshes (padding rows with context 0).  No PCP.  Host ints only."""
    if builder.use_pcp:
        return False
    # asked twice in a varlen build (the stock-only exit, then classify_step):
    # the answer is kept for the build that is running (``build`` clears it
    # when it starts; vLLM's drafter rewrites ``cm`` between builds)
    memo = getattr(builder, "_varlen_left_memo", None)
    if memo is not None and memo[0] is cm and memo[1] == max_run:
        return memo[2]
    runs = builder.decode_threshold if _full_graphs_replay_mixed_batches(builder) else max_run
    bound = policy.min_varlen_rows("flattened", kernel=builder.varlen_graph_kernel,
                                   max_run=runs)
    answer = bound is None or cm.num_actual_tokens < bound
    builder._varlen_left_memo = (cm, max_run, answer)
    return answer


def _stock_only_step(builder: Any, cm: Any) -> bool:
    """A flattening builder's step that no rule can send to varlen, decided
    before :func:`classify_step` from O(1) host ints (no split, no per-request
    lengths): the step's longest query ``max_query_len`` bounds its longest
    decode, and :func:`vllm_dsa_varlen.policy.min_varlen_rows` only grows as
    the longest run shrinks, so :func:`_left_to_stock` for runs of
    ``min(max_query_len, decode_threshold)`` tokens holds for every decode
    split of the step.  Small batches and the drafter's one-token steps take
    this exit: the plugin adds a few host microseconds to their ``build()``,
    not a classification."""
    longest = max(1, min(builder.decode_threshold, int(cm.max_query_len)))
    return builder.use_flattening and _left_to_stock(builder, cm, longest)


def _native_stock_only(builder: Any, cm: Any) -> bool:
    """A native-kernel builder's step that stock's native kernel serves and no
    rule can send to varlen, decided before :func:`classify_step` from O(1)
    host ints: every request a decode of ``max_query_len`` tokens with no graph
    padding (:func:`vllm_dsa_varlen.policy.uniform_unpadded`; with
    ``max_query_len <= decode_threshold`` and no PCP vLLM's split counts every
    request a decode), a length stock's native kernel takes, and no rule
    against it for such runs (:func:`vllm_dsa_varlen.policy.min_varlen_rows`).
    :func:`classify_step` would find stock native, not varlen; a graph-padded
    replay of the same key is classified and finds the same."""
    if builder.use_flattening or builder.use_pcp:
        return False
    longest = int(cm.max_query_len)
    if not 1 <= longest <= builder.decode_threshold or not _native_serves(builder, longest):
        return False
    if policy.min_varlen_rows("native", kernel=builder.varlen_graph_kernel,
                              max_run=longest) is not None:
        return False
    return uniform_unpadded(cm.num_reqs, longest, cm.num_reqs, cm.num_actual_tokens,
                            cm.query_start_loc_cpu)


def _record_stock_only(cm: Any, metadata: Any, stock: str) -> None:
    """Count a step left to stock before classifying (:func:`_stock_only_step`:
    ``stock`` "flattened"; :func:`_native_stock_only`: "native", uniform by
    construction) as :func:`classify_step` and :func:`step_path` would, from
    the decode count stock's build found; graph-padding requests (no tokens) do
    not make a step variable."""
    num_decodes = getattr(metadata, "num_decodes", 0)
    if not num_decodes:
        return
    variable = stock != "native" and not (
        uniform_unpadded(cm.num_reqs, cm.max_query_len, num_decodes,
                         metadata.num_decode_tokens, cm.query_start_loc_cpu)
        or StepFacts.from_query_starts(cm.query_start_loc_cpu[: num_decodes + 1]).uniform)
    stats.record(f"stock_{stock}", variable=variable,
                 mixed=getattr(metadata, "num_prefills", 0) > 0)


def _full_graphs_replay_mixed_batches(builder: Any) -> bool:
    """Whether a FULL CUDA graph may be replayed for a batch whose requests'
    lengths are not the captured batch's: cudagraph mode ``FULL`` (mixed
    batches; a flattening builder reports ``ALWAYS``), adaptive verification
    (the V2 model runner's variable-length decode graphs), or the mode unknown.
    Otherwise vLLM 0.33.0 replays FULL graphs only for uniform decode batches
    of the captured per-request length (plus 0-token padding requests)."""
    if _adaptive(builder):
        return True
    mode = getattr(getattr(builder.vllm_config, "compilation_config", None),
                   "cudagraph_mode", None)
    known = getattr(builder, "_varlen_mixed_replay", None)
    if known is not None and known[0] is mode:
        return known[1]
    # vLLM may settle the mode after the builder is made: cached per mode object
    replays = not isinstance(mode, CUDAGraphMode) or mode.mixed_mode() == CUDAGraphMode.FULL
    builder._varlen_mixed_replay = (mode, replays)
    return replays


# --------------------------------------------------------------------------------------
# _prepare_decode_tensors
# --------------------------------------------------------------------------------------

def _adaptive(builder: Any) -> bool:
    spec = builder.vllm_config.speculative_config
    return bool(spec is not None and getattr(spec, "enable_adaptive_verification", False))


def _plan_varlen_rows(builder: Any, stock: Callable[[], Any], seq_lens: torch.Tensor,
                      block_table: torch.Tensor, decode_lens_cpu: torch.Tensor, num_decodes: int,
                      num_decode_tokens: int, max_decode_len: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    """Plan ``R = num_decode_tokens`` one-token rows into the builder's buffers.

    A uniform step without graph padding (every decode ``n = max_decode_len``
    tokens, ``R = B * n``; not adaptive): stock's own flatten branch lays out
    the rows (its one-launch uniform kernel writes the same context lengths
    and block-table rows as :func:`plan_decode_rows`; tested on the GPU) and
    only the ids ``r // n`` are added, and only when the buffer does not hold
    them already (:func:`~vllm_dsa_varlen.varlen_ids.ids_hold`).  Other steps:
    :func:`plan_decode_rows` with the step's device offsets; under adaptive verification the host's
    per-request lengths are upper bounds (the device trims drafts), so those
    rows are always planned from the device offsets (the host's token total
    is exact)."""
    uniform = (max_decode_len >= 1 and not _adaptive(builder)
               and int(decode_lens_cpu.min()) == max_decode_len
               and num_decodes * max_decode_len == num_decode_tokens)
    if uniform and not builder.supports_varlen:
        ctx, bt, one_token_each, rows, padded = stock()  # stock's flatten branch, this call
        in_buffer = ctx.data_ptr() == builder.decode_seq_lens_buffer.data_ptr()
        if rows != num_decode_tokens or padded or not in_buffer:
            raise RuntimeError(
                f"varlen build: stock's flatten branch returned {rows} rows (padded={padded}) "
                f"for a uniform step of {num_decode_tokens} tokens")
        ids = builder.decode_indices_buffer[:rows]
        ready = ids_hold(builder, max_decode_len, rows)
        with ids_written(builder, (max_decode_len, rows), skip=ready):
            if not ready:
                torch.div(builder.arange_buffer[:rows], max_decode_len, rounding_mode="floor",
                          out=ids)
        builder._varlen_step_ids = ids
        return ctx, bt, one_token_each, rows, False
    qsl = builder._varlen_common.query_start_loc[: num_decodes + 1]
    with ids_written(builder, None):
        if uniform:
            rows = plan_decode_rows(seq_lens, qsl, block_table, num_rows=num_decode_tokens,
                                    uniform_len=max_decode_len, out=builder.varlen_rows)
        else:
            rows = plan_decode_rows(seq_lens, qsl, block_table, num_rows=num_decode_tokens,
                                    num_tokens=int(decode_lens_cpu.sum()), out=builder.varlen_rows)
    builder.decode_seq_lens_buffer[rows.num_rows:].zero_()
    one_token_each = builder.decode_lens_buffer[: rows.num_rows]
    one_token_each.fill_(1)
    builder._varlen_step_ids = rows.indices
    return rows.context_lens, rows.block_table, one_token_each, rows.num_rows, False


# the arguments of stock's _prepare_decode_tensors a planned build reads
_PREPARE_ARGS = frozenset(("seq_lens", "block_table", "decode_lens_cpu", "num_decodes",
                           "num_decode_tokens", "max_decode_len"))


def wrap_prepare_decode_tensors(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_prepare_decode_tensors`` replacement.  During a planned build:
    ``(int32 [R], int32 [R, W], int32 [R] of 1, R, False)`` (see
    :func:`_plan_varlen_rows`); otherwise stock's, untouched (the call passed
    through as made)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _prepare_decode_tensors(self, *args, **kwargs):
        if not getattr(self, "_varlen_planning", False):
            return original(self, *args, **kwargs)
        # stock passes every argument by name: no binding (its parameter walk
        # costs host time on every varlen step)
        a = (kwargs if not args and _PREPARE_ARGS <= kwargs.keys()
             else signature.bind(self, *args, **kwargs).arguments)
        return _plan_varlen_rows(self, functools.partial(original, self, *args, **kwargs),
                                 a["seq_lens"], a["block_table"], a["decode_lens_cpu"],
                                 a["num_decodes"], a["num_decode_tokens"], a["max_decode_len"])

    return _prepare_decode_tensors


# --------------------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------------------

def _hand_over_ids(builder: Any, metadata: Any, choice: StepChoice) -> None:
    """Varlen: the step's ids to the decode metadata and, on a tagged view of
    the schedule tensor, to the kernel call.  Stock's flattened path: no ids."""
    ids, builder._varlen_step_ids = builder._varlen_step_ids, None
    decode = metadata.decode
    if decode is None or ids is None:
        return
    if ids.shape[0] != decode.seq_lens.shape[0]:
        raise RuntimeError(f"varlen build: {ids.shape[0]} run ids for "
                           f"{decode.seq_lens.shape[0]} decode rows")
    if not choice.varlen:
        decode.indices = None
        return
    decode.schedule_metadata = attach_varlen_ids(decode.schedule_metadata, ids,
                                                 builder.varlen_backend,
                                                 max(1, choice.facts.max_run))
    decode.indices = ids


def step_path(choice: StepChoice) -> str:
    """The step's path as :mod:`vllm_dsa_varlen.stats` counts it."""
    if choice.varlen:
        return "split_avoided" if choice.stock == "split" else "varlen"
    return f"stock_{choice.stock}"


def _record_step(choice: StepChoice | None, metadata: Any) -> None:
    if choice is not None:
        stats.record(step_path(choice), variable=not choice.facts.uniform,
                     mixed=getattr(metadata, "num_prefills", 0) > 0)


def wrap_build(original: Callable[..., Any]) -> Callable[..., Any]:
    """``build`` replacement (see the module docstring).  Not varlen: stock,
    untouched.  A varlen builder's steps with decodes are counted
    (:mod:`vllm_dsa_varlen.stats`)."""

    @functools.wraps(original)
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        if not getattr(self, "use_varlen", False):
            return original(self, common_prefix_len, common_attn_metadata, fast_build)
        self._varlen_left_memo = None  # the build's own (see _left_to_stock)
        stock_only = ("flattened" if _stock_only_step(self, common_attn_metadata) else
                      "native" if _native_stock_only(self, common_attn_metadata) else None)
        self.last_step_stock_only = stock_only is not None
        if stock_only:
            self.last_step_choice = None
            metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
            _record_stock_only(common_attn_metadata, metadata, stock_only)
            return metadata
        choice = classify_step(self, common_attn_metadata)
        self.last_step_choice = choice
        if choice is None or not choice.plan:
            metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
            _record_step(choice, metadata)
            return metadata
        if choice.facts.rows > self.varlen_max_rows:
            raise RuntimeError(
                f"vllm-dsa-varlen: a decode step of {choice.facts.rows} rows (one a token) "
                f"exceeds the indexer builder's {self.varlen_max_rows}-row decode buffers "
                "(expanded_block_table_buffer, decode_seq_lens_buffer, decode_indices_buffer)")
        flattening = self.use_flattening
        self.use_flattening = True
        self._varlen_planning = True
        self._varlen_step_ids = None
        self._varlen_common = common_attn_metadata
        try:
            metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
        finally:
            self.use_flattening = flattening
            self._varlen_planning = False
            self._varlen_common = None
        _hand_over_ids(self, metadata, choice)
        _record_step(choice, metadata)
        return metadata

    return build


def wrap_update_draft_decode_metadata(original: Callable[..., Any]) -> Callable[..., Any]:
    """``update_draft_decode_metadata`` replacement: a varlen step's metadata is
    updated by stock without its ids (DeepGEMM on SM90 takes none), then the
    ids become one run per row again.  Other metadata: stock, untouched."""

    @functools.wraps(original)
    def update_draft_decode_metadata(self, metadata):
        decode = metadata.decode
        tag = None if decode is None else varlen_ids_of(decode.schedule_metadata)
        if tag is None:
            return original(self, metadata)
        ids = decode.indices
        decode.indices = None
        try:
            original(self, metadata)
        finally:
            decode.indices = ids
        if ids is not None:
            with ids_written(self, (1, ids.shape[0])):
                ids.copy_(self.arange_buffer[: ids.shape[0]])
        decode.schedule_metadata = attach_varlen_ids(decode.schedule_metadata, tag.ids,
                                                     tag.backend, 1)
        return None

    return update_draft_decode_metadata
