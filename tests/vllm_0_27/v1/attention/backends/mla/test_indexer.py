"""The patched DeepseekV32IndexerMetadataBuilder, driven through vLLM 0.27.1's own build()."""

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import vllm.v1.attention.backends.mla.indexer as ix  # noqa: E402
from fake_deep_gemm import FakeDeepGemm, schedule_fingerprint  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402
from vllm_stubs import (  # noqa: E402
    NUM_SMS,
    decode_batch,
    fake_gpu,
    fake_uniform_decode_kernel,
    make_builder,
    make_config,
    random_block_table,
)

from vllm_dsa_varlen import config, patches, policy, stats  # noqa: E402
from vllm_dsa_varlen.varlen_ids import varlen_ids_of  # noqa: E402
from vllm_dsa_varlen.vllm_0_27.utils import deep_gemm as dsa_dg  # noqa: E402
from vllm_dsa_varlen.vllm_0_27.v1.attention.backends.mla import indexer as plugin_ix  # noqa: E402

WIDTH = 64
NUM_BLOCKS = 1000


pytestmark = pytest.mark.usefixtures("clean_plugin")


def _no_triton_slot_mapping(monkeypatch):
    """DeepSeek V4's compressed slot mapping is a Triton kernel: stub it (unused here)."""
    def stub(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio,
             out=None):
        out.fill_(-1)
        return out[:num_tokens]

    monkeypatch.setattr(ix, "get_compressed_slot_mapping", stub)


def _setup(monkeypatch, backend, flavour="2.6"):
    """Fake the GPU for a backend: 'deepgemm' (SM100 + the DeepGEMM double,
    default: vLLM 0.27.1's vendored generation), 'own' (SM90, the project's kernels
    forced: every step takes the varlen kernel)."""
    if backend == "deepgemm":
        fake_gpu(monkeypatch, (10, 0))
        return FakeDeepGemm(flavour, 100, num_sms=NUM_SMS).install(monkeypatch)
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setenv(config.BACKEND_ENV, "own")
    return FakeDeepGemm(flavour, 90, num_sms=NUM_SMS).install(monkeypatch)


