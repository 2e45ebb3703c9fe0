"""The plugin's settings: every environment variable it reads, in one table
(:data:`SETTINGS`), read by one function (:func:`get`).

The names sit outside vLLM's ``VLLM_`` namespace, where vLLM warns about any
variable it does not know.  Each old ``VLLM_DSA_VARLEN*`` name is still read
as a deprecated alias of its new name (one warning per old name; where both
are set the new name wins, with a warning).  The plugin's ``register()``
calls :func:`validate`, so a bad value fails at start-up with a
``ValueError`` naming its variable.  Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Setting", "SETTINGS", "get", "validate", "markdown_table", "PREFIX", "OLD_PREFIX"]

PREFIX = "DSA_VARLEN"
OLD_PREFIX = "VLLM_" + PREFIX

MODE_ENV = PREFIX
BACKEND_ENV = f"{PREFIX}_BACKEND"
TOPK_ENV = f"{PREFIX}_TOPK"
FUSED_Q_ENV = f"{PREFIX}_FUSED_Q"
FUSED_Q_BLOCKS_ENV = f"{PREFIX}_FUSED_Q_BLOCKS"
KERNEL_ENV = f"{PREFIX}_KERNEL"
HEAD_SUM_ENV = f"{PREFIX}_HEAD_SUM"
PIPELINE_ENV = f"{PREFIX}_PIPELINE"
PDL_ENV = f"{PREFIX}_PDL"
NVRTC_ENV = f"{PREFIX}_NVRTC"

# The values each choice takes, the default first.
MODES = ("auto", "off", "stock")
BACKENDS = ("auto", "deepgemm", "own")
TOPK_SETTINGS = ("auto", "vllm", "own")
FUSED_Q_SETTINGS = ("auto", "on", "off")
KERNELS = ("auto", "portable", "sm90", "sm90_cuda")  # "sm90" and "sm90_cuda": the same kernel
HEAD_SUMS = ("fp32", "tf32")
# Values no longer taken, with what to ask for instead.
RETIRED_KERNELS = {"sm90_gluon": 'the sm_90 Gluon kernel was retired; "sm90" takes the sm_90 '
                                 'CUDA kernel'}
# Old spellings still taken, each with a warning: "triton" named the project's
# kernels after the first of them, though on Hopper they run CUDA.
BACKEND_ALIASES = {"triton": "own"}

logger = logging.getLogger("vllm.dsa_varlen")


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``name``; ``values`` (what it takes, as the
    README lists it, the default first); ``default`` (its value when unset or
    empty); ``meaning`` (one line); ``parse`` (the stripped text -> the value,
    ``ValueError`` saying what it expects)."""

    name: str
    values: str
    default: Any
    meaning: str
    parse: Callable[[str], Any]

    @property
    def old_name(self) -> str:
        """The deprecated name in vLLM's namespace, read as an alias."""
        return "VLLM_" + self.name


def _choice(name: str, allowed: tuple[str, ...], aliases: Mapping[str, str] | None = None,
            retired: Mapping[str, str] | None = None) -> Callable[[str], str]:
    """A parser taking one of ``allowed`` (case ignored), an alias (warned
    once, its target returned) or nothing else (a retired value says why)."""

    def parse(text: str) -> str:
        value = text.lower()
        if aliases and value in aliases:
            _warn_once(f"{name}={value}", f"{name}={value} is deprecated: it is "
                       f"{name}={aliases[value]} now")
            return aliases[value]
        if value in allowed:
            return value
        why = f": {retired[value]}" if retired and value in retired else ""
        raise ValueError(f"expected one of {', '.join(allowed)} (default {allowed[0]}){why}")

    return parse


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("expected 0 or 1 (default 0)")
    return text == "1"


def _blocks(text: str) -> tuple[int, int, int, int]:
    try:
        fields = tuple(int(x) for x in text.split("/"))
    except ValueError:
        fields = ()
    if len(fields) != 4 or any(f <= 0 or f & (f - 1) for f in fields):
        raise ValueError("expected four powers of two index/pe/nope/warps (heads per program "
                         "of each part, warps), e.g. 8/16/2/2")
    return fields  # type: ignore[return-value]


