"""How much precision the indexer's head sum needs: a CPU study.

The logits ``sum_h relu(q[h] . k) * w[h] * k_scale`` feed a top-k (2048 of
each row's tokens).  The sm_90 CUDA kernel can sum over heads on the tensor
cores (its ``HEAD_SUM_TC`` build: ``relu(q . k)`` and ``w`` as TF32 operands)
instead of the CUDA cores' float32 FMAs.  This module measures what that costs
in the only terms that matter downstream, against the float32 head sum:

* **top-k retention** per row: the share of the float32 path's top-2048 that
  the cheaper path's top-2048 keeps (``torch.topk``, as vLLM's top-k picks
  the largest logits), its minimum over rows (the project's contract: >= 99.9 %
  on every row) and mean;
* **calc_diff** (DeepGEMM's similarity measure, ``1 - 2 x.y / (x.x + y.y)``)
  against the float32 path, and DeepGEMM's own check on its own generator:
  ``calc_diff`` < 1e-3 against its bf16 reference and < 5e-6 against its fp8
  simulation (float32 logits).

Head sums compared (each from the same fp8 ``q . k``, computed exactly and
rounded once to float32, as the fp8 tensor cores deliver it up to their own
accumulation error, which every path shares):

* ``fp32``: float32 products and sum (DeepGEMM's arithmetic, the default build);
* ``tf32``: the ``HEAD_SUM_TC`` build (:func:`..reference.head_sum_tf32`):
  ``relu(q . k)`` rounded to nearest TF32 (``cvt.rn.relu.tf32``, one
  instruction that also applies the relu), the weights as TF32 ``hi + lo``
  (carried in the mma's spare output columns: no extra tensor work);
* ``tf32_round``: both operands rounded to nearest TF32, one mma per block;
* ``tf32_trunc``: both operands truncated to TF32 (float32 registers handed
  to the tensor core unconverted: no conversion instruction at all);
* ``bf16``: both operands rounded to bfloat16, for comparison;
* ``abs_split``: ``relu(x) = (x + |x|) / 2`` (:func:`head_sum_abs_split`):
  the absolute part in float32 (an FMA with the operand's absolute value,
  no max), the linear part as the token's dot with ``sum_h w[h] q[h]`` in
  three e4m3 parts (fp8 tensor-core products); ``abs_split2``: two parts;
* ``fp16``, ``fp16x2``: half-precision operands, which overflow where
  ``q . k`` passes 65504, so each (row, head) query is first scaled by a
  power of two in e4m3 (:func:`prescale_query`: ``|q' . k| <= 2**15`` for
  any fp8 ``k``) and the weights by its inverse and a row's power of two;
  ``relu(q' . k)`` rounded to fp16 (``cvt.rn.relu.f16x2.f32``).  ``fp16``
  sums in float32 (an fp16 tensor-core product); ``fp16x2`` on the CUDA
  cores in packed halves, one ``HFMA2`` for two heads, each lane's chain of
  eight in fp16 (:func:`head_sum_fp16`), half the float32 sum's instructions;
* ``fp64``: the exact head sum, to show the float32 path's own noise.

Serving-like inputs (:func:`serving_inputs`): q per (token, head) and k per
token quantised to e4m3 with scale ``amax / 448`` (DeepSeek V3.2's indexer:
values up to +-448, optionally power-of-two scales as with ``ue8m0``), the
query scale folded into the weights as vLLM does (``w * q_scale *
head_dim**-0.5 * heads**-0.5``); channels of unequal size (log-normal
spread), as activations have.  Run ``python3
benchmarks/studies/head_sum_precision.py`` for the table; with ``--gpu`` (an
sm_90 GPU) the same inputs go through both builds of the CUDA kernel
(:func:`gpu_study`): the TF32 build's top-k against the fp32 build's, each
against the torch reference, and DeepGEMM's check on the kernel's logits.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from vllm_dsa_varlen.ops.reference import FP8_MAX, head_sum_tf32, round_bf16, round_tf32  # noqa: E402

# TF32 keeps float32's sign and 8 exponent bits and the top 10 of its 23
# mantissa bits; the low 13 bits of the 32-bit word are dropped.
_TF32_DROP = 13


def truncate_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the TF32 value toward zero (the low 13 mantissa bits cleared):
    what the tensor core takes from a float32 register it was given unconverted."""
    bits = x.float().contiguous().view(torch.int32)
    return (bits & ~((1 << _TF32_DROP) - 1)).view(torch.float32)

