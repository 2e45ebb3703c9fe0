"""The patched DeepseekV32IndexerMetadataBuilder of vLLM 0.33.0, driven through its own build():
the builder-level decision and its log line, the per-step classification against
stock's real build, graph safety (stable buffers, no device reads, key-determined
choices), adaptive verification, and ``DSA_VARLEN=off``."""

from __future__ import annotations

import logging

import pytest
import torch

import vllm.v1.attention.backends.mla.indexer as ix  # noqa: E402
from vllm033_stubs import (  # noqa: E402
    LINE,
    HopperDeepGemm,
    decode_batch,
    fake_gpu,
    fake_uniform_decode_kernel,
    last_step_choice,
    make_builder,
)

from vllm_dsa_varlen import config, patches, policy, stats  # noqa: E402
from vllm_dsa_varlen.varlen_ids import varlen_ids_of  # noqa: E402
from vllm_dsa_varlen.vllm_0_33.v1.attention.backends.mla import indexer as ours  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_plugin")

WIDTH = 64
ALL_WIN = (policy.Rule("native"), policy.Rule("flattened"), policy.Rule("split"))


def _hopper(monkeypatch, **kw):
    fake_gpu(monkeypatch, (9, 0), **kw)
    return HopperDeepGemm().install(monkeypatch)


def _all_win(monkeypatch):
    monkeypatch.setattr(policy, "MEASURED", ALL_WIN)


def _table(gen, rows):
    return torch.randint(0, 1000, (rows, WIDTH), generator=gen, dtype=torch.int32)


# ------------------------------------------------------------------ the decision (pure)

BASE = dict(is_cuda=True, capability=(9, 0), upstream_varlen=False, own_ok=True, next_n=4,
            fp4_cache=False, flattening=False)

DECISIONS = [
    # (overrides, use_varlen, warning, words in the reason)
    ({}, True, False, ["sm_90", "next_n=4", "native [B, 4]", "per step"]),
    (dict(next_n=3, flattening=True), True, False, ["flattens every step"]),
    (dict(next_n=2), True, False, ["native [B, 2]"]),
    (dict(next_n=1), False, False, ["next_n == 1"]),
    (dict(next_n=1, backend="own"), False, True, ["own but next_n == 1"]),
    (dict(mode="off"), False, False, ["DSA_VARLEN=off"]),
    (dict(is_cuda=False, capability=None), False, False, ["not a CUDA platform"]),
    (dict(capability=None), False, False, ["capability unknown"]),
    (dict(capability=(10, 0), upstream_varlen=True), False, False, ["upstream varlen", "sm_100"]),
    (dict(capability=(10, 0), upstream_varlen=True, backend="own"), False, True,
     ["ignored", "upstream varlen"]),
    (dict(capability=(10, 0)), True, False, ["sm_100"]),  # SM100 without DeepGEMM
    (dict(backend="deepgemm"), False, True, ["deepgemm but", "SM100"]),
    (dict(fp4_cache=True), False, False, ["MXFP4"]),
    (dict(capability=(8, 0)), False, False, ["no fp8"]),
    (dict(capability=(8, 9)), True, False, ["sm_89"]),
    (dict(capability=(12, 0)), True, False, ["sm_120"]),
    (dict(own_ok=False), False, False, ["varlen kernel is unavailable"]),
    (dict(own_ok=False, backend="own"), False, True, ["own but"]),
    # a forced backend still runs the per-step rules on this line
    (dict(backend="own"), True, False, ["forced by DSA_VARLEN_BACKEND=own", "per step"]),
]


@pytest.mark.parametrize("overrides,want,warning,words", DECISIONS)
def test_choose_decode_path_table(overrides, want, warning, words):
    path = ours.choose_decode_path(**{**BASE, **overrides})
    assert path.use_varlen is want and path.warning is warning
    assert path.backend == ("own" if want else None)
    for word in words:
        assert word in path.describe(), (word, path.describe())


def test_choose_decode_path_rejects_bad_next_n():
    with pytest.raises(ValueError, match="next_n"):
        ours.choose_decode_path(**{**BASE, "next_n": 0})


# ------------------------------------------------------------------ init and the log line

@pytest.mark.parametrize("cap,deepgemm,next_n,env,want,words", [
    ((9, 0), True, 4, {}, True, ["varlen (portable Triton)", "sm_90", "next_n=4"]),
    ((9, 0), True, 3, {}, True, ["varlen (portable Triton)", "flattens"]),
    ((9, 0), True, 1, {}, False, ["stock", "next_n == 1"]),
    ((10, 0), True, 4, {}, False, ["stock", "upstream varlen"]),
    ((9, 0), True, 4, {config.MODE_ENV: "off"}, False, ["stock", "off"]),
    ((9, 0), True, 4, {config.BACKEND_ENV: "deepgemm"}, False, ["stock", "deepgemm but"]),
])
def test_init_decides_the_path_and_logs_it_once(monkeypatch, plugin_log, cap, deepgemm, next_n,
                                                env, want, words):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    fake_gpu(monkeypatch, cap, deepgemm_installed=deepgemm)
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=next_n)
    make_builder(monkeypatch, next_n=next_n)  # a second builder of the same kind: no new line
    assert builder.use_varlen is want
    assert builder.supports_varlen is (cap == (10, 0) and deepgemm)
    lines = [r.getMessage() for r in plugin_log if "decode path" in r.getMessage()]
    assert len(lines) == 1, lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    level = logging.WARNING if builder.decode_path.warning else logging.INFO
    assert [r.levelno for r in plugin_log if "decode path" in r.getMessage()] == [level]


