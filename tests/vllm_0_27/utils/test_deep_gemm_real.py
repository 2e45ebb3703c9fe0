"""The DeepGEMM argument helpers against a real, installed DeepGEMM (GPU only).

Runs where ``deep_gemm`` imports and a CUDA GPU is present (skipped in CI):
signature detection on the real pybind functions, and the paged / prefill
calls (with the 2.8.x adaptations when that API is installed) against the
torch reference.  No vLLM needed: the helpers take the DeepGEMM function.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref  # noqa: E402
from vllm_dsa_varlen.vllm_0_27.utils import deep_gemm as dsa_dg  # noqa: E402
from vllm_dsa_varlen.bench.workloads import make_decode_step  # noqa: E402


@pytest.fixture(scope="module")
def dg():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return pytest.importorskip("deep_gemm")


@pytest.fixture(scope="module")
def caps(dg):
    return dsa_dg.detect_caps(dg.fp8_fp4_paged_mqa_logits, dg.get_paged_mqa_logits_metadata,
                              dg.fp8_fp4_mqa_logits)


def _sm100():
    return torch.cuda.get_device_capability()[0] == 10


def test_signatures_are_read_from_the_pybind_docstrings(dg, caps):
    if dsa_dg.param_names(dg.get_paged_mqa_logits_metadata) == ("args", "kwargs"):
        pytest.skip("this deep_gemm wraps its functions in Python (*args, **kwargs), as vLLM "
                    "0.33's vendored copy does: no pybind signature to read")
    names = dsa_dg.param_names(dg.fp8_fp4_paged_mqa_logits)
    print("fp8_fp4_paged_mqa_logits:", names)
    print("get_paged_mqa_logits_metadata:", dsa_dg.param_names(dg.get_paged_mqa_logits_metadata))
    print("fp8_fp4_mqa_logits:", dsa_dg.param_names(dg.fp8_fp4_mqa_logits))
    print(caps)
    assert caps.signatures_known
    assert names[:3] == ("q", "kv_cache", "weights") and "context_lens" in names
    if not caps.paged_clean_logits:  # the 2.8.x generation
        assert caps.varlen and caps.prefill_max_seqlen_k


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("clean", [False, True])
def test_padded_paged_logits_match_the_reference(dg, caps, seed, clean):
    if _sm100() and not caps.paged_clean_logits:
        pytest.skip("DeepGEMM 2.8.x on SM100 takes varlen rows only")
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3, (9,), generator=gen).tolist()
    seqs = [int(s) for s in torch.randint(2, 3000, (9,), generator=gen)]
    step = make_decode_step(lens, seqs, heads=64, dim=128, page=64, seed=seed, device="cuda")
    pad = step.padded(2)
    ctx = pad["context_lens"]
    sched = dsa_dg.call_metadata(dg.get_paged_mqa_logits_metadata, caps, ctx, 64, dg.get_num_sms())
    logits = dsa_dg.call_paged_logits(dg.fp8_fp4_paged_mqa_logits, caps, (pad["q"], None),
                                      step.kv_cache, pad["weights"], ctx, pad["block_table"], sched,
                                      step.max_context_len, clean, sm100=_sm100)
    ref = paged_mqa_logits_ref(pad["q"], step.kv_cache, pad["weights"], ctx, pad["block_table"],
                               step.max_context_len)
    assert logits.dtype == torch.float32
    written = torch.isfinite(ref)
    torch.testing.assert_close(logits[written], ref[written], rtol=2e-2, atol=2e-2)
    if clean:
        assert torch.all(logits[~written] == -math.inf)


@pytest.mark.parametrize("seed", [0, 1])
def test_varlen_paged_logits_match_the_reference(dg, caps, seed):
    if not (_sm100() and caps.varlen):
        pytest.skip("varlen rows need SM100 and a DeepGEMM that takes indices")
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 5, (9,), generator=gen).tolist()
    seqs = [int(s) for s in torch.randint(4, 3000, (9,), generator=gen)]
    step = make_decode_step(lens, seqs, heads=64, dim=128, page=64, seed=seed, device="cuda",
                            padding_rows=3)
    rows = step.rows
    ctx = rows.context_lens.unsqueeze(-1)
    sched = dsa_dg.call_metadata(dg.get_paged_mqa_logits_metadata, caps, ctx, 64,
                                 dg.get_num_sms(), rows.indices)
    logits = dsa_dg.call_paged_logits(dg.fp8_fp4_paged_mqa_logits, caps, (step.q, None),
                                      step.kv_cache, step.weights, ctx, rows.block_table, sched,
                                      step.max_context_len, True, rows.indices, sm100=_sm100)
    ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                               step.max_context_len, rows.indices)
    written = torch.isfinite(ref)
    torch.testing.assert_close(logits[written], ref[written], rtol=2e-2, atol=2e-2)


def _prefill_inputs(seed, heads=64, dim=128, num_kv=700):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((24, heads, dim), generator=gen, device="cuda").to(torch.float8_e4m3fn)
    k = torch.randn((num_kv, dim), generator=gen, device="cuda").to(torch.float8_e4m3fn)
    s = torch.rand(num_kv, generator=gen, device="cuda") + 0.5
    w = torch.randn((24, heads), generator=gen, device="cuda")
    # three requests of 8 tokens: KV spans [0, 100), [100, 400), [400, 700), causal ends
    starts = torch.tensor([0] * 8 + [100] * 8 + [400] * 8, dtype=torch.int32, device="cuda")
    ends = starts + torch.tensor(list(range(93, 101)) + list(range(293, 301)) +
                                 list(range(293, 301)), dtype=torch.int32, device="cuda")
    return q, (k, s), w, starts, ends


@pytest.mark.parametrize("clean", [False, True])
def test_prefill_logits_in_stock_layout(dg, caps, clean):
    if _sm100():
        pytest.skip("FP8 prefill on SM100 needs MX scales vLLM 0.27.1 does not produce")
    q, kv, w, ks, ke = _prefill_inputs(seed=int(clean))
    logits = dsa_dg.call_prefill_logits(dg.fp8_fp4_mqa_logits, caps, (q, None), kv, w, ks, ke,
                                        clean, sm100=_sm100)
    k, s = kv
    qk = torch.einsum("mhd,nd->mhn", q.float(), k.float())
    want = (qk.relu() * w[:, :, None]).sum(1) * s[None, :]
    cols = torch.arange(k.shape[0], device="cuda")
    inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
    assert logits.shape == (q.shape[0], k.shape[0]) and logits.dtype == torch.float32
    # H200 + DeepGEMM 2.8.2: 1 of 5516 values off by 0.024 at 2e-2 (kernel rounding)
    torch.testing.assert_close(logits[inside], want[inside], rtol=2e-2, atol=5e-2)
    if clean:
        assert torch.all(logits[~inside] == -math.inf)


def test_prefill_2_8_writes_row_compressed_logits(dg, caps):
    """What the adaptation relies on: 2.8.x puts row i's span [ks, ke) at columns 0.."""
    if caps.prefill_clean_logits or _sm100():
        pytest.skip("not the 2.8.x prefill API on SM90")
    q, kv, w, ks, ke = _prefill_inputs(seed=5)
    span = int((ke - ks).max())
    comp = dg.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, max_seqlen_k=span).float()
    k, s = kv
    qk = torch.einsum("mhd,nd->mhn", q.float(), k.float())
    want = (qk.relu() * w[:, :, None]).sum(1) * s[None, :]
    for i in range(q.shape[0]):
        a, b = int(ks[i]), int(ke[i])
        torch.testing.assert_close(comp[i, : b - a], want[i, a:b], rtol=2e-2, atol=2e-2)
