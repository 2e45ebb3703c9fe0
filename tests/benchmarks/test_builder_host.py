"""benchmarks/builder_host.py: the decode batches it builds are shaped as vLLM
pads them (no engine, no timing)."""

import importlib.util
import os
import random

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "builder_host.py")
_spec = importlib.util.spec_from_file_location("builder_host", _PATH)
bh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bh)


@pytest.mark.parametrize("seed", range(8))
def test_verification_steps_pad_to_whole_requests_of_the_next_graph(seed):
    """Every verification step's padded token count is a multiple of k + 1
    covered by its requests (padding requests have 0 tokens), the smallest
    capture size rounded up to a multiple of k + 1 that holds the batch (as
    vLLM 0.27.1 rounds its sizes); drafter steps are B one-token requests."""
    rng = random.Random(seed)
    k = rng.randint(1, 4)
    n = k + 1
    sizes = sorted(rng.sample(range(1, 300), rng.randint(1, 8)))
    batches = sorted(rng.sample(range(1, 80), 4))
    got = bh.decode_batches(k, batches, sizes)
    assert len(got) == 2 * len(batches)
    for b, (verify, draft) in zip(batches, zip(got[::2], got[1::2])):
        label, lens, padded = verify
        assert label == f"B{b} x{n}" and lens[:b] == [n] * b and set(lens[b:]) <= {0}
        fitting = [m for m in (-(-s // n) * n for s in sizes) if m >= b * n]
        assert padded == (min(fitting) if fitting else b * n)
        assert padded % n == 0 and len(lens) * n == padded
        assert draft == (f"B{b} x1", [1] * b, b)


@pytest.mark.parametrize("seed", range(8))
def test_a_cut_share_adds_an_unpadded_variable_step_per_batch(seed):
    """With ``cut``, each batch of two or more requests gains, after its
    verification step, one whose requests keep k + 1 tokens but for the cut
    share (at least one, never all) at 1..k tokens: variable, unpadded."""
    rng = random.Random(seed)
    k, cut = rng.randint(1, 4), rng.choice([0.05, 0.1, 0.25, 0.5, 0.9])
    batches = sorted(rng.sample(range(1, 80), 4))
    got = bh.decode_batches(k, batches, [8, 64, 256], cut)
    plain = bh.decode_batches(k, batches, [8, 64, 256])
    assert [g for g in got if "cut" not in g[0]] == plain
    for label, lens, tokens in (g for g in got if "cut" in g[0]):
        b = int(label[1:label.index(" ")])
        short = [n for n in lens if n < k + 1]
        assert len(lens) == b and 1 <= len(short) < b and abs(len(short) - cut * b) <= 1
        assert all(1 <= n <= k for n in short) and tokens == sum(lens)
        assert max(lens) == k + 1 and len(set(lens)) > 1
    assert sum("cut" in g[0] for g in got) == sum(b > 1 for b in batches) * (k > 0)
    with pytest.raises(ValueError, match="cut"):
        bh.decode_batches(k, batches, [8], 1.0)


@pytest.mark.parametrize("rounds", [1, 2, 5])
def test_modes_alternate_and_the_extra_is_taken_within_a_round(rounds):
    """Stock's and the plugin's rounds alternate (stock first in even rounds);
    the combined µs is each mode's median, the plugin's extra the median of
    its per-round differences (a drift shared by a round's two modes cancels)."""
    order, drift = [], iter(range(100))

    def run(mode):
        order.append(mode)
        d = 10.0 * next(drift)  # the host slows as the run goes on
        return {"B1 x4": {"us": d + (50.0 if mode == "plugin" else 40.0), "dev_ops": 5,
                          "padded_tokens": 4}}

    got = bh.combine(bh.interleaved(rounds, run))
    want = [m for r in range(rounds)
            for m in (("stock", "plugin") if r % 2 == 0 else ("plugin", "stock"))]
    assert order == want
    q = got["plugin"]["B1 x4"]
    assert len(q["us_rounds"]) == rounds and q["dev_ops"] == 5
    ranked = sorted(q["us_rounds"])
    mid = ranked[rounds // 2] if rounds % 2 else (ranked[rounds // 2 - 1] + ranked[rounds // 2]) / 2
    assert q["us"] == pytest.approx(mid)
    # each round: the two runs are 10 us of drift apart, the plugin 10 us dearer
    assert all(abs(x - 10.0) <= 10.0 for x in q["extra_us"])
    assert "extra_us" not in got["stock"]["B1 x4"]
    with pytest.raises(ValueError, match="--rounds: expected an int >= 1"):
        bh.interleaved(0, run)


@pytest.mark.parametrize("seed", range(3))
def test_python_calls_count_each_call_of_a_build(seed):
    """python_calls counts calls per build: a function making n known calls
    reads n more than an empty one (each is one call itself), whatever the
    count of profiled builds."""
    rng = random.Random(seed)
    n, builds = rng.randint(1, 40), rng.randint(1, 30)

    def leaf():
        return None

    def build():
        for _ in range(n):
            leaf()

    base = bh.python_calls(lambda: None, builds)
    assert base >= 1
    assert bh.python_calls(build, builds) - base == pytest.approx(n)