@pytest.mark.parametrize("kernel,label", [("cuda_sm90", "varlen (cuda_sm90)"),
                                          ("portable", "varlen (portable Triton)")])
def test_the_log_line_names_the_kernel_a_step_runs(monkeypatch, plugin_log, kernel, label):
    """The kernel named is the one the launcher takes for this builder's cache
    (``launcher.graph_kernel``), which the policy's kernel-gated rules read."""
    from vllm_dsa_varlen.ops import launcher

    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(launcher, "graph_kernel", lambda *a, **k: kernel)
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=4)
    assert builder.varlen_graph_kernel == kernel and builder.decode_path.kernel == kernel
    lines = [r.getMessage() for r in plugin_log if "decode path" in r.getMessage()]
    assert len(lines) == 1 and f"decode path: {label}, per step" in lines[0], lines


def test_own_kernel_serves_checks_the_cache(monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    patches.apply_all(line=LINE)
    assert make_builder(monkeypatch, next_n=4).use_varlen
    assert not make_builder(monkeypatch, next_n=4, page=32).use_varlen  # kernel pages are 64
    assert not make_builder(monkeypatch, next_n=4, index_heads=16).use_varlen
    fake_gpu(monkeypatch, (9, 0), triton=False)
    assert not make_builder(monkeypatch, next_n=4).use_varlen


@pytest.mark.parametrize("cap,next_n,ratio,compiles", [
    ((9, 0), 4, 1, True), ((9, 0), 3, 1, True), ((9, 0), 3, 4, True), ((9, 0), 1, 1, False),
    ((10, 0), 4, 1, False)])
def test_builder_precompiles_the_kernels_at_creation(monkeypatch, cap, next_n, ratio, compiles):
    """A builder that may launch the project's kernel compiles it when it is made
    (the cache's kernel page -- 64 entries also for DeepSeek V4's compressed
    cache -- and run-length hints up to next_n); one left stock does not."""
    from vllm_dsa_varlen import warmup

    fake_gpu(monkeypatch, cap)
    calls = []
    monkeypatch.setattr(warmup, "precompile_for", lambda **kw: calls.append(kw))
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=next_n, compress_ratio=ratio)
    assert builder.use_varlen is compiles
    assert calls == ([dict(heads=ours._index_heads(builder), head_size=132, page=64,
                           device=torch.device("cpu"), max_run_len=next_n)]
                     if compiles else [])


# ------------------------------------------------------------------ per-step classification

def _stub_stock_triton(monkeypatch):
    """Stock's own Triton helpers (flatten prep, prefill chunk metadata) cannot
    run on the CPU: torch stand-ins, enough to see which path stock took."""
    fake_uniform_decode_kernel(monkeypatch)
    monkeypatch.setattr(ix, "build_prefill_chunk_metadata", lambda *a, **k: None)


@pytest.mark.parametrize("next_n,adaptive", [(2, False), (4, False), (3, False), (5, False),
                                             (4, True)])
def test_classification_matches_stocks_build(monkeypatch, next_n, adaptive):
    """``classify_step``'s idea of stock's path is what stock's build does: split
    (decodes cut off to the prefill path), native ([B, n] context lengths) or
    flattened (one row per token), over random steps."""
    _hopper(monkeypatch)
    _stub_stock_triton(monkeypatch)
    patches.apply_all(line=LINE)
    monkeypatch.setenv(config.MODE_ENV, "off")
    stock = make_builder(monkeypatch, next_n=next_n, adaptive=adaptive)
    monkeypatch.delenv(config.MODE_ENV)
    builder = make_builder(monkeypatch, next_n=next_n, adaptive=adaptive)
    gen = torch.Generator().manual_seed(next_n)
    seen = set()
    for _ in range(60):
        num = int(torch.randint(1, 6, (1,), generator=gen))
        if bool(torch.rand(1, generator=gen) < 0.4):
            lens = [int(torch.randint(1, next_n + 1, (1,), generator=gen))] * num
        else:
            lens = torch.randint(1, next_n + 1, (num,), generator=gen).tolist()
        seqs = [n + int(torch.randint(0, 500, (1,), generator=gen)) for n in lens]
        cm = decode_batch(lens, seqs, _table(gen, num))
        choice = ours.classify_step(builder, cm)
        md = stock.build(0, cm)
        if md.num_decodes < num:
            kind = "split"
        elif md.decode.seq_lens.shape[0] == sum(lens) and max(lens) > 1:
            kind = "flattened"
        else:
            kind = "native"
        if max(lens) == 1 and choice.stock == "flattened":
            kind = "flattened"  # one row per request either way
        assert choice.stock == kind, (lens, choice)
        assert choice.facts.rows == sum(lens) and choice.facts.max_run == max(lens)
        assert choice.facts.uniform is (min(lens) == max(lens))
        if choice.stock != "native":  # a native step is described by its graph key
            assert choice.facts == policy.StepFacts.from_decode_lens(
                lens, max_context=max(seqs)), (lens, choice.facts)
        seen.add(kind)
        # the builder counts the step on the path stock's build shows, or varlen
        stats.reset()
        builder.build(0, cm)
        want = (("split_avoided" if kind == "split" else "varlen")
                if last_step_choice(builder, cm).varlen else f"stock_{kind}")
        counts = stats.snapshot()
        assert counts["steps"] == {**dict.fromkeys(stats.PATHS, 0), want: 1}, (lens, choice)
        assert counts["variable"][want] == int(min(lens) != max(lens))
    assert seen >= ({"flattened"} if (next_n in (3, 5) or adaptive) else {"split", "native"})


