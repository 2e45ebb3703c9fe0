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

import vllm_dsa_varlen.ops.launcher as launcher  # noqa: E402
from vllm_dsa_varlen import config, patches, policy  # noqa: E402
from vllm_dsa_varlen.vllm_0_27.model_executor.layers import sparse_attn_indexer as ours  # noqa: E402
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref  # noqa: E402
from vllm_dsa_varlen.varlen_ids import attach_varlen_ids, varlen_ids_of  # noqa: E402
from vllm_dsa_varlen.bench.workloads import make_decode_step  # noqa: E402

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
    """'deepgemm' (SM100, DeepGEMM 2.8.x double), 'deepgemm-2.6' (SM100, vLLM
    0.27.1's vendored generation), 'own' (SM90, backend forced)."""
    if backend.startswith("deepgemm"):
        fake_gpu(monkeypatch, (10, 0))
        flavour = "2.6" if backend == "deepgemm-2.6" else "2.8"
        return FakeDeepGemm(flavour, 100, num_sms=NUM_SMS).install(monkeypatch)
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setenv(config.BACKEND_ENV, "own")
    return FakeDeepGemm("2.6", 90, num_sms=NUM_SMS).install(monkeypatch)


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


@pytest.mark.parametrize("backend", ["deepgemm", "deepgemm-2.6",
                                     pytest.param("own", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("seed", range(3))
def test_decode_topk_equals_the_padded_path(monkeypatch, backend, seed):
    next_n = 3
    dg = _setup(monkeypatch, backend)
    step = _random_step(seed, next_n, pad_reqs=seed % 2, pad_rows=seed)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=next_n, width=step.block_table.shape[1],
                           max_model_len=step.max_context_len)
    assert builder.varlen_backend == backend.split("-")[0]
    md = _build(builder, step)
    ids = md.decode.indices
    assert ids is not None and ids.shape[0] == step.num_rows

    seen, seen_kwargs = [], []
    real_kernel = launcher.varlen_paged_mqa_logits

    def spy(*args, **kwargs):
        seen.append(args)
        seen_kwargs.append(kwargs)
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(launcher, "varlen_paged_mqa_logits", spy)
    topk = _run_indexer(monkeypatch, md, step.q[:, 0], None, step.kv_cache.squeeze(2),
                        step.weights, step.max_context_len)
    if backend.startswith("deepgemm"):
        call = dg.calls_to("fp8_fp4_paged_mqa_logits")[-1]
        assert call.kwargs["indices"] is ids and seen == []
        q_values = call.bound["q"][0]
    else:
        assert len(seen) == 1 and seen[0][5] is ids
        assert seen_kwargs[0]["max_run_len"] == int(step.decode_lens.max())
        # the step's schedule cache: the tag's own dict, shared by every layer's call
        tag = varlen_ids_of(md.decode.schedule_metadata)
        assert isinstance(tag.schedules, dict) and seen_kwargs[0]["schedule_cache"] is tag.schedules
        assert dg.calls_to("fp8_fp4_paged_mqa_logits") == []
        q_values = seen[0][0]
    assert q_values.shape == (step.num_rows, 1, HEADS, DIM)  # rows = R, next_n = 1
    # bf16 logits (DeepGEMM 2.8.x on SM100) order near-ties differently than fp32
    _assert_topk_like_padded(topk, step, next_n, 1e-2 if backend == "deepgemm" else 1e-4)


# --------------------------------------------------------------------------- per step

def _run_indexer_spied(monkeypatch, md, step):
    """:func:`_run_indexer` on ``step``, recording what the op's decode kernel
    call (the plugin's dispatch) returned.  The spy is removed before the test
    ends, so the patch registry's undo finds its own replacement again."""
    out = []
    inner = sai.fp8_fp4_paged_mqa_logits

    def spy(*args, **kwargs):
        logits = inner(*args, **kwargs)
        out.append((args, kwargs, logits.clone()))
        return logits

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sai, "fp8_fp4_paged_mqa_logits", spy)
        topk = _run_indexer(monkeypatch, md, step.q[:, 0], None, step.kv_cache.squeeze(2),
                            step.weights, step.max_context_len)
    assert sai.fp8_fp4_paged_mqa_logits is inner
    return topk, out


def _assert_logits_like_padded(logits, step, next_n):
    """On every valid position of every real token, the logits equal the padded path's."""
    pad = step.padded(next_n)
    ref = paged_mqa_logits_ref(pad["q"], step.kv_cache, pad["weights"], pad["context_lens"],
                               pad["block_table"], step.max_context_len)
    ctx = pad["context_lens"].reshape(-1)[pad["row_of"]]
    real = pad["row_of"].numel()
    cols = torch.arange(step.max_context_len)
    valid = cols[None, :] < ctx[:, None].long()
    got = logits[:real, : step.max_context_len]
    torch.testing.assert_close(got[valid], ref[pad["row_of"]][valid], rtol=1e-5, atol=1e-5)


def _reference_varlen_kernel(q, kv_cache, weights, context_lens, block_table, indices,
                             max_context_len, **_):
    """Stand-in for the Triton kernel (the kernel itself: tests/ops, tests/test_equivalence.py)."""
    return paged_mqa_logits_ref(q, kv_cache, weights, context_lens, block_table,
                                max_context_len, indices)


@pytest.mark.parametrize("num_reqs,uniform", [(4, False), (8, True), (64, True), (64, False)])
def test_flattened_per_step_both_kernels_give_the_padded_result(monkeypatch, num_reqs, uniform):
    """SM90, next_n = 4, DeepGEMM installed: each step's kernel call goes to the
    varlen kernel or to stock's id-less DeepGEMM call on the same flattened rows,
    as ``policy.varlen_wins`` says; either way the op's logits on valid positions
    and its top-k sets are the padded path's."""
    next_n = 4
    fake_gpu(monkeypatch, (9, 0))
    dg = FakeDeepGemm("2.6", 90, num_sms=NUM_SMS).install(monkeypatch)
    monkeypatch.setattr(launcher, "varlen_paged_mqa_logits", _reference_varlen_kernel)
    # The op follows whatever the table says (the table itself: tests/test_policy.py).
    monkeypatch.setattr(policy, "MEASURED", (policy.Rule("flattened", min_run=3,
                                                         min_requests=64, note="test table"),))
    gen = torch.Generator().manual_seed(num_reqs)
    lens = ([next_n] * num_reqs if uniform else
            [next_n] + torch.randint(1, next_n + 1, (num_reqs - 1,), generator=gen).tolist())
    seqs = [n + int(x) for n, x in zip(lens, torch.randint(0, 300, (num_reqs,), generator=gen))]
    step = make_decode_step(lens, seqs, heads=HEADS, dim=DIM, page=PAGE, seed=num_reqs,
                            padding_rows=2)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=next_n, width=step.block_table.shape[1],
                           max_model_len=step.max_context_len, max_tokens=512, max_seqs=128)
    assert builder.decode_path.per_step == "flattened"
    md = _build(builder, step)
    varlen = policy.varlen_wins(policy.StepFacts.from_decode_lens(
        lens, rows=step.num_rows, max_context=max(seqs)), "flattened")
    assert varlen == (num_reqs >= 64)
    n_dg = len(dg.calls_to("fp8_fp4_paged_mqa_logits"))
    topk, calls = _run_indexer_spied(monkeypatch, md, step)
    dg_calls = dg.calls_to("fp8_fp4_paged_mqa_logits")[n_dg:]
    if varlen:
        assert dg_calls == []
    else:  # exactly stock's flattened call: [R, 1] rows, no ids
        assert len(dg_calls) == 1 and "indices" not in dg_calls[0].kwargs
        assert dg_calls[0].bound["q"][0].shape == (step.num_rows, 1, HEADS, DIM)
    (args, _, logits), = calls
    assert args[0][0].shape == (step.num_rows, 1, HEADS, DIM)
    _assert_logits_like_padded(logits, step, next_n)
    _assert_topk_like_padded(topk, step, next_n, 1e-4)


