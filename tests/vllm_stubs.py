"""Drive vLLM 0.27.1's indexer metadata builder on a CPU machine.

* :func:`fake_gpu` makes ``current_platform`` answer like a CUDA GPU of a given
  capability (instance attributes shadow the platform's classmethods).
* :func:`make_builder` builds a real ``DeepseekV32IndexerMetadataBuilder``
  from a small config stub (scheduler, parallel, speculative, attention and
  model sections) with ``num_compute_units`` patched.
* :func:`decode_batch` makes vLLM's own ``CommonAttentionMetadata`` for a
  decode batch (graph padding: zero-length requests and extra tokens).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

NUM_SMS = 8

# Some vLLM modules branch on the platform at import time (CUDA-only imports):
# import every patch target and replacement now, before any test fakes a GPU.
for _name in ("vllm.utils.deep_gemm", "vllm.model_executor.layers.sparse_attn_indexer",
              "vllm.v1.attention.backends.mla.indexer",
              "vllm_dsa_varlen.vllm_0_27.utils.deep_gemm",
              "vllm_dsa_varlen.vllm_0_27.model_executor.layers.sparse_attn_indexer",
              "vllm_dsa_varlen.vllm_0_27.v1.attention.backends.mla.indexer"):
    importlib.import_module(_name)


def fake_gpu(monkeypatch, capability: tuple[int, int] | None, *, deepgemm_installed: bool = True,
             triton: bool = True) -> None:
    """``current_platform`` becomes CUDA with ``capability`` (``None``: not CUDA)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    import vllm.triton_utils
    import vllm.v1.attention.backends.mla.indexer as ix

    cuda = capability is not None
    cap = DeviceCapability(*capability) if cuda else None
    monkeypatch.setattr(current_platform, "is_cuda", lambda: cuda)
    monkeypatch.setattr(current_platform, "get_device_capability", lambda device_id=0: cap)
    monkeypatch.setattr(current_platform, "is_device_capability_family",
                        lambda c, device_id=0: cuda and cap.major == c // 10)
    monkeypatch.setattr(current_platform, "is_device_capability",
                        lambda c, device_id=0: cuda and (
                            tuple(cap) == c if isinstance(c, tuple) else cap.to_int() == c))
    monkeypatch.setattr(current_platform, "has_device_capability",
                        lambda c, device_id=0: cuda and (
                            tuple(cap) >= c if isinstance(c, tuple) else cap.to_int() >= c))
    monkeypatch.setattr(ix, "has_deep_gemm", lambda: cuda and deepgemm_installed)
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", triton)


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


def decode_batch(decode_lens: list[int], seq_lens: list[int], block_table: torch.Tensor, *,
                 num_tokens: int | None = None):
    """vLLM's ``CommonAttentionMetadata`` for a decode-only batch.

    Requests with ``decode_lens == 0`` are graph padding (give them
    ``seq_lens == 0``); ``num_tokens`` larger than ``sum(decode_lens)`` pads
    the token count as a CUDA-graph-padded batch has."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    lens = torch.tensor(decode_lens, dtype=torch.int32)
    qsl = torch.zeros(len(decode_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    total = int(qsl[-1])
    num_tokens = total if num_tokens is None else num_tokens
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq,
        num_reqs=len(decode_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(decode_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone(),
        is_prefilling=torch.zeros(len(decode_lens), dtype=torch.bool),
    )


def random_block_table(num_reqs: int, width: int, num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_blocks, (num_reqs, width), generator=gen, dtype=torch.int32)
