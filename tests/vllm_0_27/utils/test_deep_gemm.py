"""DeepGEMM wrappers: stock-identical calls without ids, ids forwarded, 2.8.x adaptation."""

import math

import pytest
import torch

pytest.importorskip("vllm")

import vllm.utils.deep_gemm as vdg  # noqa: E402
from fake_deep_gemm import GARBAGE, FakeDeepGemm  # noqa: E402
from vllm_stubs import fake_gpu  # noqa: E402

from vllm_dsa_varlen import patches  # noqa: E402
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask  # noqa: E402
from vllm_dsa_varlen.vllm_0_27.utils import deep_gemm as dsa_dg  # noqa: E402
from vllm_dsa_varlen.bench.workloads import make_decode_step  # noqa: E402

# Stock wrappers as vLLM 0.27.1 ships them (captured before any patching).
STOCK_PAGED = vdg.fp8_fp4_paged_mqa_logits
STOCK_METADATA = vdg.get_paged_mqa_logits_metadata
STOCK_PREFILL = vdg.fp8_fp4_mqa_logits


@pytest.fixture(autouse=True)
def unpatched():
    patches.undo_all()
    yield
    patches.undo_all()


def _step(seed, padding_rows=0, max_len=4):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (5,), generator=gen).tolist()
    seqs = [int(x) + 4 for x in torch.randint(1, 300, (5,), generator=gen)]
    return make_decode_step(lens, seqs, heads=32, dim=128, page=64, seed=seed,
                            padding_rows=padding_rows)


def _same_call(a, b):
    """Two recorded calls passed the very same objects, positionally and by keyword."""
    assert a.name == b.name
    assert len(a.args) == len(b.args)
    for x, y in zip(a.args, b.args):
        assert x is y or (not isinstance(x, torch.Tensor) and x == y), (x, y)
    assert a.kwargs.keys() == b.kwargs.keys()
    for k in a.kwargs:
        assert a.kwargs[k] is b.kwargs[k] or a.kwargs[k] == b.kwargs[k]


# --------------------------------------------------------------------------- signatures

def test_param_names_of_python_and_pybind_functions():
    def f(q, kv_cache, *, indices=None):
        pass

    assert dsa_dg.param_names(f) == ("q", "kv_cache", "indices")
    for flavour in ("old", "2.8"):
        dg = FakeDeepGemm(flavour)
        with pytest.raises((TypeError, ValueError)):
            __import__("inspect").signature(dg.fp8_fp4_paged_mqa_logits)
        names = dsa_dg.param_names(dg.fp8_fp4_paged_mqa_logits)
        assert names[:7] == ("q", "kv_cache", "weights", "context_lens", "block_table",
                             "schedule_meta", "max_context_len")
        assert ("clean_logits" in names) == (flavour == "old")
        assert ("indices" in names) == (flavour == "2.8")
    # A real pybind function of torch (no signature, doc holds it).
    accel = getattr(torch._C, "_get_accelerator", None)
    if accel is not None and accel.__doc__ and accel.__doc__.startswith("_get_accelerator("):
        assert dsa_dg.param_names(accel) == ("check",)


@pytest.mark.parametrize("doc,names", [
    ("fp8_fp4_paged_mqa_logits(q: tuple[torch.Tensor, typing.Optional[torch.Tensor]], "
     "kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor, "
     "block_table: torch.Tensor, schedule_meta: torch.Tensor, max_context_len: typing.SupportsInt,"
     " indices: typing.Optional[torch.Tensor] = None) -> torch.Tensor\n",
     ("q", "kv_cache", "weights", "context_lens", "block_table", "schedule_meta",
      "max_context_len", "indices")),
    ("fp8_fp4_paged_mqa_logits(*args, **kwargs)\nOverloaded function.\n\n"
     "1. fp8_fp4_paged_mqa_logits(q: tuple[int, int], clean_logits: bool = False) -> None\n\n"
     "2. fp8_fp4_paged_mqa_logits(q: tuple[int, int], mode: str = 'a, b', "
     "indices: Optional[Tensor] = None) -> None\n",
     ("q", "clean_logits", "mode", "indices")),
    ("fp8_fp4_paged_mqa_logits(arg0: dict[str, list[int]] = {'a': [1, 2]}, x: int = 3)\n",
     ("arg0", "x")),
    ("Computes logits.\n", None),
    ("", None),
])
def test_param_names_from_pybind_docs(doc, names):
    class Fn:
        __signature__ = "no signature"
        __name__ = "fp8_fp4_paged_mqa_logits"

        def __call__(self):
            pass

    fn = Fn()
    fn.__doc__ = doc
    assert dsa_dg.param_names(fn) == names


