"""workloads.DecodeStep.stock_split: stock vLLM 0.33's uniform-prefix split of a
variable decode step, with the tail's KV gathered out of the paged cache.  On
fresh random steps, the gathered buffers scored per token must reproduce the
paged reference on every valid position of the tail rows, and the prefix must
be the step's own rows in the native ``[B, next_n]`` layout."""

import itertools

import pytest
import torch

from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref
from vllm_dsa_varlen.bench.workloads import make_decode_step, random_decode_step, random_step_rows


def _gathered_logits(split, kv_cache):
    """Scores of each tail token against its span of the gathered buffers
    (the prefill path's non-paged MQA logits, compressed: column 0 = the
    span's first token)."""
    dim = split["tail_q"].shape[-1]
    byte_rows = kv_cache.view(torch.uint8).reshape(-1, dim)
    words = kv_cache.view(torch.uint8).reshape(-1).view(torch.float32)
    k = byte_rows[split["value_rows"]].view(torch.float8_e4m3fn).float()
    scale = words[split["scale_words"]]
    q = split["tail_q"].float()
    out = torch.full((q.shape[0], split["max_seqlen_k"]), float("nan"))
    for i in range(q.shape[0]):
        lo, hi = int(split["ks"][i]), int(split["ke"][i])
        s = torch.relu(q[i] @ k[lo:hi].T)                      # [H, span]
        out[i, : hi - lo] = (s * split["tail_weights"][i][:, None]).sum(0) * scale[lo:hi]
    return out


def _check_tail(step):
    split = step.stock_split()
    if split is None:  # a uniform draw: nothing to split
        assert int(step.decode_lens.min()) == int(step.decode_lens.max())
        return
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                               step.max_context_len, indices=rows.indices)
    got = _gathered_logits(split, step.kv_cache)
    r0 = split["decode_rows"]
    for i in range(got.shape[0]):
        n = int(ctx[r0 + i].clamp_min(0))
        assert int(split["ke"][i] - split["ks"][i]) == n
        torch.testing.assert_close(got[i, :n], ref[r0 + i, :n].float(), rtol=1e-4, atol=1e-4)
    qsl = step.query_start_loc
    assert got.shape[0] == int(qsl[-1]) - r0  # the tail's own tokens, no padding rows


@pytest.mark.parametrize("seed", range(4))
def test_tail_gather_reproduces_the_paged_logits(seed):
    _check_tail(random_decode_step(6, 4, 200 + 37 * seed, variable=True, heads=32,
                                   seed=100 + seed))


@pytest.mark.parametrize("seed", range(3))
def test_tail_gather_with_padding_rows_and_a_compressed_cache(seed):
    """Graph-padding rows after the tokens, and DeepSeek V4's compressed cache
    (KV length = sequence length / 4)."""
    _check_tail(make_decode_step([2, 1, 3, 2], [300, 170, 410, 90], heads=32, padding_rows=3,
                                 seed=200 + seed))
    _check_tail(make_decode_step([1, 3, 2], [800, 650, 900], heads=32, compress_ratio=4,
                                 seed=300 + seed))


def test_prefix_is_the_uniform_leading_requests_in_native_layout():
    lens = [2, 2, 2, 1, 2, 4]
    step = make_decode_step(lens, [90, 130, 70, 40, 200, 66], heads=32, seed=5)
    split = step.stock_split()
    assert split["decode_reqs"] == 3 and split["decode_rows"] == 6 and split["next_n"] == 2
    rows = step.rows
    assert torch.equal(split["q"].reshape(6, 32, 128).view(torch.uint8),
                       step.q[:6, 0].view(torch.uint8))
    assert torch.equal(split["context_lens"].reshape(-1), rows.context_lens[:6])
    assert torch.equal(split["block_table"], step.block_table[:3])
    assert split["tail_q"].shape[0] == rows.num_rows - 6
    assert split["max_seqlen_k"] == 200


def test_uniform_step_is_not_split():
    step = make_decode_step([3, 3, 3], [50, 80, 120], heads=32, seed=1)
    assert step.stock_split() is None
    # 0-token (graph-padding) requests do not break uniformity, as in stock
    assert make_decode_step([2, 2, 0], [50, 80, 0], heads=32, seed=2).stock_split() is None


