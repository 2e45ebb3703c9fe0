"""The kernel-call dispatch in vLLM 0.33.0's indexer op (and GLM-5-Next's copy of it):
untagged calls are exactly stock's, tagged varlen steps reach the real Triton kernel
(interpreter on the CPU) and equal the reference; bad varlen calls fail loudly."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

import vllm.model_executor.layers.sparse_attn_indexer as sai  # noqa: E402
import vllm.models.glm5next.nvidia.sparse_indexer as glm  # noqa: E402
import vllm.utils.deep_gemm as vdg  # noqa: E402
from vllm033_stubs import LINE, HopperDeepGemm, fake_gpu  # noqa: E402

from vllm_dsa_varlen import patches  # noqa: E402
from vllm_dsa_varlen.ops import launcher  # noqa: E402
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, quantize_kv_fp8, valid_mask  # noqa: E402
from vllm_dsa_varlen.plan import plan_decode_rows  # noqa: E402
from vllm_dsa_varlen.varlen_ids import attach_varlen_ids, varlen_ids_of  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_plugin")

HEADS, DIM, PAGE = 32, 128, 64  # the Triton kernel's supported shapes


def _step(gen, lens, seqs, num_blocks=12, width=8):
    """A varlen decode step: q fp8 [R, 1, H, D], weights [R, H], per-row context
    lengths [R, 1], block-table rows, ids (planned by plan.py), KV cache."""
    kv = quantize_kv_fp8(torch.randn((num_blocks, PAGE, DIM), generator=gen))
    bt = torch.randint(0, num_blocks, (len(lens), width), generator=gen, dtype=torch.int32)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    rows = plan_decode_rows(torch.tensor(seqs, dtype=torch.int32), qsl, bt,
                            num_rows=sum(lens), num_tokens=sum(lens))
    q = torch.randn((rows.num_rows, 1, HEADS, DIM), generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn((rows.num_rows, HEADS), generator=gen) / HEADS
    return q, w, rows.context_lens.unsqueeze(-1), rows.block_table, rows.indices, kv


@pytest.mark.parametrize("module", [sai, glm], ids=["sparse_attn_indexer", "glm5next"])
def test_untagged_calls_are_stocks_exactly(monkeypatch, module):
    """Without a tag the call reaches stock's wrapper with stock's arguments,
    ``indices`` included (upstream's own SM100 varlen passes them)."""
    stock = module.fp8_fp4_paged_mqa_logits
    patches.apply_all(line=LINE)
    assert module.fp8_fp4_paged_mqa_logits is not stock
    assert module.fp8_fp4_paged_mqa_logits.__wrapped__ is stock
    seen = []
    sentinel = torch.empty(0)
    monkeypatch.setattr(vdg, "_lazy_init", lambda: None)
    monkeypatch.setattr(vdg, "_fp8_fp4_paged_mqa_logits_impl",
                        lambda *a, **k: (seen.append((a, k)), sentinel)[1])
    args = [torch.zeros(2, 1, HEADS, DIM), None], torch.zeros(1), torch.zeros(2, HEADS), \
        torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32), \
        torch.zeros(9, 2, dtype=torch.int32)
    ids = torch.arange(2, dtype=torch.int32)
    # vLLM 0.34 added logits_dtype (before indices); 0.33's function has none
    dtypes = ([torch.float32, torch.bfloat16] if "logits_dtype" in inspect.signature(stock).parameters
              else [None])
    for indices in (None, ids):
        for dtype in dtypes:
            dtype_kw = {} if dtype is None else {"logits_dtype": dtype}
            out = module.fp8_fp4_paged_mqa_logits(tuple(args[0]), *args[1:], max_model_len=77,
                                                  indices=indices, **dtype_kw)
            assert out is sentinel
            call_args, call_kwargs = seen[-1]
            assert all(a is b for a, b in zip(call_args[1:6], args[1:6])) and call_args[6] == 77
            assert call_kwargs == {**dtype_kw, **({} if indices is None else {"indices": ids})}
    if dtypes != [None]:  # the default stock's own: float32
        module.fp8_fp4_paged_mqa_logits(tuple(args[0]), *args[1:], max_model_len=77)
        assert seen[-1][1] == {"logits_dtype": torch.float32}


