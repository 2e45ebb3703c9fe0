"""Varlen decode is the same function as the padded decode (property-based).

Random decode batches — plain, uniform, variable, graph-padded (seq_len 0
requests and padding rows), V4-compressed, random non-monotonic block tables —
go through the project's plan into the varlen layout and, separately, into
stock vLLM's padded ``[B, next_n]`` layout.  On every valid position the
logits agree, and the top-k sets of every real row are identical.  The kernel
side is the torch reference (1000 examples) and the Triton kernel under the
interpreter (fewer, slower examples).  Derandomized: hypothesis prints the
failing example and its seed.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask
from vllm_dsa_varlen.ops.launcher import varlen_paged_mqa_logits
from vllm_dsa_varlen.bench.workloads import make_decode_step

PAGE = 64


@st.composite
def decode_batches(draw, max_reqs=6, max_tokens=4, max_len=400):
    next_n = draw(st.integers(1, max_tokens))
    num_reqs = draw(st.integers(1, max_reqs))
    kind = draw(st.sampled_from(["plain", "uniform", "variable"]))
    if kind == "plain":
        next_n = 1
    lens = [next_n if kind != "variable" else draw(st.integers(1, next_n)) for _ in range(num_reqs)]
    seq_lens = []
    for n in lens:
        if draw(st.integers(0, 9)) == 0:
            seq_lens.append(0)  # graph-padding request
        else:
            seq_lens.append(draw(st.integers(n, max_len)))
    return dict(
        decode_lens=lens, seq_lens=seq_lens, next_n=max(lens),
        padding_rows=draw(st.integers(0, 2)),
        compress_ratio=draw(st.sampled_from([1, 1, 4])),
        seed=draw(st.integers(0, 2**31 - 1)),
        extra=draw(st.integers(0, 64)),
    )


def build(batch, heads):
    return make_decode_step(batch["decode_lens"], batch["seq_lens"], heads=heads,
                            padding_rows=batch["padding_rows"], seed=batch["seed"],
                            compress_ratio=batch["compress_ratio"],
                            max_context_len=max(batch["seq_lens"]) // batch["compress_ratio"]
                            + batch["extra"] + 1)


def padded_logits(step, next_n):
    pad = step.padded(next_n)
    logits = paged_mqa_logits_ref(pad["q"], step.kv_cache, pad["weights"], pad["context_lens"],
                                  pad["block_table"], step.max_context_len)
    return logits[pad["row_of"]], pad


def assert_same_topk(varlen, padded, mask, k=8):
    for r in range(mask.shape[0]):
        n = int(mask[r].sum())
        if n == 0:
            continue
        kk = min(k, n)
        a = torch.where(mask[r], varlen[r], float("-inf")).topk(kk)
        b = torch.where(mask[r], padded[r], float("-inf")).topk(kk)
        # Equal sets; where the k-th and (k+1)-th logits tie, either choice is right.
        if set(a.indices.tolist()) != set(b.indices.tolist()):
            assert torch.equal(a.values.sort().values, b.values.sort().values), f"row {r}"


SETTINGS = dict(derandomize=True, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=1000, **SETTINGS)
@given(batch=decode_batches())
def test_varlen_reference_equals_padded_path(batch):
    step = build(batch, heads=4)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    varlen = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                                  step.max_context_len, indices=rows.indices)
    tokens = sum(batch["decode_lens"])
    padded, pad = padded_logits(step, batch["next_n"])
    mask = valid_mask(ctx, step.max_context_len, rows.indices)[:tokens]
    # Every real row sees exactly what its padded slot sees.
    pad_mask = valid_mask(pad["context_lens"], step.max_context_len)[pad["row_of"]]
    assert torch.equal(mask, pad_mask)
    torch.testing.assert_close(varlen[:tokens][mask], padded[mask], rtol=1e-5, atol=1e-5)
    assert_same_topk(varlen[:tokens], padded, mask)
    # Padding rows see nothing.
    assert not valid_mask(ctx, step.max_context_len, rows.indices)[tokens:].any()


@pytest.mark.interpreter
@settings(max_examples=500, **SETTINGS)
@given(batch=decode_batches(max_reqs=4, max_len=300))
def test_triton_varlen_equals_padded_path(batch):
    step = build(batch, heads=32)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    out = torch.full((rows.num_rows, step.max_context_len), float("nan"))
    varlen_paged_mqa_logits(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                            rows.indices, step.max_context_len, out=out,
                            max_run_len=batch["next_n"])
    tokens = sum(batch["decode_lens"])
    padded, _ = padded_logits(step, batch["next_n"])
    mask = valid_mask(ctx, step.max_context_len, rows.indices)
    assert torch.isfinite(out[mask]).all()
    assert torch.isnan(out[~mask]).all()
    m = mask[:tokens]
    torch.testing.assert_close(out[:tokens][m], padded[m], rtol=1e-4, atol=1e-4)
    assert_same_topk(out[:tokens], padded, m)
