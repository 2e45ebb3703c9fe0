"""The sm_90 (Hopper) Gluon kernel and the launcher around both kernels.

On the CPU: every kernel variant compiles (``triton.compile`` for an explicit
GPU target, no GPU needed), the schedule's arithmetic covers every work item
once, and the launcher's host logic (kernel choice, cached checks, pre-bound
launches, precompile's contract).  Marked ``gpu``: the kernel against the
reference on an sm_90 GPU (skipped elsewhere; Gluon does not run in Triton's
interpreter).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from vllm_dsa_varlen.ops import common, launcher
from vllm_dsa_varlen.ops import gluon_paged_mqa_logits as gk
from vllm_dsa_varlen.ops import triton_paged_mqa_logits as portable
from vllm_dsa_varlen.ops.launcher import precompile
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask
from vllm_dsa_varlen.workloads import make_decode_step, random_decode_step

from logits_checks import POISON, check_poisoned, launcher_args, run_poisoned

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# "sm90": the launcher's sm_90 path (the CUDA kernel at 64 heads where NVRTC
# loads, the Gluon one otherwise); "sm90_gluon": the Gluon kernel at every size.
SM90_KERNELS = ["sm90", "sm90_gluon"]


# ---------------------------------------------------------------- compiles (CPU)

@pytest.fixture(scope="module")
def compiled_variants():
    """Every variant compiled by ``python -m vllm_dsa_varlen.ops.compile_check``
    in a process without ``TRITON_INTERPRET`` (the interpreter replaces the JIT
    functions that ``triton.compile`` needs), with this environment's Triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "vllm_dsa_varlen.ops.compile_check"],
                          capture_output=True, text=True, env=env, cwd=root, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, rows[0], rows[1:]


def test_every_variant_compiles(compiled_variants):
    """The sm_90 kernel for H 32/64 and every ROWS_MAX a run-length hint can
    pick (and its launch knobs once), and the portable kernel for sm_89, sm_90, sm_100 and sm_120: all
    build with this Triton; the sm_90 kernel has wgmma, TMA and the partitions'
    register split, and no local memory."""
    rc, head, rows = compiled_variants
    failures = [r for r in rows if not r["ok"]]
    assert not failures, failures
    assert rc == 0
    portable = {(r["heads"], r["arch"], r["pairs"]) for r in rows if r["kernel"] == "portable"}
    assert portable == {(h, a, p) for h in (32, 64) for a in (89, 90, 100, 120) for p in (1, 2)}
    if head["gluon"] != "ok":
        pytest.skip(f"this Triton has no usable Gluon: {head['gluon']}")
    sm90 = [r for r in rows if r["kernel"] == "sm90"]
    plans = {(r["heads"], r["rows_max"]) for r in rows if r["kernel"] == "plan"}
    assert plans == {(32, 4), (32, 8), (64, 2), (64, 4), (64, 8)}
    assert {(r["heads"], r["rows_max"]) for r in sm90 if not r["knobs"]} == {
        (32, 4), (32, 8), (64, 2), (64, 4), (64, 8)}
    assert [r["knobs"] for r in sm90 if r["knobs"]] == [
        {"consumers": 1}, {"direct_store": False}, {"wide": True}, {"wide": False}]
    for r in sm90:
        assert r["wgmma"] and r["tma"] and r["setmaxnreg"] and not r["local"], r
        assert r["shared"] <= 227 * 1024
        wide = r["knobs"].get("wide", gk.takes_wide(r["heads"], r["rows_max"]))
        assert r["name"] == ("_varlen_logits_sm90_wide" if wide else "_varlen_logits_sm90"), r


def test_the_cuda_builds_compile_without_spills(compiled_variants):
    """The compile check builds the sm_90 CUDA kernel through NVRTC in each
    build the launcher takes, with no spills, where NVRTC loads."""
    _, head, rows = compiled_variants
    if head["nvrtc"] != "ok":
        pytest.skip(f"no NVRTC here: {head['nvrtc']}")
    cuda = [r for r in rows if r["kernel"] == "cuda_sm90"]
    assert sorted(r["defines"] for r in cuda) == [[], ["EVICT_FIRST=1"]]
    assert all(r["ok"] and r["spills"] == 0 and r["cubin_bytes"] > 0 for r in cuda), cuda