def _expected_rows(decode_lens, seq_lens, num_rows, compress_ratio=1):
    """Independent expectation: request of each row (-1: padding) and its context."""
    req, ctx = [], []
    for b, (n, s) in enumerate(zip(decode_lens, seq_lens)):
        for j in range(n):
            req.append(b)
            ctx.append(max(0, s - n + j + 1) // compress_ratio)
    while len(req) < num_rows:
        req.append(-1)
        ctx.append(0)
    return torch.tensor(req), torch.tensor(ctx, dtype=torch.int32)


def _random_batch(seed, num_reqs, max_len, *, pad_reqs=0, pad_tokens=0, uniform=False,
                  min_seq=1, max_seq=3000):
    gen = torch.Generator().manual_seed(seed)
    if uniform:
        lens = [max_len] * num_reqs
    else:
        lens = torch.randint(1, max_len + 1, (num_reqs,), generator=gen).tolist()
    seqs = [max(n, int(s)) for n, s in
            zip(lens, torch.randint(min_seq, max_seq, (num_reqs,), generator=gen))]
    return lens + [0] * pad_reqs, seqs + [0] * pad_reqs, pad_tokens


def _build(builder, lens, seqs, pad_tokens=0, seed=0):
    bt = random_block_table(len(lens), WIDTH, NUM_BLOCKS, seed)
    cm = decode_batch(lens, seqs, bt, num_tokens=sum(lens) + pad_tokens)
    return builder.build(0, cm), bt


def _check_varlen_decode(md, builder, lens, seqs, bt, compress_ratio=1, kernel=True):
    """The decode metadata of a varlen step against the independent expectation
    (``kernel``: the varlen kernel was chosen for the step, else stock's id-less
    call on the same rows)."""
    dec = md.decode
    rows = md.num_decode_tokens
    req, ctx = _expected_rows(lens, seqs, rows, compress_ratio)
    assert dec.seq_lens.shape == (rows, 1) and dec.seq_lens.dtype == torch.int32
    assert torch.equal(dec.seq_lens[:, 0], ctx)
    assert torch.equal(dec.decode_lens, torch.ones(rows, dtype=torch.int32))
    assert dec.requires_padding is False
    real = req >= 0
    assert torch.equal(dec.block_table[real], bt[req[real]])
    ids = dec.indices
    assert ids.dtype == torch.int32 and ids.shape == (rows,) and ids.data_ptr() % 8 == 0
    # Maximal runs of equal adjacent ids are exactly the requests (padding rows alone).
    starts = torch.ones(rows, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    want_starts = torch.ones(rows, dtype=torch.bool)
    want_starts[1:] = (req[1:] != req[:-1]) | (req[1:] < 0)
    assert torch.equal(starts, want_starts)
    assert len(set(ids[~real].tolist())) == int((~real).sum())
    assert not set(ids[~real].tolist()) & set(ids[real].tolist())
    if not kernel:  # stock's call: the untagged schedule buffer itself
        assert dec.schedule_metadata is builder.scheduler_metadata_buffer
        assert varlen_ids_of(dec.schedule_metadata) is None
        return ids
    # The kernel call gets the ids through a fresh view of the stable schedule buffer.
    tag = varlen_ids_of(dec.schedule_metadata)
    assert tag is not None and tag.ids is ids and tag.backend == builder.varlen_backend
    assert tag.max_run_len == max(lens)  # the host's sizing hint for the Triton kernel
    # the decode top-k's bound (the step's max_seq_len: a prefill's too in a mixed step)
    assert tag.max_context >= max(seqs) // compress_ratio >= int(ctx.max())
    if md.num_prefills == 0:
        assert tag.max_context == max(seqs) // compress_ratio
    assert dec.schedule_metadata is not builder.scheduler_metadata_buffer
    assert dec.schedule_metadata.data_ptr() == builder.scheduler_metadata_buffer.data_ptr()
    assert varlen_ids_of(builder.scheduler_metadata_buffer) is None
    return ids


# --------------------------------------------------------------------------- the decision (pure)

Caps = dsa_dg.DeepGemmCaps
DG_VARLEN = Caps(paged_indices=True, metadata_indices=True, paged_clean_logits=False,
                 prefill_clean_logits=False, prefill_max_seqlen_k=True)  # 2.8.x
# The DeepGEMM 2.6.1 vLLM 0.27.1 vendors: clean_logits *and* indices on both functions.
DG_VENDORED = Caps(paged_indices=True, metadata_indices=True, prefill_max_seqlen_k=True)
DG_OLD = Caps()  # a DeepGEMM without run ids (clean_logits, fp32 logits)
DG_HALF = Caps(paged_indices=True, metadata_indices=False)  # kernel only

SM100, SM90, SM89, SM80, SM120 = (10, 0), (9, 0), (8, 9), (8, 0), (12, 0)


def decide(**kw):
    base = dict(is_cuda=True, capability=SM90, deepgemm=DG_OLD, own_ok=True, next_n=2,
                fp4_cache=False, mode="auto", backend="auto")
    base.update(kw)
    return plugin_ix.choose_decode_path(**base)


# (kwargs, expected (use_varlen, backend, warning, per_step), a word the reason must contain)
TABLE = [
    (dict(mode="off", capability=SM100, deepgemm=DG_VARLEN), (False, None, False, None), "off"),
    (dict(is_cuda=False, capability=None), (False, None, False, None), "CUDA"),
    (dict(capability=None), (False, None, False, None), "capability"),
    (dict(capability=SM100, deepgemm=DG_VARLEN, next_n=1), (True, "deepgemm", False, None),
     "sm_100"),
    (dict(capability=SM100, deepgemm=DG_VARLEN, next_n=4), (True, "deepgemm", False, None),
     "run ids"),
    (dict(capability=SM100, deepgemm=DG_VARLEN, next_n=4, fp4_cache=True),
     (True, "deepgemm", False, None), "MXFP4"),
    (dict(capability=(10, 3), deepgemm=DG_VARLEN, next_n=2), (True, "deepgemm", False, None),
     "sm_103"),
    # A default B200 install: vLLM 0.27.1's vendored DeepGEMM takes ids -> DeepGEMM varlen.
    (dict(capability=SM100, deepgemm=DG_VENDORED, next_n=1), (True, "deepgemm", False, None),
     "run ids"),
    (dict(capability=SM100, deepgemm=DG_VENDORED, next_n=3), (True, "deepgemm", False, None),
     "FP8"),
    (dict(capability=SM100, deepgemm=DG_VENDORED, next_n=3, fp4_cache=True),
     (True, "deepgemm", False, None), "MXFP4"),
    # SM100 without a DeepGEMM that takes ids: stock runs native [B, next_n] on uniform
    # steps, so the project's kernels only take the steps stock would split.
    (dict(capability=SM100, deepgemm=DG_OLD, next_n=3), (True, "own", False, "split"),
     "splits"),
    (dict(capability=SM100, deepgemm=DG_HALF, next_n=2), (True, "own", False, "split"),
     "prefill path"),
    (dict(capability=SM100, deepgemm=DG_OLD, next_n=1), (False, None, False, None),
     "next_n == 1"),
    (dict(capability=SM100, deepgemm=DG_OLD, next_n=3, fp4_cache=True),
     (False, None, False, None), "MXFP4"),
    (dict(capability=SM100, deepgemm=None, next_n=3, fp4_cache=True), (False, None, False, None),
     "not installed"),
    # Hopper / Ada / Blackwell consumer: DeepGEMM varlen never.  next_n > 2: stock
    # flattens, compared per step; next_n == 2: stock's native kernel on uniform steps,
    # the project's kernels on the steps stock splits; no DeepGEMM: theirs every step.
    (dict(capability=SM90, deepgemm=DG_VARLEN, next_n=3), (True, "own", False, "flattened"),
     "sm_90"),
    (dict(capability=SM90, deepgemm=DG_VENDORED, next_n=4),
     (True, "own", False, "flattened"), "flattens"),
    (dict(capability=SM90, deepgemm=DG_VARLEN, next_n=2), (True, "own", False, "split"),
     "splits"),
    (dict(capability=SM90, deepgemm=None, next_n=2), (True, "own", False, None),
     "no DeepGEMM"),
    (dict(capability=SM90, deepgemm=None, next_n=4), (True, "own", False, None),
     "no DeepGEMM"),
    (dict(capability=SM90, backend="own", next_n=2), (True, "own", False, None), "forced"),
    (dict(capability=SM90, deepgemm=DG_VARLEN, next_n=1), (False, None, False, None),
     "next_n == 1"),
    (dict(capability=SM89, next_n=4), (True, "own", False, "flattened"), "sm_89"),
    (dict(capability=SM120, next_n=4), (True, "own", False, "flattened"), "sm_120"),
    (dict(capability=SM80, next_n=4), (False, None, False, None), "fp8"),
    (dict(capability=SM90, next_n=4, own_ok=False), (False, None, False, None),
     "kernel is unavailable"),
    # Forced backends.
    (dict(capability=SM90, backend="deepgemm", deepgemm=DG_VARLEN, next_n=4),
     (False, None, True, None), "SM10x"),
    (dict(capability=SM100, backend="deepgemm", deepgemm=DG_OLD, next_n=4),
     (False, None, True, None), "indices"),
    (dict(capability=SM100, backend="deepgemm", deepgemm=DG_VARLEN, next_n=4),
     (True, "deepgemm", False, None), "run ids"),
    (dict(capability=SM100, backend="own", deepgemm=DG_VARLEN, next_n=4),
     (True, "own", False, None), "forced"),
    (dict(capability=SM100, backend="own", deepgemm=DG_VARLEN, next_n=4, fp4_cache=True),
     (False, None, True, None), "MXFP4"),
    (dict(capability=SM80, backend="own", next_n=4), (False, None, True, None), "fp8"),
    (dict(capability=SM90, backend="own", next_n=4, own_ok=False),
     (False, None, True, None), "kernel is unavailable"),
    (dict(capability=SM90, backend="own", next_n=1), (False, None, True, None),
     "next_n == 1"),
]


@pytest.mark.parametrize("kwargs,expected,word", TABLE)
def test_decision_table(kwargs, expected, word):
    path = decide(**kwargs)
    assert (path.use_varlen, path.backend, path.warning, path.per_step) == expected
    assert word.lower() in path.reason.lower()
    assert path.describe().startswith("varlen" if path.use_varlen else "stock")


@pytest.mark.parametrize("cap,dg,own_ok,next_n,fp4,backend", itertools.product(
    [SM80, SM89, SM90, SM100, SM120], [None, DG_OLD, DG_VARLEN], [False, True], [1, 2, 4],
    [False, True], ["auto", "deepgemm", "own"]))
def test_invariants_over_the_whole_space(cap, dg, own_ok, next_n, fp4, backend):
    """Properties every decision must have, whatever the inputs."""
    path = decide(capability=cap, deepgemm=dg, own_ok=own_ok, next_n=next_n,
                  fp4_cache=fp4, backend=backend)
    assert (path.backend is not None) == path.use_varlen
    assert path.reason
    if path.backend == "deepgemm":
        assert cap[0] == 10 and dg is not None and dg.varlen
    if path.backend == "own":
        assert not fp4 and cap >= (8, 9) and own_ok and next_n > 1
    # Per-step comparison exactly where stock has a decode kernel and the
    # project's backend was not forced; which of stock's paths it is follows stock.
    if path.per_step is not None:
        assert path.backend == "own" and backend == "auto" and dg is not None
        stock_flattens = cap[0] != 10 and next_n > 2
        assert path.per_step == ("flattened" if stock_flattens else "split")
    elif path.backend == "own":
        assert backend == "own" or dg is None
    if fp4:
        assert path.backend != "own"
    if backend != "auto" and path.use_varlen:
        assert path.backend == backend
    if backend != "auto" and not path.use_varlen:
        assert path.warning
    if backend == "auto":
        assert not path.warning
        # auto never leaves a usable varlen backend unused
        if cap[0] == 10 and dg is not None and dg.varlen:
            assert path.backend == "deepgemm"


def test_off_and_not_cuda_win_over_everything():
    for backend in ("auto", "deepgemm", "own"):
        assert not decide(mode="off", capability=SM100, deepgemm=DG_VARLEN, backend=backend,
                          next_n=4).use_varlen
        assert not decide(is_cuda=False, capability=SM100, deepgemm=DG_VARLEN, backend=backend,
                          next_n=4).use_varlen


@pytest.mark.parametrize("bad", [dict(mode="on"), dict(backend="cuda"), dict(next_n=0)])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        decide(**bad)


# --------------------------------------------------------------------------- __init__

@pytest.mark.parametrize("cap,flavour,next_n,fp4,env,want,per_step", [
    ((10, 0), "2.6", 4, False, {}, "deepgemm", None),
    ((10, 0), "2.6", 1, False, {}, "deepgemm", None),
    ((10, 0), "2.6", 3, True, {}, "deepgemm", None),
    ((10, 0), "2.8", 4, False, {}, "deepgemm", None),
    ((10, 0), "2.8", 1, False, {}, "deepgemm", None),
    ((10, 0), "old", 3, False, {}, "own", "split"),
    ((10, 0), "old", 1, False, {}, None, None),
    ((9, 0), "2.6", 3, False, {}, "own", "flattened"),
    ((9, 0), "2.6", 2, False, {}, "own", "split"),
    ((9, 0), "old", 2, False, {config.BACKEND_ENV: "own"}, "own", None),
    ((9, 0), "2.6", 1, False, {}, None, None),
    ((10, 0), "2.6", 4, False, {config.MODE_ENV: "off"}, None, None),
    ((10, 0), "2.6", 4, False, {config.BACKEND_ENV: "own"}, "own", None),
    ((9, 0), "old", 4, False, {config.BACKEND_ENV: "deepgemm"}, None, None),
    (None, "2.6", 4, False, {}, None, None),
])
def test_init_decides_the_path(monkeypatch, plugin_log, cap, flavour, next_n, fp4, env, want,
                               per_step):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fake_gpu(monkeypatch, cap)
    FakeDeepGemm(flavour, cap[0] * 10 if cap else 100).install(monkeypatch)
    stock = make_builder(monkeypatch, next_n=next_n, fp4=fp4)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=next_n, fp4=fp4)
    assert builder.use_varlen == (want is not None) and builder.varlen_backend == want
    assert builder.decode_path.per_step == per_step
    if want:
        # "split": the flatten flag is set per step; stock's between steps.
        assert builder.use_flattening is (per_step != "split" or stock.use_flattening)
        ids = builder.decode_indices_buffer
        assert ids.dtype == torch.int32 and ids.data_ptr() % 8 == 0
        assert ids.shape[0] >= builder.vllm_config.scheduler_config.max_num_batched_tokens
    else:
        assert builder.use_flattening == stock.use_flattening
    lines = [r.getMessage() for r in plugin_log if "decode path" in r.getMessage()]
    assert len(lines) == 1 and builder.decode_path.reason in lines[0]
    make_builder(monkeypatch, next_n=next_n, fp4=fp4)  # a second builder logs nothing new
    assert len([r for r in plugin_log if "decode path" in r.getMessage()]) == 1


# --------------------------------------------------------------------------- CUDA graphs

@pytest.mark.parametrize("cap,flavour,next_n,env,want", [
    ((10, 0), "2.6", 4, {}, AttentionCGSupport.ALWAYS),      # DeepGEMM varlen
    ((10, 0), "2.6", 1, {}, AttentionCGSupport.ALWAYS),
    ((9, 0), "2.6", 4, {}, AttentionCGSupport.ALWAYS),       # Triton, per step vs flattened
    ((9, 0), "2.6", 2, {config.BACKEND_ENV: "own"}, AttentionCGSupport.ALWAYS),
    ((9, 0), None, 2, {}, AttentionCGSupport.ALWAYS),        # Triton, no DeepGEMM at all
    ((9, 0), "2.6", 2, {}, AttentionCGSupport.UNIFORM_BATCH),  # "split": layout per step
    ((10, 0), "old", 3, {}, AttentionCGSupport.UNIFORM_BATCH),
    ((9, 0), "2.6", 1, {}, AttentionCGSupport.UNIFORM_BATCH),  # stock
    ((10, 0), "2.6", 4, {config.MODE_ENV: "off"}, AttentionCGSupport.UNIFORM_BATCH),
    (None, "2.6", 4, {}, AttentionCGSupport.UNIFORM_BATCH),
])
@pytest.mark.parametrize("v4", [False, True])
def test_cudagraph_support(monkeypatch, cap, flavour, next_n, env, want, v4):
    """Both indexer backends (V3.2 and V4 share the builder class) answer ALWAYS
    exactly when every decode step gets the varlen rows; otherwise stock's answer."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fake_gpu(monkeypatch, cap, deepgemm_installed=flavour is not None)
    FakeDeepGemm(flavour or "2.6", cap[0] * 10 if cap else 100).install(monkeypatch)
    backend_cls = ix.DeepseekV4IndexerBackend if v4 else ix.DeepseekV32IndexerBackend
    spec = MLAAttentionSpec(block_size=256 if v4 else 64, num_kv_heads=1, head_size=132,
                            dtype=torch.uint8, compress_ratio=4 if v4 else 1)
    cfg = make_config(next_n=next_n)
    stock = backend_cls.get_builder_cls().get_cudagraph_support(cfg, spec)
    assert stock == AttentionCGSupport.UNIFORM_BATCH
    patches.apply_all()
    assert backend_cls.get_builder_cls().get_cudagraph_support(cfg, spec) == want
    if want == AttentionCGSupport.ALWAYS:
        builder = make_builder(monkeypatch, next_n=next_n, block_size=spec.block_size,
                               compress_ratio=spec.compress_ratio)
        assert builder.use_varlen and builder.decode_path.per_step != "split"


# --------------------------------------------------------------------------- varlen builds

@pytest.mark.parametrize("backend", ["deepgemm", "own"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["uniform", "variable", "graph_padded", "token_padded"])
def test_varlen_build(monkeypatch, backend, seed, kind):
    dg = _setup(monkeypatch, backend)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4)
    assert builder.varlen_backend == backend
    lens, seqs, pad = _random_batch(
        seed, num_reqs=3 + seed, max_len=4, uniform=kind == "uniform",
        pad_reqs=2 if kind == "graph_padded" else 0,
        pad_tokens={"graph_padded": 5, "token_padded": 3}.get(kind, 0))
    md, bt = _build(builder, lens, seqs, pad, seed)
    assert md.num_decodes == len(lens) and md.num_prefills == 0
    assert md.num_decode_tokens == sum(lens) + pad
    ids = _check_varlen_decode(md, builder, lens, seqs, bt)
    meta_calls = dg.calls_to("get_paged_mqa_logits_metadata")
    if backend == "deepgemm":
        assert len(meta_calls) == 1 and meta_calls[0].kwargs["indices"] is ids
        assert torch.equal(builder.scheduler_metadata_buffer,
                           schedule_fingerprint(md.decode.seq_lens, ids, NUM_SMS))
    else:
        assert meta_calls == []  # the Triton kernel needs no schedule


@pytest.mark.parametrize("backend", ["deepgemm", "own"])
@pytest.mark.parametrize("compress_ratio", [1, 4])
@pytest.mark.parametrize("lens,pad_tokens", [
    ([1, 1, 1, 1, 0], 0),      # a graph-padding request with no token
    ([1, 1, 1, 1, 0], 3),      # more padded tokens than requests
    ([1, 1, 1], 5),            # padding tokens without padding requests
    ([1, 1, 1, 1, 1, 1], 0),   # plain, unpadded
])
def test_plain_decode_is_flattened(monkeypatch, backend, compress_ratio, lens, pad_tokens):
    """Plain steps get the varlen rows too (as upstream 0.28.0): ``R =
    num_decode_tokens`` rows of one token, every row its own run, graph-padding
    rows with context 0 -- including steps with more padded tokens than
    requests, where ids for stock's per-request rows would not match R."""
    dg = _setup(monkeypatch, backend)
    _no_triton_slot_mapping(monkeypatch)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=3, block_size=64 * compress_ratio,
                           compress_ratio=compress_ratio)
    gen = torch.Generator().manual_seed(len(lens) + pad_tokens)
    seqs = [int(x) if n else 0 for n, x in zip(lens, torch.randint(1, 3000, (len(lens),),
                                                                   generator=gen))]
    md, bt = _build(builder, lens, seqs, pad_tokens, seed=3)
    assert md.num_decodes == len(lens) and md.num_decode_tokens == sum(lens) + pad_tokens
    ids = _check_varlen_decode(md, builder, lens, seqs, bt, compress_ratio)
    assert torch.equal(ids, torch.arange(md.num_decode_tokens, dtype=torch.int32))
    assert md.decode.seq_lens.data_ptr() == builder.decode_seq_lens_buffer.data_ptr()
    if backend == "deepgemm":
        call = dg.calls_to("get_paged_mqa_logits_metadata")[-1]
        assert call.kwargs["indices"] is ids
        assert torch.equal(builder.scheduler_metadata_buffer,
                           schedule_fingerprint(md.decode.seq_lens, ids, NUM_SMS))