@pytest.mark.parametrize("variable", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_random_step_rows_are_the_random_steps_rows(variable, seed):
    """The rows alone (what a schedule needs) are those of the full random step
    with the same draw: ids, per-row context lengths, the padding rows."""
    rows, seqs, lens, width = random_step_rows(9, 4, 3000, variable=variable, seed=seed,
                                               padding_rows=5, device="cpu")
    step = random_decode_step(9, 4, 3000, variable=variable, seed=seed, padding_rows=5)
    assert torch.equal(lens.to(step.decode_lens.dtype), step.decode_lens.cpu())
    assert torch.equal(seqs.to(step.seq_lens.dtype), step.seq_lens.cpu())
    assert rows.num_rows == int(lens.sum()) + 5
    assert torch.equal(rows.indices, step.rows.indices)
    assert torch.equal(rows.context_lens, step.rows.context_lens)
    assert width * 64 >= int(seqs.max())


@pytest.mark.parametrize("seed", [0, 3])
def test_in_order_pages_are_each_requests_consecutive_run_of_the_pool(seed):
    """pages="in-order": request b's pages are the pool's next ones after
    request b - 1's (a fresh engine's prefill); queries, weights and pool are
    the random order's, and so are the logits once the pool's pages are moved
    to where the random table points."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 5, (6,), generator=gen).tolist()
    seqs = torch.randint(70, 700, (6,), generator=gen).tolist()
    a = make_decode_step(lens, seqs, seed=seed)
    b = make_decode_step(lens, seqs, seed=seed, pages="in-order")
    assert torch.equal(a.q.float(), b.q.float()) and torch.equal(a.weights, b.weights)
    assert torch.equal(a.kv_cache, b.kv_cache)
    first = 0
    for r, n in enumerate(((torch.tensor(seqs) + 63) // 64).tolist()):
        assert b.block_table[r, :n].tolist() == list(range(first, first + n))
        first += n
    # the random order's tables hold every page once too, scattered
    used = torch.cat([a.block_table[r, :n] for r, n in
                      enumerate(((torch.tensor(seqs) + 63) // 64).tolist())])
    assert sorted(used.tolist()) == sorted(set(used.tolist()))
    # the reference over the in-order table equals the reference over the
    # random one with the pool's pages moved to the random positions
    pool = torch.empty_like(a.kv_cache)
    for r, n in enumerate(((torch.tensor(seqs) + 63) // 64).tolist()):
        pool[a.block_table[r, :n].long()] = b.kv_cache[b.block_table[r, :n].long()]
    ctx = a.rows.context_lens.view(-1, 1)
    want = paged_mqa_logits_ref(b.q, b.kv_cache, b.weights, ctx, b.rows.block_table,
                                b.max_context_len, indices=b.rows.indices)
    got = paged_mqa_logits_ref(a.q, pool, a.weights, ctx, a.rows.block_table,
                               a.max_context_len, indices=a.rows.indices)
    torch.testing.assert_close(got, want)


def test_pages_names_the_argument():
    with pytest.raises(ValueError, match="pages"):
        make_decode_step([1], [100], pages="shuffled")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("reqs,tokens,share", [(32, 4, 0.1), (8, 4, 0.25), (48, 3, 0.5),
                                               (5, 2, 1.0), (64, 8, 0.01)])
def test_a_step_with_cut_requests_has_that_many_short_ones(seed, reqs, tokens, share):
    """``short``: every request has ``tokens`` but round(share * requests) of
    them (at least one), which have 1..tokens - 1; the rows follow the counts."""
    step = random_decode_step(reqs, tokens, 2000, short=share, seed=seed)
    lens = step.decode_lens.cpu().tolist()
    cut = [n for n in lens if n != tokens]
    assert len(cut) == max(1, round(share * reqs)), lens
    assert all(1 <= n < tokens for n in cut), lens
    assert step.rows.num_rows == sum(lens)
    ids = step.rows.indices.tolist()
    runs = [len(list(g)) for _, g in itertools.groupby(ids)]
    assert runs == lens


@pytest.mark.parametrize("tokens,share,name", [(1, 0.5, "max_tokens"), (4, 0.0, "short"),
                                               (4, 1.5, "short")])
def test_cut_requests_name_the_bad_argument(tokens, share, name):
    with pytest.raises(ValueError, match=name):
        random_decode_step(8, tokens, 2000, short=share)
