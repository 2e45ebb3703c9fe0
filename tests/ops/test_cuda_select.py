"""The many-CTA decode top-k (ops/cuda_select.py, cuda/row_select.cu): on the
CPU a host model of its steps (the first digit's bin from the row histogram,
the bin taken whole or listed and narrowed by two more digits, column-order
slots) against the reference's first-ties selection (``topk_first_ties``) and
contract (``topk_selection_ok``), the launcher's plan, checks and kernel
arguments, the NVRTC builds; on an sm_90 GPU the kernels themselves into
poisoned outputs, equal to the host model slot for slot, repeatable bit for
bit, inside a CUDA-graph replay with new contents."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from vllm_dsa_varlen.ops import cuda_binding as cb
from vllm_dsa_varlen.ops import cuda_select as cs
from vllm_dsa_varlen.ops.reference import order_keys, topk_first_ties, topk_selection_ok
from topk_samples import KINDS, block_logits, random_lengths, random_logits

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
POISON = -7

NVRTC = None
try:
    cb.nvrtc()
except OSError as exc:  # pragma: no cover - depends on the environment
    NVRTC = str(exc)


# ------------------------------------------------------------ the host model

def find_bin(hist: list, need: int) -> tuple[int, int, int]:
    """(bin, keys in higher bins, keys in it) of the bin holding the
    ``need``-th largest key counted in ``hist``."""
    seen = 0
    for b in range(len(hist) - 1, -1, -1):
        if seen < need <= seen + hist[b]:
            return b, seen, hist[b]
        seen += hist[b]
    raise AssertionError("need past the keys counted")


def model_select(row: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The kernels' output for one row, slot for slot (int32 ``[k]``): the
    keys above the first digit's threshold bin in column order, then the
    bin's keys in column order where they are exactly the ones still needed,
    else the bin narrowed by 11 then 10 more bits (each step stopping where
    the prefix's keys are exactly those needed): its keys above the final
    prefix in column order, then the first of those equal to it."""
    out = torch.full((k,), -1, dtype=torch.int32)
    if n <= k:
        out[:n] = torch.arange(n, dtype=torch.int32)
        return out
    keys = order_keys(row[:n])
    top = keys >> 21
    b, above, in_bin = find_bin(torch.bincount(top, minlength=cs.BINS).tolist(), k)
    need = k - above
    hi = torch.nonzero(top > b).flatten()
    cand = torch.nonzero(top == b).flatten()
    if in_bin == need:
        return torch.cat([hi, cand]).to(torch.int32)
    ck = keys[cand]
    prefix, shift, want, count = b, 21, need, in_bin
    while count != want and shift > 0:
        nxt = 10 if shift == 21 else 0
        inside = ck[(ck >> shift) == prefix]
        digit, before, count = find_bin(
            torch.bincount((inside >> nxt) & ((1 << (shift - nxt)) - 1),
                           minlength=cs.BINS).tolist(), want)
        prefix, shift, want = (prefix << (shift - nxt)) | digit, nxt, want - before
    p = ck >> shift
    return torch.cat([hi, cand[p > prefix], cand[p == prefix][:want]]).to(torch.int32)