def test_plain_decode_with_a_hole_is_refused(monkeypatch):
    """Row r of a plain varlen step is request r: a zero-token request before a
    real one (which vLLM's graph padding never makes) is refused, not mis-planned."""
    _setup(monkeypatch, "deepgemm")
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=3)
    with pytest.raises(RuntimeError, match="zero-token request before a real one"):
        _build(builder, [1, 0, 1], [40, 0, 50], seed=0)
    md, bt = _build(builder, [1, 1, 0], [40, 50, 0], seed=0)  # the builder still works
    _check_varlen_decode(md, builder, [1, 1, 0], [40, 50, 0], bt)


def test_plain_decode_with_padding_tokens_fails_without_flattening(monkeypatch):
    """Why plain steps are flattened: stock's flatten-branch builder (SM90,
    next_n > 2) keeps per-request rows for a plain step, and under V4 a step with
    more padded tokens than requests then has 6 context rows for 3 block-table
    rows -- one run id per request cannot describe it."""
    fake_gpu(monkeypatch, (9, 0))
    FakeDeepGemm("2.6", 90, num_sms=NUM_SMS).install(monkeypatch)
    _no_triton_slot_mapping(monkeypatch)
    stock = make_builder(monkeypatch, next_n=3, block_size=256, compress_ratio=4)
    assert stock.use_flattening
    md, _ = _build(stock, [1, 1, 1], [400, 900, 20], pad_tokens=3, seed=1)
    assert md.decode.seq_lens.shape[0] == 6 and md.decode.block_table.shape[0] == 3


