"""Drive vLLM 0.33.0's indexer metadata builder on a CPU machine.

* :func:`fake_gpu` (from ``vllm_fakes``, shared with the 0.27 line) makes
  ``current_platform`` answer like a CUDA GPU of a given capability, with or
  without DeepGEMM.
* :func:`make_builder` builds a real ``DeepseekV32IndexerMetadataBuilder``
  from a small config stub (scheduler, parallel, speculative -- with adaptive
  verification on or off --, attention and model sections) with
  ``num_compute_units`` patched; DeepSeek V4 compression through the cache
  spec's ``tokens_per_state``, DCP through the parallel section.
* :func:`decode_batch` (from ``vllm_fakes``) makes vLLM's own
  ``CommonAttentionMetadata`` for a decode batch.
* :func:`last_step_choice`: a builder's classification of its last step,
  also of a step it left to stock before classifying.
* :func:`fake_uniform_decode_kernel`: a CPU stand-in for stock's Triton
  ``_PREPARE_UNIFORM_DECODE_KERNEL`` (stock's own flattening of a uniform step).
* :class:`HopperDeepGemm`: the DeepGEMM test double (``tests/fake_deep_gemm.py``)
  as vLLM 0.33's vendored DeepGEMM 2.8.1 behaves on SM90: native ``next_n``
  1, 2 or 4 (4 as 2-CTA clusters: the schedule is sized ``num_sms // 2``), run
  ids refused.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch
from vllm_fakes import decode_batch, fake_gpu  # noqa: F401  (re-exported)
from fake_deep_gemm import FakeDeepGemm, schedule_fingerprint

NUM_SMS = 8
# The installed line the vllm_0_33 patch set is tested on: 0.33 or 0.34.
LINE = __import__("vllm_dsa_varlen.patches", fromlist=["installed_line"]).installed_line()

# Some vLLM modules branch on the platform at import time (CUDA-only imports):
# import every patch target and replacement now, before any test fakes a GPU.
for _name in ("vllm.utils.deep_gemm", "vllm.model_executor.layers.sparse_attn_indexer",
              "vllm.v1.attention.backends.mla.indexer",
              "vllm.models.glm5next.nvidia.sparse_indexer",
              "vllm_dsa_varlen.vllm_0_33.model_executor.layers.sparse_attn_indexer",
              "vllm_dsa_varlen.vllm_0_33.v1.attention.backends.mla.indexer"):
    importlib.import_module(_name)


def make_config(*, next_n: int, max_tokens: int = 256, max_seqs: int = 64, fp4: bool = False,
                max_model_len: int = 4096, index_heads: int = 32, adaptive: bool = False,
                dcp: int = 1):
    hf_config = SimpleNamespace(index_n_heads=index_heads, index_head_dim=128, index_topk=2048,
                                model_type="deepseek_v32")
    spec = None
    if next_n > 1:
        spec = SimpleNamespace(num_speculative_tokens=next_n - 1,
                               enable_adaptive_verification=adaptive)
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp,
                                        prefill_context_parallel_size=1,
                                        tensor_parallel_size=1,
                                        cp_kv_cache_interleave_size=1),
        speculative_config=spec,
        num_speculative_tokens=next_n - 1,
        attention_config=SimpleNamespace(
            resolve_indexer_kv_dtype=lambda default: "mxfp4" if fp4 else "fp8",
            sparse_mla_prefill_workspace_factor=5, indexer_tp_shard_min_rows=0),
        model_config=SimpleNamespace(max_model_len=max_model_len, architectures=[],
                                     hf_config=hf_config, hf_text_config=hf_config),
        # 0.34's builder looks its layers up here (ShardQ): none use it
        compilation_config=SimpleNamespace(cudagraph_mode=None, static_forward_context={}),
    )


def make_builder(monkeypatch, *, next_n: int, width: int = 64, page: int = 64,
                 compress_ratio: int = 1, fp4: bool = False, **config_kwargs):
    """A real ``DeepseekV32IndexerMetadataBuilder`` on the CPU (whatever the
    class's ``__init__`` currently is: patched or stock), with stock's uniform
    flattening kernel stood in for (:func:`fake_uniform_decode_kernel`) unless
    a stand-in is in place already.  ``page``: indexer
    cache entries per block (the kernels' page); a block holds ``page *
    compress_ratio`` tokens."""
    import vllm.v1.attention.backends.mla.indexer as ix
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    monkeypatch.setattr(ix, "num_compute_units", lambda device_index=None: NUM_SMS)
    if not isinstance(ix._PREPARE_UNIFORM_DECODE_KERNEL, UniformDecodeKernel):
        fake_uniform_decode_kernel(monkeypatch)  # stock's Triton kernel needs a GPU
    head_size = 68 if fp4 else 132
    spec = MLAAttentionSpec(block_size=page * compress_ratio, num_kv_heads=1,
                            head_size=head_size, dtype=torch.uint8,
                            tokens_per_state=compress_ratio)
    cfg = make_config(next_n=next_n, fp4=fp4, **config_kwargs)
    return ix.DeepseekV32IndexerMetadataBuilder(spec, ["layers.0.indexer.k_cache"], cfg,
                                                torch.device("cpu"), block_table_width=width)


def last_step_choice(builder, cm):
    """The plugin builder's classification of its last step ``cm``; a step
    left to stock before classifying (``last_step_stock_only``: flattened or
    native) is classified here, and that classification must leave it to
    stock too."""
    from vllm_dsa_varlen.vllm_0_33.v1.attention.backends.mla import indexer as ours

    if not builder.last_step_stock_only:
        return builder.last_step_choice
    assert builder.last_step_choice is None
    choice = ours.classify_step(builder, cm)
    assert choice.stock in ("flattened", "native") and not choice.plan and not choice.varlen, \
        choice
    return choice


class UniformDecodeKernel:
    """CPU stand-in for 0.33.0's Triton ``_PREPARE_UNIFORM_DECODE_KERNEL`` (no
    Triton on the CPU), called as ``kernel(seq_lens, ctx_out, block_table,
    bt_out, lens_out, rows, n)``: row ``i`` is token ``i % n`` of request
    ``i // n`` and sees ``seq - n + i % n + 1`` tokens through that request's
    block-table row; its decode length becomes 1.  ``wrap`` (optional) wraps
    each call (a benchmark counts it as one launch)."""

    def __init__(self, wrap=None):
        self.launches = 0
        self._wrap = wrap or (lambda fn: fn)

    def __call__(self, seq_lens, ctx_out, block_table, bt_out, lens_out, rows, n):
        def launch():
            self.launches += 1
            token = torch.arange(rows, device=seq_lens.device)
            req = token // n
            ctx_out[:rows] = seq_lens[req] - n + token % n + 1
            bt_out[:rows, :block_table.shape[1]] = block_table[req]
            lens_out[:rows] = 1
        return self._wrap(launch)()


def fake_uniform_decode_kernel(monkeypatch, wrap=None) -> UniformDecodeKernel:
    import vllm.v1.attention.backends.mla.indexer as ix

    kernel = UniformDecodeKernel(wrap)
    monkeypatch.setattr(ix, "_PREPARE_UNIFORM_DECODE_KERNEL", kernel)
    return kernel


class HopperDeepGemm(FakeDeepGemm):
    """The DeepGEMM double as vLLM 0.33.0's (0.34.0's) vendored DeepGEMM 2.8.1 on SM90:
    the 2.8 API (no ``clean_logits``, fp32 logits on SM90), native ``next_n``
    in {1, 2, 4}, ``next_n == 4`` scheduled over ``num_sms // 2`` 2-CTA
    clusters (the schedule has ``num_sms // 2 + 1`` rows), run ids refused
    ("varlen is SM100 only")."""

    def __init__(self, num_sms: int = NUM_SMS):
        import inspect

        import vllm.utils.deep_gemm as vdg

        # the vendored DeepGEMM matches its vLLM: 0.34's logits functions take logits_dtype
        takes = "logits_dtype" in inspect.signature(vdg.fp8_fp4_paged_mqa_logits).parameters
        super().__init__("2.8", 90, num_sms=num_sms, logits_dtype=takes)
        self.full_sms = num_sms

    def _check_context_lens(self, context_lens) -> tuple[int, int]:
        assert context_lens.dim() == 2, f"context_lens: 2-D expected, got {context_lens.dim()}-D"
        assert context_lens.dtype == torch.int32, f"context_lens: {context_lens.dtype}"
        assert context_lens.is_contiguous(), "context_lens: not contiguous"
        batch, next_n = context_lens.shape
        assert next_n in (1, 2, 4), f"context_lens: next_n {next_n} not in (1, 2, 4) on SM90"
        return batch, next_n

    def _slots(self, next_n: int) -> int:
        return self.full_sms // 2 if next_n == 4 else self.full_sms

    def _metadata(self, context_lens, block_kv, num_sms, indices=None):
        batch, next_n = self._check_context_lens(context_lens)
        assert num_sms == self._slots(next_n), \
            f"num_sms: {num_sms} scheduler slots for next_n={next_n}, want {self._slots(next_n)}"
        return super()._metadata(context_lens, block_kv, num_sms, indices)

    def _paged(self, q, kv_cache, weights, context_lens, block_table, schedule_meta,
               max_context_len, clean_logits=False, indices=None, logits_dtype=torch.float32):
        self.num_sms = self._slots(q[0].shape[1])
        try:
            return super()._paged(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                  max_context_len, clean_logits, indices, logits_dtype)
        finally:
            self.num_sms = self.full_sms


__all__ = ["NUM_SMS", "fake_gpu", "make_config", "make_builder", "decode_batch",
           "HopperDeepGemm", "schedule_fingerprint", "UniformDecodeKernel",
           "fake_uniform_decode_kernel"]