HEAD_SUMS = ("fp32", "tf32", "tf32_round", "tf32_trunc", "bf16", "abs_split", "abs_split2",
             "fp16", "fp16x2", "fp64")
TOPK = 2048
CONTRACT_KEEP = 0.999  # the share of the fp32 path's top-k every row must keep
# fp8 parts of a row's linear query in the abs-split head sum (:func:`split_query_fp8`)
SPLIT_PARTS = 3
# the fp16 head sums: |q' . k| stays within this (fp16's largest value is 65504),
# and a row's largest scaled weight within 2**FP16_W_LOG2, so a lane's chain of
# eight products stays within 2**15 too
FP16_LIMIT = 2.0 ** 15
FP16_W_LOG2 = -4


# ------------------------------------------------------------------ inputs

@dataclass
class Inputs:
    """One request's rows against one KV span, in the kernel's units:
    ``q`` fp8 values as float32 ``[R, H, D]``, ``k`` fp8 values as float32
    ``[N, D]``, ``k_scale [N]``, ``w [R, H]`` (query scale folded in); and the
    unquantised ``q_ref`` / ``k_ref`` (for the fp8 quantisation's own effect)."""

    q: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    w: torch.Tensor
    q_ref: torch.Tensor
    k_ref: torch.Tensor
    w_ref: torch.Tensor