@pytest.mark.parametrize("lens,seqs", [
    ([2, 2, 2, 2], [90, 7, 300, 41]),          # uniform: stock's native [B, 2] kernel
    ([2, 1, 2, 1, 2], [90, 7, 300, 41, 12]),   # stock would split: varlen decodes
    ([1, 2, 2], [30, 200, 5]),
])
def test_split_hybrid_both_layouts_give_the_padded_result(monkeypatch, lens, seqs):
    """SM90, next_n = 2, DeepGEMM installed: a uniform step runs DeepGEMM's native
    ``[B, 2]`` kernel as stock does; a step stock would split stays all decodes
    and runs the varlen kernel on flattened rows.  Both: the padded path's
    logits on valid positions and top-k sets."""
    next_n = 2
    fake_gpu(monkeypatch, (9, 0))
    dg = FakeDeepGemm("2.6", 90, num_sms=NUM_SMS).install(monkeypatch)
    monkeypatch.setattr(launcher, "varlen_paged_mqa_logits", _reference_varlen_kernel)
    step = make_decode_step(lens, seqs, heads=HEADS, dim=DIM, page=PAGE, seed=len(lens))
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=next_n, width=step.block_table.shape[1],
                           max_model_len=step.max_context_len)
    assert builder.decode_path.per_step == "split"
    md = _build(builder, step)
    assert md.num_decodes == len(lens) and md.num_prefills == 0
    uniform = len(set(lens)) == 1
    n_dg = len(dg.calls_to("fp8_fp4_paged_mqa_logits"))
    topk, calls = _run_indexer_spied(monkeypatch, md, step)
    dg_calls = dg.calls_to("fp8_fp4_paged_mqa_logits")[n_dg:]
    (args, _, logits), = calls
    if uniform:  # stock's native call: [B, 2] queries, [B, 2] lengths, no ids
        assert md.decode.indices is None
        assert len(dg_calls) == 1 and "indices" not in dg_calls[0].kwargs
        assert args[0][0].shape == (len(lens), next_n, HEADS, DIM)
        logits = logits.reshape(len(lens) * next_n, -1)  # padded rows == real rows here
    else:
        assert dg_calls == [] and md.decode.indices is not None
        assert args[0][0].shape == (step.num_rows, 1, HEADS, DIM)
    _assert_logits_like_padded(logits, step, next_n)
    _assert_topk_like_padded(topk, step, next_n, 1e-4)


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
                                 step.rows.indices, "own")
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


