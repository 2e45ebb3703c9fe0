"""DeepGEMM indexer wrappers with varlen run ids; mirrors ``vllm/utils/deep_gemm.py``.

vLLM 0.27.1's paged-logits scheduler and kernel calls must carry the run ids
(``indices``) of a varlen step; they are forwarded only when set, so every
other call is stock's.  The wrappers also adapt to the DeepGEMM API
generation installed, told apart by the functions' signatures
(:class:`DeepGemmCaps`), never a version string: the one 0.27.1 was built
with (``clean_logits``, float32 logits) and 2.8.x (no ``clean_logits``,
emulated here; bf16 weights and logits on SM100, converted; row-compressed
prefill logits, realigned).  The DeepGEMM functions are resolved as vLLM
resolves them, so a test double set there is used here too; the helpers
that do the argument work take the function as an argument and import
nothing from vLLM.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "DeepGemmCaps", "param_names", "detect_caps", "current_caps",
    "get_paged_mqa_logits_metadata", "fp8_fp4_paged_mqa_logits", "fp8_fp4_mqa_logits",
    "call_metadata", "call_paged_logits", "call_prefill_logits", "mask_beyond",
    "check_indices", "check_varlen_layout",
]

logger = logging.getLogger("vllm.dsa_varlen")
_logged: set[str] = set()


@dataclass(frozen=True)
class DeepGemmCaps:
    """What the installed DeepGEMM's indexer functions accept (detected from
    their signatures, never from a version string).

    ``paged_indices`` / ``metadata_indices``: ``fp8_fp4_paged_mqa_logits`` /
    ``get_paged_mqa_logits_metadata`` take an ``indices`` argument (both do in
    the DeepGEMM 2.6.1 vLLM 0.27.1 vendors and in 2.8.x).
    ``paged_clean_logits`` / ``prefill_clean_logits``: the paged / prefill
    logits functions take ``clean_logits`` (the vendored 2.6.1 does; 2.8.x
    does not).
    ``prefill_max_seqlen_k``: the prefill function takes ``max_seqlen_k``
    (2.8.x: row-compressed prefill logits).
    ``signatures_known``: the argument names could be read at all.
    """

    has_paged: bool = True
    has_metadata: bool = True
    has_prefill: bool = True
    paged_indices: bool = False
    metadata_indices: bool = False
    paged_clean_logits: bool = True
    prefill_clean_logits: bool = True
    prefill_max_seqlen_k: bool = False
    signatures_known: bool = True

    @property
    def varlen(self) -> bool:
        """Both the scheduler and the kernel accept run ids."""
        return self.has_paged and self.has_metadata and self.paged_indices and self.metadata_indices


def _log_once(level: int, msg: str, *args: Any) -> None:
    if msg not in _logged:
        _logged.add(msg)
        logger.log(level, msg, *args)


# --------------------------------------------------------------------------------------
# Signature detection
# --------------------------------------------------------------------------------------

def _top_level(text: str, start: int = 0):
    """Yield ``(index, char, depth)`` for the characters of ``text`` from
    ``start`` that are outside quotes; ``depth`` counts open brackets *after*
    the character."""
    depth, quote = 0, None
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        yield i, ch, depth


def _split_top_level(text: str) -> list[str]:
    """Split ``text`` at commas not nested in brackets or quotes."""
    parts, start = [], 0
    for i, ch, depth in _top_level(text):
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _args_of_line(line: str, name: str | None) -> list[str] | None:
    """Argument names of a pybind signature line ``name(a: T, b: U = x) -> R``."""
    line = line.strip()
    if line[:1].isdigit():  # "1. name(...)" in an overloaded docstring
        line = line.split(".", 1)[1].strip()
    open_at = line.find("(")
    if open_at <= 0:
        return None
    if name is not None and line[:open_at].strip() != name:
        return None
    close_at = next((i for i, ch, depth in _top_level(line, open_at)
                     if ch in ")]}" and depth == 0), -1)
    if close_at < 0:
        return None
    names = []
    for part in _split_top_level(line[open_at + 1:close_at]):
        arg = part.split(":", 1)[0].split("=", 1)[0].strip().lstrip("*")
        if arg in ("", "/"):
            continue
        if not arg.isidentifier():
            return None
        names.append(arg)
    return names


def _names_from_doc(doc: str | None, name: str | None) -> tuple[str, ...] | None:
    if not doc:
        return None
    lines = [ln for ln in doc.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    first = _args_of_line(lines[0], name)
    if first is not None and first not in (["args", "kwargs"],):
        return tuple(first)
    # pybind overloads: "name(*args, **kwargs)\nOverloaded function.\n\n1. name(...)".
    names: list[str] = []
    for line in lines[1:]:
        if line.strip()[:1].isdigit():
            args = _args_of_line(line, name)
            if args:
                names.extend(a for a in args if a not in names)
    return tuple(names) or None


def param_names(fn: Callable[..., Any] | None) -> tuple[str, ...] | None:
    """Argument names of ``fn``: ``inspect.signature``, else the first line of
    its ``__doc__`` (pybind functions have no signature but document it there).
    ``None`` when neither works."""
    if fn is None:
        return None
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    return _names_from_doc(getattr(fn, "__doc__", None), getattr(fn, "__name__", None))


def detect_caps(paged: Callable[..., Any] | None, metadata: Callable[..., Any] | None,
                prefill: Callable[..., Any] | None = None) -> DeepGemmCaps | None:
    """Capabilities of DeepGEMM's indexer functions (``None`` when none exists).

    Unreadable signatures are taken as ``clean_logits`` accepted and no
    ``indices`` -- the call stock makes, the only safe assumption."""
    if paged is None and metadata is None and prefill is None:
        return None
    paged_names = param_names(paged)
    meta_names = param_names(metadata)
    prefill_names = param_names(prefill)
    known = all(n is not None for f, n in ((paged, paged_names), (metadata, meta_names),
                                          (prefill, prefill_names)) if f is not None)
    return DeepGemmCaps(
        has_paged=paged is not None,
        has_metadata=metadata is not None,
        has_prefill=prefill is not None,
        paged_indices=paged_names is not None and "indices" in paged_names,
        metadata_indices=meta_names is not None and "indices" in meta_names,
        paged_clean_logits=paged_names is None or "clean_logits" in paged_names,
        prefill_clean_logits=prefill_names is None or "clean_logits" in prefill_names,
        prefill_max_seqlen_k=prefill_names is not None and "max_seqlen_k" in prefill_names,
        signatures_known=known,
    )


_caps_cache: tuple[tuple[Any, Any, Any], DeepGemmCaps | None] | None = None


def _caps_for(paged, metadata, prefill) -> DeepGemmCaps | None:
    """Cached :func:`detect_caps` keyed by the function objects themselves."""
    global _caps_cache
    key = (paged, metadata, prefill)
    cached = _caps_cache
    if cached is not None and all(a is b for a, b in zip(cached[0], key)):
        return cached[1]
    caps = detect_caps(paged, metadata, prefill)
    _caps_cache = (key, caps)
    return caps


# --------------------------------------------------------------------------------------
# Argument work (no vLLM imports; the DeepGEMM function comes in as ``impl``)
# --------------------------------------------------------------------------------------

def check_indices(indices: torch.Tensor, rows: int) -> None:
    """Host-side checks of DeepGEMM's run-id contract (no device sync).

    ``indices``: int32 ``[rows]``, contiguous, start 8-byte aligned."""
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"indices: expected an int32 tensor [{rows}], got {type(indices).__name__}")
    if indices.dtype != torch.int32:
        raise ValueError(f"indices: expected dtype torch.int32, got {indices.dtype}")
    if indices.dim() != 1 or indices.shape[0] != rows:
        raise ValueError(f"indices: expected shape [{rows}] (one id per row), "
                         f"got {tuple(indices.shape)}")
    if not indices.is_contiguous():
        raise ValueError("indices: expected a contiguous tensor")
    if indices.data_ptr() % 8:
        raise ValueError(f"indices: expected an 8-byte aligned start, got {hex(indices.data_ptr())}")


def check_varlen_layout(q_values: torch.Tensor, weights: torch.Tensor | None,
                        context_lens: torch.Tensor, block_tables: torch.Tensor | None,
                        rows: int) -> None:
    """Host-side shape checks of a call that carries ``indices`` (no device sync).

    The run ids tie ``rows`` one-token rows together, so every per-row argument
    must be in the varlen layout: ``q`` values ``[R, 1, H, D']`` (``next_n ==
    1``), ``weights [R, H]``, ``context_lens`` int32 ``[R, 1]``,
    ``block_tables`` int32 ``[>= R, W]``.  ``weights`` / ``block_tables`` may
    be ``None`` (the scheduler call has neither)."""
    if q_values is not None and (q_values.dim() != 4 or q_values.shape[0] != rows
                                 or q_values.shape[1] != 1):
        raise ValueError(f"q: with indices (varlen) expected values [{rows}, 1, H, D] "
                         f"(next_n == 1, one row per id), got {tuple(q_values.shape)}")
    if weights is not None and (weights.dim() != 2 or weights.shape[0] != rows):
        raise ValueError(f"weights: with indices (varlen) expected [{rows}, H], "
                         f"got {tuple(weights.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (rows, 1):
        raise ValueError(f"context_lens: with indices (varlen) expected int32 [{rows}, 1], "
                         f"got {context_lens.dtype} {tuple(context_lens.shape)}")
    if block_tables is not None and (block_tables.dtype != torch.int32
                                     or block_tables.dim() != 2
                                     or block_tables.shape[0] < rows):
        raise ValueError(f"block_table: with indices (varlen) expected int32 [>= {rows}, W], "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")


def mask_beyond(logits: torch.Tensor, end: torch.Tensor, start: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Set ``logits[r, c] = -inf`` for ``c >= end[r]`` (and ``c < start[r]``), in place.

    ``logits``: float ``[rows, width]``; ``end`` / ``start``: int, ``rows``
    elements in any shape (e.g. ``[B, next_n]`` context lengths)."""
    rows, width = logits.shape
    cols = torch.arange(width, device=logits.device)
    invalid = cols[None, :] >= end.reshape(rows, 1)
    if start is not None:
        invalid |= cols[None, :] < start.reshape(rows, 1)
    return logits.masked_fill_(invalid, float("-inf"))


