"""Through vLLM 0.27.1's own builder, varlen decode is the padded decode (property-based).

Random decode batches -- plain, uniform, variable, graph-padded (requests of 0
tokens with ``seq_len`` 0, extra padding tokens), DeepSeek V4 compression
(``compress_ratio`` 4), DCP-local lengths (world 2, rank 0 or 1, interleave
1), random non-monotonic block tables -- go through the REAL
``DeepseekV32IndexerMetadataBuilder.build()`` with the plugin's patches
applied, for both varlen backends:

* ``deepgemm``: SM100 faked, DeepGEMM replaced by ``tests/fake_deep_gemm.py``
  in its default generation (vLLM 0.27.1's vendored DeepGEMM: ``clean_logits``
  and ``indices``, fp32 logits, so the comparison can be exact); the double
  enforces the varlen contract (ids int32 ``[R]`` aligned and contiguous,
  ``next_n == 1``, and a schedule made by the scheduler for the same context
  lengths *and ids* as the kernel call).
* ``triton``: SM90 faked, backend forced (every step varlen); the kernel call
  is routed by the plugin's dispatch to ``varlen_paged_mqa_logits``, stood in
  for here by the torch reference (the Triton kernel itself is checked against
  the padded path in ``tests/test_equivalence.py``).
* ``hopper``: SM90 faked with the double as Hopper's DeepGEMM, backend left on
  ``auto``, ``next_n > 2``: the builder compares each step with stock's
  flattened DeepGEMM call (``per_step == "flattened"``) and the kernel call
  goes to the Triton stand-in or to DeepGEMM *without* ids on the same rows.
  The rule table is replaced here by one that picks varlen whenever the
  longest request has 3 or more tokens, so both kernels run on these small
  batches (the measured table needs 64 requests).

The decode metadata is fed to the plugin's kernel-call replacement exactly as
vLLM's ``sparse_attn_indexer`` feeds it (queries ``[R, 1, H, D]``, per-row
context lengths, block-table rows, schedule tensor carrying the ids).  The
result must equal the padded path with stock semantics, computed without the
plugin: request ``b``'s token ``j`` sees ``L(seq_len_b - n_b + j + 1)``
tokens (``L``: ``// compress_ratio``, or the DCP rank's local share) through
request ``b``'s block-table row.  On valid positions the logits agree and the
top-k sets of every real row are identical (ties as in
``tests/test_equivalence.py``); padding rows see nothing.

DCP is driven through the real ``build()``: the config stub gets
``decode_context_parallel_size = 2`` and the indexer module's
``get_dcp_group`` answers the rank, as a DCP worker's would.

Speed: one builder per (backend, next_n, layout), built once for the module
and reused across examples (stable buffers, as vLLM reuses them); the fake
GPU is switched per example (a few attribute swaps).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

import vllm.v1.attention.backends.mla.indexer as ix  # noqa: E402
import vllm_stubs  # noqa: E402
from fake_deep_gemm import FakeDeepGemm  # noqa: E402
from builder_checks import DCP_WORLD, SETTINGS, local_len, reference_kernel, row_len  # noqa: E402
from test_equivalence import assert_same_topk  # noqa: E402
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens  # noqa: E402
from vllm_stubs import (  # noqa: E402
    NUM_SMS,
    decode_batch,
    fake_gpu,
    fake_uniform_decode_kernel,
    make_builder,
)

import vllm_dsa_varlen.ops.launcher as launcher  # noqa: E402
from vllm_dsa_varlen import config, patches, policy  # noqa: E402
from vllm_dsa_varlen.vllm_0_27.model_executor.layers import sparse_attn_indexer as dispatch  # noqa: E402
from vllm_dsa_varlen.ops.reference import (  # noqa: E402
    paged_mqa_logits_ref,
    quantize_kv_fp8,
    valid_mask,
)
from vllm_dsa_varlen.plan import run_starts  # noqa: E402
from vllm_dsa_varlen.varlen_ids import varlen_ids_of  # noqa: E402

HEADS, DIM, PAGE = 4, 32, 64
WIDTH = 64            # block-table width (the builder's and the batch's)
NUM_BLOCKS = 48       # KV pool pages; block tables draw from it at random
MAX_SEQ = 600         # uncompressed KV length cap (V4: x4)
LAYOUTS = ("dense", "v4", "dcp_rank0", "dcp_rank1")
# Varlen whenever the longest request has >= 3 tokens (see the module docstring).
HOPPER_TABLE = (policy.Rule("flattened", min_run=3, note="test table"),)


# --------------------------------------------------------------------------- set-up

class _World:
    """The module's builders (one per backend, next_n, layout) and KV pool."""

    def __init__(self):
        gen = torch.Generator().manual_seed(1234)
        self.kv_cache = quantize_kv_fp8(torch.randn((NUM_BLOCKS, PAGE, DIM), generator=gen))
        self.builders: dict[tuple[str, int, str], object] = {}

    def fake(self, mp: pytest.MonkeyPatch, backend: str, layout: str) -> FakeDeepGemm:
        """Fake the platform of ``backend`` (and this layout's DCP rank) in ``mp``."""
        if backend == "deepgemm":
            fake_gpu(mp, (10, 0))
            dg = FakeDeepGemm("2.6", 100, num_sms=NUM_SMS).install(mp)
        else:
            fake_gpu(mp, (9, 0))
            dg = FakeDeepGemm("2.6", 90, num_sms=NUM_SMS).install(mp)
        if backend == "hopper":
            mp.setattr(policy, "MEASURED", HOPPER_TABLE)
            fake_uniform_decode_kernel(mp)  # stock's own build of the steps left to it
        if layout.startswith("dcp"):
            mp.setattr(ix, "get_dcp_group",
                       lambda: SimpleNamespace(rank_in_group=int(layout[-1]),
                                               world_size=DCP_WORLD))
        if layout == "v4":
            # DeepSeek V4's compressed slot mapping is a Triton kernel (unused here).
            def slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size,
                             compress_ratio, out=None):
                out.fill_(-1)
                return out[:num_tokens]

            mp.setattr(ix, "get_compressed_slot_mapping", slot_mapping)
        return dg

    def builder(self, mp: pytest.MonkeyPatch, backend: str, next_n: int, layout: str):
        key = (backend, next_n, layout)
        if key not in self.builders:
            mp.setenv(config.BACKEND_ENV, "auto" if backend == "hopper" else backend)
            if layout.startswith("dcp"):
                stock_config = vllm_stubs.make_config

                def make_config(**kwargs):
                    cfg = stock_config(**kwargs)
                    cfg.parallel_config.decode_context_parallel_size = DCP_WORLD
                    return cfg

                mp.setattr(vllm_stubs, "make_config", make_config)
            ratio = 4 if layout == "v4" else 1
            b = make_builder(mp, next_n=next_n, width=WIDTH, block_size=PAGE * ratio,
                             compress_ratio=ratio)
            assert b.use_varlen, b.decode_path
            assert b.varlen_backend == ("own" if backend == "hopper" else backend)
            assert b.decode_path.per_step == ("flattened" if backend == "hopper" else None)
            assert b.dcp_world_size == (DCP_WORLD if layout.startswith("dcp") else 1)
            assert b.compress_ratio == ratio
            self.builders[key] = b
        return self.builders[key]


