"""The patch set for the vLLM 0.27 line (written against 0.27.1).

Each module here mirrors the upstream file it changes (path relative to the
``vllm`` package); :mod:`vllm_dsa_varlen.patches` lists every replacement.
"""
