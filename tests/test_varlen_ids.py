"""The id buffer's record (``varlen_ids.ids_hold`` / ``ids_written``) against
an independent model of what the buffer holds, over random write sequences."""

import random
from types import SimpleNamespace

import pytest

from vllm_dsa_varlen.varlen_ids import ids_hold, ids_written


@pytest.mark.parametrize("seed", range(5))
def test_the_record_never_claims_ids_the_buffer_does_not_hold(seed):
    rng = random.Random(seed)
    size = 64
    buffer = [None] * size                       # what the ids really are
    holder = SimpleNamespace(_varlen_ids_layout=(0, 0))
    claims = 0
    for _ in range(400):
        n, rows = rng.randint(1, 4), rng.randint(1, size)
        want = [r // n for r in range(rows)]
        kind = rng.choice(("uniform", "other", "failed"))
        if kind == "uniform":
            ready = ids_hold(holder, n, rows)
            if ready:
                claims += 1
                assert buffer[:rows] == want  # a claim must be true
            with ids_written(holder, (n, rows), skip=ready):
                if not ready:
                    buffer[:rows] = want
        elif kind == "other":
            with ids_written(holder, None):
                buffer[:rows] = [rng.randint(0, 9) for _ in range(rows)]
        else:  # a write that raises half way: the record must not claim it
            with pytest.raises(RuntimeError):
                with ids_written(holder, (n, rows)):
                    buffer[: rows // 2] = want[: rows // 2]
                    raise RuntimeError("launch failed")
        held_n, held_rows = holder._varlen_ids_layout
        if held_n:
            assert buffer[:held_rows] == [r // held_n for r in range(held_rows)]
    assert claims > 0  # the record did save writes


def test_a_skipped_write_keeps_the_record():
    holder = SimpleNamespace(_varlen_ids_layout=(3, 30))
    with ids_written(holder, (3, 12), skip=True):
        pass
    assert holder._varlen_ids_layout == (3, 30)
    assert ids_hold(holder, 3, 30) and not ids_hold(holder, 3, 31) and not ids_hold(holder, 2, 4)
