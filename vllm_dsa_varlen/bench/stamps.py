"""``vllm-dsa-varlen-bench --stamps``: where the sm_90 CUDA kernel's time goes,
CTA by CTA, from timestamps the kernel's ``STAMPS=1`` build writes
(``ops/cuda/sm90_varlen_logits.cu``: a row of :data:`SLOTS` u64 per CTA in the
module global ``stamps_sm90``; the default build has none of it), and its
``STAMPS=2`` build's cycle counters per math warpgroup: waiting for a page,
the QK wgmma chain, the rest of the page.

Per case, one step (``requests,tokens,context`` as ``--builds`` takes them):
the build launched three times after an L2 flush each, the last launch's
stamps (zeroed before it) read back and summarised (:func:`summarize`): the
kernel's span from the first CTA's entry to the last math warpgroup's end,
how late the CTAs start (launch skew), the prologue (barrier set-up), the
wait for the first page, the math warpgroups' time and the tail (the span
past the median CTA's end), with the plan's items (pages x chunks) per CTA
and cycles per item; per page of a math warpgroup (median over the CTAs'
warpgroups), the cycles it waited for the page, spent in the QK wgmma chain
(issue to completion: its own tensor-core work and the wait for the other
warpgroups' in the queue) and in the rest (head sum, stores).  Clock cycles
become µs through the CTAs' global-timer and clock readings from entry to
ring 0's end, summed over the CTAs (the global timer ticks coarsely; the
start offsets carry its tick).  A timing of the stamped build is not the
default build's: its counters read the clock in the hot loop, so it runs a
little slower, the same for every build it compares; and a stamped build
leaves ``HALF_MMA`` off unless the build names ``HALF_MMA=1`` (with the
stamps, some NVRTCs serialise its wgmmas).

    vllm-dsa-varlen-bench --stamps [default RAMP=1 ...] [--cases 16,4,16384 64,4,8192 ...]
        [--heads 64|32] [--json f]
"""

from __future__ import annotations

import json
import statistics

SLOTS = 32       # u64 per CTA (STAMP_SLOTS in the source)
MAX_CTAS = 1024  # CTAs stamped (STAMP_CTAS)
SYMBOL = b"stamps_sm90"
DEFINES = ("STAMPS=2",)
# the slots (the source's comment names the same)
ENTRY_NS, ENTRY_CLK, READY_CLK, FIRST_PAGE_CLK, END_CLK, END_NS, SMID = 0, 1, 2, 3, 4, 8, 9
MATH_WGS = 4     # END_CLK + ring, ring < MATH_WGS
# STAMPS=2: from PROF (PROF_SLOT in the source), per math warpgroup: cycles
# waiting for pages, in the QK wgmma chain, in the page after its data; pages
PROF, PROF_WAIT, PROF_CHAIN, PROF_PAGE, PROF_PAGES = 16, 0, 1, 2, 3
CASES = ["16,4,16384", "64,4,8192", "1,4,8192", "64,4,32768", "128,4,8192"]


def summarize(stamps: list[list[int]], items: list[int]) -> dict:
    """The CTAs' rows of stamps (``stamps[c][slot]``) and the plan's items per
    CTA as one case's figures (µs, cycles); CTAs without items are counted
    but not timed (their warpgroups end at once)."""
    if len(stamps) != len(items):
        raise ValueError(f"stamps: {len(stamps)} CTA rows for {len(items)} CTAs' items")
    # ns per cycle: both timers from each CTA's entry to ring 0's end, summed
    # over the CTAs (the global timer's coarse ticks average out)
    clk = sum(row[END_CLK] - row[ENTRY_CLK] for row in stamps)
    wall = sum(row[END_NS] - row[ENTRY_NS] for row in stamps)
    if clk <= 0 or wall <= 0:
        raise ValueError("stamps: the timers did not advance (was the build stamped?)")
    ns = wall / clk
    t0 = min(row[ENTRY_NS] for row in stamps)
    start, prologue, first, math, end, per_item = [], [], [], [], [], []
    for row, n in zip(stamps, items):
        done = max(row[END_CLK + w] for w in range(MATH_WGS))
        s = (row[ENTRY_NS] - t0) / 1e3
        start.append(s)
        prologue.append((row[READY_CLK] - row[ENTRY_CLK]) * ns / 1e3)
        end.append(s + (done - row[ENTRY_CLK]) * ns / 1e3)
        if n > 0:
            if row[FIRST_PAGE_CLK]:
                first.append((row[FIRST_PAGE_CLK] - row[READY_CLK]) * ns / 1e3)
            math.append((done - row[READY_CLK]) * ns / 1e3)
            per_item.append((done - row[READY_CLK]) / n)
    span = max(end)

    def spread(xs):
        return {"median": statistics.median(xs), "max": max(xs)} if xs else None

    per_page = {"wait": [], "chain": [], "rest": []}  # cycles per page, per warpgroup
    for row in stamps:
        for w in range(MATH_WGS):
            wait, chain, page, pages = row[PROF + 4 * w: PROF + 4 * w + 4]
            if pages:
                per_page["wait"].append(wait / pages)
                per_page["chain"].append(chain / pages)
                per_page["rest"].append((page - chain) / pages)
    return {"ctas": len(stamps), "ctas_with_items": sum(1 for n in items if n > 0),
            "ns_per_cycle": ns, "span_us": span, "launch_skew_us": max(start),
            "prologue_us": spread(prologue), "first_page_us": spread(first),
            "math_us": spread(math), "tail_us": span - statistics.median(end),
            "items": spread([n for n in items if n > 0]),
            "cycles_per_item": spread(per_item),
            "page_cycles": {k: spread(v) for k, v in per_page.items()}
            if per_page["wait"] else None}