def _quantize(x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per last-dim vector e4m3 quantisation: (values as float32, scale)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / FP8_MAX
    if pow2:  # ue8m0: the next power of two, so values stay within +-448
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (x / scale).to(torch.float8_e4m3fn).float(), scale.squeeze(-1)


def serving_inputs(rows: int = 8, context: int = 32768, *, heads: int = 64, dim: int = 128,
                   channel_spread: float = 0.5, pow2_scales: bool = False,
                   seed: int = 0) -> Inputs:
    """Serving-like inputs (module docstring): ``rows`` query rows of one
    request against ``context`` KV tokens.  ``channel_spread``: the standard
    deviation of the log of each channel's size (0: i.i.d. normal values)."""
    if rows < 1 or context < TOPK or heads < 1 or dim < 1:
        raise ValueError(f"rows, context, heads, dim: expected >= 1 and context >= {TOPK}, "
                         f"got {rows}, {context}, {heads}, {dim}")
    gen = torch.Generator().manual_seed(seed)
    chan = torch.exp(channel_spread * torch.randn(dim, generator=gen))
    q_ref = torch.randn((rows, heads, dim), generator=gen) * chan
    k_ref = torch.randn((context, dim), generator=gen) * chan
    w_ref = torch.randn((rows, heads), generator=gen)
    q, q_scale = _quantize(q_ref, pow2_scales)
    k, k_scale = _quantize(k_ref, pow2_scales)
    w = w_ref * q_scale * dim ** -0.5 * heads ** -0.5
    return Inputs(q, k, k_scale, w.float(), q_ref, k_ref, w_ref * dim ** -0.5 * heads ** -0.5)


def deepgemm_inputs(rows: int = 4, context: int = 8192, *, heads: int = 64, dim: int = 128,
                    seed: int = 0) -> tuple[Inputs, torch.Tensor, torch.Tensor]:
    """DeepGEMM's generator for its paged MQA logits test: q ~ N(0, 1) in bf16
    cast to e4m3 as is, weights ~ N(0, 1), KV ~ N(0, 1) in bf16 quantised per
    token (``amax / 448``).  Returns the inputs and DeepGEMM's two references
    (float32 ``[rows, context]``): the bf16 one (unquantised q and KV, q . k
    rounded to bf16 as its bf16 matmul returns it) and the fp8 simulation
    (the dequantised fp8 values, in bf16, likewise)."""
    gen = torch.Generator().manual_seed(seed)
    q_bf = torch.randn((rows, heads, dim), generator=gen).to(torch.bfloat16)
    w = torch.randn((rows, heads), generator=gen)
    kv_bf = torch.randn((context, dim), generator=gen).to(torch.bfloat16)
    q8 = q_bf.to(torch.float8_e4m3fn).float()
    sf = kv_bf.float().abs().amax(dim=-1, keepdim=True).clamp(1e-4) / FP8_MAX
    k8 = (kv_bf.float() * (1.0 / sf)).to(torch.float8_e4m3fn).float()

    def ref(qx, kx):
        s = torch.matmul(qx.reshape(-1, dim), kx.t()).float().view(rows, heads, -1)
        return (s.relu() * w[:, :, None]).sum(dim=1)

    bf16_ref = ref(q_bf, kv_bf)
    simulated = ref(q8.to(torch.bfloat16), (k8 * sf).to(torch.bfloat16))
    inputs = Inputs(q8, k8, sf.squeeze(-1), w, q_bf.float(), kv_bf.float(), w)
    return inputs, bf16_ref, simulated


# --------------------------------------------------------------- head sums

def linear_query(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``q'[r] = sum_h w[r, h] * q[r, h]`` (float64 ``[R, D]``) from ``q [R, H, D]``
    (fp8 values) and ``w [R, H]``: the query whose dot with a token is the
    linear part of the head sum, ``sum_h w[h] * (q[h] . k)``."""
    return (w.double()[:, :, None] * q.double()).sum(dim=1)


def split_query_fp8(qp: torch.Tensor, parts: int = SPLIT_PARTS):
    """``qp [R, D]`` as ``parts`` e4m3 parts with a float32 scale each, the next
    part quantising what the ones before left (per row, scale ``amax / 448``):
    ``(values [R, parts, D]`` float32 holding e4m3 values, ``scales [R,
    parts]`` float32``)``; ``sum_j values[:, j] * scales[:, j]`` is ``qp`` to
    about 12 bits with three parts.  A row of zeros gives zero scales."""
    rest = qp.double()
    values, scales = [], []
    for _ in range(parts):
        amax = rest.abs().amax(dim=-1, keepdim=True)
        scale = (amax / FP8_MAX).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).double()
        v = (rest / safe).float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        v = torch.where(scale > 0, v, torch.zeros_like(v))
        values.append(v)
        scales.append(scale.squeeze(-1))
        rest = rest - v.double() * scale.double()
    return torch.stack(values, dim=1), torch.stack(scales, dim=1)


def head_sum_abs_split(qk: torch.Tensor, w: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, parts: int = SPLIT_PARTS) -> torch.Tensor:
    """``sum_h relu(qk[r, h, n]) * w[r, h]`` as ``(sum_h |qk| * w + sum_h qk *
    w) / 2`` (``relu(x) = (x + |x|) / 2``): the first sum in float32 (one FMA a
    head with the operand's absolute value: no max), the second, linear in
    ``q . k``, as ``k . q'`` with ``q' = sum_h w[h] q[h]`` (:func:`linear_query`)
    in ``parts`` e4m3 parts (:func:`split_query_fp8`): each part's dot with the
    fp8 ``k`` exact and rounded once to float32 (an fp8 tensor-core product),
    times its scale, summed in float32.  ``qk [R, H, N]`` float32, ``w [R, H]``,
    ``q [R, H, D]``, ``k [N, D]`` (fp8 values); returns float32 ``[R, N]``."""
    absolute = (qk.float().abs() * w.float()[:, :, None]).sum(dim=1)
    values, scales = split_query_fp8(linear_query(q, w), parts)
    dots = torch.einsum("rjd,nd->rjn", values.double(), k.double()).float()
    linear = (dots * scales[:, :, None]).sum(dim=1)
    return 0.5 * (absolute + linear)


def prescale_query(q: torch.Tensor,
                   limit: float = FP16_LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [R, H, D]`` (e4m3 values) scaled per (row, head) by ``2**-s`` so that
    ``|q' . k| <= limit`` for every fp8 ``k`` (``|k| <= 448``): ``s`` is the
    least whole number >= 0 with ``448 * sum |q| * 2**-s <= limit``, and
    ``q' = e4m3(q * 2**-s)`` (exact where the value stays in e4m3's normal
    range, rounded below it).  Returns ``(q'`` float32, ``s`` float32 ``[R, H])``."""
    bound = FP8_MAX * q.double().abs().sum(dim=-1)
    s = torch.ceil(torch.log2(bound / limit)).clamp_min(0)
    s = torch.where(bound > 0, s, torch.zeros_like(s))
    scaled = (q.double() * torch.exp2(-s)[..., None]).float().to(torch.float8_e4m3fn).float()
    return scaled, s.float()


def head_sum_fp16(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, *,
                  packed: bool) -> torch.Tensor:
    """``sum_h relu(q[r, h] . k[n]) * w[r, h]`` (float32 ``[R, N]``, before the KV
    scale) in half precision: ``q`` prescaled (:func:`prescale_query`), its
    dot with the fp8 ``k`` exact and rounded once to float32 (an fp8
    tensor-core product), relu and fp16 rounding in one step; the weights
    ``w * 2**s`` scaled by a row's power of two ``2**-t`` (largest within
    ``2**FP16_W_LOG2``) and rounded to fp16, ``2**t`` restored at the end.
    ``packed=False``: exact products summed in float32 (float64 rounded once).
    ``packed=True``: the CUDA-core sum in packed halves as the kernel's lanes
    hold the accumulator (a lane has, per 8-head block ``j``, heads
    ``8j + 2l`` and ``8j + 2l + 1``, ``l`` = lane % 4, one fp16 pair): per lane
    one fused fp16 multiply-add per pair and block, in block order, then the
    pair's halves and the four lanes added in float32."""
    rows, heads, _ = q.shape
    if packed and heads % 8:
        raise ValueError(f"q: the packed fp16 sum takes a multiple of 8 heads, got {heads}")
    scaled, s = prescale_query(q)
    a = qk_fp32(scaled, k).relu().to(torch.float16).double()
    ws = w.double() * torch.exp2(s.double())
    top = ws.abs().amax(dim=-1)
    t = torch.where(top > 0, torch.ceil(torch.log2(top)) - FP16_W_LOG2, torch.zeros_like(top))
    wh = (ws * torch.exp2(-t)[:, None]).to(torch.float16).double()
    if not packed:
        total = (a * wh[:, :, None]).sum(dim=1).float()
    else:
        blocks = heads // 8
        a = a.view(rows, blocks, 4, 2, -1)
        wh = wh.view(rows, blocks, 4, 2, 1)
        acc = torch.zeros_like(a[:, 0])
        for j in range(blocks):  # fp16 products are exact in float64: one rounding per FMA
            acc = (acc + a[:, j] * wh[:, j]).to(torch.float16).double()
        lanes = acc[:, :, 0].float() + acc[:, :, 1].float()
        total = (lanes[:, 0] + lanes[:, 1]) + (lanes[:, 2] + lanes[:, 3])
    return total * torch.exp2(t).float()[:, None]


def qk_fp32(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q . k`` ``[R, H, N]``: exact (float64) and rounded once to float32."""
    return torch.einsum("rhd,nd->rhn", q.double(), k.double()).float()


def head_sum(qk: torch.Tensor, w: torch.Tensor, k_scale: torch.Tensor, how: str,
             q: torch.Tensor | None = None, k: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[R, N]`` from ``qk [R, H, N]`` float32, ``w [R, H]`` and
    ``k_scale [N]`` by head sum ``how`` (:data:`HEAD_SUMS`); the abs-split
    and fp16 sums also read the fp8 ``q [R, H, D]`` and ``k [N, D]`` they
    were made of."""
    if how in ("abs_split", "abs_split2", "fp16", "fp16x2"):
        if q is None or k is None:
            raise ValueError(f"how={how!r}: needs q and k")
        if how in ("fp16", "fp16x2"):
            return head_sum_fp16(q, k, w, packed=how == "fp16x2") * k_scale.float()
        parts = SPLIT_PARTS if how == "abs_split" else 2
        return head_sum_abs_split(qk, w, q, k, parts) * k_scale.float()
    a = qk.relu()
    if how == "fp32":
        return (a * w.float()[:, :, None]).sum(dim=1) * k_scale.float()
    if how == "fp64":
        return ((a.double() * w.double()[:, :, None]).sum(dim=1) * k_scale.double()).float()
    if how == "tf32":
        return head_sum_tf32(qk, w) * k_scale.float()
    cast = {"tf32_round": round_tf32, "tf32_trunc": truncate_tf32, "bf16": round_bf16}.get(how)
    if cast is None:
        raise ValueError(f"how: expected one of {HEAD_SUMS}, got {how!r}")
    # tensor-core products are exact (TF32 x TF32 and bf16 x bf16 fit float32);
    # the accumulation is float32-wide: float64 rounded once models it.
    s = (cast(a).double() * cast(w.float()).double()[:, :, None]).sum(dim=1).float()
    return s * k_scale.float()


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's ``calc_diff``: ``1 - 2 x.y / (x.x + y.y)`` in float64 (0 when
    both are zero); about half the squared normwise relative error."""
    x, y = x.double(), y.double()
    den = (x * x + y * y).sum()
    return 0.0 if float(den) == 0.0 else float(1 - 2 * (x * y).sum() / den)


def topk_retention(ref: torch.Tensor, got: torch.Tensor, k: int = TOPK) -> torch.Tensor:
    """Per row, the share of ``ref``'s top-``k`` entries that ``got``'s top-``k``
    keeps (float64 ``[R]``)."""
    keep = []
    for r in range(ref.shape[0]):
        a = torch.zeros(ref.shape[1], dtype=torch.bool)
        a[torch.topk(ref[r], k).indices] = True
        keep.append(int(a[torch.topk(got[r], k).indices].sum()) / k)
    return torch.tensor(keep, dtype=torch.float64)


# ------------------------------------------------------------------ study

@dataclass
class Row:
    """One head sum's figures against the float32 path: per-row retention
    (``keep``, float64 ``[R]``) and ``calc_diff`` over all rows."""

    how: str
    keep: torch.Tensor
    calc_diff: float

    def merged(self, other: "Row") -> "Row":
        return Row(self.how, torch.cat([self.keep, other.keep]),
                   max(self.calc_diff, other.calc_diff))

    @property
    def misses(self) -> torch.Tensor:
        """Per row, how many of the reference's top-k entries were lost."""
        return ((1 - self.keep) * TOPK).round().long()


def study(inputs: Inputs, hows=HEAD_SUMS, k: int = TOPK) -> list[Row]:
    """Each head sum in ``hows`` against the float32 one on ``inputs``."""
    qk = qk_fp32(inputs.q, inputs.k)
    base = head_sum(qk, inputs.w, inputs.k_scale, "fp32")
    out = []
    for how in hows:
        got = base if how == "fp32" else head_sum(qk, inputs.w, inputs.k_scale, how,
                                                  inputs.q, inputs.k)
        out.append(Row(how, topk_retention(base, got, k), calc_diff(got, base)))
    return out


def quantisation_effect(inputs: Inputs, k: int = TOPK) -> Row:
    """For scale: the fp8 path (float32 head sum) against the unquantised one."""
    exact = head_sum(qk_fp32(inputs.q_ref, inputs.k_ref), inputs.w_ref,
                     torch.ones(inputs.k.shape[0]), "fp64")
    fp8 = head_sum(qk_fp32(inputs.q, inputs.k), inputs.w, inputs.k_scale, "fp32")
    return Row("fp8 q, k vs unquantised", topk_retention(exact, fp8, k), calc_diff(fp8, exact))


def deepgemm_check(rows: int = 4, context: int = 8192, hows=HEAD_SUMS, seed: int = 0,
                   heads: int = 64) -> dict[str, tuple[float, float]]:
    """DeepGEMM's tolerances on its own generator, per head sum: ``(calc_diff``
    against its bf16 reference, ``calc_diff`` against its fp8 simulation``)``;
    DeepGEMM asserts < 1e-3 and < 5e-6 (float32 logits)."""
    inputs, bf16_ref, simulated = deepgemm_inputs(rows, context, heads=heads, seed=seed)
    qk = qk_fp32(inputs.q, inputs.k)
    return {how: (calc_diff(got, bf16_ref), calc_diff(got, simulated))
            for how in hows
            for got in [head_sum(qk, inputs.w, inputs.k_scale, how, inputs.q, inputs.k)]}


# ------------------------------------------------------ on the GPU (sm_90)

def paged_step(parts: list[Inputs], *, device="cuda", seed: int = 0, mtp: bool = True) -> dict:
    """Requests (one :class:`Inputs` each) as one varlen step of the launcher's
    arguments: ``q [R, 1, H, D]`` e4m3, ``kv_cache`` (the fused fp8 layout, pages
    in random order), ``weights``, ``context_lens [R, 1]``, ``block_table``,
    ``indices``, ``max_context_len``.  ``mtp``: a request's row ``j`` of ``n``
    sees all but its last ``n - 1 - j`` tokens (speculative rows); else every
    row sees them all."""
    page = 64
    _, heads, dim = parts[0].q.shape
    pages = [-(-p.k.shape[0] // page) for p in parts]
    perm = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(seed))
    fused = torch.zeros((sum(pages), page * (dim + 4)), dtype=torch.uint8)
    table = torch.zeros((sum(p.q.shape[0] for p in parts), max(pages)), dtype=torch.int32)
    ids, ctx, row, off = [], [], 0, 0
    for b, (p, n_pages) in enumerate(zip(parts, pages)):
        blocks = perm[off:off + n_pages]
        off += n_pages
        n_tok, n_rows = p.k.shape[0], p.q.shape[0]
        k = torch.zeros((n_pages * page, dim))
        k[:n_tok] = p.k
        sc = torch.zeros(n_pages * page)
        sc[:n_tok] = p.k_scale
        fused[blocks, : page * dim] = k.to(torch.float8_e4m3fn).view(torch.uint8).view(n_pages, -1)
        fused[blocks, page * dim:] = sc.view(n_pages, page).view(torch.uint8)
        table[row:row + n_rows, :n_pages] = blocks.to(torch.int32)
        ids += [b] * n_rows
        ctx += [n_tok - ((n_rows - 1 - j) if mtp else 0) for j in range(n_rows)]
        row += n_rows
    dev = torch.device(device)
    return {
        "q": torch.cat([p.q for p in parts]).to(torch.float8_e4m3fn)[:, None].to(dev),
        "kv_cache": fused.view(-1, page, 1, dim + 4).to(dev),
        "weights": torch.cat([p.w for p in parts]).float().contiguous().to(dev),
        "context_lens": torch.tensor(ctx, dtype=torch.int32).view(-1, 1).to(dev),
        "block_table": table.to(dev),
        "indices": torch.tensor(ids, dtype=torch.int32).to(dev),
        "max_context_len": max(p.k.shape[0] for p in parts),
    }


def _run_build(step: dict, head_sum: str, max_run_len: int) -> torch.Tensor:
    """One of the CUDA kernel's builds on ``step`` (poisoned output)."""
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck

    rows = step["q"].shape[0]
    out = torch.full((rows, step["max_context_len"]), float("nan"), device=step["q"].device)
    ck.launch(step["q"], step["kv_cache"], step["weights"], step["context_lens"],
              step["block_table"], step["indices"], step["max_context_len"], out,
              defines=ck.defines_for(max_run_len, head_sum))
    torch.cuda.synchronize()
    return out


def gpu_study(requests: int = 8, rows: int = 4, context: int = 32768, seeds: int = 2,
              spread: float = 0.5, k: int = TOPK, device="cuda") -> dict[str, Row]:
    """Serving-like steps (``requests`` requests of ``rows`` rows at ``context``
    tokens) through both builds: per row, top-``k`` retention and calc_diff of
    (label -> :class:`Row`): the TF32 build against the fp32 build (the
    contract's comparison), each build against the torch reference (fp32
    head sum; the fp8 tensor cores' own accumulation error shows here), the
    TF32 build against its emulation."""
    from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref

    table: dict[str, Row] = {}
    for seed in range(seeds):
        parts = [serving_inputs(rows, context, channel_spread=spread, seed=1000 * seed + i)
                 for i in range(requests)]
        step = paged_step(parts, device=device, seed=seed)
        got = {how: _run_build(step, how, rows) for how in ("fp32", "tf32")}
        ref = {how: paged_mqa_logits_ref(**step, head_sum=how) for how in ("fp32", "tf32")}
        ctx = step["context_lens"].view(-1).tolist()
        pairs = {"tf32 build vs fp32 build": (got["fp32"], got["tf32"]),
                 "fp32 build vs reference": (ref["fp32"], got["fp32"]),
                 "tf32 build vs reference": (ref["fp32"], got["tf32"]),
                 "tf32 build vs emulation": (ref["tf32"], got["tf32"])}
        for label, (a, b) in pairs.items():
            keep = torch.cat([topk_retention(a[r:r + 1, :c].cpu(), b[r:r + 1, :c].cpu(), k)
                              for r, c in enumerate(ctx)])
            valid = torch.isfinite(a)
            row = Row(label, keep, calc_diff(b[valid], a[valid]))
            table[label] = table[label].merged(row) if label in table else row
    return table


def gpu_deepgemm_check(context: int = 8192, rows: int = 2) -> dict[str, tuple[float, float]]:
    """DeepGEMM's check on the kernel's own logits (its generator, every row
    seeing the whole context): per build, ``calc_diff`` against its bf16
    reference and its fp8 simulation (it asserts < 1e-3 and < 5e-6)."""
    inputs, bf16_ref, simulated = deepgemm_inputs(rows, context)
    step = paged_step([inputs], mtp=False)
    out = {}
    for how in ("fp32", "tf32"):
        got = _run_build(step, how, rows).cpu()
        out[how] = (calc_diff(got, bf16_ref), calc_diff(got, simulated))
    return out


def _print_rows(rows: dict[str, Row]) -> None:
    for label, row in rows.items():
        below = int((row.keep < CONTRACT_KEEP).sum())
        hist = torch.bincount(row.misses).tolist()
        print(f"  {label:26s} {row.keep.numel():5d} {float(row.keep.min()):9.4%} "
              f"{float(row.keep.mean()):9.4%} {below:8d} {row.calc_diff:9.2e}  "
              f"{hist if len(hist) <= 8 else '-'}", flush=True)


def main_gpu(args) -> int:
    print(f"sm_90 CUDA kernel, both head-sum builds: {args.requests} requests x {args.rows} rows "
          f"at {args.context} tokens, {args.seeds} draws per channel spread; top-{TOPK} per row "
          f"over the tokens each row sees")
    for spread in args.spreads:
        print(f"  channel spread {spread}: {'comparison':26s} {'rows':>5s} {'min keep':>9s} "
              f"{'mean keep':>9s} {'< 99.9 %':>8s} {'calc_diff':>9s}  rows by lost entries")
        _print_rows(gpu_study(args.requests, args.rows, args.context, args.seeds, spread))
    print("DeepGEMM's check on the kernel's logits (asserts < 1e-3 vs bf16 ref, < 5e-6 vs fp8 "
          "simulation):")
    for context in (8192, 65536):
        for how, (ref, sim) in gpu_deepgemm_check(context).items():
            ok = ref < 1e-3 and sim < 5e-6
            print(f"  L {context:6d} {how} build  vs bf16 ref {ref:.2e}  vs simulation {sim:.2e}  "
                  f"{'pass' if ok else 'FAIL'}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=None,
                   help="rows per request (default 8 on the CPU, 4 with --gpu)")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--seeds", type=int, default=4, help="independent draws per setting")
    p.add_argument("--spreads", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    p.add_argument("--pow2", action="store_true", help="power-of-two (ue8m0) fp8 scales")
    p.add_argument("--gpu", action="store_true",
                   help="run both builds of the sm_90 CUDA kernel on the same inputs")
    p.add_argument("--requests", type=int, default=8, help="--gpu: requests per step")
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = 4 if args.gpu else 8
    if args.gpu:
        if args.rows > 8 or args.rows < 1:
            raise ValueError(f"--rows: the GPU study takes 1..8 rows per request, got {args.rows}")
        return main_gpu(args)
    print(f"top-{TOPK} retention per row against the fp32 head sum, {args.rows} rows x "
          f"{args.context} tokens, H {args.heads}, D 128, {args.seeds} draws per channel spread"
          f"{', power-of-two scales' if args.pow2 else ''}")
    print(f"{'head sum':24s} {'spread':>6s} {'rows':>5s} {'min keep':>9s} {'mean keep':>9s} "
          f"{'< 99.9 %':>8s} {'calc_diff':>9s}  rows by lost entries (0, 1, 2, ...)")
    for spread in args.spreads:
        table: dict[str, Row] = {}
        for seed in range(args.seeds):
            inp = serving_inputs(args.rows, args.context, heads=args.heads,
                                 channel_spread=spread, pow2_scales=args.pow2, seed=seed)
            for row in study(inp) + [quantisation_effect(inp)]:
                table[row.how] = table[row.how].merged(row) if row.how in table else row
        for how, row in table.items():
            below = int((row.keep < CONTRACT_KEEP).sum())
            hist = torch.bincount(row.misses).tolist() if how != "fp8 q, k vs unquantised" else []
            print(f"{how:24s} {spread:6.1f} {row.keep.numel():5d} {float(row.keep.min()):9.4%} "
                  f"{float(row.keep.mean()):9.4%} {below:8d} {row.calc_diff:9.2e}  "
                  f"{hist if len(hist) <= 8 else '-'}", flush=True)
    print("DeepGEMM's check (its generator; asserts calc_diff < 1e-3 vs bf16 ref, < 5e-6 vs "
          "fp8 simulation):")
    for context in (8192, 65536):
        for how, (ref, sim) in deepgemm_check(rows=2, context=context, heads=args.heads).items():
            ok = ref < 1e-3 and sim < 5e-6
            print(f"  L {context:6d} {how:11s} vs bf16 ref {ref:.2e}  vs simulation {sim:.2e}  "
                  f"{'pass' if ok else 'FAIL'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
