"""``vllm-dsa-varlen-bench --builds`` (:mod:`vllm_dsa_varlen.bench.builds`):
its build syntax, its per-step sums, its options (CPU)."""

import collections
import random
import statistics

import pytest

from vllm_dsa_varlen.bench import logits as bench
from vllm_dsa_varlen.bench import builds as variants


def test_a_build_is_one_the_kernel_ships_in_any_order():
    """parse_build: ``default`` and the shipped builds' macros (in any order,
    at the run's head count) -> their macros; anything else -> ValueError
    naming --builds and listing the shipped ones."""
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck

    assert variants.parse_build("default") == ()
    for heads in ck.LAUNCHER_HEADS:
        shipped = variants.shipped_at(heads)
        assert shipped and all("HEADS=32" not in b for b in shipped)
        for build in shipped:
            text = "+".join(reversed(build)) or "default"
            assert set(variants.parse_build(text, heads)) == set(build)
    assert "+".join(ck.PIPELINE) in ["+".join(b) for b in variants.shipped_at(64)]
    for bad, heads in [("STAGES=4", 64), ("MATH_REGS=112+PRODUCER_REGS=24", 64),
                       ("NUM_MATH=3", 64), ("NUM_MATH=3+DUAL_ACC=4", 32), ("HEADS=32", 64),
                       ("EVICT_FIRST=1+EVICT_FIRST=1", 64), ("default@1,0", 64),
                       ("RUN_ROWS=2", 64), ("EVICT_FIRST=2", 64)]:
        with pytest.raises(ValueError, match="--builds.*one of: default"):
            variants.parse_build(bad, heads)


def _times(**kw):
    base = {k: random.uniform(1, 200) for k in ("default", "plan", "dg-meta", "dg-flat",
                                                "topk-rows", "topk-padded")}
    base.update(kw)
    return base


def test_per_step_sums_the_paths_each_line_takes():
    """Per-step figures: once per step the plan / metadata, per layer logits +
    top-k; stock 0.33 takes native for uniform 1/2/4, its split for variable
    steps, flattened otherwise; stock 0.27 native only up to 2 tokens."""
    layers = 61
    for tokens, variable, native in ((4, False, "dg-native4"), (2, False, "dg-native2"),
                                     (3, False, None), (3, False, "dg-native4"),
                                     (4, True, "dg-native4")):
        res = _times(**({native: 77.0} if native else {}), **({"dg-split": 300.0} if variable
                                                              else {}))
        got = variants.per_step(res, "default", tokens, variable, layers)
        assert got["plugin"] == res["plan"] + layers * (res["default"] + res["topk-rows"])
        flat = res["dg-meta"] + layers * (res["dg-flat"] + res["topk-rows"])
        if variable:
            want33 = res["dg-meta"] + layers * (res["dg-split"] + res["topk-rows"])
        elif native and tokens != 3:  # vLLM 0.33 on SM90 flattens 3-token steps
            want33 = res["dg-meta"] + layers * (res[native] + res["topk-padded"])
        else:
            want33 = flat
        assert got["stock 0.33"] == want33
        want27 = (res["dg-meta"] + layers * (res[native] + res["topk-padded"])
                  if native and not variable and tokens <= 2 else flat)
        assert got["stock 0.27"] == want27
        assert got["plugin / stock 0.33"] == got["plugin"] / want33
        assert "plugin, own top-k" not in got
    # the project's top-k beside vLLM's: a second plugin figure, stock unchanged
    res = _times(**{"dg-native4": 77.0, "topk-rows-ours": 4.0})
    got = variants.per_step(res, "default", 4, False, layers)
    own = res["plan"] + layers * (res["default"] + 4.0)
    assert got["plugin, own top-k"] == own
    assert got["stock 0.33"] == res["dg-meta"] + layers * (77.0 + res["topk-padded"])
    assert got["plugin, own top-k / stock 0.33"] == own / got["stock 0.33"]
    # without DeepGEMM only the plugin's figure
    res = {"default": 10.0, "plan": 5.0, "topk-rows": 3.0}
    assert variants.per_step(res, "default", 4, False, 2) == {"plugin": 5.0 + 2 * 13.0}