@pytest.mark.parametrize("next_n", [2, 4])
def test_native_choice_is_fixed_by_the_graph_key(monkeypatch, next_n):
    """A step whose stock path is native may replay a FULL graph of its uniform
    key (padded tokens, requests): whatever the table says, the choice is the
    same for every batch of that key -- real or padding requests, any context."""
    fake_gpu(monkeypatch, (9, 0))
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=next_n)
    seen = []
    table = (policy.Rule("native", min_rows=3 * next_n),)
    monkeypatch.setattr(ours, "varlen_wins", lambda f, s, kernel=None: (
        seen.append(f), policy.varlen_wins(f, s, table, kernel))[1])
    gen = torch.Generator().manual_seed(7)
    for reqs in (3, 4):  # two graph keys
        choices = set()
        for real in range(1, reqs + 1):
            lens = [next_n] * real + [0] * (reqs - real)
            seqs = [int(torch.randint(next_n, 5000, (1,), generator=gen)) for _ in range(real)]
            cm = decode_batch(lens, seqs + [0] * (reqs - real), _table(gen, reqs),
                              num_tokens=reqs * next_n)
            choice = ours.classify_step(builder, cm)
            assert choice.stock == "native" and choice.facts.max_context == 0
            choices.add(choice.varlen)
        assert len(choices) == 1
    assert {f.rows for f in seen} == {3 * next_n, 4 * next_n}


# ------------------------------------------------------------------ graph safety

@pytest.mark.parametrize("next_n", [2, 3, 4])
def test_buffers_are_stable_across_steps(monkeypatch, next_n):
    _hopper(monkeypatch)
    _all_win(monkeypatch)
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=next_n)
    gen = torch.Generator().manual_seed(3)
    ptrs = set()
    for lens in ([next_n] * 4, [1, next_n, 2, 1], [1, 1, 1], [next_n, next_n, 0]):
        lens = [min(n, next_n) for n in lens]
        seqs = [0 if n == 0 else 100 + 31 * i for i, n in enumerate(lens)]
        md = builder.build(0, decode_batch(lens, seqs, _table(gen, len(lens))))
        dec = md.decode
        assert dec.indices.data_ptr() == builder.decode_indices_buffer.data_ptr()
        assert dec.seq_lens.data_ptr() == builder.decode_seq_lens_buffer.data_ptr()
        assert dec.block_table.data_ptr() == builder.expanded_block_table_buffer.data_ptr()
        assert dec.schedule_metadata.data_ptr() == builder.scheduler_metadata_buffer.data_ptr()
        tag = varlen_ids_of(dec.schedule_metadata)
        assert tag.ids is dec.indices and tag.max_run_len == max(lens)
        ptrs.add(dec.indices.data_ptr())
    assert len(ptrs) == 1


def _meta_batch(lens, seqs):
    cm = decode_batch(lens, seqs, torch.zeros((len(lens), WIDTH), dtype=torch.int32))
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        setattr(cm, name, getattr(cm, name).to("meta"))
    return cm


@pytest.mark.parametrize("next_n,adaptive", [(2, False), (3, False), (4, False), (4, True)])
def test_build_reads_no_device_memory(monkeypatch, next_n, adaptive):
    """The whole patched build of decode steps -- uniform, variable, plain,
    graph-padded -- runs with every device tensor on the ``meta`` device, which
    has no data: any host read of device memory (``.item()``, ``.tolist()``,
    a data-dependent shape) would raise.  So the step is planned with device
    ops only and a CUDA graph can capture it."""
    import vllm.utils.deep_gemm as vdg

    fake_gpu(monkeypatch, (9, 0))
    _all_win(monkeypatch)
    monkeypatch.setattr(vdg, "_get_paged_mqa_logits_metadata_impl",
                        lambda cl, bs, n, **kw: torch.zeros((n + 1, 2), dtype=torch.int32,
                                                            device=cl.device))
    monkeypatch.setattr(ix, "num_compute_units", lambda device_index=None: 8)
    fake_uniform_decode_kernel(monkeypatch)  # stock's Triton launch: no host read either
    patches.apply_all(line=LINE)
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    import vllm033_stubs

    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    builder = ix.DeepseekV32IndexerMetadataBuilder(
        spec, ["layers.0.indexer.k_cache"], vllm033_stubs.make_config(next_n=next_n,
                                                                     adaptive=adaptive),
        torch.device("meta"), block_table_width=WIDTH)
    with pytest.raises(Exception):  # the detector works: meta tensors cannot be read
        builder.decode_seq_lens_buffer[0].item()
    for lens in ([next_n] * 3, [1, 2, 1], [1, 1, 1], [next_n, next_n, 0]):
        md = builder.build(0, _meta_batch(lens, [0 if n == 0 else 300 for n in lens]))
        assert builder.last_step_choice.varlen and md.decode.indices.device.type == "meta"
        assert md.decode.seq_lens.shape == (sum(lens), 1)


