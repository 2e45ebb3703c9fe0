"""benchmarks/studies/bf16_logits_precision.py: the bf16 rounding, the
retention metric and its tie-breaks, at tiny sizes against independent
statements of each."""

import importlib.util
import itertools
import json
import os

import pytest
import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "studies",
                     "bf16_logits_precision.py")
_spec = importlib.util.spec_from_file_location("bf16_logits_precision", _PATH)
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def _special_floats() -> torch.Tensor:
    """float32 values where rounding to bf16 is delicate: exact halfway
    points with an even and an odd kept part, one unit either side of them,
    subnormals, the largest finite value, infinities, zeros, NaN."""
    gen = torch.Generator().manual_seed(1)
    hi = torch.randint(0, 1 << 16, (4000,), generator=gen, dtype=torch.int64) << 16
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF, 0x0001])
    bits = (hi[:, None] | low[None, :]).reshape(-1)
    extra = torch.tensor([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0x00000000,
                          0x80000000, 0x00008000, 0x00018000, 0x7FC00000, 0x007FFFFF],
                         dtype=torch.int64)
    bits = torch.cat([bits, extra])
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return bits.to(torch.int32).view(torch.float32)


def test_bf16_rounding_equals_torch_cast():
    x = torch.cat([_special_floats(), torch.randn(10000) * 1e3, torch.randn(1000) * 1e-39])
    got = study.round_bf16_rn(x)
    want = x.to(torch.bfloat16).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_bf16_rounding_ties_go_to_even():
    # 1 + 2**-8 is halfway between bf16 neighbours 1 and 1 + 2**-7: 1 is even
    one = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8])
    assert study.round_bf16_rn(one).tolist() == [1.0, 1.0 + 2 * 2.0 ** -7]


def _sorted_topk(row: list[float], k: int) -> set[int]:
    """Independent lowest-column-first top-k: sort by (-value, column)."""
    return set(sorted(range(len(row)), key=lambda c: (-row[c], c))[:k])


def test_lowest_column_rule_matches_a_sort_by_value_then_column():
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 6, (20, 40), generator=gen).float()  # many ties
    for k in (1, 7, 20, 39):
        sel = study.select_lowest_column(x, k)
        for r in range(x.shape[0]):
            assert set(sel[r].nonzero().view(-1).tolist()) == _sorted_topk(x[r].tolist(), k)


def test_random_rule_picks_k_columns_among_the_ties_and_reaches_each():
    x = torch.tensor([[9.0, 5, 5, 5, 5, 5, 1, 1]])
    k, tied = 3, [1, 2, 3, 4, 5]
    seen = torch.zeros(8)
    gen = torch.Generator().manual_seed(3)
    for _ in range(400):
        sel = study.select_random(x, k, gen)[0]
        assert int(sel.sum()) == k and bool(sel[0]) and not sel[6:].any()
        seen += sel.float()
    # each tied column is kept about (k - 1) / 5 of the time, none always
    share = seen[tied] / 400
    assert ((share > 0.25) & (share < 0.55)).all(), share


def _brute_force_bounds(key: list[float], ref: set[int], k: int) -> tuple[int, int]:
    """Fewest and most of ``ref`` a top-k of ``key`` can keep, over every
    choice among the values tied at the k-th."""
    t = sorted(key, reverse=True)[k - 1]
    above = [c for c, v in enumerate(key) if v > t]
    tied = [c for c, v in enumerate(key) if v == t]
    kept = [len(ref & set(above + list(pick)))
            for pick in itertools.combinations(tied, k - len(above))]
    return min(kept), max(kept)