def _to_fp32(logits: torch.Tensor, what: str) -> torch.Tensor:
    if logits.dtype == torch.float32:
        return logits
    _log_once(logging.INFO,
              "vllm-dsa-varlen: DeepGEMM %s returned %s logits; converting to float32 "
              "for vLLM 0.27.1's top-k kernels", what, logits.dtype)
    return logits.float()


def _weights_for(weights: torch.Tensor, bf16_weights: bool, what: str) -> torch.Tensor:
    if not bf16_weights or weights.dtype == torch.bfloat16:
        return weights
    _log_once(logging.INFO,
              "vllm-dsa-varlen: DeepGEMM 2.8.x %s on SM100 takes bf16 weights; "
              "converting vLLM's %s weights", what, weights.dtype)
    return weights.to(torch.bfloat16)


def call_metadata(impl: Callable[..., Any], caps: DeepGemmCaps | None,
                  context_lens: torch.Tensor, block_size: int, num_sms: int,
                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """Call DeepGEMM's ``get_paged_mqa_logits_metadata``.

    ``context_lens``: int32 ``[B, next_n]``.  Without ``indices`` the call is
    exactly stock's ``impl(context_lens, block_size, num_sms)``; with them
    (int32 ``[B]``, ``next_n == 1``) they are passed as ``indices=``."""
    if indices is None:
        return impl(context_lens, block_size, num_sms)
    if caps is None or not caps.metadata_indices:
        raise RuntimeError("indices: the installed DeepGEMM's get_paged_mqa_logits_metadata "
                           "takes no `indices` (varlen decode needs a DeepGEMM that does -- "
                           "vLLM 0.27.1's vendored 2.6.1 or 2.8.x -- on SM10x)")
    check_indices(indices, context_lens.shape[0])
    check_varlen_layout(None, None, context_lens, None, indices.shape[0])
    return impl(context_lens, block_size, num_sms, indices=indices)


def call_paged_logits(
    impl: Callable[..., Any],
    caps: DeepGemmCaps | None,
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor,
    max_model_len: int,
    clean_logits: bool,
    indices: torch.Tensor | None = None,
    *,
    sm100: Callable[[], bool] = lambda: False,
) -> torch.Tensor:
    """Call DeepGEMM's ``fp8_fp4_paged_mqa_logits``; float32 ``[rows, max_model_len]``.

    Shapes as in stock's wrapper: ``q = (values [B, next_n, H, D'], scales or
    None)``, ``weights [B * next_n, H]``, ``context_lens`` int32 ``[B,
    next_n]``, ``block_tables`` int32 ``[B, W]``.  ``indices`` (int32 ``[B]``,
    ``next_n == 1``) is passed only when set.  ``sm100`` is asked (only for the
    2.8.x API) whether the device is SM10x."""
    api_28 = caps is not None and not caps.paged_clean_logits
    kwargs: dict[str, Any] = {}
    if not api_28:
        kwargs["clean_logits"] = clean_logits
    if indices is not None:
        if caps is None or not caps.paged_indices:
            raise RuntimeError("indices: the installed DeepGEMM's fp8_fp4_paged_mqa_logits "
                               "takes no `indices` (varlen decode needs a DeepGEMM that does -- "
                               "vLLM 0.27.1's vendored 2.6.1 or 2.8.x -- on SM10x)")
        check_indices(indices, q[0].shape[0])
        check_varlen_layout(q[0], weights, context_lens, block_tables, indices.shape[0])
        kwargs["indices"] = indices
    if api_28:
        weights = _weights_for(weights, sm100(), "fp8_fp4_paged_mqa_logits")
    logits = impl(q, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                  max_model_len, **kwargs)
    logits = _to_fp32(logits, "fp8_fp4_paged_mqa_logits")
    if api_28 and clean_logits:
        mask_beyond(logits, context_lens)
    return logits


def call_prefill_logits(
    impl: Callable[..., Any],
    caps: DeepGemmCaps | None,
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool,
    *,
    sm100: Callable[[], bool] = lambda: False,
) -> torch.Tensor:
    """Call DeepGEMM's ``fp8_fp4_mqa_logits``; float32 ``[M, N]`` in stock's
    layout (column ``n`` scores KV row ``n``; ``N = kv[0].shape[0]``).

    On the API 0.27.1 was built with this is exactly stock's call.  On 2.8.x
    (``max_seqlen_k``, row-compressed output: row ``i`` holds its span
    ``[ks[i], ke[i])`` from column 0) every row is given the span ``[0,
    ke[i])`` with ``max_seqlen_k = N``, which makes the compressed layout the
    absolute one with no extra memory and no host sync; the price is scoring
    KV rows ``[0, ks[i])`` that the top-k never reads (more work when a prefill
    chunk holds several requests)."""
    if caps is None or caps.prefill_clean_logits:
        return impl(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean_logits)
    weights = _weights_for(weights, sm100(), "fp8_fp4_mqa_logits")
    if caps.prefill_max_seqlen_k:
        _log_once(logging.INFO,
                  "vllm-dsa-varlen: DeepGEMM fp8_fp4_mqa_logits writes row-compressed "
                  "logits; prefill rows are scored from KV row 0 to keep vLLM 0.27.1's layout")
        num_kv = kv[0].shape[0]
        logits = impl(q, kv, weights, torch.zeros_like(cu_seqlen_ks), cu_seqlen_ke,
                      max_seqlen_k=num_kv)
    else:
        logits = impl(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke)
    logits = _to_fp32(logits, "fp8_fp4_mqa_logits")
    if clean_logits:
        mask_beyond(logits, cu_seqlen_ke, cu_seqlen_ks)
    return logits


# --------------------------------------------------------------------------------------
# vLLM-facing wrappers (resolve DeepGEMM through vllm.utils.deep_gemm)
# --------------------------------------------------------------------------------------

_vdg_module: Any = None


def _vdg() -> Any:
    global _vdg_module
    if _vdg_module is None:
        import vllm.utils.deep_gemm as vdg
        _vdg_module = vdg
    return _vdg_module


def _impls() -> tuple[Any, Any, Any]:
    vdg = _vdg()
    vdg._lazy_init()
    return (vdg._fp8_fp4_paged_mqa_logits_impl, vdg._get_paged_mqa_logits_metadata_impl,
            vdg._fp8_fp4_mqa_logits_impl)


def _is_sm100() -> bool:
    from vllm.platforms import current_platform
    return bool(current_platform.is_device_capability_family(100))


def current_caps() -> DeepGemmCaps | None:
    """Capabilities of the DeepGEMM vLLM resolves (``None`` when it has none).

    Imports DeepGEMM on first use, as vLLM's own wrappers do."""
    return _caps_for(*_impls())


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_size: int, num_sms: int,
                                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """Scheduling metadata for paged MQA logits (see stock's docstring).

    ``context_lens`` int32 ``[B, next_n]``; ``indices`` int32 ``[B]`` run ids
    (varlen, ``next_n == 1``), forwarded only when set."""
    paged, metadata, prefill = _impls()
    if metadata is None:
        return _vdg()._missing()
    caps = _caps_for(paged, metadata, prefill) if indices is not None else None
    return call_metadata(metadata, caps, context_lens, block_size, num_sms, indices)


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor,
    max_model_len: int,
    clean_logits: bool,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged MQA logits, float32 ``[B * next_n, max_model_len]`` (see
    :func:`call_paged_logits` and stock's docstring); ``indices`` int32 ``[B]``
    run ids, forwarded only when set."""
    paged, metadata, prefill = _impls()
    if paged is None:
        return _vdg()._missing()
    caps = _caps_for(paged, metadata, prefill)
    return call_paged_logits(paged, caps, q, kv_cache, weights, context_lens, block_tables,
                             schedule_metadata, max_model_len, clean_logits, indices,
                             sm100=_is_sm100)


def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool,
) -> torch.Tensor:
    """Prefill MQA logits, float32 ``[M, N]`` (see :func:`call_prefill_logits`)."""
    paged, metadata, prefill = _impls()
    if prefill is None:
        return _vdg()._missing()
    caps = _caps_for(paged, metadata, prefill)
    return call_prefill_logits(prefill, caps, q, kv, weights, cu_seqlen_ks, cu_seqlen_ke,
                               clean_logits, sm100=_is_sm100)