# ------------------------------------------------------------------ adaptive verification

def test_adaptive_verification_rows_follow_the_device_offsets(monkeypatch):
    """Under adaptive verification the host's per-request lengths are upper
    bounds (drafts are trimmed on the device, the token total is exact): rows
    are planned from the device's query offsets."""
    _hopper(monkeypatch)
    _all_win(monkeypatch)
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=4, adaptive=True)
    gen = torch.Generator().manual_seed(11)
    host_lens, device_lens = [3, 3, 3, 3], [4, 1, 3, 4]
    seqs = [200, 150, 90, 300]
    bt = _table(gen, 4)
    cm = decode_batch(host_lens, seqs, bt)
    qsl = torch.zeros(5, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(device_lens), 0)
    cm.query_start_loc = qsl
    # vLLM's seq_lens count each request's device tokens.
    md = builder.build(0, cm)
    dec = md.decode
    want_ctx = [s - n + j + 1 for n, s in zip(device_lens, seqs) for j in range(n)]
    want_req = [b for b, n in enumerate(device_lens) for _ in range(n)]
    assert dec.seq_lens[:, 0].tolist() == want_ctx
    assert dec.indices.tolist() == want_req
    assert torch.equal(dec.block_table, bt[torch.tensor(want_req)])


# ------------------------------------------------------------------ off and stock steps

def test_off_and_stock_steps_equal_unpatched_stock(monkeypatch):
    """``DSA_VARLEN=off`` builders, and steps the policy leaves to stock
    (native ones under the measured table), produce exactly unpatched stock's
    metadata."""
    _hopper(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    steps = [([4, 4, 4], [100, 230, 57]), ([1, 1, 1, 1], [9, 80, 70, 300]),
             ([4, 4, 0], [77, 300, 0]), ([2, 2], [50, 60])]
    tables = [_table(gen, len(lens)) for lens, _ in steps]

    def run():
        builder = make_builder(monkeypatch, next_n=4)
        out = []
        for (lens, seqs), bt in zip(steps, tables):
            md = builder.build(0, decode_batch(lens, seqs, bt, num_tokens=len(lens) * max(lens)))
            d = md.decode
            out.append((d.seq_lens.clone(), d.block_table.clone(), d.decode_lens.clone(),
                        d.requires_padding, d.schedule_metadata.clone(), d.indices,
                        varlen_ids_of(d.schedule_metadata)))
        return out

    stock = run()
    patches.apply_all(line=LINE)
    monkeypatch.setenv(config.MODE_ENV, "off")
    off = run()
    monkeypatch.delenv(config.MODE_ENV)
    measured = run()
    for got in (off, measured):
        for a, b in zip(stock, got):
            for x, y in zip(a[:5], b[:5]):
                assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y)
            assert b[5] is None and b[6] is None


def test_register_off_leaves_0_33_unpatched(monkeypatch, plugin_log):
    import vllm_dsa_varlen

    monkeypatch.setenv(config.MODE_ENV, "off")
    stock_build = ix.DeepseekV32IndexerMetadataBuilder.build
    vllm_dsa_varlen.register()
    assert patches.applied() == [] and patches.pending() == []
    assert ix.DeepseekV32IndexerMetadataBuilder.build is stock_build
    assert any("off" in r.getMessage() for r in plugin_log)


def test_draft_update_of_a_varlen_step(monkeypatch):
    """A drafter's later steps reuse a plain step's metadata (stock's
    ``update_draft_decode_metadata``): a varlen step's metadata is updated
    without handing its ids to DeepGEMM (the SM90 double refuses ids), the
    schedule is DeepGEMM's for the new rows, and the ids are one run per row."""
    from fake_deep_gemm import schedule_fingerprint

    dg = _hopper(monkeypatch)
    _all_win(monkeypatch)
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=4)
    gen = torch.Generator().manual_seed(2)
    bt = _table(gen, 3)
    md = builder.build(0, decode_batch([1, 1, 1], [40, 90, 61], bt))
    assert builder.last_step_choice.varlen
    builder.decode_indices_buffer[:3] = torch.tensor([5, 5, 5], dtype=torch.int32)  # stale
    md.seq_lens = torch.tensor([41, 91, 62], dtype=torch.int32)
    builder.update_draft_decode_metadata(md)
    dec = md.decode
    assert dec.indices.tolist() == [0, 1, 2]
    assert dec.seq_lens[:, 0].tolist() == [41, 91, 62]
    tag = varlen_ids_of(dec.schedule_metadata)
    assert tag is not None and tag.ids is dec.indices and tag.max_run_len == 1
    assert torch.equal(dec.schedule_metadata, schedule_fingerprint(dec.seq_lens, None, 8))
    assert all(c.bound.get("indices") is None for c in dg.calls)


