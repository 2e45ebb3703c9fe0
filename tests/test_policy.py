"""The per-step choice :func:`vllm_dsa_varlen.policy.varlen_wins` and its step facts.

Rules measured with the CUDA sm_90 kernel only (``kernel="cuda_sm90"``) apply
only when the caller names that kernel (the builder's graph-time kernel).

The expectations below are written from the measured table as BENCHMARKS.md
states it (varlen at least as fast as DeepGEMM flattened on uniform 2-token
steps from 128 rows, uniform 3-4-token steps from 64 rows (with the CUDA sm_90
kernel: 3 tokens from 18 rows, 4 from 32), uniform 8-token
steps from 64 requests, and variable steps whose longest request has 4 tokens
from 64 requests at >= 32K contexts (with the CUDA sm_90 kernel also from 64
at 8K, and, >= 2.8 tokens a request, from 16 at 16K and 32 at 8K); never
measured faster than DeepGEMM's
native kernels) and from stock's split behaviour,
independently of how :data:`policy.MEASURED` encodes them.
"""

import itertools
import random
import subprocess
import sys

import pytest

from vllm_dsa_varlen import policy
from vllm_dsa_varlen.policy import MEASURED, Rule, StepFacts, uniform_unpadded, varlen_wins


def _facts_by_hand(lens, rows=None, max_context=0):
    real = [n for n in lens if n > 0]
    return dict(rows=sum(lens) if rows is None else rows, requests=len(real),
                max_run=max(real) if real else 0,
                uniform=len(set(real)) <= 1, max_context=max_context)


@pytest.mark.parametrize("seed", range(200))
def test_from_decode_lens_counts_requests_runs_and_uniformity(seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 4) for _ in range(rng.randint(0, 40))]
    if rng.random() < 0.5 and lens:
        lens = [lens[0]] * len(lens)
    lens += [0] * rng.randint(0, 3)  # graph-padding requests are not requests
    pad_rows = rng.randint(0, 5)
    facts = StepFacts.from_decode_lens(lens, rows=sum(lens) + pad_rows, max_context=77)
    want = _facts_by_hand(lens, sum(lens) + pad_rows, 77)
    assert {k: getattr(facts, k) for k in want} == want
    assert StepFacts.from_decode_lens(lens).rows == sum(lens)


@pytest.mark.parametrize("kwargs,word", [
    (dict(rows=-1, requests=0, max_run=0, uniform=True), "rows"),
    (dict(rows=3, requests=4, max_run=1, uniform=True), "requests"),
    (dict(rows=8, requests=2, max_run=0, uniform=True), "max_run"),
    (dict(rows=8, requests=2, max_run=9, uniform=True), "max_run"),
    (dict(rows=8, requests=2, max_run=4, uniform=True, max_context=-5), "max_context"),
    (dict(rows=8.0, requests=2, max_run=4, uniform=True), "rows"),
])
def test_bad_facts_name_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        StepFacts(**kwargs)


def test_bad_decode_lens_and_stock_kind_raise():
    with pytest.raises(ValueError, match="decode_lens"):
        StepFacts.from_decode_lens([2, -1])
    with pytest.raises(ValueError, match="stock"):
        varlen_wins(StepFacts.from_decode_lens([4] * 64), "padded")


