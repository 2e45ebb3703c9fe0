"""The decode top-k choice (vllm_dsa_varlen/topk.py; its setting:
tests/test_settings.py): the pure per-device decision, the per-call layout check, and the dispatch (the
project's kernel where it serves, vLLM's call otherwise, with its own
arguments)."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_dsa_varlen import stats, topk
from vllm_dsa_varlen.ops import cuda_topk
from vllm_dsa_varlen.ops.reference import topk_ref, topk_selection_ok


def test_choose_topk_table():
    own = dict(mode="auto", setting="own", capability=(9, 0), kernel_error=None)
    got = topk.choose_topk(**own)
    assert got.own and not got.per_call
    got = topk.choose_topk(**{**own, "setting": "auto"})
    assert got.own and got.per_call and "measured faster" in got.reason
    for setting in ("own", "auto"):
        for change, words in [({"mode": "off"}, "DSA_VARLEN=off"),
                              ({"mode": "stock"}, "DSA_VARLEN=stock"),
                              ({"setting": "vllm"}, "DSA_VARLEN_TOPK=vllm"),
                              ({"capability": (10, 0)}, "sm_100"),
                              ({"capability": (8, 9)}, "sm_89"),
                              ({"capability": None}, "unknown"),
                              ({"kernel_error": "OSError: no NVRTC"}, "no NVRTC")]:
            got = topk.choose_topk(**{**own, "setting": setting, **change})
            assert not got.own and words in got.reason, (change, got)


def test_measured_faster_rule():
    """auto's per-call rule: more than COOPERATIVE_ROWS rows bounded at
    LONG_ROWS or more, and no more rows than SMs or rows a CTA's stage holds
    whole; no bound, no claim."""
    most = cuda_topk.MAX_STAGE
    for rows, bound, want in [(33, topk.LONG_ROWS, True), (33, most, True),
                              (32, topk.LONG_ROWS, False), (4, 40000, False),
                              (33, most + 1, True), (132, 163840, True), (133, 163840, False),
                              (133, most, True), (512, most + 1, False), (512, 163840, False),
                              (512, topk.LONG_ROWS - 1, False), (64, topk.LONG_ROWS - 1, False),
                              (1024, 4096, False), (256, None, False), (64, None, False),
                              (1, None, False)]:
        assert topk.measured_faster(rows, bound, 132) is want, (rows, bound)
    assert not topk.measured_faster(100, 163840, 78) and topk.measured_faster(78, 163840, 78)
    # a vLLM line whose call takes cooperative_topk up to 64 rows (0.33.0): up to them
    # only rows a CTA stages whole (ours 0.92-0.94x its cooperative_topk at 42.6K, level
    # at 64K-81K); past them as against 0.27.1's persistent_topk
    for rows in (33, 48, 64):
        assert topk.measured_faster(rows, 40000, 132, 64)
        assert topk.measured_faster(rows, most, 132, 64)
        assert not topk.measured_faster(rows, most + 1, 132, 64)
        assert not topk.measured_faster(rows, topk.LONG_ROWS - 1, 132, 64)
        assert topk.measured_faster(rows, most + 1, 132)  # 0.27.1: persistent_topk's rows
    assert topk.measured_faster(65, most + 1, 132, 64)
    assert not topk.measured_faster(32, 40000, 132, 8)  # never below 0.27.1's 32


def test_auto_builds_cover_every_call_the_rule_takes():
    """Each call measured_faster takes (a bound clamped to the width, as
    dispatch does) plans a build among auto_builds(sms): none compiles while
    serving; and auto_builds names no build the plan cannot take."""
    gen = torch.Generator().manual_seed(5)
    for sms in (1, 33, 66, 78, 114, 132, 200):
        builds = topk.auto_builds(sms)
        assert builds and set(builds) <= set(cuda_topk.plan_builds())
        taken = 0
        for _ in range(300):
            rows = int(torch.randint(1, 3 * sms + 64, (1,), generator=gen))
            width = int(torch.randint(1, 5 * cuda_topk.MAX_STAGE, (1,), generator=gen))
            bound = int(torch.randint(1, 5 * cuda_topk.MAX_STAGE, (1,), generator=gen))
            longest = min(width, bound)
            if topk.measured_faster(rows, longest, sms):
                taken += 1
                plan = cuda_topk.launch_plan(rows, longest, sms, bounded=True)
                assert plan in builds, (sms, rows, longest)
        assert taken > 0
    # On 132 SMs (H100, H200) the rule's calls take one to four CTAs per row, one CTA per
    # SM, and the sampled build for staged rows on one CTA each.
    assert sorted(topk.auto_builds(132)) == sorted(
        [(f"SPLIT={s}", "MINB=1") for s in (1, 2, 4)] + [cuda_topk.SAMPLED])


def _call(rows=6, width=300, k=16, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    logits = torch.randn(rows, width, generator=gen)
    lens = torch.randint(0, width + 1, (rows, 1), generator=gen, dtype=torch.int32)
    out = torch.full((rows, k + 4), -7, dtype=torch.int32)[:, :k]
    return logits, lens, out, k


def test_layout_ok_accepts_the_indexer_ops_calls_and_refuses_others():
    logits, lens, out, k = _call()
    assert topk.layout_ok(logits, lens, out, k)
    assert topk.layout_ok(logits, lens.view(3, 2).long(), out, k)  # [B, next_n], int64
    assert not topk.serves(logits, lens, out, k)  # a CPU tensor: never the kernel
    bad = [(logits.double(), lens, out, k), (logits.t().contiguous().t(), lens, out, k),
           (logits, lens.float(), out, k), (logits, lens[:5], out, k),
           (logits, lens, out.long(), k), (logits, lens, out[:, :8], k),
           (logits, lens, out, 0), (logits, lens, out, True), (logits[0], lens, out, k),
           (logits, lens, torch.zeros(k, 6, dtype=torch.int32).t(), k),
           (logits.as_strided(logits.shape, (100, 1)), lens, out, k)]  # rows overlapping
    for args in bad:
        assert not topk.layout_ok(*args), [getattr(a, "shape", a) for a in args]


@pytest.fixture
def kernel_here(monkeypatch):
    """The dispatch as on an sm_90 GPU with the kernel loaded, on CPU
    tensors: serves() = layout_ok(), the decision 'own', and a stand-in for
    the kernel that writes the reference's selection (calls recorded)."""
    calls = []

    def fake(logits, lengths, k, out, bound=None):  # the launch plan's build
        calls.append((logits, bound))
        out.copy_(topk_ref(logits, lengths, k))
        return out

    monkeypatch.setattr(topk, "serves", topk.layout_ok)
    monkeypatch.setattr(topk, "decide", lambda index: topk.TopkChoice(True, "test"))
    monkeypatch.setattr(cuda_topk, "launch_checked", fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(topk, "num_sms", lambda index: 132)  # the H200's
    return calls


def test_dispatch_takes_the_kernel_where_it_serves(kernel_here):
    logits, lens, out, k = _call()
    stock = []
    topk.dispatch(logits, lens, out, k, lambda: stock.append(1))
    assert stock == [] and len(kernel_here) == 1 and kernel_here[0][1] is None
    assert topk_selection_ok(logits, lens, k, out) == []


@pytest.mark.parametrize("bound,passed", [(300, 300), (1, 1), (0, None), (-5, None),
                                          (True, None), (2.5, None), (None, None)])
def test_dispatch_hands_a_valid_host_bound_to_the_plan(kernel_here, bound, passed):
    logits, lens, out, k = _call()
    topk.dispatch(logits, lens, out, k, lambda: pytest.fail("stock called"), bound=bound)
    assert kernel_here[-1][1] == passed and topk_selection_ok(logits, lens, k, out) == []


def test_dispatch_leaves_other_calls_to_stock(kernel_here, monkeypatch):
    logits, lens, out, k = _call()
    stock = []
    topk.dispatch(logits.double(), lens, out, k, lambda: stock.append(1))
    monkeypatch.setattr(topk, "decide", lambda index: topk.TopkChoice(False, "test"))
    topk.dispatch(logits, lens, out, k, lambda: stock.append(2))
    assert stock == [1, 2] and kernel_here == []
    assert (out == -7).all()


def test_decide_once_per_device_from_the_environment(monkeypatch):
    """decide() reads the settings and the device once, logs, and caches;
    DSA_VARLEN_TOPK=vllm never loads the kernel; own loads every build
    the launch plan can take, auto those its rule can reach."""
    topk.reset()
    loads = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(topk, "num_sms", lambda index: 132)
    monkeypatch.setattr(cuda_topk, "load", lambda device, build: loads.append((device, build)))
    every = len(cuda_topk.plan_builds())  # each build the launch plan can take, loaded at once
    monkeypatch.setenv(topk.TOPK_ENV, "vllm")
    assert not topk.decide(3).own and loads == []
    monkeypatch.setenv(topk.TOPK_ENV, "own")
    assert not topk.decide(3).own  # cached
    topk.reset()
    assert topk.decide(3).own and len(loads) == every
    assert sorted(b for _, b in loads) == sorted(cuda_topk.plan_builds())
    topk.reset()
    monkeypatch.setenv(topk.TOPK_ENV, "auto")  # loads too: the per-call rule may take it
    assert topk.decide(0).own and topk.decide(0).per_call
    assert [b for _, b in loads[every:]] == topk.auto_builds(132)
    topk.reset()
    monkeypatch.setenv(topk.TOPK_ENV, "own")

    def broken(device, build):
        raise OSError("no NVRTC library")

    monkeypatch.setattr(cuda_topk, "load", broken)
    got = topk.decide(0)
    assert not got.own and "no NVRTC library" in got.reason
    topk.reset()


def test_force_overrides_the_decision(kernel_here):
    """force(False) keeps vLLM's call where the kernel would serve, force(True)
    takes the kernel whatever decide() says, None decides again; the layout
    check holds in every case."""
    logits, lens, out, k = _call()
    stock = []
    try:
        topk.force(False)
        topk.dispatch(logits, lens, out, k, lambda: stock.append("forced off"))
        assert stock == ["forced off"] and kernel_here == []
        topk.force(True)
        topk.dispatch(logits.double(), lens, out, k, lambda: stock.append("layout"))
        assert stock[-1] == "layout"
        topk.dispatch(logits, lens, out, k, lambda: stock.append("never"))
        assert len(kernel_here) == 1 and stock[-1] != "never"
        topk.force(None)
        topk.dispatch(logits, lens, out, k, lambda: stock.append("never"))
        assert len(kernel_here) == 2
    finally:
        topk.reset()
    assert topk._forced is None


def test_a_device_decided_for_vllm_skips_the_layout_check(monkeypatch):
    """Once a device's decision is vLLM's, dispatch calls stock's op at once
    (no per-call layout check: eager steps pay nothing for the choice)."""
    topk.reset()
    checks = []
    monkeypatch.setattr(topk, "serves", lambda *a: checks.append(1) or False)
    topk._choices[None] = topk.TopkChoice(False, "test")  # CPU tensors' device index
    stock = []
    logits, lens, out, k = _call()
    topk.dispatch(logits, lens, out, k, lambda: stock.append(1))
    assert stock == [1] and checks == []
    topk.reset()
    topk.dispatch(logits, lens, out, k, lambda: stock.append(2))
    assert stock == [1, 2] and checks == [1]  # undecided: checked (and refused)
    topk.reset()


def test_a_device_decided_for_auto_checks_the_layout_only_where_the_rule_takes_it(
        kernel_here, monkeypatch):
    """With the device's decision auto's (per call), a call the rule leaves to
    vLLM goes to stock's op at once, counted, with no layout check; a call
    it takes is checked, then served by the kernel."""
    topk.reset()
    checks = []
    monkeypatch.setattr(topk, "serves", lambda *a: checks.append(1) or topk.layout_ok(*a))
    topk._choices[None] = topk.TopkChoice(True, "test", per_call=True)
    try:
        for rows, width, bound, ours in [(40, 300, topk.LONG_ROWS, False), (4, 40000, 40000, False),
                                         (40, 40000, None, False), (40, 40000, 40000, True)]:
            logits, lens, out, k = _call(rows=rows, width=width)
            stock, before, counted = [], len(checks), stats.snapshot()["topk"]
            topk.dispatch(logits, lens, out, k, lambda: stock.append(1), bound=bound)
            assert (len(checks) - before, len(stock)) == ((1, 0) if ours else (0, 1))
            key = "own_eager" if ours else "vllm_eager"
            assert stats.snapshot()["topk"][key] == counted[key] + 1
    finally:
        topk.reset()


def test_auto_routes_each_call_by_the_measured_rule(kernel_here, monkeypatch):
    """Under auto the decision is per call: the kernel where measured_faster
    says so (more than 32 rows bounded at LONG_ROWS up), vLLM's op elsewhere."""
    monkeypatch.setattr(topk, "decide",
                        lambda index: topk.TopkChoice(True, "test", per_call=True))
    wide = topk.LONG_ROWS + 8
    for rows, width, bound, ours in [(4, 300, None, False), (40, 300, None, False),
                                     (40, 300, 1000, False), (4, wide, topk.LONG_ROWS, False),
                                     (40, wide, topk.LONG_ROWS, True), (40, wide, 10**6, True),
                                     # a bound past the width: the width is the longest row
                                     (40, 300, topk.LONG_ROWS, False),
                                     # past a stage: up to as many rows as SMs (132 here)
                                     (132, cuda_topk.MAX_STAGE + 8, 10**6, True),
                                     (133, cuda_topk.MAX_STAGE + 8, 10**6, False)]:
        logits, lens, out, k = _call(rows=rows, width=width)
        stock = []
        before = len(kernel_here)
        counted = stats.snapshot()["topk"]
        topk.dispatch(logits, lens, out, k, lambda: stock.append(1), bound=bound)
        assert (len(kernel_here) - before, len(stock)) == ((1, 0) if ours else (0, 1))
        grew = {c: n - counted[c] for c, n in stats.snapshot()["topk"].items() if n != counted[c]}
        assert grew == {("own_eager" if ours else "vllm_eager"): 1}
        if ours:
            assert topk_selection_ok(logits, lens, k, out) == []


def test_a_bound_is_ignored_inside_a_graph_capture(kernel_here, monkeypatch):
    """A captured launch replays at other lengths: under capture the call
    hands no bound (neither to the plan nor to auto's rule)."""
    monkeypatch.setattr(topk, "decide",
                        lambda index: topk.TopkChoice(True, "test", per_call=True))
    for capturing, ours in [(False, True), (True, False)]:
        monkeypatch.setattr(topk, "capturing", lambda logits: capturing)
        logits, lens, out, k = _call(rows=40, width=topk.LONG_ROWS)  # > 32 rows: the bound decides
        stock = []
        before = len(kernel_here)
        counted = stats.snapshot()["topk"]
        topk.dispatch(logits, lens, out, k, lambda: stock.append(1), bound=topk.LONG_ROWS)
        assert (len(kernel_here) - before, len(stock)) == ((1, 0) if ours else (0, 1))
        key = ("own_eager" if ours else "vllm_captured")  # captured: vLLM's here (no bound)
        assert stats.snapshot()["topk"][key] == counted[key] + 1
    monkeypatch.setattr(topk, "decide", lambda index: topk.TopkChoice(True, "test"))
    logits, lens, out, k = _call(rows=5)
    topk.dispatch(logits, lens, out, k, lambda: pytest.fail("stock called"), bound=300)
    assert kernel_here[-1][1] is None and topk_selection_ok(logits, lens, k, out) == []


def test_capture_is_asked_only_for_cuda_logits(monkeypatch):
    """``capturing`` asks the stream only for CUDA logits (a CPU tensor or
    anything else is not captured, and no CUDA query is made for it)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing",
                        lambda: pytest.fail("asked the stream for non-CUDA logits"))
    assert topk.capturing(torch.zeros(2, 3)) is False
    assert not topk.capturing(None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert topk.capturing(types.SimpleNamespace(is_cuda=True)) is True


@pytest.mark.gpu
def test_capture_is_seen_inside_a_cuda_graph():
    logits = torch.zeros(4, 8, device="cuda")
    seen = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seen.append(topk.capturing(logits))
        logits.add_(1)
    assert seen == [True] and topk.capturing(logits) is False