@pytest.mark.parametrize("next_n", [3, 4])
def test_step_facts_of_padded_steps_are_the_requests_own(monkeypatch, next_n):
    """Graph-padded steps whose padded token count happens to be ``requests x
    longest`` (e.g. [3, 1] padded to 6): the facts are still the requests'
    own (variable, 4 tokens), on the classified path and in the counters of
    the steps left to stock."""
    _hopper(monkeypatch)
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=next_n)
    gen = torch.Generator().manual_seed(5)
    for _ in range(60):
        reqs = int(torch.randint(2, 12, (1,), generator=gen))
        lens = torch.randint(1, next_n + 1, (reqs,), generator=gen).tolist()
        if len(set(lens)) == 1:
            lens[0] = 1 if lens[0] > 1 else 2
        padded = reqs * max(lens)  # the count that looks uniform
        seqs = [n + int(torch.randint(0, 300, (1,), generator=gen)) for n in lens]
        cm = decode_batch(lens, seqs, _table(gen, reqs), num_tokens=padded)
        choice = ours.classify_step(builder, cm)
        assert choice.facts == policy.StepFacts.from_decode_lens(
            lens, rows=padded, max_context=max(seqs)), (lens, choice.facts)
        stats.reset()
        builder.build(0, cm)
        assert sum(stats.snapshot()["variable"].values()) == 1, lens


@pytest.mark.parametrize("seed", range(4))
def test_run_ids_right_on_every_step_of_one_builder(monkeypatch, seed):
    """One builder, a random sequence of varlen steps -- uniform ones of
    different token counts (stock's flatten branch lays out their rows; the ids
    are written only when the buffer does not hold them), variable and
    graph-padded ones (planned by ``plan_decode_rows``), plain ones and the
    drafter's updates of them (ids reset to one run per row) -- in any order:
    every step's ids are its own requests' runs, its rows the requests' own
    tokens."""
    from vllm_dsa_varlen.plan import run_starts

    _hopper(monkeypatch)
    _all_win(monkeypatch)
    patches.apply_all(line=LINE)
    next_n = 4
    builder = make_builder(monkeypatch, next_n=next_n)
    gen = torch.Generator().manual_seed(seed)
    kinds = []
    for _ in range(40):
        reqs = int(torch.randint(1, 9, (1,), generator=gen))
        kind = ("uniform", "uniform", "variable", "padded", "plain")[
            int(torch.randint(0, 5, (1,), generator=gen))]
        if kind in ("uniform", "plain"):
            n = 1 if kind == "plain" else int(torch.randint(2, next_n + 1, (1,), generator=gen))
            lens = [n] * reqs
        else:
            lens = torch.randint(1, next_n + 1, (reqs,), generator=gen).tolist()
        pad = int(torch.randint(1, 4, (1,), generator=gen)) if kind == "padded" else 0
        seqs = [n + int(torch.randint(0, 300, (1,), generator=gen)) for n in lens]
        bt = _table(gen, reqs)
        md = builder.build(0, decode_batch(lens, seqs, bt, num_tokens=sum(lens) + pad))
        assert builder.last_step_choice.varlen, (kind, lens)
        rows = sum(lens) + pad
        dec = md.decode
        req = torch.tensor([b for b, n in enumerate(lens) for _ in range(n)])
        want = torch.ones(rows, dtype=torch.bool)
        want[1:sum(lens)] = req[1:] != req[:-1]
        assert torch.equal(run_starts(dec.indices[:rows]), want), (kinds, kind, lens)
        assert dec.seq_lens[:sum(lens), 0].tolist() == [
            s - n + j + 1 for n, s in zip(lens, seqs) for j in range(n)]
        assert torch.equal(dec.block_table[:sum(lens)], bt[req])
        kinds.append(kind)
        if kind == "plain" and torch.rand((1,), generator=gen).item() < 0.7:
            # the drafter's next step reuses a plain step's metadata
            md.seq_lens = md.seq_lens + 1
            builder.update_draft_decode_metadata(md)
            assert dec.indices.tolist() == list(range(dec.indices.shape[0]))
            kinds.append("draft")
    assert {"uniform", "variable", "padded", "plain", "draft"} <= set(kinds)


@pytest.mark.parametrize("graph_kernel", ["cuda_sm90", "portable"])
def test_kernel_gated_rules_follow_the_builders_graph_kernel(monkeypatch, graph_kernel):
    """A step stock flattens (6 tokens: no native kernel) takes varlen under a
    rule measured with the CUDA sm_90 kernel only when the builder's graph-time
    kernel (``launcher.graph_kernel``, asked with its cache geometry) is that one;
    with the other kernel no rule can ever apply: stock's own build (one row per
    token, no ids)."""
    from vllm_dsa_varlen.ops import launcher

    _hopper(monkeypatch)
    fake_uniform_decode_kernel(monkeypatch)
    monkeypatch.setattr(policy, "MEASURED", (policy.Rule(
        "flattened", min_run=6, max_run_le=6, min_requests=2, uniform=True, kernel="cuda_sm90",
        note="test table"),))
    asked = []
    monkeypatch.setattr(launcher, "graph_kernel", lambda device, heads, dim, page: (
        asked.append((dim, page)), graph_kernel)[1])
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=6)
    gen = torch.Generator().manual_seed(3)
    cm = decode_batch([6, 6, 6], [900, 1500, 70], _table(gen, 3))
    builder.build(0, cm)
    choice = last_step_choice(builder, cm)
    assert choice.stock == "flattened"
    assert choice.varlen is choice.plan is (graph_kernel == "cuda_sm90")
    assert asked and set(asked) == {(builder.kv_cache_spec.head_size - 4,
                                     builder.kv_cache_spec.num_states)}


