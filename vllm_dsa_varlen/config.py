"""The builder-level decisions every vLLM line shares, as pure functions.

:func:`choose_decode_path` says whether a varlen backend serves an indexer
metadata builder; each line adds only what differs (:class:`LineFacts`).
:func:`choose_fused_q` says whether the project's query preparation replaces
vLLM's.  The facts come in as arguments (the settings are read by the callers,
through :mod:`vllm_dsa_varlen.settings`), so the decision tables are tested
directly.  Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from .settings import (BACKEND_ENV, BACKENDS, FUSED_Q_ENV, FUSED_Q_SETTINGS, MODE_ENV,
                       MODES)

# fp8 (e4m3) tensor-core support starts with Ada / Hopper.
MIN_FP8_CAPABILITY = (8, 9)
SM100_MAJOR = 10
# The query preparation was measured, and bit-checked against vLLM's kernel,
# on this GPU family only.
FUSED_Q_CAPABILITY_MAJOR = 9
# What each of the project's logits kernels is called in a decode-path line.
KERNEL_LABELS = {"cuda_sm90": "cuda_sm90", "portable": "portable Triton",
                 "deepgemm": "DeepGEMM", None: "the project's kernels"}


def choose_fused_q(*, is_cuda: bool, capability: tuple[int, int] | None, setting: str = "auto",
                   mode: str = "auto") -> tuple[bool, str]:
    """Whether the project's query preparation replaces vLLM's kernel on this
    GPU, and why (pure).  ``off`` / ``stock`` modes, ``setting == "off"``, no
    CUDA or no capability: vLLM's.  ``on``: the project's on an fp8 GPU.
    ``auto``: the project's on sm_90, where it was measured (SM100 keeps vLLM's
    own kernel), vLLM's elsewhere.  Shapes the kernel cannot take fall back
    per call."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if setting not in FUSED_Q_SETTINGS:
        raise ValueError(f"setting: expected one of {FUSED_Q_SETTINGS}, got {setting!r}")
    refusal = platform_refusal(mode=mode, is_cuda=is_cuda, capability=capability)
    if refusal is None and setting == "off":
        refusal = f"{FUSED_Q_ENV}=off"
    if refusal is not None:
        return False, f"vLLM's kernel ({refusal})"
    capability = (int(capability[0]), int(capability[1]))
    cap = fmt_cap(capability)
    ours = f"the project's kernel ({cap}: a program per token and block of heads"
    if setting == "on":
        if capability < MIN_FP8_CAPABILITY:
            return False, f"vLLM's kernel ({cap}: no fp8, although {FUSED_Q_ENV}=on)"
        return True, f"{ours}; {FUSED_Q_ENV}=on)"
    if capability[0] != FUSED_Q_CAPABILITY_MAJOR:
        return False, f"vLLM's kernel ({cap}: the project's is measured on sm_90 only)"
    return True, f"{ours}, bit-equal to vLLM's)"


@dataclass(frozen=True)
class DecodePath:
    """The decode path of a builder.

    ``use_varlen``: flatten decode rows and hand run ids to the kernel.
    ``backend``: ``"deepgemm"`` | ``"own"`` (the project's kernels) when
    varlen, else ``None``.  ``reason``: one sentence saying why.
    ``warning``: the setting asked for something that cannot run here.
    ``per_step``: which of stock's paths each step is compared with
    (:func:`vllm_dsa_varlen.policy.varlen_wins`), or ``None`` when every
    decode step takes the varlen kernel:

    * ``"flattened"``: stock flattens every multi-token step; every step gets
      the flattened rows and run ids, and the kernel call goes to the varlen
      kernel or to stock's id-less call on the same rows, per step.
    * ``"split"``: stock runs DeepGEMM's native ``[B, next_n]`` kernel on
      uniform steps and splits the others to the prefill path; a step stock
      would split is flattened and takes the varlen kernel.
    * ``"each"``: each step is classified against what stock would run for it
      (native, flattened or split) by the line's builder.

    ``kernel``: the logits kernel a varlen step runs, where the builder knows
    it (:data:`KERNEL_LABELS`).
    """

    use_varlen: bool
    backend: str | None
    reason: str
    warning: bool = False
    per_step: str | None = None
    kernel: str | None = None

    def describe(self) -> str:
        if not self.use_varlen:
            return f"stock: {self.reason}"
        kernel = "deepgemm" if self.backend == "deepgemm" else self.kernel
        path = f"varlen ({KERNEL_LABELS.get(kernel, kernel)})"
        path += {None: "",
                 "flattened": ", per step against stock's flattened DeepGEMM call",
                 "split": " for the steps stock splits; uniform steps stay stock's native path",
                 "each": ", per step where measured at least as fast as stock's path "
                         "(policy.MEASURED), else stock's"}[self.per_step]
        return f"{path}: {self.reason}"


_logged_paths: set[str] = set()


def log_decode_path(path: DecodePath) -> None:
    """Log a builder's decode path on the ``vllm.dsa_varlen`` logger, once per
    distinct message in the process (every builder of a model decides alike):
    a warning when :attr:`DecodePath.warning`, else info."""
    msg = f"vllm-dsa-varlen: DSA indexer decode path: {path.describe()}"
    if msg not in _logged_paths:
        _logged_paths.add(msg)
        logging.getLogger("vllm.dsa_varlen").log(
            logging.WARNING if path.warning else logging.INFO, msg)


