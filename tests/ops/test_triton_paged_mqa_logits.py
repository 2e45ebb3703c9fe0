"""Triton varlen paged MQA logits against the reference.

On the CPU the kernel runs in Triton's interpreter at small shapes; tests
marked ``gpu`` run at serving sizes on a CUDA GPU with fp8 and skip elsewhere.
"""

import pytest
import torch

from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask
from vllm_dsa_varlen.ops.launcher import varlen_paged_mqa_logits
from vllm_dsa_varlen.plan import DecodeRowBuffers, plan_decode_rows
from vllm_dsa_varlen.bench.workloads import make_decode_step, random_decode_step

from logits_checks import StaticStep

POISON = float("nan")


def run_kernel(step, **kwargs):
    rows = step.rows
    width = step.max_context_len + 37
    out = torch.full((rows.num_rows, width), POISON, device=step.q.device)
    got = varlen_paged_mqa_logits(step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1),
                                  rows.block_table, rows.indices, step.max_context_len, out=out, **kwargs)
    assert got.data_ptr() == out.data_ptr()
    return out


def check_against_reference(step, out, rel_tol):
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                               step.max_context_len, indices=rows.indices)
    mask = valid_mask(ctx, step.max_context_len, rows.indices)
    got = out[:, : step.max_context_len]
    assert torch.isfinite(got[mask]).all(), "a valid position was not written"
    # Nothing is written past a row's valid columns, nor past max_context_len.
    assert torch.isnan(got[~mask]).all(), "a position past the row's context was written"
    assert torch.isnan(out[:, step.max_context_len:]).all()
    if mask.any():
        err = (got[mask] - ref[mask]).norm() / ref[mask].norm().clamp_min(1e-30)
        assert err < rel_tol, f"relative error {err:.2e}"
    return ref, mask


CPU_CASES = {
    # name: (decode_lens, seq_lens, padding_rows, heads)
    "runs_1_to_8": ([1, 2, 3, 4, 5, 6, 7, 8], [65, 130, 3, 64, 200, 129, 70, 191], 0, 32),
    "single_row_runs": ([1] * 6, [1, 63, 64, 65, 127, 250], 0, 32),
    "graph_padding": ([2, 2, 2, 2], [90, 0, 150, 0], 3, 32),
    "heads_64": ([3, 1, 2], [100, 7, 180], 1, 64),
    "all_padding": ([1, 1], [0, 0], 2, 32),
}


KNOBS = [dict(rows_per_dot=2, tiles_per_split=1), dict(rows_per_dot=4, tiles_per_split=3),
         dict(rows_per_dot=1), dict(per_row=True, rows_per_dot=2, tiles_per_split=2),
         dict(tile_pages=2, tiles_per_split=1), dict(tile_pages=2, per_row=True, rows_per_dot=4),
         dict(groups=1, rows_per_dot=2, tiles_per_split=2), dict(groups=2, rows_per_dot=1)]


@pytest.mark.parametrize("name", list(CPU_CASES))
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_small_shapes_match_reference(name, knobs, device):
    decode_lens, seq_lens, padding_rows, heads = CPU_CASES[name]
    step = make_decode_step(decode_lens, seq_lens, heads=heads, padding_rows=padding_rows,
                            max_context_len=max(seq_lens) + 11, seed=len(name), device=device)
    out = run_kernel(step, **knobs)
    check_against_reference(step, out, rel_tol=1e-5)


def test_runs_longer_than_a_dot_and_unaligned_max_len(device):
    step = make_decode_step([8, 5], [333, 140], heads=32, max_context_len=333, seed=5, device=device)
    for knobs in (dict(rows_per_dot=2, tiles_per_split=2), dict(per_row=True, rows_per_dot=2),
                  dict(tile_pages=2, rows_per_dot=4)):
        out = run_kernel(step, **knobs)
        check_against_reference(step, out, rel_tol=1e-5)


def test_block_table_rows_after_the_first_of_a_run_are_not_read(device):
    step = make_decode_step([3, 2], [150, 100], heads=32, seed=9, device=device)
    ref_out = run_kernel(step)
    # Corrupt every row but each run's first: DeepGEMM semantics read the first.
    step.rows.block_table[1:3] = -12345
    step.rows.block_table[4] = -12345
    out = run_kernel(step)
    mask = valid_mask(step.rows.context_lens, step.max_context_len, step.rows.indices)
    assert torch.equal(out[:, : step.max_context_len][mask], ref_out[:, : step.max_context_len][mask])