# ------------------------------------------------------------------ steps left to stock

def _dummy_lens(num_tokens: int, num_reqs: int) -> list[int]:
    """The per-request lengths of vLLM 0.33.0's capture batch (``num_tokens``
    spread over ``num_reqs`` requests, the remainder one each on the last ones)."""
    base, extra = divmod(num_tokens, num_reqs)
    return [base] * (num_reqs - extra) + [base + 1] * extra


@pytest.mark.parametrize("next_n,adaptive,run,mode", [
    (3, False, 3, "FULL_AND_PIECEWISE"),  # flattening builder (no native next_n 3 on SM90)
    (3, False, 3, "FULL"),                # ... FULL graphs also replay mixed batches
    (4, True, 4, "FULL_AND_PIECEWISE"),   # adaptive verification: variable-length decode graphs
    (4, False, 3, "FULL_AND_PIECEWISE"),  # native builder, a uniform 3-token key: stock flattens
])
@pytest.mark.parametrize("graph_kernel", ["portable", "cuda_sm90"])
def test_steps_left_to_stock_replay_the_captured_graph(monkeypatch, next_n, adaptive, run, mode,
                                                       graph_kernel):
    """SM90, the measured table: a flattened step whose token count is below
    every rule's rows is left to stock's own build.  For FULL-graph sizes on
    both sides of the bound, a capture-like batch (vLLM's dummy: ``size / run``
    requests of ``run`` tokens, or one per token where graphs replay mixed
    batches, contexts equal to the lengths) and replay-like batches of the same
    padded size (fewer real requests plus 0-token padding requests, other
    contexts; variable lengths and padding tokens where graphs replay mixed
    batches; under adaptive verification device offsets that differ from the
    host's per-request lengths) get the same decision, the same buffers, and
    the kernel call as captured (the capture's metadata tensors, refreshed by
    each replay's build) computes the replay batch's logits: against the
    reference on the independent per-token rows."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    from vllm.config import CUDAGraphMode

    from vllm_dsa_varlen.ops import launcher
    from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, quantize_kv_fp8, valid_mask

    dg = _hopper(monkeypatch)
    uniform_kernel = fake_uniform_decode_kernel(monkeypatch)
    monkeypatch.setattr(launcher, "varlen_paged_mqa_logits",
                        lambda q, kv_cache, weights, context_lens, block_table, indices,
                        max_context_len, **_: paged_mqa_logits_ref(
                            q, kv_cache, weights, context_lens, block_table, max_context_len,
                            indices))
    monkeypatch.setattr(launcher, "graph_kernel", lambda *a, **k: graph_kernel)
    patches.apply_all(line=LINE)
    max_seqs = 64
    builder = make_builder(monkeypatch, next_n=next_n, adaptive=adaptive, max_seqs=max_seqs)
    assert builder.varlen_graph_kernel == graph_kernel
    builder.vllm_config.compilation_config.cudagraph_mode = getattr(CUDAGraphMode, mode)
    assert builder.use_flattening is (next_n == 3 or adaptive)
    mixed = mode == "FULL" or adaptive
    # The table's smallest row bound for runs of 2..4 tokens, read off the rules
    # (a rule's requests times the tokens it asks of each fill rows too): 64, and
    # 18 with the CUDA sm_90 kernel (uniform 3 tokens from 18 rows).
    bound = min(max(r.min_rows, r.min_requests, -(-r.min_requests * r.min_tokens_per_request // 1))
                for r in policy.MEASURED
                if r.stock == "flattened" and r.min_run <= 4 and r.kernel in (None, graph_kernel))
    assert bound == (18 if graph_kernel == "cuda_sm90" else 64)
    heads, dim, page, blocks = 4, 128, 64, 64
    gen = torch.Generator().manual_seed(7)
    kv = quantize_kv_fp8(torch.randn((blocks, page, dim), generator=gen))

    def build(lens, seqs, size, reqs, device_lens=None):
        lens, seqs = lens + [0] * (reqs - len(lens)), seqs + [0] * (reqs - len(seqs))
        bt = _table(gen, reqs) % blocks
        cm = decode_batch(lens, seqs, bt, num_tokens=size)
        if device_lens is not None:  # adaptive verification: the device's own offsets
            dev = device_lens + [0] * (reqs - len(device_lens))
            cm.query_start_loc = torch.zeros(reqs + 1, dtype=torch.int32)
            cm.query_start_loc[1:] = torch.cumsum(torch.tensor(dev), 0)
            lens = dev
        decode = builder.build(0, cm).decode
        return lens, seqs, bt, cm, decode, last_step_choice(builder, cm)

    decided = {}
    for reqs in (1, 2, 5, 16, 21, 22):
        size = reqs * run
        graph_reqs = min(size, max_seqs) if mixed else reqs
        cap_lens = _dummy_lens(size, graph_reqs)
        *_, cm, cap, cap_choice = build(cap_lens, cap_lens, size, graph_reqs)
        if mixed:
            cm.max_query_len = size  # a mixed graph's capture promises any query length
        assert cap_choice.stock == "flattened"
        left = not cap_choice.plan
        assert left == (size < bound) and not (left and cap_choice.varlen)
        if not mixed:  # a uniform 3-token capture: its own rule (18 or 64 rows) decides
            assert cap_choice.varlen == (size >= bound)
        decided[size] = left
        real = [reqs, max(1, reqs // 2)]
        replays = []
        for r in real:
            seqs = [run + int(x) for x in torch.randint(1, 2000, (r,), generator=gen)]
            replays.append(([run] * r, seqs, None))
        if mixed:
            var = torch.randint(1, next_n + 1, (reqs,), generator=gen).tolist()
            while sum(var) > size:
                var.pop()
            seqs = [n + int(x) for n, x in zip(var, torch.randint(1, 2000, (len(var),),
                                                                   generator=gen))]
            device = None
            if adaptive and len(var) > 1 and max(var) > 1:
                # the host spreads the step's tokens evenly; the device trimmed them
                host = _dummy_lens(sum(var), len(var))
                var, device = host, var
            replays.append((var, seqs, device))
        for lens, seqs, device in replays:
            lens, seqs, bt, cm, dec, choice = build(lens, seqs, size, graph_reqs, device)
            assert (choice.plan, choice.stock) == (cap_choice.plan, "flattened")
            if left:
                assert not choice.varlen and dec.indices is None
                assert varlen_ids_of(dec.schedule_metadata) is None
            # The captured call: the capture's tensors, refreshed in place.
            for name in ("seq_lens", "block_table", "schedule_metadata"):
                a, b = getattr(dec, name), getattr(cap, name)
                assert a.data_ptr() == b.data_ptr() and a.shape == b.shape, name
            req = torch.tensor([b for b, n in enumerate(lens) for _ in range(n)])
            ctx = torch.zeros(size, dtype=torch.int32)
            ctx[:len(req)] = torch.tensor([s - n + j + 1 for n, s in zip(lens, seqs)
                                           for j in range(n)], dtype=torch.int32)
            assert torch.equal(cap.seq_lens[:, 0], ctx)
            q = torch.randn((size, 1, heads, dim), generator=gen).to(torch.float8_e4m3fn)
            w = torch.randn((size, heads), generator=gen)
            max_len = int(ctx.max()) + 3
            got = sai.fp8_fp4_paged_mqa_logits(
                (q, None), kv, w, cap.seq_lens, cap.block_table, cap.schedule_metadata,
                max_model_len=max_len, indices=cap.indices)
            rows_bt = torch.zeros((size, WIDTH), dtype=torch.int32)
            rows_bt[:len(req)] = bt[req]
            want = paged_mqa_logits_ref(q, kv, w, ctx.unsqueeze(-1), rows_bt, max_len)
            valid = valid_mask(ctx.unsqueeze(-1), max_len)
            torch.testing.assert_close(got.float()[valid], want[valid], rtol=1e-5, atol=1e-5)
    assert decided == {s: s < bound for s in decided} and set(decided.values()) == {True, False}
    # Plain steps: no rule has 1-token runs, so where a graph's key fixes the run
    # length they are left to stock at any size; else the next_n bound holds.
    for reqs in (5, max_seqs):
        *_, choice = build([1] * reqs, [40 + b for b in range(reqs)], reqs, reqs)
        assert choice.plan == (mixed and reqs >= 64)
    # stock's uniform branch ran (never under adaptive verification), DeepGEMM was called
    assert (uniform_kernel.launches > 0) is not adaptive
    assert dg.calls_to("fp8_fp4_paged_mqa_logits")


@pytest.mark.parametrize("next_n", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_native_steps_no_rule_can_take_skip_the_classification(monkeypatch, next_n, seed):
    """A native builder (SM90, next_n 2 or 4, the measured table: no rule
    against stock's native kernel): an all-decode uniform step without graph
    padding of a length the native kernel takes is left to stock before any
    classification, and classifying it would find the same (stock native, not
    varlen) and count it the same; graph-padded, variable, mixed and
    flattened (3-token) steps are classified.  With a rule against native
    (every step wins) nothing is skipped."""
    import random

    _hopper(monkeypatch)
    _stub_stock_triton(monkeypatch)
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=next_n, max_seqs=64)
    assert not builder.use_flattening
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seen = set()
    for _ in range(30):
        kind = rng.choice(["uniform", "plain", "padded", "variable", "mixed", "three"])
        n = rng.randint(1, 12)
        run = {"plain": 1, "three": 3}.get(kind, next_n)
        if kind == "three" and next_n == 2:
            run = 2
        lens = ([run] * n if kind in ("uniform", "plain", "three") else
                [run] * n + [0] * rng.randint(1, 3) if kind == "padded" else
                [rng.randint(1, next_n) for _ in range(n)] if kind == "variable" else
                [next_n] * n + [rng.randint(next_n + 1, 40)])
        seqs = [x + rng.randint(1, 3000) if x else 0 for x in lens]
        size = len(lens) * max(lens) if kind == "padded" else sum(lens)
        cm = decode_batch(lens, seqs, _table(gen, len(lens)), num_tokens=size)
        stats.reset()
        builder.build(0, cm)
        got = stats.snapshot()
        choice = ours.classify_step(builder, cm)
        skipped = builder.last_step_stock_only
        one = lens[0]
        want_skip = (kind != "mixed" and 0 not in lens and lens == [one] * len(lens)
                     and (one == 1 or ix._supports_native_decode(one)))
        assert skipped == want_skip, (kind, lens)
        seen.add(skipped)
        if skipped:
            assert choice.stock == "native" and not choice.varlen and not choice.plan
            assert got["steps"]["stock_native"] == 1 and sum(got["steps"].values()) == 1
            assert sum(got["variable"].values()) == sum(got["mixed"].values()) == 0
        else:
            assert builder.last_step_choice == choice
    assert seen == {True, False}
    _all_win(monkeypatch)
    for lens in ([next_n] * 5, [1] * 7):
        cm = decode_batch(lens, [x + 100 for x in lens], _table(gen, len(lens)))
        builder.build(0, cm)
        assert not builder.last_step_stock_only and builder.last_step_choice.varlen


def test_planned_prepare_reads_its_arguments_by_name_or_position(monkeypatch):
    """During a planned build the wrapped ``_prepare_decode_tensors`` hands the
    planner the same arguments whether stock passes them by name (as 0.33.0
    does) or by position."""
    seen = []
    monkeypatch.setattr(ours, "_plan_varlen_rows",
                        lambda builder, stock, *args: seen.append(args) or "planned")

    def original(self, seq_lens, block_table, decode_lens, decode_lens_cpu, query_start_loc,
                 num_decodes, num_decode_tokens, use_native, next_n, max_decode_len):
        return "stock"

    wrapped = ours.wrap_prepare_decode_tensors(original)
    builder = type("B", (), {"_varlen_planning": True})()
    values = dict(seq_lens="s", block_table="b", decode_lens="d", decode_lens_cpu="dc",
                  query_start_loc="q", num_decodes=3, num_decode_tokens=9, use_native=False,
                  next_n=3, max_decode_len=3)
    assert wrapped(builder, **values) == "planned"
    assert wrapped(builder, *values.values()) == "planned"
    assert seen[0] == seen[1] == ("s", "b", "dc", 3, 9, 3)
    builder._varlen_planning = False
    assert wrapped(builder, **values) == "stock"


def test_a_common_rewritten_in_place_is_decided_afresh(monkeypatch):
    """vLLM's drafter rewrites its common metadata object between builds: the
    stock-only answer a build keeps for its own second question never carries
    into the next build of the same object.  A 4-request 3-token step (12 rows,
    under the CUDA kernel's 18-row rule) is left to stock; the same object
    rewritten to 8 such requests (24 rows) is planned and takes varlen."""
    from vllm_dsa_varlen.ops import launcher

    _hopper(monkeypatch)
    fake_uniform_decode_kernel(monkeypatch)
    monkeypatch.setattr(launcher, "graph_kernel", lambda *a, **k: "cuda_sm90")
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=3, adaptive=False, max_seqs=64)
    assert builder.use_flattening and builder.varlen_graph_kernel == "cuda_sm90"
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    seqs = [3 + int(x) for x in torch.randint(1, 4000, (8,), generator=gen)]
    cm = decode_batch([3] * 4, seqs[:4], _table(gen, 4), num_tokens=12)
    builder.build(0, cm)
    assert builder.last_step_stock_only
    cm.__dict__.update(decode_batch([3] * 8, seqs, _table(gen, 8), num_tokens=24).__dict__)
    decode = builder.build(0, cm).decode
    choice = last_step_choice(builder, cm)
    assert not builder.last_step_stock_only and choice.varlen and choice.stock == "flattened"
    assert varlen_ids_of(decode.schedule_metadata) is not None


def test_varlen_rows_beyond_the_decode_buffers_fail_clearly(monkeypatch):
    """The decode buffers the varlen rows are planned into hold a fixed number
    of rows (vLLM 0.34 sizes the block-table buffer ``min(max_num_seqs *
    next_n, max_num_batched_tokens)``, 0.33 ``max_num_batched_tokens``): a
    step planned past them raises a RuntimeError naming the buffers before any
    is written, and a step that fits is planned as before."""
    _hopper(monkeypatch)
    _all_win(monkeypatch)
    patches.apply_all(line=LINE)
    builder = make_builder(monkeypatch, next_n=3, max_seqs=5, max_tokens=15)
    buffers = (builder.decode_indices_buffer, builder.decode_seq_lens_buffer,
               builder.expanded_block_table_buffer, builder.decode_lens_buffer)
    assert builder.varlen_max_rows == min(b.shape[0] for b in buffers) == 15
    gen = torch.Generator().manual_seed(4)
    for b in buffers:
        b.fill_(-3)
    too_many = [3] * 6  # 18 rows
    cm = decode_batch(too_many, [200 + 7 * i for i in range(6)], _table(gen, 6))
    with pytest.raises(RuntimeError, match="18 rows .* 15-row decode buffers"):
        builder.build(0, cm)
    assert all(bool((b == -3).all()) for b in buffers)
    md = builder.build(0, decode_batch([3] * 5, [200 + 7 * i for i in range(5)], _table(gen, 5)))
    assert builder.last_step_choice.varlen and md.decode.indices.tolist() == [
        r // 3 for r in range(15)]
