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
