"""vllm_dsa_varlen/bench/stamps.py (``vllm-dsa-varlen-bench --stamps``): the
summary of the kernel's per-CTA timestamps on synthetic stamps, the stamped
build through NVRTC (no GPU needed), and on a GPU the stamped build's logits
and stamps."""

import random
import re
import statistics

import pytest
import torch

from vllm_dsa_varlen.bench import logits as bench
from vllm_dsa_varlen.bench import stamps as st
from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck

NVRTC = None
try:
    ck._nvrtc()
except OSError as exc:  # pragma: no cover - depends on the environment
    NVRTC = str(exc)


def _synthetic(rng, ctas, ghz, tick_ns):
    """Stamps of ``ctas`` CTAs with known parts (µs), the global timer in
    ``tick_ns`` ticks, the clock at ``ghz``; returns (stamps, items, truth)."""
    truth = {"start": [], "prologue": [], "first": [], "math": [], "end": [], "cpi": [],
             "wait": [], "chain": [], "rest": []}
    stamps, items = [], []
    base_ns, base_clk = rng.randrange(10**12, 10**13), rng.randrange(10**9, 10**10)
    for c in range(ctas):
        start = rng.uniform(0, 3.0)
        prologue, first = rng.uniform(0.3, 0.8), rng.uniform(0.5, 2.0)
        n = 0 if rng.random() < 0.15 else rng.randint(5, 60)
        per_item = rng.uniform(900, 1200)  # cycles
        math = n * per_item / (ghz * 1e3) + first if n else 0.05
        ends = [math - (rng.uniform(0, 0.3) if w else 0.0) for w in range(st.MATH_WGS)]
        clk0 = base_clk + rng.randrange(10**6)  # each SM's clock has its own origin

        def cyc(us):
            return clk0 + round(us * ghz * 1e3)

        t_entry = base_ns + start * 1e3
        row = [0] * st.SLOTS
        row[st.ENTRY_NS] = int(t_entry // tick_ns * tick_ns)
        row[st.ENTRY_CLK] = cyc(0)
        row[st.READY_CLK] = cyc(prologue)
        row[st.FIRST_PAGE_CLK] = cyc(prologue + first) if n else 0
        for w in range(st.MATH_WGS):
            row[st.END_CLK + w] = cyc(prologue + ends[w])
        row[st.END_NS] = int((t_entry + (prologue + ends[0]) * 1e3) // tick_ns * tick_ns)
        row[st.SMID] = c % 132
        for w in range(st.MATH_WGS):  # STAMPS=2's counters: per-page parts, summed
            pages = n // st.MATH_WGS + (w < n % st.MATH_WGS)
            if pages:
                parts = {"wait": rng.uniform(0, 300), "chain": rng.uniform(400, 900),
                         "rest": rng.uniform(100, 400)}
                for key, value in parts.items():
                    truth[key].append(value)
                base = st.PROF + 4 * w
                row[base + st.PROF_WAIT] = round(parts["wait"] * pages)
                row[base + st.PROF_CHAIN] = round(parts["chain"] * pages)
                row[base + st.PROF_PAGE] = round((parts["chain"] + parts["rest"]) * pages)
                row[base + st.PROF_PAGES] = pages
        stamps.append(row)
        items.append(n)
        truth["start"].append(start)
        truth["prologue"].append(prologue)
        if n:
            truth["first"].append(first)
            truth["math"].append(max(ends))
            truth["cpi"].append(max(ends) * ghz * 1e3 / n)
        truth["end"].append(start + prologue + max(ends))
    return stamps, items, truth


@pytest.mark.parametrize("seed", range(6))
def test_summary_recovers_the_parts_of_a_known_kernel(seed):
    """Synthetic CTAs with known start, prologue, first-page wait and math time
    (the clock at a known rate, the global timer in coarse ticks): the summary
    gives them back, µs and cycles per item, to the timers' resolution."""
    rng = random.Random(seed)
    ghz = rng.uniform(1.4, 2.0)
    stamps, items, truth = _synthetic(rng, rng.randint(40, 132), ghz, rng.choice([1, 32, 1000]))
    got = st.summarize(stamps, items)
    assert got["ns_per_cycle"] == pytest.approx(1 / ghz, rel=0.02)
    t0 = min(truth["start"])
    assert got["launch_skew_us"] == pytest.approx(max(truth["start"]) - t0, abs=1.01)
    assert got["span_us"] == pytest.approx(max(truth["end"]) - t0, abs=1.1)
    assert got["prologue_us"]["median"] == pytest.approx(statistics.median(truth["prologue"]),
                                                         rel=0.03)
    assert got["math_us"]["max"] == pytest.approx(max(truth["math"]), rel=0.03)
    assert got["first_page_us"]["max"] == pytest.approx(max(truth["first"]), rel=0.03)
    assert got["ctas"] == len(stamps)
    assert got["ctas_with_items"] == sum(1 for n in items if n)
    assert got["items"]["max"] == max(items)
    for part in ("cycles_per_item", "math_us", "first_page_us"):
        key = {"cycles_per_item": "cpi", "math_us": "math", "first_page_us": "first"}[part]
        assert got[part]["median"] == pytest.approx(statistics.median(truth[key]), rel=0.03)
    for key in ("wait", "chain", "rest"):  # per page of a warpgroup, cycles
        assert got["page_cycles"][key]["median"] == pytest.approx(
            statistics.median(truth[key]), abs=1.0)
        assert got["page_cycles"][key]["max"] == pytest.approx(max(truth[key]), abs=1.0)
    assert "wgmma chain" in st.line(got)


def test_a_build_without_counters_summarises_without_them():
    """STAMPS=1 rows (no counters): the summary and its line leave them out."""
    rng = random.Random(7)
    stamps, items, _ = _synthetic(rng, 60, 1.7, 32)
    for row in stamps:
        row[st.PROF:st.PROF + 4 * st.MATH_WGS] = [0] * (4 * st.MATH_WGS)
    got = st.summarize(stamps, items)
    assert got["page_cycles"] is None and "wgmma" not in st.line(got)

def test_bad_stamps_are_refused_naming_them():
    with pytest.raises(ValueError, match="stamps: 2 CTA rows for 3 CTAs"):
        st.summarize([[0] * st.SLOTS] * 2, [1, 1, 1])
    with pytest.raises(ValueError, match="stamps: the timers did not advance"):
        st.summarize([[0] * st.SLOTS] * 3, [1, 1, 1])


def test_the_slots_match_the_kernel_source():
    """The host's slot count, CTA count and symbol are the source's."""
    src = ck.source()
    assert int(re.search(r"#define STAMP_SLOTS (\d+)", src).group(1)) == st.SLOTS
    assert int(re.search(r"#define STAMP_CTAS (\d+)", src).group(1)) == st.MAX_CTAS
    assert int(re.search(r"#define PROF_SLOT (\d+)", src).group(1)) == st.PROF
    assert st.PROF + 4 * st.MATH_WGS <= st.SLOTS and st.PROF > st.SMID
    assert f"stamps_sm90[STAMP_CTAS * STAMP_SLOTS]" in src
    assert st.SYMBOL == b"stamps_sm90" and st.DEFINES == ("STAMPS=2",)
    assert max(st.SMID, st.END_NS, st.END_CLK + st.MATH_WGS - 1) < st.SLOTS


@pytest.mark.skipif(NVRTC is not None, reason=f"no NVRTC here: {NVRTC}")
@pytest.mark.parametrize("heads", ck.HEAD_COUNTS)
@pytest.mark.parametrize("level", [1, 2])
def test_the_stamped_build_compiles_without_spills_and_only_it_has_stamps(heads, level):
    """The STAMPS=1 and =2 builds (64 and 32 heads) through NVRTC: no spills,
    no wgmma serialization, the stamps' symbol in its cubin and not in the
    default build's."""
    extra = () if heads == ck.HEADS else (f"-DHEADS={heads}",)
    stamped, log = ck.compile_cubin(extra=("--ptxas-options=-v", f"-DSTAMPS={level}", *extra))
    plain, _ = ck.compile_cubin(extra=extra)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, log
    assert "serializ" not in log.lower(), log  # the stamps keep the wgmma pipeline as it is
    assert st.SYMBOL in stamped and st.SYMBOL not in plain


@pytest.mark.parametrize("builds", [[], ["default", "RAMP=1"]])
def test_stamps_needs_a_gpu(monkeypatch, builds):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--stamps: needs a CUDA GPU"):
        bench.main(["--stamps", *builds])


def test_stamps_refuses_a_cost_model_naming_the_build():
    with pytest.raises(SystemExit, match="--stamps: 'RAMP=1@5,2': a cost model"):
        bench.main(["--stamps", "RAMP=1@5,2"])


@pytest.mark.parametrize("build", ["RUN_ROWS=2", "EVICT_FIRST=1+CUT_ITEMS=0"])
def test_stamps_refuses_the_bench_only_plan_tokens(build):
    with pytest.raises(SystemExit, match=re.escape(f"--stamps: '{build}': RUN_ROWS and CUT_ITEMS")):
        bench.main(["--stamps", build])


@pytest.mark.gpu
@pytest.mark.skipif(NVRTC is not None, reason=f"no NVRTC here: {NVRTC}")
def test_the_stamped_build_on_the_gpu_keeps_the_logits_and_stamps_every_cta():
    """On sm_90: the stamped build's logits are the default build's and the
    reference's (outputs poisoned first), every CTA stamps its entry, set-up
    and end, and the summary's parts fit inside the span."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUDA kernel is sm_90")
    from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask
    from vllm_dsa_varlen.bench.workloads import random_decode_step

    step = random_decode_step(16, 4, 4096, seed=3, device="cuda")
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    table, ctas = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1], 64)

    def run(defines):
        out = torch.full((rows.num_rows, step.max_context_len), float("nan"), device="cuda")
        kern = ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                         step.max_context_len, out, schedule=(table, ctas), defines=defines)
        return kern, out

    plain = run(())[1]
    kern, _ = run(st.DEFINES)
    st.clear_stamps(torch, kern)
    _, out = run(st.DEFINES)
    ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                               step.max_context_len, indices=rows.indices)
    mask = valid_mask(ctx, step.max_context_len, rows.indices)
    assert torch.isnan(out[~mask]).all()
    # the stamps change no arithmetic: the default build's logits, bit for bit
    assert torch.equal(out[mask], plain[mask])
    # and the reference within the default build's bound (fp8 products accumulate
    # on the tensor cores with fewer bits than fp32: measured 1.3e-4 here)
    assert float((out[mask] - ref[mask]).norm() / ref[mask].norm()) < 1e-3
    c = ctas.cpu().tolist()
    stamps = st.read_stamps(torch, kern, len(c))
    assert all(r[st.ENTRY_NS] and r[st.ENTRY_CLK] < r[st.READY_CLK] for r in stamps)
    assert all(r[st.READY_CLK] <= r[st.END_CLK + w] for r in stamps for w in range(st.MATH_WGS))
    items = [hi - lo for _, lo, hi, _ in c]
    got = st.summarize(stamps, items)
    assert 0 < got["math_us"]["max"] <= got["span_us"] < 1e4
    for row, n in zip(stamps, items):  # the counters: every item a page of one warpgroup
        prof = [row[st.PROF + 4 * w: st.PROF + 4 * w + 4] for w in range(st.MATH_WGS)]
        assert sum(p[st.PROF_PAGES] for p in prof) == n
        for w, (wait, chain, page, _) in enumerate(prof):
            assert chain <= page and wait + page <= row[st.END_CLK + w] - row[st.READY_CLK]
    assert 0.3 < got["ns_per_cycle"] < 1.0  # a 1-3 GHz clock


def test_the_printed_line_names_every_part_and_survives_a_step_without_items():
    rng = random.Random(11)
    stamps, items, _ = _synthetic(rng, 20, 1.8, 32)
    text = st.line(st.summarize(stamps, items))
    for word in ("span", "skew", "prologue", "first page", "math", "tail", "items",
                 "cycles per item"):
        assert word in text
    empty = st.summarize(stamps, [0] * len(items))
    assert empty["math_us"] is None and empty["ctas_with_items"] == 0
    assert "math -" in st.line(empty)
