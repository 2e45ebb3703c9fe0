"""The decode-row plan against a plain per-request loop."""

import dataclasses

import pytest
import torch

from vllm_dsa_varlen.plan import (DecodeRowBuffers, make_ramp, plan_decode_rows, run_ends,
                                   run_starts)


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


def _garbage_buffers(rows, width, *, ramp_len):
    """Buffers full of stale values (what a previous step left behind)."""
    bufs = DecodeRowBuffers.allocate(rows, width, "cpu")
    bufs.indices.fill_(-7)
    bufs.context_lens.fill_(-7)
    bufs.block_table.fill_(-7)
    bufs.ramp = None if ramp_len is None else make_ramp(ramp_len, "cpu")
    return bufs


@pytest.mark.parametrize("ramp_len", [None, 2, 64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", range(6))
def test_planned_into_stale_buffers_matches_loop(seed, dtype, ramp_len):
    """Every output row is rewritten (stale buffers, a block-table buffer wider
    than the table, ramps absent or too short, int64 inputs)."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = int(torch.randint(1, 9, (1,), generator=gen))
    decode_lens, seq_lens, block_table = random_batch(gen, num_reqs, 5, width=5)
    uniform_len = int(torch.randint(1, 5, (1,), generator=gen))
    for uniform in (False, True):
        lens = [uniform_len] * num_reqs if uniform else decode_lens
        tokens = sum(lens)
        padding = 0 if uniform else int(torch.randint(0, 4, (1,), generator=gen))
        qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=dtype) + 3
        # arange exactly as long as the rows: the variable path's r + 1 has no view
        bufs = _garbage_buffers(tokens + padding, 8, ramp_len=ramp_len)
        # the caller's own query-length differences, on every other seed
        given = None if uniform or seed % 2 else torch.tensor(lens, dtype=dtype)
        rows = plan_decode_rows(torch.tensor(seq_lens, dtype=dtype), qsl, block_table.to(dtype),
                                num_rows=tokens + padding, num_tokens=tokens,
                                uniform_len=uniform_len if uniform else None, out=bufs,
                                decode_lens=given)
        ids, ctx, bt = expected_rows(lens, seq_lens, block_table, padding)
        assert rows.context_lens.tolist() == ctx + [0] * padding
        assert rows.block_table.tolist() == bt + [[0] * 5] * padding
        got_ids = rows.indices.tolist()
        assert got_ids[:tokens] == ids
        pad_ids = got_ids[tokens:]
        assert len(set(pad_ids)) == padding and not set(pad_ids) & set(ids)
        assert (bufs.block_table[:, 5:] == -7).all()  # columns past the table untouched


def test_ramp_holds_the_offsets_of_every_shorter_request():
    ramp = make_ramp(6, "cpu")
    for n in range(1, 7):
        assert ramp[6 - n:].tolist() == [j - n + 1 for j in range(n)]
    assert DecodeRowBuffers.allocate(5, 2, "cpu").ramp.tolist() == [-4, -3, -2, -1, 0]


def test_indices_ready_leaves_the_ids_as_they_are():
    """``indices_ready``: a uniform plan writes everything but the ids (a
    caller that did not write them gets its own stale values back)."""
    bufs = DecodeRowBuffers.allocate(8, 3, "cpu")
    seq_lens = torch.tensor([10, 20], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 6], dtype=torch.int32)
    bt = torch.arange(6, dtype=torch.int32).view(2, 3)
    bufs.indices.fill_(5)
    rows = plan_decode_rows(seq_lens, qsl, bt, num_rows=6, uniform_len=3, out=bufs,
                            indices_ready=True)
    assert rows.indices.tolist() == [5] * 6
    assert rows.context_lens.tolist() == [8, 9, 10, 18, 19, 20]
    rows = plan_decode_rows(seq_lens, qsl, bt, num_rows=6, uniform_len=3, out=bufs)
    assert rows.indices.tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="indices_ready"):
        plan_decode_rows(seq_lens, qsl, bt, num_rows=6, out=bufs, indices_ready=True)
    with pytest.raises(ValueError, match="indices_ready"):
        plan_decode_rows(seq_lens, qsl, bt, num_rows=6, uniform_len=3, indices_ready=True)


def test_decode_lens_of_another_shape_are_refused():
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="decode_lens"):
        plan_decode_rows(torch.tensor([10, 20], dtype=torch.int32), qsl,
                         torch.zeros((2, 3), dtype=torch.int32), num_rows=4,
                         decode_lens=torch.tensor([2, 2, 0], dtype=torch.int32))


@pytest.mark.parametrize("short", ["indices", "context_lens", "block_table", "arange"])
def test_out_buffers_too_short_are_named(short):
    """Every buffer of ``out`` is checked against the rows to plan (vLLM 0.34
    sizes the block-table buffer for decode tokens only, shorter than the
    others): the short one is named, and nothing is written."""
    gen = torch.Generator().manual_seed(3)
    lens = [3, 1, 2]
    rows = sum(lens)
    qsl = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    seq_lens = torch.randint(10, 90, (3,), generator=gen, dtype=torch.int32)
    bt = torch.randint(0, 50, (3, 4), generator=gen, dtype=torch.int32)
    out = DecodeRowBuffers.allocate(rows + 2, 4, "cpu")
    out = dataclasses.replace(out, **{short: getattr(out, short)[: rows - 1]})
    for name in ("indices", "context_lens", "block_table"):
        getattr(out, name).fill_(-7)
    with pytest.raises(ValueError, match=f"out.{short}: holds {rows - 1} rows, {rows} needed"):
        plan_decode_rows(seq_lens, qsl, bt, num_rows=rows, num_tokens=rows, out=out)
    assert all(bool((getattr(out, n) == -7).all()) for n in ("indices", "context_lens", "block_table"))
    # one row fewer to plan fits every buffer
    plan_decode_rows(seq_lens[:2], qsl[:3], bt[:2], num_rows=rows - 2, num_tokens=4,
                     out=dataclasses.replace(out, **{short: getattr(out, short)}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("uniform_len", [None, 1, 3, 4])
def test_no_host_sync_when_planning_on_the_device(uniform_len, no_host_sync):
    """Planning a step's rows into the builder's buffers (uniform: broadcast
    views; variable: sized from the host's token count) never waits on the
    device: a build's host work keeps running ahead of the GPU."""
    gen = torch.Generator().manual_seed(17 + (uniform_len or 0))
    num_reqs = 24
    if uniform_len is None:
        decode_lens, seq_lens, block_table = random_batch(gen, num_reqs, 4)
    else:
        decode_lens = [uniform_len] * num_reqs
        seq_lens = torch.randint(uniform_len, 300, (num_reqs,), generator=gen).tolist()
        block_table = torch.randint(0, 1000, (num_reqs, 6), generator=gen, dtype=torch.int32)
    tokens = sum(decode_lens)
    qsl = torch.tensor([0] + list(torch.tensor(decode_lens).cumsum(0)), dtype=torch.int32)
    out = DecodeRowBuffers.allocate(tokens + 8, 6, "cuda")
    args = (torch.tensor(seq_lens, device="cuda"), qsl.cuda(), block_table.cuda())
    kwargs = (dict(num_rows=tokens, uniform_len=uniform_len) if uniform_len else
              dict(num_rows=tokens + 3, num_tokens=tokens))
    plan_decode_rows(*args, out=out, **kwargs)
    torch.cuda.synchronize()
    with no_host_sync():
        rows = plan_decode_rows(*args, out=out, **kwargs)
    ids, ctx, bt = expected_rows(decode_lens, seq_lens, block_table, 0)
    assert rows.indices[:tokens].cpu().tolist() == ids
    assert rows.context_lens[:tokens].cpu().tolist() == ctx
    assert rows.block_table[:tokens].cpu().tolist() == bt