@pytest.fixture(scope="module")
def world():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(config.MODE_ENV, raising=False)
        mp.delenv(config.BACKEND_ENV, raising=False)
        patches.undo_all()
        patches.apply_all()
        try:
            yield _World()
        finally:
            patches.undo_all()


# --------------------------------------------------------------------------- batches

@st.composite
def builder_batches(draw):
    backend = draw(st.sampled_from(["deepgemm", "own", "hopper"]))
    layout = draw(st.sampled_from(LAYOUTS))
    # DeepGEMM varlen serves any next_n on SM100; Triton needs next_n >= 2; on
    # Hopper stock flattens (and is compared per step) from next_n = 3.
    next_n = draw(st.integers({"deepgemm": 1, "own": 2, "hopper": 3}[backend], 4))
    kind = draw(st.sampled_from(["variable", "uniform", "plain", "variable"]))
    num_reqs = draw(st.integers(1, 6))
    if kind == "plain":
        lens = [1] * num_reqs
    elif kind == "uniform":
        lens = [draw(st.integers(min(2, next_n), next_n))] * num_reqs
    else:
        lens = [draw(st.integers(1, next_n)) for _ in range(num_reqs)]
    ratio = 4 if layout == "v4" else 1
    seqs = [draw(st.integers(n, MAX_SEQ * ratio)) for n in lens]
    pad_reqs = draw(st.integers(0, 2))
    pad_tokens = draw(st.integers(0, 3))
    return dict(backend=backend, layout=layout, next_n=next_n, kind=kind,
                lens=lens + [0] * pad_reqs, seqs=seqs + [0] * pad_reqs, pad_tokens=pad_tokens,
                seed=draw(st.integers(0, 2**31 - 1)), extra=draw(st.integers(0, 64)))


