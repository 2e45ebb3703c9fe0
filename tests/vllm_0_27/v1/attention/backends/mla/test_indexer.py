"""The patched DeepseekV32IndexerMetadataBuilder, driven through vLLM 0.27.1's own build()."""


import pytest
import torch

pytest.importorskip("vllm")

import vllm.v1.attention.backends.mla.indexer as ix  # noqa: E402
from fake_deep_gemm import FakeDeepGemm, schedule_fingerprint  # noqa: E402
from vllm_stubs import NUM_SMS, decode_batch, fake_gpu, make_builder, random_block_table  # noqa: E402

from vllm_dsa_varlen import config, patches  # noqa: E402
from vllm_dsa_varlen.varlen_ids import varlen_ids_of  # noqa: E402

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


def _setup(monkeypatch, backend):
    """Fake the GPU for a backend: 'deepgemm' (SM100 + DeepGEMM 2.8.x double),
    'triton' (SM90, Triton usable)."""
    if backend == "deepgemm":
        fake_gpu(monkeypatch, (10, 0))
        return FakeDeepGemm("2.8", 100, num_sms=NUM_SMS).install(monkeypatch)
    fake_gpu(monkeypatch, (9, 0))
    return FakeDeepGemm("old", 90, num_sms=NUM_SMS).install(monkeypatch)


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


def _check_varlen_decode(md, builder, lens, seqs, bt, compress_ratio=1):
    """The decode metadata of a varlen step against the independent expectation."""
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
    # The kernel call gets the ids through a fresh view of the stable schedule buffer.
    tag = varlen_ids_of(dec.schedule_metadata)
    assert tag is not None and tag.ids is ids and tag.backend == builder.varlen_backend
    assert tag.max_run_len == max(lens)  # the host's sizing hint for the Triton kernel
    assert dec.schedule_metadata is not builder.scheduler_metadata_buffer
    assert dec.schedule_metadata.data_ptr() == builder.scheduler_metadata_buffer.data_ptr()
    assert varlen_ids_of(builder.scheduler_metadata_buffer) is None
    return ids


# --------------------------------------------------------------------------- __init__

@pytest.mark.parametrize("cap,flavour,next_n,fp4,env,want", [
    ((10, 0), "2.8", 4, False, {}, "deepgemm"),
    ((10, 0), "2.8", 1, False, {}, "deepgemm"),
    ((10, 0), "2.8", 3, True, {}, "deepgemm"),
    ((10, 0), "old", 3, False, {}, "triton"),
    ((10, 0), "old", 1, False, {}, None),
    ((9, 0), "2.8", 3, False, {}, "triton"),
    ((9, 0), "old", 2, False, {}, None),
    ((9, 0), "old", 2, False, {config.BACKEND_ENV: "triton"}, "triton"),
    ((9, 0), "old", 1, False, {}, None),
    ((10, 0), "2.8", 4, False, {config.MODE_ENV: "off"}, None),
    ((10, 0), "2.8", 4, False, {config.BACKEND_ENV: "triton"}, "triton"),
    ((9, 0), "old", 4, False, {config.BACKEND_ENV: "deepgemm"}, None),
    (None, "2.8", 4, False, {}, None),
])
def test_init_decides_the_path(monkeypatch, plugin_log, cap, flavour, next_n, fp4, env, want):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fake_gpu(monkeypatch, cap)
    FakeDeepGemm(flavour, cap[0] * 10 if cap else 100).install(monkeypatch)
    stock = make_builder(monkeypatch, next_n=next_n, fp4=fp4)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=next_n, fp4=fp4)
    assert builder.use_varlen == (want is not None) and builder.varlen_backend == want
    if want:
        assert builder.use_flattening is True
        ids = builder.decode_indices_buffer
        assert ids.dtype == torch.int32 and ids.data_ptr() % 8 == 0
        assert ids.shape[0] >= builder.vllm_config.scheduler_config.max_num_batched_tokens
    else:
        assert builder.use_flattening == stock.use_flattening
    lines = [r.getMessage() for r in plugin_log if "decode path" in r.getMessage()]
    assert len(lines) == 1 and builder.decode_path.reason in lines[0]
    make_builder(monkeypatch, next_n=next_n, fp4=fp4)  # a second builder logs nothing new
    assert len([r for r in plugin_log if "decode path" in r.getMessage()]) == 1


# --------------------------------------------------------------------------- varlen builds

@pytest.mark.parametrize("backend", ["deepgemm", "triton"])
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


@pytest.mark.parametrize("backend", ["deepgemm", "triton"])
def test_plain_decode_keeps_stock_rows_with_one_run_per_request(monkeypatch, backend):
    lens, seqs = [1, 1, 1, 1, 0], [40, 900, 7, 65, 0]
    _setup(monkeypatch, "triton")  # stock on SM90 (2.8.x on SM100 refuses id-less calls)
    stock = make_builder(monkeypatch, next_n=4)
    stock_md, _ = _build(stock, lens, seqs, pad_tokens=2, seed=1)
    stock_dec = {k: getattr(stock_md.decode, k).clone() for k in ("seq_lens", "block_table")}
    _setup(monkeypatch, backend)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4)
    md, bt = _build(builder, lens, seqs, pad_tokens=2, seed=1)
    dec = md.decode
    assert torch.equal(dec.indices, torch.arange(len(lens), dtype=torch.int32))
    assert dec.indices.data_ptr() == builder.arange_buffer.data_ptr()
    assert torch.equal(dec.seq_lens[:, 0], torch.tensor(seqs, dtype=torch.int32))
    assert torch.equal(dec.seq_lens, stock_dec["seq_lens"])
    assert torch.equal(dec.block_table, stock_dec["block_table"])
    assert dec.requires_padding == stock_md.decode.requires_padding
    assert varlen_ids_of(dec.schedule_metadata).ids is dec.indices
    assert varlen_ids_of(dec.schedule_metadata).max_run_len == 1


@pytest.mark.parametrize("backend", ["deepgemm", "triton"])
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
    """Same row count -> same addresses (what a captured CUDA graph replays)."""
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


def test_mixed_batch_keeps_variable_decodes_as_decodes(monkeypatch):
    _setup(monkeypatch, "deepgemm")
    monkeypatch.setattr(ix, "build_prefill_chunk_metadata", lambda *a, **k: None)
    patches.apply_all()
    builder = make_builder(monkeypatch, next_n=4)
    lens, seqs = [3, 1, 4, 20], [10, 7, 12, 20]
    md, bt = _build(builder, lens, seqs, seed=2)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (3, 1, 8)
    _check_varlen_decode(md, builder, lens[:3], seqs[:3], bt)


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


@pytest.mark.parametrize("backend", ["deepgemm", "triton"])
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
