"""vLLM 0.27.1's real ``sparse_attn_indexer`` decode path with the varlen builder.

The op function runs as shipped; only what cannot run on a CPU is stood in for:
the forward context (a namespace holding the built metadata), DeepGEMM (the
test double) and the top-k kernel (a torch top-k over each row's context).
"""

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import vllm.model_executor.layers.sparse_attn_indexer as sai  # noqa: E402
from fake_deep_gemm import FakeDeepGemm  # noqa: E402
from vllm.config import CUDAGraphMode  # noqa: E402
from vllm_stubs import NUM_SMS, decode_batch, fake_gpu, make_builder  # noqa: E402

import vllm_dsa_varlen.ops.triton_paged_mqa_logits as triton_kernel  # noqa: E402
from vllm_dsa_varlen import patches  # noqa: E402
from vllm_dsa_varlen.vllm_0_27.model_executor.layers import sparse_attn_indexer as ours  # noqa: E402
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref  # noqa: E402
from vllm_dsa_varlen.varlen_ids import attach_varlen_ids  # noqa: E402
from vllm_dsa_varlen.workloads import make_decode_step  # noqa: E402

PREFIX = "model.layers.0.self_attn.indexer.k_cache"
HEADS, DIM, PAGE, TOPK = 32, 128, 64, 16


pytestmark = pytest.mark.usefixtures("clean_plugin")


def _topk_per_row_decode(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, k):
    """Stand-in for vLLM's top_k_per_row_decode: top-k of each row's first
    ``seq_lens`` columns, -1 padded."""
    lens = seq_lens.reshape(-1)
    topk_indices.fill_(-1)
    for r in range(num_rows):
        n = int(lens[r])
        if n > 0:
            top = logits[r, :n].topk(min(k, n)).indices
            topk_indices[r, : top.numel()] = top.to(topk_indices.dtype)


def _run_indexer(monkeypatch, md, q_quant, q_scale, kv_cache, weights, max_model_len, fp4=False):
    ctx = SimpleNamespace(attn_metadata={PREFIX: md}, cudagraph_runtime_mode=CUDAGraphMode.NONE)
    monkeypatch.setattr(sai, "get_forward_context", lambda: ctx)
    monkeypatch.setattr(sai, "ops", SimpleNamespace(top_k_per_row_decode=_topk_per_row_decode))
    tokens = q_quant.shape[0]
    topk_buffer = torch.full((tokens, TOPK), 7, dtype=torch.int32)
    out = sai.sparse_attn_indexer(
        torch.empty(tokens, 1), PREFIX, kv_cache, q_quant, q_scale, None, weights,
        128, "ue8m0", TOPK, DIM, max_model_len, 4 * max_model_len, topk_buffer,
        True, False, "", fp4)
    assert out is topk_buffer
    return topk_buffer


def _setup(monkeypatch, backend, fp4=False):
    if backend == "deepgemm":
        fake_gpu(monkeypatch, (10, 0))
        return FakeDeepGemm("2.8", 100, num_sms=NUM_SMS).install(monkeypatch)
    fake_gpu(monkeypatch, (9, 0))
    return FakeDeepGemm("old", 90, num_sms=NUM_SMS).install(monkeypatch)


def _random_step(seed, next_n, pad_reqs, pad_rows):
    gen = torch.Generator().manual_seed(seed)
    num_reqs = 3 + seed % 3
    lens = torch.randint(1, next_n + 1, (num_reqs,), generator=gen).tolist() + [0] * pad_reqs
    seqs = [max(n, int(s)) for n, s in zip(lens, torch.randint(1, 400, (num_reqs,),
                                                               generator=gen))] + [0] * pad_reqs
    return make_decode_step(lens, seqs, heads=HEADS, dim=DIM, page=PAGE, seed=seed,
                            padding_rows=pad_rows)