# --------------------------------------------------------------------------- paths

def _expected_rows(lens, seqs, layout):
    """(request, own context length) of every real varlen row, in row order."""
    return [(b, row_len(s, n, j, layout)) for b, (n, s) in enumerate(zip(lens, seqs))
            for j in range(n)]


def _padded_logits(q_rows, w_rows, kv_cache, block_table, lens, seqs, layout, max_len):
    """Stock's padded ``[B, P]`` layout, right-aligned (``P`` = longest request),
    through the reference; returns logits of each real token, in row order."""
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
            q[b, slot] = q_rows[r, 0].float()
            w[b * slots + slot] = w_rows[r]
            row_of.append(b * slots + slot)
            r += 1
    logits = paged_mqa_logits_ref(q.to(torch.float8_e4m3fn), kv_cache, w, ctx, block_table,
                                  max_len)
    mask = valid_mask(ctx, max_len)
    index = torch.tensor(row_of, dtype=torch.long)
    return logits[index], mask[index]


def _kernel_call(md, q, w, kv_cache, max_len):
    """The indexer op's decode-branch call, through the plugin's replacement."""
    dec = md.decode
    return dispatch.fp8_fp4_paged_mqa_logits(
        (q, None), kv_cache, w, dec.seq_lens, dec.block_table, dec.schedule_metadata,
        max_model_len=max_len, clean_logits=False)


