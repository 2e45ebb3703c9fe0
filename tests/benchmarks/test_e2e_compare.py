"""Two end-to-end runs compared (``benchmarks/e2e_compare.py``): the TPOT
ratio and step statistics, the token verdict, the run's table."""

import importlib.util
import os
import random
import statistics

import pytest

_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_DIR, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


e2e = _load("e2e_decode")
ec = _load("e2e_compare")
import e2e_trace  # noqa: E402  (beside them, on the path they set)
from e2e_runs import run_file  # noqa: E402


def _diverging(rng, length, by=1):
    """Stock's tokens (4 requests of ``length``), the plugin's (one token
    raised by ``by``), and where they part."""
    tokens = [[rng.randrange(1000) for _ in range(length)] for _ in range(4)]
    other = [list(t) for t in tokens]
    r, pos = rng.randrange(4), rng.randrange(length)
    other[r][pos] += by
    return tokens, other, r, pos


@pytest.mark.parametrize("seed", range(20))
def test_first_divergence_finds_the_first_differing_token(seed):
    rng = random.Random(seed)
    a = [[rng.randrange(100) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    b = [list(x) for x in a]
    assert ec.first_divergence(a, b) is None
    r = rng.randrange(6)
    pos = rng.randrange(len(a[r]))
    b[r][pos] = a[r][pos] + 1
    for later in range(r + 1, 6):  # later requests differ too: the first one is reported
        b[later][0] += 1
    assert ec.first_divergence(a, b) == {"request": r, "position": pos, "stock": a[r][pos],
                                          "plugin": a[r][pos] + 1}
    b = [list(x) for x in a]
    b[r] = b[r][:-1]
    assert ec.first_divergence(a, b)["position"] == len(a[r]) - 1


def test_compare_reports_speed_and_identity():
    stock, plugin = run_file([[1, 2, 3]]), run_file([[1, 2, 4]])
    plugin["cases"][0]["tpot_ms"] = 1.6
    row = ec.compare(stock, plugin)["rows"][0]
    assert row["speedup"] == pytest.approx(2.0 / 1.6)
    assert not row["tokens_identical"] and row["first_divergence"]["position"] == 2


@pytest.mark.parametrize("seed", range(8))
def test_compare_says_where_stock_disagrees_with_itself(seed):
    rng = random.Random(seed)
    tokens, other, r, pos = _diverging(rng, 6)
    stock, plugin = run_file(tokens), run_file(other)
    stock_rounds, plugin_rounds = rng.random() < 0.5, rng.random() < 0.5
    stock["cases"][0]["rounds_tokens_equal"] = stock_rounds
    plugin["cases"][0]["rounds_tokens_equal"] = plugin_rounds
    lp = -rng.uniform(1, 10)
    tie = rng.random() < 0.5
    second = lp if tie else lp - rng.uniform(1e-6, 1e-3)
    top2 = [[[[t, lp], [t + 1, second]] for t in row] for row in tokens]
    stock["identity"] = {"batch": 4, "prompt": 4096, "tokens": tokens, "top2": top2}
    plugin["identity"] = {"batch": 4, "prompt": 4096, "tokens": other, "top2": top2}
    cmp = ec.compare(stock, plugin)
    row = cmp["rows"][0]
    assert row["rounds_tokens_equal"] == [stock_rounds, plugin_rounds]
    verdict = ec.tokens_verdict(row)
    assert verdict.startswith("NO") and (("stock's own rounds" in verdict) == (not stock_rounds))
    assert cmp["identity"]["first_divergence"]["request"] == r
    assert cmp["identity"]["stock_tie"] is tie
    assert ec.tokens_verdict(ec.compare(stock, run_file(tokens))["rows"][0]) == "yes"
    assert ec.stock_tie([]) is None and ec.stock_tie([[[1, lp]]]) is None


@pytest.mark.parametrize("seed", range(12))
def test_a_case_difference_at_a_tie_of_stocks_identity_run_is_named(seed):
    rng = random.Random(seed)
    tokens, other, r, pos = _diverging(rng, 8, by=1 + rng.randrange(5))
    stock, plugin = run_file(tokens), run_file(other)
    lp = -rng.uniform(1, 10)
    top2 = [[[[t, lp], [t + 7, lp - rng.uniform(1e-6, 1e-3)]] for t in row] for row in tokens]
    identity = {"batch": 4, "prompt": 4096, "tokens": [list(t) for t in tokens], "top2": top2}
    stock["identity"] = plugin["identity"] = identity
    # no tie in stock's identity run: a plain difference
    row = ec.compare(stock, plugin)["rows"][0]
    assert row["stock_tie"] is False and ec.tokens_verdict(row) == "NO"
    # stock's top two tie there, between the two tokens the engines chose
    top2[r][pos] = [[other[r][pos], lp], [tokens[r][pos], lp]]
    row = ec.compare(stock, plugin)["rows"][0]
    assert row["stock_tie"] is True
    assert ec.tokens_verdict(row) == "NO (at an exact tie of stock's top two)"
    stock["cases"][0]["rounds_tokens_equal"] = False  # stock's own rounds take precedence
    assert "stock's own rounds" in ec.tokens_verdict(ec.compare(stock, plugin)["rows"][0])
    del stock["cases"][0]["rounds_tokens_equal"]
    # a tie between other tokens says nothing about this difference
    top2[r][pos] = [[other[r][pos] + 1000, lp], [tokens[r][pos], lp]]
    assert ec.compare(stock, plugin)["rows"][0]["stock_tie"] is False
    top2[r][pos] = [[other[r][pos], lp], [tokens[r][pos], lp]]
    # the identity run speaks only for the same prompts and the same tokens before
    identity["prompt"] = 8192
    assert ec.compare(stock, plugin)["rows"][0]["stock_tie"] is None
    identity["prompt"] = 4096
    if pos:
        identity["tokens"][r][pos - 1] += 1
        assert ec.compare(stock, plugin)["rows"][0]["stock_tie"] is None
        identity["tokens"][r][pos - 1] -= 1
    if r:
        identity["tokens"] = identity["tokens"][:r]  # fewer requests than the case
        assert ec.compare(stock, plugin)["rows"][0]["stock_tie"] is None
    assert ec.tie_at(None, stock["cases"][0], identity) is None


def test_skipped_cases_pass_through_compare_table_and_spread():
    stock, plugin = run_file([[1, 2, 3]]), run_file([[1, 2, 3]])
    for run in (stock, plugin):
        run["cases"].append({"batch": 64, "prompt": 32768, "skipped": "does not fit"})
    cmp = ec.compare(stock, plugin)
    assert cmp["rows"][1] == {"batch": 64, "prompt": 32768, "k": 3, "skipped": "does not fit"}
    assert cmp["rows"][0]["tokens_identical"]
    text = ec.table({"per_k": {"3": {"comparison": cmp}}})
    assert "| 3 | 64 | 32K | skipped: does not fit |" in text
    assert text.count("\n") == 3  # header, rule, two rows
    spread = e2e.repeat_spread([{"stock": stock, "plugin": plugin}])
    assert [s["gain_median"] for s in spread] == [1.0, None]


def test_a_case_probe_is_the_mean_of_the_probes_around_its_round():
    a, b = random.uniform(1, 3), random.uniform(1, 3)
    assert ec._case_probe({"host_probe_us": a, "host_probe_after_us": b}) == (a + b) / 2
    assert ec._case_probe({"host_probe_us": a}) == a
    assert ec._case_probe({}) is None


@pytest.mark.parametrize("seed", range(4))
def test_fast_steps_compare_two_engines_through_the_hosts_phases(seed):
    """Both engines meet the same host phases (step-time multipliers, shuffled
    differently across rounds) and one engine's steps cost ``f`` times the
    other's: the pooled low quantile's ratio is ``f`` exactly, whatever the
    rounds' means say; runs without step times give None."""
    rng = random.Random(seed)
    f = rng.uniform(0.9, 1.1)
    phases = [rng.choice((1.0, 2.2)) * rng.uniform(1, 1.05) for _ in range(3 * 40)]

    def case(scale):
        mine = phases[:]
        rng.shuffle(mine)
        return {"rounds": [{"step_ms": [10 * scale * m for m in mine[i::3]]} for i in range(3)]}

    stock, plugin = case(f), case(1.0)
    assert ec.fast_step_ms(stock) / ec.fast_step_ms(plugin) == pytest.approx(f, rel=1e-12)
    assert ec.fast_step_ms({"rounds": [{"tpot_ms": 1.0}]}) is None
    low = sorted(t for r in plugin["rounds"] for t in r["step_ms"])
    assert ec.fast_step_ms(plugin) in low[:len(low) // 4 + 1]


@pytest.mark.parametrize("seed", range(6))
def test_step_pairs_pair_each_step_with_the_other_engines_same_step(seed):
    """Step pairs: stock ÷ plugin of the steps with the same round and index
    (a run whose rounds have different lengths pairs the common steps); a
    host phase that slows both engines' step alike leaves its pair at 1."""
    rng = random.Random(seed)
    rounds_s, rounds_p, want = [], [], []
    for _ in range(rng.randint(1, 4)):
        n = rng.randint(1, 40)
        base = [rng.uniform(10, 14) * rng.choice([1.0, 1.5]) for _ in range(n)]  # phases
        gain = rng.uniform(0.9, 1.1)
        s = [b * gain for b in base]
        p = list(base) + [rng.uniform(10, 14)] * rng.randint(0, 3)  # extra steps: unpaired
        rounds_s.append({"step_ms": s})
        rounds_p.append({"step_ms": p})
        want += [gain] * n
    got = ec.step_pairs({"rounds": rounds_s}, {"rounds": rounds_p})
    want.sort()
    assert got["n"] == len(want)
    assert got["median"] == pytest.approx(statistics.median(want))
    assert got["p10"] <= got["median"] <= got["p90"]
    assert min(want) - 1e-9 <= got["p10"] and got["p90"] <= max(want) + 1e-9
    assert ec.step_pairs({"rounds": [{}]}, {"rounds": [{}]}) is None
    assert ec.step_pairs({}, {}) is None


@pytest.mark.parametrize("seed", range(4))
def test_a_rows_indexer_share_is_its_own_cases_trace_or_none(seed):
    """The table's indexer share of a row comes from the trace at that row's
    case (in `traces` or the one `trace`); rows with no trace show '-', not
    another case's share."""
    rng = random.Random(seed)
    cases = [(b, x) for b in (1, 8, 32) for x in (4096, 16384)]
    traced = rng.sample(cases, rng.randint(1, len(cases)))
    share = {c: (rng.uniform(0.05, 0.5), rng.uniform(0.05, 0.5)) for c in traced}

    def t(mode, c):
        return {"batch": c[0], "prompt": c[1], "indexer_share": share[c][mode == "plugin"]}
    entry = {"traces": {m: [t(m, c) for c in traced[:-1]] for m in ("stock", "plugin")},
             "trace": {m: t(m, traced[-1]) for m in ("stock", "plugin")}}
    rows = []
    for b, x in cases:
        rows.append({"batch": b, "prompt": x, "stock_tok_s": 1.0, "plugin_tok_s": 1.0,
                     "stock_tpot_ms": 10.0, "plugin_tpot_ms": 10.0, "speedup": 1.0,
                     "tokens_identical": True, "plugin_paths": {"varlen": 1},
                     "indexer_build_us": [1.0, 1.0]})
    entry["comparison"] = {"rows": rows}
    text = ec.table({"per_k": {"2": entry}})
    for b, x in cases:
        assert e2e_trace.case_share(entry, "plugin", b, x) == (share[(b, x)][1] if (b, x) in share
                                                         else None)
        line = [s for s in text.splitlines() if s.startswith(f"| 2 | {b} | {x // 1024}K |")][0]
        cell = line.split("|")[11].strip()
        want = (f"{share[(b, x)][0]:.0%} / {share[(b, x)][1]:.0%}" if (b, x) in share
                else "- / -")
        assert cell == want, (cell, want)
