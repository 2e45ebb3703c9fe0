"""Varlen sparse-attention-indexer decode for vLLM (DeepSeek V3.2 / V4, GLM), as a plugin.

vLLM calls :func:`register` (entry point ``vllm.general_plugins`` ->
``vllm_dsa_varlen:register``) in every process it starts.  It recognises the
installed vLLM's line and applies that line's patch set
(:mod:`vllm_dsa_varlen.patches`): ``vllm_0_27/`` for 0.27.x, ``vllm_0_33/``
for 0.33.x and 0.34.x, where the installed source still has what each patch was written
against (:func:`.patches.upstream_differences`); any other vLLM is left
stock, with a log line.  Importing this
package is cheap and imports nothing from vLLM; the kernels (``ops``), the row
planner (``plan``), the decisions (``config``, ``policy``) work without vLLM.
"""

from __future__ import annotations

import logging

from . import patches  # the registry: standard library only, no vLLM

__all__ = ["register", "SUPPORTED_LINES"]

# vLLM lines (major, minor) with a patch set: the registry's (patches.LINES,
# with the release each was read from).
SUPPORTED_LINES = tuple(tuple(int(p) for p in line.split(".")) for line in patches.LINES)

logger = logging.getLogger("vllm.dsa_varlen")


def register() -> None:
    """Plugin entry point: apply the installed vLLM line's patch set
    (idempotent; target modules not imported yet are patched when they are).

    Does nothing but log when ``VLLM_DSA_VARLEN=off``, when the installed
    vLLM is on no line of the registry (0.27.x, 0.33.x, 0.34.x), or when its source
    differs from the release the line's patches were read from where they
    apply (a warning naming each difference; stock behaviour).  With
    ``VLLM_DSA_VARLEN=stock`` only the line's DeepGEMM API adapters are applied
    (stock's decode path, stock's arguments, on a DeepGEMM of another API
    generation).  Raises
    ``ValueError`` for an invalid ``VLLM_DSA_VARLEN`` /
    ``VLLM_DSA_VARLEN_BACKEND`` value."""
    from . import config

    mode = config.read_mode()
    config.read_backend()  # validate early: a typo fails at start-up, not at first build
    if mode == "off":
        logger.info("vllm-dsa-varlen: %s=off, vLLM left unpatched", config.MODE_ENV)
        return
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    line = patches.line_of(version)
    if line not in patches.LINES:
        logger.warning("vllm-dsa-varlen: has patches for vLLM %s, found %s; not patching "
                       "(stock behaviour)", " and ".join(f"{x}.x" for x in patches.LINES),
                       version)
        return
    differences = patches.upstream_differences(line, api_only=mode == "stock")
    if differences:
        logger.warning("vllm-dsa-varlen: vLLM %s differs from %s where the %s line's patches "
                       "apply; not patching (stock behaviour): %s", version, patches.LINES[line],
                       line, "; ".join(differences))
        return
    if mode == "stock":
        api = patches.for_line(line, api_only=True)
        logger.info("vllm-dsa-varlen: %s=stock: stock decode path; %s", config.MODE_ENV,
                    f"only the DeepGEMM API adapters applied ({len(api)} patches)" if api
                    else "this line needs no DeepGEMM API adapter, vLLM left unpatched")
        if api:
            patches.apply_all(api, defer_unimported=True)
        return
    logger.debug("vllm-dsa-varlen: vLLM %s: applying the %s line's patches (read from %s)",
                 version, line, patches.LINES[line])
    # Modules not imported yet are patched right after their first import, so
    # loading the plugin imports no vLLM module early (see patches' docstring).
    patches.apply_all(line=line, defer_unimported=True)