def line(got: dict) -> str:
    """One case's :func:`summarize` as a printed line ("-" where no CTA had items)."""
    def part(name: str, fmt: str = ".1f") -> str:
        v = got[name]
        return "-" if v is None else f"{v['median']:{fmt}} (max {v['max']:{fmt}})"

    text = (f"span {got['span_us']:.1f} us, skew {got['launch_skew_us']:.1f}, prologue "
            f"{part('prologue_us', '.2f')}, first page {part('first_page_us', '.2f')}, math "
            f"{part('math_us')}, tail {got['tail_us']:.1f}; items {part('items', '.0f')}, "
            f"cycles per item {part('cycles_per_item', '.0f')}")
    pages = got.get("page_cycles")
    if pages:
        text += "; a warpgroup's page, cycles: " + ", ".join(
            f"{name} {pages[key]['median']:.0f} (max {pages[key]['max']:.0f})"
            for key, name in (("wait", "wait"), ("chain", "wgmma chain"), ("rest", "rest")))
    return text


def _stamps_global(kern) -> tuple:
    """``(driver, address, bytes)`` of the loaded build ``kern``'s ``stamps_sm90``."""
    from ..ops import cuda_binding as cb

    drv = cb.driver()
    ptr, size = cb.ok(drv.cuModuleGetGlobal(kern.module, SYMBOL), "cuModuleGetGlobal")
    return drv, int(ptr), int(size)


def read_stamps(torch, kern, ctas: int) -> list[list[int]]:
    """The stamps of the last launch of the loaded build ``kern`` (its module's
    ``stamps_sm90``), ``ctas`` rows."""
    from ..ops import cuda_binding as cb

    if ctas > MAX_CTAS:
        raise ValueError(f"ctas: the build stamps {MAX_CTAS} CTAs, got {ctas}")
    drv, ptr, size = _stamps_global(kern)
    copy = torch.empty(MAX_CTAS * SLOTS, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    cb.ok(drv.cuMemcpyDtoD(copy.data_ptr(), ptr, min(size, copy.numel() * 8)), "cuMemcpyDtoD")
    torch.cuda.synchronize()
    return copy.view(MAX_CTAS, SLOTS)[:ctas].cpu().tolist()


def clear_stamps(torch, kern) -> None:
    """Zero the loaded build ``kern``'s stamps (so a CTA that did not stamp reads 0)."""
    from ..ops import cuda_binding as cb

    drv, ptr, size = _stamps_global(kern)
    torch.cuda.synchronize()
    cb.ok(drv.cuMemsetD8(ptr, 0, size), "cuMemsetD8")
    torch.cuda.synchronize()


def run(args) -> int:
    """``--stamps [BUILD ...]``: ``args.stamps`` (builds as ``--builds`` names
    them, cost models left out; none: the default build), ``cases``, ``heads``,
    ``json``."""
    import torch

    from .builds import BENCH_ONLY, parse_variant
    from .schedule import parse_case
    from ..ops import cuda_paged_mqa_logits as ck
    from .workloads import random_decode_step

    builds = args.stamps or ["default"]
    for name in builds:
        defines, cost = parse_variant(name)
        if cost is not None:
            raise SystemExit(f"--stamps: {name!r}: a cost model ('@') is --builds' only")
        if any(d.partition("=")[0] in BENCH_ONLY for d in defines):
            raise SystemExit(f"--stamps: {name!r}: {' and '.join(BENCH_ONLY)} are --builds' only")

    if not torch.cuda.is_available():
        raise SystemExit("--stamps: needs a CUDA GPU (sm_90)")
    heads = args.heads or 64
    if heads not in ck.HEAD_COUNTS:
        raise SystemExit(f"--stamps: the CUDA kernel serves {ck.HEAD_COUNTS} heads, got {heads}")
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    report = {"device": torch.cuda.get_device_name(), "heads": heads, "cases": []}
    for case in args.cases or CASES:
        reqs, tokens, context = parse_case(case)
        step = random_decode_step(reqs, abs(tokens), context, variable=tokens < 0, seed=0,
                                  device="cuda", heads=heads)
        rows = step.rows
        ctx = rows.context_lens.view(-1, 1)
        out = torch.empty(rows.num_rows, step.max_context_len, device="cuda")
        table, ctas = ck.plan(rows.indices, ctx, step.max_context_len,
                              rows.block_table.shape[1], heads)
        c = ctas.cpu().tolist()
        for name in builds:
            defines = parse_variant(name)[0] + DEFINES

            def call():
                flush.zero_()
                return ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                                 rows.indices, step.max_context_len, out,
                                 schedule=(table, ctas), defines=defines)

            call()  # loads the build
            kern = call()
            clear_stamps(torch, kern)
            call()
            got = summarize(read_stamps(torch, kern, len(c)), [hi - lo for _, lo, hi, _ in c])
            got["case"], got["build"] = case, name
            report["cases"].append(got)
            print(f"{case} {name}: {line(got)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
