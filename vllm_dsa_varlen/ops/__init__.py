"""Paged MQA logits kernels (fp8 indexer cache, DeepGEMM's varlen semantics).

* :mod:`.launcher` — the entry point :func:`~.launcher.varlen_paged_mqa_logits`
  (input checks, the choice of kernel) and :func:`~.launcher.precompile`
  (compile every variant a server uses, up front);
* :mod:`.cuda_paged_mqa_logits` — the sm_90 (Hopper) CUDA C++ kernel (NVRTC and
  the driver through ``cuda-python``), 64 heads;
* :mod:`.gluon_paged_mqa_logits` — the sm_90 Gluon kernel, where the CUDA one
  cannot run (32 heads, no NVRTC);
* :mod:`.triton_paged_mqa_logits` — the portable Triton kernel (any fp8 GPU,
  the CPU interpreter);
* :mod:`.common` — what the kernels share (geometry, SM count, bound launches);
* :mod:`.reference` — the torch reference, the source of truth for tests;
* :mod:`.compile_check` — every variant built for its GPU target without a GPU.

The launcher imports the kernels; the kernels import only :mod:`.common` and
:mod:`.reference`.  Nothing is imported here, so reading the reference does
not load Triton.
"""
