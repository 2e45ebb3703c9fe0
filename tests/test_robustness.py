"""Bad inputs: each gets a clear error naming the argument and the expectation,
or a logged fallback to stock behaviour.

Where each bad input of the issue is covered ("here" = this file):

* q: wrong dtype / shape
    - Triton kernel: tests/ops/test_triton_paged_mqa_logits.py::
      test_bad_input_names_the_argument[q dtype, q shape]
    - dispatch, Triton backend (non-FP8 or MXFP4 queries): here
      test_dispatch_triton_names_the_argument[q dtype, q next_n 2];
      tests/model_executor/layers/test_sparse_attn_indexer.py::test_mxfp4_is_never_routed_to_triton
    - DeepGEMM wrapper with ids (not [R, 1, H, D]): here
      test_deepgemm_varlen_layout_is_checked_before_deepgemm[q ...]
* weights: wrong dtype / shape
    - Triton kernel: ...::test_bad_input_names_the_argument[weights dtype, weights shape];
      dispatch: here test_dispatch_triton_names_the_argument[weights ...]
    - DeepGEMM wrapper with ids (rows): here test_deepgemm_varlen_layout_...[weights rows]
      (dtype: DeepGEMM's own host checks, as in stock; 2.8.x bf16 is converted)
* KV cache: wrong dtype / shape
    - Triton kernel: ...[kv dtype, kv width, kv page]; dispatch: here [kv dtype];
      reference: here test_reference_names_a_bad_kv_cache
    - DeepGEMM: its own host checks, as in stock (the plugin passes the cache unchanged)
* context lengths: wrong dtype / shape
    - Triton kernel: ...[context dtype, context shape]; dispatch: here [context ...]
    - DeepGEMM wrapper with ids (kernel and scheduler): here
      test_deepgemm_varlen_layout_...[context ...], test_deepgemm_scheduler_checks_context_lens
    - planner (seq_lens / query_start_loc): tests/test_plan.py::test_bad_shapes_are_named
* block table: wrong dtype / shape
    - Triton kernel: ...[block table dtype, block table rows]; dispatch: here [block table ...]
    - DeepGEMM wrapper with ids: here test_deepgemm_varlen_layout_...[block table ...]
    - planner: tests/test_plan.py::test_bad_shapes_are_named
* ids: not int32 / not contiguous / misaligned / wrong length (or 2-D, not a tensor)
    - Triton kernel: ...[ids dtype, ids length, ids 2-D, ids not contiguous,
      ids misaligned, ids missing]
    - DeepGEMM wrapper (kernel and scheduler): tests/utils/test_deep_gemm.py::
      test_ids_contract_is_checked_before_deepgemm (int64, short, strided, misaligned);
      here test_deepgemm_wrapper_refuses_bad_ids_before_deepgemm (the rest: too long,
      2-D, int16, not a tensor)
    - dispatch (``sparse_attn_indexer``'s kernel call), both backends: here
      test_dispatch_refuses_bad_ids_before_the_kernel (ids too short: ``run ids``)
    - the carrier: here test_attach_refuses_bad_ids_backend_and_run_length
* context length beyond the block table
    - Triton kernel (data-dependent, so with ``validate_contents=True``; a launch
      stays sync-free and the kernel clamps every run to the block table's
      capacity, never reading past it): tests/ops/test_triton_paged_mqa_logits.py::
      test_contents_check_catches_context_beyond_the_block_table,
      ::test_contents_check_catches_context_past_max_len
    - logits wider than a rank-local block table (DCP) are valid and served: here
      test_triton_under_dcp_logits_wider_than_local_block_table,
      tests/ops/test_triton_paged_mqa_logits.py::test_logits_wider_than_the_block_table_are_served
* unsupported head count or head dim (or page size)
    - Triton kernel: ...[head count, head dim, kv page]
    - builder (logged fallback to stock): here test_unsupported_triton_cache_falls_back_to_stock,
      test_own_kernel_serves_only_supported_caches
* vLLM not 0.27.x
    - tests/test_patches.py::test_register_on_another_vllm_warns_and_patches_nothing
      (logged, stock), ::test_register_accepts_the_0_27_series,
      ::test_failed_apply_rolls_back (a patch target missing names it)
* DeepGEMM missing, or without ``indices``
    - decision table: tests/test_config.py::test_decision_table
    - builder: tests/v1/attention/backends/mla/test_indexer.py::test_init_decides_the_path
      (SM100 with an id-less DeepGEMM -> Triton or stock); here
      test_sm100_without_a_varlen_deepgemm_falls_back_to_stock (logged, builds stock
      metadata; forced backend -> warning)
    - wrapper given ids for an id-less DeepGEMM: tests/utils/test_deep_gemm.py::
      test_ids_on_an_api_without_indices_raise (RuntimeError naming ``indices``)
* Non-varlen calls stay stock: tests/utils/test_deep_gemm.py::
  test_non_varlen_calls_reach_deepgemm_exactly_as_stock; here
  test_layout_checks_apply_only_with_ids.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from fake_deep_gemm import FakeDeepGemm  # noqa: E402
from vllm_stubs import NUM_SMS, decode_batch, fake_gpu, make_builder, random_block_table  # noqa: E402

from vllm_dsa_varlen import config, patches, varlen_ids  # noqa: E402
from vllm_dsa_varlen.vllm_0_27.model_executor.layers import sparse_attn_indexer as dispatch  # noqa: E402
from vllm_dsa_varlen.ops.reference import (  # noqa: E402
    paged_mqa_logits_ref,
    split_fused_kv,
    valid_mask,
)
from vllm_dsa_varlen.vllm_0_27.utils import deep_gemm as dsa_dg  # noqa: E402
from vllm_dsa_varlen.varlen_ids import VarlenTag, attach_varlen_ids  # noqa: E402
from vllm_dsa_varlen.bench.workloads import make_decode_step  # noqa: E402

PAGE = 64


pytestmark = pytest.mark.usefixtures("clean_plugin")


def _step(seed=0, lens=(3, 1, 2), seqs=None):
    seqs = seqs or [300, 90, 170, 230][: len(lens)]
    return make_decode_step(list(lens), list(seqs), heads=32, dim=128, page=PAGE, seed=seed)


def _varlen(step):
    """The varlen call's arguments as the indexer op passes them."""
    rows = step.rows
    return dict(q=(step.q, None), kv_cache=step.kv_cache, weights=step.weights,
                context_lens=rows.context_lens.unsqueeze(-1), block_tables=rows.block_table,
                max_model_len=step.max_context_len, ids=rows.indices)


