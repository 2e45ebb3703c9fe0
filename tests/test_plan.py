"""The decode-row plan against a plain per-request loop."""

import pytest
import torch

from vllm_dsa_varlen.plan import DecodeRowBuffers, plan_decode_rows, run_ends, run_starts


def expected_rows(decode_lens, seq_lens, block_table, padding_rows):
    ids, ctx, bt = [], [], []
    for b, (n, s) in enumerate(zip(decode_lens, seq_lens)):
        for j in range(n):
            ids.append(b)
            ctx.append(max(0, s - n + j + 1))
            bt.append(block_table[b].tolist())
    return ids, ctx, bt


def random_batch(gen, num_reqs, max_tokens, width=6):
    decode_lens = torch.randint(0, max_tokens + 1, (num_reqs,), generator=gen).tolist()
    seq_lens = [0 if torch.rand(1, generator=gen).item() < 0.2 else
                int(torch.randint(n, 300, (1,), generator=gen)) for n in decode_lens]
    block_table = torch.randint(0, 1000, (num_reqs, width), generator=gen, dtype=torch.int32)
    return decode_lens, seq_lens, block_table


@pytest.mark.parametrize("seed", range(20))
def test_variable_batch_matches_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    decode_lens, seq_lens, block_table = random_batch(gen, int(torch.randint(1, 9, (1,), generator=gen)), 5)
    padding = int(torch.randint(0, 4, (1,), generator=gen))
    qsl = torch.tensor([0] + torch.tensor(decode_lens).cumsum(0).tolist(), dtype=torch.int32)
    tokens = sum(decode_lens)
    rows = plan_decode_rows(torch.tensor(seq_lens, dtype=torch.int32), qsl, block_table,
                            num_rows=tokens + padding, num_tokens=tokens)
    ids, ctx, bt = expected_rows(decode_lens, seq_lens, block_table, padding)
    assert rows.num_rows == tokens + padding
    assert rows.indices[:tokens].tolist() == ids
    assert rows.context_lens[:tokens].tolist() == ctx
    assert rows.block_table[:tokens].tolist() == bt
    # Padding rows: context 0, zero block table, and ids of their own.
    assert rows.context_lens[tokens:].tolist() == [0] * padding
    assert not rows.block_table[tokens:].any()
    all_ids = rows.indices.tolist()
    for r in range(tokens, tokens + padding):
        assert all_ids[r] != all_ids[r - 1] if r > 0 else True
        assert all_ids.count(all_ids[r]) == 1


@pytest.mark.parametrize("uniform_len", [1, 2, 3, 4])
def test_uniform_batch_matches_loop_and_variable_path(uniform_len):
    gen = torch.Generator().manual_seed(uniform_len)
    num_reqs = 7
    seq_lens = torch.randint(uniform_len, 500, (num_reqs,), generator=gen, dtype=torch.int32)
    seq_lens[3] = 0  # a graph-padding request
    block_table = torch.randint(0, 1000, (num_reqs, 5), generator=gen, dtype=torch.int32)
    qsl = torch.arange(0, (num_reqs + 1) * uniform_len, uniform_len, dtype=torch.int32) + 11
    rows = plan_decode_rows(seq_lens, qsl, block_table, num_rows=num_reqs * uniform_len,
                            uniform_len=uniform_len)
    ids, ctx, bt = expected_rows([uniform_len] * num_reqs, seq_lens.tolist(), block_table, 0)
    assert rows.indices.tolist() == ids
    assert rows.context_lens.tolist() == ctx
    assert rows.block_table.tolist() == bt
    var = plan_decode_rows(seq_lens, qsl, block_table, num_rows=num_reqs * uniform_len)
    assert torch.equal(var.indices, rows.indices)
    assert torch.equal(var.context_lens, rows.context_lens)


def test_writes_into_buffers_with_stable_addresses():
    bufs = DecodeRowBuffers.allocate(64, 8, "cpu")
    assert bufs.indices.data_ptr() % 8 == 0
    seq_lens = torch.tensor([10, 20], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    bt = torch.arange(12, dtype=torch.int32).view(2, 6)
    rows = plan_decode_rows(seq_lens, qsl, bt, num_rows=4, uniform_len=2, out=bufs)
    assert rows.indices.data_ptr() == bufs.indices.data_ptr()
    assert rows.context_lens.data_ptr() == bufs.context_lens.data_ptr()
    assert rows.block_table.data_ptr() == bufs.block_table.data_ptr()
    assert rows.block_table.tolist() == [bt[0].tolist()] * 2 + [bt[1].tolist()] * 2


def test_run_starts():
    ids = torch.tensor([0, 0, 1, 2, 2, 2, 0], dtype=torch.int32)
    assert run_starts(ids).tolist() == [True, False, True, True, False, False, True]
    assert run_ends(ids).tolist() == [False, True, True, False, False, True, True]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_rows=5, uniform_len=2), "num_rows"),
    (dict(num_rows=4, uniform_len=0), "uniform_len"),
    (dict(num_rows=4, num_tokens=5), "num_tokens"),
    (dict(num_rows=-1), "num_rows"),
])
def test_bad_arguments_are_named(kwargs, match):
    seq_lens = torch.tensor([10, 20], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    bt = torch.zeros((2, 3), dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        plan_decode_rows(seq_lens, qsl, bt, **kwargs)


def test_bad_shapes_are_named():
    bt = torch.zeros((2, 3), dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        plan_decode_rows(torch.zeros((2, 1), dtype=torch.int32), torch.zeros(3, dtype=torch.int32), bt, num_rows=2)
    with pytest.raises(ValueError, match="query_start_loc"):
        plan_decode_rows(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), bt, num_rows=2)
    with pytest.raises(ValueError, match="block_table"):
        plan_decode_rows(torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), bt, num_rows=2)


def test_more_requests_than_rows():
    """Zero-token (graph-padding) requests: more requests than rows."""
    seq_lens = torch.tensor([0, 0, 50, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 0, 0, 2, 2], dtype=torch.int32)
    bt = torch.arange(8, dtype=torch.int32).view(4, 2)
    rows = plan_decode_rows(seq_lens, qsl, bt, num_rows=2)
    assert rows.indices.tolist() == [2, 2]
    assert rows.context_lens.tolist() == [49, 50]
    assert rows.block_table.tolist() == [[4, 5], [4, 5]]
