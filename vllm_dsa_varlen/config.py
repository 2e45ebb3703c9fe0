"""Configuration: the plugin's environment variables and its pure decision functions.

* ``VLLM_DSA_VARLEN``: ``auto`` (default), ``off`` or ``stock``.  ``off``
  leaves every decode step on stock vLLM's path (the plugin also skips
  patching when it is ``off`` at start-up).  ``stock`` is stock vLLM too, with
  only the DeepGEMM API adapters applied (``patches.Patch.api``): the baseline
  to compare against where the installed DeepGEMM is not the generation vLLM
  was built with (e.g. vLLM 0.27.1 beside DeepGEMM 2.8.x, whose calls stock
  0.27.1 cannot make).
* ``VLLM_DSA_VARLEN_BACKEND``: ``auto`` (default), ``deepgemm`` or ``triton``.
  ``triton`` names the project's own kernels (the name of the first of them):
  :mod:`vllm_dsa_varlen.ops.launcher` runs the CUDA sm_90 kernel where it
  serves and the Triton kernels elsewhere, so a log line's "varlen (triton)"
  on an H100/H200 is the CUDA kernel.
* ``VLLM_DSA_VARLEN_FUSED_Q``: ``auto`` (default), ``on`` or ``off``: the
  step's query preparation (vLLM 0.33's ``fused_q``: RoPE, fp8 quant, indexer
  weights; vLLM 0.27's ``fused_indexer_q_rope_quant``: the indexer's part).
  ``auto`` takes the project's kernel where it was measured (sm_90, both
  lines); ``on`` takes it on any fp8 CUDA GPU, measured or not; ``off``
  keeps vLLM's (:func:`choose_fused_q`).
  ``VLLM_DSA_VARLEN_FUSED_Q_BLOCKS=index/pe/nope/warps`` (powers of two) sets
  that kernel's heads per program and warps (tuning; default the measured
  best, ``ops.triton_fused_q.Blocks``; vLLM 0.27's kernel takes ``index``
  and ``warps``).

:func:`choose_decode_path` turns the facts a builder knows (platform, GPU
capability, the installed DeepGEMM's capabilities, whether the project's
kernels can serve this cache, ``next_n``, FP4 cache, the two settings) into a
:class:`DecodePath`.  It reads no global state, so the decision table is
tested directly.  Nothing here imports vLLM.

The builder-level decision says whether a varlen backend can serve a builder
and, for the project's kernels (``triton``), which of stock's paths each step
is compared with (``DecodePath.per_step``); the per-step choice itself is
:func:`vllm_dsa_varlen.policy.varlen_wins`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping

MODE_ENV = "VLLM_DSA_VARLEN"
BACKEND_ENV = "VLLM_DSA_VARLEN_BACKEND"
FUSED_Q_ENV = "VLLM_DSA_VARLEN_FUSED_Q"
MODES = ("auto", "off", "stock")
FUSED_Q_SETTINGS = ("auto", "on", "off")
BACKENDS = ("auto", "deepgemm", "triton")

# fp8 (e4m3) tensor-core support starts with Ada / Hopper.
MIN_FP8_CAPABILITY = (8, 9)
SM100_MAJOR = 10


def _read(name: str, allowed: tuple[str, ...], environ: Mapping[str, str] | None) -> str:
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return allowed[0]
    value = raw.strip().lower()
    if value not in allowed:
        raise ValueError(
            f"{name}={raw!r} is not valid: expected one of {', '.join(allowed)} "
            f"(default {allowed[0]})")
    return value


def read_mode(environ: Mapping[str, str] | None = None) -> str:
    """``VLLM_DSA_VARLEN`` -> ``"auto"`` | ``"off"`` | ``"stock"`` (unset or
    empty: ``"auto"``)."""
    return _read(MODE_ENV, MODES, environ)


def read_backend(environ: Mapping[str, str] | None = None) -> str:
    """``VLLM_DSA_VARLEN_BACKEND`` -> ``"auto"`` | ``"deepgemm"`` | ``"triton"``."""
    return _read(BACKEND_ENV, BACKENDS, environ)


def read_fused_q(environ: Mapping[str, str] | None = None) -> str:
    """``VLLM_DSA_VARLEN_FUSED_Q`` -> ``"auto"`` | ``"on"`` | ``"off"``."""
    return _read(FUSED_Q_ENV, FUSED_Q_SETTINGS, environ)


FUSED_Q_BLOCKS_ENV = "VLLM_DSA_VARLEN_FUSED_Q_BLOCKS"


def read_fused_q_blocks(environ: Mapping[str, str] | None = None) -> tuple[int, int, int, int] | None:
    """``VLLM_DSA_VARLEN_FUSED_Q_BLOCKS=index/pe/nope/warps`` -> four powers of
    two (``None`` when unset or empty)."""
    env = os.environ if environ is None else environ
    raw = (env.get(FUSED_Q_BLOCKS_ENV) or "").strip()
    if not raw:
        return None
    try:
        fields = tuple(int(x) for x in raw.split("/"))
    except ValueError:
        fields = ()
    if len(fields) != 4 or any(f <= 0 or f & (f - 1) for f in fields):
        raise ValueError(f"{FUSED_Q_BLOCKS_ENV}={raw!r} is not valid: expected four powers of two "
                         "index/pe/nope/warps (heads per program of each part, warps), e.g. 8/16/2/2")
    return fields  # type: ignore[return-value]


# The query preparation was measured (and bit-checked against vLLM's kernel)
# on this GPU family only.
FUSED_Q_CAPABILITY_MAJOR = 9


def choose_fused_q(*, is_cuda: bool, capability: tuple[int, int] | None, setting: str = "auto",
                   mode: str = "auto", measured: bool = True) -> tuple[bool, str]:
    """Whether the project's query preparation replaces vLLM's kernel on this
    GPU, and why (pure).  ``measured``: whether this vLLM line's kernel was
    measured on sm_90 (0.33's ``fused_q`` and 0.27's indexer query: yes).
    Rules: ``VLLM_DSA_VARLEN`` off or stock, or ``VLLM_DSA_VARLEN_FUSED_Q=off``
    -> vLLM's.  Not CUDA / unknown capability -> vLLM's.  ``on``: the
    project's on a GPU with fp8 (sm_89 and later), vLLM's below.  ``auto``:
    the project's on sm_90 where ``measured`` (vLLM launches a one-warp Triton
    program per token, part and head there; SM100 has its own CuTeDSL kernel
    in 0.33, left alone), vLLM's everywhere else.  Shapes the kernel cannot
    take fall back per call (``input_problem`` of the kernel's module)."""
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
    cap = _fmt_cap(capability)
    ours = f"the project's kernel ({cap}: a program per token and block of heads"
    if setting == "on":
        if capability < MIN_FP8_CAPABILITY:
            return False, f"vLLM's kernel ({cap}: no fp8, although {FUSED_Q_ENV}=on)"
        return True, f"{ours}; {FUSED_Q_ENV}=on)"
    if capability[0] != FUSED_Q_CAPABILITY_MAJOR:
        return False, f"vLLM's kernel ({cap}: the project's is measured on sm_90 only)"
    if not measured:
        return False, (f"vLLM's kernel (the project's for this vLLM is not measured yet; "
                       f"{FUSED_Q_ENV}=on takes it)")
    return True, f"{ours}, bit-equal to vLLM's)"


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


@dataclass(frozen=True)
class DecodePath:
    """The decode path of a builder.

    ``use_varlen``: flatten decode rows and hand run ids to the kernel.
    ``backend``: ``"deepgemm"`` | ``"triton"`` when varlen, else ``None``.
    ``reason``: one human sentence saying why.
    ``warning``: the setting asked for something that cannot run here.
    ``per_step``: which of stock's paths each step is compared with
    (:func:`vllm_dsa_varlen.policy.varlen_wins`), or ``None`` when every
    decode step takes the varlen kernel:

    * ``"flattened"``: stock flattens every multi-token step (Hopper-class
      GPUs with ``next_n > 2``).  Every step gets the flattened rows and run
      ids; the kernel call goes to the varlen kernel or to stock's id-less
      DeepGEMM call on the same rows, per step.
    * ``"split"``: stock runs DeepGEMM's native ``[B, next_n]`` kernel on
      uniform steps and sends the requests after the first length mismatch
      to the prefill path (``next_n == 2`` off SM10x; SM10x without a
      DeepGEMM that takes ids).  Uniform steps keep stock's native path;
      a step stock would split is flattened and takes the varlen kernel.
    """

    use_varlen: bool
    backend: str | None
    reason: str
    warning: bool = False
    per_step: str | None = None

    def describe(self) -> str:
        path = f"varlen ({self.backend})" if self.use_varlen else "stock"
        if self.per_step == "flattened":
            path += ", per step against stock's flattened DeepGEMM call"
        elif self.per_step == "split":
            path += " for the steps stock splits; uniform steps stay stock's native path"
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
    """Why stock is kept before any kernel is considered (every vLLM line's
    first rules), or ``None``: ``VLLM_DSA_VARLEN=off``, not CUDA, or the device
    capability unknown (``stock`` counts as ``off`` here: its builders are
    stock's)."""
    if mode in ("off", "stock"):
        return f"{MODE_ENV}={mode}"
    if not is_cuda:
        return "not a CUDA platform"
    if capability is None:
        return "CUDA device capability unknown"
    return None


def _stock(reason: str, warning: bool = False) -> DecodePath:
    return DecodePath(False, None, reason, warning)


def _fmt_cap(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def choose_decode_path(
    *,
    is_cuda: bool,
    capability: tuple[int, int] | None,
    deepgemm: DeepGemmCaps | None,
    triton_ok: bool,
    next_n: int,
    fp4_cache: bool,
    mode: str = "auto",
    backend: str = "auto",
) -> DecodePath:
    """Decide a builder's decode path (pure; see the module docstring).

    Rules, in order: ``mode == "off"`` -> stock.  Not CUDA / no capability ->
    stock.  SM10x with a DeepGEMM whose scheduler and kernel take ``indices``
    (vLLM 0.27.1's vendored 2.6.1 and 2.8.x both do) -> DeepGEMM varlen for
    every step, any ``next_n``.  Otherwise, with an fp8-capable GPU
    (>= sm_89), a usable kernel of the project's, an FP8 cache and
    ``next_n >= 2`` -> the project's varlen kernels, compared per step with
    the path stock would take (``per_step``, see :class:`DecodePath`): ``"flattened"`` where stock
    flattens (``next_n > 2`` off SM10x), ``"split"`` where stock runs
    DeepGEMM's native ``[B, next_n]`` kernel on uniform steps (``next_n ==
    2``, or SM10x); with no DeepGEMM installed stock has no decode kernel,
    so every step takes Triton.  ``next_n == 1`` -> stock (varlen saves
    nothing).  A forced Triton backend takes every step (no per-step
    comparison).  The MXFP4 indexer cache is SM100 + DeepGEMM only (never
    Triton).  A forced backend that cannot run gives stock with
    ``warning=True``.
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
    cap = _fmt_cap(capability)
    sm10x = capability[0] == SM100_MAJOR

    dg_reason = _deepgemm_refusal(sm10x, cap, deepgemm)
    forced = backend == "triton"
    triton_reason = _triton_refusal(capability, cap, triton_ok, next_n, fp4_cache)

    if backend in ("auto", "deepgemm") and dg_reason is None:
        return DecodePath(True, "deepgemm",
                          f"{cap} with a DeepGEMM whose paged MQA logits take run ids "
                          f"(next_n={next_n}, {'MXFP4' if fp4_cache else 'FP8'} cache)")
    if backend == "deepgemm":
        return _stock(f"{BACKEND_ENV}=deepgemm but {dg_reason}", warning=True)
    if triton_reason is None:
        per_step = None if forced else _stock_kind(sm10x, next_n, deepgemm)
        why = {None: "forced" if forced else "no DeepGEMM installed: stock has no decode kernel",
               "flattened": "stock flattens and re-reads the KV per token",
               "split": "stock splits non-uniform steps to the prefill path"}[per_step]
        return DecodePath(True, "triton",
                          f"{cap}, FP8 cache, next_n={next_n} ({why}): the project's varlen "
                          "kernels read each KV page once per request (ops.launcher: CUDA "
                          "sm_90 where it serves, else Triton)", per_step=per_step)
    if forced:
        return _stock(f"{BACKEND_ENV}=triton but {triton_reason}", warning=True)
    return _stock(f"no varlen backend: {dg_reason}; {triton_reason}")


def _stock_kind(sm10x: bool, next_n: int, deepgemm: DeepGemmCaps | None) -> str | None:
    """What stock 0.27.1 runs for a multi-token step on this GPU (``None``: it
    has no decode kernel without DeepGEMM)."""
    if deepgemm is None:
        return None
    if sm10x or next_n == 2:
        return "split"  # native [B, next_n] on uniform steps, prefill for the rest
    return "flattened"


def _deepgemm_refusal(sm10x: bool, cap: str, deepgemm: DeepGemmCaps | None) -> str | None:
    if not sm10x:
        return f"DeepGEMM varlen needs SM10x (device is {cap})"
    if deepgemm is None:
        return "DeepGEMM is not installed"
    if not deepgemm.varlen:
        return ("the installed DeepGEMM's paged MQA logits take no `indices` "
                "(vLLM 0.27.1's vendored 2.6.1 and 2.8.x do)")
    return None


def _triton_refusal(capability: tuple[int, int], cap: str, triton_ok: bool, next_n: int,
                    fp4_cache: bool) -> str | None:
    if fp4_cache:
        return "the MXFP4 indexer cache is served by DeepGEMM on SM100 only (never Triton)"
    if capability < MIN_FP8_CAPABILITY:
        return f"{cap} has no fp8 support (the project's varlen kernels need >= sm_89)"
    if not triton_ok:
        return "the project's varlen kernel is unavailable or does not support this cache"
    if next_n == 1:
        return "next_n == 1: one row per request, varlen would save nothing"
    return None
