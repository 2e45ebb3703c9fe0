"""The patch set for the vLLM 0.33 line (written against 0.33.0).

Each module here mirrors the upstream file it changes (path relative to the
``vllm`` package); :mod:`vllm_dsa_varlen.patches` lists every replacement.

vLLM 0.33 already runs varlen decode itself on SM100 with DeepGEMM (run ids
built on the device, ``DecodeMetadata.indices`` passed to the kernel); that
path is left alone.  These patches bring varlen to Hopper and other fp8 GPUs
without a DeepGEMM varlen kernel, through the project's varlen kernels, step by
step where it was measured at least as fast as stock's path
(:mod:`vllm_dsa_varlen.policy`).
"""
