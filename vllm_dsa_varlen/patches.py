"""The one registry of every monkey-patch this plugin makes to vLLM, per vLLM line.

No vLLM file is edited: the plugin replaces attributes (module globals and
class attributes) at run time, and every such replacement is a :class:`Patch`
record in :data:`PATCHES` -- the list *is* the documentation of what the plugin
changes and why.  Each patch names the vLLM release its target was read from
(``upstream``); patches are grouped by *line* (``"0.27"``, ``"0.33"``: major.minor,
:data:`LINES`), and only the installed line's patches are ever applied.
:func:`apply_all` applies a line's patches (idempotent), :func:`undo_all` puts
the originals back exactly (also restoring "was not there" by deleting),
:func:`applied` lists what is in force.  :data:`SHAPES` records what each
patched attribute looked like in that release (its parameters, fields or
import); :func:`upstream_differences` compares them with the installed source
(:mod:`.upstream`, no import), and the plugin entry point leaves a vLLM that
differs stock.

A patch names its replacement by dotted path (``"package.module:name"``) so
this module imports neither vLLM nor the replacement modules until
:func:`apply_all` runs.  ``apply_all(defer_unimported=True)`` (what the plugin
entry point uses) patches the modules already imported and patches each other
target module right after it is first imported (a ``sys.meta_path`` hook), so
loading the plugin imports no vLLM module early: some read settings at import
time (e.g. ``sparse_attn_indexer``'s ``@eager_break_during_capture`` reads
``VLLM_USE_BREAKABLE_CUDAGRAPH``, which ``VllmConfig`` may set only after the
plugins were loaded).  With ``wraps=True`` the named object is a factory
called once with the original attribute, returning the replacement (used to
wrap stock methods without looking the original up on every call).

Order matters where one patch's replacement reads another's target: within a
line, the ``vllm.utils.deep_gemm`` wrappers and the kernel-call dispatch come
first, the builder patches last.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("vllm.dsa_varlen")

# vLLM line (major.minor) -> the release its patches were read from.
LINES: dict[str, str] = {"0.27": "0.27.1", "0.33": "0.33.0", "0.34": "0.34.0"}
# vLLM line -> the subpackage holding its replacements: one serves several lines
# where the upstream code it patches and calls is the same.
PACKAGES: dict[str, str] = {"0.27": "vllm_0_27", "0.33": "vllm_0_33", "0.34": "vllm_0_33"}

_MISSING = object()


@dataclass(frozen=True)
class Patch:
    """One replaced attribute.

    ``module``: dotted module path, e.g. ``"vllm.v1.attention.backends.mla.indexer"``.
    ``attribute``: attribute path inside it, e.g.
    ``"DeepseekV32IndexerMetadataBuilder.build"`` (the last part is replaced on
    the object the earlier parts lead to).
    ``replacement``: ``"package.module:name"`` of the replacement (or of a
    factory ``original -> replacement`` when ``wraps``).
    ``reason``: why the patch exists (required, non-empty).
    ``upstream``: the vLLM release the patched code was read from; its
    major.minor is the patch's :attr:`line`.
    ``api``: the patch only adapts a call to the installed DeepGEMM's API
    generation (stock's arguments, stock's path); these alone are applied in
    ``DSA_VARLEN=stock`` mode, the baseline where the installed DeepGEMM
    is not the one vLLM was built with.
    """

    module: str
    attribute: str
    replacement: str
    reason: str
    upstream: str
    wraps: bool = False
    api: bool = False

    @property
    def key(self) -> str:
        return f"{self.module}:{self.attribute}"

    @property
    def line(self) -> str | None:
        """``"0.27"`` for ``upstream == "0.27.1"`` (``None`` if unparsable)."""
        return line_of(self.upstream)


def line_of(version: str) -> str | None:
    """The line (``"major.minor"``) of a vLLM version string such as
    ``"0.33.0"`` or ``"0.27.1.dev12+gabc"``; ``None`` when it has none."""
    parts = str(version).split(".")
    try:
        return f"{int(parts[0])}.{int(parts[1])}"
    except (IndexError, ValueError):
        return None


def installed_line() -> str | None:
    """The line of the installed vLLM (from package metadata, without
    importing vLLM); ``None`` when vLLM is not installed."""
    import importlib.metadata as md

    try:
        return line_of(md.version("vllm"))
    except md.PackageNotFoundError:
        return None


def for_line(line: str | None, *, api_only: bool = False) -> tuple["Patch", ...]:
    """The patches of ``line`` in registry order (empty for a line without any);
    ``api_only``: just the DeepGEMM API adapters (``Patch.api``)."""
    return tuple(p for p in PATCHES
                 if line is not None and p.line == line and (p.api or not api_only))


_DG = "vllm.utils.deep_gemm"
_SAI = "vllm.model_executor.layers.sparse_attn_indexer"
_IX = "vllm.v1.attention.backends.mla.indexer"
_OUR_DG = "vllm_dsa_varlen.vllm_0_27.utils.deep_gemm"
_OUR_SAI = "vllm_dsa_varlen.vllm_0_27.model_executor.layers.sparse_attn_indexer"
_OUR_IX = "vllm_dsa_varlen.vllm_0_27.v1.attention.backends.mla.indexer"
_V2 = "vllm.model_executor.models.deepseek_v2"
_OUR_V2 = "vllm_dsa_varlen.vllm_0_27.model_executor.models.deepseek_v2"
_GLM5N = "vllm.models.glm5next.nvidia.sparse_indexer"
_OUR_SAI_33 = "vllm_dsa_varlen.vllm_0_33.model_executor.layers.sparse_attn_indexer"
_OUR_IX_33 = "vllm_dsa_varlen.vllm_0_33.v1.attention.backends.mla.indexer"
_V32_ATTN = "vllm.models.deepseek_v32.attention"
_OUR_V32_ATTN_33 = "vllm_dsa_varlen.vllm_0_33.models.deepseek_v32.attention"


def _patches_0_27(release: str) -> tuple[Patch, ...]:
    """The patch set of the modules under ``vllm_0_27/``, read from ``release``."""
    return (
        Patch(_DG, "get_paged_mqa_logits_metadata", f"{_OUR_DG}:get_paged_mqa_logits_metadata",
              "accept the varlen run ids (`indices`) and forward them to DeepGEMM only "
              "when set; without them the call is exactly stock's", upstream=release),
        Patch(_DG, "fp8_fp4_paged_mqa_logits", f"{_OUR_DG}:fp8_fp4_paged_mqa_logits",
              "forward `indices` when set; adapt to DeepGEMM 2.8.x (no `clean_logits`: "
              "drop it and emulate; bf16 weights/logits on SM100: convert) so 0.27.1's "
              "fp32 top-k kernels keep working", api=True, upstream=release),
        Patch(_DG, "fp8_fp4_mqa_logits", f"{_OUR_DG}:fp8_fp4_mqa_logits",
              "prefill logits: DeepGEMM 2.8.x has no `clean_logits` and writes "
              "row-compressed logits; adapt so stock's absolute-column top-k still reads "
              "right (unchanged call on the API 0.27.1 was built with)",
              api=True, upstream=release),
        Patch(_SAI, "fp8_fp4_mqa_logits", f"{_OUR_DG}:fp8_fp4_mqa_logits",
              "the indexer op imported the prefill wrapper by name; point it at the "
              "adapted one", api=True, upstream=release),
        Patch(_SAI, "fp8_fp4_paged_mqa_logits", f"{_OUR_SAI}:fp8_fp4_paged_mqa_logits",
              "the registered custom op captured `sparse_attn_indexer` itself but looks "
              "this module global up per call: route varlen decode steps (ids carried "
              "by the schedule tensor) to DeepGEMM-with-indices or the project's varlen "
              "kernel; untagged calls (every call in `stock` mode) are stock's call through "
              "the DeepGEMM adapter", api=True, upstream=release),
        Patch(_SAI, "torch", f"{_OUR_SAI}:torch_with_own_topk",
              "the decode top-k is `torch.ops._C.persistent_topk` / `cooperative_topk` "
              "reached through this module global: a view of torch whose two top-k ops run "
              "the project's top-k kernel where it is chosen and serves "
              "(vllm_dsa_varlen.topk: sm_90, DSA_VARLEN_TOPK), the same op otherwise; every "
              "other name is torch's",
              wraps=True, upstream=release),
        Patch(_V2, "fused_indexer_q_rope_quant",
              f"{_OUR_V2}:wrap_fused_indexer_q_rope_quant",
              "the indexer layer calls this module global once per layer to prepare its "
              "query (RoPE, fp8, the weights' scaling): on sm_90 (DSA_VARLEN_FUSED_Q=auto; "
              "`on` also other fp8 GPUs) the project's kernel (a program per token and block "
              "of heads, vLLM's arithmetic, bytes equal to its outputs) instead of vLLM's "
              "one-warp program per token and head; vLLM's otherwise and for any call it "
              "does not take (config.choose_fused_q)",
              wraps=True, upstream=release),
        Patch(_IX, "get_paged_mqa_logits_metadata", f"{_OUR_IX}:get_paged_mqa_logits_metadata",
              "the builder's build() calls this module global: during a varlen build pass "
              "the step's run ids to DeepGEMM's scheduler (the project's kernels need no "
              "schedule)", upstream=release),
        Patch(_IX, "DeepSeekV32IndexerDecodeMetadata",
              f"{_OUR_IX}:DeepSeekV32IndexerDecodeMetadata",
              "build() constructs the decode metadata through this module global: a "
              "subclass adds the `indices` field (None when not varlen)", upstream=release),
        Patch(_IX, "DeepseekV32IndexerMetadataBuilder.get_cudagraph_support",
              f"{_OUR_IX}:wrap_get_cudagraph_support",
              "full CUDA graphs for every batch: ALWAYS when every decode step gets the "
              "varlen rows (one row per token, any batch composition), as upstream 0.28.0; "
              "stock's UNIFORM_BATCH otherwise", wraps=True, upstream=release),
        Patch(_IX, "DeepseekV32IndexerMetadataBuilder.__init__", f"{_OUR_IX}:wrap_init",
              "decide the decode path once (config.choose_decode_path with the 0.27 line's "
              "facts), force the flatten "
              "branch and allocate the run-id buffer when varlen", wraps=True, upstream=release),
        Patch(_IX, "DeepseekV32IndexerMetadataBuilder._prepare_decode_tensors",
              f"{_OUR_IX}:wrap_prepare_decode_tensors",
              "varlen: plan rows with plan.plan_decode_rows into stock's buffers (no "
              "second copy of the row logic), plain steps flattened too, "
              "and remember the run ids; stock steps: padding requests' context lengths "
              "clamped at 0",
              wraps=True, upstream=release),
        Patch(_IX, "DeepseekV32IndexerMetadataBuilder.build", f"{_OUR_IX}:wrap_build",
              "varlen: choose the step's layout and kernel (policy.varlen_wins), mark the "
              "build for the metadata hook, then hand the run ids to the decode metadata "
              "and to the kernel call (via a per-step schedule view)",
              wraps=True, upstream=release),
    )


def _patches_0_33(release: str) -> tuple[Patch, ...]:
    """The patch set of the modules under ``vllm_0_33/``, for ``release``: vLLM 0.33.0
    and 0.34.0 differ in none of the code these patches replace or call, except
    the logits function's ``logits_dtype``, which the logits wrapper reads from
    the function it wraps (SM100 + DeepGEMM: upstream varlen, untouched;
    Hopper and other fp8 GPUs: per-step varlen with the project's kernels)."""
    return (
        Patch(_SAI, "fp8_fp4_paged_mqa_logits", f"{_OUR_SAI_33}:wrap_paged_mqa_logits",
              "the indexer op looks this module global up per call: a decode step whose "
              "schedule tensor carries run ids (a varlen step of the project's kernels) goes "
              "to the project's varlen kernel; every other call is stock's, `indices` (and "
              "0.34's `logits_dtype`) passed through",
              upstream=release, wraps=True),
        Patch(_SAI, "get_indexer_topk", f"{_OUR_SAI_33}:wrap_get_indexer_topk",
              "the indexer op looks this module global up per call for its decode top-k: with "
              "the `auto` backend the project's top-k kernel runs where it is chosen and serves "
              "(vllm_dsa_varlen.topk: sm_90, DSA_VARLEN_TOPK), vLLM's otherwise",
              upstream=release, wraps=True),
        Patch(_GLM5N, "fp8_fp4_paged_mqa_logits", f"{_OUR_SAI_33}:wrap_paged_mqa_logits",
              "GLM-5-Next's indexer op (NVIDIA) has its own copy of the decode call on the "
              "same builder's metadata: the same dispatch, so its varlen steps reach the "
              "project's kernel instead of DeepGEMM with ids it cannot take on SM90",
              upstream=release, wraps=True),
        Patch(_GLM5N, "get_indexer_topk", f"{_OUR_SAI_33}:wrap_get_indexer_topk",
              "GLM-5-Next's indexer op (NVIDIA) looks its own copy of this global up for its "
              "decode top-k: the same choice",
              upstream=release, wraps=True),
        Patch(_IX, "DeepseekV32IndexerMetadataBuilder.__init__", f"{_OUR_IX_33}:wrap_init",
              "decide once whether the project's varlen kernel serves this builder (SM100 with "
              "DeepGEMM: upstream varlen, left alone) and log the path in one line",
              upstream=release, wraps=True),
        Patch(_IX, "DeepseekV32IndexerMetadataBuilder._prepare_decode_tensors",
              f"{_OUR_IX_33}:wrap_prepare_decode_tensors",
              "during a planned build, one-token rows into stock's buffers (a uniform step "
              "through stock's flatten branch, others by plan.plan_decode_rows) and the run "
              "ids into stock's decode_indices_buffer",
              upstream=release, wraps=True),
        Patch(_IX, "DeepseekV32IndexerMetadataBuilder.update_draft_decode_metadata",
              f"{_OUR_IX_33}:wrap_update_draft_decode_metadata",
              "a drafter reuses a step's metadata one token per request: for a varlen step, "
              "remake DeepGEMM's schedule without the ids (SM90 takes none) and reset the ids "
              "to one run per row",
              upstream=release, wraps=True),
        Patch(_IX, "DeepseekV32IndexerMetadataBuilder.build", f"{_OUR_IX_33}:wrap_build",
              "classify each step from host facts (what stock runs: native, flattened or "
              "split) and ask policy.varlen_wins; varlen: flatten without the uniform split "
              "and hand the run ids to the decode metadata and the kernel call",
              upstream=release, wraps=True),
        Patch(_V32_ATTN, "fused_q", f"{_OUR_V32_ATTN_33}:wrap_fused_q",
              "the attention layer calls this module global once per layer to prepare the "
              "indexer's and the MLA's queries (RoPE, fp8, the indexer weights): on sm_90 the "
              "project's kernel (a program per token and block of heads, bit-equal outputs) "
              "instead of vLLM's one-warp program per token, part and head; vLLM's elsewhere "
              "and for any call it does not take (config.choose_fused_q)",
              upstream=release, wraps=True),
    )


PATCHES: tuple[Patch, ...] = (_patches_0_27(LINES["0.27"]) + _patches_0_33(LINES["0.33"])
                               + _patches_0_33(LINES["0.34"]))


# What each patched attribute looks like in the release its line was read
# from, as upstream.shape reads it from source (a function's parameters, a
# class's fields, a global's import).  register() compares them with the
# installed vLLM before applying a line (upstream_differences): a 0.27.x or
# 0.33.x release that changed one is left stock, with a warning naming it.
_BUILDER = "DeepseekV32IndexerMetadataBuilder"
_DG_PAGED_27 = ("def(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, "
                "max_model_len, clean_logits)")
_DG_PAGED_33 = ("def(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, "
                "max_model_len, indices)")
_DG_PAGED_34 = ("def(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, "
                "max_model_len, logits_dtype, indices)")
_DG_MQA_27 = "def(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits)"
_DG_META = "def(context_lens, block_size, num_sms)"
_PREPARE = ("def(self, seq_lens, block_table, decode_lens, decode_lens_cpu, query_start_loc, "
            "num_decodes, num_decode_tokens, use_native, next_n, max_decode_len)")
_BUILD = "def(self, common_prefix_len, common_attn_metadata, fast_build)"
_INIT = "def(self, *args, block_table_width, **kwargs)"
_TOPK_33 = "vllm.model_executor.layers.indexer_topk.get_indexer_topk: def(backend)"
def _shapes_0_33(paged_logits: str) -> dict[str, str]:
    """The shapes the ``vllm_0_33/`` patch set was written against; 0.33.0 and
    0.34.0 differ in the decode logits function only (``paged_logits``)."""
    logits = f"{_DG}.fp8_fp4_paged_mqa_logits: {paged_logits}"
    return {
        f"{_SAI}:fp8_fp4_paged_mqa_logits": logits,
        f"{_SAI}:get_indexer_topk": _TOPK_33,
        f"{_GLM5N}:fp8_fp4_paged_mqa_logits": logits,
        f"{_GLM5N}:get_indexer_topk": _TOPK_33,
        f"{_IX}:{_BUILDER}.__init__": _INIT,
        f"{_IX}:{_BUILDER}._prepare_decode_tensors": _PREPARE,
        f"{_IX}:{_BUILDER}.update_draft_decode_metadata": "def(self, metadata)",
        f"{_IX}:{_BUILDER}.build": _BUILD,
        f"{_V32_ATTN}:fused_q":
            "vllm.models.deepseek_v32.common.kernels.fused_q: def(positions, q_pe, "
            "q_pe_cos_sin_cache, index_q, index_q_cos_sin_cache, ql_nope, q_scale, "
            "index_weights, index_weights_softmax_scale, index_weights_head_scale, "
            "has_indexer, index_rope_interleave, quantize_mqa)",
    }


SHAPES: dict[str, dict[str, str]] = {
    "0.27": {
        f"{_DG}:get_paged_mqa_logits_metadata": _DG_META,
        f"{_DG}:fp8_fp4_paged_mqa_logits": _DG_PAGED_27,
        f"{_DG}:fp8_fp4_mqa_logits": _DG_MQA_27,
        f"{_SAI}:fp8_fp4_mqa_logits": f"{_DG}.fp8_fp4_mqa_logits: {_DG_MQA_27}",
        f"{_SAI}:fp8_fp4_paged_mqa_logits": f"{_DG}.fp8_fp4_paged_mqa_logits: {_DG_PAGED_27}",
        f"{_SAI}:torch": "import torch",
        f"{_V2}:fused_indexer_q_rope_quant":
            f"{_SAI}.fused_indexer_q_rope_quant: def(positions, q, cos_sin_cache, weights, "
            "softmax_scale, head_scale, is_neox)",
        f"{_IX}:get_paged_mqa_logits_metadata": f"{_DG}.get_paged_mqa_logits_metadata: {_DG_META}",
        f"{_IX}:DeepSeekV32IndexerDecodeMetadata":
            "class(block_table, seq_lens, decode_lens, requires_padding, schedule_metadata, "
            "global_seq_lens)",
        f"{_IX}:{_BUILDER}.get_cudagraph_support": "def(cls, vllm_config, kv_cache_spec)",
        f"{_IX}:{_BUILDER}.__init__": _INIT,
        f"{_IX}:{_BUILDER}._prepare_decode_tensors": _PREPARE,
        f"{_IX}:{_BUILDER}.build": _BUILD,
    },
    "0.33": _shapes_0_33(_DG_PAGED_33),
    "0.34": _shapes_0_33(_DG_PAGED_34),
}


def upstream_differences(line: str, *, api_only: bool = False) -> list[str]:
    """Where the installed vLLM's source differs from what ``line``'s patches
    were written against (:data:`SHAPES`, read by :func:`.upstream.shape`
    without importing vLLM), one line each; empty where it does not.
    ``api_only``: the DeepGEMM API adapters only (``DSA_VARLEN=stock``)."""
    from .upstream import shape  # read per call: tests stand in for it

    expected = SHAPES.get(line, {})
    found = []
    for patch in for_line(line, api_only=api_only):
        want = expected.get(patch.key)
        got = shape(patch.module, patch.attribute)
        if want is None or got != want:
            found.append(f"{patch.key}: {LINES[line]} has {want or 'no recorded shape'}, "
                         f"the installed vLLM {got or 'nothing there'}")
    return found


@dataclass
class _Applied:
    patch: Patch
    owner: Any
    name: str
    original: Any  # raw value from the owner's __dict__, or _MISSING
    replacement: Any


_lock = threading.RLock()
_applied: dict[str, _Applied] = {}


def init_then(setup: Callable[[Any], None]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A ``wraps=True`` factory for an ``__init__`` patch: the replacement runs
    the stock ``__init__``, then ``setup(self)``."""

    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            setup(self)

        return __init__

    return wrap


def _resolve(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"replacement: expected 'package.module:name', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _owner_and_name(patch: Patch) -> tuple[Any, str]:
    owner: Any = importlib.import_module(patch.module)
    *parents, name = patch.attribute.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def _raw(owner: Any, name: str) -> Any:
    """The attribute as stored on ``owner`` itself (descriptors unbound), or _MISSING."""
    return vars(owner).get(name, _MISSING)


def _apply_one(patch: Patch) -> None:
    owner, name = _owner_and_name(patch)
    original = _raw(owner, name)
    if original is _MISSING and not hasattr(owner, name):
        raise AttributeError(
            f"{patch.key}: not found in vLLM {patch.upstream}-style module; "
            "the installed vLLM differs from the one this patch was written for")
    target = _resolve(patch.replacement)
    current = getattr(owner, name)
    replacement = target(current) if patch.wraps else target
    setattr(owner, name, replacement)
    _applied[patch.key] = _Applied(patch, owner, name, original, replacement)


def _apply_module_patches(patches: list[Patch]) -> list[str]:
    """Apply ``patches`` (all or none: on failure the ones applied are undone)."""
    done: list[str] = []
    try:
        for patch in patches:
            if patch.key in _applied:
                continue
            _apply_one(patch)
            done.append(patch.key)
    except Exception:
        for key in reversed(done):
            _undo_one(_applied.pop(key))
        raise
    return done


def apply_all(patches: tuple[Patch, ...] | None = None, *, line: str | None = None,
              defer_unimported: bool = False) -> list[str]:
    """Apply every patch of a line not yet applied (idempotent).  Returns the
    keys applied by this call.  On failure the patches applied by this call are
    undone.

    ``patches``: explicit patches (default: :func:`for_line` of ``line``).
    ``line``: ``"0.27"`` | ``"0.33"`` (default: the installed vLLM's line).
    ``defer_unimported``: a patch whose target module is not imported yet is
    applied right after that module's first import instead of importing it now."""
    if patches is None:
        line = installed_line() if line is None else line
        if line not in LINES:
            raise ValueError(f"line: no patches for vLLM line {line!r} "
                             f"(known: {', '.join(LINES)})")
        patches = for_line(line)
    with _lock:
        in_force = {e.patch.line for e in _applied.values()}
        in_force |= {p.line for bucket in _pending.values() for p in bucket}
        if len(in_force | {p.line for p in patches}) > 1:
            raise RuntimeError(
                f"patches of vLLM line(s) {sorted(in_force)} are in force; undo_all() before "
                f"applying line(s) {sorted({p.line for p in patches})}")
        todo = [p for p in patches if p.key not in _applied]
        now = [p for p in todo if not defer_unimported or p.module in sys.modules]
        later = [p for p in todo if p not in now]
        done = _apply_module_patches(now)
        for patch in later:
            bucket = _pending.setdefault(patch.module, [])
            if all(q.key != patch.key for q in bucket):
                bucket.append(patch)
        if _pending:
            _install_hook()
    if done:
        logger.debug("vllm-dsa-varlen: applied %d patches: %s", len(done), ", ".join(done))
    if later:
        logger.debug("vllm-dsa-varlen: %d patches wait for their module's import: %s",
                     len(later), ", ".join(p.key for p in later))
    return done


# --------------------------------------------------------------------------------------
# Deferred patches: applied right after their module's first import
# --------------------------------------------------------------------------------------

_pending: dict[str, list[Patch]] = {}


def _apply_pending(module_name: str) -> None:
    with _lock:
        patches = _pending.pop(module_name, [])
        if not _pending:
            _remove_hook()
        if patches:
            done = _apply_module_patches(patches)
            logger.debug("vllm-dsa-varlen: applied on import of %s: %s", module_name,
                         ", ".join(done))


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then applies the module's pending patches."""

    def __init__(self, inner: Any, name: str):
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _apply_pending(self._name)

    def __getattr__(self, attr: str) -> Any:  # get_source, is_package, ...
        return getattr(self._inner, attr)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds target modules with the other finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


_hook = _PatchOnImport()


def _install_hook() -> None:
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


def _remove_hook() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def pending() -> list[Patch]:
    """Patches waiting for their module's first import."""
    with _lock:
        return [p for bucket in _pending.values() for p in bucket]


def _undo_one(entry: _Applied) -> None:
    current = _raw(entry.owner, entry.name)
    if current is not entry.replacement:
        logger.warning("vllm-dsa-varlen: %s was replaced again by someone else; "
                       "restoring the original anyway", entry.patch.key)
    if entry.original is _MISSING:
        if current is not _MISSING:
            delattr(entry.owner, entry.name)
    else:
        setattr(entry.owner, entry.name, entry.original)


def undo_all() -> list[str]:
    """Restore every original, in reverse order of application, and drop the
    patches still waiting for an import.  Returns the keys restored."""
    with _lock:
        _pending.clear()
        _remove_hook()
        keys = list(_applied)
        for key in reversed(keys):
            _undo_one(_applied.pop(key))
    return keys


def applied() -> list[Patch]:
    """The patches in force, in the order they were applied."""
    with _lock:
        return [entry.patch for entry in _applied.values()]


def original(module: str, attribute: str) -> Any:
    """The stock attribute a patch replaced (raises KeyError when not applied)."""
    with _lock:
        entry = _applied[f"{module}:{attribute}"]
    if entry.original is _MISSING:
        raise KeyError(f"{module}:{attribute} had no original")
    return entry.original


def replacement_of(patch: Patch) -> Callable[..., Any] | Any:
    """The object installed for ``patch`` (raises KeyError when not applied)."""
    with _lock:
        return _applied[patch.key].replacement


def describe() -> str:
    """The registry as a Markdown table (module, attribute, upstream, reason),
    every line's patches in registry order."""
    lines = ["| module | attribute | upstream | reason |", "|---|---|---|---|"]
    lines += [f"| `{p.module}` | `{p.attribute}` | {p.upstream} | {p.reason} |" for p in PATCHES]
    return "\n".join(lines)


def describe_installed() -> str:
    """One line on the installed vLLM against its line's recorded shapes:
    whether the plugin would patch it, and each difference where not."""
    line = installed_line()
    if line not in LINES:
        return f"installed vLLM line: {line or 'none'}: no patch set (stock behaviour)"
    differences = upstream_differences(line)
    if not differences:
        return (f"installed vLLM ({line} line): its source has what every patch of the line "
                f"was written against ({LINES[line]})")
    return (f"installed vLLM ({line} line) differs from {LINES[line]}; not patched (stock "
            "behaviour):\n" + "\n".join(f"- {d}" for d in differences))


if __name__ == "__main__":
    print(describe())
    print()
    print(describe_installed())
