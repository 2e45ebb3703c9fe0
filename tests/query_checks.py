"""Shared inputs and byte checks of the query-preparation kernels' tests
(``ops.triton_fused_q``, ``ops.triton_indexer_q``, the vLLM patches that call
them): real RoPE tables, vLLM 0.33's ``fused_q`` inputs as its attention
layer lays them out and vLLM 0.27's indexer-query inputs as its indexer
does, what Triton's CPU interpreter rounds otherwise than a
GPU (its ``tl.fma``, its casts), and a byte view for exact comparisons."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_dsa_varlen.ops.triton_fused_q import ROPE_FUSED

FP8 = torch.float8_e4m3fn


def rope_table(positions: int, rot_dim: int, device, dtype=torch.float32, base=10000.0,
               scale=1.0):
    """cos | sin rows per position, times ``scale`` (YaRN's attention factor
    scales them past 1), rounded once to ``dtype``."""
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return (torch.cat([ang.cos(), ang.sin()], dim=1) * scale).to(dtype).to(device)


def fused_q_inputs(tokens, heads=64, index_heads=64, *, device, seed=0, nope=512, rope=64,
                   index_dim=128, index_rope=64, dtype=torch.bfloat16, spread=1.0,
                   max_pos=4096, cache_dtype=torch.float32, cache_scale=1.0):
    """vLLM 0.33's and 0.34's ``fused_q`` inputs (by name) for ``tokens``
    positions drawn below ``max_pos``; the RoPE tables in ``cache_dtype``,
    times ``cache_scale`` (YaRN's attention factor scales them past 1)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    positions = torch.randint(0, max_pos, (tokens,), generator=g).to(device)
    # q rows [T, H, nope_head + rope] as the q projection writes them; q_pe is their tail.
    q = rand(tokens, heads, 128 + rope, scale=spread)
    q_pe = q[..., 128:]
    ql_nope = rand(heads, tokens, nope, scale=spread).transpose(0, 1)
    # index_q: some heads far larger than others (per-head scales must differ).
    head_mag = torch.exp2(torch.randint(-6, 7, (index_heads,), generator=g).float())
    index_q = (torch.randn(tokens, index_heads, index_dim, generator=g) * head_mag[:, None]
               * spread).to(dtype).to(device)
    if tokens:
        index_q[0, 0] = 0  # an all-zero head: the 1e-4 floor of the scale
    kw = rand(tokens, index_dim + index_heads)
    return dict(
        positions=positions, q_pe=q_pe,
        q_pe_cos_sin_cache=rope_table(max_pos, rope, device, cache_dtype, scale=cache_scale),
        index_q=index_q,
        index_q_cos_sin_cache=rope_table(max_pos, index_rope, device, cache_dtype,
                                         scale=cache_scale),
        ql_nope=ql_nope, q_scale=torch.tensor([0.0371], device=device),
        index_weights=kw[:, index_dim:], index_weights_softmax_scale=index_dim ** -0.5,
        index_weights_head_scale=index_heads ** -0.5)


# vLLM's fused_q positional order, which the kernel, the reference and the patch share.
FUSED_Q_ARGS = ("positions", "q_pe", "q_pe_cos_sin_cache", "index_q", "index_q_cos_sin_cache",
                "ql_nope", "q_scale", "index_weights", "index_weights_softmax_scale",
                "index_weights_head_scale")


def fused_q_args(inp) -> tuple:
    """``fused_q_inputs``' inputs as vLLM's ``fused_q`` takes them positionally."""
    return tuple(inp[name] for name in FUSED_Q_ARGS)


MAX_POS = 4096
# vLLM's positional order, which the kernel, the reference and the patch share.
INDEXER_Q_ARGS = ("positions", "q", "cos_sin_cache", "weights", "softmax_scale", "head_scale")


def indexer_q_inputs(tokens, heads=64, *, device, seed=0, dim=128, rope=64,
                     cs_dtype=torch.float32, spread=1.0):
    """vLLM 0.27's ``fused_indexer_q_rope_quant`` inputs (by name, all but
    ``is_neox``) for ``tokens`` positions, laid out as its indexer hands them
    over: ``q`` the ``wq_b`` projection's ``[T, H * dim]`` rows seen as ``[T,
    H, dim]``, the weights a view of the fused ``wk | weights`` projection."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=g).to(device)
    # Heads far apart in magnitude, so the per-head scales differ.
    head_mag = torch.exp2(torch.randint(-6, 7, (heads,), generator=g).float())
    rows = torch.randn(tokens, heads, dim, generator=g) * head_mag[:, None] * spread
    q = rows.to(torch.bfloat16).reshape(tokens, heads * dim).to(device).view(tokens, heads, dim)
    if tokens:
        q[0, 0] = 0  # an all-zero head: the 1e-10 floor of the scale
    kw = torch.randn(tokens, dim + heads, generator=g).to(torch.bfloat16).to(device)
    return dict(positions=positions, q=q,
                cos_sin_cache=rope_table(MAX_POS, rope, device, dtype=cs_dtype),
                weights=kw[:, dim:], softmax_scale=dim ** -0.5, head_scale=heads ** -0.5)


def indexer_q_args(inp, is_neox) -> tuple:
    """``indexer_q_inputs``' inputs and ``is_neox`` as vLLM's function takes them."""
    return tuple(inp[name] for name in INDEXER_Q_ARGS) + (is_neox,)


@triton.jit
def _fma_probe(out_ptr, a, b, c):
    tl.store(out_ptr, tl.fma(a, b, c))


@functools.cache
def kernel_fuses_fma() -> bool:
    """Whether the query kernels' RoPE rounds each multiply-add once where the
    tests run them.  Not where Triton does not fuse vLLM's kernels by default
    (``ROPE_FUSED``: then the kernels round every product, as vLLM's);
    else their ``tl.fma``: compiled for a GPU, always; in Triton's CPU
    interpreter (no GPU here), 3.9's does and 3.8's does not: ``(1 + 2^-12)^2 -
    (1 + 2^-11)`` is ``2^-24`` fused, 0 rounded twice."""
    if not ROPE_FUSED:
        return False
    if torch.cuda.is_available():
        return True
    out = torch.zeros(1)
    _fma_probe[(1,)](out, 1 + 2.0 ** -12, 1 + 2.0 ** -12, -(1 + 2.0 ** -11))
    assert out.item() in (0.0, 2.0 ** -24), out.item()
    return out.item() != 0.0


def interpreter_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What Triton's CPU interpreter stores for the float32 values ``x`` cast to
    ``dtype`` (its own conversion routine): it rounds fp8 half-up without
    carrying into the exponent and truncates bf16, unlike the GPU and torch, so
    on the CPU the kernel's bytes are compared with the reference's float32
    values passed through the interpreter's conversion: every value before the
    cast is then checked bit for bit."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import _convert_float, _ir

    tl_dtype, mode, view = {FP8: (tl.float8e4nv, _ir.ROUNDING_MODE.RTNE, np.uint8),
                            torch.bfloat16: (tl.bfloat16, None, np.int16)}[dtype]
    data = _convert_float(x.float().contiguous().cpu().numpy(), tl.float32, tl_dtype, mode)
    return torch.from_numpy(np.ascontiguousarray(data).view(view)).view(dtype)


def as_bytes(x):
    """``x``'s bytes (any dtype, any layout), on the CPU: what the tests compare."""
    return x.contiguous().view(torch.uint8).cpu()


def check_power_of_two_quantization(q_fp8, weights_out, weights, roped) -> None:
    """Properties of the per-(token, head) quantization alone, on a GPU's
    outputs: each head's scale (``weights_out / weights``, ``weights`` the
    input weights times both float scales) is a power of two, exactly one head
    (the all-zero one) quantizes to zeros, every other head's largest fp8
    value lies in e4m3's top octave (224..448: the scale fits the head), and
    fp8 x scale is ``roped`` (the RoPE'd query, float32) within half an fp8
    step (16 units of the scale at 448).  (The interpreter's fp8 cast breaks
    the last two.)"""
    ratio = weights_out.cpu() / weights.cpu()
    scale = torch.exp2(torch.log2(ratio).round())
    torch.testing.assert_close(ratio, scale, rtol=1e-6, atol=0)
    amax = q_fp8.float().abs().amax(-1).cpu()
    live = amax > 0
    assert (~live).sum() == 1, "only the all-zero head quantizes to zeros"
    assert (amax[live] <= 448).all() and (amax[live] >= 224).all()
    deq = q_fp8.float().cpu() * scale[..., None]
    assert ((deq - roped.cpu()).abs() <= 16 * scale[..., None]).all()


class Recorder:
    """A stand-in for one of vLLM's functions: records each call, returns a marker."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "vllm's"
