"""The id buffer's record (``varlen_ids.ids_hold`` / ``ids_written``) against
an independent model of what the buffer holds, over random write sequences."""

import random
from types import SimpleNamespace

import pytest

from vllm_dsa_varlen.varlen_ids import first_rows, ids_hold, ids_written


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


@pytest.mark.parametrize("rows", [0, 1, 4, 7, 9])
def test_first_rows_cuts_longer_tensors_and_hands_back_the_rest(rows):
    """Each tensor cut to its first ``rows`` rows where it has more (a view of
    the same storage), itself where it has ``rows`` or fewer."""
    import torch

    ids = torch.arange(7, dtype=torch.int32)
    ctx = torch.randint(1, 99, (7, 1), dtype=torch.int32)
    table = torch.randint(0, 9, (7, 3), dtype=torch.int32)
    short = torch.zeros(2, dtype=torch.int32)
    got = first_rows(rows, ids, ctx, table, short)
    for before, after in zip((ids, ctx, table, short), got):
        if before.shape[0] <= rows:
            assert after is before
        else:
            assert after.shape == (rows, *before.shape[1:])
            assert torch.equal(after, before[:rows])
            assert after._base is before  # a view of it, nothing copied