@pytest.mark.parametrize("argv, flag", [(["--deepgemm"], "--deepgemm"),
                                        (["--topk-lib", "x.so"], "--topk-lib"),
                                        (["--layers", "3"], "--layers"),
                                        (["--rounds", "2"], "--rounds"),
                                        (["--fixed-order"], "--fixed-order"),
                                        (["--pages", "in-order"], "--pages"),
                                        (["--flush", "read"], "--flush"),
                                        (["--lead", "copy"], "--lead"),
                                        (["--builds", "default", "--lead", "early", "--topk-lib",
                                          "x.so"], "--lead only with --builds without"),
                                        (["--topk-builds", "default"], "--topk-builds"),
                                        (["--topk-width", "163840"], "--topk-width"),
                                        (["--builds", "default", "--topk-width", "9"],
                                         "--topk-width"),
                                        (["--builds", "default", "--topk-builds", "default"],
                                         "--topk-builds"),
                                        (["--topk-cooperative-rows", "64"],
                                         "--topk-cooperative-rows"),
                                        (["--topk-eager-line", "0.33.0"], "--topk-eager-line"),
                                        (["--builds", "default", "--topk-eager-line",
                                          "0.27.1"], "--topk-eager-line"),
                                        (["--builds", "default", "--topk-lib", "x.so",
                                          "--topk-cooperative-rows", "-1"],
                                         "--topk-cooperative-rows: expected an int >= 0")])
def test_builds_options_only_with_builds(argv, flag, capsys):
    """The --builds options are refused without --builds (naming the flag),
    rather than silently ignored."""
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert flag in capsys.readouterr().err


def test_vllm_topk_op_is_cooperative_up_to_the_lines_rows_on_aligned_rows():
    """Which of vLLM's decode top-k ops the bench times: cooperative_topk up to
    the line's row limit (0.27.1: 32, 0.33.0: 64) on rows whose stride is a
    multiple of 4, persistent_topk otherwise."""
    for limit in (0, 32, 64):
        for rows in (1, 31, 32, 33, 64, 65, 500):
            for stride in (163840, 163841, 8192, 4098):
                want = rows <= limit and stride % 4 == 0
                got = variants.vllm_topk_op(rows, stride, limit)
                assert got == ("cooperative_topk" if want else "persistent_topk"), (rows, stride)


def test_vllm_max_seq_len_is_the_width_under_capture_and_the_lines_eager_value():
    """vLLM's top-k gets max_model_len (the width) in a captured step; in an
    eager one the step's longest row, except 0.27.1's persistent_topk call,
    which passes the width (each line's sparse_attn_indexer)."""
    rng = random.Random()
    for _ in range(50):
        step_max = rng.randrange(1, 163840)
        width = rng.randrange(step_max, 200000)
        for op in ("cooperative_topk", "persistent_topk"):
            assert variants.vllm_max_seq_len(op, None, step_max, width) == width
            assert variants.vllm_max_seq_len(op, "0.33.0", step_max, width) == step_max
        assert variants.vllm_max_seq_len("cooperative_topk", "0.27.1", step_max, width) == step_max
        assert variants.vllm_max_seq_len("persistent_topk", "0.27.1", step_max, width) == width
    with pytest.raises(ValueError, match="eager_line"):
        variants.vllm_max_seq_len("persistent_topk", "0.30", 1, 2)
    # 0.27.1's eager row limit is the one the plugin's rule counts from there
    from vllm_dsa_varlen.topk import COOPERATIVE_ROWS
    assert variants.LINE_COOPERATIVE_ROWS["0.27.1"] == COOPERATIVE_ROWS


