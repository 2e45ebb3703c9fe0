"""The reference against a scalar loop that decodes the fused KV bytes itself."""

import math
import struct

import pytest
import torch

from vllm_dsa_varlen.ops import reference
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, quantize_kv_fp8, valid_mask


def fp8_byte_to_float(byte):
    """e4m3fn decode, written out from the format (bias 7, no infinities)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def scalar_logit(q, w, kv_bytes, block, tok, heads, dim, page):
    raw = kv_bytes[block].reshape(-1).tolist()
    k = [fp8_byte_to_float(raw[tok * dim + d]) for d in range(dim)]
    scale = struct.unpack("<f", bytes(raw[page * dim + 4 * tok: page * dim + 4 * tok + 4]))[0]
    total = 0.0
    for h in range(heads):
        dot = sum(float(q[h, d]) * k[d] for d in range(dim))
        total += max(dot, 0.0) * scale * float(w[h])
    return total


@pytest.mark.parametrize("varlen", [False, True])
def test_reference_matches_scalar_loop(varlen):
    gen = torch.Generator().manual_seed(3)
    heads, dim, page, blocks = 2, 8, 4, 9
    kv = quantize_kv_fp8(torch.randn((blocks, page, dim), generator=gen))
    if varlen:
        ids = torch.tensor([0, 0, 1, 2, 2, 2], dtype=torch.int32)
        ctx = torch.tensor([5, 6, 3, 7, 8, 9], dtype=torch.int32).view(-1, 1)
        bt = torch.randperm(blocks, generator=gen)[:3].int().repeat(6, 1)
        bt[2] = torch.randperm(blocks, generator=gen)[:3].int()
        bt[3] = torch.randperm(blocks, generator=gen)[:3].int()
        bt[4:] = 0  # not the run's first row: must not be read
        q = torch.randn((6, 1, heads, dim), generator=gen).to(torch.float8_e4m3fn)
    else:
        ids = None
        ctx = torch.tensor([[5, 6], [2, 3], [9, 10]], dtype=torch.int32)
        bt = torch.stack([torch.randperm(blocks, generator=gen)[:3].int() for _ in range(3)])
        q = torch.randn((3, 2, heads, dim), generator=gen).to(torch.float8_e4m3fn)
    rows = ctx.numel()
    w = torch.randn((rows, heads), generator=gen)
    max_len = 12
    got = paged_mqa_logits_ref(q, kv, w, ctx, bt, max_len, indices=ids)
    q_rows = q.reshape(rows, heads, dim).float()
    flat_ctx = ctx.reshape(-1).tolist()
    first = list(range(rows)) if ids is None else [
        next(s for s in range(r, -1, -1) if s == 0 or ids[s - 1] != ids[r]) for r in range(rows)]
    last = list(range(rows)) if ids is None else [
        next(e for e in range(r, rows) if e == rows - 1 or ids[e + 1] != ids[r]) for r in range(rows)]
    for r in range(rows):
        bt_row = bt[first[r]] if ids is not None else bt[r // 2]
        limit = min(flat_ctx[r], flat_ctx[last[r]]) if ids is not None else flat_ctx[r]
        for n in range(max_len):
            if n < limit:
                want = scalar_logit(q_rows[r], w[r], kv, int(bt_row[n // page]), n % page, heads, dim, page)
                assert got[r, n].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
            else:
                assert got[r, n].item() == float("-inf")


def test_valid_mask_bounds_rows_by_their_run():
    ids = torch.tensor([4, 4, 4, 9], dtype=torch.int32)
    ctx = torch.tensor([3, 7, 5, 2], dtype=torch.int32)
    m = valid_mask(ctx, 8, ids)
    assert m.sum(1).tolist() == [3, 5, 5, 2]
    assert valid_mask(ctx, 8).sum(1).tolist() == [3, 7, 5, 2]


def _fma_exact(a: float, b: float, c: float) -> float:
    """``a * b + c`` rounded once to float32 (ties to even), in rationals."""
    from fractions import Fraction

    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = torch.tensor([float(exact)], dtype=torch.float64).float()  # within one step
    cands = [torch.nextafter(near, torch.tensor([-math.inf])), near,
             torch.nextafter(near, torch.tensor([math.inf]))]
    dist = [abs(Fraction(x.item()) - exact) for x in cands]
    best = min(dist)
    ties = [x for x, d in zip(cands, dist) if d == best]
    if len(ties) == 1:
        return ties[0].item()
    return next(x.item() for x in ties if x.view(torch.int32).item() & 1 == 0)


def test_fma32_rounds_once():
    """reference.fma32 against rational arithmetic: random float32 triples of
    mixed magnitudes, and a triple whose float64 sum lands on a float32 tie
    (rounding through float64 would give the other neighbour)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    n = 3000
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    b = torch.randn(n, generator=g)
    c = -(a * b) * (1 + torch.randn(n, generator=g) * 2.0 ** -10)  # cancellation: fused matters
    c[: n // 3] = torch.randn(n // 3, generator=g)
    got = reference.fma32(a, b, c)
    want = torch.tensor([_fma_exact(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())])
    assert torch.equal(got, want)
    twice = (a * b) + c
    assert (twice != want).float().mean() > 0.1  # the inputs tell one rounding from two

    a1 = torch.tensor([2.0 ** -12 * (1 + 2.0 ** -23)])
    b1 = torch.tensor([2.0 ** -12 * (1 - 2.0 ** -23)])
    c1 = torch.tensor([1 + 2.0 ** -23])
    via64 = (a1.double() * b1.double() + c1.double()).float()
    assert via64.item() == 1 + 2.0 ** -22  # the double rounding
    assert reference.fma32(a1, b1, c1).item() == 1 + 2.0 ** -23 == _fma_exact(
        a1.item(), b1.item(), c1.item())
