"""The one-launch schedule planner (ops/cuda_plan.py, cuda/sm90_plan.cu)
against the torch plan it replaces (``cuda_paged_mqa_logits.plan_torch``),
in its build for each head count of the logits kernel (64: chunks of 4 rows,
32: chunks of 8): on the CPU a host model of the kernel's algorithm (its
thread shares, scans, division-found CTA starts) fed the launcher's kernel
arguments, those arguments against the kernel's signature, and its NVRTC
builds; on an sm_90 GPU the kernel itself, bit for bit into poisoned outputs,
on many random steps (uniform, variable, graph-padded, single rows, very
long runs, up to 9000 rows; serving-shaped steps of 1 to 256 requests with
contexts up to 128K), inside CUDA-graph replays with new contents and
without host syncs, and the logits kernel's output through its schedule
against the torch reference."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
from vllm_dsa_varlen.ops import cuda_plan as cp
from vllm_dsa_varlen.ops.common import num_sms
from vllm_dsa_varlen.ops.reference import run_spans
from vllm_dsa_varlen.bench.workloads import make_decode_step, random_decode_step, random_step_rows

from logits_checks import check_poisoned, launcher_args, run_poisoned

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


NVRTC = None
try:
    ck._nvrtc()
except OSError as exc:  # pragma: no cover - depends on the environment
    NVRTC = str(exc)


# ------------------------------------------------------------- random steps

def random_rows(seed: int, max_rows: int = 600):
    """A step's ``(ids, ctx, max_context_len, bt_width, programs)`` (int32
    CPU tensors, ints) of one of several shapes: uniform runs, variable runs,
    graph padding (rows with context 0 and ids of their own), single rows,
    very long runs, ids that repeat after other runs, odd context lengths
    (negative, past the cap, shorter than the run)."""
    rnd = random.Random(seed)
    kind = rnd.choice(["uniform", "variable", "padded", "single", "long", "mixed"])
    ids, ctx = [], []
    budget = rnd.randint(1, max_rows)
    req = rnd.randint(0, 50)
    base = rnd.choice([1, 64, 3000, 40000])
    n_uniform = rnd.randint(1, 8)
    while len(ids) < budget:
        if kind == "uniform":
            n = n_uniform
        elif kind == "single":
            n = 1
        elif kind == "long":
            n = rnd.choice([1, 5, rnd.randint(100, 3000)])
        else:
            n = rnd.randint(1, 9)
        kv = max(0, int(base * rnd.uniform(0.7, 1.3))) if rnd.random() < 0.9 else rnd.choice(
            [0, 1, 63, 64, 65])
        rid = req if not (kind == "mixed" and ids and rnd.random() < 0.2) else rnd.choice(ids)
        for j in range(n):
            ids.append(rid)
            c = max(0, kv - (n - 1 - j))
            if kind == "mixed" and rnd.random() < 0.1:
                c = rnd.randint(-5, 5 * base)
            ctx.append(c)
        req += rnd.randint(1, 3)
    if kind == "padded":
        for _ in range(rnd.randint(1, 40)):
            req += 1
            ids.append(req)
            ctx.append(0)
    width = rnd.choice([1, 8, -(-2 * base // 64), 2100])
    max_len = rnd.choice([64, 2 * base, 131072])
    programs = rnd.choice([1, 3, 7, 132, 132, 1024])
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
            max_len, width, programs)


def steps(count: int, max_rows: int = 600):
    return [random_rows(seed, max_rows) for seed in range(count)]


# ----------------------------------------------------- host model of the kernel

def kernel_model(ids, ctx, max_len, width, programs, cost=ck.COST, threads=1024, heads=64,
                 cut_items=0):
    """The planner kernel's algorithm on the host, step by step as
    sm90_plan.cu runs it (``threads`` threads, thread t owning rows [t K, t K
    + K)), from the arguments the launcher passes it (``cp.kernel_args``: the
    KV cap, a page's cost per chunk size, the division magics, ``cut_items``):
    ``(table, ctas)`` as lists of rows."""
    ids, ctx = [int(x) for x in ids], [int(x) for x in ctx]
    rows = len(ids)
    args = cp.kernel_args(0, 0, rows, max_len, width, programs, 0, 0, heads=heads, cost=cost,
                          cut_items=cut_items)
    cap, units, magics = args["cap"].value, list(args["unit"]), list(args["magic"])
    chunk = len(units)  # the build's ROWS_MAX
    group = chunk // 2  # GROUP_ROWS
    per = -(-rows // threads)
    spans = [(min(t * per, rows), min(t * per + per, rows)) for t in range(threads)]

    # 1. each thread's run starts and ends; the last start before its rows and
    # the first end past them (exclusive scans)
    starts = [{r for r in range(a, b) if r == 0 or ids[r] != ids[r - 1]} for a, b in spans]
    ends = [{r for r in range(a, b) if r == rows - 1 or ids[r] != ids[r + 1]} for a, b in spans]
    carry_first = [max([-1] + [max(s) for s in starts[:t] if s]) for t in range(threads)]
    carry_last = [min([rows] + [min(e) for e in ends[t + 1:] if e]) for t in range(threads)]
    kv_ends, kv_carry_last = [set(e) for e in ends], list(carry_last)  # the runs' own ends

    def last_of(r, t, ends_t, after):
        """The first end at or past row r among thread t's rows, else ``after``."""
        b = spans[t][1]
        while r < b and r not in ends_t:
            r += 1
        return after if r == b else r

    def walk(t):
        """The thread's rows: (r, first, kv, n_rows, items, unit, last)."""
        a, b = spans[t]
        first, last = carry_first[t], -1
        for r in range(a, b):
            if r in starts[t]:
                first = r
            if last < r:
                last = last_of(r, t, ends[t], carry_last[t])
            kv = min(max(ctx[last_of(r, t, kv_ends[t], kv_carry_last[t])], 0), cap)
            n = min(last - r + 1, chunk)
            work = (r - first) % chunk == 0 and kv > 0
            items = -(-kv // ck.PAGE) if work else 0
            unit = units[n - 1] if work else 0
            yield r, first, kv, n, items, unit, last

    # 1b. small steps: runs over both row groups of a chunk cut into row
    # groups, each thread from its own rows and its uncut carries
    if cut_items > 0 and sum(w[4] for t in range(threads) for w in walk(t)) <= cut_items:
        new = []
        for t, (a, b) in enumerate(spans):
            got = list(walk(t))
            cs, ce, before, after = set(starts[t]), set(ends[t]), carry_first[t], carry_last[t]
            for r, first, _, _, _, _, last in got:
                length = last - first + 1
                if group < length <= chunk:
                    if (r - first) % group == 0:
                        cs.add(r)
                    if (r - first) % group == group - 1:
                        ce.add(r)
            if got:
                f, length = before, got[0][6] - before + 1
                if before >= 0 and a not in starts[t] and group < length <= chunk:
                    before = f + (a - f) // group * group
                _, f, _, _, _, _, last = got[-1]
                length = last - f + 1
                if last >= b and group < length <= chunk:
                    after = min(f + ((b - 1 - f) // group + 1) * group - 1, last)
            new.append((cs, ce, before, after))
        for t, (cs, ce, before, after) in enumerate(new):
            starts[t], ends[t], carry_first[t], carry_last[t] = cs, ce, before, after

    # 2. per-thread sums, exclusive scans, totals
    sums = []
    for t in range(threads):
        got = list(walk(t))
        sums.append((sum(w[4] for w in got), sum(w[4] > 0 for w in got),
                     sum(w[4] * w[5] for w in got)))
    before = [tuple(sum(s[k] for s in sums[:t]) for k in range(3)) for t in range(threads)]
    total_items, with_work, cost_total = (sum(s[k] for s in sums) for k in range(3))

    # 3. table rows; the chunk holding CTA c's start tags c
    def ceil_div(a, b):
        return -(-a // b)

    table = [None] * rows
    tags = [None] * programs
    for t in range(threads):
        item, seg, seg_cost = before[t]
        thread_tags = cost_total > 0 and (ceil_div(seg_cost * programs, cost_total)
                                          < ceil_div((seg_cost + sums[t][2]) * programs,
                                                     cost_total))
        for r, first, kv, n, items, unit, _ in walk(t):
            work = items > 0
            pos = seg if work else with_work + (r - seg)
            off = item if work else total_items
            table[pos] = [r, n, kv, off, items, first, 0, 0]
            if work:
                end_cost = seg_cost + unit * items
                if thread_tags:
                    c = ceil_div(seg_cost * programs, cost_total)
                    if c < ceil_div(end_cost * programs, cost_total):
                        tags[c] = (pos, off, seg_cost, n)
                item += items
                seg_cost = end_cost
                seg += 1

    # 4. each CTA: the last tag at or before it
    los, seg0s, tag = [], [], None
    for c in range(programs):
        tag = tags[c] or tag
        if cost_total == 0:
            los.append(total_items)
            seg0s.append(rows)
        else:
            pos, off, seg_cost, n = tag
            x = _div_by(c * cost_total, programs, args["magic_p"].value)
            los.append(off + _div_by(x - seg_cost, units[n - 1], magics[n - 1]))
            seg0s.append(pos)
    ctas = [[seg0s[c], los[c], los[c + 1] if c + 1 < programs else total_items, 0]
            for c in range(programs)]
    return table, ctas


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("threads", [1024, 1, 3, 8, 32])
@pytest.mark.parametrize("seed", range(40))
def test_kernel_model_matches_plan_torch(seed, threads, heads):
    """The planner's algorithm (every thread count: one row per thread, many
    rows per thread, runs across threads' shares) on the launcher's
    arguments gives plan_torch's table and ctas exactly, for every cost form,
    at both head counts."""
    ids, ctx, max_len, width, programs = random_rows(seed, max_rows=300)
    cost = [ck.COST, (5, 2), (1, 0), (0, 1, 5), (3, 7, 1)][seed % 5]
    table, ctas = ck.plan_torch(ids, ctx.view(-1, 1), max_len, width, heads, programs=programs,
                                cost=cost)
    got_table, got_ctas = kernel_model(ids, ctx, max_len, width, programs, cost, threads, heads)
    assert got_table == table.tolist()
    assert got_ctas == ctas.tolist()


def cut_ids(ids, group: int):
    """Run ids with every run of more than ``group`` and at most ``2 * group``
    rows (one chunk over both its row groups) cut into runs of ``group`` rows
    (the last the shorter), by a plain walk over the rows."""
    ids = [int(x) for x in ids]
    out, new, r = [], -1, 0
    while r < len(ids):
        e = r
        while e + 1 < len(ids) and ids[e + 1] == ids[r]:
            e += 1
        length = e - r + 1
        piece = group if group < length <= 2 * group else length
        for j in range(length):
            if j % piece == 0:
                new += 1
            out.append(new)
        r = e + 1
    return torch.tensor(out, dtype=torch.int32)


def _cut_threshold(rnd, items: int) -> tuple[int, bool]:
    """A ``cut_items`` on either side of a step's ``items``, and whether it cuts."""
    cut = rnd.choice([items, items + rnd.randint(1, 99), max(1, items - rnd.randint(1, 99)),
                      10**9])
    return cut, items <= cut


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("seed", range(40))
def test_a_cut_plan_is_the_plan_of_the_cut_runs(seed, heads):
    """plan_torch with ``cut_items`` at or above the step's items plans the
    runs cut to row groups (a plain walk's ids, cut_ids), each piece with its
    own run's KV length; below them, the step's own runs."""
    rnd = random.Random(seed)
    ids, ctx, max_len, width, programs = random_rows(seed, max_rows=300)
    group = ck.rows_per_group(heads)
    plain = ck.plan_torch(ids, ctx.view(-1, 1), max_len, width, heads, programs=programs)
    items = int(plain[0][:, 4].sum())
    cut, cuts = _cut_threshold(rnd, items)
    table, _ = ck.plan_torch(ids, ctx.view(-1, 1), max_len, width, heads, programs=programs,
                             cut_items=cut)
    pieces = cut_ids(ids, group) if cuts else ids
    cap = min(max_len, width * ck.PAGE)
    run_kv = {r: kv for first, e, kv in run_spans(ids, ctx, cap) for r in range(first, e + 1)}
    chunk = cp.chunk_rows(heads)
    want = [(first + c, min(chunk, e - first - c + 1), run_kv[first])
            for first, e, _ in run_spans(pieces, ctx, cap)
            for c in range(0, e - first + 1, chunk) if run_kv[first] > 0]
    assert [(row[0], row[1], row[2]) for row in table.tolist() if row[4] > 0] == want


def test_a_cut_plan_gives_each_row_group_of_a_request_its_own_items():
    """Four 4-row requests at 64 heads: cut, eight 2-row chunks each with the
    request's KV length and pages; not cut (cut_items one below the step's
    items), four 4-row chunks."""
    ids = torch.tensor([r // 4 for r in range(16)], dtype=torch.int32)
    ctx = torch.tensor([1000 * (r // 4 + 1) + r % 4 for r in range(16)], dtype=torch.int32)
    items = sum(-(-(1000 * (q + 1) + 3) // 64) for q in range(4))
    table, _ = ck.plan_torch(ids, ctx, 8192, 200, 64, programs=7, cut_items=items)
    work = [row for row in table.tolist() if row[4] > 0]
    assert [(row[0], row[1], row[2], row[4]) for row in work] == [
        (r, 2, int(ctx[r | 3]), -(-int(ctx[r | 3]) // 64)) for r in range(0, 16, 2)]
    table, _ = ck.plan_torch(ids, ctx, 8192, 200, 64, programs=7, cut_items=items - 1)
    assert [(row[0], row[1]) for row in table.tolist() if row[4] > 0] == [
        (r, 4) for r in range(0, 16, 4)]


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("threads", [1024, 1, 2, 3, 5, 32])
@pytest.mark.parametrize("seed", range(30))
def test_kernel_model_cuts_as_plan_torch_does(seed, threads, heads):
    """The planner's cut (each thread's bits from its own rows, its carries
    from the uncut ones) gives plan_torch's cut plan exactly, on either side
    of the threshold, with runs across threads' shares."""
    rnd = random.Random(seed)
    ids, ctx, max_len, width, programs = random_rows(seed + 500, max_rows=200)
    plain = ck.plan_torch(ids, ctx.view(-1, 1), max_len, width, heads, programs=programs)
    cut, _ = _cut_threshold(rnd, int(plain[0][:, 4].sum()))
    table, ctas = ck.plan_torch(ids, ctx.view(-1, 1), max_len, width, heads, programs=programs,
                                cut_items=cut)
    got = kernel_model(ids, ctx, max_len, width, programs, threads=threads, heads=heads,
                       cut_items=cut)
    assert got == (table.tolist(), ctas.tolist())


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("seed", range(6))
def test_kernel_model_on_serving_steps(seed, heads):
    """The model on the GPU tests' serving-shaped steps (serving_rows, below)."""
    ids, ctx, max_len, width, programs = serving_rows(seed)
    table, ctas = ck.plan_torch(ids, ctx, max_len, width, heads, programs=programs)
    assert kernel_model(ids, ctx, max_len, width, programs, heads=heads) == (table.tolist(),
                                                                            ctas.tolist())


def test_the_head_count_sets_the_chunk():
    """Runs of 9 rows: chunks of 4 rows at 64 heads (rows 0, 4, 8 start
    chunks of 4, 4, 1 rows), of 8 at 32 (rows 0, 8: 8 and 1 rows); the model
    and plan_torch agree on both (and differ between them)."""
    ids = torch.tensor([5] * 9 + [6] * 9, dtype=torch.int32)
    ctx = torch.tensor([1000 + r for r in range(18)], dtype=torch.int32)
    got = {}
    for heads, starts in ((64, [0, 4, 8, 9, 13, 17]), (32, [0, 8, 9, 17])):
        table, ctas = ck.plan_torch(ids, ctx, 4096, 64, heads, programs=7)
        assert kernel_model(ids, ctx, 4096, 64, 7, heads=heads) == (table.tolist(),
                                                                     ctas.tolist())
        work = [row for row in table.tolist() if row[4] > 0]
        assert [row[0] for row in work] == starts
        assert max(row[1] for row in work) == cp.chunk_rows(heads)
        got[heads] = table
    assert not torch.equal(got[64], got[32])


def test_kernel_model_on_a_step_with_no_pages():
    ids = torch.tensor([3, 3, 4, 9, 9, 9], dtype=torch.int32)
    ctx = torch.zeros(6, dtype=torch.int32)
    for heads in (64, 32):
        table, ctas = ck.plan_torch(ids, ctx, 128, 2, heads, programs=5)
        assert kernel_model(ids, ctx, 128, 2, 5, threads=4, heads=heads) == (table.tolist(),
                                                                             ctas.tolist())
        assert ctas.tolist() == [[6, 0, 0, 0]] * 5


@pytest.mark.skipif(NVRTC is not None, reason=f"no NVRTC here: {NVRTC}")
@pytest.mark.parametrize("heads", [64, 32])
def test_nvrtc_builds_the_planner_for_sm90a_without_spills(heads):
    """The planner's build for each head count compiles for sm_90a to one
    kernel with no local memory, in the registers a 1024-thread CTA has (64
    per thread); its static shared memory and the most dynamic shared memory
    any row count asks for fit an SM (227 KB)."""
    cubin, log = cp.compile_cubin(extra=("--ptxas-options=-v",), heads=heads)
    assert cubin[:4] == b"\x7fELF"
    assert "plan_sm90" in log
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, log
    regs = int(log.split(" registers")[0].rsplit(" ", 1)[-1])
    assert regs <= 64, log
    static = int(log.split(" bytes smem")[0].rsplit(" ", 1)[-1])
    most = max(cp.stage_bytes(r) for r in (1, 1000, cp.TABLE_ROWS, cp.TABLE_ROWS + 1,
                                           cp.STAGE_ROWS, cp.STAGE_ROWS + 1))
    assert most == max(cp.stage_bytes(cp.TABLE_ROWS), cp.stage_bytes(cp.STAGE_ROWS))
    assert static + most <= 227 * 1024, (static, most)


@pytest.mark.skipif(NVRTC is not None, reason=f"no NVRTC here: {NVRTC}")
def test_the_builds_differ_by_head_count_and_refuse_others():
    """HEADS=32 is a build of its own (the chunk is in the code), the default
    build is the 64-head one, and the source refuses any other head count."""
    default, _ = cp.compile_cubin()
    assert cp.compile_cubin(heads=64)[0] == default
    assert cp.compile_cubin(heads=32)[0] != default
    assert cp.defines_for(64) == () and cp.defines_for(32) == ("HEADS=32",)
    with pytest.raises(RuntimeError, match="64 or 32 heads"):
        cp.compile_cubin(extra=("-DHEADS=16",))


_C_SIZES = {"int": 4, "i64": 8, "u64": 8}


def _kernel_signature(heads: int) -> list[tuple[str, int]]:
    """(name, bytes) of each parameter of plan_sm90, read from its source
    (``ByRows<T>``: one T per chunk size, two row groups of 128 // heads rows)."""
    with open(cp.SOURCE) as f:
        src = f.read()
    start = src.index("(", src.index(cp.KERNEL_NAME.decode() + "("))
    out = []
    for p in src[start + 1:src.index(")", start)].split(","):
        words = [w for w in p.replace("*", " * ").split() if w not in ("const", "__restrict__")]
        name, kind = words[-1], " ".join(words[:-1])
        if "*" in words:
            size = 8
        elif kind.startswith("ByRows<"):
            size = _C_SIZES[kind[len("ByRows<"):-1]] * 2 * (128 // heads)
        else:
            size = _C_SIZES[kind]
        out.append((name, size))
    return out


@pytest.mark.parametrize("heads", [64, 32])
def test_kernel_args_match_the_signature_and_the_cost_model(heads):
    """The launcher's kernel arguments name the kernel's parameters in order,
    each of its size at this head count (cuLaunchKernel copies that many
    bytes from each address); their values: the addresses and counts given,
    the KV cap, a page's cost for each chunk size as plan_torch's page_cost
    at this head count, floor((2^64 - 1) / d) for each divisor."""
    cost = (3, 1, 4)
    cut = random.randint(1, 5000)
    args = cp.kernel_args(0x1000, 0x2000, 77, 5000, 9, 132, 0x3000, 0x4000, heads=heads,
                          cost=cost, cut_items=cut)
    assert [(n, ctypes.sizeof(v)) for n, v in args.items()] == _kernel_signature(heads)
    group = ck.rows_per_group(heads)
    units = [ck.page_cost(cost, n, group) for n in range(1, ck.rows_max_for(heads, 1) + 1)]
    assert list(args["unit"]) == units
    assert units == ([8, 9, 14, 15] if heads == 64 else [8, 9, 10, 11, 16, 17, 18, 19])
    assert list(args["magic"]) == [(2**64 - 1) // u for u in units]
    assert args["magic_p"].value == (2**64 - 1) // 132
    scalars = {n: v.value for n, v in args.items() if n not in ("unit", "magic", "magic_p")}
    assert scalars == dict(ids_g=0x1000, ctx_g=0x2000, rows=77, cap=min(5000, 9 * 64),
                           programs=132, cut_items=cut, table=0x3000, ctas=0x4000)
    assert cp.kernel_args(0, 0, 1, 100, 9, 1, 0, 0, heads=heads)["cut_items"].value == 0
    assert cp.kernel_args(0, 0, 1, 2**40, 2**30, 1, 0, 0, heads=heads)["cap"].value == 2**31 - 1
    assert cp.kernel_args(0, 0, 1, 100, 9, 1, 0, 0, heads=heads)["cap"].value == 100


def test_the_planner_serves_the_logits_kernels_head_counts():
    """A build per head count the logits kernel has, each with its chunk."""
    assert sorted(cp.HEAD_COUNTS) == sorted(ck.HEAD_COUNTS) == sorted(ck.LAUNCHER_HEADS)
    for heads in cp.HEAD_COUNTS:
        assert cp.group_rows(heads) == ck.rows_per_group(heads)
        assert cp.chunk_rows(heads) == ck.rows_max_for(heads, 1)
    assert cp.HEADS == ck.HEADS == 64
    for call in (lambda: cp.chunk_rows(16), lambda: cp.defines_for(128),
                 lambda: cp.compile_cubin(heads=48),
                 lambda: cp.kernel_args(0, 0, 1, 64, 1, 1, 0, 0, heads=16)):
        with pytest.raises(ValueError, match="heads: expected 64 or 32"):
            call()


def test_shared_memory_layout_holds_every_row():
    """stage_bytes covers the kernel's layout: ids and context lengths at
    pad(i) (one padding word per 32), the table's 16-byte chunks at slot(q)
    (one padding slot per 8) after them, 16-byte aligned; nothing above
    STAGE_ROWS rows (global memory)."""
    for rows in [0, 1, 2, 31, 32, 33, 1000, 1024, 1025, 4095, 4096, 4097, 8191, 8192]:
        pad = rows + rows // 32 + 1            # words per array (pad(rows - 1) < pad(rows) + 1)
        words = (2 * pad + 3) & ~3
        need = 4 * words
        if 0 < rows <= cp.TABLE_ROWS:
            last = 2 * rows - 1
            need += 16 * (last + (last >> 3) + 1)
            assert len({q + (q >> 3) for q in range(2 * rows)}) == 2 * rows
        assert cp.stage_bytes(rows) == need
    assert cp.stage_bytes(cp.STAGE_ROWS + 1) == 0


def _div_by(a: int, d: int, magic: int | None = None) -> int:
    """The kernel's div_by: high word of a * magic (default: cp.magic(d)),
    raised while too small."""
    q = (a * (cp.magic(d) if magic is None else magic)) >> 64
    steps = 0
    while (q + 1) * d <= a:
        q += 1
        steps += 1
    assert steps <= 2
    return q


def test_division_by_multiply_is_exact():
    """div_by (CTA boundaries, a share's first item): exact, at most two
    correction steps, for the divisors it meets (CTA counts, a page's cost)."""
    rnd = random.Random(5)
    divisors = [1, 2, 3, 7, 11, 13, 15, 23, 132, 1023, 1024]
    divisors += [rnd.randint(1, 2**31) for _ in range(20)]
    for d in divisors:
        values = [0, 1, d - 1, d, d + 1, 2**40, 2**62 + 12345]
        for a in values + [rnd.randint(0, 2**62) for _ in range(200)]:
            assert _div_by(a, d) == a // d, (a, d)


def test_first_cta_estimate_is_made_exact():
    """first_cta_at: ceilf(a * P / C) in float32, then integer checks, equals
    ceil(a * P / C) (the least c with c * C >= a * P) with at most one step."""
    import numpy as np

    rnd = random.Random(7)
    for _ in range(3000):
        programs = rnd.choice([1, 7, 132, 1024])
        cost = rnd.choice([1, 15, rnd.randint(1, 10**6), rnd.randint(1, 2**45)])
        a = rnd.choice([0, cost, rnd.randint(0, cost)])
        ratio = np.float32(programs) / np.float32(cost)
        c = int(np.ceil(np.float32(a) * ratio))
        steps = 0
        while c > 0 and (c - 1) * cost >= a * programs:
            c -= 1
            steps += 1
        while c * cost < a * programs:
            c += 1
            steps += 1
        assert c == -(-a * programs // cost)
        assert steps <= 1


def test_plan_device_refuses_bad_inputs():
    ids = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices"):
        cp.plan_device(ids, ids, 64, 1)
    with pytest.raises(ValueError, match="heads: expected 64 or 32, got 16"):
        cp.plan_device(ids, ids, 64, 1, heads=16)


class _ReadingDriver:
    """cuda-python's driver for the launch only: each ``cuLaunchKernel`` reads
    the parameter values its pointer array points to *at the call* (the block
    is reused by the next launch), decoded with ``layout`` (ctypes types in
    the kernel's order)."""

    def __init__(self):
        self.launches = []
        self.layout = None
        self.ctx_param, self.rows = None, 0  # which value is the context lengths' address

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        ptrs = (ctypes.c_void_p * len(self.layout)).from_address(params)
        values = [bytes(t.from_address(p)) for t, p in zip(self.layout, ptrs)]
        ctx_addr = int.from_bytes(values[self.ctx_param], "little")
        self.launches.append(dict(grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                                  stream=stream, values=values, ctx_addr=ctx_addr,
                                  ctx=list((ctypes.c_int32 * self.rows).from_address(ctx_addr))))
        return (0,)


def test_eager_launch_hands_the_driver_a_fresh_blocks_values(monkeypatch):
    """plan_device's parameter block is made once per (heads, cost, CTAs) and
    refreshed per launch: every launch hands the driver exactly the values a
    block built afresh by kernel_args holds, the context lengths converted
    when they are not contiguous int32 (their values read back through the
    address handed over).  CPU tensors, the driver stubbed."""
    from vllm_dsa_varlen.bench import launch as host_time
    from vllm_dsa_varlen.ops import cuda_binding as cb

    drv = _ReadingDriver()
    monkeypatch.setattr(cb, "driver", lambda: drv)
    monkeypatch.setattr(cp, "load", lambda device, heads=cp.HEADS: type(
        "K", (), {"fn": "plan_sm90", "ctx": None})())
    monkeypatch.setattr(cp, "_stream", lambda index: 0x5EED)
    monkeypatch.setattr(cp, "_current_device", lambda: None)
    monkeypatch.setattr(cp, "_PARAMS", {})
    rng = random.Random()
    with host_time.fake_hopper():
        for _ in range(40):
            heads = rng.choice(cp.HEAD_COUNTS)
            cost = rng.choice([cp.COST, (rng.randint(0, 9), rng.randint(1, 9), rng.randint(0, 9))])
            rows, programs = rng.randint(1, 300), rng.choice([1, 7, 132, 1024])
            ids = torch.sort(torch.randint(0, rows, (rows,), dtype=torch.int32)).values
            ctx = torch.randint(0, 1 << 20, (rows, 1), dtype=rng.choice([torch.int32,
                                                                          torch.int64]))
            if rng.random() < 0.3:
                ctx = torch.randint(0, 1 << 20, (2, rows), dtype=torch.int32)[1]  # strided
            max_len, width = rng.randint(0, 1 << 22), rng.randint(0, 4096)
            out = cp.allocate(rows, programs, "cpu")
            want = cp.kernel_args(ids.data_ptr(), 0, rows, max_len, width, programs,
                                  out[0].data_ptr(), out[1].data_ptr(), heads=heads, cost=cost)
            drv.layout = [type(v) for v in want.values()]
            drv.ctx_param, drv.rows = list(want).index("ctx_g"), rows
            cp.plan_device(ids, ctx, max_len, width, heads=heads, programs=programs, cost=cost,
                           out=out)
            got = drv.launches[-1]
            assert got["grid"] == (1, 1, 1) and got["block"] == (cp.THREADS, 1, 1)
            assert got["smem"] == cp.stage_bytes(rows) and got["stream"] == 0x5EED
            assert got["ctx"] == ctx.reshape(-1).to(torch.int32).tolist()
            want["ctx_g"] = ctypes.c_uint64(got["ctx_addr"])
            assert got["values"] == [bytes(v) for v in want.values()]
    assert len(cp._PARAMS) <= 2 * 2 * 4 * 41  # one block per (heads, cost, CTAs)


# ---------------------------------------------------------------- GPU (sm_90)

def _skip_without_nvrtc():
    if NVRTC is not None:
        pytest.skip(f"no NVRTC: {NVRTC}")


POISON = -7  # what every output word holds before the planner writes it


def _poisoned(rows: int, programs: int):
    out = cp.allocate(rows, programs, "cuda")
    for t in out:
        t.fill_(POISON)
    return out


def _both(ids, ctx, max_len, width, programs, cost=ck.COST, heads=64, cut_items=0):
    """``plan_torch``'s schedule and the planner's, the latter written into
    poisoned outputs."""
    want = ck.plan_torch(ids.cuda(), ctx.cuda(), max_len, width, heads, programs=programs,
                         cost=cost, cut_items=cut_items)
    out = _poisoned(ids.numel(), programs)
    got = cp.plan_device(ids.cuda(), ctx.cuda(), max_len, width, heads=heads,
                         programs=programs, cost=cost, out=out, cut_items=cut_items)
    assert all(a is b for a, b in zip(got, out))
    return want, got


def _assert_same(want, got, what=""):
    for name, w, g in zip(("table", "ctas"), want, got):
        assert g.dtype == torch.int32 and g.shape == w.shape, (what, name)
        assert torch.equal(g, w), (what, name, (g != w).nonzero()[:5].tolist())


@pytest.fixture
def planner_calls(monkeypatch):
    """The head counts plan() launched the planner for (it still runs)."""
    calls = []

    def spy(*args, heads=cp.HEADS, **kwargs):
        calls.append(heads)
        return cp.plan_device(*args, heads=heads, **kwargs)

    monkeypatch.setattr(ck, "plan_device", spy)
    return calls


def serving_rows(seed: int):
    """A serving-shaped step as CPU tensors and ints ``(ids, ctx, max_len,
    width, programs)``: 1 to 256 requests, tokens per request uniform (n of 1
    to 8 each) or variable (1..4 or 1..8 each), KV lengths 1 to 128K
    (log-uniform; a request's tokens see contexts one apart, its last the
    KV length), one request in ten padding (context 0 on its rows), 0 to 16
    graph-padding rows after them (ids of their own, context 0); the
    device's SMs as CTAs mostly."""
    rnd = random.Random(seed)
    reqs = rnd.choice([1, 2, 256, rnd.randint(1, 256), rnd.randint(1, 256)])
    mode = rnd.choice(["uniform", "variable4", "variable8"])
    uniform = rnd.randint(1, 8)
    ids, ctx = [], []
    for req in range(reqs):
        n = uniform if mode == "uniform" else rnd.randint(1, 4 if mode == "variable4" else 8)
        kv = 0 if rnd.random() < 0.1 else max(n, min(131072, int(2 ** rnd.uniform(0, 17))))
        ids += [req] * n
        ctx += [max(0, kv - (n - 1 - j)) for j in range(n)]
    for k in range(rnd.randint(0, 16)):
        ids.append(reqs + k)
        ctx.append(0)
    max_len = max(1, max(ctx))
    width = -(-max_len // ck.PAGE) + rnd.choice([0, 0, 5])
    programs = rnd.choice([132, 132, 132, 1, 7, 1024])
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
            max_len, width, programs)


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("seed", range(300))
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_planner_matches_plan_torch_bitwise(seed, heads):
    """Odd steps (random_rows: negative and capped contexts, ids that come
    back, very long runs, up to 9000 rows), every cost form."""
    _skip_without_nvrtc()
    seed += 0 if heads == 64 else 10_000  # other steps at 32 heads
    ids, ctx, max_len, width, programs = random_rows(seed, max_rows=[600, 3000, 9000][seed % 3])
    cost = [ck.COST, (5, 2), (1, 0), (0, 1, 5)][seed % 4]
    want, got = _both(ids, ctx, max_len, width, programs, cost, heads)
    _assert_same(want, got, seed)


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("seed", range(200))
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_planner_cuts_as_plan_torch_does(seed, heads):
    """The planner's small-step cut, bit for bit plan_torch's, on either side
    of the threshold (odd steps of up to 9000 rows)."""
    _skip_without_nvrtc()
    rnd = random.Random(seed)
    ids, ctx, max_len, width, programs = random_rows(seed + 20_000 + heads,
                                                     max_rows=[300, 3000, 9000][seed % 3])
    plain = ck.plan_torch(ids, ctx.view(-1, 1), max_len, width, heads, programs=programs)
    cut, _ = _cut_threshold(rnd, int(plain[0][:, 4].sum()))
    want, got = _both(ids, ctx, max_len, width, programs, heads=heads, cut_items=cut)
    _assert_same(want, got, seed)


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("seed", range(200))
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_planner_matches_plan_torch_on_random_serving_steps(seed, heads, planner_calls):
    """Serving-shaped steps (serving_rows: uniform, variable 1..4 and 1..8
    tokens, padding requests, 1 to 256 requests, contexts up to 128K),
    through plan() (which takes the planner at both head counts)."""
    _skip_without_nvrtc()
    ids, ctx, max_len, width, programs = serving_rows(seed + (0 if heads == 64 else 20_000))
    want, got = _both(ids, ctx, max_len, width, programs, heads=heads,
                      cut_items=ck.cut_items_for(heads, programs))
    _assert_same(want, got, seed)
    _assert_same(want, ck.plan(ids.cuda(), ctx.cuda(), max_len, width, heads,
                               programs=programs), seed)
    assert planner_calls == [heads]


SERVING = [  # (requests, tokens per request, context), uniform and variable, as the benchmark's
    (1, 4, 8192), (8, 4, 131072), (16, 4, 16384), (64, 4, 32768), (64, 2, 32768), (64, 4, 8192),
    (128, 4, 8192), (256, 4, 8192), (256, 2, 4096), (64, 8, 8192), (256, 8, 8192),
    (1024, 8, 4096), (2048, 4, 2048)]


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("variable", [False, True])
@pytest.mark.parametrize("case", SERVING, ids=lambda c: f"B{c[0]}x{c[1]}L{c[2]}")
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_planner_matches_plan_torch_on_serving_steps(case, variable, heads, planner_calls):
    """Serving-shaped rows (plan_decode_rows), graph padding of 7 rows,
    with the launcher's defaults (the device's SMs): plan() takes the
    planner's build for the head count."""
    _skip_without_nvrtc()
    reqs, tokens, ctx_len = case
    rows, seqs, _, width = random_step_rows(reqs, tokens, ctx_len, variable=variable,
                                            seed=reqs + tokens)
    max_len = int(seqs.max())
    cut = ck.cut_items_for(heads, ck.num_sms(rows.indices.device))
    want = ck.plan_torch(rows.indices, rows.context_lens.view(-1, 1), max_len, width, heads,
                         cut_items=cut)
    got = ck.plan(rows.indices, rows.context_lens.view(-1, 1), max_len, width, heads)
    assert planner_calls == [heads]
    _assert_same(want, got)


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_planner_edge_steps(heads):
    """One row; one run of 9000 rows; 9000 single rows; 8192 rows (the most
    staged in shared memory) and 8193 (read from global memory); 4096 rows
    (the most whose table is built in shared memory) and 4097; 1025 (two
    rows per thread); runs of 7, 8 and 9 rows (a chunk's bounds at 32
    heads); no pages at all; every CTA count the kernel takes; outputs
    written in place (poisoned first)."""
    _skip_without_nvrtc()
    cases = [
        ([5], [1000], 131072, 2048, 132),
        ([5], [0], 131072, 2048, 132),
        ([7] * 9000, list(range(1, 9001)), 131072, 2048, 132),
        ([r // 3 for r in range(8192)], [(r * 37) % 5000 for r in range(8192)], 4096, 64, 132),
        ([r // 5 for r in range(8193)], [(r * 37) % 5000 for r in range(8193)], 4096, 64, 132),
        ([r // 2 for r in range(4096)], [(r * 53) % 9000 for r in range(4096)], 8192, 128, 132),
        ([r // 2 for r in range(4097)], [(r * 53) % 9000 for r in range(4097)], 8192, 128, 132),
        ([r // 7 for r in range(1025)], [3000] * 1025, 4096, 64, 132),
        ([0] * 7 + [1] * 8 + [2] * 9 + [3] * 16 + [4] * 17, [4000 + r for r in range(57)],
         8192, 128, 132),
        (list(range(9000)), [64 * (r % 7) + r % 3 for r in range(9000)], 512, 8, 132),
        ([1, 1, 2, 2, 2, 1, 1], [0, 0, 0, 0, 0, 0, 0], 64, 1, 1024),
        ([2, 2, 2, 2, 2], [300, 301, 302, 303, 304], 4096, 64, 1),
        ([2, 2, 2, 2, 2], [300, 301, 302, 303, 304], 4096, 64, 1024),
    ]
    for ids, ctx, max_len, width, programs in cases:
        ids_t = torch.tensor(ids, dtype=torch.int32)
        ctx_t = torch.tensor(ctx, dtype=torch.int32)
        want, got = _both(ids_t, ctx_t, max_len, width, programs, heads=heads)
        _assert_same(want, got, (len(ids), programs))


def small_uniform_rows(seed: int, heads: int = 64):
    """A small uniform step (1 to 8 requests of a chunk's tokens: 4 at 64
    heads, 8 at 32; KV lengths up to 8K: at most 1024 chunk pages, under the
    serving cut on 132 CTAs) as :func:`serving_rows` returns it."""
    rnd = random.Random(seed)
    n = ck.rows_max_for(heads, 0)
    ids, ctx = [], []
    for r in range(rnd.randint(1, 8)):
        kv = rnd.randint(n, 8192)
        ids += [r] * n
        ctx += [kv - n + 1 + j for j in range(n)]
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
            max(ctx), 128, 132)


@pytest.mark.parametrize("cut", ["none", "serving"])
@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_planner_replays_in_a_graph_with_new_contents_and_no_host_sync(heads, cut,
                                                                        no_host_sync):
    """Captured once into preallocated outputs; replays on new ids and
    context lengths (same row count) give each step's plan_torch exactly;
    neither the capture nor the launches sync with the host.  With the
    serving cut (at 64 and 32 heads) the replays fall on both sides of it: the
    captured planner decides each step's cut itself."""
    _skip_without_nvrtc()
    rows, programs = 2500, 132
    cut_items = 0 if cut == "none" else ck.cut_items_for(heads, programs)
    ids_buf = torch.zeros(rows, dtype=torch.int32, device="cuda")
    ctx_buf = torch.zeros(rows, dtype=torch.int32, device="cuda")
    out = cp.allocate(rows, programs, "cuda")
    cp.load("cuda", heads)
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(2):
            cp.plan_device(ids_buf, ctx_buf, 131072, 2048, heads=heads, programs=programs,
                           out=out, cut_items=cut_items)
            ck.plan(ids_buf, ctx_buf, 131072, 2048, heads, programs=programs)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        cp.plan_device(ids_buf, ctx_buf, 131072, 2048, heads=heads, programs=programs, out=out,
                       cut_items=cut_items)
    torch.cuda.current_stream().wait_stream(side)
    checked, was_cut = 0, 0
    for seed in range(40):
        if seed % 4 == 1:
            ids, ctx, _, _, _ = random_rows(seed + 1000, max_rows=rows)
        elif seed % 4 == 3:
            ids, ctx, _, _, _ = small_uniform_rows(seed + 1000, heads)
        else:
            ids, ctx, _, _, _ = serving_rows(seed + 1000)
        if ids.shape[0] < rows:  # pad as a graph pads: own ids, context 0
            pad = rows - ids.shape[0]
            ids = torch.cat([ids, int(ids.max()) + 1 + torch.arange(pad, dtype=torch.int32)])
            ctx = torch.cat([ctx, torch.zeros(pad, dtype=torch.int32)])
        ids, ctx = ids[:rows], ctx[:rows]
        ids_buf.copy_(ids)
        ctx_buf.copy_(ctx)
        for t in out:
            t.fill_(POISON)
        graph.replay()
        want = ck.plan_torch(ids_buf, ctx_buf, 131072, 2048, heads, programs=programs,
                             cut_items=cut_items)
        _assert_same(want, out, seed)
        plain = ck.plan_torch(ids_buf, ctx_buf, 131072, 2048, heads, programs=programs)
        was_cut += not torch.equal(want[0], plain[0])
        checked += 1
    assert checked == 40
    if cut_items:
        assert 5 <= was_cut <= 35, was_cut  # both sides of the threshold replayed


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("name,lens,seqs", [
    ("uniform", [4] * 40, None), ("variable", [1, 2, 3, 4, 3, 1, 4, 2] * 5, None),
    ("variable8", [1, 8, 5, 7, 2, 8, 3, 6] * 5, None),
    ("long_runs", [12, 16, 9], [700, 3000, 5000]), ("one_row", [1], [4000])])
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_logits_through_the_planner_match_the_reference(name, lens, seqs, heads, planner_calls):
    """The logits kernel reading the planner's schedule (the launcher's
    default plan on the GPU, at the step's head count) writes every valid
    position, close to the reference, and nothing else (poisoned output)."""
    _skip_without_nvrtc()
    gen = random.Random(len(name))
    seqs = seqs or [gen.randint(200, 9000) for _ in lens]
    step = make_decode_step(lens, seqs, heads=heads, padding_rows=3,
                            max_context_len=max(seqs) + 11,
                            seed=len(lens) + (0 if heads == 64 else 1), device="cuda")
    rows = step.rows
    sched = cp.plan_device(rows.indices, rows.context_lens, step.max_context_len,
                           rows.block_table.shape[1], heads=heads,
                           out=_poisoned(rows.num_rows, num_sms(rows.indices.device)))
    _assert_same(ck.plan_torch(rows.indices, rows.context_lens, step.max_context_len,
                               rows.block_table.shape[1], heads), sched)
    check_poisoned(step, run_poisoned(step, kernel="sm90_cuda", max_run_len=max(lens),
                                      schedule=sched))
    # and the launcher planning by itself (ck.plan -> the planner)
    assert planner_calls == []
    check_poisoned(step, run_poisoned(step, kernel="sm90_cuda", max_run_len=max(lens)))
    assert planner_calls == [heads]


@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_logits_in_a_graph_with_the_planner_inside(heads, planner_calls):
    """Planner + logits captured together, replayed after the step's contents
    change in place (new runs over the same rows, new context lengths, block
    tables, queries and weights): the logits match the reference each time."""
    _skip_without_nvrtc()
    from vllm_dsa_varlen.ops import launcher

    step = random_decode_step(32, 8 if heads == 32 else 4, 3000, heads=heads, device="cuda",
                              variable=True, seed=1)
    rows = step.rows
    args = launcher_args(step)
    out = torch.full((rows.num_rows, step.max_context_len), float("nan"), device="cuda")
    orig_bt = rows.block_table.clone()
    orig_ctx = rows.context_lens.cpu().tolist()

    def call():
        sched = ck.plan(rows.indices, rows.context_lens.view(-1, 1), step.max_context_len,
                        rows.block_table.shape[1], heads)
        launcher.varlen_paged_mqa_logits(*args, out=out, kernel="sm90_cuda", schedule=sched)

    from vllm_dsa_varlen.bench.graph import capture_graph

    graph = capture_graph(torch, call)
    assert planner_calls and set(planner_calls) == {heads}
    rnd = random.Random(3)
    for trial in range(4):
        ids, ctx, firsts, r = [], [], [], 0
        while r < rows.num_rows:
            n = min(rnd.randint(1, 2 * cp.chunk_rows(heads) - 2), rows.num_rows - r)
            kv = rnd.randint(0, orig_ctx[r]) if trial % 2 else orig_ctx[r]
            for j in range(n):
                ids.append(2 * r + trial)
                ctx.append(max(0, kv - (n - 1 - j)))
                firsts.append(r)
            r += n
        rows.indices.copy_(torch.tensor(ids, dtype=torch.int32))
        rows.context_lens.copy_(torch.tensor(ctx, dtype=torch.int32))
        rows.block_table.copy_(orig_bt[torch.tensor(firsts, device="cuda")])
        step.q.copy_(torch.randn(step.q.shape, device="cuda").to(step.q.dtype))
        step.weights.copy_(torch.randn_like(step.weights) / 8)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        padded = torch.full((out.shape[0] + 2, out.shape[1] + 40), float("nan"), device="cuda")
        padded[: out.shape[0], : out.shape[1]] = out
        check_poisoned(step, padded)