def platform_refusal(*, mode: str, is_cuda: bool,
                     capability: tuple[int, int] | None) -> str | None:
    """Why stock is kept before any kernel is considered, or ``None``: mode
    ``off`` or ``stock`` (whose builders are stock's), not CUDA, or the device
    capability unknown."""
    if mode in ("off", "stock"):
        return f"{MODE_ENV}={mode}"
    if not is_cuda:
        return "not a CUDA platform"
    if capability is None:
        return "CUDA device capability unknown"
    return None


@dataclass(frozen=True)
class LineFacts:
    """What one vLLM line adds to :func:`choose_decode_path` on a device.

    ``deepgemm_refusal``: why the plugin cannot drive DeepGEMM varlen here
    (``None``: it can).  ``upstream``: vLLM runs varlen itself here, said in
    words: stock's path is left alone.  ``stock``: what stock runs, in words.
    ``per_step``: the :attr:`DecodePath.per_step` of the project's kernels,
    and ``forced_per_step`` the one under a forced ``own`` backend.
    """

    deepgemm_refusal: str | None
    stock: str
    per_step: str | None = None
    forced_per_step: str | None = None
    upstream: str | None = None


def choose_decode_path(line: Callable[[tuple[int, int]], LineFacts], *, is_cuda: bool,
                       capability: tuple[int, int] | None, own_ok: bool, next_n: int,
                       fp4_cache: bool, mode: str = "auto", backend: str = "auto") -> DecodePath:
    """A builder's decode path (pure).  ``line``: the vLLM line's facts for a
    device of known capability; ``own_ok``: the project's kernels serve this
    cache and head count.

    Rules, in order: the platform refusal (:func:`platform_refusal`) -> stock.
    vLLM's own varlen (``upstream``) -> stock, a forced backend warned.
    DeepGEMM varlen the plugin drives -> it, unless ``own`` is forced; a forced
    ``deepgemm`` that cannot run -> stock with a warning.  Then the project's
    kernels, unless the MXFP4 cache, no fp8 (< sm_89), a kernel that does not
    serve, or ``next_n == 1`` (one row per request: nothing to save); a forced
    ``own`` that cannot run -> stock with a warning.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if next_n < 1:
        raise ValueError(f"next_n: expected >= 1, got {next_n}")
    refusal = platform_refusal(mode=mode, is_cuda=is_cuda, capability=capability)
    if refusal is not None:
        return _stock(refusal)
    capability = (int(capability[0]), int(capability[1]))
    cap = fmt_cap(capability)
    facts = line(capability)
    if facts.upstream is not None:
        if backend != "auto":
            return _stock(f"{BACKEND_ENV}={backend} ignored, {facts.upstream}", warning=True)
        return _stock(facts.upstream)
    if facts.deepgemm_refusal is None and backend in ("auto", "deepgemm"):
        return DecodePath(True, "deepgemm",
                          f"{cap} with a DeepGEMM whose paged MQA logits take run ids "
                          f"(next_n={next_n}, {'MXFP4' if fp4_cache else 'FP8'} cache)",
                          kernel="deepgemm")
    if backend == "deepgemm":
        return _stock(f"{BACKEND_ENV}=deepgemm but {facts.deepgemm_refusal}", warning=True)
    forced = backend == "own"
    own_refusal = _own_refusal(capability, cap, own_ok, next_n, fp4_cache)
    if own_refusal is None:
        why = f"forced by {BACKEND_ENV}=own" if forced else facts.stock
        return DecodePath(True, "own",
                          f"{cap}, FP8 cache, next_n={next_n} ({why}): the project's varlen "
                          "kernel reads each KV page once per request",
                          per_step=facts.forced_per_step if forced else facts.per_step)
    if forced:
        return _stock(f"{BACKEND_ENV}=own but {own_refusal}", warning=True)
    return _stock(f"no varlen backend: {facts.deepgemm_refusal}; {own_refusal}")


def own_kernel_serves(*, page: int | None, head_size: int | None, heads: int | None) -> bool:
    """Whether the project's varlen kernels take an indexer cache of ``page``
    entries of ``head_size`` bytes (fp8 values and a float32 scale) and
    ``heads`` index heads (``None``: unknown, taken).  False where they do not
    import (no Triton)."""
    try:
        from .ops import launcher
    except Exception:  # noqa: BLE001 - Triton missing or broken: no kernel of ours
        return False
    return (page in launcher.SUPPORTED_PAGES and head_size is not None
            and head_size - 4 in launcher.SUPPORTED_DIMS
            and (heads is None or heads in launcher.SUPPORTED_HEADS))


def _stock(reason: str, warning: bool = False) -> DecodePath:
    return DecodePath(False, None, reason, warning)


def fmt_cap(capability: tuple[int, int]) -> str:
    """``(9, 0)`` -> ``"sm_90"``."""
    return f"sm_{capability[0]}{capability[1]}"


def _own_refusal(capability: tuple[int, int], cap: str, own_ok: bool, next_n: int,
                 fp4_cache: bool) -> str | None:
    if fp4_cache:
        return "the MXFP4 indexer cache is served by DeepGEMM on SM100 only (never by the " \
               "project's kernels)"
    if capability < MIN_FP8_CAPABILITY:
        return f"{cap} has no fp8 support (the project's varlen kernels need >= sm_89)"
    if not own_ok:
        return "the project's varlen kernel is unavailable or does not support this cache"
    if next_n == 1:
        return "next_n == 1: one row per request, varlen would save nothing"
    return None