@pytest.mark.interpreter
def test_triton_backend_clean_logits(monkeypatch):
    """clean_logits=True through the Triton backend: -inf past each row's context."""
    step = _random_step(3, 3, pad_reqs=0, pad_rows=1)
    ids = step.rows.indices
    ctx = step.rows.context_lens.unsqueeze(-1)
    schedule = attach_varlen_ids(torch.zeros((NUM_SMS + 1, 2), dtype=torch.int32), ids, "own")
    logits = ours.fp8_fp4_paged_mqa_logits((step.q, None), step.kv_cache, step.weights, ctx,
                                           step.rows.block_table, schedule, step.max_context_len,
                                           clean_logits=True)
    ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, step.rows.block_table,
                               step.max_context_len, ids)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert torch.all(logits[torch.arange(step.max_context_len)[None, :] >= ctx] == -math.inf)


@pytest.mark.interpreter
@pytest.mark.parametrize("cut", [0, 1, 3])
def test_fewer_query_rows_than_the_step_has_take_its_first_rows(monkeypatch, cut):
    """Queries of ``cut`` rows fewer than the step's ids, lengths and per-row
    block table (stock's dummy row of a decode batch without tokens): the
    launcher gets each one's first rows, the logits equal the reference's
    there; with every row present, the step's own tensors (no view a layer)."""
    step = _random_step(4 + cut, 3, pad_reqs=0, pad_rows=0)
    ids, bt = step.rows.indices, step.rows.block_table
    ctx = step.rows.context_lens.unsqueeze(-1)
    rows = step.num_rows - cut
    schedule = attach_varlen_ids(torch.zeros((NUM_SMS + 1, 2), dtype=torch.int32), ids, "own")
    seen = []
    real = launcher.varlen_paged_mqa_logits
    monkeypatch.setattr(launcher, "varlen_paged_mqa_logits",
                        lambda *a, **k: (seen.append(a), real(*a, **k))[1])
    logits = ours.fp8_fp4_paged_mqa_logits((step.q[:rows], None), step.kv_cache,
                                           step.weights[:rows], ctx, bt, schedule,
                                           step.max_context_len, clean_logits=False)
    got_ctx, got_bt, got_ids = seen[0][3], seen[0][4], seen[0][5]
    assert torch.equal(got_ctx, ctx[:rows]) and torch.equal(got_bt, bt[:rows])
    assert torch.equal(got_ids, ids[:rows])
    if cut == 0:
        assert got_ctx is ctx and got_bt is bt and got_ids is ids
    ref = paged_mqa_logits_ref(step.q[:rows], step.kv_cache, step.weights[:rows], ctx[:rows],
                               bt[:rows], step.max_context_len, ids[:rows])
    valid = torch.arange(step.max_context_len)[None, :] < ctx[:rows]
    assert logits.shape == (rows, step.max_context_len)
    torch.testing.assert_close(logits[valid], ref[valid], rtol=1e-4, atol=1e-4)