def model(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    width = logits.shape[1]
    lens = lengths.reshape(-1).long().clamp(0, width).tolist()
    return torch.stack([model_select(logits[r], n, k) for r, n in enumerate(lens)])


def same_sets(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [2048, 7])
def test_host_model_selects_the_first_ties_set(kind, k):
    gen = torch.Generator().manual_seed(len(kind) * 31 + k)
    width = 9000
    logits = random_logits(kind, 24, width, gen)
    lens = random_lengths(24, width, k, gen)
    got = model(logits, lens, k)
    assert topk_selection_ok(logits, lens, k, got) == []
    assert same_sets(got, topk_first_ties(logits, lens, k))


def test_host_model_takes_every_path():
    """The three ways a row ends: the first bin taken whole, the bin
    narrowed to a prefix of exactly the keys needed, ties at the full key."""
    gen = torch.Generator().manual_seed(5)
    whole = block_logits(1, 6000, 2048, gen)[0]       # 2048 keys alone in the top bin
    keys = order_keys(whole)
    top = keys >> 21
    assert int((top == top.max()).sum()) == 2048
    assert same_sets(model_select(whole, 6000, 2048)[None],
                     topk_first_ties(whole[None], torch.tensor([6000]), 2048))
    tied = torch.ones(6000)                            # every key equal: the lowest columns
    assert torch.equal(model_select(tied, 6000, 100), torch.arange(100, dtype=torch.int32))


def test_first_ties_reference_takes_the_lowest_tied_columns():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    got = topk_first_ties(logits, torch.tensor([7]), 4)
    assert got.tolist() == [[1, 3, 2, 4]]
    assert topk_first_ties(logits, torch.tensor([3]), 4).tolist() == [[0, 1, 2, -1]]
    signed = torch.tensor([[-0.0, 0.0]])                # -0.0 orders below +0.0
    assert topk_first_ties(signed, torch.tensor([2]), 1).tolist() == [[1]]


# ------------------------------------------------------------ the launcher

@pytest.mark.parametrize("rows, width, sms, items", [
    (4, 8192, 132, 4),          # B1 x 4 tokens: the smallest slices
    (64, 16384, 132, 8),        # 64 rows x 8 slices of 2048 = 512 CTAs > 264: 4 of 4096
    (16, 16384, 132, 4),
    (256, 32768, 132, 16),      # no build within one wave: the fewest CTAs
])
def test_plan_items_keeps_one_wave_where_a_build_can(rows, width, sms, items):
    got = cs.plan_items(rows, width, sms)
    fits = [i for i in cs.ITEMS_BUILDS if rows * cs.slices(width, i) <= cs.CTAS_PER_SM * sms]
    assert got == (fits[0] if fits else cs.ITEMS_BUILDS[-1]) == items


def test_slices_cover_the_width():
    for items in cs.ITEMS_BUILDS:
        for width in (1, 2047, 2048, 8192, 8193, 163840):
            s = cs.slices(width, items)
            assert (s - 1) * cs.THREADS * items < width <= s * cs.THREADS * items


def test_bad_input_names_the_argument():
    logits = torch.zeros(4, 100)
    lens = torch.full((4,), 100, dtype=torch.int32)
    with pytest.raises(ValueError, match="^logits: expected a CUDA tensor"):
        cs.select_topk(logits, lens, 8)
    with pytest.raises(ValueError, match="^items: expected one of"):
        cs.load(torch.device("cpu"), 5)


def _signature(name: str) -> list[tuple[str, int]]:
    with open(cs.SOURCE) as f:
        src = f.read()
    start = src.index("(", src.index(name + "("))
    sizes = {"int": 4, "i64": 8}
    want = []
    for p in src[start + 1:src.index(")", start)].split(","):
        words = [w for w in p.replace("*", " * ").split() if w not in ("const", "__restrict__")]
        want.append((words[-1], 8 if "*" in words else sizes[" ".join(words[:-1])]))
    return want


def test_kernel_args_match_the_signatures():
    hist = cs.hist_args(1, 2, 3, 4, 5, 6, 7)
    sel = cs.select_args(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
    assert [(n, ctypes.sizeof(v)) for n, v in hist.items()] == _signature("row_hist")
    assert [(n, ctypes.sizeof(v)) for n, v in sel.items()] == _signature("row_select")


def test_constants_match_the_source():
    with open(cs.SOURCE) as f:
        src = f.read()
    for name in ("THREADS", "BINS", "CAP"):
        assert re.search(rf"^#define {name} {getattr(cs, name)}\b", src, re.M), name
    assert "__launch_bounds__(THREADS, %d)" % cs.CTAS_PER_SM in src


@pytest.mark.skipif(NVRTC is not None, reason=f"no NVRTC here: {NVRTC}")
@pytest.mark.parametrize("items", cs.ITEMS_BUILDS)
def test_nvrtc_builds_every_build_without_spills(items):
    from vllm_dsa_varlen.ops.compile_check import compile_select

    for report in compile_select(items):
        cap = 65536 // (cs.THREADS * cs.CTAS_PER_SM)
        assert report["spills"] == 0 and 0 < report["registers"] <= cap, report


# ------------------------------------------------------------ on the GPU

def _run_poisoned(logits, lens, k, items=None):
    out = torch.full((logits.shape[0], k), POISON, dtype=torch.int32, device=logits.device)
    cs.select_topk(logits, lens, k, out=out, items=items)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("items", cs.ITEMS_BUILDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", [3000, 33000, 200000])
@pytest.mark.parametrize("k", [2048, 512, 7])
def test_kernel_equals_the_host_model(items, kind, width, k):
    gen = torch.Generator().manual_seed(width + k + len(kind) + items)
    rows = 12 if width > 100000 else 24
    logits = random_logits(kind, rows, width, gen)
    lens = random_lengths(rows, width, k, gen)
    got = _run_poisoned(logits.cuda(), lens.cuda(), k, items).cpu()
    assert topk_selection_ok(logits, lens, k, got) == []
    assert torch.equal(got, model(logits, lens, k))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_unaligned_rows_and_lengths_past_the_width(offset):
    gen = torch.Generator().manual_seed(offset)
    rows, width, k = 40, 21000, 2048
    base = random_logits("positive", rows, width + 8, gen)
    logits = base[:, offset:offset + width]           # rows start off 16 bytes
    lens = random_lengths(rows, width, k, gen)
    lens[0], lens[1] = 10**6, -5
    got = _run_poisoned(base.cuda()[:, offset:offset + width], lens.cuda(), k).cpu()
    assert torch.equal(got, model(logits, lens, k))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("rows, width", [(1000, 9000), (4, 8192), (256, 32768), (3, 160000)])
def test_planned_launch_equals_the_host_model(rows, width):
    gen = torch.Generator().manual_seed(rows)
    logits = random_logits("positive", rows, width, gen)
    lens = torch.randint(width // 2, width + 1, (rows,), generator=gen, dtype=torch.int32)
    got = _run_poisoned(logits.cuda(), lens.cuda(), 2048).cpu()
    assert torch.equal(got, model(logits, lens, 2048))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_repeats_bit_for_bit():
    gen = torch.Generator().manual_seed(9)
    logits = random_logits("ties", 256, 32768, gen).cuda()
    lens = torch.randint(20000, 32769, (256,), generator=gen, dtype=torch.int32).cuda()
    first = _run_poisoned(logits, lens, 2048)
    for _ in range(20):
        assert torch.equal(_run_poisoned(logits, lens, 2048), first)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_replays_in_a_graph_with_new_contents():
    rows, width, k = 64, 40000, 2048
    logits = torch.empty(rows, width, device="cuda")
    lens = torch.empty(rows, dtype=torch.int32, device="cuda")
    out = torch.full((rows, k), POISON, dtype=torch.int32, device="cuda")
    logits.normal_()
    lens.fill_(width)
    cs.select_topk(logits, lens, k, out=out)  # load before capture
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        cs.select_topk(logits, lens, k, out=out)
    torch.cuda.current_stream().wait_stream(side)
    for seed in range(4):
        gen = torch.Generator().manual_seed(100 + seed)
        host = random_logits(KINDS[seed], rows, width, gen)
        hl = random_lengths(rows, width, k, gen)
        logits.copy_(host)
        lens.copy_(hl)
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), model(host, hl, k))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("reqs, tokens, context", [(1, 4, 8192), (16, 4, 16384), (9, -4, 9000),
                                                   (40, 3, 3000), (64, 2, 32768), (5, 1, 1500)])
def test_counted_by_the_logits_kernel_equals_the_two_launches(heads, reqs, tokens, context):
    """The logits kernel's ROW_HIST=1 build writes the default build's bits
    and counts the histograms row_hist would; the one-launch select on them
    selects what the host model selects, slot for slot."""
    from vllm_dsa_varlen.bench.workloads import random_decode_step
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck

    step = random_decode_step(reqs, abs(tokens), context, variable=tokens < 0, seed=reqs,
                              device="cuda", heads=heads)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    width = step.max_context_len
    plain = torch.full((rows.num_rows, width), float("nan"), device="cuda")
    counted = torch.full_like(plain, float("nan"))
    ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices, width,
              plain)
    ws = cs.workspace(rows.num_rows, width, "cuda")
    ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices, width,
              counted, defines=ck.ROW_HIST, hist=cs.histograms(ws, rows.num_rows))
    torch.cuda.synchronize()
    assert torch.equal(plain.nan_to_num(7.0), counted.nan_to_num(7.0))
    host = plain.nan_to_num(float("-inf")).cpu()
    lens = rows.context_lens.view(-1).cpu()
    want = torch.zeros(rows.num_rows, cs.BINS, dtype=torch.int32)
    for r, n in enumerate(lens.tolist()):
        if n > 2048:
            want[r] = torch.bincount(order_keys(host[r, :n]) >> 21, minlength=cs.BINS)
    got_hist = cs.histograms(ws, rows.num_rows).cpu()
    long_rows = lens > 2048
    assert torch.equal(got_hist[long_rows], want[long_rows])
    out = torch.full((rows.num_rows, 2048), POISON, dtype=torch.int32, device="cuda")
    cs.select_topk(plain, ctx, 2048, out=out, counted=ws)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), model(host, lens, 2048))


def test_a_counted_workspace_of_the_wrong_size_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    logits = torch.zeros(4, 10000)
    lens = torch.full((4,), 100, dtype=torch.int32)
    monkeypatch.setattr(cs, "num_sms", lambda index: 132)
    monkeypatch.setattr(cs.cb, "current_device", lambda: 0)
    small = torch.zeros(10, dtype=torch.int32)
    with pytest.raises(ValueError, match="^counted: expected a workspace"):
        cs.select_topk(logits, lens, 8, counted=small)