def test_per_step_integers_are_not_specialised():
    """Row count, logits width and block-table width/stride change every step:
    neither kernel may compile a variant per value."""
    assert {"num_rows", "max_context_len", "bt_width", "stride_bt"} <= set(portable.PER_STEP_INTS)
    assert "tiles_per_split" in portable.PER_STEP_INTS
    assert {"num_rows", "max_context_len", "bt_width", "stride_bt"} <= set(gk.PER_STEP_INTS)
    if gk.available() is None:
        for fn, names in ((gk._varlen_logits_sm90, gk.PER_STEP_INTS),
                          (gk._varlen_logits_sm90_wide, gk.PER_STEP_INTS),
                          (gk._plan_sm90, ("num_rows", "max_context_len", "bt_width"))):
            params = {p.name: p for p in fn.params}
            assert all(params[n].do_not_specialize for n in names)


# ---------------------------------------------------------------- schedule (CPU)

def _step_ids(lens):
    ids = []
    for i, n in enumerate(lens):
        ids += [i] * n
    return ids


@pytest.mark.parametrize("pages_per_item", [1, 2])  # the wide structure's two-page items
@pytest.mark.parametrize("seed", range(6))
def test_schedule_covers_every_item_once_and_splits_evenly(seed, pages_per_item):
    gen = torch.Generator().manual_seed(seed + 100 * pages_per_item)
    item = 64 * pages_per_item
    lens = torch.randint(1, 11, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
    ids = _step_ids(lens)
    ctx = torch.randint(-3, 900, (len(ids),), generator=gen).tolist()
    max_len, width, rows_max = 700, 9, [2, 4, 8][seed % 3]
    programs = int(torch.randint(1, 300, (1,), generator=gen))
    shares = gk.schedule_model(ids, ctx, max_len, width, rows_max, programs,
                               pages_per_item=pages_per_item)
    items = [it for share in shares for it in share]
    assert len(items) == len(set(items))
    # every run's every item, once per row chunk, with the run's KV clamped to
    # the block table's pages (a run's last two-page item holds one page when
    # its page count is odd)
    want = set()
    start = 0
    for n in lens:
        end = start + n - 1
        kv = min(max(ctx[end], 0), max_len, width * 64)
        want |= {(start, end, c, p) for c in range(0, n, rows_max) for p in range(-(-kv // item))}
        start = end + 1
    assert set(items) == want
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1
    # each program's items are consecutive in run order
    order = sorted(want)
    for share in shares:
        if share:
            i = order.index(share[0])
            assert order[i:i + len(share)] == share


def test_structure_follows_the_row_groups_per_segment():
    """Two row groups per segment take the two-warpgroup structure; one group
    (2-token steps at 64 heads, up to 4 tokens at 32) and chunked longer runs
    take the wide one, which holds at most two groups."""
    assert [gk.takes_wide(64, r) for r in (2, 4, 8)] == [True, False, True]
    assert [gk.takes_wide(32, r) for r in (4, 8)] == [True, False]
    assert [gk.wide_rows_max(64, r) for r in (2, 4, 8)] == [2, 4, 4]
    assert [gk.wide_rows_max(32, r) for r in (4, 8)] == [4, 8]


@pytest.mark.parametrize("knobs", [dict(stages=3), dict(wide=True, stages=5),
                                   dict(consumers=2, stages=7)])
def test_ring_depth_must_divide_among_the_math_partitions(knobs):
    """A slot's next item must go to the consumer that took its last one (a
    parity wait passes one phase early otherwise): refused before any launch."""
    step = make_decode_step([2, 2], [70, 20], heads=64)
    rows = step.rows
    out = torch.empty(rows.num_rows, step.max_context_len)
    with pytest.raises(ValueError, match="stages"):
        gk.launch(step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1),
                  rows.block_table, rows.indices, step.max_context_len, out, rows_max=4, **knobs)


def test_schedule_key_separates_what_a_plan_depends_on():
    """A per-step cache hands a planned schedule only to calls it was planned
    for: same tensors, integers and structure, and the same side of a CUDA
    graph capture."""
    ids = torch.zeros(8, dtype=torch.int32)
    ctx = torch.zeros((8, 1), dtype=torch.int32)
    key = gk.schedule_key(ids, ctx, 700, 9, 64, 4, False)
    assert key == gk.schedule_key(ids, ctx, 700, 9, 64, 4, False)
    others = [gk.schedule_key(ids, ctx, 700, 9, 64, 4, True),     # inside a capture
              gk.schedule_key(ids, ctx, 701, 9, 64, 4, False),
              gk.schedule_key(ids, ctx, 700, 10, 64, 4, False),
              gk.schedule_key(ids, ctx, 700, 9, 64, 2, False),    # the wide structure
              gk.schedule_key(ids, ctx, 700, 9, 32, 4, False),
              gk.schedule_key(ids.clone(), ctx, 700, 9, 64, 4, False),
              gk.schedule_key(ids, ctx.clone(), 700, 9, 64, 4, False),
              gk.schedule_key(ids[:6], ctx, 700, 9, 64, 4, False)]
    assert all(k != key for k in others)


def test_bad_schedule_is_refused(monkeypatch):
    step = make_decode_step([2, 2], [70, 20], heads=64)
    rows = step.rows
    out = torch.empty(rows.num_rows, step.max_context_len)
    monkeypatch.setattr(gk, "num_sms", lambda index: 4)
    for bad in (torch.zeros((3, gk.SCHED_WORDS), dtype=torch.int32),
                torch.zeros((4, gk.SCHED_WORDS), dtype=torch.int64),
                torch.zeros((4, 2), dtype=torch.int32)):
        with pytest.raises(ValueError, match="schedule"):
            gk.launch(step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1),
                      rows.block_table, rows.indices, step.max_context_len, out, rows_max=4,
                      schedule=bad)


def test_rows_max_follows_the_hint_and_the_wgmma_group():
    assert [gk.rows_max_for(64, n) for n in (1, 2, 3, 4, 5, 8, 12)] == [2, 2, 4, 4, 8, 8, 8]
    assert [gk.rows_max_for(32, n) for n in (1, 2, 4, 5, 9)] == [4, 4, 4, 8, 8]
    assert gk.variants(64) == [2, 4, 8] and gk.variants(32) == [4, 8]


# ---------------------------------------------------------------- launcher (CPU)

_args = launcher_args
_run = run_poisoned
_check = check_poisoned


def test_cpu_tensors_take_the_portable_kernel_and_sm90_is_refused():
    step = make_decode_step([2, 1], [70, 20], heads=32)
    assert launcher.hopper_kernel_for(step.q, step.kv_cache, "auto") is None
    assert launcher.hopper_kernel_for(step.q, step.kv_cache, "portable") is None
    with pytest.raises(RuntimeError, match="sm_90 kernel cannot run"):
        launcher.varlen_paged_mqa_logits(*_args(step), kernel="sm90")
    with pytest.raises(ValueError, match="kernel"):
        launcher.varlen_paged_mqa_logits(*_args(step), kernel="fastest")
    assert "not an sm_90 GPU" in gk.unsupported_reason(step.q, step.kv_cache) or gk.available()


def test_auto_takes_sm90_where_it_measured_faster(monkeypatch):
    """On Hopper, "auto" takes the sm_90 kernel for runs of up to 4 tokens or a
    hint of 8, at any row count (the H200 table in BENCHMARKS.md), the portable
    kernel otherwise."""
    assert launcher.auto_takes_sm90(rows=256, max_run_len=4)
    assert launcher.auto_takes_sm90(rows=32, max_run_len=1)
    assert launcher.auto_takes_sm90(rows=512, max_run_len=8)      # 4-row chunks: faster
    assert launcher.auto_takes_sm90(rows=4, max_run_len=4)        # B1: faster since planned once
    assert not launcher.auto_takes_sm90(rows=384, max_run_len=6)  # a 2-row chunk pays for 4
    assert not launcher.auto_takes_sm90(rows=320, max_run_len=5)  # not measured faster
    # Eager calls pay the sm_90 launch's host time: the portable kernel.
    assert not launcher.auto_takes_sm90(rows=256, max_run_len=4, capturing=False)
    monkeypatch.setattr(launcher, "HOPPER_AUTO", False)
    assert not launcher.auto_takes_sm90(rows=256, max_run_len=4)


def test_layout_checks_run_once_per_shape_signature(monkeypatch):
    step = make_decode_step([2, 1], [70, 20], heads=32)
    calls = []
    real = launcher.check_varlen_inputs
    monkeypatch.setattr(launcher, "check_varlen_inputs", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(launcher, "_CHECKED", {})
    for _ in range(3):
        launcher.checked_layout(*_args(step))
    assert len(calls) == 1
    other = make_decode_step([3, 2], [90, 20], heads=32)
    launcher.checked_layout(*_args(other))
    assert len(calls) == 2
    # bad inputs are still refused, cached or not
    args = list(_args(step))
    args[2] = args[2].double()
    with pytest.raises(ValueError, match="weights"):
        launcher.checked_layout(*args)
    args = list(_args(step))
    with pytest.raises(ValueError, match="max_context_len"):
        launcher.checked_layout(*args[:-1], 0)
    buf = torch.zeros(args[5].numel() + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="8-byte aligned"):
        launcher.checked_layout(*args[:5], buf[1:], args[6])


def test_prebound_launch_key_separates_specialisations():
    """The cached compiled kernel is reused only for arguments Triton would
    specialise the same way (integer == 1 / % 16, tensor 16-byte alignment)."""
    a = torch.zeros(64, dtype=torch.float32)
    assert common._spec(a) == common._spec(torch.zeros(8, dtype=torch.float32))
    assert common._spec(a) != common._spec(a[1:])
    assert common._spec(a) != common._spec(a.int())
    assert common._spec(32) == common._spec(48) != common._spec(33) != common._spec(1)


def test_precompile_needs_a_gpu():
    with pytest.raises(ValueError, match="device"):
        precompile(heads=64, device="cpu")


# ---------------------------------------------------------------- GPU (sm_90)

def _compiled(fn):
    return sum(len(c[0]) for c in fn.device_caches.values())


@pytest.mark.gpu
def test_no_compile_after_precompile_for_new_step_sizes():
    """After precompile, steps with new row counts, logits widths and block-table
    widths compile nothing (the kernels' own caches do not grow), eager (the
    portable kernel) or captured into a CUDA graph (where "auto" may take the
    sm_90 kernel)."""
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck

    heads = 64
    took = precompile(heads=heads, device="cuda")
    assert took > 0
    fns = [portable._varlen_paged_mqa_logits_kernel] + (
        [gk._varlen_logits_sm90, gk._varlen_logits_sm90_wide, gk._plan_sm90] if HOPPER else [])
    before = [_compiled(f) for f in fns]
    cuda_builds = dict(ck._LOADED)  # the CUDA kernel: NVRTC builds loaded by precompile
    if HOPPER and ck.available() is None:
        assert cuda_builds, "precompile did not build the CUDA sm_90 kernel"

    for i, (reqs, tokens, ctx_len, width_pad) in enumerate(
            [(3, 1, 300, 0), (17, 2, 5000, 3), (33, 3, 2000, 1), (5, 4, 9000, 7), (2, 8, 100, 2),
             (129, 1, 70, 5)]):
        step = random_decode_step(reqs, tokens, ctx_len, heads=heads, seed=i, device="cuda",
                                  max_context_len=ctx_len * 2 + 17 * i)
        rows = step.rows
        bt = torch.cat([rows.block_table, torch.zeros((rows.num_rows, width_pad), dtype=torch.int32,
                                                      device="cuda")], dim=1)
        out = launcher.varlen_paged_mqa_logits(step.q, step.kv_cache, step.weights,
                                               rows.context_lens.view(-1, 1), bt, rows.indices,
                                               step.max_context_len, max_run_len=tokens)
        torch.cuda.synchronize()
        mask = valid_mask(rows.context_lens.view(-1, 1), step.max_context_len, rows.indices)
        ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights,
                                   rows.context_lens.view(-1, 1), bt, step.max_context_len,
                                   indices=rows.indices)
        assert (out[mask] - ref[mask]).norm() / ref[mask].norm() < 1e-3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = launcher.varlen_paged_mqa_logits(
                step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1), bt,
                rows.indices, step.max_context_len, max_run_len=tokens)
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert (captured[mask] - ref[mask]).norm() / ref[mask].norm() < 1e-3
    assert [_compiled(f) for f in fns] == before
    assert ck._LOADED == cuda_builds


SMALL = {
    # decode lens, seq lens, padding rows, heads
    "runs_1_to_8_h32": ([1, 2, 3, 4, 5, 6, 7, 8], [65, 130, 3, 64, 200, 129, 70, 191], 0, 32),
    "runs_1_to_8_h64": ([8, 7, 6, 5, 4, 3, 2, 1], [65, 130, 9, 64, 200, 129, 70, 191], 0, 64),
    "shorter_than_a_page": ([1, 1, 3, 2], [1, 63, 5, 64], 0, 64),
    "shorter_than_the_run": ([4, 8, 3], [2, 5, 1], 0, 64),
    "graph_padding": ([2, 2, 2, 2], [90, 0, 150, 0], 3, 64),
    "longer_than_rows_max": ([9, 12], [700, 3000], 0, 64),
}


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("kernel", SM90_KERNELS)
@pytest.mark.parametrize("hint", [1, 4, 8])
@pytest.mark.parametrize("name", list(SMALL))
def test_sm90_matches_reference_small(name, hint, kernel):
    lens, seqs, pad, heads = SMALL[name]
    step = make_decode_step(lens, seqs, heads=heads, padding_rows=pad,
                            max_context_len=max(seqs) + 11, seed=len(name) + hint, device="cuda")
    _check(step, _run(step, kernel=kernel, max_run_len=hint))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("knobs", [dict(consumers=1, wide=False), dict(consumers=2, wide=False),
                                   dict(direct_store=False, wide=False),
                                   dict(consumers=1, stages=3, wide=False),
                                   dict(stages=4, wide=False), dict(wide=False), dict(wide=True),
                                   dict(wide=True, stages=2)])
@pytest.mark.parametrize("name", list(SMALL))
def test_sm90_launch_knobs_match_reference(name, knobs):
    """Each math-warpgroup count, store path and a shallow ring, and each
    structure (the wide one holds at most two row groups: longer runs are
    chunked), with each ``ROWS_MAX`` these runs reach."""
    lens, seqs, pad, heads = SMALL[name]
    step = make_decode_step(lens, seqs, heads=heads, padding_rows=pad,
                            max_context_len=max(seqs) + 11, seed=len(name), device="cuda")
    rows = step.rows
    for rows_max in sorted({gk.rows_max_for(heads, n) for n in (1, 4, 8)}):
        out = torch.full((rows.num_rows + 2, step.max_context_len + 40), POISON, device="cuda")
        gk.launch(step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1),
                  rows.block_table, rows.indices, step.max_context_len, out[: rows.num_rows],
                  rows_max=rows_max, **knobs)
        _check(step, out)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", [(64, 4, 8192, None, 64), (64, 4, 8192, 0.7, 64),
                                  (32, 2, 16384, None, 64), (96, 3, 4096, 0.5, 32),
                                  (8, 8, 20000, 0.8, 64), (1, 4, 8192, None, 64),
                                  (200, 1, 3000, None, 64)])
