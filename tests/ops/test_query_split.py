"""ops/query_split.py: an ABS_SPLIT build's per-row q' tiles, by torch and by
its Triton kernel (the interpreter on the CPU), against the reference's split."""

import random

import pytest
import torch

from vllm_dsa_varlen.ops import query_split as qs
from vllm_dsa_varlen.ops.reference import linear_query, split_query_fp8
from vllm_dsa_varlen.workloads import make_decode_step


def _unswizzle(tiles):
    """The tiles back in logical order: [R, 2 places, 4 tile rows, 128 bytes]
    (place p's tile rows are 4 p .. 4 p + 3 of a group's atom, chunk c of tile
    row n stored at c ^ n)."""
    rows = tiles.shape[0]
    chunks = tiles.view(rows, 2, 4, 8, 16)
    n = torch.arange(8).view(2, 4)
    swz = torch.arange(8)[None, None, :] ^ n[:, :, None]
    return torch.gather(chunks, 3, swz[None, :, :, :, None].expand_as(chunks)).view(rows, 2, 4, 128)


def _step(seed, heads=64):
    rng = random.Random(seed)
    lens = [rng.randint(1, 5) for _ in range(rng.randint(1, 6))]
    return make_decode_step(lens, [rng.randint(70, 300) for _ in lens], heads=heads, seed=seed)


@pytest.mark.parametrize("seed", range(4))
def test_each_row_has_its_parts_at_both_places_of_a_group(seed):
    """query_split_torch: row r's three e4m3 parts of q' (split_query_fp8 of
    linear_query: the reference's definition) as tile rows 0-2, tile row 3
    zero, once swizzled as the first row of a group and once as the second;
    its scales, then 0; the format check refuses another row count."""
    step = _step(seed)
    rows = step.rows.num_rows
    tiles, scales = qs.query_split_torch(step.q, step.weights)
    qs.check_split((tiles, scales), rows)
    values, want_sc = split_query_fp8(linear_query(step.q.view(rows, 64, 128).float(),
                                                   step.weights))
    want = torch.zeros((rows, 4, 128), dtype=torch.uint8)
    want[:, :3] = values.to(torch.float8_e4m3fn).view(torch.uint8)
    logical = _unswizzle(tiles)
    assert torch.equal(logical[:, 0], want) and torch.equal(logical[:, 1], want)
    assert not torch.equal(tiles[:, :512], tiles[:, 512:])
    assert torch.equal(scales[:, :3], want_sc) and scales[:, 3].eq(0).all()
    with pytest.raises(ValueError, match="split"):
        qs.check_split((tiles[:-1], scales), rows)


@pytest.mark.parametrize("seed", range(3))
def test_the_triton_kernel_writes_the_same_bytes(seed):
    """query_split_triton (one program per row, float64 as the reference) writes
    the torch version's bytes, every byte of its outputs (they start as
    garbage), also for an all-zero row and queries whose rows lie apart; its
    e4m3 rounding (integer operations) is torch's, ties to even, subnormals
    included."""
    step = _step(seed + 10)
    rows = step.rows.num_rows
    q = step.q
    if seed == 1:  # rows apart in memory (a larger buffer's view), heads contiguous
        big = torch.zeros((rows, 64 * 128 + 256), dtype=torch.float8_e4m3fn)
        big[:, :64 * 128] = q.view(rows, -1)
        q = big[:, :64 * 128].view(rows, 1, 64, 128)
        assert q.stride(0) == 64 * 128 + 256
    w = step.weights.clone()
    w[0] = 0  # q' = 0: zero parts and scales
    want = qs.query_split_torch(q, w)
    got = qs.query_split_triton(q, w)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert got[1][0].eq(0).all()


def test_the_kernels_e4m3_rounding_is_torchs_on_every_tie_and_subnormal():
    """_e4m3_round on every e4m3 value, every midpoint between neighbours (ties
    to even) and points just off them, both signs, subnormals and zero: the
    byte and value torch's float8_e4m3fn cast gives."""
    import triton
    import triton.language as tl

    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique().sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    x = x[x.abs() <= 448]
    n = 1 << (x.numel() - 1).bit_length()
    x = torch.cat([x, torch.zeros(n - x.numel())])

    @triton.jit
    def run(x_ptr, b_ptr, v_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        code, value = qs._e4m3_round(tl.load(x_ptr + o))
        tl.store(b_ptr + o, code)
        tl.store(v_ptr + o, value)
    code = torch.empty(n, dtype=torch.int32)
    value = torch.empty(n)
    run[(1,)](x, code, value, N=n)
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(code.to(torch.uint8), want.view(torch.uint8))
    assert torch.equal(value, want.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 37, 1024])
def test_on_the_gpu_the_triton_kernel_writes_the_torch_bytes(rows):
    """On a GPU (compiled, no FP fusion): query_split (the Triton kernel there)
    writes query_split_torch's bytes and scales, serving-like magnitudes."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    q = (torch.randn((rows, 1, 64, 128), device="cuda", generator=gen) * 100).to(
        torch.float8_e4m3fn)
    w = torch.randn((rows, 64), device="cuda", generator=gen) * 1e-3
    got = qs.query_split(q, w)
    want = qs.query_split_torch(q, w)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
