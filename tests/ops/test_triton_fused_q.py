"""The indexer's query preparation (ops.triton_fused_q) against the torch
reference and, where vLLM 0.33 or 0.34 is installed, against vLLM's own ``fused_q``
kernel on the same inputs.

Inputs are laid out as the attention layer hands them over: ``q_pe`` a view
of the q projection's ``[T, H, 192]`` rows, ``ql_nope`` the transposed output
of the per-head absorption ``bmm`` (``[H, T, 512]`` seen as ``[T, H, 512]``),
the indexer weights a view of the fused ``wk | weights`` projection, the RoPE
tables real cos / sin rows.  Outputs are poisoned (NaN) before the kernel runs.

The kernel writes its multiply-adds out (``tl.fma``) where vLLM's kernel has
them fused on Hopper, and the reference rounds them the same way
(:func:`~vllm_dsa_varlen.ops.reference.fma32`).  On the CPU the kernel runs in
Triton's interpreter, numpy float32 (Triton 3.9's interpreter fuses ``tl.fma``,
3.8's does not: :func:`kernel_fuses_fma` says which, and the reference
rounds alike): every value before the final cast must be bit-equal, compared
through the interpreter's own cast (:func:`interpreter_cast`).  On a GPU the
RoPE'd query is bit-equal to the reference; a quotient by the per-tensor
``q_scale`` (the fp8 query; the GPU divides approximately) may move a value by
one fp8 step.  Against vLLM's Triton kernel every byte must be equal, at every
block shape; float32 inputs on the bf16-query path show every bit of the
RoPE'd ``q_pe`` (a bf16 output hides most of them).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from query_checks import (FP8, as_bytes, check_power_of_two_quantization, fused_q_args,
                          fused_q_inputs, interpreter_cast, kernel_fuses_fma)
from vllm_dsa_varlen.ops import triton_fused_q as fq
from vllm_dsa_varlen.ops.reference import fused_q_reference


def poisoned_out(inp, quantize_mqa):
    t, h, r = inp["q_pe"].shape
    dev = inp["q_pe"].device
    nan8 = torch.full((), float("nan")).to(FP8)
    mqa = (torch.full((t, h, inp["ql_nope"].shape[2] + r), float("nan"), device=dev).to(FP8)
           if quantize_mqa else torch.full_like(inp["q_pe"], float("nan")))
    assert torch.isnan(nan8.float())
    return (torch.full(inp["index_q"].shape, float("nan"), device=dev).to(FP8),
            torch.full(inp["index_q"].shape[:2], float("nan"), device=dev), mqa)


def run_ours(inp, *, interleave=False, quantize_mqa=False, blocks=fq.Blocks()):
    out = poisoned_out(inp, quantize_mqa)
    got = fq.fused_q(**inp, index_rope_interleave=interleave, quantize_mqa=quantize_mqa,
                     blocks=blocks, out=out)
    assert all(a is b for a, b in zip(got, out))
    for x in got:
        assert not torch.isnan(x.float()).any(), "an output element was not written"
    return got


def reference(inp, *, interleave=False, quantize_mqa=False):
    fused = kernel_fuses_fma()
    return fused_q_reference(*fused_q_args(inp), interleave=interleave, quantize_mqa=quantize_mqa,
                             fused=fused)


def fp8_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable e4m3 values lie between ``a`` and ``b`` (same sign
    assumed where both are nonzero: the ordering of e4m3 bit patterns)."""
    def ordinal(x):
        bits = x.view(torch.uint8).to(torch.int32)
        mag = bits & 0x7F
        return torch.where(bits & 0x80 != 0, -mag, mag)
    return (ordinal(a.cpu()) - ordinal(b.cpu())).abs()


def assert_matches_reference(got, ref, inp, quantize_mqa, interpreter):
    index_q_fp8, weights, mqa = got
    pre_index = ref["index_q_roped"] / ref["index_scale"][..., None]
    pre_mqa = (torch.cat([inp["ql_nope"].float(), ref["q_pe_roped"]], dim=-1) / inp["q_scale"].float()
               if quantize_mqa else ref["q_pe_roped"])
    if interpreter:
        assert torch.equal(as_bytes(weights), as_bytes(ref["index_weights_out"]))
        assert torch.equal(as_bytes(index_q_fp8), as_bytes(interpreter_cast(pre_index, FP8)))
        want = pre_mqa if mqa.dtype == torch.float32 else interpreter_cast(pre_mqa, mqa.dtype)
        assert torch.equal(as_bytes(mqa), as_bytes(want))
        return
    # On the GPU: the RoPE and the power-of-two scales exactly as the reference;
    # the fp8 query's quotient by q_scale (an approximate division there) may
    # move a value by one fp8 step, rarely.
    assert torch.equal(as_bytes(index_q_fp8), as_bytes(ref["index_q_fp8"]))
    assert torch.equal(as_bytes(weights), as_bytes(ref["index_weights_out"]))
    if quantize_mqa:
        apart = fp8_steps_apart(mqa, ref["mqa_q"])
        assert apart.max() <= 1 and (apart > 0).float().mean() < 1e-3
    else:
        assert torch.equal(as_bytes(mqa), as_bytes(ref["mqa_q"]))


