"""The decode top-k kernel (ops/cuda_topk.py, cuda/decode_topk.cu) against
the torch reference's contract (``reference.topk_ref``,
``topk_selection_ok``): on the CPU a host model of the kernel's radix select
(its digits, bin search, early stop and tie slots) on random rows of many
value distributions, the launcher's checks and kernel arguments against the
kernel's signature, its NVRTC build; on an sm_90 GPU the kernel itself into
poisoned outputs (rows staged in shared memory and rows read from global
memory, aligned and unaligned rows, ties, infinities, every length edge,
k of 2048, 512 and 7) and inside a CUDA-graph replay with new contents."""

from __future__ import annotations

import ctypes
import math
import re
import zlib

import pytest
import torch

from vllm_dsa_varlen.ops import cuda_binding as cb
from vllm_dsa_varlen.ops import cuda_topk as ct
from vllm_dsa_varlen.ops.reference import topk_ref, topk_selection_ok

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
POISON = -7

NVRTC = None
try:
    cb.nvrtc()
except OSError as exc:  # pragma: no cover - depends on the environment
    NVRTC = str(exc)

KINDS = ("normal", "positive", "ties", "equal", "inf", "narrow", "negative", "block")


def random_logits(kind: str, rows: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """float32 ``[rows, width]`` of one value distribution (CPU)."""
    x = torch.randn(rows, width, generator=gen)
    if kind == "positive":   # relu-weighted head sums: non-negative, few octaves
        return x.abs() * 10
    if kind == "ties":
        return torch.randint(0, 40, (rows, width), generator=gen).float()
    if kind == "equal":
        return torch.ones(rows, width)
    if kind == "inf":
        x[torch.rand(rows, width, generator=gen) < 0.3] = float("-inf")
        x[:, ::997] = float("inf")
        return x
    if kind == "narrow":     # one exponent and the top mantissa bits shared
        return 1000 + x * 1e-4
    if kind == "negative":
        return -x.abs() - 1
    if kind == "block":      # 2048 columns in one top bin (all of it taken at k = 2048)
        return block_logits(rows, width, 2048, gen)
    return x * 3


def block_logits(rows: int, width: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """float32 ``[rows, width]``: normal values but ``count`` random columns
    per row at 100 ± 0.001 (one first-digit bin above all others)."""
    x = torch.randn(rows, width, generator=gen)
    cols = torch.rand(rows, width, generator=gen).argsort(dim=1)[:, :min(count, width)]
    x.scatter_(1, cols, 100 + torch.randn(rows, cols.shape[1], generator=gen) * 1e-3)
    return x


def random_lengths(rows: int, width: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[rows]``: every edge (0, 1, k - 1, k, k + 1, the width) then
    random lengths."""
    edges = [0, 1, k - 1, k, k + 1, width]
    rnd = torch.randint(0, width + 1, (rows,), generator=gen)
    out = [min(max(e, 0), width) for e in edges] + rnd.tolist()
    return torch.tensor(out[:rows], dtype=torch.int32)


# ------------------------------------------------------------ the host model

def order_keys(x: torch.Tensor) -> torch.Tensor:
    """The kernel's order-preserving keys of float32 ``x`` (as int64)."""
    b = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(b >= 0x80000000, (~b) & 0xFFFFFFFF, b | 0x80000000)


def model_select(row: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The kernel's steps for one row (int32 ``[k]``): three 11/11/10-bit
    digits, each histogram over the keys in the threshold's bin so far, the
    bin holding the ``k - above``-th key found from the top, stopping when it
    holds exactly the keys still needed; then every key above the threshold
    prefix and the first ``k - above`` equal to it."""
    out = torch.full((k,), -1, dtype=torch.int32)
    if n <= k:
        out[:n] = torch.arange(n, dtype=torch.int32)
        return out
    keys = order_keys(row[:n])
    prefix, shift, above = 0, 32, 0
    for sh, bits in ((21, 11), (10, 11), (0, 10)):
        inside = keys[(keys >> shift) == prefix]
        hist = torch.bincount((inside >> sh) & ((1 << bits) - 1), minlength=ct.BINS).tolist()
        need, seen = k - above, 0
        for b in range(ct.BINS - 1, -1, -1):
            if seen < need <= seen + hist[b]:
                break
            seen += hist[b]
        prefix, shift, above, in_bin = (prefix << bits) | b, sh, above + seen, hist[b]
        if in_bin == k - above:
            break
    pre = keys >> shift
    hi = torch.nonzero(pre > prefix).flatten()
    eq = torch.nonzero(pre == prefix).flatten()[: k - above]
    assert hi.numel() == above
    out[:] = torch.cat([hi, eq]).to(torch.int32)
    return out


def _bin_of(hist: list, need: int) -> tuple[int, int, int]:
    """(bin, keys in higher bins, keys in it) of the ``need``-th largest."""
    seen = 0
    for b in range(len(hist) - 1, -1, -1):
        if seen < need <= seen + hist[b]:
            return b, seen, hist[b]
        seen += hist[b]
    raise AssertionError("need past the keys counted")


def model_sampled(row: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, bool]:
    """A SAMPLE build's steps for one staged row of 1024-thread CTAs, and
    whether the sample decided it: in each trip of 4096 columns, the 128
    columns of every 8th warp, rotating with the trip (rows of at least 4
    trips), its bin of the expected rank of the k-th key
    plus 3 sqrt + 16, refined by the next 11 bits, a 22-bit threshold; where k
    to CAND keys pass, they are listed in the kernel's order (a thread's four
    columns of each trip, thread by thread) and narrowed from the top digit,
    the ties taken in list order; otherwise the plain steps."""
    span, stride = 4 * ct.THREADS, 8
    trips = -(-n // span)
    if n <= k or trips < 4 or n > ct.MAX_STAGE:
        return model_select(row, n, k), False
    keys = order_keys(row[:n])
    cols = torch.arange(n)
    sample = keys[((cols % span) // 128 + cols // span) % stride == 0]
    r = -(-k * sample.numel() // n)
    need = min(sample.numel(), r + 3 * int(math.sqrt(r)) + 16)
    top, before, _ = _bin_of(torch.bincount(sample >> 21, minlength=ct.BINS).tolist(), need)
    inside = sample[(sample >> 21) == top]
    low, _, _ = _bin_of(torch.bincount((inside >> 10) & 2047, minlength=ct.BINS).tolist(),
                        need - before)
    thr = (top << 11) | low
    order = ((cols % span) // 4 * trips + cols // span) * 4 + cols % 4  # (thread, trip, column)
    listed = cols[order.argsort()]
    listed = listed[(keys[listed] >> 10) >= thr]
    if not k <= listed.numel() <= ct.CAND:
        return model_select(row, n, k), False
    lk = keys[listed]
    prefix, shift, above, in_bin = 0, 32, 0, listed.numel()
    while in_bin != k - above and shift > 0:
        nxt = 21 if shift == 32 else 10 if shift == 21 else 0
        under = lk[(lk >> shift) == prefix] if shift < 32 else lk
        digit, seen, in_bin = _bin_of(torch.bincount((under >> nxt) & ((1 << (shift - nxt)) - 1),
                                                     minlength=ct.BINS).tolist(), k - above)
        prefix, shift, above = ((prefix << (shift - nxt)) if shift < 32 else 0) | digit, nxt, \
            above + seen
    pre = lk >> shift
    got = torch.cat([listed[pre > prefix], listed[pre == prefix][:k - above]])
    return got.to(torch.int32), True


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", [20000, 47000])
def test_sampled_host_model_meets_the_contract(kind, width):
    gen = torch.Generator().manual_seed(width + len(kind))
    logits = random_logits(kind, 12, width, gen)
    lens = random_lengths(12, width, 2048, gen)
    got = torch.full((12, 2048), -1, dtype=torch.int32)
    for r, n in enumerate(lens.tolist()):
        sel, _ = model_sampled(logits[r], n, 2048)
        got[r, :sel.numel()] = sel
    assert topk_selection_ok(logits, lens, 2048, got) == []


def test_the_sample_decides_serving_like_rows():
    """On rows like the indexer's (relu-weighted head sums, normal values) of
    16K-47K columns the sample's threshold passes k to CAND keys on nearly
    every row (the plain steps otherwise: right, slower); on rows of one
    value it never does."""
    gen = torch.Generator().manual_seed(3)
    decided = total = 0
    for kind in ("positive", "normal"):
        logits = random_logits(kind, 100, 47000, gen)
        for r, n in enumerate(torch.randint(16384, 47001, (100,), generator=gen).tolist()):
            _, took = model_sampled(logits[r], n, 2048)
            decided += took
            total += 1
    assert decided >= 0.99 * total, (decided, total)
    assert not model_sampled(torch.ones(30000), 30000, 2048)[1]


def test_the_sample_spans_rows_that_drift_with_position():
    """Logits that rise or fall along the row (a trend of 3 standard
    deviations end to end): a sample from one stretch would set the threshold
    far off; one spanning the row still decides nearly every row."""
    gen = torch.Generator().manual_seed(4)
    decided = total = 0
    for sign in (1.0, -1.0):
        for n in torch.randint(32768, 47001, (60,), generator=gen).tolist():
            row = torch.randn(n, generator=gen) + sign * 3.0 * torch.linspace(0, 1, n)
            decided += model_sampled(row, n, 2048)[1]
            total += 1
    assert decided >= 0.99 * total, (decided, total)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [2048, 7])
def test_host_model_meets_the_contract(kind, k):
    gen = torch.Generator().manual_seed(zlib.crc32(f'{kind} {k}'.encode()))
    width = 9000
    logits = random_logits(kind, 10, width, gen)
    lens = random_lengths(10, width, k, gen)
    got = torch.stack([model_select(logits[r], int(lens[r]), k) for r in range(10)])
    assert topk_selection_ok(logits, lens, k, got) == []


def test_the_checker_catches_wrong_selections():
    """topk_selection_ok refuses a smaller value swapped in, a repeated or
    out-of-range column, and a -1 slot too many."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 500, generator=gen)
    lens = torch.tensor([500, 300, 20])
    good = topk_ref(logits, lens, 16)
    assert topk_selection_ok(logits, lens, 16, good) == []
    worst = int(logits[0].argmin())
    for bad_row in (worst, int(good[0, 1]), 600):
        bad = good.clone()
        bad[0, 0] = bad_row
        assert topk_selection_ok(logits, lens, 16, bad)
    bad = good.clone()
    bad[2, 3] = -1
    assert topk_selection_ok(logits, lens, 16, bad)


# ------------------------------------------------------------ launcher, build

def test_check_args_names_the_bad_argument():
    logits = torch.zeros(4, 100)
    lens = torch.full((4,), 50, dtype=torch.int32)
    cases = [((logits.double(), lens, 8, None), "logits"),
             ((logits.t(), torch.zeros(100, dtype=torch.int32), 8, None), "logits"),
             ((logits, lens.float(), 8, None), "lengths"),
             ((logits, lens[:3], 8, None), "lengths"),
             ((logits, lens, 0, None), "k"),
             ((logits, lens, True, None), "k"),
             ((logits, lens, 8, torch.zeros(4, 8)), "out"),
             ((logits, lens, 8, torch.zeros(4, 9, dtype=torch.int32)), "out"),
             ((logits, lens, 8, torch.zeros(8, 4, dtype=torch.int32).t()), "out")]
    for args, name in cases:
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            ct.check_args(*args)
    with pytest.raises(ValueError, match="^logits: expected a CUDA tensor"):
        ct.decode_topk(logits, lens, 8)
    flat = ct.check_args(logits, lens.long().view(2, 2), 8, None)
    assert flat.dtype == torch.int32 and flat.shape == (4,) and flat.is_contiguous()
    ct.check_args(logits, lens, 8, torch.zeros(4, 20, dtype=torch.int32)[:, :8])


def test_kernel_args_match_the_signature():
    with open(ct.SOURCE) as f:
        src = f.read()
    start = src.index("(", src.index(ct.KERNEL_NAME.decode() + "("))
    sizes = {"int": 4, "i64": 8}
    want = []
    for p in src[start + 1:src.index(")", start)].split(","):
        words = [w for w in p.replace("*", " * ").split() if w not in ("const", "__restrict__")]
        want.append((words[-1], 8 if "*" in words else sizes[" ".join(words[:-1])]))
    args = ct.kernel_args(0x1000, 4096, 0x2000, 4000, 2048, 0x3000, 2048, 4000)
    assert [(n, ctypes.sizeof(v)) for n, v in args.items()] == want


class _ReadingDriver:
    """cuda-python's driver for the launch only: each ``cuLaunchKernel``
    reads the values its parameter pointer array points to *at the call*
    (the block is rewritten by the next launch), sized by ``kernel_args``'
    ctypes types in the kernel's order."""

    def __init__(self):
        self.launches = []
        self.types = [type(v) for v in ct.kernel_args(0, 0, 0, 0, 0, 0, 0, 0).values()]

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        ptrs = (ctypes.c_void_p * len(self.types)).from_address(params)
        self.launches.append(dict(fn=fn, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                                  stream=stream,
                                  values=[bytes(t.from_address(p)) for t, p in
                                          zip(self.types, ptrs)]))
        return (0,)


def test_every_launch_hands_the_driver_the_values_kernel_args_makes(monkeypatch):
    """decode_topk's (and launch_checked's) parameter block is made once and
    refilled per launch:
    each launch hands the driver exactly the values kernel_args makes afresh
    for its arguments (the lengths converted where they are not contiguous
    int32: their address then the converted copy's), with the plan's grid,
    block and shared memory, also where a shape comes again and its launch
    facts come from the last call's (``_last``).  CPU tensors, the driver
    stubbed."""
    import random

    from vllm_dsa_varlen.bench import launch as host_time

    drv = _ReadingDriver()
    monkeypatch.setattr(cb, "driver", lambda: drv)
    monkeypatch.setattr(ct, "load", lambda device, defines=(): type(
        "K", (), {"fn": "+".join(defines), "ctx": None})())
    monkeypatch.setattr(ct, "_stream", lambda index: 0x5EED)
    monkeypatch.setattr(ct, "_current_device", lambda: None)
    monkeypatch.setattr(ct, "num_sms", lambda index: 132)
    monkeypatch.setattr(ct, "_last", None)  # the stubbed builds' facts, not a real one's
    rng = random.Random()
    seen, shapes = [], []
    with host_time.fake_hopper():
        for _ in range(80):
            if shapes and rng.random() < 0.4:  # a shape again (as a step's next layer)
                rows, width, k, bound, defines = rng.choice(shapes)
            else:
                rows, width, k = rng.randint(1, 300), rng.randint(1, 200000), rng.choice([7, 2048])
                bound = rng.choice([None, rng.randint(1, 2 * width)])
                defines = rng.choice([None, ("SPLIT=2", "MINB=1"), ct.SHORT_ROWS])
                shapes.append((rows, width, k, bound, defines))
            logits = torch.empty(rows, width + rng.choice([0, 3]))[:, :width]
            lens = torch.randint(0, width + 1, (rows,), dtype=rng.choice([torch.int32,
                                                                          torch.int64]))
            out = torch.empty(rows, k + rng.choice([0, 5]), dtype=torch.int32)[:, :k]
            if defines is None and rng.random() < 0.5:  # topk.dispatch's call: the same launch
                ct.launch_checked(logits, lens, k, out, bound=bound)
            else:
                ct.decode_topk(logits, lens, k, out=out, defines=defines, bound=bound)
            got = drv.launches[-1]
            plan = defines or ct.launch_plan(rows, width if bound is None else min(width, bound),
                                             132, bounded=bound is not None)
            longest = width if bound is None else min(width, bound)
            split, lists = ct.split_of(plan), ct.listed(plan)
            lens_addr = int.from_bytes(got["values"][2], "little")
            if lens.dtype == torch.int32:
                assert lens_addr == lens.data_ptr()
            want = ct.kernel_args(logits.data_ptr(), logits.stride(0), lens_addr, width, k,
                                  out.data_ptr(), out.stride(0) if rows > 1 else k,
                                  ct.stage_for(longest, split, lists))
            assert got["values"] == [bytes(v) for v in want.values()]
            assert got["fn"] == "+".join(plan) and got["stream"] == 0x5EED
            assert got["grid"] == (rows * split, 1, 1)
            assert got["block"] == (ct.threads_of(plan), 1, 1)
            assert got["smem"] == ct.smem_bytes(longest, split, lists)
            seen.append(got["values"])
    assert len({tuple(v) for v in seen}) > 70  # the block is refilled, not frozen


def test_shared_memory_fits_at_every_width():
    with open(ct.SOURCE) as f:
        src = f.read()
    for name in ("THREADS", "BINS", "CAND", "BARS", "CHUNK"):
        assert f"#define {name} {getattr(ct, name)}" in src, name
    assert "int* sel = warp_sums + 2 * WARPS;" in src  # HEADER_BYTES' layout
    most = (ct.MAX_SMEM - ct.HEADER_BYTES - 8 * ct.CAND) // 4
    assert ct.HEADER_BYTES % 16 == 0 and ct.MAX_STAGE == most // 4 * 4
    for width in (1, 3, 4, 2048, most - 1, most, most + 1, 163840, 2**31 - 1):
        stage = ct.stage_for(width)
        assert stage % 4 == 0 and min(width, most - 3) <= stage <= most
        assert ct.smem_bytes(width) == ct.HEADER_BYTES + 4 * stage + 8 * ct.CAND <= ct.MAX_SMEM
        for split in (2, 4, 8):
            # the kernel's slice of the longest row: ceil(width / split) rounded up to 4
            slice_ = (-(-width // split) + 3) // 4 * 4
            assert ct.stage_for(width, split) == min(slice_, ct.MAX_STAGE)
            assert ct.smem_bytes(width, split) <= ct.smem_bytes(width)


def test_split_and_minb_of_a_build():
    assert ct.split_of(()) == 1 and ct.split_of(("MINB=2",)) == 1
    assert ct.split_of(("MINB=1", "SPLIT=4")) == 4
    assert ct.minb_of(()) == 1 and ct.minb_of(("SPLIT=4",)) == 1
    assert ct.minb_of(("SPLIT=1", "MINB=4")) == 4 and ct.minb_of(ct.SHORT_ROWS) == 4


BUILDS = ct.plan_builds()  # the only builds the source compiles


@pytest.mark.skipif(NVRTC is not None, reason=f"no NVRTC here: {NVRTC}")
@pytest.mark.parametrize("build", BUILDS, ids="+".join)
def test_nvrtc_builds_every_planned_build_without_spills(build):
    from vllm_dsa_varlen.ops.compile_check import compile_topk

    report = compile_topk(build)
    cap = 65536 // (ct.threads_of(build) * ct.minb_of(build))  # registers for MINB CTAs per SM
    assert report["spills"] == 0 and 0 < report["registers"] <= min(cap, 255), report


def _ptx(defines: tuple) -> str:
    """The kernel's PTX for a build (NVRTC, no GPU)."""
    code, _ = cb.compile_source(ct.SOURCE, extra=tuple(f"-D{d}" for d in defines), ptx=True)
    return code.decode()


SEL_WORDS = 4 * (ct.BINS + 2 * 32)  # the kernel's `sel` words (16): after the histogram and scratch


def early_sel_loads(ptx: str) -> list[str]:
    """Loads of a ``sel`` word (written by one thread, read by all after a
    barrier) that no barrier precedes in their basic block."""
    lines = ptx.splitlines()
    bad = []
    for n, line in enumerate(lines):
        m = re.search(r"ld\.shared\S*\s.*\[smem\+(\d+)\]", line)
        if not m or not SEL_WORDS <= int(m.group(1)) < SEL_WORDS + 64:
            continue
        for prev in reversed(lines[:n]):
            p = prev.strip()
            if p.startswith(("bar.sync", "barrier.sync", "barrier.cluster.wait")):
                break
            if p.endswith(":") or re.match(r"(@!?%p\d+\s+)?bra", p) or p.startswith("}"):
                bad.append(f"line {n + 1}: {line.strip()}")
                break
    return bad


@pytest.mark.skipif(NVRTC is not None, reason=f"no NVRTC here: {NVRTC}")
@pytest.mark.parametrize("build", BUILDS, ids="+".join)
def test_every_build_reads_the_shared_words_after_the_barrier(build):
    """The words one thread writes for all (``sel``: the bin, the counts,
    the keys passing the sample) are loaded after the barrier that publishes
    them, in every build: a load hoisted above it reads a stale value, and
    threads that disagree on it take different barriers (the SAMPLE builds
    did so through ``__restrict__`` parameters and hung)."""
    assert early_sel_loads(_ptx(build)) == []


def test_no_barrier_function_takes_a_writable_restrict_pointer():
    """A device function that reaches a CTA barrier (directly or through
    another) takes no non-const ``__restrict__`` pointer: through one the
    compiler may keep a value across ``__syncthreads()`` that another thread
    changed (the kernel's own parameters are global memory, not shared)."""
    with open(ct.SOURCE) as f:
        src = f.read()
    funcs = {m.group(1): m for m in re.finditer(
        r"__device__[^;{(]*?\b(\w+)\(([^)]*)\)\s*\{", src)}
    bodies = {}
    for name, m in funcs.items():
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        bodies[name] = src[m.end():i]
    barrier = {n for n, b in bodies.items() if "__syncthreads()" in b or "barrier.cluster" in b}
    while True:
        more = {n for n, b in bodies.items() if n not in barrier
                and any(re.search(rf"\b{c}\s*(<[^>]*>)?\(", b) for c in barrier)}
        if not more:
            break
        barrier |= more
    assert {"find_bin", "block_exclusive_scan", "narrow_list", "sampled_select"} <= barrier
    bad = [(n, p.strip()) for n in sorted(barrier) for p in funcs[n].group(2).split(",")
           if "__restrict__" in p and not p.strip().startswith("const")]
    assert bad == []


def test_only_the_planned_builds_are_taken():
    """decode_topk's ``defines``: one of plan_builds (absent macros at their
    defaults), else a ValueError naming ``defines`` before anything runs; the
    source refuses the others at compile time too."""
    logits, lens = torch.zeros(2, 8), torch.ones(2, dtype=torch.int32)
    for bad in [("SPLIT=8", "MINB=1"), ("THREADS=256", "LIST=0", "MINB=8"),
                ("SPLIT=4", "LIST=0", "MINB=1"), ("SPLIT=2", "MINB=2"), ("LIST=0",)]:
        with pytest.raises(ValueError, match="defines"):
            ct.decode_topk(logits, lens, 4, defines=bad)
    for build in ct.plan_builds():  # taken: the check passes, the CPU tensor is refused next
        with pytest.raises(ValueError, match="logits"):
            ct.decode_topk(logits, lens, 4, defines=build)
    for bad in [("SPLIT=2", "SAMPLE=1"), ("THREADS=512", "LIST=0", "MINB=4", "SAMPLE=1"),
                ("SPLIT=1", "MINB=2", "SAMPLE=1")]:
        with pytest.raises(ValueError, match="defines"):  # the sample: one CTA a row, listed
            ct.decode_topk(logits, lens, 4, defines=bad)
    with pytest.raises(ValueError, match="logits"):  # MINB=1 and LIST=1 are the defaults
        ct.decode_topk(logits, lens, 4, defines=("SPLIT=2",))
    if NVRTC is None:
        with pytest.raises(RuntimeError, match="not a build cuda_topk.plan_builds names"):
            ct.compile_cubin(extra=("-DSPLIT=8",))
        with pytest.raises(RuntimeError, match="SAMPLE is a build of one CTA a row"):
            ct.compile_cubin(extra=("-DSPLIT=2", "-DSAMPLE=1"))


def test_a_build_s_threads_list_and_shared_memory():
    assert ct.threads_of(()) == ct.THREADS and ct.threads_of(("THREADS=512",)) == 512
    assert ct.listed(()) and ct.listed(("LIST=1",)) and not ct.listed(("LIST=0",))
    for width in (1, 5000, ct.MAX_STAGE, 10**6):
        assert ct.smem_bytes(width, 1, False) == ct.HEADER_BYTES + 4 * ct.stage_for(width, 1, False)
        assert ct.stage_for(width, 1, False) >= ct.stage_for(width, 1, True)
        assert ct.smem_bytes(width, 1, False) <= ct.MAX_SMEM
    assert ct.stage_for(10**6, 1, False) == ct.MAX_STAGE_UNLISTED <= ct.BARS * ct.CHUNK


# ------------------------------------------------------------ on the GPU

def _run_poisoned(logits, lens, k, extra_cols=5, defines=(), bound=None):
    buf = torch.full((logits.shape[0] + 1, k + extra_cols), POISON, dtype=torch.int32,
                     device="cuda")
    ct.decode_topk(logits, lens, k, out=buf[:-1, :k], defines=defines, bound=bound)
    torch.cuda.synchronize()
    assert (buf[:, k:] == POISON).all() and (buf[-1] == POISON).all(), "written outside out"
    return buf[:-1, :k]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("build", BUILDS, ids="+".join)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", [3000, 33000, 60000, 200000])
@pytest.mark.parametrize("k", [2048, 512, 7])
def test_kernel_meets_the_contract(build, kind, width, k):
    """Every build the launch plan takes (1, 2 or 4 CTAs per row, a cluster
    summing its histograms; candidates listed in CTA 0 or narrowed over the
    slices; 512 or 1024 threads), slices staged in shared
    memory and slices longer than the stage read from global memory in
    every pass (60000 columns over one CTA, 200000 over up to four)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f'{build} {kind} {width} {k}'.encode()))
    rows = 12
    logits = random_logits(kind, rows, width, gen)
    lens = random_lengths(rows, width, k, gen)
    got = _run_poisoned(logits.cuda(), lens.cuda(), k, defines=build)
    assert topk_selection_ok(logits, lens, k, got.cpu()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sampled_build_on_rows_that_drift(sign):
    """The sampled builds on rows whose logits rise or fall along the row
    (no ties): the sets of the host model of the sampled path, which decides
    these rows from its sample (the contract either way)."""
    gen = torch.Generator().manual_seed(int(sign) + 7)
    rows, width, k = 16, 47000, 2048
    logits = torch.randn(rows, width, generator=gen) + sign * 3.0 * torch.linspace(0, 1, width)
    lens = torch.randint(32768, width + 1, (rows,), generator=gen, dtype=torch.int32)
    got = _run_poisoned(logits.cuda(), lens.cuda(), k, defines=ct.SAMPLED).cpu()
    assert topk_selection_ok(logits, lens, k, got) == []
    for r, n in enumerate(lens.tolist()):
        want, decided = model_sampled(logits[r], n, k)
        assert decided
        assert set(got[r].tolist()) == set(want.tolist()), r


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("build", [None, ct.SHORT_ROWS], ids=["plan", "+".join(ct.SHORT_ROWS)])
def test_unaligned_rows_and_wide_lengths(offset, build):
    """Rows that start off a 16-byte boundary (odd strides, a sliced start),
    lengths as int64 ``[B, next_n]``, lengths past the width (clamped) and
    negative (0)."""
    gen = torch.Generator().manual_seed(offset)
    base = torch.randn(9, 20001 + offset, generator=gen) * 5
    logits = base[:, offset:offset + 20000 - offset]  # stride 20001 + offset
    lens = torch.randint(0, 20000, (3, 3), generator=gen)
    lens[0, 0], lens[0, 1] = 10**6, -5
    got = _run_poisoned(logits.cuda(), lens.cuda(), 2048, defines=build)
    assert topk_selection_ok(logits, lens, 2048, got.cpu()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_replays_in_a_graph_with_new_contents():
    rows, width, k = 64, 40000, 2048
    logits = torch.empty(rows, width, device="cuda")
    lens = torch.empty(rows, dtype=torch.int32, device="cuda")
    out = torch.full((rows, k), POISON, dtype=torch.int32, device="cuda")
    logits.normal_()
    lens.fill_(width)
    ct.decode_topk(logits, lens, k, out=out)  # load before capture
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        ct.decode_topk(logits, lens, k, out=out)
    torch.cuda.current_stream().wait_stream(side)
    for seed in range(3):
        gen = torch.Generator().manual_seed(100 + seed)
        host = random_logits(KINDS[seed], rows, width, gen)
        hl = random_lengths(rows, width, k, gen)
        logits.copy_(host)
        lens.copy_(hl)
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert topk_selection_ok(host, hl, k, out.cpu()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("build", BUILDS, ids="+".join)
@pytest.mark.parametrize("k", [2048, 6000])
def test_first_bin_holding_exactly_the_keys_needed(build, k):
    """Full rows whose top first-digit bin holds exactly ``k`` keys (written
    straight out, also past the CAND list slots at k = 6000), and shorter
    rows where it holds fewer."""
    gen = torch.Generator().manual_seed(k)
    width = 40000
    logits = block_logits(8, width, k, gen)
    lens = torch.tensor([width] * 4 + [width - 1, 30000, k + 1, 20000], dtype=torch.int32)
    got = _run_poisoned(logits.cuda(), lens.cuda(), k, defines=build)
    assert topk_selection_ok(logits, lens, k, got.cpu()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("build", BUILDS, ids="+".join)
@pytest.mark.parametrize("k", [2048, 6000, 7])
@pytest.mark.parametrize("offset", [0, 1])
def test_every_build_on_block_rows_unaligned_rows_and_other_k(build, k, offset):
    """First bins holding exactly k keys (taken whole), rows off a 16-byte
    boundary (no bulk copies), k = 6000 (past CAND) and 7, in every build."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"split block {build} {k} {offset}".encode()))
    width = 90000  # staged from two CTAs per row up
    base = block_logits(8, width + offset, k, gen)
    logits = base[:, offset:]
    lens = torch.tensor([width] * 3 + [width - 1, 30000, k + 1, 20000, 5], dtype=torch.int32)
    got = _run_poisoned(logits.cuda(), lens.cuda(), k, defines=build)
    assert topk_selection_ok(logits, lens, k, got.cpu()) == []


@pytest.mark.parametrize("rows, bound, split, bounded_split", [
    (36, 98304, 2, 4), (48, 98304, 2, 4), (64, 98304, 2, 2),  # fours: 144, 192 CTAs; not 256
    (96, 65536, 1, 2), (128, 49152, 1, 2),                    # pairs: 192, 256 CTAs
    (128, 47760, 1, 1), (132, 90000, 1, 2), (133, 90000, 1, 1), (132, 98304, 1, 1), (16, 131072, 4, 4)])
def test_the_bounded_plan_doubles_the_split_where_it_was_measured_faster(rows, bound, split,
                                                                        bounded_split):
    """The H200's (132 SMs) timed shapes: an eager call's bound doubles the
    CTAs per row where the plan's slice is past the stage and the doubled
    one is not, within two waves for pairs and one and a half for fours; a
    slice the stage holds, more rows than SMs, or four CTAs already: no."""
    assert ct.split_of(ct.launch_plan(rows, bound, 132)) == split
    assert ct.split_of(ct.launch_plan(rows, bound, 132, bounded=True)) == bounded_split


def test_launch_plan_spreads_few_rows():
    """Every plan names a build among plan_builds(); it spreads rows over the
    SMs (up to SPREAD CTAs per row, doubling while twice as many still fit),
    and takes registers for two CTAs per SM only where there are more CTAs
    than SMs and two CTAs' shared memory fits an SM."""
    gen = torch.Generator().manual_seed(11)
    builds = set(ct.plan_builds())
    for _ in range(400):
        rows = int(torch.randint(1, 2000, (1,), generator=gen))
        longest = int(torch.randint(1, 9 * ct.MAX_STAGE, (1,), generator=gen))
        sms = int(torch.randint(1, 200, (1,), generator=gen))
        plan = ct.launch_plan(rows, longest, sms)
        assert plan in builds
        split, minb = ct.split_of(plan), ct.minb_of(plan)
        assert split in (1, 2, 4) and (split == 1 or rows * split <= sms)
        assert split == ct.SPREAD or rows * split * 2 > sms
        # under a host bound: once more where that stages the slice, within two CTAs per SM
        bounded = ct.launch_plan(rows, longest, sms, bounded=True)
        assert bounded in builds
        more = ct.split_of(bounded)
        def slice_(c):
            return (-(-longest // c) + 3) // 4 * 4
        waves = 2 * sms if split == 1 else sms * 3 // 2  # pairs: 2 waves; fours: 1.5
        if more != split:
            assert more == 2 * split <= ct.SPREAD and rows * more <= waves
            assert slice_(split) > ct.MAX_STAGE >= slice_(more)
        else:
            assert (split == ct.SPREAD or rows * 2 * split > waves
                    or slice_(split) <= ct.MAX_STAGE or slice_(2 * split) > ct.MAX_STAGE)
            assert bounded == plan
        fits = [c for c in (1, 2, 4) if c * (ct.smem_bytes(longest, 1, False) + 1024)
                <= ct.SM_SMEM]
        short = rows > sms and split == 1 and 4 in fits
        mid = (rows > sms and split == 1 and not short and 2 in fits
               and 2 * (ct.smem_bytes(longest) + 1024) > ct.SM_SMEM)
        assert (plan == ct.SHORT_ROWS) == short and (plan == ct.MID_ROWS) == mid
        if short or mid:
            assert longest <= ct.MAX_STAGE_UNLISTED  # every row of up to `longest` staged
            continue
        two = rows * split > sms and 2 * (ct.smem_bytes(longest, split) + 1024) <= ct.SM_SMEM
        assert (minb == 2) == two and ct.listed(plan) and ct.threads_of(plan) == 1024
        # a staged long row on one CTA at one per SM: first a threshold from a sample
        sampled = split == 1 and not two and ct.SAMPLE_FROM <= slice_(1) <= ct.MAX_STAGE
        assert (plan == ct.SAMPLED) == sampled


@pytest.mark.parametrize("rows,longest,plan", [
    (256, 32768, ("SPLIT=1", "MINB=1", "SAMPLE=1")),   # 64 requests x 4 tokens of 32K
    (128, 32768, ("SPLIT=1", "MINB=1", "SAMPLE=1")),   # x 2 tokens
    (256, 65536, ("SPLIT=1", "MINB=1")),               # past the stage: no sample
    (256, 16384, ("SPLIT=1", "MINB=2")),               # shorter than SAMPLE_FROM
    (64, 32768, ("SPLIT=2", "MINB=1")),                # split rows: no sample
])
def test_launch_plan_samples_staged_long_rows(rows, longest, plan):
    """The sampled build where the benchmark measured it faster (132 SMs):
    one CTA a row at one per SM, the longest row staged and of at least
    SAMPLE_FROM columns; elsewhere the plain builds."""
    assert ct.launch_plan(rows, longest, 132) == plan
    assert ct.launch_plan(rows, longest, 132, bounded=True) == plan


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("rows,width", [(3, 9000), (40, 21000), (200, 44000), (24, 160000),
                                        (300, 5000)])
def test_planned_launch_meets_the_contract(rows, width):
    """decode_topk(defines=None): the launch plan's build for the shape."""
    gen = torch.Generator().manual_seed(rows * width)
    logits = random_logits("normal", rows, width, gen)
    lens = random_lengths(rows, width, 2048, gen)
    got = _run_poisoned(logits.cuda(), lens.cuda(), 2048, defines=None)
    assert topk_selection_ok(logits, lens, 2048, got.cpu()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("bound", [1000, 30000, 10**6])
def test_a_bound_sizes_the_plan_not_the_result(bound):
    """``bound`` (a host bound on the lengths) sizes the plan and the stage:
    rows past it are read from global memory and still meet the contract."""
    gen = torch.Generator().manual_seed(bound)
    logits = random_logits("normal", 40, 60000, gen)
    lens = random_lengths(40, 60000, 2048, gen)
    got = _run_poisoned(logits.cuda(), lens.cuda(), 2048, defines=None, bound=bound)
    assert topk_selection_ok(logits, lens, 2048, got.cpu()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("rows,width,bound", [(40, 33000, 33000), (128, 44000, 44000),
                                              (200, 9000, 9000), (24, 160000, None)])
def test_no_host_sync_in_eager_top_k_calls(rows, width, bound, no_host_sync):
    """The project's top-k as the dispatch calls it on an eager step (the
    plan's build for the call: split, staged, sampled where it applies) never
    waits on the device once its build is loaded: an engine step's host work
    keeps running ahead of the GPU."""
    gen = torch.Generator().manual_seed(rows * 7 + width)
    logits = random_logits("normal", rows, width, gen).cuda()
    lens = random_lengths(rows, width, 2048, gen).cuda()
    out = torch.full((rows, 2048), POISON, dtype=torch.int32, device="cuda")
    ct.launch_checked(logits, lens, 2048, out, bound=bound)  # the build loaded
    torch.cuda.synchronize()
    out.fill_(POISON)
    with no_host_sync():
        for _ in range(2):
            ct.launch_checked(logits, lens, 2048, out, bound=bound)
    assert topk_selection_ok(logits.cpu(), lens.cpu(), 2048, out.cpu()) == []