@settings(max_examples=1000, **SETTINGS)
@given(batch=builder_batches())
def test_builder_varlen_equals_padded_path(world, batch):
    backend, layout = batch["backend"], batch["layout"]
    lens, seqs = batch["lens"], batch["seqs"]
    with pytest.MonkeyPatch.context() as mp:
        dg = world.fake(mp, backend, layout)
        mp.setattr(launcher, "varlen_paged_mqa_logits", reference_kernel)
        builder = world.builder(mp, backend, batch["next_n"], layout)
        gen = torch.Generator().manual_seed(batch["seed"])
        block_table = torch.randint(0, NUM_BLOCKS, (len(lens), WIDTH), generator=gen,
                                    dtype=torch.int32)
        cm = decode_batch(lens, seqs, block_table, num_tokens=sum(lens) + batch["pad_tokens"])
        if layout.startswith("dcp"):
            cm.dcp_local_seq_lens = get_dcp_local_seq_lens(cm.seq_lens, DCP_WORLD,
                                                           int(layout[-1]))
        md = builder.build(0, cm)

        dec = md.decode
        assert md.num_decodes == len(lens) and md.num_prefills == 0
        num_rows = dec.seq_lens.shape[0]
        tokens = sum(lens)
        # Every varlen step, plain ones included, is one token per row: R =
        # the step's (padded) token count.
        assert num_rows == tokens + batch["pad_tokens"] and dec.seq_lens.shape == (num_rows, 1)
        assert dec.requires_padding is False
        assert torch.equal(dec.decode_lens, torch.ones(num_rows, dtype=torch.int32))
        ids = dec.indices
        tag = varlen_ids_of(dec.schedule_metadata)
        kernel = backend if backend != "hopper" else (
            "own" if policy.varlen_wins(policy.StepFacts.from_decode_lens(
                lens, rows=num_rows, max_context=max(seqs)), "flattened") else "stock")
        # A multi-token step with fewer padded tokens than the test table's
        # longest-run bound (3), one row per token in stock's rows: stock's own build.
        stock_built = (backend == "hopper" and 1 < max(lens) and num_rows < 3
                       and len(lens) * max(lens) >= num_rows)
        if kernel == "stock":  # stock's id-less DeepGEMM call on the same rows
            assert tag is None and dec.schedule_metadata is builder.scheduler_metadata_buffer
        else:
            assert tag is not None and tag.ids is ids and tag.backend == kernel
        assert (ids is None) == stock_built
        if stock_built:
            ids = torch.arange(num_rows, dtype=torch.int32)  # no runs: one row each
            ids[:tokens] = torch.repeat_interleave(torch.arange(len(lens)),
                                                   torch.tensor(lens)).to(torch.int32)
        assert ids.dtype == torch.int32 and ids.shape == (num_rows,) and ids.data_ptr() % 8 == 0

        # The metadata against the independent expectation: per-row lengths,
        # block-table rows, runs = requests (padding rows alone).
        expected = _expected_rows(lens, seqs, layout)
        want_ctx = torch.tensor([c for _, c in expected] + [0] * (num_rows - tokens),
                                dtype=torch.int32)
        assert torch.equal(dec.seq_lens[:, 0], want_ctx)
        req = torch.tensor([b for b, _ in expected], dtype=torch.long)
        assert torch.equal(dec.block_table[:tokens], block_table[req])
        want_starts = torch.ones(num_rows, dtype=torch.bool)
        if tokens > 1:
            want_starts[1:tokens] = req[1:] != req[:-1]
        assert torch.equal(run_starts(ids), want_starts)
        if layout.startswith("dcp"):
            # DCP top-k merge reads the global per-row lengths (stock expansion).
            want_global = [max(0, s - n + j + 1) for n, s in zip(lens, seqs) for j in range(n)]
            if max(lens) == 1:
                want_global = seqs
            glob = dec.global_seq_lens.reshape(-1)[:len(want_global)]
            assert glob.tolist() == want_global

        # The kernel call as the indexer op makes it, then the padded path.
        q = torch.randn((num_rows, 1, HEADS, DIM), generator=gen).to(torch.float8_e4m3fn)
        w = torch.randn((num_rows, HEADS), generator=gen) / HEADS ** 0.5
        max_len = max(1, int(want_ctx.max()) if num_rows else 1) + batch["extra"]
        n_calls = len(dg.calls_to("fp8_fp4_paged_mqa_logits"))
        logits = _kernel_call(md, q, w, world.kv_cache, max_len)
        call = dg.calls_to("fp8_fp4_paged_mqa_logits")[n_calls:]
        if kernel == "deepgemm":
            assert len(call) == 1 and call[0].kwargs["indices"] is ids
        elif kernel == "stock":
            assert len(call) == 1 and "indices" not in call[0].kwargs
            assert call[0].bound["q"][0].shape[:2] == (num_rows, 1)
        else:
            assert call == []

    mask = valid_mask(dec.seq_lens, max_len, ids)
    padded, pad_mask = _padded_logits(q, w, world.kv_cache, block_table, lens, seqs, layout,
                                      max_len)
    assert torch.equal(mask[:tokens], pad_mask)  # every real row sees what its slot sees
    assert not mask[tokens:].any()  # padding rows see nothing
    real, m = logits[:tokens], mask[:tokens]
    torch.testing.assert_close(real[m], padded[m], rtol=1e-5, atol=1e-5)
    assert_same_topk(real, padded, m)


def test_dcp_localisation_matches_vllm():
    """The independent DCP expectation above is vLLM's own localisation."""
    lengths = torch.arange(0, 300, dtype=torch.int32)
    for rank in range(DCP_WORLD):
        got = get_dcp_local_seq_lens(lengths, DCP_WORLD, rank, 1)
        assert got.tolist() == [local_len(n, DCP_WORLD, rank) for n in lengths.tolist()]