def _cases(gpu):
    tokens = (1, 7, 256) if gpu else (1, 5)
    return [(t, h, hi, il, qm) for t in tokens for (h, hi) in ((64, 64), (16, 64), (128, 32))
            for il in (False, True) for qm in (False, True)]


@pytest.mark.parametrize("tokens,heads,index_heads,interleave,quantize_mqa", _cases(False))
def test_against_reference(device, tokens, heads, index_heads, interleave, quantize_mqa):
    inp = fused_q_inputs(tokens, heads, index_heads, device=device, seed=tokens * 131 + heads)
    got = run_ours(inp, interleave=interleave, quantize_mqa=quantize_mqa)
    ref = reference(inp, interleave=interleave, quantize_mqa=quantize_mqa)
    assert_matches_reference(got, ref, inp, quantize_mqa, interpreter=device.type == "cpu")


@pytest.mark.parametrize("interleave,quantize_mqa", [(False, True), (True, False)])
def test_against_reference_with_model_tables(device, interleave, quantize_mqa):
    """bf16 RoPE tables scaled past 1 (YaRN), positions deep into a 32K context."""
    inp = fused_q_inputs(5, 16, 64, device=device, seed=random.randrange(1 << 30),
                         max_pos=32768, cache_dtype=torch.bfloat16, cache_scale=1.2)
    got = run_ours(inp, interleave=interleave, quantize_mqa=quantize_mqa)
    ref = reference(inp, interleave=interleave, quantize_mqa=quantize_mqa)
    assert_matches_reference(got, ref, inp, quantize_mqa, interpreter=device.type == "cpu")


# The default shape (one warp), a two-warp shape and one indexer head a program:
# left to the compiler, the products fused differed between such shapes.
SHAPES = [fq.Blocks(), fq.Blocks(4, 16, 2, 2), fq.Blocks(1, 8, 1, 1)]

# Every case at the default shape; the other shapes at 256 tokens of 64 heads
# (each shape and head count is a compile of its own on the GPU).
_GPU_CASES = ([(c, fq.Blocks()) for c in _cases(True)]
              + [((256, 64, 64, il, qm), b) for b in SHAPES[1:]
                 for il in (False, True) for qm in (False, True)])


@pytest.mark.gpu
@pytest.mark.parametrize("case,blocks", _GPU_CASES, ids=str)
def test_against_reference_gpu(case, blocks):
    tokens, heads, index_heads, interleave, quantize_mqa = case
    inp = fused_q_inputs(tokens, heads, index_heads, device=torch.device("cuda"), seed=tokens + heads)
    got = run_ours(inp, interleave=interleave, quantize_mqa=quantize_mqa, blocks=blocks)
    ref = reference(inp, interleave=interleave, quantize_mqa=quantize_mqa)
    assert_matches_reference(got, ref, inp, quantize_mqa, interpreter=False)


@pytest.mark.parametrize("blocks", SHAPES, ids=str)
@pytest.mark.parametrize("interleave", [False, True])
def test_float32_query_shows_which_products_are_fused(device, interleave, blocks):
    """float32 inputs on the bf16-query path: the RoPE'd ``q_pe`` comes out in
    float32, every bit of it, so the rounding of each RoPE value shows (the
    fused and the twice-rounded forms differ in a good share of the values,
    checked: the comparison can tell them apart)."""
    tokens = 64 if device.type == "cuda" else 3
    inp = fused_q_inputs(tokens, 8, 16, device=device, seed=21 + interleave, dtype=torch.float32)
    got = run_ours(inp, interleave=interleave, quantize_mqa=False, blocks=blocks)
    ref = reference(inp, interleave=interleave, quantize_mqa=False)
    assert got[2].dtype == torch.float32
    assert_matches_reference(got, ref, inp, False, interpreter=device.type == "cpu")
    other = fused_q_reference(*fused_q_args(inp), interleave=interleave, quantize_mqa=False,
                              fused=not kernel_fuses_fma())
    assert (other["q_pe_roped"] != ref["q_pe_roped"]).float().mean() > 0.05


@pytest.mark.parametrize("blocks", [fq.Blocks(1, 1, 1, 1), fq.Blocks(64, 64, 16, 8),
                                    fq.Blocks(8, 128, 2, 2)])
