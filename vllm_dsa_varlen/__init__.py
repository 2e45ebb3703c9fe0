"""Varlen sparse-attention-indexer decode for vLLM (DeepSeek V3.2 / V4, GLM), as a plugin.

vLLM calls :func:`register` (entry point ``vllm.general_plugins`` ->
``vllm_dsa_varlen:register``) in every process it starts.  It checks the
settings (:mod:`.settings`), recognises the installed vLLM's line and applies
that line's patch set (:mod:`.patches`) where the installed source still has
what each patch was written against; any other vLLM is left stock, with a log
line.  Importing this package is cheap and imports nothing from vLLM.
"""

from __future__ import annotations

import logging

__all__ = ["register", "SUPPORTED_LINES"]

logger = logging.getLogger("vllm.dsa_varlen")


def __getattr__(name: str):
    # The registry is imported on first use, not with the package, so that
    # ``python -m vllm_dsa_varlen.patches`` runs it as a fresh module.
    if name == "SUPPORTED_LINES":  # the registry's lines as (major, minor)
        from .patches import LINES

        return tuple(tuple(int(p) for p in line.split(".")) for line in LINES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Plugin entry point: apply the installed vLLM line's patch set
    (idempotent; target modules not imported yet are patched when they are).

    Every setting is read first (:func:`.settings.validate`): a bad value
    raises ``ValueError`` naming its variable, here at start-up.  Then does
    nothing but log when ``DSA_VARLEN=off``, when the installed vLLM is on no
    line of the registry, or when its source differs from the release the
    line's patches were read from where they apply (a warning naming each
    difference; stock behaviour).  With ``DSA_VARLEN=stock`` only the line's
    DeepGEMM API adapters are applied (stock's decode path on a DeepGEMM of
    another API generation)."""
    from . import patches, settings

    mode = settings.validate()[settings.MODE_ENV]
    if mode == "off":
        logger.info("vllm-dsa-varlen: %s=off, vLLM left unpatched", settings.MODE_ENV)
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
        logger.info("vllm-dsa-varlen: %s=stock: stock decode path; %s", settings.MODE_ENV,
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