@pytest.mark.parametrize("backend", ["deepgemm", "own"])
@pytest.mark.parametrize("seed", range(3))
def test_v4_compressed_cache(monkeypatch, backend, seed):
    """compress_ratio 4: stock divides the planned per-row lengths in place."""
    _setup(monkeypatch, backend)
    _no_triton_slot_mapping(monkeypatch)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=3, block_size=256, compress_ratio=4)
    assert builder.use_varlen and builder.compress_ratio == 4
    lens, seqs, pad = _random_batch(seed, num_reqs=5, max_len=3, pad_reqs=1, pad_tokens=2)
    md, bt = _build(builder, lens, seqs, pad, seed)
    _check_varlen_decode(md, builder, lens, seqs, bt, compress_ratio=4)
    assert md.decode.seq_lens.data_ptr() == builder.decode_seq_lens_buffer.data_ptr()


def test_buffers_are_stable_across_steps(monkeypatch):
    """Every step -- uniform, variable, plain -- the same addresses (what a
    captured CUDA graph replays)."""
    _setup(monkeypatch, "deepgemm")
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4)
    first, _ = _build(builder, [4, 4, 4], [100, 200, 300], seed=0)        # uniform
    addrs = [t.data_ptr() for t in (first.decode.indices, first.decode.seq_lens,
                                    first.decode.block_table, first.decode.schedule_metadata)]
    second, bt = _build(builder, [3, 4, 1, 4], [50, 60, 70, 80], seed=1)  # variable, 12 rows
    assert [t.data_ptr() for t in (second.decode.indices, second.decode.seq_lens,
                                   second.decode.block_table,
                                   second.decode.schedule_metadata)] == addrs
    _check_varlen_decode(second, builder, [3, 4, 1, 4], [50, 60, 70, 80], bt)
    # the first step's tag still names its own ids object, not the second step's
    assert varlen_ids_of(first.decode.schedule_metadata).ids is first.decode.indices
    assert first.decode.indices is not second.decode.indices
    third, bt = _build(builder, [1, 1, 1, 0], [9, 99, 999, 0], pad_tokens=8, seed=2)  # plain
    assert [t.data_ptr() for t in (third.decode.indices, third.decode.seq_lens,
                                   third.decode.block_table,
                                   third.decode.schedule_metadata)] == addrs
    _check_varlen_decode(third, builder, [1, 1, 1, 0], [9, 99, 999, 0], bt)


def test_v4_buffers_are_stable_across_plain_and_multi_token_steps(monkeypatch):
    """V4: stock divides plain steps' lengths into another buffer; the varlen rows
    are copied back so a captured graph reads the same buffer for every step."""
    _setup(monkeypatch, "deepgemm")
    _no_triton_slot_mapping(monkeypatch)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4, block_size=256, compress_ratio=4)
    multi, _ = _build(builder, [4, 2, 4], [1000, 600, 3000], pad_tokens=2, seed=0)
    addrs = [t.data_ptr() for t in (multi.decode.indices, multi.decode.seq_lens,
                                    multi.decode.block_table)]
    plain, bt = _build(builder, [1, 1, 0], [1000, 600, 0], pad_tokens=9, seed=1)
    assert [t.data_ptr() for t in (plain.decode.indices, plain.decode.seq_lens,
                                   plain.decode.block_table)] == addrs
    _check_varlen_decode(plain, builder, [1, 1, 0], [1000, 600, 0], bt, compress_ratio=4)


def test_mixed_batch_keeps_variable_decodes_as_decodes(monkeypatch):
    _setup(monkeypatch, "deepgemm")
    monkeypatch.setattr(ix, "build_prefill_chunk_metadata", lambda *a, **k: None)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4)
    lens, seqs = [3, 1, 4, 20], [10, 7, 12, 20]
    md, bt = _build(builder, lens, seqs, seed=2)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (3, 1, 8)
    _check_varlen_decode(md, builder, lens[:3], seqs[:3], bt)


# --------------------------------------------------------------------------- stock paths

@pytest.mark.parametrize("where", ["sm90_next_n2_split", "sm100_no_varlen_deepgemm_split",
                                   "sm90_no_triton_stock", "off"])