def _library(text: str) -> str:
    # A path must name a file; a bare name is left to the dynamic loader's search.
    if os.sep in text and not os.path.isfile(text):
        raise ValueError("no such file (expected the path of an NVRTC library, or a "
                         "library name the dynamic loader finds)")
    return text


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting(MODE_ENV, "`auto`, `off`, `stock`", "auto",
            "`off`: nothing patched; `stock`: stock's decode path with only the DeepGEMM API "
            "adapters (a DeepGEMM of another generation than vLLM's)",
            _choice(MODE_ENV, MODES)),
    Setting(BACKEND_ENV, "`auto`, `deepgemm`, `own` (`triton`: deprecated, = `own`)", "auto",
            "force a varlen backend: `own` the project's kernels (CUDA on sm_90, portable "
            "Triton elsewhere), `deepgemm` DeepGEMM's; one that cannot run logs a warning "
            "and leaves stock",
            _choice(BACKEND_ENV, BACKENDS, aliases=BACKEND_ALIASES)),
    Setting(TOPK_ENV, "`auto`, `vllm`, `own`", "auto",
            "the decode top-k: the project's on sm_90 where measured faster (`auto`: long "
            "rows, eager steps), always (`own`), or never (`vllm`)",
            _choice(TOPK_ENV, TOPK_SETTINGS)),
    Setting(FUSED_Q_ENV, "`auto`, `on`, `off`", "auto",
            "the indexer query (and on 0.33 the MLA query's RoPE) by the project's kernels, "
            "bytes equal to vLLM's: `auto` on sm_90; `on` also other fp8 GPUs (not "
            "measured); `off` vLLM's kernels",
            _choice(FUSED_Q_ENV, FUSED_Q_SETTINGS)),
    Setting(FUSED_Q_BLOCKS_ENV, "unset, or `index/pe/nope/warps` (powers of two)", None,
            "those kernels' heads per program of each part, and warps (unset: the measured "
            "best; 0.27's kernel reads `index` and `warps`)",
            _blocks),
    Setting(KERNEL_ENV, "`auto`, `portable`, `sm90` (= `sm90_cuda`)", "auto",
            "the launcher's logits kernel: `auto` the CUDA one on sm_90, the portable Triton "
            "one elsewhere",
            _choice(KERNEL_ENV, KERNELS, retired=RETIRED_KERNELS)),
    Setting(HEAD_SUM_ENV, "`fp32`, `tf32`", "fp32",
            "the sm_90 kernel's head sum on the CUDA cores in float32, or on the tensor cores "
            "in TF32 (other bits)",
            _choice(HEAD_SUM_ENV, HEAD_SUMS)),
    Setting(PIPELINE_ENV, "`0`, `1`", False,
            "the sm_90 kernel's pipelined build on >= 64 rows at 64 heads with the `fp32` "
            "sum (the same bits)",
            _flag),
    Setting(PDL_ENV, "`0`, `1`", False,
            "launch the sm_90 kernel as a programmatic dependent, as vLLM 0.33 launches "
            "DeepGEMM's (the same bits)",
            _flag),
    Setting(NVRTC_ENV, "unset, or a library path", None,
            "the NVRTC library the sm_90 kernels compile with (unset: PyTorch's CUDA wheel's)",
            _library),
)}

# Warnings given in this process (each deprecated name or value once).
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("vllm-dsa-varlen: %s", message)


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of setting ``name`` (a key of :data:`SETTINGS`) in
    ``environ`` (default ``os.environ``): its default when unset or empty,
    else its parsed value, blanks around it ignored.  The old name is read
    where the new one is unset.  ``ValueError`` naming the variable read for a
    value its setting does not take."""
    setting = SETTINGS.get(name)
    if setting is None:
        raise ValueError(f"name: {name!r} is not one of the plugin's settings "
                         f"({', '.join(SETTINGS)})")
    env = os.environ if environ is None else environ
    source, raw = name, env.get(name)
    old = env.get(setting.old_name)
    if old is not None:
        if raw is None:
            _warn_once(setting.old_name, f"{setting.old_name} is deprecated (vLLM's namespace): "
                       f"set {name} instead")
            source, raw = setting.old_name, old
        else:
            _warn_once(setting.old_name, f"both {name} and the deprecated {setting.old_name} "
                       f"are set: {name} wins")
    if raw is None or not raw.strip():
        return setting.default
    try:
        return setting.parse(raw.strip())
    except ValueError as exc:
        raise ValueError(f"{source}={raw!r} is not valid: {exc}") from None


def validate(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every setting's value (:func:`get`), so that any bad one raises now."""
    return {name: get(name, environ) for name in SETTINGS}


def markdown_table() -> str:
    """:data:`SETTINGS` as the README's settings table."""
    rows = ["| variable | values (default first) | effect |", "|---|---|---|"]
    rows += [f"| `{s.name}` | {s.values} | {s.meaning} |" for s in SETTINGS.values()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
