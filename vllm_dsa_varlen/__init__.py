"""Varlen sparse-attention-indexer decode for vLLM 0.27.1 (DeepSeek V3.2 / V4), as a plugin.

vLLM calls :func:`register` (entry point ``vllm.general_plugins`` ->
``vllm_dsa_varlen:register``) in every process it starts.  Importing this
package is cheap and imports nothing from vLLM; the kernels (``ops``), the row
planner (``plan``) and the configuration (``config``) work without vLLM.
"""

from __future__ import annotations

import logging

__all__ = ["register", "SUPPORTED_VLLM"]

SUPPORTED_VLLM = (0, 27)  # major, minor of the vLLM the patches were written for

logger = logging.getLogger("vllm.dsa_varlen")


def _vllm_series(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def register() -> None:
    """Plugin entry point: apply the patch registry (idempotent; target modules
    not imported yet are patched when they are).

    Does nothing but log when ``VLLM_DSA_VARLEN=off`` or when the installed
    vLLM is not 0.27.x (stock behaviour).  Raises ``ValueError`` for an
    invalid ``VLLM_DSA_VARLEN`` / ``VLLM_DSA_VARLEN_BACKEND`` value."""
    from . import config

    mode = config.read_mode()
    config.read_backend()  # validate early: a typo fails at start-up, not at first build
    if mode == "off":
        logger.info("vllm-dsa-varlen: %s=off, vLLM left unpatched", config.MODE_ENV)
        return
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if _vllm_series(version) != SUPPORTED_VLLM:
        logger.warning("vllm-dsa-varlen: written for vLLM %d.%d.x, found %s; not patching "
                       "(stock behaviour)", *SUPPORTED_VLLM, version)
        return
    from . import patches

    # Modules not imported yet are patched right after their first import, so
    # loading the plugin imports no vLLM module early (see patches' docstring).
    patches.apply_all(defer_unimported=True)