def test_stock_paths_clamp_padding_requests_at_zero(monkeypatch, where):
    """A graph-padded uniform step on the paths left to stock's native kernel:
    0.27.1 gives the padding request negative per-token lengths (read as uint32
    by DeepGEMM); the plugin clamps them at 0.  ``DSA_VARLEN=off`` leaves
    vLLM exactly stock."""
    lens, seqs, next_n = [2, 2, 0], [10, 7, 0], 2  # num_tokens 6
    if where == "sm100_no_varlen_deepgemm_split":
        fake_gpu(monkeypatch, (10, 0))
        dg = FakeDeepGemm("old", 100, num_sms=NUM_SMS).install(monkeypatch)
    else:
        fake_gpu(monkeypatch, (9, 0), triton=where != "sm90_no_triton_stock")
        dg = FakeDeepGemm("2.6", 90, num_sms=NUM_SMS).install(monkeypatch)
    stock = make_builder(monkeypatch, next_n=next_n)
    stock_md, _ = _build(stock, lens, seqs, pad_tokens=2, seed=5)
    assert stock_md.decode.seq_lens.tolist() == [[9, 10], [6, 7], [-1, 0]]  # 0.27.1 as shipped
    stock_bt = stock_md.decode.block_table.clone()
    if where == "off":
        monkeypatch.setenv(config.MODE_ENV, "off")
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=next_n)
    assert builder.use_varlen == where.endswith("split")
    md, _ = _build(builder, lens, seqs, pad_tokens=2, seed=5)
    dec = md.decode
    want = [[max(0, s - next_n + j + 1) for j in range(next_n)] for s in seqs]
    if where == "off":
        want = stock_md.decode.seq_lens.tolist()
    assert dec.seq_lens.tolist() == want
    assert dec.indices is None and varlen_ids_of(dec.schedule_metadata) is None
    assert torch.equal(dec.block_table, stock_bt) and dec.requires_padding
    # DeepGEMM's scheduler saw the clamped lengths
    assert torch.equal(builder.scheduler_metadata_buffer,
                       schedule_fingerprint(dec.seq_lens, None, NUM_SMS))
    assert dg.calls_to("get_paged_mqa_logits_metadata")[-1].kwargs == {}


# --------------------------------------------------------------------------- per step

def test_split_hybrid_keeps_uniform_steps_native_and_flattens_the_steps_stock_splits(
        monkeypatch):
    """SM90, next_n == 2, DeepGEMM installed (``per_step == "split"``): a uniform
    step (graph padding included) keeps stock's native ``[B, 2]`` rows and
    DeepGEMM; a step stock would split keeps every decode as a decode, in varlen
    rows for the Triton kernel."""
    fake_gpu(monkeypatch, (9, 0))
    FakeDeepGemm("2.6", 90, num_sms=NUM_SMS).install(monkeypatch)
    monkeypatch.setattr(ix, "build_prefill_chunk_metadata", lambda *a, **k: None)
    stock = make_builder(monkeypatch, next_n=2)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=2)
    assert builder.decode_path.per_step == "split" and not builder.use_flattening
    stats.reset()

    md, _ = _build(builder, [2, 2, 2, 0], [50, 60, 70, 0], pad_tokens=2, seed=0)
    assert md.num_decodes == 4 and md.decode.indices is None
    assert md.decode.seq_lens.tolist() == [[49, 50], [59, 60], [69, 70], [0, 0]]
    assert varlen_ids_of(md.decode.schedule_metadata) is None

    for lens, seqs, decodes in (([2, 1, 2], [40, 30, 90], 3), ([2, 1, 50], [40, 30, 90], 2),
                                ([1, 2, 2, 0], [5, 70, 80, 0], 4)):
        stock_md, _ = _build(stock, lens, seqs, pad_tokens=1, seed=1)
        assert stock_md.num_decodes < decodes  # stock sends the tail to the prefill path
        md, bt = _build(builder, lens, seqs, pad_tokens=1, seed=1)
        assert (md.num_decodes, md.num_prefills) == (decodes, len(lens) - decodes)
        pad = 1 if decodes == len(lens) else 0  # padding tokens belong to the last request
        _check_varlen_decode(md, builder, lens[:decodes], seqs[:decodes], bt)
        assert md.num_decode_tokens == sum(lens[:decodes]) + pad
        assert varlen_ids_of(md.decode.schedule_metadata).backend == "own"
        assert not builder.use_flattening  # stock's flag again between steps
    # the counters saw what the builds did; the builder made before the patches runs
    # the patched class's build() with no decode path: counted as stock's own steps,
    # which split all three variable steps
    counts = stats.snapshot()
    assert counts["steps"] == {**dict.fromkeys(stats.PATHS, 0), "stock_native": 1,
                               "split_avoided": 3, "stock_split": 3}
    # (stock's decode part of a split step is its uniform prefix: not variable)
    assert counts["variable"] == {**dict.fromkeys(stats.PATHS, 0), "split_avoided": 3}
    # [2, 1, 50]: the 50-token request prefills; stock sends every split tail to prefill
    assert counts["mixed"]["split_avoided"] == 1 and counts["mixed"]["stock_split"] == 3


@pytest.mark.parametrize("lens_kind,num_reqs", [
    ("uniform", 4), ("variable", 8), ("plain", 64), ("uniform", 64), ("variable", 64)])
def test_flattened_per_step_kernel_choice(monkeypatch, lens_kind, num_reqs):
    """SM90, next_n == 4, DeepGEMM installed (``per_step == "flattened"``): every
    step gets the flattened rows and ids, and DeepGEMM's id-less schedule for
    those rows (so either kernel finds valid metadata); the kernel is the one
    ``policy.varlen_wins`` picks from the host-known step facts."""
    fake_gpu(monkeypatch, (9, 0))
    dg = FakeDeepGemm("2.6", 90, num_sms=NUM_SMS).install(monkeypatch)
    fake_uniform_decode_kernel(monkeypatch)
    # The builder follows whatever the table says (the table itself: tests/test_policy.py).
    monkeypatch.setattr(policy, "MEASURED", (policy.Rule("flattened", min_run=3,
                                                         min_requests=64, note="test table"),))
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4, max_tokens=256, max_seqs=64)
    assert builder.decode_path.per_step == "flattened"
    gen = torch.Generator().manual_seed(num_reqs)
    if lens_kind == "uniform":
        lens = [4] * num_reqs
    elif lens_kind == "plain":
        lens = [1] * num_reqs
    else:
        lens = [4] + torch.randint(1, 5, (num_reqs - 1,), generator=gen).tolist()
    seqs = [n + int(x) for n, x in zip(lens, torch.randint(0, 3000, (num_reqs,), generator=gen))]
    stats.reset()
    md, bt = _build(builder, lens, seqs, seed=num_reqs)
    facts = policy.StepFacts.from_decode_lens(lens, max_context=max(seqs))
    varlen = policy.varlen_wins(facts, "flattened")
    assert varlen == (num_reqs >= 64 and lens_kind != "plain")  # the test table
    want = "varlen" if varlen else ("stock_native" if lens_kind == "plain" else "stock_flattened")
    counts = stats.snapshot()
    assert counts["steps"] == {**dict.fromkeys(stats.PATHS, 0), want: 1}
    assert counts["variable"][want] == int(len(set(lens)) > 1)
    assert sum(counts["mixed"].values()) == 0
    if lens_kind != "plain" and sum(lens) < 64:
        # fewer tokens than any rule's rows: stock's own build, stock's rows
        req, ctx = _expected_rows(lens, seqs, sum(lens))
        assert md.decode.indices is None and varlen_ids_of(md.decode.schedule_metadata) is None
        assert torch.equal(md.decode.seq_lens[:, 0], ctx)
        assert torch.equal(md.decode.block_table[:, :WIDTH], bt[req])
    else:
        _check_varlen_decode(md, builder, lens, seqs, bt, kernel=varlen)
    call = dg.calls_to("get_paged_mqa_logits_metadata")[-1]
    assert call.kwargs == {} and call.args[0] is md.decode.seq_lens
    assert torch.equal(builder.scheduler_metadata_buffer,
                       schedule_fingerprint(md.decode.seq_lens, None, NUM_SMS))


# --------------------------------------------------------------------------- vs stock

