"""Fakes that drive either vLLM line's indexer builder on a CPU machine (the
parts that are the same on vLLM 0.27.1 and 0.33.0; each line's stubs module,
``vllm_stubs`` / ``vllm033_stubs``, re-exports them beside its own builder).

* :func:`fake_gpu` makes ``current_platform`` answer like a CUDA GPU of a given
  capability (instance attributes shadow the platform's classmethods), with or
  without DeepGEMM and Triton.
* :func:`decode_batch` makes vLLM's own ``CommonAttentionMetadata`` for a
  decode batch (graph padding: zero-length requests and extra tokens).
"""

from __future__ import annotations

import torch


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
