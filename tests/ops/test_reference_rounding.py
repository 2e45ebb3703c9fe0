"""The head sum's emulations in ops/reference.py (TF32 and bfloat16 rounding,
the tensor-core head sum, the reference's cheaper head sums) against an
independent formulation of the rounding rules, on the CPU."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch
from float_samples import tf32_samples

from vllm_dsa_varlen.ops.reference import (
    head_sum_tf32, paged_mqa_logits_ref, quantize_kv_fp8, round_bf16, round_tf32, split_tf32)


def _tf32_nearest(x: float) -> float:
    """Round a finite float32 value to 11 significant bits, ties to even,
    written from the definition with exact rationals (no bit tricks)."""
    if x == 0 or math.isinf(x) or math.isnan(x):
        return x
    _, e = math.frexp(x)                     # x = f * 2**e, 0.5 <= |f| < 1
    ulp = Fraction(2) ** max(e - 11, -136)  # 11 significant bits (subnormals: 2**-136)
    q = Fraction(x) / ulp
    n = math.floor(q)
    rem = q - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    out = float(n * ulp)
    return out if abs(out) <= 3.4028234663852886e38 else math.copysign(math.inf, x)


def test_round_tf32_is_nearest_ties_to_even():
    x = tf32_samples()
    got = round_tf32(x)
    for a, b in zip(x.tolist(), got.tolist()):
        assert b == _tf32_nearest(a) or (b == a == 0), (a, b, _tf32_nearest(a))
    assert (got.view(torch.int32) & 0x1FFF).eq(0).all()
    # spelled-out ties: to the even neighbour
    assert round_tf32(torch.tensor([1 + 2 ** -11])).item() == 1.0
    assert round_tf32(torch.tensor([1 + 3 * 2 ** -11])).item() == 1 + 2 ** -9
    assert round_tf32(torch.tensor([3.4028234663852886e38])).item() == math.inf
    assert math.isnan(round_tf32(torch.tensor([math.nan])).item())


def test_round_bf16_keeps_8_bits_nearest():
    x = tf32_samples(seed=2)
    x = x[x.abs() < 1e38]  # bf16 rounds float32's largest values to infinity
    got = round_bf16(x)
    assert (got.view(torch.int32) & 0xFFFF).eq(0).all()
    err = (got.double() - x.double()).abs()
    assert (err <= x.double().abs() * 2 ** -8 + 1e-45).all()


def test_split_tf32_carries_22_bits():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(5000, generator=gen) * torch.exp2(torch.randint(-20, 5, (5000,), generator=gen))
    hi, lo = split_tf32(w)
    for part in (hi, lo):
        assert (part.view(torch.int32) & 0x1FFF).eq(0).all()
    assert torch.equal(hi, round_tf32(w))
    err = (hi.double() + lo.double() - w.double()).abs()
    assert (err <= w.double().abs() * 2 ** -21).all()
    assert (err > 0).any()  # not the identity: 24 bits do not fit 22


def test_head_sum_tf32_matches_a_scalar_loop():
    """head_sum_tf32 against a loop of exact rationals: relu, the nearest TF32
    of each operand part, exact products, each part's sum rounded to float32."""
    gen = torch.Generator().manual_seed(5)
    qk = torch.randn(3, 6, 5, generator=gen) * 1000
    w = torch.randn(3, 6, generator=gen)
    got = head_sum_tf32(qk, w)
    f32 = lambda v: struct.unpack("<f", struct.pack("<f", float(v)))[0]  # noqa: E731
    for r in range(3):
        for n in range(5):
            hi_sum = lo_sum = Fraction(0)
            for h in range(6):
                a = Fraction(_tf32_nearest(max(qk[r, h, n].item(), 0.0)))
                wh = w[r, h].item()
                hi = _tf32_nearest(wh)
                lo = _tf32_nearest(f32(wh - hi))
                hi_sum += a * Fraction(hi)
                lo_sum += a * Fraction(lo)
            want = f32(f32(float(hi_sum)) + f32(float(lo_sum)))
            assert got[r, n].item() == want


@pytest.mark.parametrize("how, low, high", [("tf32", 1e-6, 2e-3)])
def test_reference_takes_the_cheaper_head_sums(how, low, high):
    """paged_mqa_logits_ref(head_sum=...): the fp32 reference's positions,
    values within the head sum's rounding of it (TF32's), yet not equal to
    it; bad values refused (bf16; the abs-split sum, the precision study's
    alone, which no kernel computes)."""
    gen = torch.Generator().manual_seed(6)
    heads, dim, page, blocks = 64, 128, 64, 6
    kv = quantize_kv_fp8(torch.randn((blocks, page, dim), generator=gen))
    q = torch.randn((3, 1, heads, dim), generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn((3, heads), generator=gen)
    ids = torch.tensor([0, 0, 1], dtype=torch.int32)
    ctx = torch.tensor([[200], [201], [90]], dtype=torch.int32)
    bt = torch.randperm(blocks, generator=gen)[:4].int().repeat(3, 1)
    fp32 = paged_mqa_logits_ref(q, kv, w, ctx, bt, 256, indices=ids)
    got = paged_mqa_logits_ref(q, kv, w, ctx, bt, 256, indices=ids, head_sum=how)
    fin = torch.isfinite(fp32)
    assert torch.equal(fin, torch.isfinite(got))
    err = (got[fin] - fp32[fin]).norm() / fp32[fin].norm()
    assert low < err < high, err
    for bad in ("bf16", "abs_split"):
        with pytest.raises(ValueError, match="head_sum"):
            paged_mqa_logits_ref(q, kv, w, ctx, bt, 256, indices=ids, head_sum=bad)
    with pytest.raises(ValueError, match="compute_dtype"):
        paged_mqa_logits_ref(q, kv, w, ctx, bt, 256, indices=ids, head_sum=how,
                             compute_dtype=torch.float64)