@pytest.mark.interpreter
@pytest.mark.parametrize("lens,seqs", [([3, 1, 4], [130, 70, 200]), ([2, 2], [64, 129]),
                                        ([1], [5])])
def test_tagged_step_runs_the_triton_kernel(monkeypatch, lens, seqs):
    """A tagged step goes to the real Triton varlen kernel (interpreter on the
    CPU), never to DeepGEMM, and equals the reference on every valid position."""
    fake_gpu(monkeypatch, (9, 0))
    dg = HopperDeepGemm().install(monkeypatch)
    patches.apply_all(line=LINE)
    gen = torch.Generator().manual_seed(sum(seqs))
    q, w, ctx, bt, ids, kv = _step(gen, lens, seqs)
    schedule = attach_varlen_ids(torch.zeros((9, 2), dtype=torch.int32), ids, "own",
                                 max(lens))
    max_len = max(seqs) + 13
    seen = []
    real = launcher.varlen_paged_mqa_logits

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(launcher, "varlen_paged_mqa_logits", spy)
    logits = sai.fp8_fp4_paged_mqa_logits((q, None), kv, w, ctx, bt, schedule,
                                          max_model_len=max_len, indices=ids)
    assert dg.calls == []
    # the step's schedule cache is the tag's own dict (shared by every layer's call)
    assert seen[0]["schedule_cache"] is varlen_ids_of(schedule).schedules == {}
    want = paged_mqa_logits_ref(q, kv, w, ctx, bt, max_len, ids)
    mask = valid_mask(ctx, max_len, ids)
    assert logits.shape == (sum(lens), max_len) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[mask], want[mask], rtol=2e-3, atol=2e-3)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [5, 2, 1])
def test_fewer_query_rows_than_the_step_has_take_its_first_rows(monkeypatch, rows):
    """Queries of fewer rows than the step's ids and lengths (stock's dummy
    row of a decode batch without tokens): the launcher gets the first
    ``rows`` ids and lengths, the logits equal the reference's there; with
    every row present it gets the step's own tensors (no view made a layer)."""
    fake_gpu(monkeypatch, (9, 0))
    HopperDeepGemm().install(monkeypatch)
    patches.apply_all(line=LINE)
    gen = torch.Generator().manual_seed(rows)
    q, w, ctx, bt, ids, kv = _step(gen, [2, 3], [90, 150])
    schedule = attach_varlen_ids(torch.zeros((9, 2), dtype=torch.int32), ids, "own", 3)
    seen = []
    real = launcher.varlen_paged_mqa_logits

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(launcher, "varlen_paged_mqa_logits", spy)
    logits = sai.fp8_fp4_paged_mqa_logits((q[:rows], None), kv, w[:rows], ctx, bt, schedule,
                                          max_model_len=160, indices=ids)  # stock's weights[:R]
    got_ctx, got_ids = seen[0][3], seen[0][5]
    assert torch.equal(got_ctx, ctx[:rows]) and torch.equal(got_ids, ids[:rows])
    if rows == ids.shape[0]:
        assert got_ctx is ctx and got_ids is ids
    want = paged_mqa_logits_ref(q[:rows], kv, w[:rows], ctx[:rows], bt, 160, ids[:rows])
    mask = valid_mask(ctx[:rows], 160, ids[:rows])
    assert logits.shape == (rows, 160)
    torch.testing.assert_close(logits[mask], want[mask], rtol=2e-3, atol=2e-3)


