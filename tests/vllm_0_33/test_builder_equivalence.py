"""Through vLLM 0.33.0's own builder, varlen decode is the path upstream would take (property-based).

Random decode batches -- plain, uniform, variable, graph-padded (requests of 0
tokens with ``seq_len`` 0, extra padding tokens), DeepSeek V4 compression
(``tokens_per_state`` 4), DCP-local lengths (world 2, rank 0 or 1,
interleave 1), random non-monotonic block tables -- for builders of every
kind stock 0.33.0 has on SM90: native (next_n 2 or 4: uniform steps native,
non-uniform ones split), flattened (next_n 3 or 5, or adaptive
verification).  They go through the REAL ``DeepseekV32IndexerMetadataBuilder.build()``
with the 0.33 patches applied, SM90 faked, DeepGEMM replaced by
``HopperDeepGemm`` (``tests/vllm033_stubs.py``: native next_n 1, 2 or 4,
schedule sized per next_n, run ids refused), and the per-step policy either
the real measured table or a table where varlen wins everywhere (so every
kind of step is also driven through varlen).

The decode metadata then goes through the indexer op's decode branch as
0.33.0's ``sparse_attn_indexer`` runs it (reshape, or pack when
``requires_padding``; the kernel call through the patched module global,
``indices=decode.indices``): a varlen step reaches the Triton varlen kernel
(stood in for by the torch reference, the kernel itself is checked in
``tests/ops/``), a stock step reaches the DeepGEMM double with stock's layout.
The result must equal the path upstream takes, computed without the plugin:
request ``b``'s token ``j`` sees ``L(seq_len_b - n_b + j + 1)`` tokens
(``L``: ``// 4`` for V4, or the DCP rank's local share) through request
``b``'s block-table row (native, flattened and the prefill split all compute
this function).  On valid positions the logits agree and every real row's
top-k set is identical; padding rows see nothing.  Where stock's own path runs
on the CPU (native steps), a builder with ``DSA_VARLEN=off`` gives the
same logits as well.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm.model_executor.layers.sparse_attn_indexer as sai  # noqa: E402
import vllm.v1.attention.backends.mla.indexer as ix  # noqa: E402
from builder_checks import DCP_WORLD, SETTINGS, local_len, reference_kernel, row_len  # noqa: E402
from test_equivalence import assert_same_topk  # noqa: E402
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens  # noqa: E402
from vllm033_stubs import (  # noqa: E402
    LINE,
    HopperDeepGemm,
    decode_batch,
    fake_gpu,
    fake_uniform_decode_kernel,
    last_step_choice,
    make_builder,
)

import vllm_dsa_varlen.ops.launcher as launcher  # noqa: E402
from vllm_dsa_varlen import config, patches, policy  # noqa: E402
from vllm_dsa_varlen.ops.reference import (  # noqa: E402
    paged_mqa_logits_ref,
    quantize_kv_fp8,
    valid_mask,
)
from vllm_dsa_varlen.plan import run_starts  # noqa: E402
from vllm_dsa_varlen.varlen_ids import varlen_ids_of  # noqa: E402

HEADS, DIM, PAGE = 4, 32, 64
WIDTH = 64
NUM_BLOCKS = 48
MAX_SEQ = 600
LAYOUTS = ("dense", "v4", "dcp_rank0", "dcp_rank1")
# Builder kinds: (next_n, adaptive verification).
CONFIGS = ((2, False), (4, False), (3, False), (5, False), (2, True), (4, True))
ALL_WIN = (policy.Rule("native"), policy.Rule("flattened"), policy.Rule("split"))


class _World:
    def __init__(self):
        gen = torch.Generator().manual_seed(4321)
        self.kv_cache = quantize_kv_fp8(torch.randn((NUM_BLOCKS, PAGE, DIM), generator=gen))
        self.builders: dict[tuple, object] = {}

    def fake(self, mp: pytest.MonkeyPatch, layout: str) -> HopperDeepGemm:
        fake_gpu(mp, (9, 0))
        dg = HopperDeepGemm().install(mp)
        fake_uniform_decode_kernel(mp)  # stock's own flattening of the steps left to it
        if layout.startswith("dcp"):
            mp.setattr(ix, "get_dcp_group",
                       lambda: SimpleNamespace(rank_in_group=int(layout[-1]),
                                               world_size=DCP_WORLD))
        if layout == "v4":
            def slot_mapping(num_tokens, slot_mapping, query_start_loc, seq_lens, block_table,
                             num_states, compress_ratio, out=None, **_):
                out.fill_(-1)  # DeepSeek V4's compressed slot mapping (Triton; unused here)
                return out[:num_tokens]

            mp.setattr(ix, "get_compressed_slot_mapping", slot_mapping)
        return dg

    def builder(self, mp: pytest.MonkeyPatch, next_n: int, adaptive: bool, layout: str,
                mode: str = "auto"):
        key = (next_n, adaptive, layout, mode)
        if key not in self.builders:
            mp.setenv(config.MODE_ENV, mode)
            ratio = 4 if layout == "v4" else 1
            b = make_builder(mp, next_n=next_n, width=WIDTH, page=PAGE, compress_ratio=ratio,
                             adaptive=adaptive, dcp=DCP_WORLD if layout.startswith("dcp") else 1)
            mp.delenv(config.MODE_ENV)
            assert b.use_varlen is (mode == "auto"), b.decode_path
            assert b.use_flattening is (next_n in (3, 5) or adaptive)
            assert b.compress_ratio == ratio
            self.builders[key] = b
        return self.builders[key]


@pytest.fixture(scope="module")
def world():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(config.MODE_ENV, raising=False)
        mp.delenv(config.BACKEND_ENV, raising=False)
        patches.undo_all()
        patches.apply_all(line=LINE)
        try:
            yield _World()
        finally:
            patches.undo_all()


@st.composite
def builder_batches(draw):
    next_n, adaptive = draw(st.sampled_from(CONFIGS))
    layout = draw(st.sampled_from(LAYOUTS))
    kind = draw(st.sampled_from(["variable", "uniform", "plain", "variable"]))
    num_reqs = draw(st.integers(1, 6))
    if kind == "plain":
        lens = [1] * num_reqs
    elif kind == "uniform":
        lens = [draw(st.integers(2, next_n))] * num_reqs
    else:
        lens = [draw(st.integers(1, next_n)) for _ in range(num_reqs)]
    ratio = 4 if layout == "v4" else 1
    seqs = [draw(st.integers(n, MAX_SEQ * ratio)) for n in lens]
    pad_reqs = draw(st.integers(0, 2))
    # Graph padding as vLLM makes it: a native builder (UNIFORM_BATCH) is only
    # replayed from uniform-decode graphs, padded with 0-token requests and
    # ``next_n`` tokens each (one each on one-token steps); a flattening builder
    # (ALWAYS) may also be replayed with extra tokens past the last request.
    flattening = next_n in (3, 5) or adaptive
    if flattening and max(lens) > 1:
        pad_tokens = draw(st.integers(0, 3))
    else:
        pad_tokens = pad_reqs * max(lens)
    return dict(next_n=next_n, adaptive=adaptive, layout=layout, kind=kind,
                lens=lens + [0] * pad_reqs, seqs=seqs + [0] * pad_reqs, pad_tokens=pad_tokens,
                table=draw(st.sampled_from(["measured", "all_win"])),
                seed=draw(st.integers(0, 2**31 - 1)), extra=draw(st.integers(0, 64)))


def _expected_logits(q_tok, w_tok, kv_cache, block_table, lens, seqs, layout, max_len):
    """Upstream's function for every real token (row order), through the
    reference on a right-aligned ``[B, P]`` layout (``P`` = longest request)."""
    num_reqs, slots = len(lens), max(lens)
    q = torch.zeros((num_reqs, slots, HEADS, DIM), dtype=torch.float32)
    w = torch.zeros((num_reqs * slots, HEADS), dtype=torch.float32)
    ctx = torch.zeros((num_reqs, slots), dtype=torch.int32)
    row_of, r = [], 0
    for b, (n, s) in enumerate(zip(lens, seqs)):
        for slot in range(slots):
            ctx[b, slot] = row_len(s, slots, slot, layout)
        for j in range(n):
            slot = slots - n + j
            q[b, slot] = q_tok[r].float()
            w[b * slots + slot] = w_tok[r]
            row_of.append(b * slots + slot)
            r += 1
    logits = paged_mqa_logits_ref(q.to(torch.float8_e4m3fn), kv_cache, w, ctx, block_table,
                                  max_len)
    mask = valid_mask(ctx, max_len)
    index = torch.tensor(row_of, dtype=torch.long)
    return logits[index], mask[index]


def decode_branch(md, q_tok, w_tok, kv_cache, max_len):
    """0.33.0's ``sparse_attn_indexer`` decode branch up to the logits (shapes as
    it makes them: reshape to ``[B, next_n, H, D]``, or pack each request's
    tokens from slot 0 when ``requires_padding``), the kernel call through the
    patched module global.  Returns ``(logits of each real token in token
    order, context lengths [rows, 1] or [B, next_n], row of each token)``."""
    dec = md.decode
    tokens = md.num_decode_tokens
    decode_lens = dec.decode_lens
    padded = dec.requires_padding or tokens % decode_lens.shape[0] != 0
    q = torch.zeros((tokens, HEADS, DIM), dtype=torch.float8_e4m3fn)
    w = torch.zeros((tokens, HEADS), dtype=torch.float32)
    q[: q_tok.shape[0]] = q_tok
    w[: w_tok.shape[0]] = w_tok
    if padded:
        lens = decode_lens.tolist()
        width = max(lens)
        qp = torch.zeros((len(lens), width, HEADS, DIM), dtype=torch.float8_e4m3fn)
        wp = torch.zeros((len(lens) * width, HEADS), dtype=torch.float32)
        token_row, t = [], 0
        for b, n in enumerate(lens):
            for j in range(n):
                qp[b, j] = q[t]
                wp[b * width + j] = w[t]
                token_row.append(b * width + j)
                t += 1
    else:
        qp = q.reshape(decode_lens.shape[0], -1, HEADS, DIM)
        wp = w
        token_row = list(range(tokens))
    batch, next_n = qp.shape[:2]
    seq_lens = dec.seq_lens[:batch]
    logits = sai.fp8_fp4_paged_mqa_logits((qp, None), kv_cache, wp[: batch * next_n], seq_lens,
                                          dec.block_table, dec.schedule_metadata,
                                          max_model_len=max_len, indices=dec.indices)
    return logits.float(), seq_lens, token_row


@settings(max_examples=1000, **SETTINGS)
@given(batch=builder_batches())
def test_builder_varlen_equals_upstream_path(world, batch):
    layout, lens, seqs = batch["layout"], batch["lens"], batch["seqs"]
    tokens = sum(lens)
    with pytest.MonkeyPatch.context() as mp:
        dg = world.fake(mp, layout)
        mp.setattr(launcher, "varlen_paged_mqa_logits", reference_kernel)
        if batch["table"] == "all_win":
            mp.setattr(policy, "MEASURED", ALL_WIN)
        builder = world.builder(mp, batch["next_n"], batch["adaptive"], layout)
        gen = torch.Generator().manual_seed(batch["seed"])
        block_table = torch.randint(0, NUM_BLOCKS, (len(lens), WIDTH), generator=gen,
                                    dtype=torch.int32)
        cm = decode_batch(lens, seqs, block_table, num_tokens=tokens + batch["pad_tokens"])
        if layout.startswith("dcp"):
            cm.dcp_local_seq_lens = get_dcp_local_seq_lens(cm.seq_lens, DCP_WORLD,
                                                           int(layout[-1]), 1)
        md = builder.build(0, cm)
        choice = last_step_choice(builder, cm)
        dec = md.decode
        assert md.num_decodes == len(lens) and md.num_prefills == 0, "a decode was split off"
        assert choice.varlen is policy.varlen_wins(
            choice.facts, choice.stock, ALL_WIN if batch["table"] == "all_win" else policy.MEASURED)

        # A flattened step with fewer tokens than any rule's rows: stock's own build.
        stock_built = choice.stock == "flattened" and not choice.plan
        bound = policy.min_varlen_rows("flattened", kernel=builder.varlen_graph_kernel,
                                       max_run=batch["next_n"])
        assert stock_built == (choice.stock == "flattened"
                               and (bound is None or cm.num_actual_tokens < bound))
        if stock_built:
            # Stock's flattened rows: one per token (padding rows see nothing).
            num_rows = tokens + batch["pad_tokens"]
            assert dec.seq_lens.shape == (num_rows, 1) and not dec.requires_padding
            assert dec.seq_lens.data_ptr() == builder.decode_seq_lens_buffer.data_ptr()
            assert dec.block_table.data_ptr() == builder.expanded_block_table_buffer.data_ptr()
            assert not dec.seq_lens[tokens:].any()
        if choice.plan:
            # Varlen layout (also stock's flattened one): one row per token.
            num_rows = tokens + batch["pad_tokens"]
            assert dec.seq_lens.shape == (num_rows, 1) and not dec.requires_padding
            req = torch.tensor([b for b, n in enumerate(lens) for _ in range(n)],
                               dtype=torch.long)
            want_ctx = [row_len(s, n, j, layout) for n, s in zip(lens, seqs) for j in range(n)]
            assert dec.seq_lens[:tokens, 0].tolist() == want_ctx
            assert not dec.seq_lens[tokens:].any()
            assert torch.equal(dec.block_table[:tokens], block_table[req])
            ids = builder.decode_indices_buffer[:num_rows]
            want_starts = torch.ones(num_rows, dtype=torch.bool)
            if tokens > 1:
                want_starts[1:tokens] = req[1:] != req[:-1]
            assert torch.equal(run_starts(ids), want_starts)
            if layout.startswith("dcp") and max(lens) > 1:
                want_global = [max(0, s - n + j + 1) for n, s in zip(lens, seqs)
                               for j in range(n)]
                assert dec.global_seq_lens[:tokens].tolist() == want_global
        tag = varlen_ids_of(dec.schedule_metadata)
        if choice.varlen:
            assert tag is not None and tag.ids is dec.indices and tag.backend == "own"
            assert dec.indices.data_ptr() == builder.decode_indices_buffer.data_ptr()
        else:
            assert tag is None and dec.indices is None

        q_tok = torch.randn((tokens, HEADS, DIM), generator=gen).to(torch.float8_e4m3fn)
        w_tok = torch.randn((tokens, HEADS), generator=gen) / HEADS ** 0.5
        max_len = max([row_len(s, n, n - 1, layout) for n, s in zip(lens, seqs)] + [1])
        max_len += batch["extra"]
        n_calls = len(dg.calls_to("fp8_fp4_paged_mqa_logits"))
        logits, ctx, token_row = decode_branch(md, q_tok, w_tok, world.kv_cache, max_len)
        dg_calls = len(dg.calls_to("fp8_fp4_paged_mqa_logits")) - n_calls
        assert dg_calls == (0 if choice.varlen else 1)  # varlen never reaches DeepGEMM
        index = torch.tensor(token_row[:tokens], dtype=torch.long)
        ids = dec.indices if choice.varlen else None
        mask_all = valid_mask(ctx, max_len, ids)

    got, mask = logits[index], mask_all[index]
    want, want_mask = _expected_logits(q_tok, w_tok, world.kv_cache, block_table, lens, seqs,
                                       layout, max_len)
    assert torch.equal(mask, want_mask)  # every real token sees what upstream's row sees
    if choice.plan or stock_built:
        assert not mask_all[tokens:].any()  # padding rows see nothing
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert_same_topk(got, want, mask)


NATIVE_CASES = [(next_n, lens) for next_n in (2, 4)
                for lens in ([next_n] * 3, [1, 1, 1, 1], [next_n, next_n, 0], [2, 2])]


@pytest.mark.parametrize("next_n,lens", NATIVE_CASES)
@pytest.mark.parametrize("table", ["measured", "all_win"])
def test_varlen_equals_stock_run_on_native_steps(world, next_n, lens, table):
    """Where stock 0.33.0's own path runs on the CPU (native steps through the
    DeepGEMM double), the plugin's logits equal it exactly on valid positions,
    whether the policy keeps native or switches the step to varlen."""
    seqs = [0 if n == 0 else 300 + 37 * b for b, n in enumerate(lens)]
    gen = torch.Generator().manual_seed(next_n * 100 + len(lens))
    block_table = torch.randint(0, NUM_BLOCKS, (len(lens), WIDTH), generator=gen,
                                dtype=torch.int32)
    q_tok = torch.randn((sum(lens), HEADS, DIM), generator=gen).to(torch.float8_e4m3fn)
    w_tok = torch.randn((sum(lens), HEADS), generator=gen) / HEADS ** 0.5
    max_len = 400
    out = {}
    for mode in ("off", "auto"):
        with pytest.MonkeyPatch.context() as mp:
            world.fake(mp, "dense")
            mp.setattr(launcher, "varlen_paged_mqa_logits", reference_kernel)
            if table == "all_win":
                mp.setattr(policy, "MEASURED", ALL_WIN)
            builder = world.builder(mp, next_n, False, "dense", mode)
            cm = decode_batch(lens, seqs, block_table)
            md = builder.build(0, cm)
            if mode == "auto":
                choice = last_step_choice(builder, cm)
                assert choice.stock == "native"
                assert choice.varlen is (table == "all_win")
            logits, ctx, token_row = decode_branch(md, q_tok, w_tok, world.kv_cache, max_len)
            index = torch.tensor(token_row, dtype=torch.long)
            ids = md.decode.indices
            out[mode] = (logits[index], valid_mask(ctx, max_len, ids)[index])
    (stock, stock_mask), (got, mask) = out["off"], out["auto"]
    assert torch.equal(mask, stock_mask)
    torch.testing.assert_close(got[mask], stock[mask], rtol=1e-5, atol=1e-5)
    assert_same_topk(got, stock, mask)
