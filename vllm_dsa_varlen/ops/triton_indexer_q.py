"""The indexer query's preparation alone, in few, wide programs (Triton; sm_90 in serving).

vLLM 0.27's DeepSeek-V3.2 indexer (``vllm.model_executor.models.deepseek_v2``)
prepares its query with ``fused_indexer_q_rope_quant(positions, q,
cos_sin_cache, weights, softmax_scale, head_scale, is_neox)``:

* ``q [T, H, 128]`` (bf16): RoPE on its first 64 dims (NeoX halves, or
  interleaved pairs), each RoPE'd value rounded to bf16; then fp8 e4m3 with one
  power-of-two (ue8m0) scale per token and head, ``s = 2 ** ceil(log2(max(amax,
  1e-10) * (1 / 448)))``, the quotients clamped to +-448;
* ``weights [T, H]`` -> ``weights * s * softmax_scale * head_scale`` (float32).

Its Triton kernel launches a one-warp program per token and head (16384 at
256 tokens of 64 heads), each 128 values: bound by how fast the GPU starts
programs.  This kernel gives a program a token's block of ``heads`` heads as
one 2-D tile (:func:`~.triton_fused_q.index_rope_operands` reads it, as for
vLLM 0.33's ``fused_q``).  The arithmetic is vLLM's kernel's as it runs on
Hopper: its RoPE ``a cos - b sin`` / ``b cos + a sin`` is left to the compiler
there, and ``ptxas`` fuses the first value's product in both (``fma(a, cos,
-(b sin))``, ``fma(a, sin, b cos)``; the sm_90 SASS of its kernel, Triton 3.8
and 3.9 alike, NeoX and interleaved, float32 and bf16 tables).  Those forms
are written out here (``tl.fma``) and nothing else is fused
(``COMPILE_OPTIONS``); where Triton does not fuse by default, vLLM's kernel
rounds every product and so does this one
(:data:`~.triton_fused_q.ROPE_FUSED`).
:func:`~.reference.indexer_q_reference` is the torch statement of the same
maths.

Nothing here imports vLLM; the vLLM 0.27 patch
(:mod:`vllm_dsa_varlen.vllm_0_27.model_executor.models.deepseek_v2`) decides
where it serves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_fused_q
from .common import check_out_tensor, fail, is_pow2
from .reference import FP8_MAX
from .triton_fused_q import (COMPILE_OPTIONS, FLOATS, INDEX_HEADS, NEG_ONE, NUM_WARPS,
                             index_rope_operands)


@triton.jit
def _indexer_q_kernel(
    pos_ptr, q_ptr, q_s0, q_s1, cs_ptr, cs_s0, out_ptr, out_s0, out_s1,
    w_ptr, w_s0, w_s1, softmax_scale, head_scale, w_out_ptr, w_out_s0, w_out_s1,
    NUM_HEADS: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr, HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr, FP8_LIMIT: tl.constexpr, FUSED: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h = heads[:, None]
    d = tl.arange(0, DIM)[None, :]
    hmask = h < NUM_HEADS
    pos = tl.load(pos_ptr + tok)
    x, partner, cos, sin, in_rope, first = index_rope_operands(
        q_ptr + tok * q_s0 + h * q_s1, pos, cs_ptr, cs_s0, h, d, NUM_HEADS, HALF, INTERLEAVE)
    if FUSED:  # the pair (a, b) -> (fma(a, cos, -(b sin)), fma(a, sin, b cos))
        a = tl.where(first, x, partner)
        # -(b sin) as a product with -1: NEG_ONE's note
        roped = tl.fma(a, tl.where(first, cos, sin),
                       tl.where(first, partner * sin * NEG_ONE, x * cos))
    else:  # (a cos - b sin, b cos + a sin), every product rounded
        roped = tl.where(first, x * cos - partner * sin, x * cos + partner * sin)
    # each RoPE'd value rounded to bf16
    x = tl.where(in_rope, roped.to(tl.bfloat16).to(tl.float32), x)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(amax, 1e-10) * (1.0 / FP8_LIMIT)
    scale = tl.math.exp2(tl.math.ceil(tl.math.log2(scale)))
    # vLLM's x / scale, as a product: scale is a power of two, so 1 / scale is
    # exact and the product is the quotient's correctly rounded value.
    q8 = tl.clamp(x * tl.div_rn(1.0, scale)[:, None], -FP8_LIMIT, FP8_LIMIT)
    tl.store(out_ptr + tok * out_s0 + h * out_s1 + d, q8.to(tl.float8e4nv), mask=hmask)
    wmask = heads < NUM_HEADS
    w = tl.load(w_ptr + tok * w_s0 + heads * w_s1, mask=wmask, other=0.0).to(tl.float32)
    w *= scale
    w *= softmax_scale
    w *= head_scale
    tl.store(w_out_ptr + tok * w_out_s0 + heads * w_out_s1, w, mask=wmask)


def input_problem(positions, q, cos_sin_cache, weights):
    """``None`` when the kernel takes these inputs, else ``(argument, what was
    expected, what came)`` (the serving patch falls back to vLLM's kernel on
    it; :func:`indexer_q` raises it)."""
    if positions.ndim != 1 or positions.dtype not in (torch.int64, torch.int32):
        return "positions", "a 1-D int64 or int32 tensor", f"{positions.dtype} {tuple(positions.shape)}"
    t = positions.shape[0]
    if q.ndim != 3 or q.shape[0] != t:
        return "q", f"[{t}, heads, dim] (one row per position)", tuple(q.shape)
    if q.dtype != torch.bfloat16:
        return "q", "bf16", q.dtype
    if q.stride(2) != 1 or not is_pow2(q.shape[2]):
        return "q", "a power-of-two head dim with a unit stride", f"{tuple(q.shape)} strides {q.stride()}"
    if (cos_sin_cache.ndim != 2 or cos_sin_cache.stride(1) != 1
            or cos_sin_cache.dtype not in FLOATS):
        return "cos_sin_cache", "a float [positions, 2 * half] table with a unit last stride", \
            f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}"
    cols = cos_sin_cache.shape[1]
    if cols % 2 or not is_pow2(cols // 2) or cols > q.shape[2]:
        return "cos_sin_cache", f"2 * half columns, half a power of two, at most {q.shape[2]}", cols
    if weights.ndim != 2 or tuple(weights.shape) != tuple(q.shape[:2]):
        return "weights", f"[{t}, {q.shape[1]}]", tuple(weights.shape)
    if weights.dtype not in FLOATS:
        return "weights", "bf16, fp16 or fp32", weights.dtype
    return None


def check_inputs(positions, q, cos_sin_cache, weights) -> None:
    """Raise ``ValueError`` naming the argument the kernel cannot take."""
    problem = input_problem(positions, q, cos_sin_cache, weights)
    if problem is not None:
        fail(*problem)


def _check_out(out, q, weights) -> None:
    if len(out) != 2:
        fail("out", "(q_fp8, weights_out)", f"{len(out)} tensors")
    for name, x, shape, dtype in (("out[0] (q_fp8)", out[0], tuple(q.shape), torch.float8_e4m3fn),
                                  ("out[1] (weights_out)", out[1], tuple(weights.shape),
                                   torch.float32)):
        check_out_tensor(name, x, shape, dtype)


def indexer_q(positions: torch.Tensor, q: torch.Tensor, cos_sin_cache: torch.Tensor,
              weights: torch.Tensor, softmax_scale: float, head_scale: float, is_neox: bool, *,
              heads: int = INDEX_HEADS, warps: int = NUM_WARPS,
              out: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_fp8, weights_out)`` as vLLM 0.27's ``fused_indexer_q_rope_quant``
    returns them (module docstring): ``q_fp8`` e4m3 like ``q``, ``weights_out``
    float32 like ``weights``.  ``heads``: heads per program, ``warps``: warps
    per program (powers of two).  ``out``: the two outputs, allocated by the
    caller (tests poison them); by default allocated here as vLLM allocates
    them.  Inputs are checked (:func:`check_inputs`)."""
    check_inputs(positions, q, cos_sin_cache, weights)
    for name, n in (("heads", heads), ("warps", warps)):
        if not is_pow2(n):
            fail(name, "a power of two", n)
    return launch(positions, q, cos_sin_cache, weights, softmax_scale, head_scale, is_neox,
                  heads=heads, warps=warps, out=out)