@pytest.mark.parametrize("flavour,arch", [("2.6", 100), ("2.6", 90), ("old", 100), ("old", 90),
                                          ("2.8", 100), ("2.8", 90)])
def test_detect_caps_of_each_flavour(flavour, arch):
    dg = FakeDeepGemm(flavour, arch)
    caps = dsa_dg.detect_caps(dg.fp8_fp4_paged_mqa_logits, dg.get_paged_mqa_logits_metadata,
                              dg.fp8_fp4_mqa_logits)
    assert caps.signatures_known
    assert caps.varlen == (flavour != "old")  # the vendored 2.6.1 and 2.8.x take ids
    assert caps.paged_clean_logits == caps.prefill_clean_logits == (flavour != "2.8")
    assert caps.prefill_max_seqlen_k == (flavour != "old")
    assert dsa_dg.detect_caps(None, None, None) is None


def test_default_double_is_the_vendored_generation():
    dg = FakeDeepGemm()
    assert (dg.flavour, dg.arch) == ("2.6", 100)
    assert dsa_dg.param_names(dg.fp8_fp4_paged_mqa_logits)[-3:] == (
        "clean_logits", "logits_dtype", "indices")


def test_unreadable_signatures_mean_the_stock_api():
    def opaque(*args, **kwargs):
        pass

    opaque.__signature__ = "none"
    opaque.__doc__ = "no signature line here"
    caps = dsa_dg.detect_caps(opaque, opaque, opaque)
    assert not caps.signatures_known and not caps.varlen
    assert caps.paged_clean_logits and caps.prefill_clean_logits


def test_current_caps_resolves_through_vllm_module_globals(monkeypatch):
    old = FakeDeepGemm("old").install(monkeypatch)
    assert not dsa_dg.current_caps().varlen
    new = FakeDeepGemm("2.8").install(monkeypatch)
    assert dsa_dg.current_caps().varlen
    assert old is not new


# --------------------------------------------------------------------------- stock calls

