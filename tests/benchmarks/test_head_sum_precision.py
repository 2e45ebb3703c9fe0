"""benchmarks/studies/head_sum_precision.py, the CPU study of what a cheaper
head sum costs the top-k: its roundings against an independent formulation,
its measures, its inputs."""

from __future__ import annotations

import importlib.util
import math
import os
import struct
import sys
from fractions import Fraction

import pytest
import torch
from float_samples import tf32_samples

from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "studies",
                     "head_sum_precision.py")
_spec = importlib.util.spec_from_file_location("head_sum_precision", _PATH)
hp = sys.modules["head_sum_precision"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hp)  # (registered first: its dataclasses look their module up)
head_sum_abs_split, linear_query, split_query_fp8 = (hp.head_sum_abs_split, hp.linear_query,
                                                     hp.split_query_fp8)
truncate_tf32 = hp.truncate_tf32


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def test_truncate_tf32_is_toward_zero():
    x = tf32_samples(seed=1)
    got = truncate_tf32(x)
    for a, b in zip(x.tolist(), got.tolist()):
        assert _bits(b) == _bits(a) & 0xFFFFE000
        assert abs(b) <= abs(a) and (b == 0 or math.copysign(1, a) == math.copysign(1, b))
        if a != 0:
            assert abs(a - b) < abs(a) * 2 ** -10


@pytest.mark.parametrize("seed", range(4))
def test_split_query_fp8_carries_about_twelve_bits_and_each_part_is_fp8(seed):
    """split_query_fp8: every part holds e4m3 values, its scale its rest's
    amax / 448 (so a part reaches +-448), and the parts' sum leaves a rest
    below 2^-11 of the row's amax with three parts (each part keeps 3+1 bits,
    each rest shrinks by at least 2^-4 of the one before); zero rows give zero
    parts and scales."""
    gen = torch.Generator().manual_seed(seed)
    qp = torch.randn(6, 128, generator=gen, dtype=torch.float64) * torch.exp(
        3 * torch.randn(6, 1, generator=gen, dtype=torch.float64))
    qp[2] = 0
    values, scales = split_query_fp8(qp, 3)
    assert values.shape == (6, 3, 128) and scales.shape == (6, 3) and scales.dtype == torch.float32
    assert torch.equal(values, values.to(torch.float8_e4m3fn).float())
    live = [r for r in range(6) if r != 2]
    assert values[live, 0].abs().amax(dim=-1).eq(448).all()
    rest = qp - (values.double() * scales.double()[:, :, None]).sum(dim=1)
    amax = qp.abs().amax(dim=-1)
    assert (rest[live].abs().amax(dim=-1) <= amax[live] * 2.0 ** -11).all()
    assert values[2].eq(0).all() and scales[2].eq(0).all()
    one, _ = split_query_fp8(qp, 1)
    assert torch.equal(one[:, 0], values[:, 0])


def test_the_abs_split_head_sum_is_relu_of_the_same_products():
    """head_sum_abs_split against the float64 head sum of the same fp8 q, k:
    within 2^-11 of the row's largest |logit| (the query split's rounding);
    with one head's weight alone it is that head's relu (the halves cancel
    where its q . k is negative, to the split's rounding); the linear query
    is the weighted sum over heads."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(3, 8, 128, generator=gen).mul(100).to(torch.float8_e4m3fn).float()
    k = torch.randn(300, 128, generator=gen).mul(100).to(torch.float8_e4m3fn).float()
    w = torch.randn(3, 8, generator=gen)
    qk = torch.einsum("rhd,nd->rhn", q.double(), k.double()).float()
    exact = (qk.double().relu() * w.double()[:, :, None]).sum(dim=1)
    got = head_sum_abs_split(qk, w, q, k)
    err = (got.double() - exact).abs().amax(dim=-1) / exact.abs().amax(dim=-1)
    assert (err < 2.0 ** -11).all(), err
    assert torch.allclose(linear_query(q, w), torch.einsum("rh,rhd->rd", w.double(), q.double()))
    one = torch.zeros_like(w)
    one[:, 3] = 2.0  # one head: its relu, twice; where its q . k < 0 the two halves cancel
    got = head_sum_abs_split(qk, one, q, k).double()
    want = 2.0 * qk[:, 3].double().relu()
    scale = want.abs().amax(dim=-1, keepdim=True)
    assert ((got - want).abs() <= scale * 2.0 ** -12).all()
    assert (qk[:, 3] < 0).any() and (qk[:, 3] > 0).any()


def _half(x: float) -> float:
    """The nearest fp16 value of a float (ties to even), by IEEE packing."""
    return struct.unpack("<e", struct.pack("<e", x))[0]


@pytest.mark.parametrize("seed", range(3))
def test_prescale_query_bounds_every_dot_with_the_least_power_of_two(seed):
    """prescale_query: q' is e4m3, equal to q * 2**-s where q * 2**-s stays in
    e4m3's normal range; against the fp8 k that makes each dot largest (448
    with q's signs) |q' . k| <= 2**15, and one power of two less would not
    bound the original (s is the least); zero vectors keep s = 0."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-8, 9, (4, 16, 1), generator=gen).float())
    q = (torch.randn(4, 16, 128, generator=gen) * mag).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn).float()
    q[1, 3] = 0
    scaled, s = hp.prescale_query(q)
    assert torch.equal(scaled, scaled.to(torch.float8_e4m3fn).float())
    assert s.eq(s.round()).all() and (s >= 0).all() and s[1, 3] == 0
    exact = q.double() * torch.exp2(-s.double())[..., None]
    normal = exact.abs() >= 2.0 ** -6
    assert torch.equal(scaled.double()[normal], exact[normal])
    worst = (scaled.double().abs() * 448).sum(dim=-1)
    assert (worst <= hp.FP16_LIMIT).all()
    bound = 448 * q.double().abs().sum(dim=-1)
    assert (bound[s > 0] * torch.exp2(-(s[s > 0].double() - 1)) > hp.FP16_LIMIT).all()
    assert (s > 0).any() and (s == 0).any()