def test_the_op_modules_torch_sends_the_decode_topk_through_the_choice(monkeypatch):
    """The indexer op module's ``torch`` global is a view of torch (every name
    torch's) whose ``ops._C.persistent_topk`` / ``cooperative_topk`` go
    through vllm_dsa_varlen.topk.dispatch: the project's kernel where it
    serves, the op itself, with its own arguments, otherwise; undone, the
    module's torch is torch again."""
    from vllm_dsa_varlen import topk
    from vllm_dsa_varlen.ops import cuda_topk
    from vllm_dsa_varlen.ops.reference import topk_ref, topk_selection_ok
    from vllm_dsa_varlen.varlen_ids import mark_bound

    assert sai.torch is torch
    patches.apply_all(line="0.27")
    view = sai.torch
    assert view is not torch and view.float32 is torch.float32 and view.Tensor is torch.Tensor
    assert view.ops.aten is torch.ops.aten and view.cuda is torch.cuda
    seen = []
    fake_c = SimpleNamespace(
        persistent_topk=lambda *a: seen.append(("persistent", a)),
        cooperative_topk=lambda *a: seen.append(("cooperative", a)), other="other")
    c_ops = ours._TopkOps(SimpleNamespace(_C=fake_c))
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 200, generator=gen)
    lens = torch.tensor([[200], [7], [150], [0]], dtype=torch.int32)
    out = torch.full((4, 16), -7, dtype=torch.int32)
    work = torch.empty(8, dtype=torch.uint8)
    c_ops.persistent_topk(logits, lens, out, work, 16, 200)  # a CPU call: the op's
    c_ops.cooperative_topk(logits, lens, out, work, 16, 200)
    assert [s[0] for s in seen] == ["persistent", "cooperative"]
    assert all(s[1][0] is logits and s[1][3] is work and s[1][4:] == (16, 200) for s in seen)
    assert c_ops.other == "other" and (out == -7).all()
    # as on an sm_90 GPU with the kernel loaded: the kernel, not the op
    monkeypatch.setattr(topk, "serves", topk.layout_ok)
    monkeypatch.setattr(topk, "decide", lambda index: topk.TopkChoice(True, "test"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bounds = []
    monkeypatch.setattr(cuda_topk, "launch_checked",
                        lambda lg, ln, k, out, bound=None:
                        bounds.append(bound) or out.copy_(topk_ref(lg, ln, k)))
    c_ops.persistent_topk(logits, lens, out, work, 16, 200)
    c_ops.cooperative_topk(logits, lens, out, work, 16, 150)
    assert len(seen) == 2 and topk_selection_ok(logits, lens, 16, out) == []
    # cooperative_topk's max_seq_len bounds the step's rows; persistent_topk's is stock's
    # logits width (max_model_len), no bound, unless the logits carry a varlen step's
    assert bounds == [None, 150]
    c_ops.persistent_topk(mark_bound(logits, 180), lens, out, work, 16, 200)
    assert bounds == [None, 150, 180] and topk_selection_ok(logits, lens, 16, out) == []
    patches.undo_all()
    assert sai.torch is torch