@pytest.mark.parametrize("seed", range(300))
def test_measured_table_as_benchmarks_states_it(seed):
    rng = random.Random(1000 + seed)
    num = rng.choice([1, 2, 4, 5, 6, 7, 8, 15, 16, 31, 32, 63, 64, 65, 128, 256])
    top = rng.choice([1, 2, 3, 4, 5, 6, 7, 8])
    lens = [top] * num if rng.random() < 0.5 else [rng.randint(1, top) for _ in range(num)]
    if rng.random() < 0.3:  # longer runs on average (variable steps up to 8: >= 4.5 per request)
        lens = [rng.randint(max(1, top - 2), top) for _ in range(num)]
    if rng.random() < 0.3:  # a served step: k + 1 tokens but for a few cut drafts
        lens = [top if rng.random() < 0.8 else rng.randint(1, top) for _ in range(num)]
    step = StepFacts.from_decode_lens(lens, max_context=rng.choice([0, 8191, 8192, 16383, 16384,
                                                                    32767, 32768, 1 << 17]))
    uniform = len(set(lens)) == 1
    top = max(lens)
    # stock flattens: varlen measured at least as fast only on these steps
    want = ((uniform and top == 2 and sum(lens) >= 128)
            or (uniform and top in (3, 4) and sum(lens) >= 64)
            or (uniform and top == 8 and num >= 64)
            or (not uniform and top == 4 and num >= 64 and step.max_context >= 32768
                and sum(lens) >= 2.6 * num))
    assert varlen_wins(step, "flattened") == want
    for kernel in ("portable", "another"):
        assert varlen_wins(step, "flattened", kernel=kernel) == want
    # with the CUDA sm_90 kernel (calls 39, 49) also: uniform 5-7 tokens from 64 requests,
    # variable steps up to 4 tokens from 8K contexts, up to 8 tokens with >= 4.5
    # tokens per request from 8K contexts; (h200-744ee8f, h200-320b823) uniform 4 tokens
    # from 32 rows, uniform 3 tokens from 18 rows
    want_cuda = (want or (uniform and top in (5, 6, 7) and num >= 64)
                 or (uniform and top == 4 and sum(lens) >= 32)
                 or (uniform and top == 3 and sum(lens) >= 18)
                 or (not uniform and top == 4 and num >= 64 and step.max_context >= 8192
                     and sum(lens) >= 2.6 * num)
                 # (h100, cut drafts) from 16 requests at 16K, 32 at 8K, >= 2.8 a request
                 or (not uniform and top == 4 and sum(lens) >= 2.8 * num
                     and ((num >= 16 and step.max_context >= 16384)
                          or (num >= 32 and step.max_context >= 8192)))
                 or (not uniform and top == 8 and num >= 64 and step.max_context >= 8192
                     and sum(lens) >= 4.5 * num))
    assert varlen_wins(step, "flattened", kernel="cuda_sm90") == want_cuda
    # stock's native [B, next_n] kernel: always kept (h200-533ddd0: in vLLM
    # 0.33.0's engine the varlen kernel lost to it)
    for kernel in (None, "portable", "cuda_sm90"):
        assert not varlen_wins(step, "native", kernel=kernel)
    # stock would split: the tail would run as prefill -> varlen keeps them decodes
    assert varlen_wins(step, "split")


def test_empty_step_never_takes_varlen():
    empty = StepFacts(rows=0, requests=0, max_run=0, uniform=True)
    assert not any(varlen_wins(empty, kind) for kind in policy.STOCK_KINDS)


def test_adding_requests_never_loses_a_win():
    """Monotone in the batch: a step that wins keeps winning with more requests."""
    for kind in policy.STOCK_KINDS:
        for run in range(1, 5):
            wins = [varlen_wins(StepFacts.from_decode_lens([run] * b), kind) for b in range(1, 300)]
            assert wins == sorted(wins), (kind, run)


def test_table_is_looked_up_at_call_time_and_can_be_given(monkeypatch):
    step = StepFacts.from_decode_lens([3, 1, 2])
    assert not varlen_wins(step, "flattened")
    mine = (Rule("flattened", min_run=3),)
    assert varlen_wins(step, "flattened", mine)
    monkeypatch.setattr(policy, "MEASURED", mine)
    assert varlen_wins(step, "flattened")
    assert not varlen_wins(step, "flattened", ())


def test_every_rule_names_a_stock_kind_and_says_why():
    for rule in MEASURED:
        assert rule.stock in policy.STOCK_KINDS and rule.note