def _build(builder, step):
    lens = step.decode_lens.tolist()
    cm = decode_batch(lens, step.seq_lens.tolist(), step.block_table,
                      num_tokens=step.num_rows)
    return builder.build(0, cm)


def _assert_topk_like_padded(topk, step, next_n, tol_rel):
    """Each real row's top-k is a top-k of the padded path's logits (tie-robust)."""
    pad = step.padded(next_n)
    ref = paged_mqa_logits_ref(pad["q"], step.kv_cache, pad["weights"], pad["context_lens"],
                               pad["block_table"], step.max_context_len)
    ctx = pad["context_lens"].reshape(-1)
    real = pad["row_of"].numel()
    for r in range(step.num_rows):
        got = topk[r][topk[r] >= 0]
        if r >= real:  # graph-padding row: context 0, nothing selected
            assert got.numel() == 0
            continue
        row = pad["row_of"][r]
        n = int(ctx[row])
        want = min(TOPK, n)
        assert got.numel() == want and got.unique().numel() == want and int(got.max()) < n
        kth = ref[row, :n].topk(want).values[-1]
        tol = tol_rel * max(1.0, abs(float(kth)))
        assert torch.all(ref[row, got.long()] >= kth - tol), r


@pytest.mark.parametrize("backend", ["deepgemm", "triton"])
@pytest.mark.parametrize("seed", range(3))
def test_decode_topk_equals_the_padded_path(monkeypatch, backend, seed):
    next_n = 3
    dg = _setup(monkeypatch, backend)
    step = _random_step(seed, next_n, pad_reqs=seed % 2, pad_rows=seed)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=next_n, width=step.block_table.shape[1],
                           max_model_len=step.max_context_len)
    assert builder.varlen_backend == backend
    md = _build(builder, step)
    ids = md.decode.indices
    assert ids is not None and ids.shape[0] == step.num_rows

    seen, seen_kwargs = [], []
    real_kernel = triton_kernel.varlen_paged_mqa_logits

    def spy(*args, **kwargs):
        seen.append(args)
        seen_kwargs.append(kwargs)
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(triton_kernel, "varlen_paged_mqa_logits", spy)
    topk = _run_indexer(monkeypatch, md, step.q[:, 0], None, step.kv_cache.squeeze(2),
                        step.weights, step.max_context_len)
    if backend == "deepgemm":
        call = dg.calls_to("fp8_fp4_paged_mqa_logits")[-1]
        assert call.kwargs["indices"] is ids and seen == []
        q_values = call.bound["q"][0]
    else:
        assert len(seen) == 1 and seen[0][5] is ids
        assert seen_kwargs[0]["max_run_len"] == int(step.decode_lens.max())
        assert dg.calls_to("fp8_fp4_paged_mqa_logits") == []
        q_values = seen[0][0]
    assert q_values.shape == (step.num_rows, 1, HEADS, DIM)  # rows = R, next_n = 1
    # bf16 logits (DeepGEMM 2.8.x on SM100) order near-ties differently than fp32
    _assert_topk_like_padded(topk, step, next_n, 1e-2 if backend == "deepgemm" else 1e-4)


