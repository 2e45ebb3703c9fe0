"""Torch reference of paged MQA logits: the single source of truth for tests.

``logits[r, n] = sum_h relu(q[r, h] . k[n]) * k_scale[n] * w[r, h]`` for every
KV token ``n`` the row may see, ``-inf`` elsewhere.  Two layouts:

* padded (DeepGEMM SM90 / stock vLLM): ``q [B, next_n, H, D]``,
  ``context_lens [B, next_n]``, ``block_table [B, W]``; row ``b * next_n + j``
  reads block-table row ``b`` and sees ``context_lens[b, j]`` tokens.
* varlen (``indices`` given): ``q [R, 1, H, D]``, ``context_lens [R, 1]`` (or
  ``[R]``), ``block_table [R, W]``, ``indices [R]``.  A request is a maximal
  run of equal adjacent ids; its KV length is the run's *last* row's context
  length, its block-table row is the run's *first* row, and each row sees
  ``min(own context length, run KV length)`` tokens.

KV cache: the fused fp8 layout ``uint8 [num_blocks, page, 1, D + 4]``: per page,
``page * D`` e4m3 values followed by ``page`` fp32 scales.  Nothing here
imports vLLM.

Head sum: ``head_sum="fp32"`` (default) sums ``relu(q . k) * w`` over heads in
float32, as DeepGEMM does on the CUDA cores; ``head_sum="tf32"`` is the sm_90
CUDA kernel's tensor-core head sum (its ``HEAD_SUM_TC`` build,
:func:`head_sum_tf32`): ``relu(q . k)`` rounded to TF32 (10 stored mantissa
bits, round to nearest even: :func:`round_tf32`), the weights carried as two
TF32 parts (``hi = round(w)``, ``lo = round(w - hi)``), the products exact,
each part's sum float32, their sum times the token's scale.

The indexer's query preparation (:func:`fused_q_reference`, vLLM 0.33's
``fused_q``: RoPE, the per-head power-of-two fp8 scale, the weights' scaling)
is stated here too, for :mod:`.triton_fused_q`.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
HEAD_SUMS = ("fp32", "tf32")

# TF32 keeps float32's sign and 8 exponent bits and the top 10 of its 23
# mantissa bits; the low 13 bits of the 32-bit word are dropped.
_TF32_DROP = 13


def round_low_bits(x: torch.Tensor, drop: int) -> torch.Tensor:
    """float32 -> the nearest float32 whose low ``drop`` bits are zero, ties to
    even, from the bits: what PTX's ``cvt.rn`` to a float32-exponent format
    stores (TF32 drops 13, bf16 16).  A finite value past the format's largest
    rounds to infinity; NaN stays NaN."""
    x = x.float().contiguous()
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    odd = (bits >> drop) & 1
    bits = (bits + ((1 << (drop - 1)) - 1) + odd) & (0xFFFFFFFF & ~((1 << drop) - 1))
    out = bits.to(torch.int32).view(torch.float32)  # int64 -> int32 keeps the low 32 bits
    return torch.where(torch.isnan(x), x, out)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest TF32 value, ties to even (PTX ``cvt.rn.tf32.f32``)."""
    return round_low_bits(x, _TF32_DROP)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest bfloat16 value (ties to even), as float32."""
    return x.float().to(torch.bfloat16).float()


def split_fused_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8 [blocks, page, 1, D + 4]`` -> (fp8 ``[blocks, page, D]``, fp32 ``[blocks, page]``)."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise ValueError(
            "kv_cache: expected uint8 [num_blocks, page, 1, D + 4], got "
            f"{kv_cache.dtype} {tuple(kv_cache.shape)}")
    blocks, page, _, width = kv_cache.shape
    dim = width - 4
    flat = kv_cache.reshape(blocks, page * width)
    values = flat[:, : page * dim].contiguous().view(torch.float8_e4m3fn).view(blocks, page, dim)
    scales = flat[:, page * dim:].contiguous().view(torch.float32).view(blocks, page)
    return values, scales


def quantize_kv_fp8(k: torch.Tensor) -> torch.Tensor:
    """Quantize ``k`` float ``[blocks, page, D]`` per token to the fused fp8 layout."""
    blocks, page, dim = k.shape
    scale = k.abs().float().amax(dim=-1, keepdim=True).clamp_min(1e-4) / FP8_MAX
    values = (k.float() / scale).to(torch.float8_e4m3fn)
    fused = torch.empty((blocks, page * (dim + 4)), dtype=torch.uint8, device=k.device)
    fused[:, : page * dim] = values.reshape(blocks, page * dim).view(torch.uint8)
    fused[:, page * dim:] = scale.reshape(blocks, page).contiguous().view(torch.uint8).view(
        blocks, page * 4)
    return fused.view(blocks, page, 1, dim + 4)


def split_tf32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` float32 as two TF32 values ``(hi, lo)``, ``hi = round(w)``,
    ``lo = round(w - hi)`` (:func:`round_tf32`): ``hi + lo`` is ``w`` to ~22 bits."""
    hi = round_tf32(w.float())
    return hi, round_tf32(w.float() - hi)


