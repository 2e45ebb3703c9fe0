"""Paged MQA logits kernels (fp8 indexer cache, DeepGEMM's varlen semantics), the
decode top-k, and the step's query preparation.

* :mod:`.launcher` — the entry point :func:`~.launcher.varlen_paged_mqa_logits`
  (input checks, the choice of kernel) and :func:`~.launcher.precompile`
  (compile every variant a server uses, up front);
* :mod:`.cuda_paged_mqa_logits` — the sm_90 (Hopper) CUDA C++ kernel, 32 and
  64 heads, fp32 or tensor-core head sum;
* :mod:`.cuda_plan` — that kernel's per-step schedule: its format, its cost
  model, the one-launch planner kernel;
* :mod:`.cuda_binding` — NVRTC and the CUDA driver through ``cuda-python``
  (compile, load, launch), for the CUDA kernels;
* :mod:`.cuda_topk` — the indexer's decode top-k in one launch (sm_90; chosen
  by :mod:`vllm_dsa_varlen.topk`);
* :mod:`.triton_paged_mqa_logits` — the portable Triton kernel (any fp8 GPU,
  the CPU interpreter);
* :mod:`.triton_fused_q` — the step's query preparation (vLLM 0.33's
  ``fused_q``: RoPE, fp8 and weights of the indexer's query, the MLA query's
  RoPE), served on sm_90 by the vLLM 0.33 patch;
* :mod:`.common` — what the kernels share (geometry, SM count, bound launches);
* :mod:`.reference` — the torch reference, the source of truth for tests;
* :mod:`.compile_check` — every variant built for its GPU target without a GPU.

The launcher imports the kernels; the kernels import only :mod:`.common`,
:mod:`.reference` and their own helpers (the CUDA kernel :mod:`.cuda_plan` and
:mod:`.cuda_binding`).  Nothing is imported here, so reading the reference does
not load Triton.
"""