def test_tie_breaks_do_what_they_say():
    # ref set {0, 1, 4, 5}; the key ties columns 2..5 at the 4th value
    key = torch.tensor([[6.0, 6.0, 3.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
    ref = torch.zeros(1, 8, dtype=torch.bool)
    ref[0, [0, 1, 4, 5]] = True
    res = study.retention(ref, key, 4, torch.Generator().manual_seed(0))
    assert res["lowest_column"].item() == 0.5  # keeps 2, 3: both outside the ref set
    assert res["worst"].item() == 0.5
    assert res["best"].item() == 1.0
    assert 0.5 <= res["random"].item() <= 1.0
    assert res["tied"].item() == 4 and res["tied_in_ref"].item() == 2


def test_worst_and_best_equal_the_brute_force_bounds():
    gen = torch.Generator().manual_seed(4)
    for _ in range(30):
        n, k = 12, int(torch.randint(2, 8, (1,), generator=gen))
        key = torch.randint(0, 4, (1, n), generator=gen).float()
        ref = torch.zeros(1, n, dtype=torch.bool)
        ref[0, torch.randperm(n, generator=gen)[:k]] = True
        res = study.retention(ref, key, k, gen)
        lo, hi = _brute_force_bounds(key[0].tolist(), set(ref[0].nonzero().view(-1).tolist()), k)
        assert round(res["worst"].item() * k) == lo
        assert round(res["best"].item() * k) == hi
        assert lo <= round(res["lowest_column"].item() * k) <= hi
        assert lo <= round(res["random"].item() * k) <= hi


def test_retention_is_one_for_identical_logits():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((6, 300), generator=gen)
    ref = study.select_lowest_column(x, 50)
    res = study.retention(ref, x.clone(), 50, gen)
    for rule in study.TIE_BREAKS:
        assert torch.equal(res[rule], torch.ones(6, dtype=torch.float64)), rule


def test_retention_drops_when_a_boundary_element_is_perturbed():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn((4, 300), generator=gen)
    k = 50
    ref = study.select_lowest_column(x, k)
    order = x.argsort(dim=1, descending=True)
    y = x.clone()
    r = torch.arange(4)
    # the k-th value falls just below the (k+1)-th: one column swaps out
    y[r, order[:, k - 1]] = x[r, order[:, k]] - 1e-3
    res = study.retention(ref, y, k, gen)
    for rule in study.TIE_BREAKS:
        assert torch.allclose(res[rule], torch.full((4,), (k - 1) / k, dtype=torch.float64)), rule


def test_every_key_keeps_the_order_so_the_best_case_keeps_all():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((8, 3000), generator=gen) * 3 + 1
    x[:, 2500:] = float("-inf")  # columns past the rows' length
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    res = study.study_step(x, ids, k=400)
    for how in study.KEYS:
        key = study.make_key(x, how, 400, study.sibling_rows(ids))
        order = x[:, :2500].argsort(dim=1)
        assert (key[:, :2500].gather(1, order).diff(dim=1) >= 0).all(), how
        assert torch.isinf(key[:, 2500:]).all()
        assert (res[how]["best"] == 1).all(), how
    assert (res["bf16"]["lowest_column"] < 1).any()  # bf16 ties do cost some rows here


def test_sibling_rows_is_another_row_of_the_same_request():
    ids = torch.tensor([0, 0, 1, 2, 2, 2, 7])
    sib = study.sibling_rows(ids).tolist()
    for r, s in enumerate(sib):
        same = [j for j in range(len(ids)) if ids[j] == ids[r] and j != r]
        assert (s in same) if same else s == r


def test_calc_diff_is_half_the_relative_squared_distance():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1000, generator=gen)
    y = x + 1e-2 * torch.randn(1000, generator=gen)
    want = float(((x.double() - y.double()) ** 2).sum()
                 / ((x.double() ** 2).sum() + (y.double() ** 2).sum()))
    assert study.calc_diff(x, y) == pytest.approx(want, rel=1e-9)
    assert study.calc_diff(x, x) == 0.0


def test_serving_step_rows_and_logits():
    step = study.serving_step(2, 2048, tokens=3, heads=4, seed=9)
    assert step.q.dtype == torch.float8_e4m3fn and tuple(step.q.shape) == (6, 1, 4, 128)
    ctx = step.rows.context_lens.tolist()
    assert ctx[1] - ctx[0] == 1 and ctx[2] - ctx[1] == 1  # growing per-token lengths
    logits = study.step_logits(step)
    valid = torch.isfinite(logits)
    assert valid.sum(dim=1).tolist() == ctx
    res = study.study_step(logits, step.rows.indices, k=64)
    assert set(res) == set(study.KEYS)


def test_deepgemm_check_on_a_small_case():
    res = study.deepgemm_check(2, 2048, heads=16, seed=10)
    assert res["fp32"]["pass_fp8_tol"]
    # rounding to bf16 moves the logits off the float32 ones, within DeepGEMM's reference noise
    assert res["bf16"]["vs_simulation"] != res["fp32"]["vs_simulation"]
    assert res["bf16"]["vs_reference"] < study.DEEPGEMM_FP8_TOL[0]


@pytest.mark.parametrize("flag,value", [("--rows", "100:4"), ("--rows", "4096"),
                                        ("--deepgemm", "8192:0")])
def test_bad_arguments_are_refused_by_name(flag, value):
    with pytest.raises(ValueError, match=flag):
        study.main([flag, value])


def test_main_writes_strict_json_and_log(tmp_path):
    assert study.main(["--rows", "4096:4", "--deepgemm", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "study.json") as f:
        data = json.load(f, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    (ctx,) = data["contexts"]
    assert ctx["context"] == 4096 and ctx["rows"] == 4
    assert ctx["keys"]["bf16"]["best"]["min"] == 1.0
    assert (tmp_path / "study.log").read_text().count("bf16") >= 4