def test_every_block_shape_gives_the_same_bytes(device, blocks):
    inp = fused_q_inputs(3, 24, 48, device=device, seed=5)  # heads not a multiple of every block
    base = run_ours(inp, quantize_mqa=True)
    other = run_ours(inp, quantize_mqa=True, blocks=blocks)
    for a, b in zip(base, other):
        assert torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.gpu
def test_scales_are_powers_of_two_that_fit_each_head():
    inp = fused_q_inputs(4, device=torch.device("cuda"), seed=11, spread=300.0)
    index_q_fp8, weights, _ = run_ours(inp)
    check_power_of_two_quantization(
        index_q_fp8, weights, inp["index_weights"].float() * inp["index_weights_softmax_scale"]
        * inp["index_weights_head_scale"], reference(inp)["index_q_roped"])


def test_zero_tokens(device):
    inp = fused_q_inputs(0, device=device)
    a, b, c = fq.fused_q(**inp)
    assert a.shape == (0, 64, 128) and b.shape == (0, 64) and c.shape == (0, 64, 512 + 64)


@pytest.mark.parametrize("arg,bad,message", [
    ("positions", lambda i: i["positions"].int(), "positions"),
    ("q_pe", lambda i: i["q_pe"][:-1], "q_pe"),
    ("ql_nope", lambda i: i["ql_nope"][:, :-1], "ql_nope"),
    ("ql_nope", lambda i: i["ql_nope"][..., ::2], "ql_nope"),  # read by the fp8 query
    ("index_q", lambda i: i["index_q"][..., :96], "index_q"),
    ("index_weights", lambda i: i["index_weights"][:, :-1], "index_weights"),
    ("q_scale", lambda i: i["q_scale"].double(), "q_scale"),
    ("q_pe_cos_sin_cache", lambda i: i["q_pe_cos_sin_cache"][:, :32], "q_pe_cos_sin_cache"),
    ("index_q_cos_sin_cache", lambda i: torch.cat([i["index_q_cos_sin_cache"]] * 3, 1),
     "index_q_cos_sin_cache"),
])
def test_bad_input_names_the_argument(device, arg, bad, message):
    inp = fused_q_inputs(2, device=device)
    inp[arg] = bad(inp)
    with pytest.raises(ValueError, match=message):
        fq.fused_q(**inp)


def test_bad_blocks_and_out_are_refused(device):
    inp = fused_q_inputs(2, device=device)
    with pytest.raises(ValueError, match="blocks.pe"):
        fq.fused_q(**inp, blocks=fq.Blocks(pe=3))
    with pytest.raises(ValueError, match="blocks.warps"):
        fq.fused_q(**inp, blocks=fq.Blocks(warps=3))
    out = list(poisoned_out(inp, False))
    out[1] = out[1].double()
    with pytest.raises(ValueError, match="index_weights_out"):
        fq.fused_q(**inp, quantize_mqa=False, out=tuple(out))


# ---- against vLLM's own kernel (where vLLM 0.33 or 0.34 is installed) ------------------

def _vllm_fused_q():
    """vLLM's own ``fused_q`` (its Triton kernel; 0.34 ships 0.33's module
    unchanged, and both lines serve the project's kernel in its place).  Off CUDA vLLM hands
    its modules a placeholder ``triton``; there its kernels module is loaded a
    second time, under another name, with the real Triton (the interpreter),
    leaving vLLM's own import untouched."""
    pytest.importorskip("vllm")
    from vllm_dsa_varlen.patches import installed_line
    if installed_line() not in ("0.33", "0.34"):
        pytest.skip("vLLM's fused_q is compared where vLLM 0.33 or 0.34 is installed")
    import importlib.util

    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    if torch.cuda.is_available():
        from vllm.models.deepseek_v32.common import kernels
        return kernels.fused_q
    if kernel_fuses_fma():
        pytest.skip("this interpreter fuses the kernel's tl.fma but not the products vLLM's "
                    "kernel leaves to the compiler: it stands for no GPU build")
    spec = importlib.util.find_spec("vllm.models.deepseek_v32.common.kernels")
    saved = tu.triton, tu.tl
    tu.triton, tu.tl = triton, tl
    try:
        mod = importlib.util.module_from_spec(
            importlib.util.spec_from_file_location("_vllm_033_kernels_interpreted", spec.origin))
        mod.__spec__.loader.exec_module(mod)
    finally:
        tu.triton, tu.tl = saved
    return mod.fused_q


def _vllm_run(stock, inp, interleave, quantize_mqa):
    return stock(*fused_q_args(inp), has_indexer=True, index_rope_interleave=interleave,
                 quantize_mqa=quantize_mqa)