def test_builds_without_a_gpu_says_so(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--builds: needs a CUDA GPU"):
        bench.main(["--builds", "default"])
    # a case with a share of cut requests passes the command line's check (then: no GPU)
    with pytest.raises(SystemExit, match="--builds: needs a CUDA GPU"):
        bench.main(["--builds", "default", "--cases", "8,4,4096,0.25"])


def test_a_share_of_cut_requests_is_for_builds_cases_only(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--plan-timing", "--cases", "8,4,4096,0.25"])
    assert "--cases" in capsys.readouterr().err


@pytest.mark.parametrize("seed", range(4))
def test_paired_ratios_divide_each_round_by_the_base_paths_same_round(seed):
    """A path's time over the base path's in the same round: median, min and
    max of those ratios (not the ratio of the medians); the base and
    single-round runs get none."""
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    times = {name: [rng.uniform(5, 200) for _ in range(n)] for name in ("default", "A", "dg")}
    got = variants.paired_ratios(times, "default")
    assert set(got) == {"A", "dg"}
    for name in ("A", "dg"):
        r = [t / b for t, b in zip(times[name], times["default"])]
        assert got[name]["median"] == pytest.approx(statistics.median(r))
        assert (got[name]["min"], got[name]["max"]) == (pytest.approx(min(r)), pytest.approx(max(r)))
    assert variants.paired_ratios({k: v[:1] for k, v in times.items()}, "default") == {}


@pytest.mark.parametrize("n", range(1, 12))
def test_round_order_balances_leaders_and_predecessors_over_a_cycle(n):
    """Over one cycle every path is timed once per round, leads equally often,
    sits at each position equally often and follows every other path equally
    often (counted here); the next cycle repeats it; ``fixed`` keeps the given
    order (the control for a predecessor effect)."""
    rng = random.Random(n)
    names = [f"p{i}" for i in range(n)]
    rng.shuffle(names)
    cycle = variants.order_cycle(n)
    orders = [variants.round_order(names, r) for r in range(cycle)]
    for order in orders:
        assert sorted(order) == sorted(names)
    for pos in range(n):
        counts = collections.Counter(o[pos] for o in orders)
        assert len(counts) == n and len(set(counts.values())) == 1
    pairs = collections.Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    if n > 1:
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
    assert [variants.round_order(names, r + cycle) for r in range(cycle)] == orders
    assert all(variants.round_order(names, r, fixed=True) == names for r in range(cycle))


@pytest.mark.parametrize("paths", range(1, 12))
def test_case_rounds_default_to_one_whole_balanced_cycle(paths):
    """Without --rounds a case runs one whole cycle of the balanced order (every
    path leading and following every other equally often), one round in a fixed
    order; --rounds is taken as given, a bad one refused."""
    from vllm_dsa_varlen.bench.graph import order_cycle, round_order

    rounds = variants.case_rounds(None, paths)
    assert rounds == order_cycle(paths)
    names = list(range(paths))
    leads = [round_order(names, r)[0] for r in range(rounds)]
    assert sorted(leads) == sorted(names * (rounds // paths))
    assert variants.case_rounds(None, paths, fixed_order=True) == 1
    asked = random.randint(1, 30)
    assert variants.case_rounds(asked, paths) == asked
    with pytest.raises(ValueError, match="--rounds"):
        variants.case_rounds(0, paths)


def test_topk_build_splits_macros_from_the_bound():
    assert variants.topk_build("default") == ((), None)
    assert variants.topk_build("SPLIT=2+MINB=1") == (("SPLIT=2", "MINB=1"), None)
    assert variants.topk_build("SPLIT=1+THREADS=512+bound=8192+LIST=0+MINB=4") == (
        ("SPLIT=1", "THREADS=512", "LIST=0", "MINB=4"), 8192)
    assert variants.topk_build("bound=100") == ((), 100)
    assert variants.topk_build("bound=step") == ((), "step")
    with pytest.raises(ValueError, match="one bound=N"):
        variants.topk_build("bound=1+bound=2")
    for bad in ("bound=0", "bound=x", "bound=-3"):
        with pytest.raises(ValueError, match="bound=N takes"):
            variants.topk_build(bad)


def test_topk_builds_are_the_planned_ones():
    """--topk-builds: each of cuda_topk.plan_builds (absent macros at their
    defaults); the A/B builds the source no longer compiles are refused,
    naming the flag."""
    from vllm_dsa_varlen.ops import cuda_topk as ct

    for build in ct.plan_builds():
        assert variants.topk_build("+".join(build)) == (build, None)
    for bad in ("SPLIT=8+MINB=1", "THREADS=256+LIST=0+MINB=8", "SPLIT=4+LIST=0+MINB=1",
                "KEY16=1"):
        with pytest.raises(ValueError, match="--topk-builds.*not a build the top-k plans"):
            variants.topk_build(bad)


def test_graph_replay_refuses_an_unknown_flush():
    """graph_replay_us names a bad ``flush`` before touching the GPU."""
    from vllm_dsa_varlen.bench.graph import FLUSHES, graph_replay_us

    assert FLUSHES == ("read", "zero")
    with pytest.raises(ValueError, match="flush"):
        graph_replay_us(None, None, None, 1, flush="dirty")


def test_led_calls_run_the_lead_before_each_logits_path_only():
    """``--lead``: every logits path runs the queries' copy first and returns
    its own result; the schedule's, DeepGEMM's metadata and the top-k paths
    are left alone; ``lead`` alone is added; the copy rewrites the queries
    with their own values (the checks made before still hold)."""
    torch = pytest.importorskip("torch")
    from vllm_dsa_varlen.bench.workloads import make_decode_step

    step = make_decode_step([2, 3], [70, 130], heads=64, seed=4)
    before = step.q.clone()
    seen = []

    def path(name):
        def fn():
            seen.append(name)
            return name
        return fn

    names = ["default", "PDL=1", "dg-native4", "dg-flat", "plan", "dg-meta", "topk-rows",
             "topk-rows-ours"]
    calls = {n: path(n) for n in names}
    led = variants.led_calls(torch, step, calls, "copy")
    assert list(led) == ["lead", *names]
    for n in names:
        assert led[n]() == n
    assert seen == names and torch.equal(step.q, before)
    # the lead writes q: poisoned first, each led path restores it, the others do not
    for n, wrote in (("default", True), ("dg-flat", True), ("plan", False),
                     ("topk-rows", False)):
        step.q.view(torch.uint8).fill_(0x7F)
        led[n]()
        assert torch.equal(step.q.view(torch.uint8), before.view(torch.uint8)) is wrote, n
    step.q.view(torch.uint8).fill_(0x7F)
    led["lead"]()
    assert torch.equal(step.q.view(torch.uint8), before.view(torch.uint8))
    with pytest.raises(ValueError, match="--lead"):
        variants.led_calls(torch, step, calls, "late")


@pytest.mark.gpu
def test_the_early_lead_copies_the_queries_and_lets_a_dependent_read_them():
    """``--lead early`` (a Triton kernel launched as a programmatic dependent,
    letting the next launch at its start), captured in a graph before a
    kernel launched the same way: the queries it copies are what that kernel
    reads (the CUDA kernel's PDL build against the reference), replay after
    replay on new sources."""
    torch = pytest.importorskip("torch")
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs an sm_90 GPU")
    from vllm_dsa_varlen.bench.graph import capture_graph
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.bench.workloads import random_decode_step

    from logits_checks import POISON, check_poisoned

    step = random_decode_step(24, 4, 2000, heads=64, device="cuda", variable=True, seed=2)
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    out = torch.full((rows.num_rows, step.max_context_len), POISON, device="cuda")
    sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1])
    source = torch.empty_like(step.q)
    copy = variants.early_copy()

    def call():
        copy(step.q, source)
        ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                  step.max_context_len, out, schedule=sched, defines=ck.PDL)

    source.copy_(step.q)
    graph = capture_graph(torch, call)
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        source.copy_(torch.randn(step.q.shape, generator=gen, device="cuda").to(step.q.dtype))
        step.q.view(torch.uint8).fill_(0)
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(step.q.view(torch.uint8), source.view(torch.uint8))
        check_poisoned(step, out)


def test_a_case_takes_a_share_of_cut_requests():
    """``requests,tokens,context[,share]``: three fields as before (no share),
    a fourth the share of requests with fewer tokens; a share outside (0, 1]
    or one on fewer than 2 tokens is refused naming --cases."""
    assert variants.parse_step_case("64,-4,8192") == (64, -4, 8192, None)
    assert variants.parse_step_case("32,4,16384,0.1") == (32, 4, 16384, 0.1)
    for bad in ("32,4,16384,0", "32,4,16384,1.5", "32,-4,16384,0.1", "32,1,16384,0.5",
                "32,4,16384,x", "32,4"):
        with pytest.raises(ValueError, match="--cases"):
            variants.parse_step_case(bad)