@pytest.mark.parametrize("kernel", SM90_KERNELS)
def test_sm90_serving_sizes_repeatable(case, kernel):
    num_reqs, tokens, context, acceptance, heads = case
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    step = random_decode_step(num_reqs, tokens, context, acceptance=acceptance, heads=heads,
                              seed=seed, device="cuda")
    hint = int(step.decode_lens.max())
    first = _run(step, kernel=kernel, max_run_len=hint)
    mask = _check(step, first)
    r = step.num_rows
    for _ in range(20):
        again = _run(step, kernel=kernel, max_run_len=hint)
        assert torch.equal(again[:r, : step.max_context_len][mask],
                           first[:r, : step.max_context_len][mask]), "not bitwise repeatable"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("heads,hint", [(64, 2), (64, 4), (64, 8), (32, 4), (32, 8)])
def test_sm90_plan_matches_the_host_schedule(heads, hint):
    """The planned schedule (one launch) gives every program the share the
    host model gives it: item count, last row of its first run, offset in it."""
    gen = torch.Generator().manual_seed(heads + hint)
    lens = torch.randint(1, 9, (40,), generator=gen).tolist()
    ids = _step_ids(lens)
    ctx = torch.randint(-2, 3000, (len(ids),), generator=gen).tolist()
    max_len, width = 2500, 40
    rows_max = gk.rows_max_for(heads, hint)
    wide, held, pr = gk._structure(heads, rows_max, None)
    ids_t = torch.tensor(ids, dtype=torch.int32, device="cuda")
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda").view(-1, 1)
    got = gk.plan(ids_t, ctx_t, max_len, width, heads, rows_max).cpu()
    shares = gk.schedule_model(ids, ctx, max_len, width, held, got.shape[0], pages_per_item=pr)
    for c, share in enumerate(shares):
        if not share:
            assert int(got[c, 0]) == 0
            continue
        first, last, chunk, item = share[0]
        kv = min(max(ctx[last], 0), max_len, width * 64)
        items = -(-kv // (64 * pr))
        assert got[c, :3].tolist() == [len(share), last, chunk // held * items + item], c


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("kernel", SM90_KERNELS)
def test_sm90_graph_replay_with_new_contents_and_compositions(kernel):
    num_reqs, tokens, max_len = 24, 4, 6000
    steps = [random_decode_step(num_reqs, tokens, 4000, acceptance=a, variable=v, heads=64, seed=s,
                                device="cuda", max_context_len=max_len, extra_blocks=40)
             for s, a, v in ((1, None, False), (2, 0.6, False), (3, None, True), (4, 0.3, False))]
    cap = num_reqs * tokens
    width = max(s.rows.block_table.shape[1] for s in steps)
    q = torch.zeros((cap, 1, 64, 128), dtype=torch.float8_e4m3fn, device="cuda")
    w = torch.zeros((cap, 64), device="cuda")
    ctx = torch.zeros((cap, 1), dtype=torch.int32, device="cuda")
    bt = torch.zeros((cap, width), dtype=torch.int32, device="cuda")
    ids = torch.zeros(cap, dtype=torch.int32, device="cuda")
    kv = torch.zeros((max(s.kv_cache.shape[0] for s in steps), *steps[0].kv_cache.shape[1:]),
                     dtype=torch.uint8, device="cuda")
    out = torch.empty((cap, max_len), device="cuda")

    def load(step):
        n = step.num_rows
        q.zero_(); w.zero_(); ctx.zero_(); bt.zero_()
        q[:n] = step.q; w[:n] = step.weights; ctx[:n, 0] = step.rows.context_lens
        bt[:n, : step.rows.block_table.shape[1]] = step.rows.block_table
        ids.copy_(torch.arange(cap, device="cuda", dtype=torch.int32) + 10**6)
        ids[:n] = step.rows.indices
        kv[: step.kv_cache.shape[0]].copy_(step.kv_cache)

    def call(dst, cache=None):
        launcher.varlen_paged_mqa_logits(q, kv, w, ctx, bt, ids, max_len, out=dst,
                                         max_run_len=tokens, kernel=kernel, schedule_cache=cache)

    load(steps[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(out)
    torch.cuda.current_stream().wait_stream(side)
    # Two "layers" in one graph sharing a step's schedule cache, as the builder's
    # tag makes them: the first plans inside the capture, the second reads it.
    cache = {}
    second = torch.empty_like(out)
    call(out, cache)                      # eager: planned outside any capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out, cache)
        call(second, cache)
    assert len(cache) == 2                # one plan outside, one inside the capture
    for step in steps[1:] + steps[:1]:
        load(step)
        out.fill_(POISON)
        second.fill_(POISON)
        graph.replay()
        eager = torch.full_like(out, POISON)
        call(eager)
        torch.cuda.synchronize()
        mask = valid_mask(ctx, max_len, ids)
        assert torch.equal(out[mask], eager[mask])
        assert torch.equal(second[mask], eager[mask])
        assert torch.isnan(out[~mask]).all() and torch.isnan(second[~mask]).all()
        n = step.num_rows
        ref = paged_mqa_logits_ref(q[:n], kv, w[:n], ctx[:n], bt[:n], max_len, indices=ids[:n])
        m = mask[:n]
        assert (out[:n][m] - ref[m]).norm() / ref[m].norm() < 1e-3