def test_policy_is_pure_python():
    """No torch, no vLLM: the choice is made from host ints, never from tensors."""
    code = ("import sys, vllm_dsa_varlen.policy; "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_mean_run_bound_counts_tokens_not_padding_rows():
    """The variable rule's tokens-per-request bound reads the requests' own
    tokens: graph-padding rows must not lift a losing step over it."""
    lens = [1, 2, 3, 4] * 16 + [1] * 16          # 80 requests, 176 tokens: 2.2 per request
    step = StepFacts.from_decode_lens(lens, max_context=32768)
    assert step.tokens == 176 and not varlen_wins(step, "flattened")
    padded = StepFacts.from_decode_lens(lens, rows=256, max_context=32768)  # 3.2 rows each
    assert padded.rows == 256 and padded.tokens == 176
    assert not varlen_wins(padded, "flattened")
    more = StepFacts.from_decode_lens([4, 3, 2] * 22, rows=256, max_context=32768)  # 3.0
    assert varlen_wins(more, "flattened")


def test_tokens_fact_is_checked():
    with pytest.raises(ValueError, match="tokens"):
        StepFacts(rows=4, requests=2, max_run=2, uniform=True, tokens=5)


def test_kernel_gated_rules_need_the_callers_kernel():
    six = StepFacts.from_decode_lens([6] * 64, max_context=8000)
    assert not varlen_wins(six, "flattened")
    assert varlen_wins(six, "flattened", kernel="cuda_sm90")
    for n in (5, 7):
        step = StepFacts.from_decode_lens([n] * 64)
        assert varlen_wins(step, "flattened", kernel="cuda_sm90")
        assert not varlen_wins(step, "flattened", kernel="portable")
        assert not varlen_wins(StepFacts.from_decode_lens([n] * 63), "flattened",
                               kernel="cuda_sm90")
    table = (Rule("flattened", min_run=2, kernel="portable", note="test"),)
    assert varlen_wins(six, "flattened", table, kernel="portable")
    assert not varlen_wins(six, "flattened", table, kernel="cuda_sm90")
    assert not varlen_wins(six, "flattened", table)


def test_graph_kernel_on_the_cpu_is_the_portable_one():
    from vllm_dsa_varlen.ops import launcher

    assert launcher.graph_kernel("cpu", 64) == "portable"
    assert launcher.graph_kernel("cpu", None, 128, 64) == "portable"


def test_min_varlen_rows_bounds_every_rule():
    """No step with fewer rows than ``min_varlen_rows`` wins, for every kernel
    and run bound (exhaustive over small steps); at the bound one does."""
    from vllm_dsa_varlen import policy as pol

    for kernel in (None, "cuda_sm90", "portable"):
        for max_run in (1, 2, 4, 8):
            bound = pol.min_varlen_rows("flattened", kernel=kernel, max_run=max_run)
            for rows in range(1, 70):
                for requests in {1, rows // 4, rows // 2, rows} - {0}:
                    for run in range(1, min(max_run, rows) + 1):
                        if requests * run < rows and run > 1:
                            continue
                        for uniform in (True, False):
                            step = pol.StepFacts(rows=rows, requests=requests, max_run=run,
                                                 uniform=uniform, max_context=1 << 20)
                            if bound is None or rows < bound:
                                assert not pol.varlen_wins(step, "flattened", kernel=kernel)
    assert pol.min_varlen_rows("flattened", kernel="cuda_sm90", max_run=4) == 18
    assert pol.min_varlen_rows("flattened", kernel="portable", max_run=4) == 64
    assert pol.varlen_wins(pol.StepFacts(rows=64, requests=16, max_run=4, uniform=True),
                           "flattened")
    assert pol.min_varlen_rows("flattened", max_run=1) is None  # no rule for 1-token runs
    assert pol.min_varlen_rows("native") is None
    assert pol.min_varlen_rows("native", kernel="cuda_sm90") is None
    assert pol.min_varlen_rows("native", kernel="cuda_sm90", max_run=4) is None


def test_min_varlen_rows_counts_the_tokens_a_rule_asks_of_each_request():
    """A rule asking ``t`` tokens of each of at least ``r`` requests needs
    ``ceil(t * r)`` rows (rows hold every token); one row fewer never wins,
    that many can."""
    from vllm_dsa_varlen import policy as pol

    for requests, per in ((16, 2.8), (5, 1.5), (7, 3.0)):
        table = (pol.Rule("flattened", min_run=2, min_requests=requests,
                          min_tokens_per_request=per, note="t"),)
        bound = pol.min_varlen_rows("flattened", table)
        assert bound == -(-int(per * 10) * requests // 10)
        top = -(-bound // requests)
        fits = [top] * requests
        while sum(fits) > bound:
            fits[fits.index(max(fits))] -= 1
        assert pol.varlen_wins(pol.StepFacts.from_decode_lens(fits), "flattened", table)
        short = pol.StepFacts(rows=bound - 1, requests=requests, max_run=top, uniform=False)
        assert not pol.varlen_wins(short, "flattened", table)


def test_min_varlen_rows_follows_the_table_in_place(monkeypatch):
    """The bound is remembered per table, yet a table swapped in at call time
    (here: random bounds, drawn fresh) is answered from its own rules, and the
    old table's answer comes back with it."""
    rng = random.Random()
    before = policy.min_varlen_rows("flattened", kernel="cuda_sm90", max_run=4)
    for _ in range(5):
        rows = rng.randrange(1, 4096)
        table = (Rule("flattened", min_run=2, max_run_le=4, min_rows=rows),
                 Rule("flattened", min_run=3, min_rows=rows + rng.randrange(1, 64)))
        assert policy.min_varlen_rows("flattened", table, max_run=4) == rows
        monkeypatch.setattr(policy, "MEASURED", table)
        assert policy.min_varlen_rows("flattened", kernel="cuda_sm90", max_run=4) == rows
        assert policy.min_varlen_rows("flattened", kernel="cuda_sm90", max_run=1) is None
        monkeypatch.undo()
    assert policy.min_varlen_rows("flattened", kernel="cuda_sm90", max_run=4) == before


@pytest.mark.parametrize("seed", range(30))
def test_from_query_starts_equals_from_decode_lens(seed):
    """The builders' fast constructor gives the facts ``from_decode_lens`` gives
    for the same counts (graph-padding requests of 0 tokens among them), from a
    list or a tensor of offsets."""
    import torch

    rng = random.Random()
    n = rng.randrange(0, 70)
    lens = [rng.choice([0, rng.randrange(1, 9), 4]) for _ in range(n)]
    start = rng.randrange(0, 100)
    starts = [start]
    for x in lens:
        starts.append(starts[-1] + x)
    rows = sum(lens) + rng.randrange(0, 8)
    ctx = rng.randrange(0, 1 << 17)
    want = StepFacts.from_decode_lens(lens, rows=rows, max_context=ctx)
    assert StepFacts.from_query_starts(starts, rows=rows, max_context=ctx) == want
    assert StepFacts.from_query_starts(torch.tensor(starts, dtype=torch.int32), rows=rows,
                                       max_context=ctx) == want
    assert (StepFacts.from_query_starts(starts, max_context=ctx)
            == StepFacts.from_decode_lens(lens, max_context=ctx))


def test_from_query_starts_refuses_decreasing_offsets():
    with pytest.raises(ValueError, match="query_starts"):
        StepFacts.from_query_starts([0, 4, 3, 8])


@pytest.mark.parametrize("seed", range(20))
def test_uniform_unpadded_holds_exactly_for_uniform_steps_without_padding(seed):
    """``uniform_unpadded`` (two host reads) says True exactly when every
    request is a decode of the longest's tokens (no padding request) and the
    rows are their tokens, as the per-request lengths show."""
    import torch

    rng = random.Random(seed)
    for _ in range(50):
        n = rng.randint(1, 6)
        k = rng.randint(1, 4)
        lens = [k] * n if rng.random() < 0.5 else [rng.choice([0, k, rng.randint(1, 4)])
                                                   for _ in range(n)]
        starts = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
        decodes = n if rng.random() < 0.8 else rng.randint(0, n)
        longest = max(lens)
        rows = sum(lens[:decodes]) + (rng.choice([0, 0, 1, k]))
        want = (decodes == n and longest >= 1 and all(x == longest for x in lens)
                and rows == sum(lens))
        assert uniform_unpadded(n, longest, decodes, rows, starts) == want, (lens, decodes, rows)


def _random_rule(rng: random.Random) -> Rule:
    lo = rng.randint(1, 8)
    return Rule(rng.choice(policy.STOCK_KINDS), min_run=lo,
                max_run_le=rng.choice([None, lo + rng.randint(0, 4)]),
                min_rows=rng.choice([0, rng.randint(1, 256)]),
                min_requests=rng.choice([0, rng.randint(1, 64)]),
                min_context=rng.choice([0, 0, rng.randint(1, 65536)]),
                min_tokens_per_request=rng.choice([0.0, rng.uniform(1, 6)]),
                uniform=rng.choice([None, True, False]),
                kernel=rng.choice([None, "cuda_sm90", "triton"]), note="random")


@pytest.mark.parametrize("seed", range(60))
def test_uniform_step_wins_is_varlen_wins_at_every_context_or_says_it_cannot(seed):
    """The kept answer for a uniform unpadded step equals varlen_wins on that
    step's facts at any context length; where a rule that could match bounds
    contexts it answers None (the caller decides from the facts)."""
    rng = random.Random(seed)
    table = tuple(_random_rule(rng) for _ in range(rng.randint(0, 6)))
    for _ in range(40):
        run = rng.randint(1, 8)
        rows = run * rng.randint(1, 96)
        stock = rng.choice(policy.STOCK_KINDS)
        kernel = rng.choice([None, "cuda_sm90", "triton"])
        known = policy.uniform_step_wins(rows, run, stock, kernel, table)
        bounded = any(r.min_context > 0 and r.uniform is not False and r.stock == stock
                      and (r.kernel is None or r.kernel == kernel) for r in table)
        assert (known is None) == bounded
        for context in (0, 1, rng.randint(1, 1 << 17)):
            facts = StepFacts(rows=rows, requests=rows // run, max_run=run, uniform=True,
                              max_context=context, tokens=rows)
            want = varlen_wins(facts, stock, table, kernel)
            if known is not None:
                assert known == want, (facts, stock, kernel, table)
        # asked again: the kept answer
        assert policy.uniform_step_wins(rows, run, stock, kernel, table) == known


def test_uniform_step_wins_follows_the_table_and_refuses_partial_requests(monkeypatch):
    facts = StepFacts(rows=128, requests=32, max_run=4, uniform=True, tokens=128)
    before = policy.uniform_step_wins(128, 4, "flattened", "cuda_sm90")
    assert before == varlen_wins(facts, "flattened", kernel="cuda_sm90")
    # a table swapped in at call time is a new table, never a stale answer
    monkeypatch.setattr(policy, "MEASURED", ())
    assert policy.uniform_step_wins(128, 4, "flattened", "cuda_sm90") is False
    with pytest.raises(ValueError, match="rows"):
        policy.uniform_step_wins(10, 4, "flattened")
