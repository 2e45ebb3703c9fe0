"""Drive vLLM 0.27.1's indexer metadata builder on a CPU machine.

* :func:`fake_gpu` (from ``vllm_fakes``, shared with the 0.33 line) makes
  ``current_platform`` answer like a CUDA GPU of a given capability.
* :func:`make_builder` builds a real ``DeepseekV32IndexerMetadataBuilder``
  from a small config stub (scheduler, parallel, speculative, attention and
  model sections) with ``num_compute_units`` patched.
* :func:`decode_batch` (from ``vllm_fakes``) makes vLLM's own
  ``CommonAttentionMetadata`` for a decode batch.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch
from vllm_fakes import decode_batch, fake_gpu  # noqa: F401  (re-exported)

NUM_SMS = 8

# Some vLLM modules branch on the platform at import time (CUDA-only imports):
# import every patch target and replacement now, before any test fakes a GPU.
for _name in ("vllm.utils.deep_gemm", "vllm.model_executor.layers.sparse_attn_indexer",
              "vllm.v1.attention.backends.mla.indexer",
              "vllm_dsa_varlen.vllm_0_27.utils.deep_gemm",
              "vllm_dsa_varlen.vllm_0_27.model_executor.layers.sparse_attn_indexer",
              "vllm_dsa_varlen.vllm_0_27.v1.attention.backends.mla.indexer"):
    importlib.import_module(_name)


def make_config(*, next_n: int, max_tokens: int = 256, max_seqs: int = 64, fp4: bool = False,
                max_model_len: int = 4096, index_heads: int = 32):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1,
                                        cp_kv_cache_interleave_size=1),
        speculative_config=(SimpleNamespace(num_speculative_tokens=next_n - 1)
                            if next_n > 1 else None),
        attention_config=SimpleNamespace(use_fp4_indexer_cache=fp4),
        model_config=SimpleNamespace(max_model_len=max_model_len,
                                     hf_config=SimpleNamespace(index_n_heads=index_heads)),
    )


def make_builder(monkeypatch, *, next_n: int, width: int = 64, block_size: int = 64,
                 compress_ratio: int = 1, fp4: bool = False, **config_kwargs):
    """A real ``DeepseekV32IndexerMetadataBuilder`` on the CPU (whatever the
    class's ``__init__`` currently is: patched or stock)."""
    import vllm.v1.attention.backends.mla.indexer as ix
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    monkeypatch.setattr(ix, "num_compute_units", lambda device_index=None: NUM_SMS)
    head_size = 68 if fp4 else 132
    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size,
                            dtype=torch.uint8, compress_ratio=compress_ratio)
    cfg = make_config(next_n=next_n, fp4=fp4, **config_kwargs)
    return ix.DeepseekV32IndexerMetadataBuilder(spec, ["layers.0.indexer.k_cache"], cfg,
                                                torch.device("cpu"), block_table_width=width)


def random_block_table(num_reqs: int, width: int, num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_blocks, (num_reqs, width), generator=gen, dtype=torch.int32)


class UniformDecodeKernel:
    """CPU stand-in for 0.27.1's Triton ``_prepare_uniform_decode_kernel`` (no
    Triton on the CPU), launched as ``kernel[(rows,)](...)``: row ``i`` is token
    ``i % n`` of request ``i // n`` and sees ``seq - n + i % n + 1`` tokens
    through that request's block-table row; its decode length becomes 1."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def launch(seq_lens, ctx_out, block_table, bt_stride, bt_out, bt_out_stride, lens_out,
                   n, BLOCK_SIZE=None):
            self.launches += 1
            rows = grid[0]
            token = torch.arange(rows)
            req = token // n
            ctx_out[:rows] = seq_lens[req] - n + token % n + 1
            bt_out[:rows, :block_table.shape[1]] = block_table[req]
            lens_out[:rows] = 1
        return launch


def fake_uniform_decode_kernel(monkeypatch) -> UniformDecodeKernel:
    import vllm.v1.attention.backends.mla.indexer as ix

    kernel = UniformDecodeKernel()
    monkeypatch.setattr(ix, "_prepare_uniform_decode_kernel", kernel)
    return kernel