def test_mxfp4_cache_hands_ids_to_deepgemm(monkeypatch):
    dg = _setup(monkeypatch, "deepgemm")
    step = _random_step(5, 4, pad_reqs=1, pad_rows=2)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4, fp4=True, width=step.block_table.shape[1],
                           max_model_len=step.max_context_len)
    assert builder.varlen_backend == "deepgemm"
    md = _build(builder, step)
    rows = step.num_rows
    num_blocks = step.kv_cache.shape[0]
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randint(0, 255, (num_blocks, PAGE, DIM // 2 + DIM // 32), generator=gen,
                             dtype=torch.uint8)
    q_quant = torch.randint(0, 255, (rows, HEADS, DIM // 2), generator=gen, dtype=torch.uint8)
    q_scale = torch.randint(0, 2 ** 20, (rows, HEADS), generator=gen, dtype=torch.int32)
    _run_indexer(monkeypatch, md, q_quant, q_scale, kv_cache, step.weights,
                 step.max_context_len, fp4=True)
    call = dg.calls_to("fp8_fp4_paged_mqa_logits")[-1]
    assert call.kwargs["indices"] is md.decode.indices
    q_values, scales = call.bound["q"]
    assert q_values.dtype == torch.int8 and q_values.shape == (rows, 1, HEADS, DIM // 2)
    assert scales.shape == (rows, 1, HEADS) and torch.equal(scales.reshape(rows, HEADS), q_scale)
    assert call.bound["kv_cache"].shape == (num_blocks, PAGE, 1, DIM // 2 + DIM // 32)
    assert torch.equal(call.bound["context_lens"], md.decode.seq_lens)
    assert call.bound["block_table"] is md.decode.block_table


def test_mxfp4_is_never_routed_to_triton():
    step = _random_step(1, 2, pad_reqs=0, pad_rows=0)
    rows = step.num_rows
    q = (torch.zeros((rows, 1, HEADS, DIM // 2), dtype=torch.int8),
         torch.zeros((rows, 1, HEADS), dtype=torch.int32))
    schedule = attach_varlen_ids(torch.zeros((NUM_SMS + 1, 2), dtype=torch.int32),
                                 step.rows.indices, "triton")
    with pytest.raises(RuntimeError, match="FP8 indexer cache only"):
        ours.fp8_fp4_paged_mqa_logits(q, step.kv_cache, step.weights,
                                      step.rows.context_lens.unsqueeze(-1), step.rows.block_table,
                                      schedule, step.max_context_len, clean_logits=False)


@pytest.mark.parametrize("clean", [False, True])
def test_untagged_schedule_is_the_stock_call(monkeypatch, clean):
    """No ids on the schedule: our kernel call hands DeepGEMM what stock's does."""
    import vllm.utils.deep_gemm as vdg

    fake_gpu(monkeypatch, (9, 0))
    dg = FakeDeepGemm("old", 90, num_sms=NUM_SMS).install(monkeypatch)
    step = _random_step(2, 2, pad_reqs=0, pad_rows=0)
    pad = step.padded(2)
    sched = vdg.get_paged_mqa_logits_metadata(pad["context_lens"], PAGE, NUM_SMS)
    args = ((pad["q"], None), step.kv_cache, pad["weights"], pad["context_lens"],
            pad["block_table"], sched)
    stock = vdg.fp8_fp4_paged_mqa_logits(*args, max_model_len=step.max_context_len,
                                         clean_logits=clean)
    got = ours.fp8_fp4_paged_mqa_logits(*args, max_model_len=step.max_context_len,
                                        clean_logits=clean)
    a, b = dg.calls[-2], dg.calls[-1]
    assert all(x is y for x, y in zip(a.args, b.args)) and len(a.args) == len(b.args)
    assert a.kwargs == b.kwargs == {"clean_logits": clean}
    assert torch.equal(stock, got)


def test_triton_backend_clean_logits(monkeypatch):
    """clean_logits=True through the Triton backend: -inf past each row's context."""
    step = _random_step(3, 3, pad_reqs=0, pad_rows=1)
    ids = step.rows.indices
    ctx = step.rows.context_lens.unsqueeze(-1)
    schedule = attach_varlen_ids(torch.zeros((NUM_SMS + 1, 2), dtype=torch.int32), ids, "triton")
    logits = ours.fp8_fp4_paged_mqa_logits((step.q, None), step.kv_cache, step.weights, ctx,
                                           step.rows.block_table, schedule, step.max_context_len,
                                           clean_logits=True)
    ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, step.rows.block_table,
                               step.max_context_len, ids)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert torch.all(logits[torch.arange(step.max_context_len)[None, :] >= ctx] == -math.inf)