def _misaligned(ids):
    storage = torch.zeros(ids.numel() + 2, dtype=torch.int32)
    out = storage[1:1 + ids.numel()]
    out.copy_(ids)
    return out


def _forge(schedule, ids, backend):
    """A schedule view carrying ``ids`` as they are (``attach_varlen_ids``
    refuses some of them): what the dispatch would see if a carrier were wrong."""
    view = schedule.view(schedule.shape)
    setattr(view, varlen_ids._ATTR, VarlenTag(ids, backend, 1))
    return view


BAD_IDS = {
    "int64": (lambda ids: ids.long(), "indices: expected dtype torch.int32"),
    "int16": (lambda ids: ids.to(torch.int16), "indices: expected dtype torch.int32"),
    "2-D": (lambda ids: ids.view(-1, 1), "indices: expected shape"),
    "too short": (lambda ids: ids[:-1], "indices: expected shape"),
    "too long": (lambda ids: torch.cat([ids, ids[-1:] + 1]), "indices: expected shape"),
    "not contiguous": (lambda ids: torch.stack([ids, ids], 1)[:, 0], "indices: expected a contiguous"),
    "misaligned": (_misaligned, "indices: expected an 8-byte aligned"),
    "not a tensor": (lambda ids: ids.tolist(), "indices: expected an int32 tensor"),
}


# --------------------------------------------------------------------------- DeepGEMM wrapper

def _sm100(monkeypatch):
    fake_gpu(monkeypatch, (10, 0))
    return FakeDeepGemm("2.8", 100, num_sms=NUM_SMS).install(monkeypatch)