def head_sum_tf32(qk: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_h relu(qk[..., h, n]) * w[..., h]`` as the tensor-core head sum
    computes it: ``relu(qk)`` rounded to TF32 (:func:`round_tf32`), ``w`` as
    TF32 ``hi + lo`` (:func:`split_tf32`), the products exact (TF32 x TF32 fits
    float32), each part summed (float64, rounded once to float32, as the
    tensor core's float32 accumulation nearly is), then ``hi + lo`` in float32.
    ``qk [..., H, N]`` float32, ``w [..., H]``; returns float32 ``[..., N]``."""
    a = round_tf32(qk.float().relu()).double()
    hi, lo = split_tf32(w)
    return ((a * hi.double()[..., None]).sum(dim=-2).float()
            + (a * lo.double()[..., None]).sum(dim=-2).float())


def _row_logits(q_rows, weights_rows, values, scales, bt_row, kv_len, page, dtype,
                head_sum="fp32"):
    """Logits ``[n_rows, kv_len]`` of rows sharing one request's KV."""
    num_pages = (kv_len + page - 1) // page
    blocks = bt_row[:num_pages].long()
    k = values[blocks].to(dtype).reshape(num_pages * page, -1)[:kv_len]
    s = scales[blocks].to(dtype).reshape(-1)[:kv_len]
    qk = torch.einsum("rhd,nd->rhn", q_rows.to(dtype), k)
    if head_sum == "tf32":
        return head_sum_tf32(qk, weights_rows) * s.float()[None, :]
    return (qk.relu() * weights_rows.to(dtype)[:, :, None]).sum(dim=1) * s[None, :]


def paged_mqa_logits_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    indices: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    head_sum: str = "fp32",
) -> torch.Tensor:
    """Reference logits, float32 ``[rows, max_context_len]``; ``-inf`` where a
    row sees no token.  See the module docstring for both layouts and for
    ``head_sum`` (``"fp32"`` or ``"tf32"``; ``"tf32"`` needs the float32
    ``compute_dtype``)."""
    if head_sum not in HEAD_SUMS:
        raise ValueError(f"head_sum: expected one of {HEAD_SUMS}, got {head_sum!r}")
    if head_sum == "tf32" and compute_dtype != torch.float32:
        raise ValueError(f"compute_dtype: the tf32 head sum takes float32 q . k, got {compute_dtype}")
    values, scales = split_fused_kv(kv_cache)
    page = values.shape[1]
    batch, next_n, heads, _ = q.shape
    rows = batch * next_n
    out = torch.full((rows, max_context_len), float("-inf"), dtype=torch.float32, device=q.device)
    q_rows = q.reshape(rows, heads, -1)
    w_rows = weights.reshape(rows, heads)
    ctx = context_lens.reshape(rows).tolist()
    if indices is None:
        groups = [(b * next_n, (b + 1) * next_n, b) for b in range(batch)]
        kv_lens = [max(ctx[s:e]) for s, e, _ in groups]
    else:
        ids = indices.tolist()
        groups, start = [], 0
        for r in range(1, rows + 1):
            if r == rows or ids[r] != ids[start]:
                groups.append((start, r, start))
                start = r
        kv_lens = [ctx[e - 1] for _, e, _ in groups]
    for (start, end, bt_index), kv_len in zip(groups, kv_lens):
        kv_len = max(0, min(kv_len, max_context_len))
        if kv_len == 0:
            continue
        logits = _row_logits(q_rows[start:end], w_rows[start:end], values, scales,
                             block_table[bt_index], kv_len, page, compute_dtype, head_sum)
        cols = torch.arange(kv_len, device=q.device)
        row_ctx = torch.tensor(ctx[start:end], device=q.device).clamp(max=kv_len)
        out[start:end, :kv_len] = torch.where(
            cols[None, :] < row_ctx[:, None], logits.float(), float("-inf"))
    return out


def run_spans(indices, context_lens, cap: int) -> list[tuple[int, int, int]]:
    """Host walk of a varlen step's runs, for schedule models and tests: each
    run's ``(first row, last row, KV length)``, the KV length being its last
    row's context length clamped to ``[0, cap]``."""
    ids = [int(x) for x in indices]
    ctx = [int(x) for x in context_lens]
    spans = []
    r = 0
    while r < len(ids):
        e = r
        while e + 1 < len(ids) and ids[e + 1] == ids[r]:
            e += 1
        spans.append((r, e, min(max(ctx[e], 0), cap)))
        r = e + 1
    return spans


def valid_mask(context_lens: torch.Tensor, max_context_len: int,
               indices: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[rows, max_context_len]``: positions a kernel must write.

    Each row's own context length bounds it; in the varlen layout also its
    run's KV length (the run's last row's context length)."""
    ctx = context_lens.reshape(-1).long()
    if indices is not None:
        ids = indices.reshape(-1)
        # Last row of each row's run: scan from the end.
        n = ids.numel()
        last = torch.arange(n, device=ids.device)
        if n > 1:
            is_end = torch.ones(n, dtype=torch.bool, device=ids.device)
            is_end[:-1] = ids[:-1] != ids[1:]
            pos = torch.where(is_end, last, torch.full_like(last, n))
            last = pos.flip(0).cummin(0).values.flip(0)
        ctx = torch.minimum(ctx, ctx[last])
    cols = torch.arange(max_context_len, device=ctx.device)
    return cols[None, :] < ctx[:, None]


def topk_ref(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """The indexer's decode top-k: per row ``r`` the columns of the ``k``
    largest of ``logits[r, :lengths[r]]`` (``torch.topk``), int32 ``[R, k]``;
    a row with ``length <= k`` gets ``0 .. length - 1``, then ``-1``.  Order
    and the choice among values tied at the k-th are not part of the
    contract (:func:`topk_selection_ok` checks a result against it).
    ``lengths``: ``R`` integers in any shape, clamped to ``[0, width]``."""
    rows, width = logits.shape
    lens = lengths.reshape(-1).long().clamp(0, width).tolist()
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    for r, n in enumerate(lens):
        if n <= k:
            out[r, :n] = torch.arange(n, dtype=torch.int32, device=logits.device)
        else:
            out[r] = torch.topk(logits[r, :n], k).indices.to(torch.int32)
    return out


def topk_selection_ok(logits: torch.Tensor, lengths: torch.Tensor, k: int,
                      got: torch.Tensor) -> list[str]:
    """What is wrong with ``got`` as the top-k of :func:`topk_ref`'s contract
    (empty: nothing): per row, ``min(length, k)`` distinct columns below the
    row's length then ``-1`` in the remaining slots (any order), and the
    selected values, sorted, equal :func:`topk_ref`'s (so every selected
    value is at least every unselected one; ties chosen freely)."""
    rows, width = logits.shape
    lens = lengths.reshape(-1).long().clamp(0, width).tolist()
    ref = topk_ref(logits, lengths, k)
    errors = []
    for r, n in enumerate(lens):
        row = got[r].long()
        want = min(n, k)
        sel = row[row >= 0]
        if (row == -1).sum() != k - want or sel.numel() != want:
            errors.append(f"row {r}: {sel.numel()} columns selected and "
                          f"{int((row == -1).sum())} -1 slots, want {want} and {k - want}")
            continue
        if want and (sel.max() >= n or sel.unique().numel() != want):
            errors.append(f"row {r}: a column repeated or past the length {n}")
            continue
        mine = logits[r, sel].sort().values
        theirs = logits[r, ref[r, :want].long()].sort().values
        if not torch.equal(mine, theirs):
            errors.append(f"row {r}: selected values differ from torch.topk's")
    return errors


# --------------------------------------------------------------------------------------
# The indexer's query preparation (vLLM 0.33's ``fused_q``; ops.triton_fused_q)
# --------------------------------------------------------------------------------------

def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to float32, as a fused multiply-add rounds
    (float32 inputs, broadcast).  The product of two float32 values is exact in
    float64; the sum is rounded to float64 and then to float32, which rounds
    twice only where the float64 sum falls on a float32 tie: those values are
    recomputed exactly (rational arithmetic, ties to even)."""
    a, b, c = torch.broadcast_tensors(a.float(), b.float(), c.float())
    s = a.double() * b.double() + c.double()
    f = s.float()
    fd = f.double()
    toward = torch.where(s > fd, torch.full_like(f, float("inf")), torch.full_like(f, -float("inf")))
    mate = torch.nextafter(f, toward)
    tie = (s != fd) & torch.isfinite(s) & (s == (fd + mate.double()) / 2)
    if tie.any():
        from fractions import Fraction

        f = f.clone()
        for i in tie.nonzero().tolist():
            i = tuple(i)
            exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
            lo, hi = sorted((f[i].item(), mate[i].item()))
            mid = (Fraction(lo) + Fraction(hi)) / 2
            if exact != mid:
                f[i] = lo if exact < mid else hi
            else:  # the even one: its last mantissa bit clear
                even = torch.tensor([lo], dtype=torch.float32).view(torch.int32).item() & 1 == 0
                f[i] = lo if even else hi
    return f


def _rope_index(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                interleave: bool, *, fused: str | None) -> torch.Tensor:
    """RoPE on the first ``2 * half`` dims of ``x [T, H, D]`` (float32); ``cos``,
    ``sin [T, half]``.  NeoX: dim ``i < half`` pairs with ``i + half``;
    interleaved: ``2i`` with ``2i + 1``.  The rest of ``x`` is unchanged.

    The pair ``(a, b)`` becomes ``(a cos - b sin, b cos + a sin)``, rounded as
    ``fused`` says: ``None`` two products and a sum, each rounded; ``"own"``
    each value's own product fused (``fma(a, cos, -(b sin))``, ``fma(b, cos,
    a sin)``: vLLM's indexer query on Hopper); ``"first"`` the first value's
    products fused in both (``fma(a, cos, -(b sin))``, ``fma(a, sin, b cos)``:
    its MLA query)."""
    half = cos.shape[1]
    out = x.clone()
    if interleave:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    a, b = x[..., first], x[..., second]
    cos, sin = cos[:, None], sin[:, None]
    if fused is None:
        out[..., first] = a * cos - b * sin
        out[..., second] = b * cos + a * sin
    elif fused in ("own", "first"):
        out[..., first] = fma32(a, cos, -(b * sin))
        out[..., second] = fma32(b, cos, a * sin) if fused == "own" else fma32(a, sin, b * cos)
    else:
        raise ValueError(f"fused: expected None, 'own' or 'first', got {fused!r}")
    return out


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale of a block whose largest magnitude is ``amax``:
    ``2 ** ceil(log2(max(amax, 1e-4) / FP8_MAX))`` (float32)."""
    s = torch.clamp(amax.float(), min=1e-4) / FP8_MAX
    return torch.exp2(torch.ceil(torch.log2(s)))


def fused_q_reference(positions: torch.Tensor, q_pe: torch.Tensor, q_pe_cos_sin_cache: torch.Tensor,
                      index_q: torch.Tensor, index_q_cos_sin_cache: torch.Tensor,
                      ql_nope: torch.Tensor, q_scale: torch.Tensor, index_weights: torch.Tensor,
                      softmax_scale: float, head_scale: float, *, interleave: bool = False,
                      quantize_mqa: bool = True, fused: bool = True) -> dict[str, torch.Tensor]:
    """The queries the indexer and the MLA attention take, from the step's
    projections (float32 maths; the RoPE's multiply-adds fused where vLLM's
    kernel fuses them on Hopper (:func:`_rope_index`), or, with ``fused=False``,
    none):

    ``index_q_fp8``: ``index_q [T, Hi, Di]`` RoPE'd (``index_q_roped``, float32;
    ``interleave`` or NeoX,
    ``index_q_cos_sin_cache [P, 2 * half]`` rows ``cos | sin`` at each position)
    and quantized to e4m3 per (token, head) with :func:`ue8m0_scale`;
    ``index_scale [T, Hi]`` those scales; ``index_weights_out``: ``index_weights
    [T, Hi] * scale * softmax_scale * head_scale``; ``q_pe_roped [T, H, R]``:
    ``q_pe`` RoPE'd in interleaved pairs (float32); ``mqa_q``: with
    ``quantize_mqa`` the e4m3 ``[ql_nope, q_pe_roped] / q_scale``, else
    ``q_pe_roped`` in ``q_pe``'s dtype."""
    pos = positions.long()
    cs = index_q_cos_sin_cache.float()[pos]
    half = cs.shape[1] // 2
    x = _rope_index(index_q.float(), cs[:, :half], cs[:, half:], interleave,
                    fused="own" if fused else None)
    scale = ue8m0_scale(x.abs().amax(dim=-1))
    index_q_fp8 = (x / scale[..., None]).to(torch.float8_e4m3fn)
    weights = index_weights.float() * scale * float(softmax_scale) * float(head_scale)
    pcs = q_pe_cos_sin_cache.float()[pos]
    r = pcs.shape[1] // 2
    q_pe_roped = _rope_index(q_pe.float(), pcs[:, :r], pcs[:, r:], True,
                             fused="first" if fused else None)
    if quantize_mqa:
        s = q_scale.float().reshape(())
        mqa_q = (torch.cat([ql_nope.float(), q_pe_roped], dim=-1) / s).to(torch.float8_e4m3fn)
    else:
        mqa_q = q_pe_roped.to(q_pe.dtype)
    return {"index_q_fp8": index_q_fp8, "index_q_roped": x, "index_scale": scale,
            "index_weights_out": weights,
            "q_pe_roped": q_pe_roped, "mqa_q": mqa_q}


# --------------------------------------------------------------------------------------
# The indexer query alone (vLLM 0.27's ``fused_indexer_q_rope_quant``; ops.triton_indexer_q)
# --------------------------------------------------------------------------------------

def indexer_q_reference(positions: torch.Tensor, q: torch.Tensor, cos_sin_cache: torch.Tensor,
                        weights: torch.Tensor, softmax_scale: float, head_scale: float,
                        is_neox: bool, *, fused: bool = True,
                        to_bf16=round_bf16) -> dict[str, torch.Tensor]:
    """The indexer's query and weights from its projections (float32 maths):
    ``q [T, H, D]`` RoPE'd on its first ``2 * half`` dims (``cos_sin_cache [P,
    2 * half]`` rows ``cos | sin``; NeoX halves, else interleaved pairs), the
    first value's products fused in both of a pair's values as vLLM's kernel
    has them on Hopper (``fused=False``: none fused), each RoPE'd value rounded
    to bf16 by ``to_bf16`` (``q_roped``, float32; the GPU rounds to nearest
    even, :func:`round_bf16`; Triton's CPU interpreter truncates); one
    power-of-two scale per token and head, ``2 ** ceil(log2(max(amax, 1e-10) *
    (1 / 448)))`` (``scale``); ``q_fp8`` the e4m3 of ``q_roped / scale``
    clamped to +-448; ``weights_out`` ``weights * scale * softmax_scale *
    head_scale``, each product rounded to float32."""
    cs = cos_sin_cache.float()[positions.long()]
    half = cs.shape[1] // 2
    x = _rope_index(q.float(), cs[:, :half], cs[:, half:], not is_neox,
                    fused="first" if fused else None)
    x[..., :2 * half] = to_bf16(x[..., :2 * half])
    scale = torch.clamp(x.abs().amax(dim=-1), min=1e-10) * torch.tensor(1.0 / FP8_MAX)
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q_fp8 = torch.clamp(x / scale[..., None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    w = weights.float() * scale * float(softmax_scale) * float(head_scale)
    return {"q_fp8": q_fp8, "q_roped": x, "scale": scale, "weights_out": w}