def _snapshot(md):
    out = {k: getattr(md, k) for k in ("num_decodes", "num_decode_tokens", "num_prefills",
                                       "num_prefill_tokens", "max_seq_len")}
    if md.decode is not None:
        for k in ("seq_lens", "block_table", "decode_lens", "schedule_metadata"):
            out["decode." + k] = getattr(md.decode, k).clone()
        out["decode.requires_padding"] = md.decode.requires_padding
        out["decode.global_seq_lens"] = md.decode.global_seq_lens
    return out


def _assert_same(a, b, skip=()):
    assert a.keys() == b.keys()
    for k in a:
        if k in skip:
            continue
        if isinstance(a[k], torch.Tensor):
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("platform", ["sm100_native", "cpu"])
@pytest.mark.parametrize("seed", range(3))
def test_off_or_stock_path_is_identical_to_unpatched(monkeypatch, platform, seed):
    """A builder on the stock path builds exactly what unpatched 0.27.1 builds."""
    # Stock's uniform split may turn short decodes into prefills, whose chunk
    # metadata is a Triton kernel: stub it (no chunk is compared).
    monkeypatch.setattr(ix, "build_prefill_chunk_metadata", lambda *a, **k: None)
    if platform == "sm100_native":
        fake_gpu(monkeypatch, (10, 0))
        dg = FakeDeepGemm("old", 100, num_sms=NUM_SMS).install(monkeypatch)
        next_n, uniform = 2, seed % 2 == 0
    else:  # a real non-CUDA platform: stock flatten branch, torch-only variable path
        if torch.cuda.is_available():
            pytest.skip("this case is a non-CUDA platform's; the real platform here is CUDA")
        dg, next_n, uniform = None, 3, False
    lens, seqs, pad = _random_batch(seed, num_reqs=4, max_len=next_n, uniform=uniform,
                                    min_seq=next_n)
    stock = make_builder(monkeypatch, next_n=next_n)
    want = _snapshot(_build(stock, lens, seqs, pad, seed)[0])
    stock_calls = [(c.args, c.kwargs) for c in dg.calls] if dg else []
    patches.apply_all()
    if platform == "sm100_native":
        monkeypatch.setenv(config.MODE_ENV, "off")
    builder = make_builder(monkeypatch, next_n=next_n)
    assert not builder.use_varlen
    n = len(dg.calls) if dg else 0
    md = _build(builder, lens, seqs, pad, seed)[0]
    # Without DeepGEMM the schedule buffer is never written (torch.empty garbage).
    _assert_same(_snapshot(md), want, skip=() if dg else ("decode.schedule_metadata",))
    assert md.decode.indices is None and varlen_ids_of(md.decode.schedule_metadata) is None
    if dg:
        ours = [(c.args, c.kwargs) for c in dg.calls[n:]]
        assert len(ours) == len(stock_calls) == 1
        (a_args, a_kw), (b_args, b_kw) = ours[0], stock_calls[0]
        assert a_kw == b_kw and len(a_args) == len(b_args)
        assert torch.equal(a_args[0], b_args[0]) and a_args[1:] == b_args[1:]


@pytest.mark.parametrize("backend", ["deepgemm", "own"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("compress_ratio", [1, 4])
def test_varlen_rows_match_stock_flatten_branch(monkeypatch, backend, seed, compress_ratio):
    """Per-row lengths, block-table rows and row count equal stock's flatten branch
    (run where stock runs it on the CPU: a variable batch off SM100)."""
    _no_triton_slot_mapping(monkeypatch)
    block_size = 64 * compress_ratio
    lens, seqs, pad = _random_batch(seed, num_reqs=5, max_len=4, pad_reqs=seed % 2,
                                    pad_tokens=seed)
    fake_gpu(monkeypatch, (9, 0), triton=False)
    FakeDeepGemm("old", 90, num_sms=NUM_SMS).install(monkeypatch)
    stock = make_builder(monkeypatch, next_n=4, block_size=block_size,
                         compress_ratio=compress_ratio)
    assert stock.use_flattening
    want = _snapshot(_build(stock, lens, seqs, pad, seed)[0])
    _setup(monkeypatch, backend)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4, block_size=block_size,
                           compress_ratio=compress_ratio)
    assert builder.varlen_backend == backend
    got = _snapshot(_build(builder, lens, seqs, pad, seed)[0])
    _assert_same(got, want, skip=("decode.schedule_metadata",))


@pytest.mark.parametrize("backend,next_n,ratio,compiles", [
    ("own", 4, 1, True), ("own", 3, 1, True), ("own", 3, 4, True),
    ("deepgemm", 4, 1, False)])
def test_builder_precompiles_the_triton_kernels_at_creation(monkeypatch, backend, next_n, ratio,
                                                            compiles):
    """A Triton-backed builder compiles the kernels when it is made (with the
    cache's kernel page -- 64 entries also for DeepSeek V4's compressed cache --
    and run-length hints up to next_n); a DeepGEMM one does not."""
    from vllm_dsa_varlen import warmup

    _setup(monkeypatch, backend)
    if ratio > 1:
        _no_triton_slot_mapping(monkeypatch)
    calls = []
    monkeypatch.setattr(warmup, "precompile_for", lambda **kw: calls.append(kw))
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=next_n, block_size=64 * ratio,
                           compress_ratio=ratio)
    assert builder.varlen_backend == backend
    assert calls == ([dict(heads=builder.vllm_config.model_config.hf_config.index_n_heads,
                           head_size=132, page=64, device=torch.device("cpu"),
                           max_run_len=next_n)] if compiles else [])


@pytest.mark.parametrize("graph_kernel", ["cuda_sm90", "portable"])
def test_kernel_gated_rules_follow_the_builders_graph_kernel(monkeypatch, graph_kernel):
    """A rule measured with one varlen kernel only (``Rule.kernel``) applies when
    the builder's graph-time kernel (``launcher.graph_kernel``, asked with its cache's
    geometry and index heads) is that kernel."""
    from vllm_dsa_varlen.ops import launcher

    fake_gpu(monkeypatch, (9, 0))
    FakeDeepGemm("2.6", 90, num_sms=NUM_SMS).install(monkeypatch)
    monkeypatch.setattr(policy, "MEASURED", (policy.Rule(
        "flattened", min_run=3, min_requests=64, kernel="cuda_sm90", note="test table"),))
    asked = []
    monkeypatch.setattr(launcher, "graph_kernel", lambda device, heads, dim, page: (
        asked.append((dim, page)), graph_kernel)[1])
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4, max_tokens=256, max_seqs=64)
    assert builder.decode_path.per_step == "flattened"
    gen = torch.Generator().manual_seed(5)
    lens = [4] * 64
    seqs = [n + int(x) for n, x in zip(lens, torch.randint(0, 3000, (64,), generator=gen))]
    fake_uniform_decode_kernel(monkeypatch)
    md, bt = _build(builder, lens, seqs, seed=5)
    if graph_kernel == "cuda_sm90":
        _check_varlen_decode(md, builder, lens, seqs, bt, kernel=True)
    else:  # no rule can ever apply: stock's own build of the step
        req, ctx = _expected_rows(lens, seqs, sum(lens))
        assert md.decode.indices is None and varlen_ids_of(md.decode.schedule_metadata) is None
        assert torch.equal(md.decode.seq_lens[:, 0], ctx)
        assert torch.equal(md.decode.block_table[:, :WIDTH], bt[req])
    assert asked and set(asked) == {(builder.kv_cache_spec.head_size - 4, 64)}