@pytest.mark.parametrize("case", ["int16", "2-D", "too long", "not a tensor"])
def test_deepgemm_wrapper_refuses_bad_ids_before_deepgemm(monkeypatch, case):
    """The cases tests/utils/test_deep_gemm.py does not already cover."""
    dg = _sm100(monkeypatch)
    a = _varlen(_step())
    sched = dsa_dg.get_paged_mqa_logits_metadata(a["context_lens"], PAGE, NUM_SMS,
                                                 indices=a["ids"])
    mutate, match = BAD_IDS[case]
    bad = mutate(a["ids"])
    n = len(dg.calls)
    with pytest.raises(ValueError, match=match):
        dsa_dg.fp8_fp4_paged_mqa_logits(a["q"], a["kv_cache"], a["weights"], a["context_lens"],
                                         a["block_tables"], sched, a["max_model_len"], False,
                                         indices=bad)
    with pytest.raises(ValueError, match=match):
        dsa_dg.get_paged_mqa_logits_metadata(a["context_lens"], PAGE, NUM_SMS, indices=bad)
    assert len(dg.calls) == n  # nothing reached DeepGEMM


def _as_next_n_2(t):
    return t.reshape(t.shape[0] // 2, 2, *t.shape[2:])


BAD_LAYOUT = {
    "q next_n 2": (lambda a: a.update(q=(_as_next_n_2(a["q"][0]), None)), "q: with indices"),
    "q 3-D": (lambda a: a.update(q=(a["q"][0][:, 0], None)), "q: with indices"),
    "weights rows": (lambda a: a.update(weights=a["weights"][:-1]), "weights: with indices"),
    "weights 1-D": (lambda a: a.update(weights=a["weights"].reshape(-1)), "weights: with indices"),
    "context int64": (lambda a: a.update(context_lens=a["context_lens"].long()),
                      "context_lens: with indices .* int32"),
    "context 1-D": (lambda a: a.update(context_lens=a["context_lens"][:, 0]), "context_lens"),
    "context [R/2, 2]": (lambda a: a.update(context_lens=a["context_lens"].reshape(-1, 2)),
                         "context_lens"),
    "block table int64": (lambda a: a.update(block_tables=a["block_tables"].long()),
                          "block_table: with indices"),
    "block table rows": (lambda a: a.update(block_tables=a["block_tables"][:-1]),
                         "block_table: with indices"),
}


@pytest.mark.parametrize("case", list(BAD_LAYOUT))
def test_deepgemm_varlen_layout_is_checked_before_deepgemm(monkeypatch, case):
    dg = _sm100(monkeypatch)
    a = _varlen(_step(lens=(3, 1, 2, 2)))  # 8 rows: reshapable to next_n 2
    sched = dsa_dg.get_paged_mqa_logits_metadata(a["context_lens"], PAGE, NUM_SMS,
                                                 indices=a["ids"])
    mutate, match = BAD_LAYOUT[case]
    mutate(a)
    n = len(dg.calls)
    with pytest.raises(ValueError, match=match):
        dsa_dg.fp8_fp4_paged_mqa_logits(a["q"], a["kv_cache"], a["weights"], a["context_lens"],
                                         a["block_tables"], sched, a["max_model_len"], False,
                                         indices=a["ids"][: a["q"][0].shape[0]]
                                         if case == "q next_n 2" else a["ids"])
    assert len(dg.calls) == n


@pytest.mark.parametrize("bad,match", [
    (lambda c: c.long(), "context_lens: with indices .* int32"),
    (lambda c: c[:, 0], "indices: expected shape|context_lens"),
    (lambda c: c.reshape(-1, 2), "indices: expected shape|context_lens"),
])
def test_deepgemm_scheduler_checks_context_lens(monkeypatch, bad, match):
    dg = _sm100(monkeypatch)
    a = _varlen(_step(lens=(3, 1, 2, 2)))
    with pytest.raises(ValueError, match=match):
        dsa_dg.get_paged_mqa_logits_metadata(bad(a["context_lens"]), PAGE, NUM_SMS,
                                             indices=a["ids"])
    assert dg.calls == []


def test_layout_checks_apply_only_with_ids(monkeypatch):
    """Without ids the padded [B, next_n] layout reaches DeepGEMM untouched."""
    fake_gpu(monkeypatch, (9, 0))
    dg = FakeDeepGemm("old", 90, num_sms=NUM_SMS).install(monkeypatch)
    step = _step(lens=(2, 1, 2), seqs=(200, 60, 130))
    pad = step.padded(2)
    sched = dsa_dg.get_paged_mqa_logits_metadata(pad["context_lens"], PAGE, NUM_SMS)
    logits = dsa_dg.fp8_fp4_paged_mqa_logits((pad["q"], None), step.kv_cache, pad["weights"],
                                             pad["context_lens"], pad["block_table"], sched,
                                             step.max_context_len, False)
    assert [c.name for c in dg.calls] == ["get_paged_mqa_logits_metadata",
                                          "fp8_fp4_paged_mqa_logits"]
    assert dg.calls[-1].kwargs == {"clean_logits": False}
    assert logits.shape == (3 * 2, step.max_context_len)


# --------------------------------------------------------------------------- dispatch

@pytest.mark.parametrize("backend", ["deepgemm", "own"])
@pytest.mark.parametrize("case", ["int64", "2-D", "not contiguous", "misaligned"])
def test_dispatch_refuses_bad_ids_before_the_kernel(monkeypatch, backend, case):
    """ids on the schedule tensor that break the contract stop at the plugin's
    checks: ValueError naming ``indices``, DeepGEMM never called."""
    if backend == "deepgemm":
        dg = _sm100(monkeypatch)
    else:
        fake_gpu(monkeypatch, (9, 0))
        dg = FakeDeepGemm("old", 90, num_sms=NUM_SMS).install(monkeypatch)
    a = _varlen(_step())
    sched = torch.zeros((NUM_SMS + 1, 2), dtype=torch.int32)
    if backend == "deepgemm":
        sched = dsa_dg.get_paged_mqa_logits_metadata(a["context_lens"], PAGE, NUM_SMS,
                                                     indices=a["ids"])
    mutate, match = BAD_IDS[case]
    bad = mutate(a["ids"])
    if case in ("not contiguous", "misaligned"):
        tagged = attach_varlen_ids(sched, bad, backend)  # the carrier takes int32 [R]
    else:
        tagged = _forge(sched, bad, backend)
    n = len(dg.calls)
    with pytest.raises(ValueError, match=match):
        dispatch.fp8_fp4_paged_mqa_logits(a["q"], a["kv_cache"], a["weights"],
                                          a["context_lens"], a["block_tables"], tagged,
                                          max_model_len=a["max_model_len"], clean_logits=False)
    assert len(dg.calls) == n


@pytest.mark.parametrize("backend", ["deepgemm", "own"])
def test_dispatch_refuses_too_few_ids(monkeypatch, backend):
    dg = _sm100(monkeypatch) if backend == "deepgemm" else None
    a = _varlen(_step())
    tagged = attach_varlen_ids(torch.zeros((NUM_SMS + 1, 2), dtype=torch.int32),
                               a["ids"][:-2].clone(), backend)
    with pytest.raises(RuntimeError, match=r"queries \[R, 1, H, D\] with R <= \d+ run ids"):
        dispatch.fp8_fp4_paged_mqa_logits(a["q"], a["kv_cache"], a["weights"],
                                          a["context_lens"], a["block_tables"], tagged,
                                          max_model_len=a["max_model_len"], clean_logits=False)
    if dg is not None:
        assert dg.calls == []


BAD_TRITON_CALL = {
    "q dtype": (lambda a: a.update(q=(a["q"][0].float(), None)), RuntimeError,
                "FP8 indexer cache only.*dtype torch.float32"),
    "q next_n 2": (lambda a: a.update(q=(_as_next_n_2(a["q"][0]), None)), RuntimeError,
                   r"varlen decode expects queries \[R, 1, H, D\]"),
    "head count": (lambda a: a.update(q=(a["q"][0][:, :, :16].contiguous(), None),
                                      weights=a["weights"][:, :16].contiguous()),
                   ValueError, "q: expected head count"),
    "head dim": (lambda a: a.update(q=(a["q"][0][..., :64].contiguous(), None)),
                 ValueError, "q: expected head dim"),
    "weights dtype": (lambda a: a.update(weights=a["weights"].half()), ValueError,
                      "weights: expected float32"),
    "weights rows": (lambda a: a.update(weights=a["weights"][:-1]), ValueError,
                     "weights: expected float32"),
    "kv dtype": (lambda a: a.update(kv_cache=a["kv_cache"].view(torch.int8)), ValueError,
                 "kv_cache: expected uint8"),
    "context dtype": (lambda a: a.update(context_lens=a["context_lens"].long()), ValueError,
                      "context_lens: expected int32"),
    "context shape": (lambda a: a.update(context_lens=a["context_lens"].reshape(-1, 2)),
                      ValueError, "context_lens: expected int32"),
    "block table dtype": (lambda a: a.update(block_tables=a["block_tables"].long()), ValueError,
                          "block_table: expected int32"),
    "block table rows": (lambda a: a.update(block_tables=a["block_tables"][:-1]), ValueError,
                         "block_table: expected int32"),
}


@pytest.mark.parametrize("case", list(BAD_TRITON_CALL))
def test_dispatch_triton_names_the_argument(case):
    """Bad arguments of the indexer op's call, routed to the Triton backend."""
    a = _varlen(_step(lens=(3, 1, 2, 2)))
    tagged = attach_varlen_ids(torch.zeros((NUM_SMS + 1, 2), dtype=torch.int32), a["ids"],
                               "own", 3)
    mutate, error, match = BAD_TRITON_CALL[case]
    mutate(a)
    with pytest.raises(error, match=match):
        dispatch.fp8_fp4_paged_mqa_logits(a["q"], a["kv_cache"], a["weights"],
                                          a["context_lens"], a["block_tables"], tagged,
                                          max_model_len=a["max_model_len"], clean_logits=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(ids=torch.zeros(4, dtype=torch.int64)), "ids: expected an int32"),
    (dict(ids=torch.zeros((4, 1), dtype=torch.int32)), "ids: expected an int32 \\[R\\]"),
    (dict(ids=[0, 0, 1, 2]), "ids: expected an int32"),
    (dict(backend="cutlass"), "backend: expected one of"),
    (dict(max_run_len=0), "max_run_len: expected an int >= 1"),
    (dict(max_run_len=2.0), "max_run_len: expected an int >= 1"),
    (dict(max_context=0), "max_context: expected an int >= 1 or None"),
    (dict(max_context=2.5), "max_context: expected an int >= 1 or None"),
])
def test_attach_refuses_bad_ids_backend_and_run_length(kwargs, match):
    args = dict(ids=torch.zeros(4, dtype=torch.int32), backend="own", max_run_len=1,
                max_context=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        attach_varlen_ids(torch.zeros((3, 2), dtype=torch.int32), args["ids"], args["backend"],
                          args["max_run_len"], args["max_context"])


def test_reference_names_a_bad_kv_cache():
    kv = _step().kv_cache
    for bad in (kv.view(torch.int8), kv[:, :, 0], kv.reshape(kv.shape[0], PAGE, 2, -1)):
        with pytest.raises(ValueError, match=r"kv_cache: expected uint8 \[num_blocks, page, 1"):
            split_fused_kv(bad)


@pytest.mark.interpreter
def test_triton_under_dcp_logits_wider_than_local_block_table():
    max_model_len, dcp_world = 4096, 2
    width = -(-max_model_len // (PAGE * dcp_world))
    step = make_decode_step([3, 2], [1000, 700], heads=32, dim=128, page=PAGE, seed=3,
                            max_context_len=width * PAGE)
    rows = step.rows
    bt = torch.zeros((rows.num_rows, width), dtype=torch.int32)
    bt[:, : rows.block_table.shape[1]] = rows.block_table
    ctx = rows.context_lens.unsqueeze(-1)
    tagged = attach_varlen_ids(torch.zeros((NUM_SMS + 1, 2), dtype=torch.int32), rows.indices,
                               "own", 3)
    logits = dispatch.fp8_fp4_paged_mqa_logits((step.q, None), step.kv_cache, step.weights, ctx,
                                               bt, tagged, max_model_len=max_model_len,
                                               clean_logits=False)
    ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, bt, max_model_len,
                               rows.indices)
    mask = valid_mask(ctx, max_model_len, rows.indices)
    torch.testing.assert_close(logits[mask], ref[mask], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- builder fallbacks

def _decision_lines(records):
    return [r for r in records if "decode path" in r.getMessage()]


def _assert_builds_stock(builder, lens):
    """A stock builder: no ids anywhere in the decode metadata.  (Stock's
    uniform flatten path is a Triton kernel vLLM disables without a GPU, so
    flattening builders get a variable batch.)"""
    seqs = [90, 300, 41]
    md = builder.build(0, decode_batch(lens, seqs, random_block_table(3, 64, 500, 0)))
    assert md.decode.indices is None
    assert varlen_ids.varlen_ids_of(md.decode.schedule_metadata) is None


@pytest.mark.parametrize("deepgemm,forced,want_reason,level", [
    ("missing", None, "DeepGEMM is not installed", logging.INFO),
    ("old", None, "take no `indices`", logging.INFO),
    ("old", "deepgemm", "take no `indices`", logging.WARNING),
    ("missing", "deepgemm", "DeepGEMM is not installed", logging.WARNING),
])
def test_sm100_without_a_varlen_deepgemm_falls_back_to_stock(monkeypatch, plugin_log, deepgemm,
                                                             forced, want_reason, level):
    """SM100 where DeepGEMM is missing or takes no ``indices`` (and the Triton
    kernel is unavailable): stock path, and the reason is logged once."""
    if forced:
        monkeypatch.setenv(config.BACKEND_ENV, forced)
    fake_gpu(monkeypatch, (10, 0), deepgemm_installed=deepgemm != "missing", triton=False)
    FakeDeepGemm("old", 100, num_sms=NUM_SMS).install(monkeypatch)
    stock = make_builder(monkeypatch, next_n=2)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=2)
    assert builder.use_varlen is False and builder.varlen_backend is None
    assert builder.use_flattening == stock.use_flattening
    lines = _decision_lines(plugin_log)
    assert len(lines) == 1 and lines[0].levelno == level
    assert "stock" in lines[0].getMessage() and want_reason in lines[0].getMessage()
    if deepgemm == "missing":
        _assert_builds_stock(builder, [2, 2, 2])


@pytest.mark.parametrize("kwargs,forced", [
    (dict(index_heads=16), None),
    (dict(index_heads=128), "own"),
    (dict(block_size=32), None),
])
def test_unsupported_triton_cache_falls_back_to_stock(monkeypatch, plugin_log, kwargs, forced):
    """SM90 (no DeepGEMM varlen): a head count or page size the Triton kernel
    does not serve gives stock, logged (a warning when Triton was forced)."""
    if forced:
        monkeypatch.setenv(config.BACKEND_ENV, forced)
    fake_gpu(monkeypatch, (9, 0), deepgemm_installed=False)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4, **kwargs)
    assert builder.use_varlen is False
    lines = _decision_lines(plugin_log)
    assert len(lines) == 1 and "does not support this cache" in lines[0].getMessage()
    assert lines[0].levelno == (logging.WARNING if forced else logging.INFO)
    _assert_builds_stock(builder, [3, 1, 2])


@pytest.mark.parametrize("head_size,block_size,heads,serves", [
    (132, 64, 32, True),    # D = 128, page 64, 32 heads
    (132, 64, 64, True),
    (68, 64, 32, False),    # D = 64
    (260, 64, 32, False),   # D = 256
    (132, 128, 32, False),  # page 128
    (132, 64, 16, False),
    (132, 64, None, True),  # head count unknown: the kernel checks it per call
])
def test_own_kernel_serves_only_supported_caches(monkeypatch, head_size, block_size, heads, serves):
    from vllm_dsa_varlen.vllm_0_27.v1.attention.backends.mla import indexer as ours

    fake_gpu(monkeypatch, (9, 0))
    builder = SimpleNamespace(
        kv_cache_spec=SimpleNamespace(block_size=block_size, storage_block_size=block_size,
                                      head_size=head_size),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(
            hf_config=SimpleNamespace(index_n_heads=heads))))
    assert ours._own_kernel_serves(builder.vllm_config, builder.kv_cache_spec) is serves