def test_the_packed_fp16_head_sum_matches_a_scalar_loop():
    """head_sum_fp16(packed=True) against a loop written from its rules: the
    prescaled dot rounded to float32, relu, nearest fp16; the weight times
    2**(s - t) to nearest fp16; per lane (l = lane % 4) two fp16 chains over
    the 8-head blocks, each step one fused multiply-add rounded to fp16; the
    chains and then the lanes added in float32; times 2**t.  The float32-sum
    build is the same operands' exact sum rounded once; both stay within fp16
    rounding of the float64 head sum, overflow-free on the largest inputs."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(2, 16, 128, generator=gen).mul(150).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn).float()
    k = torch.randn(3, 128, generator=gen).mul(150).clamp(-448, 448)
    k = k.to(torch.float8_e4m3fn).float()
    w = torch.randn(2, 16, generator=gen) * 1e-3
    got = hp.head_sum_fp16(q, k, w, packed=True)
    plain = hp.head_sum_fp16(q, k, w, packed=False)
    scaled, s = hp.prescale_query(q)
    f32 = lambda v: struct.unpack("<f", struct.pack("<f", float(v)))[0]  # noqa: E731
    for r in range(2):
        ws = [w[r, h].item() * 2.0 ** s[r, h].item() for h in range(16)]
        t = math.ceil(math.log2(max(abs(v) for v in ws))) - hp.FP16_W_LOG2
        wh = [_half(v * 2.0 ** -t) for v in ws]
        for n in range(3):
            a = [_half(max(f32(sum(Fraction(x) * Fraction(y) for x, y in
                                   zip(scaled[r, h].tolist(), k[n].tolist()))), 0.0))
                 for h in range(16)]
            lanes = []
            for lane in range(4):
                halves = []
                for half in range(2):
                    acc = 0.0
                    for j in range(2):
                        h = 8 * j + 2 * lane + half
                        acc = _half(float(Fraction(acc) + Fraction(a[h]) * Fraction(wh[h])))
                    halves.append(acc)
                lanes.append(f32(halves[0] + halves[1]))
            want = f32(f32(f32(lanes[0] + lanes[1]) + f32(lanes[2] + lanes[3])) * 2.0 ** t)
            assert got[r, n].item() == want
            exact = float(sum(Fraction(a[h]) * Fraction(wh[h]) for h in range(16)))
            assert plain[r, n].item() == f32(f32(exact) * 2.0 ** t)
    ref = (torch.einsum("rhd,nd->rhn", q.double(), k.double()).relu()
           * w.double()[:, :, None]).sum(dim=1)
    scale = (torch.einsum("rhd,nd->rhn", q.double(), k.double()).abs()
             * w.double().abs()[:, :, None]).sum(dim=1)
    for out in (got, plain):
        assert ((out.double() - ref).abs() <= scale * 2.0 ** -7).all()
    big = torch.full((1, 8, 128), 448.0)
    huge = hp.head_sum_fp16(big, big[0, :1], torch.ones(1, 8), packed=True)
    assert torch.isfinite(huge).all()
    assert huge.item() == pytest.approx(8 * 128 * 448.0 ** 2, rel=1e-2)
    with pytest.raises(ValueError, match="heads"):
        hp.head_sum_fp16(q[:, :12], k, w[:, :12], packed=True)


# ---------------------------------------------------------------- the study

def test_retention_and_calc_diff_measure_what_they_say():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5000, generator=gen)
    assert hp.topk_retention(x, x, 100).tolist() == [1.0] * 3
    y = x.clone()
    top = torch.topk(x[1], 100).indices
    y[1, top[0]] = -10  # one of row 1's top-100 falls out
    assert hp.topk_retention(x, y, 100).tolist() == [1.0, 0.99, 1.0]
    assert hp.calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    assert hp.calc_diff(x, -x) == pytest.approx(2.0)
    assert hp.calc_diff(x, 1.01 * x) == pytest.approx(0.01 ** 2 / (1 + 1.01 ** 2), rel=1e-4)


def test_serving_inputs_have_serving_ranges():
    inp = hp.serving_inputs(rows=3, context=4096, seed=1)
    assert inp.q.abs().amax(dim=-1).eq(448).all()  # each (row, head) vector reaches +-448
    assert inp.k.abs().amax(dim=-1).eq(448).all()
    assert torch.equal(inp.q, inp.q.to(torch.float8_e4m3fn).float())
    # the query scale is folded into the weights (w * q_scale / sqrt(D * H))
    q_scale = inp.q_ref.abs().amax(dim=-1) / 448
    assert torch.allclose(inp.w, inp.w_ref * q_scale, rtol=1e-5)
    pow2 = hp.serving_inputs(rows=2, context=4096, seed=1, pow2_scales=True)
    assert (pow2.k.abs().amax(dim=-1) <= 448).all()
    assert torch.equal(torch.log2(pow2.k_scale), torch.log2(pow2.k_scale).round())
    with pytest.raises(ValueError, match="context"):
        hp.serving_inputs(rows=1, context=100)


def test_study_orders_the_head_sums_by_their_rounding():
    """On serving-like inputs (8K tokens, top-2048): the fp32 path keeps
    everything against itself; the kernel's tf32 sum (weights to 22 bits) is
    closer to fp32 than both operands in TF32, truncation further, bf16
    furthest; fp64 differs from fp32 only by float32's own rounding."""
    rows = {r.how: r for r in hp.study(hp.serving_inputs(rows=4, context=8192, seed=2))}
    assert rows["fp32"].keep.eq(1).all() and rows["fp32"].calc_diff == 0
    assert rows["fp64"].calc_diff < 1e-12
    order = [rows[h].calc_diff for h in ("tf32", "tf32_round", "tf32_trunc", "bf16")]
    assert order == sorted(order) and order[0] > 0, order
    assert rows["bf16"].keep.mean() < rows["tf32"].keep.mean()
    assert rows["tf32"].keep.min() >= 0.99
    # the abs-split sum: three fp8 parts of the linear query closer than two,
    # both closer than bf16; three within the contract on every row
    assert rows["abs_split"].calc_diff < rows["abs_split2"].calc_diff < rows["bf16"].calc_diff
    assert rows["abs_split"].keep.min() >= hp.CONTRACT_KEEP
    # fp16 operands (11 bits, as TF32's): near tf32_round; the packed sum's fp16
    # chains add their own rounding, still well short of bf16's
    assert rows["fp16"].calc_diff < rows["fp16x2"].calc_diff < rows["bf16"].calc_diff
    assert rows["fp16"].calc_diff < 4 * rows["tf32_round"].calc_diff