def launch(positions, q, cos_sin_cache, weights, softmax_scale, head_scale, is_neox, *,
           heads: int, warps: int, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`indexer_q` for inputs already found acceptable (:func:`input_problem`
    returned ``None``; the serving patch asks it to choose between this and
    vLLM's kernel): the same outputs, no second check."""
    if out is None:
        out = (torch.empty_like(q, dtype=torch.float8_e4m3fn),
               torch.empty_like(weights, dtype=torch.float32))
    else:
        _check_out(out, q, weights)
    q_fp8, weights_out = out
    t, num_heads, dim = q.shape
    _indexer_q_kernel[(t, triton.cdiv(num_heads, heads))](
        positions, q, q.stride(0), q.stride(1), cos_sin_cache, cos_sin_cache.stride(0),
        q_fp8, q_fp8.stride(0), q_fp8.stride(1),
        weights, weights.stride(0), weights.stride(1), softmax_scale, head_scale,
        weights_out, weights_out.stride(0), weights_out.stride(1),
        NUM_HEADS=num_heads, HEADS=heads, DIM=dim, HALF=cos_sin_cache.shape[1] // 2,
        INTERLEAVE=not is_neox, FP8_LIMIT=FP8_MAX, FUSED=triton_fused_q.ROPE_FUSED, num_warps=warps,
        **COMPILE_OPTIONS)
    return q_fp8, weights_out