def test_bad_varlen_calls_fail_loudly(monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    patches.apply_all(line=LINE)
    gen = torch.Generator().manual_seed(1)
    q, w, ctx, bt, ids, kv = _step(gen, [2, 3], [90, 100])
    schedule = attach_varlen_ids(torch.zeros((9, 2), dtype=torch.int32), ids, "own", 3)
    call = sai.fp8_fp4_paged_mqa_logits
    with pytest.raises(RuntimeError, match="FP8 indexer cache only"):
        call((q, torch.ones(q.shape[:-1], dtype=torch.int32)), kv, w, ctx, bt, schedule,
             max_model_len=128, indices=ids)
    with pytest.raises(RuntimeError, match=r"\[R, 1, H, D\]"):
        call((q.reshape(1, 5, HEADS, DIM), None), kv, w, ctx, bt, schedule, max_model_len=128,
             indices=ids)
    with pytest.raises(RuntimeError, match="not the run ids"):
        call((q, None), kv, w, ctx, bt, schedule, max_model_len=128, indices=ids.clone())


@pytest.mark.parametrize("module", [sai, glm], ids=["sparse_attn_indexer", "glm5next"])
def test_decode_topk_goes_through_the_choice(monkeypatch, module):
    """``get_indexer_topk("auto")`` gives stock's module behind the project's
    choice (one per backend); a backend the user named is stock's own; a call
    the kernel does not serve reaches stock's module with its own arguments,
    one it serves (as on sm_90) the kernel; undone, stock's function."""
    from vllm_dsa_varlen import topk
    from vllm_dsa_varlen.ops import cuda_topk
    from vllm_dsa_varlen.ops.reference import topk_ref, topk_selection_ok

    stock_get = module.get_indexer_topk
    patches.apply_all(line=LINE)
    auto = module.get_indexer_topk("auto")
    assert auto is module.get_indexer_topk("auto") and auto.stock is stock_get("auto")
    assert module.get_indexer_topk("persistent") is stock_get("persistent")
    assert auto.resolve_backend == stock_get("auto").resolve_backend
    seen = []
    monkeypatch.setattr(auto, "stock", lambda *a: seen.append(a))
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 300, generator=gen)
    lens = torch.tensor([[300, 12], [299, 0]], dtype=torch.int32)  # [B, next_n]
    out = torch.full((4, 32), -7, dtype=torch.int32)
    auto(logits, lens, 2, out, 32, 300)  # a CPU call: stock's
    assert len(seen) == 1 and seen[0][0] is logits and seen[0][2:] == (2, out, 32, 300)
    monkeypatch.setattr(topk, "serves", topk.layout_ok)
    monkeypatch.setattr(topk, "decide", lambda index: topk.TopkChoice(True, "test"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bounds = []
    monkeypatch.setattr(cuda_topk, "launch_checked",
                        lambda lg, ln, k, out, bound=None:
                        bounds.append(bound) or out.copy_(topk_ref(lg, ln, k)))
    auto(logits, lens, 2, out, 32, 300)
    assert len(seen) == 1 and topk_selection_ok(logits, lens, 32, out) == []
    assert bounds == [300]  # the op's max_seq_len argument sizes the kernel's plan
    patches.undo_all()
    assert module.get_indexer_topk is stock_get


@pytest.mark.parametrize("module", [sai, glm], ids=["sparse_attn_indexer", "glm5next"])
def test_auto_counts_stocks_cooperative_rows(monkeypatch, module):
    """Stock 0.33.0's ``auto`` chain takes cooperative_topk up to its module's
    AUTO_COOPERATIVE_MAX_ROWS (64): up to that many rows the project's ``auto``
    takes a bounded call of long contexts only where a CTA stages a row whole
    (timed at 0.92-0.94x cooperative_topk there, level past it); one row more
    goes to the kernel past the stage too (against persistent_topk)."""
    import sys

    from vllm_dsa_varlen import topk
    from vllm_dsa_varlen.ops import cuda_topk

    patches.apply_all(line=LINE)
    try:
        auto = module.get_indexer_topk("auto")
        limit = sys.modules[type(auto.stock).__module__].AUTO_COOPERATIVE_MAX_ROWS
        assert auto.cooperative_rows == limit >= topk.COOPERATIVE_ROWS
        seen, ours = [], []
        monkeypatch.setattr(auto, "stock", lambda *a: seen.append(a))
        monkeypatch.setattr(topk, "serves", topk.layout_ok)
        monkeypatch.setattr(topk, "decide",
                            lambda index: topk.TopkChoice(True, "test", per_call=True))
        monkeypatch.setattr(topk, "num_sms", lambda index: 132)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda_topk, "launch_checked",
                            lambda lg, ln, k, out, bound=None: ours.append(1))
        width = cuda_topk.MAX_STAGE + 1
        for rows, bound, want in [(limit, cuda_topk.MAX_STAGE + 1, (1, 0)),
                                  (limit, cuda_topk.MAX_STAGE, (1, 1)),
                                  (limit, topk.LONG_ROWS - 1, (2, 1)),
                                  (limit + 1, cuda_topk.MAX_STAGE + 1, (2, 2))]:
            logits = torch.zeros(rows, width)
            lens = torch.full((rows, 1), bound, dtype=torch.int32)
            out = torch.zeros(rows, 8, dtype=torch.int32)
            auto(logits, lens, 1, out, 8, bound)
            assert (len(seen), len(ours)) == want, (rows, bound)
    finally:
        patches.undo_all()


@pytest.mark.interpreter
def test_varlen_steps_write_float32_where_bf16_logits_are_asked(monkeypatch, caplog):
    """vLLM 0.34's ``indexer_logits_dtype=bfloat16``: a varlen step's logits
    come from the project's kernel in float32 (equal to the reference; vLLM's
    top-k then reads them as they are), and that is said once in the log."""
    from vllm_dsa_varlen.vllm_0_33.model_executor.layers import sparse_attn_indexer as ours

    if "logits_dtype" not in inspect.signature(sai.fp8_fp4_paged_mqa_logits).parameters:
        pytest.skip("this vLLM's decode logits function takes no logits_dtype (0.33)")
    fake_gpu(monkeypatch, (9, 0))
    dg = HopperDeepGemm().install(monkeypatch)
    patches.apply_all(line=LINE)
    monkeypatch.setattr(ours, "_logged_dtypes", set())
    gen = torch.Generator().manual_seed(11)
    lens, seqs = [3, 1, 2], [130, 70, 90]
    q, w, ctx, bt, ids, kv = _step(gen, lens, seqs)
    schedule = attach_varlen_ids(torch.zeros((9, 2), dtype=torch.int32), ids, "own", 3)
    max_len = max(seqs) + 5
    want = paged_mqa_logits_ref(q, kv, w, ctx, bt, max_len, ids)
    mask = valid_mask(ctx, max_len, ids)
    with caplog.at_level(logging.INFO, logger="vllm.dsa_varlen"):
        for _ in range(3):
            logits = sai.fp8_fp4_paged_mqa_logits((q, None), kv, w, ctx, bt, schedule,
                                                  max_model_len=max_len,
                                                  logits_dtype=torch.bfloat16, indices=ids)
            assert logits.dtype == torch.float32 and dg.calls == []
            torch.testing.assert_close(logits[mask], want[mask], rtol=2e-3, atol=2e-3)
        sai.fp8_fp4_paged_mqa_logits((q, None), kv, w, ctx, bt, schedule, max_model_len=max_len,
                                     logits_dtype=torch.float32, indices=ids)
    said = [r.getMessage() for r in caplog.records if "logits dtype" in r.getMessage()]
    assert len(said) == 1 and "torch.bfloat16" in said[0] and "float32" in said[0]