def check_bit_equal_to_vllm(device, tokens, heads, index_heads, interleave, quantize_mqa, seed,
                            blocks=fq.Blocks(), dtype=torch.bfloat16, **tables):
    stock = _vllm_fused_q()
    inp = fused_q_inputs(tokens, heads, index_heads, device=device, seed=seed, dtype=dtype,
                         **tables)
    want = _vllm_run(stock, inp, interleave, quantize_mqa)
    got = run_ours(inp, interleave=interleave, quantize_mqa=quantize_mqa, blocks=blocks)
    for name, a, b in zip(("index_q_fp8", "index_weights_out", "mqa_q"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(as_bytes(a), as_bytes(b)), f"{name} differs from vLLM's fused_q"


@pytest.mark.parametrize("interleave,quantize_mqa", [(False, False), (True, True)])
def test_bit_equal_to_vllm(device, interleave, quantize_mqa):
    check_bit_equal_to_vllm(device, 3, 16, 64, interleave, quantize_mqa, seed=7)


_PATHS = [(False, False), (False, True), (True, False), (True, True)]  # (interleave, quantize_mqa)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 256, 1027])
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("interleave,quantize_mqa", _PATHS)
def test_bit_equal_to_vllm_gpu(tokens, heads, interleave, quantize_mqa):
    for seed in range(3):
        check_bit_equal_to_vllm(torch.device("cuda"), tokens, heads, 64, interleave,
                                quantize_mqa, seed=seed * 1000 + tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("blocks", SHAPES, ids=str)
@pytest.mark.parametrize("interleave,quantize_mqa", _PATHS)
def test_every_shape_bit_equal_to_vllm_gpu(interleave, quantize_mqa, blocks, dtype):
    """At 1027 tokens of 64 heads, each shape with bf16 and float32 inputs
    (float32: every bit of the RoPE'd ``q_pe`` shows)."""
    for seed in range(3):
        check_bit_equal_to_vllm(torch.device("cuda"), 1027, 64, 64, interleave, quantize_mqa,
                                seed=seed * 1000 + 1027, blocks=blocks, dtype=dtype)


# A served prefill: chunks of thousands of tokens at positions deep into a long context,
# with the model's own tables (bf16 or float32, YaRN-scaled past 1).
_TABLES = [dict(max_pos=32768, cache_dtype=torch.float32, cache_scale=1.0),
           dict(max_pos=32768, cache_dtype=torch.bfloat16, cache_scale=1.2)]


@pytest.mark.parametrize("tables", _TABLES, ids=["fp32", "bf16-scaled"])
def test_deep_positions_and_model_tables_bit_equal_to_vllm(device, tables):
    for interleave, quantize_mqa in _PATHS:
        check_bit_equal_to_vllm(device, 3, 16, 64, interleave, quantize_mqa,
                                seed=random.randrange(1 << 30), **tables)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [4096, 8192])
@pytest.mark.parametrize("tables", _TABLES, ids=["fp32", "bf16-scaled"])
@pytest.mark.parametrize("interleave,quantize_mqa", _PATHS)
def test_prefill_chunks_bit_equal_to_vllm_gpu(tokens, tables, interleave, quantize_mqa):
    check_bit_equal_to_vllm(torch.device("cuda"), tokens, 16, 64, interleave, quantize_mqa,
                            seed=random.randrange(1 << 30), **tables)


def test_reference_rope_is_a_rotation():
    """The reference's RoPE keeps each pair's length and turns it by the
    position's angle (independent of the kernel's arithmetic)."""
    inp = fused_q_inputs(6, 4, 4, device=torch.device("cpu"), seed=3, dtype=torch.float32)
    ref = reference(inp, quantize_mqa=False)
    x = inp["q_pe"].float()
    y = ref["q_pe_roped"]
    n0 = x[..., 0::2] ** 2 + x[..., 1::2] ** 2
    n1 = y[..., 0::2] ** 2 + y[..., 1::2] ** 2
    torch.testing.assert_close(n1, n0, rtol=1e-5, atol=1e-5)
    pos = inp["positions"][2].item()
    inv = 1.0 / (10000.0 ** (2 * 5 / 64))
    a0 = math.atan2(x[2, 1, 11].item(), x[2, 1, 10].item())
    a1 = math.atan2(y[2, 1, 11].item(), y[2, 1, 10].item())
    assert math.isclose(math.remainder(a1 - a0 - pos * inv, 2 * math.pi), 0.0, abs_tol=1e-3)


def test_the_bf16_query_does_not_read_ql_nope(device):
    """On the bf16-query path the NoPE part is not read (vLLM hands it to the
    attention as it is), so its layout is not checked there."""
    inp = fused_q_inputs(2, 16, 64, device=device, seed=8)
    want = run_ours(inp, quantize_mqa=False)
    inp["ql_nope"] = inp["ql_nope"][..., ::2]
    got = run_ours(inp, quantize_mqa=False)
    for a, b in zip(got, want):
        assert torch.equal(as_bytes(a), as_bytes(b))
