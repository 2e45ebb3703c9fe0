"""The per-step inputs of the sm_90 kernel's ``ABS_SPLIT`` builds.

That build sums over heads as ``(sum_h |s_h| w_h + k . q') / 2`` (``relu(x) =
(x + |x|) / 2``, :func:`.reference.head_sum_abs_split`): the linear part is the
token's dot with ``q'[r] = sum_h w[r, h] q[r, h]``, carried in
:data:`.reference.SPLIT_PARTS` e4m3 parts with a float32 scale each
(:func:`.reference.split_query_fp8`), which the kernel reads as the B operand of
an m64n8 wgmma.  Per query row ``r`` this module makes

* ``tiles`` uint8 ``[R, 1024]``: the row's four tile rows (its parts, then a
  zero row; ``DIM`` bytes each), 128-byte swizzled (16-byte chunk ``c`` of tile
  row ``n`` stored at chunk ``c ^ n``) twice: bytes ``[0, 512)`` with ``n`` the
  tile row (the row first in its row group), ``[512, 1024)`` with ``n`` 4 more
  (second); the kernel copies the half of the place the row takes;
* ``scales`` float32 ``[R, 4]``: the parts' scales, then 0.

Two implementations of the same definition: :func:`query_split_torch` (torch
operations, the reference's own functions) and :func:`query_split_triton` (one
launch, a program per row, float64 as the reference): graph safe, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import FP8_MAX, SPLIT_PARTS, linear_query, split_query_fp8

TILE_ROWS = 4         # a query row's rows of a group's tile: its parts, then zeros
ROW_TILES = 2         # swizzled for the first and for the second place of a group
SCALES = 4            # its parts' scales, then zeros
TILE_BYTES = ROW_TILES * TILE_ROWS * 128


def query_split_torch(q, weights):
    """``(tiles, scales)`` (module docstring) by torch operations."""
    rows, _, heads, dim = q.shape
    dev = q.device
    values, scales = split_query_fp8(
        linear_query(q.view(rows, heads, dim).float(), weights.view(rows, heads)))
    tile = torch.zeros((rows, TILE_ROWS, dim), dtype=torch.uint8, device=dev)
    tile[:, :SPLIT_PARTS] = values.to(torch.float8_e4m3fn).view(torch.uint8)
    chunks = tile.view(rows, 1, TILE_ROWS, dim // 16, 16).expand(
        rows, ROW_TILES, TILE_ROWS, dim // 16, 16)
    n = torch.arange(ROW_TILES * TILE_ROWS, device=dev).view(ROW_TILES, TILE_ROWS)
    swz = torch.arange(dim // 16, device=dev)[None, None, :] ^ n[:, :, None]
    swizzled = torch.gather(chunks, 3, swz[None, :, :, :, None].expand_as(chunks))
    sc = torch.zeros((rows, SCALES), dtype=torch.float32, device=dev)
    sc[:, :SPLIT_PARTS] = scales
    return swizzled.reshape(rows, ROW_TILES * TILE_ROWS * dim), sc


@triton.jit
def _e4m3_round(v):
    """``v`` (float32, ``|v| <= 448``) to the nearest e4m3 value, ties to even:
    ``(its byte as int32, its value as float32)``, by integer operations on the
    float's bits (the same in Triton's CPU interpreter, whose fp8 casts round
    otherwise, and on a GPU).  Normal range (``>= 2**-6``): the 20 mantissa
    bits e4m3 lacks rounded away with a carry into the exponent, the exponent
    rebiased (127 -> 7); below it, ``round(|v| * 2**9)`` (2**-9 units)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    mag = bits & 2147483647
    normal = mag >= (121 << 23)
    rounded = (mag + 524287 + ((mag >> 20) & 1)) & -1048576
    small = tl.abs(v) * 512.0
    sub = (small + 8388608.0) - 8388608.0  # ties to even below 2**22
    byte = tl.where(normal, (rounded >> 20) - (120 << 3), sub.to(tl.int32))
    value = tl.where(normal, rounded.to(tl.float32, bitcast=True), sub * (1.0 / 512.0))
    value = tl.where(sign != 0, -value, value)
    return byte | ((sign >> 24) & 128), value


@triton.jit
def _query_split_kernel(q_ptr, w_ptr, tiles_ptr, scales_ptr, stride_q, stride_h, stride_w,
                        H: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr,
                        FP8_LIMIT: tl.constexpr):
    """Row ``program_id``'s q' (float64), its parts and scales, stored swizzled
    at both places of a group (the module docstring)."""
    r = tl.program_id(0)
    offs_h = tl.arange(0, H)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + r * stride_q + offs_h[:, None] * stride_h + offs_d[None, :]).to(tl.float32)
    w = tl.load(w_ptr + r * stride_w + offs_h)
    rest = tl.sum(q.to(tl.float64) * w.to(tl.float64)[:, None], axis=0)
    chunk = offs_d // 16
    within = offs_d % 16
    base = tiles_ptr + r * (2 * 4 * D)
    for j in tl.static_range(4):
        if j < PARTS:
            amax = tl.max(tl.abs(rest), axis=0)
            scale = (amax / FP8_LIMIT).to(tl.float32)
            live = scale > 0
            safe = tl.where(live, scale, 1.0).to(tl.float64)
            v = (rest / safe).to(tl.float32)
            v = tl.minimum(tl.maximum(v, -FP8_LIMIT), FP8_LIMIT)
            v = tl.where(live, v, 0.0)
            code, v8 = _e4m3_round(v)
            rest = rest - v8.to(tl.float64) * scale.to(tl.float64)
            byte = code.to(tl.uint8)
            tl.store(scales_ptr + r * 4 + j, scale)
        else:
            byte = tl.zeros((D,), dtype=tl.uint8)
            tl.store(scales_ptr + r * 4 + j, 0.0)
        for p in tl.static_range(2):
            n = 4 * p + j
            tl.store(base + p * (4 * D) + j * D + (chunk ^ n) * 16 + within, byte)


def query_split_triton(q, weights):
    """``(tiles, scales)`` (module docstring) in one launch: a program per row."""
    rows, _, heads, dim = q.shape
    tiles = torch.empty((rows, TILE_BYTES), dtype=torch.uint8, device=q.device)
    scales = torch.empty((rows, SCALES), dtype=torch.float32, device=q.device)
    if rows:
        _query_split_kernel[(rows,)](q, weights, tiles, scales, q.stride(0), q.stride(2),
                                     weights.stride(0),
                                     H=heads, D=dim, PARTS=SPLIT_PARTS, FP8_LIMIT=FP8_MAX,
                                     enable_fp_fusion=False)  # each rounding as torch's
    return tiles, scales


def query_split(q, weights):
    """``(tiles, scales)``: :func:`query_split_triton` on a CUDA device (one
    launch), else :func:`query_split_torch`."""
    if q.is_cuda:
        return query_split_triton(q, weights)
    return query_split_torch(q, weights)


def check_split(split, rows: int) -> None:
    """``ValueError`` naming ``split`` unless it is this module's format for ``rows`` rows."""
    ok = (isinstance(split, (tuple, list)) and len(split) == 2
          and all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in split)
          and split[0].dtype == torch.uint8 and split[0].shape == (rows, TILE_BYTES)
          and split[1].dtype == torch.float32 and split[1].shape == (rows, SCALES))
    if not ok:
        raise ValueError(f"split: expected (uint8 [{rows}, {TILE_BYTES}], float32 "
                         f"[{rows}, {SCALES}]) from query_split()")