def test_deepgemm_tolerances_separate_the_head_sums():
    """DeepGEMM's own check (its generator, its two references): the fp32 and
    tf32 head sums pass it; the bf16 one does not (so the check is not blind)."""
    got = hp.deepgemm_check(rows=2, context=4096)
    for how in ("fp32", "tf32", "tf32_round", "abs_split", "fp16", "fp16x2"):
        ref, sim = got[how]
        assert ref < 1e-3 and sim < 5e-6, (how, ref, sim)
    assert got["bf16"][1] > 5e-6


def test_paged_step_holds_the_inputs():
    """paged_step packs requests into the fused paged cache: the torch
    reference on it gives the study's direct head sum, row by row, over the
    tokens each (speculative) row sees."""
    parts = [hp.serving_inputs(rows=3, context=n, seed=i) for i, n in enumerate((2100, 2048))]
    step = hp.paged_step(parts, device="cpu", seed=1)
    assert step["context_lens"].view(-1).tolist() == [2098, 2099, 2100, 2046, 2047, 2048]
    assert step["indices"].tolist() == [0, 0, 0, 1, 1, 1]
    got = paged_mqa_logits_ref(**step)
    row = 0
    for p in parts:
        want = hp.head_sum(hp.qk_fp32(p.q, p.k), p.w, p.k_scale, "fp32")
        for j in range(3):
            c = int(step["context_lens"][row])
            assert torch.allclose(got[row, :c], want[j, :c], rtol=1e-5, atol=1e-6)
            assert torch.isinf(got[row, c:]).all()
            row += 1


def test_gpu_study_compares_what_it_names(monkeypatch):
    """gpu_study's bookkeeping with each build replaced by its torch emulation
    (CPU): the emulation comparisons keep everything, the tf32-vs-fp32 one
    what the CPU study measures."""
    def emulated(step, head_sum, max_run_len):
        return paged_mqa_logits_ref(**step, head_sum=head_sum)

    monkeypatch.setattr(hp, "_run_build", emulated)
    got = hp.gpu_study(requests=2, rows=2, context=4096, seeds=1, k=512, device="cpu")
    assert set(got) == {"tf32 build vs fp32 build", "fp32 build vs reference",
                        "tf32 build vs reference", "tf32 build vs emulation"}
    for label in ("fp32 build vs reference", "tf32 build vs emulation"):
        assert got[label].keep.eq(1).all() and got[label].calc_diff == 0
    assert got["tf32 build vs fp32 build"].keep.numel() == 4
    assert 0 < got["tf32 build vs fp32 build"].calc_diff < 1e-6