def _hopper_next4_builder(monkeypatch, mode: str):
    """The plugin's builder on a fake H200 with DeepGEMM 2.6, next_n 4, the
    CUDA-graph mode ``mode``: steps compared per step with stock's flattened
    call."""
    from vllm.config import CUDAGraphMode

    fake_gpu(monkeypatch, (9, 0))
    FakeDeepGemm("2.6", 90, num_sms=NUM_SMS).install(monkeypatch)
    fake_uniform_decode_kernel(monkeypatch)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4, max_tokens=256, max_seqs=64)
    builder.vllm_config.compilation_config = SimpleNamespace(
        cudagraph_mode=getattr(CUDAGraphMode, mode))
    assert builder.decode_path.per_step == "flattened"
    return builder


@pytest.mark.parametrize("graph_kernel", ["cuda_sm90", "portable"])
@pytest.mark.parametrize("mode,plain_to_stock", [("FULL_AND_PIECEWISE", True), ("FULL", False)])
def test_steps_left_to_stock_replay_the_captured_graph(monkeypatch, mode, plain_to_stock,
                                                       graph_kernel):
    """SM90, next_n 4, the measured table: a step whose padded token count is
    below every rule's rows goes to stock's own build.  For each FULL-graph
    size, a capture-like batch (size / 4 dummy requests of 4 tokens) and
    replay-like batches of the same padded size (fewer real requests plus
    0-token padding requests, other contexts, variable lengths) get the same
    decision, and the kernel call as captured (the capture's metadata tensors,
    whose buffers each replay build refreshes) computes the replay batch's
    logits: against the reference on the independent per-token rows."""
    from vllm_dsa_varlen.ops import launcher
    from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, quantize_kv_fp8
    from vllm_dsa_varlen.vllm_0_27.model_executor.layers import sparse_attn_indexer as dispatch

    monkeypatch.setattr(launcher, "graph_kernel", lambda *a, **k: graph_kernel)
    builder = _hopper_next4_builder(monkeypatch, mode)
    assert builder.varlen_graph_kernel == graph_kernel
    # The table's smallest row bound for 3-4-token steps, read off the rules
    # here (a rule's requests times the tokens it asks of each fill rows too):
    # 18 rows with the CUDA sm_90 kernel (3 tokens; 4 tokens from 32), 64 with
    # the portable one.
    kernel = builder.varlen_graph_kernel
    bound = min(max(r.min_rows, r.min_requests, -(-r.min_requests * r.min_tokens_per_request // 1))
                for r in policy.MEASURED
                if r.stock == "flattened" and r.kernel in (None, kernel) and r.min_run <= 4)
    assert bound == (18 if kernel == "cuda_sm90" else 64)
    # 4-token steps: stock's build below 18 rows; the step's rule from 32 (cuda) / 64 rows
    four = 32 if kernel == "cuda_sm90" else 64
    heads, dim, page, blocks = 4, 128, 64, 64
    gen = torch.Generator().manual_seed(7)
    kv = quantize_kv_fp8(torch.randn((blocks, page, dim), generator=gen))

    def batch(lens, seqs, size, seed):
        pad = (size - sum(lens)) // 4 if max(lens) > 1 else size - len(lens)
        lens, seqs = lens + [0] * pad, seqs + [0] * pad
        bt = random_block_table(len(lens), WIDTH, blocks, seed)
        return lens, seqs, bt, decode_batch(lens, seqs, bt, num_tokens=size)

    for size in (4, 8, 16, 32, 64, 128):
        n = size // 4
        lens, seqs, bt, cm = batch([4] * n, [4] * n, size, 0)  # capture: dummy contexts
        cap = builder.build(0, cm).decode
        stock_built = cap.indices is None
        assert stock_built == (size < bound)
        varlen = varlen_ids_of(cap.schedule_metadata) is not None
        assert varlen == (size >= four)  # the captured step's own choice
        replays = [([4] * n, [int(x) + 4 for x in torch.randint(1, 2000, (n,), generator=gen)])]
        if n > 1:
            real = int(torch.randint(1, n, (1,), generator=gen))
            replays.append(([4] * real, [int(x) + 4 for x in
                                         torch.randint(1, 2000, (real,), generator=gen)]))
            var = torch.randint(1, 5, (n,), generator=gen).tolist()
            replays.append((var, [v + int(x) for v, x in
                                  zip(var, torch.randint(1, 2000, (n,), generator=gen))]))
        for i, (real_lens, real_seqs) in enumerate(replays):
            lens, seqs, bt, cm = batch(real_lens, real_seqs, size, i + 1)
            dec = builder.build(0, cm).decode
            assert (dec.indices is None) == stock_built  # the same decision as the capture
            if stock_built:
                assert varlen_ids_of(dec.schedule_metadata) is None
            # The captured call: the capture's tensors, refreshed in place.
            assert dec.seq_lens.data_ptr() == cap.seq_lens.data_ptr()
            assert dec.block_table.data_ptr() == cap.block_table.data_ptr()
            req, ctx = _expected_rows(lens, seqs, size)
            assert torch.equal(cap.seq_lens[:, 0], ctx)
            q = torch.randn((size, 1, heads, dim), generator=gen).to(torch.float8_e4m3fn)
            w = torch.randn((size, heads), generator=gen)
            max_len = int(ctx.max()) + 3
            monkeypatch.setattr(
                launcher_module(), "varlen_paged_mqa_logits",
                lambda q, kv_cache, weights, context_lens, block_table, indices,
                max_context_len, **_: paged_mqa_logits_ref(q, kv_cache, weights, context_lens,
                                                           block_table, max_context_len, indices))
            got = dispatch.fp8_fp4_paged_mqa_logits(
                (q, None), kv, w, cap.seq_lens, cap.block_table, cap.schedule_metadata,
                max_model_len=max_len, clean_logits=False)
            rows_bt = torch.zeros((size, WIDTH), dtype=torch.int32)
            rows_bt[req >= 0] = bt[req[req >= 0]]
            want = paged_mqa_logits_ref(q, kv, w, ctx.unsqueeze(-1), rows_bt, max_len)
            valid = torch.arange(max_len).unsqueeze(0) < ctx.unsqueeze(-1)
            # The same reference on runs of rows (got) and on single rows (want):
            # float32 sums in another order (the matmuls' shapes differ), so equal
            # within rounding; a wrong row or page differs by O(1).
            torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{(size, i, varlen)}: {m}")
    # Plain (1-token) steps go to stock only where no FULL graph replays other batches.
    lens, seqs, bt, cm = batch([1] * 5, [40, 50, 60, 70, 80], 8, 9)
    md = builder.build(0, cm)
    assert (md.decode.indices is None) == plain_to_stock
    assert md.decode.seq_lens[:5, 0].tolist() == [40, 50, 60, 70, 80]


@pytest.mark.parametrize("seed", range(6))
def test_steps_left_to_stock_count_as_their_lengths_say(monkeypatch, seed):
    """A step left to stock's own build counts its path without reading the
    requests' lengths when they are uniform and unpadded; every kind of such
    step (uniform, graph-padded, variable, one-token) counts as its lengths
    say: stock flattened, native where no request has two tokens, variable
    where the real requests' lengths differ (graph padding does not count)."""
    builder = _hopper_next4_builder(monkeypatch, "FULL_AND_PIECEWISE")
    gen = torch.Generator().manual_seed(seed)
    kinds = []
    for size in (4, 8, 16, 32):
        n = size // 4
        real = int(torch.randint(1, n + 1, (1,), generator=gen))
        var = torch.randint(1, 5, (n,), generator=gen).tolist()
        kinds += [[4] * n, [4] * real + [0] * (n - real), var + [0] * ((size - sum(var)) // 4)]
    kinds += [[1] * 8, [1] * 5 + [0] * 3]  # one-token steps, unpadded and padded
    for lens in kinds:
        seqs = [v + int(x) if v else 0 for v, x in
                zip(lens, torch.randint(1, 2000, (len(lens),), generator=gen))]
        size = len(lens) * max(lens)
        cm = decode_batch(lens, seqs, random_block_table(len(lens), WIDTH, 64, seed),
                          num_tokens=size)
        stats.reset()
        md = builder.build(0, cm)
        got = stats.snapshot()
        assert md.decode.indices is None, lens  # left to stock
        real = [n for n in lens if n]
        path = "stock_flattened" if max(real) > 1 else "stock_native"
        assert {p for p, c in got["steps"].items() if c} == {path}, lens
        assert sum(got["steps"].values()) == 1
        assert sum(got["variable"].values()) == (min(real) != max(real)), lens
        assert sum(got["mixed"].values()) == 0


def launcher_module():
    from vllm_dsa_varlen.ops import launcher
    return launcher


# --------------------------------------------------------------------------- rows kept across steps

def _random_step(gen):
    """(lens, seqs, pad_tokens) of one decode step: uniform (2..4 tokens, the ids
    ``r // n``), variable, graph-padded (requests of 0 tokens, padding tokens)
    or plain (1 token each)."""
    kind = ["uniform", "uniform", "variable", "padded", "plain"][
        int(torch.randint(0, 5, (1,), generator=gen))]
    num_reqs = int(torch.randint(1, 9, (1,), generator=gen))
    seed = int(torch.randint(0, 10_000, (1,), generator=gen))
    if kind == "plain":
        lens, seqs, _ = _random_batch(seed, num_reqs, 1, uniform=True, pad_reqs=2)
        return kind, lens, seqs, int(torch.randint(0, 5, (1,), generator=gen))
    n = int(torch.randint(2, 5, (1,), generator=gen))
    lens, seqs, pad = _random_batch(seed, num_reqs, n, uniform=kind == "uniform",
                                    pad_reqs=2 if kind == "padded" else 0,
                                    pad_tokens=3 if kind == "padded" else 0)
    return kind, lens, seqs, pad


@pytest.mark.parametrize("backend", ["deepgemm", "own"])
@pytest.mark.parametrize("seed", range(3))
def test_every_step_rewrites_what_it_reads_whatever_came_before(monkeypatch, backend, seed):
    """A captured graph replays with whatever the last build left in the buffers,
    and builds skip what is known to hold already (the ids of a uniform layout
    the buffer still holds; the all-ones ``decode_lens``): over a random sequence
    of uniform, variable, graph-padded and plain steps every build's rows equal
    the independent expectation, uniform steps' ids are exactly ``r // n``, and
    every buffer keeps its address."""
    _setup(monkeypatch, backend)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4)
    gen = torch.Generator().manual_seed(seed)
    addrs = None
    for step in range(40):
        kind, lens, seqs, pad = _random_step(gen)
        md, bt = _build(builder, lens, seqs, pad, seed=step)
        ids = _check_varlen_decode(md, builder, lens, seqs, bt)
        rows = md.num_decode_tokens
        if kind == "uniform":
            assert torch.equal(ids, torch.arange(rows, dtype=torch.int32) // lens[0]), (step, lens)
        if kind == "plain":
            assert torch.equal(ids, torch.arange(rows, dtype=torch.int32)), (step, lens)
        if kind != "plain":
            # stock's own per-request lengths are in its buffer; the step's decode_lens are not
            assert builder.decode_lens_buffer[0] == lens[0]
        now = [t.data_ptr() for t in (md.decode.indices, md.decode.seq_lens,
                                      md.decode.block_table, md.decode.decode_lens)]
        assert now == (addrs or now), step
        addrs = now


def test_a_failed_ids_write_is_not_taken_for_a_held_layout(monkeypatch):
    """A uniform step whose planning fails leaves the builder unsure of its ids:
    the next step of the layout it held before writes them again."""
    import vllm_dsa_varlen.vllm_0_27.v1.attention.backends.mla.indexer as pix

    _setup(monkeypatch, "deepgemm")
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4)
    _build(builder, [4, 4], [100, 200])                      # holds r // 4, 8 rows
    real_plan = pix.plan_decode_rows

    def failing_plan(*args, **kwargs):
        builder.decode_indices_buffer.fill_(-1)  # a write that got part way
        raise RuntimeError("planning failed")

    monkeypatch.setattr(pix, "plan_decode_rows", failing_plan)
    with pytest.raises(RuntimeError, match="planning failed"):
        _build(builder, [2, 2, 2], [50, 60, 70])
    monkeypatch.setattr(pix, "plan_decode_rows", real_plan)
    md, bt = _build(builder, [4, 4], [300, 400])
    assert md.decode.indices.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    _check_varlen_decode(md, builder, [4, 4], [300, 400], bt)


@pytest.mark.parametrize("seed", range(8))
def test_step_facts_of_uniform_unpadded_steps_are_what_the_lengths_give(seed):
    """step_facts reads two host offsets on a uniform step without graph
    padding; on every kind of step (uniform, padded, variable, one-token, with
    prefills after the decodes) its facts equal those of the requests' lengths
    (``StepFacts.from_decode_lens``)."""
    from vllm_dsa_varlen.policy import StepFacts
    from vllm_dsa_varlen.vllm_0_27.v1.attention.backends.mla import indexer as pix

    rng = random.Random(seed)
    for _ in range(40):
        n = rng.randint(1, 12)
        kind = rng.choice(["uniform", "padded", "variable", "plain"])
        top = 1 if kind == "plain" else rng.randint(2, 4)
        lens = ([top] * n if kind in ("uniform", "plain") else
                [rng.randint(1, top) for _ in range(n)])
        if kind == "padded":
            lens = [top] * n + [0] * rng.randint(1, 3)
        decodes = len(lens)
        prefills = [rng.randint(5, 40) for _ in range(rng.choice([0, 0, 2]))]
        rows = sum(lens) if kind != "padded" else decodes * top
        starts = [0]
        for x in lens + prefills:
            starts.append(starts[-1] + x)
        cm = SimpleNamespace(num_reqs=decodes + len(prefills),
                             max_query_len=max(lens + prefills),
                             query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
                             max_seq_len=rng.randint(1, 70000))
        want = StepFacts.from_decode_lens(lens, rows=rows, max_context=cm.max_seq_len)
        assert pix.step_facts(cm, decodes, rows) == want, (kind, lens, prefills)


def test_the_top_k_bound_follows_compression_and_skips_context_parallelism():
    """The decode top-k's bound: ``max_seq_len`` divided as DeepSeek V4's
    compressed rows are; none under decode context parallelism."""
    from vllm_dsa_varlen.vllm_0_27.v1.attention.backends.mla import indexer as glue

    common = SimpleNamespace(max_seq_len=40001)
    for ratio, dcp, want in [(1, 1, 40001), (4, 1, 10000), (1, 2, None), (4, 4, None)]:
        builder = SimpleNamespace(compress_ratio=ratio, dcp_world_size=dcp)
        assert glue._topk_bound(builder, common) == want
    assert glue._topk_bound(SimpleNamespace(), SimpleNamespace(max_seq_len=0)) == 1
