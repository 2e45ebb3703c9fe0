"""The decode-path counters: what is recorded is what is read back."""

import random

import pytest

from vllm_dsa_varlen import stats


def test_counts_follow_the_records():
    stats.reset()
    rng = random.Random(7)
    want = {k: dict.fromkeys(stats.PATHS, 0) for k in ("steps", "variable", "mixed")}
    want["topk"] = dict.fromkeys(stats.TOPK, 0)
    for _ in range(200):
        path = rng.choice(stats.PATHS)
        variable, mixed = rng.random() < 0.3, rng.random() < 0.2
        stats.record(path, variable=variable, mixed=mixed)
        want["steps"][path] += 1
        want["variable"][path] += variable
        want["mixed"][path] += mixed
        own, captured = rng.random() < 0.5, rng.random() < 0.5
        stats.record_topk(own, captured)
        want["topk"][("own_" if own else "vllm_") + ("captured" if captured else "eager")] += 1
    assert stats.snapshot() == want
    stats.reset()
    assert all(v == 0 for kind in stats.snapshot().values() for v in kind.values())


def test_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path"):
        stats.record("varlen_fast", variable=False, mixed=False)
