"""The indexer's query preparation in few, wide programs (Triton; sm_90 in serving).

Right before the indexer's logits, DeepSeek-V3.2's attention layer (vLLM 0.33's
``fused_q``) prepares both queries of the step in one launch:

* the indexer query ``index_q [T, Hi, Di]`` (bf16): RoPE on its first
  ``2 * half`` dims (NeoX halves for DeepSeek-V3.2, interleaved pairs where the
  model sets ``indexer_rope_interleave``), then fp8 e4m3 with one power-of-two
  (ue8m0) scale per token and head: ``s = 2 ** ceil(log2(max(amax, 1e-4) /
  448))``;
* the indexer weights ``w [T, Hi]`` -> ``w * s * softmax_scale * head_scale``
  (float32);
* the MLA query's RoPE part ``q_pe [T, H, R]`` (interleaved pairs): RoPE'd into
  a bf16 ``q_pe_out`` (FlashMLA's bf16 query), or with ``quantize_mqa`` both it
  and ``ql_nope [T, H, N]`` divided by the per-tensor ``q_scale`` into one fp8
  ``[T, H, N + R]`` (the fp8 query).

vLLM's Triton kernel launches ``(T, 3, max(Hi, H / 2))`` one-warp programs
(49152 at 256 tokens), each one head's 128 values: at 256 tokens it is bound
by how fast the GPU starts programs, not by the ~10 MB it moves.  This kernel
gives each program a block of heads of one part (``INDEX_HEADS`` indexer
heads, ``PE_HEADS`` MLA heads' RoPE part, ``NOPE_HEADS`` heads' NoPE part) as
2-D tiles: a few hundred to a few thousand programs per step.  The arithmetic
is vLLM's kernel's as it runs on Hopper, operation for operation, so that the
outputs are bit-equal to its kernel's on the same GPU (tested there);
:func:`~.reference.fused_q_reference` is the torch statement of the same maths.

Fused multiply-adds are written out, and the compiler may fuse nothing else
(``COMPILE_OPTIONS``): vLLM's RoPE expressions are contracted by the compiler
(Triton 3.6-3.9 with its ``ptxas``, sm_90: the same SASS in each), and which
product of ``a * b + c * d`` is fused depends on the code around it: left to
the compiler, this kernel's one-warp shapes fused the other product of the
MLA query's second RoPE value and differed from vLLM's in a few values.
Written out: the indexer query's value fuses its own product,
``fma(x, cos, sign * partner * sin)``; the MLA query's pair ``(x1, x2)``
becomes ``fma(x1, cos, -(x2 * sin))`` and ``fma(x1, sin, x2 * cos)``.  Where
Triton does not fuse by default (``TRITON_DEFAULT_FP_FUSION=0``,
``TRITON_FORCE_DISABLE_FP_FUSION=1``; Triton 3.10 is to stop fusing by
default) vLLM's kernel rounds every product, and so does this one
(:data:`ROPE_FUSED`, the ``FUSED`` switch).

Nothing here imports vLLM; the vLLM 0.33 patch
(:mod:`vllm_dsa_varlen.vllm_0_33.models.deepseek_v32.attention`) decides where
it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import check_out_tensor, fail, is_pow2
from .reference import FP8_MAX

# Heads per program of each part (powers of two) and warps: the fastest shape
# of the sweep on both query paths (benchmarks/fused_q_bench.py; BENCHMARKS.md,
# the step's query preparation).
INDEX_HEADS = 4
PE_HEADS = 8
NOPE_HEADS = 2
NUM_WARPS = 1

# The multiply-adds the kernel fuses are written in it (tl.fma); nothing else is
# fused, whatever the Triton version's default.
COMPILE_OPTIONS = {"enable_fp_fusion": False}


def vllm_rope_fused() -> bool:
    """Whether vLLM's query kernels get their RoPE multiply-adds fused: they
    leave it to Triton's default (their launches do not set
    ``enable_fp_fusion``), which fuses through Triton 3.9 unless
    ``TRITON_DEFAULT_FP_FUSION=0`` or ``TRITON_FORCE_DISABLE_FP_FUSION=1`` is
    set (Triton 3.10 is to stop fusing by default).  The project's query
    kernels then write the fused forms out (``tl.fma``) or round every product
    (plain ``*`` and ``+``), so that their bytes follow vLLM's either way.
    The launches read :data:`ROPE_FUSED`, this read once at import (a plain
    module constant: ``torch.compile`` traces the launches, and it cannot
    trace Triton's environment reads)."""
    lang = getattr(getattr(triton, "knobs", None), "language", None)
    if lang is None:  # a Triton without knobs: fusion on
        return True
    if getattr(lang, "force_disable_fp_fusion", False):
        return False
    return bool(getattr(lang, "default_fp_fusion", True))


ROPE_FUSED = vllm_rope_fused()

# A RoPE product negated as a product with -1: Triton before 3.8 compiles a
# float's unary minus as ``0 - y``, which gives +0 for y = +0 where the negated
# FFMA operand of vLLM's contracted ``a cos - b sin`` gives -0 (3.8 and later
# emit a true negation; the product with -1 is one on every version).
NEG_ONE: tl.constexpr = tl.constexpr(-1.0)


@dataclass(frozen=True)
class Blocks:
    """Heads per program of the three parts and the warps of a program."""

    index: int = INDEX_HEADS
    pe: int = PE_HEADS
    nope: int = NOPE_HEADS
    warps: int = NUM_WARPS

    def __post_init__(self) -> None:
        for name in ("index", "pe", "nope", "warps"):
            if not is_pow2(getattr(self, name)):
                fail(f"blocks.{name}", "a power of two", getattr(self, name))


@triton.jit
def index_rope_operands(row, pos, cs_ptr, cs_s0, h, d, NUM_HEADS: tl.constexpr,
                        HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The RoPE's operands of an indexer query tile (heads ``h`` [HEADS, 1] x
    dims ``d`` [1, DIM] of the rows at ``row``), float32: each value ``x``, its
    RoPE partner, ``cos`` and ``sin`` (1 and 0 past the first ``2 * HALF``
    dims), whether the value is in the RoPE dims and whether it is the first of
    its pair (NeoX: dim ``i < HALF`` pairs with ``i + HALF``; interleaved:
    ``2i`` with ``2i + 1``)."""
    hmask = h < NUM_HEADS
    x = tl.load(row + d, mask=hmask, other=0.0).to(tl.float32)
    in_rope = d < 2 * HALF
    if INTERLEAVE:
        c = d // 2
        mate = tl.where(in_rope, d ^ 1, d)
        first = d % 2 == 0
    else:
        c = d % HALF
        mate = tl.where(in_rope, d ^ HALF, d)
        first = d < HALF
    cos = tl.load(cs_ptr + pos * cs_s0 + c, mask=in_rope, other=1.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * cs_s0 + HALF + c, mask=in_rope, other=0.0).to(tl.float32)
    partner = tl.load(row + mate, mask=hmask, other=0.0).to(tl.float32)
    return x, partner, cos, sin, in_rope, first


@triton.jit
def _index_part(tok, pos, blk, index_q_ptr, iq_s0, iq_s1, cs_ptr, cs_s0,
                out_ptr, out_s0, out_s1, w_ptr, w_s0, softmax_scale, head_scale,
                w_out_ptr, w_out_s0,
                NUM_HEADS: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr,
                HALF: tl.constexpr, INTERLEAVE: tl.constexpr, FP8_LIMIT: tl.constexpr,
                FUSED: tl.constexpr):
    heads = blk * HEADS + tl.arange(0, HEADS)
    h = heads[:, None]
    d = tl.arange(0, DIM)[None, :]
    hmask = h < NUM_HEADS
    row = index_q_ptr + tok * iq_s0 + h * iq_s1
    x, partner, cos, sin, in_rope, first = index_rope_operands(
        row, pos, cs_ptr, cs_s0, h, d, NUM_HEADS, HALF, INTERLEAVE)
    sign = tl.where(first, -1.0, 1.0)
    if FUSED:
        x = tl.where(in_rope, tl.fma(x, cos, sign * partner * sin), x)
    else:
        x = tl.where(in_rope, x * cos + sign * partner * sin, x)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.div_rn(tl.maximum(amax, 1e-4), FP8_LIMIT)
    scale = tl.math.exp2(tl.math.ceil(tl.math.log2(scale)))
    # x / scale as vLLM divides, as a product: scale is a power of two (2^-22 ..
    # 2^120 here), so 1 / scale is exact and x * (1 / scale) is the same
    # correctly rounded value as the quotient, without an IEEE division (a
    # reciprocal and a chain of five FMAs) per value.
    q8 = (x * tl.div_rn(1.0, scale)[:, None]).to(tl.float8e4nv)
    tl.store(out_ptr + tok * out_s0 + h * out_s1 + d, q8, mask=hmask)
    wmask = heads < NUM_HEADS
    w = tl.load(w_ptr + tok * w_s0 + heads, mask=wmask, other=0.0).to(tl.float32)
    w *= scale
    w *= softmax_scale
    w *= head_scale
    tl.store(w_out_ptr + tok * w_out_s0 + heads, w, mask=wmask)


@triton.jit
def _pe_part(tok, pos, blk, q_pe_ptr, pe_s0, pe_s1, cs_ptr, cs_s0, q_scale_ptr,
             mqa_ptr, mqa_s0, mqa_s1, NUM_HEADS: tl.constexpr, HEADS: tl.constexpr,
             HALF: tl.constexpr, NOPE: tl.constexpr, QUANTIZE: tl.constexpr,
             FUSED: tl.constexpr):
    h = (blk * HEADS + tl.arange(0, HEADS))[:, None]
    i = tl.arange(0, HALF)[None, :]
    hmask = h < NUM_HEADS
    cos = tl.load(cs_ptr + pos * cs_s0 + i).to(tl.float32)
    sin = tl.load(cs_ptr + pos * cs_s0 + i + HALF).to(tl.float32)
    src = q_pe_ptr + tok * pe_s0 + h * pe_s1 + 2 * i
    x1 = tl.load(src, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(src + 1, mask=hmask, other=0.0).to(tl.float32)
    if FUSED:
        r1 = tl.fma(x1, cos, x2 * sin * NEG_ONE)  # not -(...): NEG_ONE's note
        r2 = tl.fma(x1, sin, x2 * cos)
    else:
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
    if QUANTIZE:
        scale = tl.load(q_scale_ptr)
        dst = mqa_ptr + tok * mqa_s0 + h * mqa_s1 + NOPE + 2 * i
        tl.store(dst, (r1 / scale).to(tl.float8e4nv), mask=hmask)
        tl.store(dst + 1, (r2 / scale).to(tl.float8e4nv), mask=hmask)
    else:  # the RoPE'd q_pe itself, in its own dtype
        dst = mqa_ptr + tok * mqa_s0 + h * mqa_s1 + 2 * i
        out_ty = mqa_ptr.dtype.element_ty
        tl.store(dst, r1.to(out_ty), mask=hmask)
        tl.store(dst + 1, r2.to(out_ty), mask=hmask)


@triton.jit
def _nope_part(tok, blk, ql_nope_ptr, qn_s0, qn_s1, q_scale_ptr, mqa_ptr, mqa_s0, mqa_s1,
               NUM_HEADS: tl.constexpr, HEADS: tl.constexpr, NOPE: tl.constexpr,
               NOPE_BLOCK: tl.constexpr):
    h = (blk * HEADS + tl.arange(0, HEADS))[:, None]
    d = tl.arange(0, NOPE_BLOCK)[None, :]
    mask = (h < NUM_HEADS) & (d < NOPE)
    scale = tl.load(q_scale_ptr)
    v = tl.load(ql_nope_ptr + tok * qn_s0 + h * qn_s1 + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(mqa_ptr + tok * mqa_s0 + h * mqa_s1 + d, (v / scale).to(tl.float8e4nv), mask=mask)


@triton.jit
def _fused_q_blocks_kernel(
    pos_ptr,
    index_q_ptr, iq_s0, iq_s1, index_cs_ptr, index_cs_s0,
    index_q_fp8_ptr, iqf_s0, iqf_s1,
    w_ptr, w_s0, softmax_scale, head_scale, w_out_ptr, w_out_s0,
    q_pe_ptr, pe_s0, pe_s1, pe_cs_ptr, pe_cs_s0,
    ql_nope_ptr, qn_s0, qn_s1, q_scale_ptr,
    mqa_ptr, mqa_s0, mqa_s1,
    NUM_INDEX_HEADS: tl.constexpr, INDEX_HEADS: tl.constexpr, INDEX_DIM: tl.constexpr,
    INDEX_HALF: tl.constexpr, INTERLEAVE: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr, PE_HEADS: tl.constexpr, PE_HALF: tl.constexpr,
    NOPE_HEADS: tl.constexpr, NOPE: tl.constexpr, NOPE_BLOCK: tl.constexpr,
    QUANTIZE: tl.constexpr, USE_PDL: tl.constexpr, FP8_LIMIT: tl.constexpr,
    FUSED: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    index_blocks: tl.constexpr = (NUM_INDEX_HEADS + INDEX_HEADS - 1) // INDEX_HEADS
    pe_blocks: tl.constexpr = (NUM_Q_HEADS + PE_HEADS - 1) // PE_HEADS
    if blk < index_blocks:
        pos = tl.load(pos_ptr + tok)
        _index_part(tok, pos, blk, index_q_ptr, iq_s0, iq_s1, index_cs_ptr, index_cs_s0,
                    index_q_fp8_ptr, iqf_s0, iqf_s1, w_ptr, w_s0, softmax_scale, head_scale,
                    w_out_ptr, w_out_s0, NUM_INDEX_HEADS, INDEX_HEADS, INDEX_DIM, INDEX_HALF,
                    INTERLEAVE, FP8_LIMIT, FUSED)
    elif blk < index_blocks + pe_blocks:
        pos = tl.load(pos_ptr + tok)
        _pe_part(tok, pos, blk - index_blocks, q_pe_ptr, pe_s0, pe_s1, pe_cs_ptr, pe_cs_s0,
                 q_scale_ptr, mqa_ptr, mqa_s0, mqa_s1, NUM_Q_HEADS, PE_HEADS, PE_HALF, NOPE, QUANTIZE,
                 FUSED)
    else:
        _nope_part(tok, blk - index_blocks - pe_blocks, ql_nope_ptr, qn_s0, qn_s1, q_scale_ptr,
                   mqa_ptr, mqa_s0, mqa_s1, NUM_Q_HEADS, NOPE_HEADS, NOPE, NOPE_BLOCK)


def input_problem(positions, q_pe, q_pe_cos_sin_cache, index_q, index_q_cos_sin_cache, ql_nope,
                  q_scale, index_weights, *, quantize_mqa: bool):
    """``None`` when the kernel takes these inputs, else ``(argument, what was
    expected, what came)`` (the serving patch falls back to stock's kernel on
    it; :func:`fused_q` raises it)."""
    if positions.ndim != 1 or positions.dtype != torch.int64:
        return "positions", "a 1-D int64 tensor", f"{positions.dtype} {tuple(positions.shape)}"
    t = positions.shape[0]
    for name, x in (("q_pe", q_pe), ("index_q", index_q), ("ql_nope", ql_nope)):
        if x.ndim != 3 or x.shape[0] != t:
            return name, f"[{t}, heads, dim] (one row per position)", tuple(x.shape)
        if x is ql_nope and not quantize_mqa:
            continue  # read only for the fp8 query
        if x.stride(2) != 1:
            return name, "a unit stride on its last dim", x.stride()
        if x.dtype not in FLOATS:
            return name, "bf16, fp16 or fp32", x.dtype
    if ql_nope.shape[1] != q_pe.shape[1]:
        return "ql_nope", f"{q_pe.shape[1]} heads (as q_pe)", ql_nope.shape[1]
    if not is_pow2(index_q.shape[2]):
        return "index_q", "a power-of-two head dim", index_q.shape[2]
    if q_pe.shape[2] % 2 or not is_pow2(q_pe.shape[2] // 2):
        return "q_pe", "an even rope dim whose half is a power of two", q_pe.shape[2]
    for name, cache in (("q_pe_cos_sin_cache", q_pe_cos_sin_cache),
                        ("index_q_cos_sin_cache", index_q_cos_sin_cache)):
        if cache.ndim != 2 or cache.stride(1) != 1 or cache.shape[1] % 2:
            return name, "[positions, 2 * half] with a unit last stride", tuple(cache.shape)
    if q_pe_cos_sin_cache.shape[1] != q_pe.shape[2]:
        return "q_pe_cos_sin_cache", f"{q_pe.shape[2]} columns (q_pe's rope dim)", \
            q_pe_cos_sin_cache.shape[1]
    if index_q_cos_sin_cache.shape[1] > index_q.shape[2]:
        return "index_q_cos_sin_cache", f"at most {index_q.shape[2]} columns (index_q's dim)", \
            index_q_cos_sin_cache.shape[1]
    if index_weights.ndim != 2 or tuple(index_weights.shape) != tuple(index_q.shape[:2]):
        return "index_weights", f"[{t}, {index_q.shape[1]}]", tuple(index_weights.shape)
    if index_weights.stride(1) != 1:
        return "index_weights", "a unit stride on its last dim", index_weights.stride()
    if q_scale.dtype != torch.float32 or q_scale.numel() != 1:
        return "q_scale", "a one-element float32 tensor", f"{q_scale.dtype} x{q_scale.numel()}"
    return None


FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def check_inputs(*args, quantize_mqa: bool) -> None:
    """Raise ``ValueError`` naming the argument the kernel cannot take."""
    problem = input_problem(*args, quantize_mqa=quantize_mqa)
    if problem is not None:
        fail(*problem)


def _allocate(q_pe, index_q, ql_nope, index_weights, quantize_mqa):
    t, num_q_heads, rope_dim = q_pe.shape
    if quantize_mqa:
        mqa_q = torch.empty((t, num_q_heads, ql_nope.shape[2] + rope_dim),
                            dtype=torch.float8_e4m3fn, device=q_pe.device)
    else:
        mqa_q = torch.empty_like(q_pe)
    return (torch.empty_like(index_q, dtype=torch.float8_e4m3fn),
            torch.empty_like(index_weights, dtype=torch.float32), mqa_q)


def _check_out(out, q_pe, index_q, ql_nope, quantize_mqa) -> None:
    if len(out) != 3:
        fail("out", "(index_q_fp8, index_weights_out, mqa_q)", f"{len(out)} tensors")
    t, h, r = q_pe.shape
    mqa = ((t, h, ql_nope.shape[2] + r), torch.float8_e4m3fn) if quantize_mqa else (
        tuple(q_pe.shape), q_pe.dtype)
    for name, x, (shape, dtype) in (
            ("out[0] (index_q_fp8)", out[0], (tuple(index_q.shape), torch.float8_e4m3fn)),
            ("out[1] (index_weights_out)", out[1], (tuple(index_q.shape[:2]), torch.float32)),
            ("out[2] (mqa_q)", out[2], mqa)):
        check_out_tensor(name, x, shape, dtype)


def fused_q(positions: torch.Tensor, q_pe: torch.Tensor, q_pe_cos_sin_cache: torch.Tensor,
            index_q: torch.Tensor, index_q_cos_sin_cache: torch.Tensor, ql_nope: torch.Tensor,
            q_scale: torch.Tensor, index_weights: torch.Tensor,
            index_weights_softmax_scale: float, index_weights_head_scale: float, *,
            index_rope_interleave: bool = False, quantize_mqa: bool = True,
            use_pdl: bool = False, blocks: Blocks = Blocks(),
            out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(index_q_fp8, index_weights_out, mqa_q)`` as vLLM 0.33's ``fused_q``
    returns them with an indexer (module docstring): ``index_q_fp8`` e4m3 like
    ``index_q``, ``index_weights_out`` float32 like ``index_weights``; ``mqa_q``
    the fp8 ``[T, H, N + R]`` with ``quantize_mqa``, else the RoPE'd ``q_pe``
    (its dtype).  ``use_pdl``: launch as a programmatic dependent (waits for
    the previous kernel's writes, lets the next kernel start early), as vLLM
    does on Hopper.  ``out``: the three outputs, allocated by the caller (tests
    poison them); by default allocated here as vLLM allocates them.  Shapes and
    dtypes are checked (:func:`check_inputs`)."""
    check_inputs(positions, q_pe, q_pe_cos_sin_cache, index_q, index_q_cos_sin_cache, ql_nope,
                 q_scale, index_weights, quantize_mqa=quantize_mqa)
    return launch(positions, q_pe, q_pe_cos_sin_cache, index_q, index_q_cos_sin_cache, ql_nope,
                  q_scale, index_weights, index_weights_softmax_scale, index_weights_head_scale,
                  index_rope_interleave=index_rope_interleave, quantize_mqa=quantize_mqa,
                  use_pdl=use_pdl, blocks=blocks, out=out)


def launch(positions, q_pe, q_pe_cos_sin_cache, index_q, index_q_cos_sin_cache, ql_nope, q_scale,
           index_weights, index_weights_softmax_scale, index_weights_head_scale, *,
           index_rope_interleave: bool, quantize_mqa: bool, use_pdl: bool, blocks: Blocks,
           out=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fused_q` for inputs already found acceptable (:func:`input_problem`
    returned ``None``; the serving patch asks it to choose between this and
    vLLM's kernel): the same outputs, no second check."""
    t, num_q_heads, rope_dim = q_pe.shape
    num_index_heads, index_dim = index_q.shape[1], index_q.shape[2]
    if out is None:
        out = _allocate(q_pe, index_q, ql_nope, index_weights, quantize_mqa)
    else:
        _check_out(out, q_pe, index_q, ql_nope, quantize_mqa)
    index_q_fp8, weights_out, mqa_q = out
    nope = ql_nope.shape[2]
    parts = (triton.cdiv(num_index_heads, blocks.index) + triton.cdiv(num_q_heads, blocks.pe)
             + (triton.cdiv(num_q_heads, blocks.nope) if quantize_mqa else 0))
    pdl = {"launch_pdl": True} if use_pdl else {}
    _fused_q_blocks_kernel[(t, parts)](
        positions,
        index_q, index_q.stride(0), index_q.stride(1),
        index_q_cos_sin_cache, index_q_cos_sin_cache.stride(0),
        index_q_fp8, index_q_fp8.stride(0), index_q_fp8.stride(1),
        index_weights, index_weights.stride(0), index_weights_softmax_scale,
        index_weights_head_scale, weights_out, weights_out.stride(0),
        q_pe, q_pe.stride(0), q_pe.stride(1), q_pe_cos_sin_cache, q_pe_cos_sin_cache.stride(0),
        ql_nope, ql_nope.stride(0), ql_nope.stride(1), q_scale,
        mqa_q, mqa_q.stride(0), mqa_q.stride(1),
        NUM_INDEX_HEADS=num_index_heads, INDEX_HEADS=blocks.index, INDEX_DIM=index_dim,
        INDEX_HALF=index_q_cos_sin_cache.shape[1] // 2, INTERLEAVE=bool(index_rope_interleave),
        NUM_Q_HEADS=num_q_heads, PE_HEADS=blocks.pe, PE_HALF=rope_dim // 2,
        NOPE_HEADS=blocks.nope, NOPE=nope, NOPE_BLOCK=triton.next_power_of_2(nope),
        QUANTIZE=bool(quantize_mqa), USE_PDL=bool(use_pdl), FP8_LIMIT=FP8_MAX,
        FUSED=ROPE_FUSED, num_warps=blocks.warps, **COMPILE_OPTIONS, **pdl)
    return index_q_fp8, weights_out, mqa_q