@pytest.mark.parametrize("arch,accepts_indices", [(100, False), (100, True), (90, False)])
@pytest.mark.parametrize("clean", [False, True])
def test_non_varlen_calls_reach_deepgemm_exactly_as_stock(monkeypatch, arch, accepts_indices, clean):
    """Old API: ours and stock's wrappers hand DeepGEMM the same objects."""
    fake_gpu(monkeypatch, (arch // 10, 0))
    dg = FakeDeepGemm("old", arch, accepts_indices=accepts_indices).install(monkeypatch)
    step = _step(seed=arch + clean, max_len=2)
    pad = step.padded(2)
    ctx, q = pad["context_lens"], (pad["q"], None)
    n = len(dg.calls)
    sched_stock = STOCK_METADATA(ctx, 64, dg.num_sms)
    sched_ours = dsa_dg.get_paged_mqa_logits_metadata(ctx, 64, dg.num_sms)
    _same_call(dg.calls[n], dg.calls[n + 1])
    assert torch.equal(sched_stock, sched_ours)
    stock = STOCK_PAGED(q, step.kv_cache, pad["weights"], ctx, pad["block_table"], sched_stock,
                        max_model_len=step.max_context_len, clean_logits=clean)
    ours = dsa_dg.fp8_fp4_paged_mqa_logits(q, step.kv_cache, pad["weights"], ctx,
                                           pad["block_table"], sched_stock,
                                           max_model_len=step.max_context_len, clean_logits=clean)
    _same_call(dg.calls[n + 2], dg.calls[n + 3])
    assert "indices" not in dg.calls[n + 3].kwargs and dg.calls[n + 3].kwargs == {
        "clean_logits": clean}
    assert torch.equal(stock, ours) and ours.dtype == torch.float32


def test_prefill_call_is_stock_on_the_old_api(monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    dg = FakeDeepGemm("old", 90).install(monkeypatch)
    q, kv, w, ks, ke = _prefill_inputs(seed=3)
    stock = STOCK_PREFILL((q, None), kv, w, ks, ke, clean_logits=False)
    ours = dsa_dg.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, clean_logits=False)
    _same_call(dg.calls[-2], dg.calls[-1])
    assert torch.equal(stock, ours)


def test_stock_wrapper_cannot_call_deepgemm_2_8(monkeypatch):
    """Why the wrapper exists: stock passes `clean_logits`, which 2.8.x rejects."""
    fake_gpu(monkeypatch, (9, 0))
    FakeDeepGemm("2.8", 90).install(monkeypatch)
    step = _step(seed=5, max_len=2)
    pad = step.padded(2)
    sched = STOCK_METADATA(pad["context_lens"], 64, 8)
    with pytest.raises(TypeError, match="clean_logits"):
        STOCK_PAGED((pad["q"], None), step.kv_cache, pad["weights"], pad["context_lens"],
                    pad["block_table"], sched, step.max_context_len, clean_logits=False)


# --------------------------------------------------------------------------- 2.8.x, varlen

def _varlen_args(step):
    rows = step.rows
    return ((step.q, None), step.kv_cache, step.weights, rows.context_lens.unsqueeze(-1),
            rows.block_table, rows.indices)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clean", [False, True])
def test_varlen_on_2_8_sm100_forwards_ids_converts_dtypes_and_cleans(monkeypatch, seed, clean):
    fake_gpu(monkeypatch, (10, 0))
    dg = FakeDeepGemm("2.8", 100).install(monkeypatch)
    step = _step(seed, padding_rows=seed)
    q, kv, w, ctx, bt, ids = _varlen_args(step)
    sched = dsa_dg.get_paged_mqa_logits_metadata(ctx, 64, dg.num_sms, indices=ids)
    assert dg.calls[-1].kwargs["indices"] is ids
    logits = dsa_dg.fp8_fp4_paged_mqa_logits(q, kv, w, ctx, bt, sched, step.max_context_len,
                                             clean_logits=clean, indices=ids)
    call = dg.calls[-1]
    assert call.kwargs["indices"] is ids and "clean_logits" not in call.bound
    assert call.bound["weights"].dtype == torch.bfloat16
    assert torch.equal(call.bound["weights"], w.to(torch.bfloat16))
    assert logits.dtype == torch.float32 and logits.shape == (step.num_rows, step.max_context_len)
    # Independent expectation: the varlen reference, through bf16 like the kernel's output.
    ref = paged_mqa_logits_ref(q[0], kv, w.to(torch.bfloat16).float(), ctx, bt,
                               step.max_context_len, ids)
    written = valid_mask(ctx, step.max_context_len, ids)
    torch.testing.assert_close(logits[written], ref[written].to(torch.bfloat16).float())
    if clean:
        cols = torch.arange(step.max_context_len)
        beyond = cols[None, :] >= ctx
        assert torch.all(logits[beyond] == -math.inf)
        assert torch.all(torch.isfinite(logits[~beyond]) | (ref[~beyond] == -math.inf))
    else:
        assert torch.all(logits[~written] == torch.tensor(GARBAGE, dtype=torch.bfloat16).float())


def test_paged_on_2_8_sm90_drops_clean_logits_and_emulates_it(monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    dg = FakeDeepGemm("2.8", 90).install(monkeypatch)
    step = _step(seed=11, max_len=2)
    pad = step.padded(2)
    ctx = pad["context_lens"]
    sched = dsa_dg.get_paged_mqa_logits_metadata(ctx, 64, dg.num_sms)
    assert dg.calls[-1].kwargs == {} and len(dg.calls[-1].args) == 3
    logits = dsa_dg.fp8_fp4_paged_mqa_logits((pad["q"], None), step.kv_cache, pad["weights"], ctx,
                                             pad["block_table"], sched, step.max_context_len,
                                             clean_logits=True)
    assert dg.calls[-1].kwargs == {} and dg.calls[-1].bound["weights"].dtype == torch.float32
    ref = paged_mqa_logits_ref(pad["q"], step.kv_cache, pad["weights"], ctx, pad["block_table"],
                               step.max_context_len)
    torch.testing.assert_close(logits, ref)  # -inf exactly where the reference has it


def test_ids_contract_is_checked_before_deepgemm(monkeypatch):
    fake_gpu(monkeypatch, (10, 0))
    dg = FakeDeepGemm("2.8", 100).install(monkeypatch)
    step = _step(seed=4)
    q, kv, w, ctx, bt, ids = _varlen_args(step)
    sched = dsa_dg.get_paged_mqa_logits_metadata(ctx, 64, dg.num_sms, indices=ids)
    storage = torch.zeros(ids.numel() + 2, dtype=torch.int32)
    misaligned = storage[1:1 + ids.numel()]
    misaligned.copy_(ids)
    bad = {"misaligned": misaligned, "int64": ids.long(), "short": ids[:-1],
           "strided": torch.stack([ids, ids], 1)[:, 0]}
    n = len(dg.calls)
    for why, wrong in bad.items():
        with pytest.raises(ValueError, match="indices"):
            dsa_dg.fp8_fp4_paged_mqa_logits(q, kv, w, ctx, bt, sched, step.max_context_len,
                                             False, indices=wrong)
        with pytest.raises(ValueError, match="indices"):
            dsa_dg.get_paged_mqa_logits_metadata(ctx, 64, dg.num_sms, indices=wrong)
    assert len(dg.calls) == n  # nothing reached DeepGEMM


def test_double_enforces_the_sm100_contract(monkeypatch):
    """The double is strict: stale schedules, missing ids, next_n > 1 all raise."""
    fake_gpu(monkeypatch, (10, 0))
    dg = FakeDeepGemm("2.8", 100).install(monkeypatch)
    step = _step(seed=6)
    q, kv, w, ctx, bt, ids = _varlen_args(step)
    sched = dsa_dg.get_paged_mqa_logits_metadata(ctx, 64, dg.num_sms, indices=ids)
    with pytest.raises(AssertionError, match="required"):
        dsa_dg.get_paged_mqa_logits_metadata(ctx, 64, dg.num_sms)
    with pytest.raises(AssertionError, match="schedule"):
        other = ids.clone()
        other[0] += 100
        dsa_dg.fp8_fp4_paged_mqa_logits(q, kv, w, ctx, bt, sched, step.max_context_len, False,
                                         indices=other)
    with pytest.raises(AssertionError, match="block_kv"):
        dsa_dg.get_paged_mqa_logits_metadata(ctx, 256, dg.num_sms, indices=ids)
    with pytest.raises(AssertionError, match="weights"):
        dg.fp8_fp4_paged_mqa_logits(q, kv, w, ctx, bt, sched, step.max_context_len, indices=ids)


def test_ids_on_an_api_without_indices_raise(monkeypatch):
    fake_gpu(monkeypatch, (10, 0))
    dg = FakeDeepGemm("old", 100).install(monkeypatch)
    step = _step(seed=8)
    q, kv, w, ctx, bt, ids = _varlen_args(step)
    with pytest.raises(RuntimeError, match="indices"):
        dsa_dg.get_paged_mqa_logits_metadata(ctx, 64, dg.num_sms, indices=ids)
    sched = dsa_dg.get_paged_mqa_logits_metadata(ctx, 64, dg.num_sms)
    with pytest.raises(RuntimeError, match="indices"):
        dsa_dg.fp8_fp4_paged_mqa_logits(q, kv, w, ctx, bt, sched, step.max_context_len, False,
                                         indices=ids)


@pytest.mark.parametrize("flavour", ["2.6", "old"])
def test_old_api_with_indices_keeps_fp32_and_clean_logits(monkeypatch, flavour):
    """The vendored 2.6.1 (and any API with clean_logits and ids): ids and
    clean_logits forwarded, logits_dtype left at its float32 default, FP8 cache
    on SM100."""
    fake_gpu(monkeypatch, (10, 0))
    dg = FakeDeepGemm(flavour, 100, accepts_indices=True).install(monkeypatch)
    step = _step(seed=9)
    q, kv, w, ctx, bt, ids = _varlen_args(step)
    sched = dsa_dg.get_paged_mqa_logits_metadata(ctx, 64, dg.num_sms, indices=ids)
    logits = dsa_dg.fp8_fp4_paged_mqa_logits(q, kv, w, ctx, bt, sched, step.max_context_len,
                                             clean_logits=True, indices=ids)
    assert dg.calls[-1].kwargs == {"clean_logits": True, "indices": ids}
    assert dg.calls[-1].bound["weights"] is w
    assert logits.dtype == torch.float32
    ref = paged_mqa_logits_ref(q[0], kv, w, ctx, bt, step.max_context_len, ids)
    torch.testing.assert_close(logits, ref)


def test_vendored_double_asserts_ids_only_on_sm100_with_one_token_rows(monkeypatch):
    """The 2.6.1 contract the double enforces: ids need arch 10 and next_n == 1."""
    step = _step(seed=4)
    q, kv, w, ctx, bt, ids = _varlen_args(step)
    sm90 = FakeDeepGemm("2.6", 90)
    with pytest.raises(AssertionError, match="SM100"):
        sm90.get_paged_mqa_logits_metadata(ctx, 64, sm90.num_sms, indices=ids)
    sm100 = FakeDeepGemm("2.6", 100)
    two = ctx[: ctx.shape[0] // 2 * 2].reshape(-1, 2).contiguous()
    with pytest.raises(AssertionError, match="next_n == 1"):
        sm100.get_paged_mqa_logits_metadata(two, 64, sm100.num_sms,
                                            indices=ids[: two.shape[0]].contiguous())


# --------------------------------------------------------------------------- prefill

def _prefill_inputs(seed, heads=32, dim=64, num_kv=50):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((12, heads, dim), generator=gen).to(torch.float8_e4m3fn)
    k = torch.randn((num_kv, dim), generator=gen).to(torch.float8_e4m3fn)
    s = torch.rand(num_kv, generator=gen) + 0.5
    w = torch.randn((12, heads), generator=gen)
    # three requests of 4 tokens each, KV spans [0,10), [10,30), [30,50) (causal ends)
    ks = torch.tensor([0] * 4 + [10] * 4 + [30] * 4, dtype=torch.int32)
    ke = ks + torch.tensor([7, 8, 9, 10, 17, 18, 19, 20, 17, 18, 19, 20], dtype=torch.int32)
    return q, (k, s), w, ks, ke


def _scores(q, kv, w):
    k, s = kv
    qk = torch.einsum("mhd,nd->mhn", q.float(), k.float())
    return (qk.relu() * w[:, :, None]).sum(1) * s[None, :]


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("clean", [False, True])
def test_prefill_on_2_8_returns_stock_layout(monkeypatch, arch, clean):
    fake_gpu(monkeypatch, (arch // 10, 0))
    dg = FakeDeepGemm("2.8", arch).install(monkeypatch)
    q, kv, w, ks, ke = _prefill_inputs(seed=arch + clean)
    logits = dsa_dg.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, clean_logits=clean)
    assert logits.dtype == torch.float32 and logits.shape == (q.shape[0], kv[0].shape[0])
    call = dg.calls[-1]
    assert call.bound["max_seqlen_k"] == kv[0].shape[0] and "clean_logits" not in call.bound
    want_w = torch.bfloat16 if arch == 100 else torch.float32
    assert call.bound["weights"].dtype == want_w
    expect = _scores(q, kv, call.bound["weights"].float())
    cols = torch.arange(kv[0].shape[0])
    inside = (cols[None, :] >= ks[:, None].long()) & (cols[None, :] < ke[:, None].long())
    got, want = logits[inside], expect[inside]
    if arch == 100:
        want = want.to(torch.bfloat16).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if clean:
        assert torch.all(logits[~inside] == -math.inf)