def test_default_output_shape_and_alignment(device):
    step = make_decode_step([2, 1], [70, 20], heads=32, max_context_len=77, device=device)
    rows = step.rows
    out = varlen_paged_mqa_logits(step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1),
                                  rows.block_table, rows.indices, step.max_context_len)
    assert out.shape == (3, 77) and out.dtype == torch.float32
    assert out.stride(0) % 128 == 0


# ---------------------------------------------------------------- bad input

def _args(step):
    rows = step.rows
    return dict(q=step.q, kv_cache=step.kv_cache, weights=step.weights,
                context_lens=rows.context_lens.view(-1, 1), block_table=rows.block_table,
                indices=rows.indices, max_context_len=step.max_context_len)


BAD_INPUTS = {
    "q dtype": (lambda a: a.update(q=a["q"].float()), "q: expected dtype"),
    "q shape": (lambda a: a.update(q=a["q"].view(-1, 2, *a["q"].shape[2:])), "q: expected a \\[R, 1, H, D\\]"),
    "head count": (lambda a: a.update(q=a["q"][:, :, :16].contiguous(), weights=a["weights"][:, :16].contiguous()), "head count"),
    "head dim": (lambda a: a.update(q=a["q"][..., :64].contiguous()), "head dim"),
    "weights dtype": (lambda a: a.update(weights=a["weights"].half()), "weights"),
    "weights shape": (lambda a: a.update(weights=a["weights"][:-1]), "weights"),
    "kv dtype": (lambda a: a.update(kv_cache=a["kv_cache"].view(torch.int8)), "kv_cache"),
    "kv width": (lambda a: a.update(kv_cache=a["kv_cache"][..., :-4]), "kv_cache"),
    "kv page": (lambda a: a.update(kv_cache=a["kv_cache"].view(a["kv_cache"].shape[0] * 2, 32, 1, -1)), "page size"),
    "context dtype": (lambda a: a.update(context_lens=a["context_lens"].long()), "context_lens"),
    "context shape": (lambda a: a.update(context_lens=a["context_lens"][:-1]), "context_lens"),
    "block table dtype": (lambda a: a.update(block_table=a["block_table"].long()), "block_table"),
    "block table rows": (lambda a: a.update(block_table=a["block_table"][:-1]), "block_table"),
    "ids dtype": (lambda a: a.update(indices=a["indices"].long()), "indices: expected dtype torch.int32"),
    "ids length": (lambda a: a.update(indices=a["indices"][:-1]), "indices: expected shape"),
    "ids 2-D": (lambda a: a.update(indices=a["indices"].view(-1, 1)), "indices: expected shape"),
    "ids not contiguous": (lambda a: a.update(indices=torch.stack([a["indices"], a["indices"]], 1)[:, 0]), "indices: expected a contiguous"),
    "ids misaligned": (lambda a: a.update(indices=torch.cat([a["indices"][:1], a["indices"]])[1:]), "indices: expected an 8-byte aligned"),
    "ids missing": (lambda a: a.update(indices=None), "indices"),
    "max len zero": (lambda a: a.update(max_context_len=0), "max_context_len"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_the_argument(case):
    step = make_decode_step([2, 2], [100, 70], heads=32)
    args = _args(step)
    mutate, match = BAD_INPUTS[case]
    mutate(args)
    with pytest.raises(ValueError, match=match):
        varlen_paged_mqa_logits(**args)


def test_contents_check_catches_context_beyond_the_block_table():
    step = make_decode_step([2], [100], heads=32)
    args = _args(step)
    args["max_context_len"] = args["block_table"].shape[1] * 64 + 64  # wider logits are fine
    args["context_lens"] = args["context_lens"] + 64
    with pytest.raises(ValueError, match="beyond the block table"):
        varlen_paged_mqa_logits(**args, validate_contents=True)


def test_logits_wider_than_the_block_table_are_served(device):
    """vLLM under DCP asks for max_model_len columns from a rank-local (narrower)
    block table: columns past the table's capacity are past every context."""
    step = make_decode_step([3, 1], [150, 90], heads=32, seed=4, device=device)
    step.max_context_len = step.block_table.shape[1] * 64 + 200
    out = run_kernel(step)
    check_against_reference(step, out, rel_tol=1e-5)


def test_contents_check_catches_context_past_max_len():
    step = make_decode_step([2], [100], heads=32)
    args = _args(step)
    args["context_lens"] = args["context_lens"] + 500
    with pytest.raises(ValueError, match="context_lens"):
        varlen_paged_mqa_logits(**args, validate_contents=True)


# ---------------------------------------------------------------- GPU, serving sizes

GPU_CASES = [
    # (num_reqs, max_tokens, context, acceptance, heads)
    (64, 4, 8192, None, 64),
    (64, 4, 8192, 0.7, 64),
    (32, 2, 16384, None, 64),
    (96, 3, 4096, 0.5, 32),
    (8, 8, 20000, 0.8, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_serving_sizes_match_reference(case):
    num_reqs, max_tokens, context, acceptance, heads = case
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    step = random_decode_step(num_reqs, max_tokens, context, acceptance=acceptance, heads=heads,
                              seed=seed, device="cuda")
    out = run_kernel(step)
    check_against_reference(step, out, rel_tol=1e-3)
    mask = valid_mask(step.rows.context_lens, step.max_context_len, step.rows.indices)
    first = out[:, : step.max_context_len][mask]
    for _ in range(20):
        again = run_kernel(step)[:, : step.max_context_len][mask]
        assert torch.equal(again, first), "not bitwise repeatable"


@pytest.mark.gpu
def test_no_host_sync_in_plan_and_launch(no_host_sync):
    step = random_decode_step(16, 3, 2048, heads=64, device="cuda")
    qsl = torch.arange(0, 17 * 3, 3, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    with no_host_sync():
        rows = plan_decode_rows(step.seq_lens, qsl, step.block_table, num_rows=48, uniform_len=3)
        q = torch.zeros((48, 1, 64, 128), dtype=torch.float8_e4m3fn, device="cuda")
        w = torch.zeros((48, 64), device="cuda")
        varlen_paged_mqa_logits(q, step.kv_cache, w, rows.context_lens.view(-1, 1), rows.block_table,
                                rows.indices, step.max_context_len)


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_contents():
    """Capture once, then replay on new batch compositions written into the same buffers."""
    num_reqs, tokens, max_len = 24, 3, 6000
    steps = [random_decode_step(num_reqs, tokens, 4000, acceptance=a, heads=64, seed=s, device="cuda",
                                max_context_len=max_len, extra_blocks=40)
             for s, a in ((1, None), (2, 0.6), (3, 0.3))]
    first = steps[0]
    buf = StaticStep(steps, num_reqs * tokens, 64, max_len)
    q, w, ctx, bt, ids, kv, out = buf.q, buf.w, buf.ctx, buf.bt, buf.ids, buf.kv, buf.out
    load = buf.load

    load(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        varlen_paged_mqa_logits(q, kv, w, ctx, bt, ids, max_len, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        varlen_paged_mqa_logits(q, kv, w, ctx, bt, ids, max_len, out=out)
    for step in steps[1:] + steps[:1]:
        load(step)
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.full_like(out, POISON)
        # eagerly with the kernel the capture took (kernels sum the heads in
        # different orders)
        varlen_paged_mqa_logits(q, kv, w, ctx, bt, ids, max_len, out=eager,
                                kernel=_captured_kernel(q, kv, 4))
        mask = valid_mask(ctx, max_len, ids)
        assert torch.equal(out[mask], eager[mask])
        n = step.num_rows
        ref = paged_mqa_logits_ref(q[:n], kv, w[:n], ctx[:n], bt[:n], max_len, indices=ids[:n])
        m = mask[:n]
        err = (out[:n][m] - ref[m]).norm() / ref[m].norm()
        assert err < 1e-3


def _captured_kernel(q, kv, hint):
    """The kernel "auto" takes (in a CUDA-graph capture as eagerly), to run eagerly."""
    from vllm_dsa_varlen.ops import launcher

    if launcher.hopper_kernel_for(q, kv, "auto", hint) is not None:
        return "sm90"
    return "portable"


@pytest.mark.gpu
def test_uniform_plan_and_kernel_captured_together():
    """The builder's uniform path (plan + kernel) in one CUDA graph, replayed on
    new batch compositions (new lengths, graph-padding requests, block tables,
    queries), equals eager execution and the reference."""
    num_reqs, tokens, max_len = 32, 3, 5000
    rows_cap = num_reqs * tokens
    steps = [random_decode_step(num_reqs, tokens, 3500, heads=64, seed=s, device="cuda",
                                max_context_len=max_len, extra_blocks=64) for s in (11, 12, 13)]
    width = max(s.block_table.shape[1] for s in steps)
    seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, rows_cap + 1, tokens, dtype=torch.int32, device="cuda")
    block_table = torch.zeros((num_reqs, width), dtype=torch.int32, device="cuda")
    q = torch.zeros((rows_cap, 1, 64, 128), dtype=torch.float8_e4m3fn, device="cuda")
    w = torch.zeros((rows_cap, 64), device="cuda")
    kv = torch.zeros((max(s.kv_cache.shape[0] for s in steps), *steps[0].kv_cache.shape[1:]),
                     dtype=torch.uint8, device="cuda")
    bufs = DecodeRowBuffers.allocate(rows_cap, width, "cuda")
    out = torch.empty((rows_cap, max_len), device="cuda")

    def run(dst):
        rows = plan_decode_rows(seq_lens, qsl, block_table, num_rows=rows_cap,
                                uniform_len=tokens, out=bufs)
        kernel = None if torch.cuda.is_current_stream_capturing() else _captured_kernel(
            q, kv, tokens)
        varlen_paged_mqa_logits(q, kv, w, rows.context_lens.view(-1, 1), rows.block_table,
                                rows.indices, max_len, out=dst, max_run_len=tokens, kernel=kernel)

    def load(step, padding_reqs):
        seq_lens.copy_(step.seq_lens)
        seq_lens[padding_reqs] = 0
        block_table.zero_()
        block_table[:, : step.block_table.shape[1]] = step.block_table
        q.copy_(step.q)
        w.copy_(step.weights)
        kv[: step.kv_cache.shape[0]].copy_(step.kv_cache)

    load(steps[0], [])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out)
    for step, padding in ((steps[1], [3, 4]), (steps[2], []), (steps[0], [0, 31])):
        load(step, padding)
        out.fill_(POISON)
        graph.replay()
        eager = torch.full_like(out, POISON)
        run(eager)
        torch.cuda.synchronize()
        ctx = bufs.context_lens[:rows_cap].view(-1, 1)
        ids = bufs.indices[:rows_cap]
        mask = valid_mask(ctx, max_len, ids)
        assert not mask[[r for p in padding for r in range(p * tokens, (p + 1) * tokens)]].any()
        assert torch.equal(out[mask], eager[mask])
        ref = paged_mqa_logits_ref(q, kv, w, ctx, bufs.block_table[:rows_cap], max_len, indices=ids)
        err = (out[mask] - ref[mask]).norm() / ref[mask].norm()
        assert err < 1e-3


def test_rows_past_r_are_never_touched(device):
    """ids, queries and logits may be views of longer buffers (the builder's are):
    an id past row R equal to the last run's must not extend that run."""
    step = make_decode_step([2, 3], [90, 140], heads=32, seed=21, device=device)
    rows = step.rows
    r = rows.num_rows
    ids_buf = torch.empty(r + 2, dtype=torch.int32, device=device)
    ids_buf[:r] = rows.indices
    ids_buf[r:] = rows.indices[-1]  # stale ids of a longer earlier step
    q_buf = torch.cat([step.q, step.q[:2]])
    w_buf = torch.cat([step.weights, step.weights[:2]])
    ctx_buf = torch.cat([rows.context_lens, rows.context_lens[-1:] + 5, rows.context_lens[-1:]])
    bt_buf = torch.cat([rows.block_table, rows.block_table[:2]])
    out_buf = torch.full((r + 2, step.max_context_len + 64), POISON, device=device)
    varlen_paged_mqa_logits(q_buf[:r], step.kv_cache, w_buf[:r], ctx_buf[:r].view(-1, 1),
                            bt_buf[:r], ids_buf[:r], step.max_context_len,
                            out=out_buf[:r, : step.max_context_len])
    assert torch.isnan(out_buf[r:]).all(), "rows past R were written"
    # fp8 tensor-core products accumulate in ~14 bits on the GPU; the interpreter in fp32
    check_against_reference(step, out_buf[:r], rel_tol=1e-3 if device.type == "cuda" else 1e-5)
