"""The indexer query's preparation (ops.triton_indexer_q) against the torch
reference and, where vLLM is installed, against vLLM's own
``fused_indexer_q_rope_quant`` kernel on the same inputs (the same kernel in
vLLM 0.27.1 and 0.33.0).

Inputs are laid out as vLLM's indexer hands them over
(``query_checks.indexer_q_inputs``), the RoPE table real cos / sin rows
(float32 or bf16).  Outputs are poisoned (NaN) before the kernel runs.

On the CPU the kernels run in Triton's interpreter, which rounds float32 to
bf16 by truncation and to fp8 its own way, and fuses ``tl.fma`` or not by
version (``query_checks.kernel_fuses_fma``): the reference rounds alike,
and the fp8 values are compared through the interpreter's own cast.  On a GPU
every byte must equal the reference's and vLLM's kernel's.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import math
import pathlib
import types

import pytest
import torch

from query_checks import (FP8, as_bytes, check_power_of_two_quantization, indexer_q_args,
                          indexer_q_inputs, interpreter_cast, kernel_fuses_fma)
from vllm_dsa_varlen.ops import triton_indexer_q as iq
from vllm_dsa_varlen.ops.reference import indexer_q_reference, round_bf16


def poisoned_out(inp):
    q = inp["q"]
    return (torch.full(q.shape, float("nan"), device=q.device).to(FP8),
            torch.full(q.shape[:2], float("nan"), device=q.device))


def run_ours(inp, is_neox=True, heads=iq.INDEX_HEADS, warps=iq.NUM_WARPS):
    out = poisoned_out(inp)
    got = iq.indexer_q(*indexer_q_args(inp, is_neox), heads=heads, warps=warps, out=out)
    assert all(a is b for a, b in zip(got, out))
    for x in got:
        assert not torch.isnan(x.float()).any(), "an output element was not written"
    return got


def interpreter_bf16(x: torch.Tensor) -> torch.Tensor:
    return interpreter_cast(x, torch.bfloat16).float()


def reference(inp, is_neox, *, interpreter: bool, fused: bool | None = None):
    """The reference rounded as the kernel under test rounds: ``fused``
    (default: as this kernel's ``tl.fma`` does where it runs) and, in the
    interpreter, its truncating bf16 cast."""
    return indexer_q_reference(*indexer_q_args(inp, is_neox),
                               fused=kernel_fuses_fma() if fused is None else fused,
                               to_bf16=interpreter_bf16 if interpreter else round_bf16)


def assert_matches(got, ref, *, interpreter: bool):
    q_fp8, weights = got
    assert torch.equal(as_bytes(weights), as_bytes(ref["weights_out"]))
    if interpreter:
        pre = torch.clamp(ref["q_roped"] / ref["scale"][..., None], -448.0, 448.0)
        assert torch.equal(as_bytes(q_fp8), as_bytes(interpreter_cast(pre, FP8)))
    else:
        assert torch.equal(as_bytes(q_fp8), as_bytes(ref["q_fp8"]))


@pytest.mark.parametrize("tokens,heads", [(1, 64), (5, 64), (3, 32), (2, 24)])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("cs_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_against_reference(device, tokens, heads, is_neox, cs_dtype):
    inp = indexer_q_inputs(tokens, heads, device=device, seed=tokens * 31 + heads, cs_dtype=cs_dtype)
    got = run_ours(inp, is_neox)
    assert_matches(got, reference(inp, is_neox, interpreter=device.type == "cpu"),
                   interpreter=device.type == "cpu")


# The default shape, one head a program, and a wide two-warp one.
SHAPES = [(iq.INDEX_HEADS, iq.NUM_WARPS), (1, 1), (16, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [7, 256, 1027])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
def test_against_reference_gpu(tokens, shape, is_neox):
    inp = indexer_q_inputs(tokens, device=torch.device("cuda"), seed=tokens + 3 * is_neox)
    got = run_ours(inp, is_neox, *shape)
    assert_matches(got, reference(inp, is_neox, interpreter=False), interpreter=False)


@pytest.mark.parametrize("heads,warps", [(1, 1), (8, 2), (64, 4), (32, 8)])
def test_every_block_shape_gives_the_same_bytes(device, heads, warps):
    inp = indexer_q_inputs(3, 24, device=device, seed=5)  # 24 heads: not a multiple of every block
    base = run_ours(inp, False)
    other = run_ours(inp, False, heads, warps)
    for a, b in zip(base, other):
        assert torch.equal(as_bytes(a), as_bytes(b))


def test_an_all_zero_head_takes_the_1e_10_floor(device):
    """The zero head's scale is ``2 ** ceil(log2(1e-10 / 448)) = 2 ** -42``
    (worked out here by hand, not by the reference), its fp8 values zeros."""
    assert math.ceil(math.log2(1e-10 / 448)) == -42
    inp = indexer_q_inputs(2, 16, device=device, seed=9)
    q_fp8, weights = run_ours(inp)
    w = inp["weights"][0, 0].float().item()
    want = torch.tensor(w, dtype=torch.float32) * 2.0 ** -42
    want = want * torch.tensor(inp["softmax_scale"]) * torch.tensor(inp["head_scale"])
    assert weights[0, 0].item() == want.item()
    assert (q_fp8[0, 0].float() == 0).all()


@pytest.mark.gpu
def test_scales_are_powers_of_two_that_fit_each_head():
    inp = indexer_q_inputs(4, device=torch.device("cuda"), seed=11, spread=300.0)
    q_fp8, weights = run_ours(inp)
    check_power_of_two_quantization(
        q_fp8, weights, inp["weights"].float() * inp["softmax_scale"] * inp["head_scale"],
        reference(inp, True, interpreter=False)["q_roped"])


def test_reference_rope_is_a_rotation_rounded_to_bf16():
    """The reference's RoPE keeps each pair's length (to bf16's precision) and
    turns it by the position's angle; its values are bf16 values; the rest of
    the head is untouched (independent of the kernel's arithmetic)."""
    inp = indexer_q_inputs(6, 4, device=torch.device("cpu"), seed=3)
    for is_neox in (True, False):
        y = indexer_q_reference(*indexer_q_args(inp, is_neox))["q_roped"]
        x = inp["q"].float()
        first, second = ((slice(0, 32), slice(32, 64)) if is_neox
                         else (slice(0, 64, 2), slice(1, 64, 2)))
        n0 = x[..., first] ** 2 + x[..., second] ** 2
        n1 = y[..., first] ** 2 + y[..., second] ** 2
        torch.testing.assert_close(n1, n0, rtol=2e-2, atol=1e-6)
        assert torch.equal(y, y.to(torch.bfloat16).float())
        assert torch.equal(y[..., 64:], x[..., 64:])
        pos = inp["positions"][2].item()
        i = 5
        inv = 1.0 / (10000.0 ** (2 * i / 64))
        a, b = (i, 32 + i) if is_neox else (2 * i, 2 * i + 1)
        a0 = math.atan2(x[2, 1, b].item(), x[2, 1, a].item())
        a1 = math.atan2(y[2, 1, b].item(), y[2, 1, a].item())
        assert math.isclose(math.remainder(a1 - a0 - pos * inv, 2 * math.pi), 0.0, abs_tol=2e-2)


def test_zero_tokens(device):
    inp = indexer_q_inputs(0, device=device)
    q_fp8, weights = iq.indexer_q(*indexer_q_args(inp, True))
    assert q_fp8.shape == (0, 64, 128) and weights.shape == (0, 64)


@pytest.mark.parametrize("arg,bad,message", [
    ("positions", lambda i: i["positions"].float(), "positions"),
    ("q", lambda i: i["q"][:-1], "q"),
    ("q", lambda i: i["q"].float(), "q"),
    ("q", lambda i: i["q"][..., :96], "q"),
    ("cos_sin_cache", lambda i: i["cos_sin_cache"][:, :48], "cos_sin_cache"),
    ("cos_sin_cache", lambda i: torch.cat([i["cos_sin_cache"]] * 4, 1), "cos_sin_cache"),
    ("weights", lambda i: i["weights"][:, :-1], "weights"),
])
def test_bad_input_names_the_argument(device, arg, bad, message):
    inp = indexer_q_inputs(2, device=device)
    inp[arg] = bad(inp)
    with pytest.raises(ValueError, match=message):
        iq.indexer_q(*indexer_q_args(inp, True))


def test_bad_blocks_and_out_are_refused(device):
    inp = indexer_q_inputs(2, device=device)
    with pytest.raises(ValueError, match="heads"):
        iq.indexer_q(*indexer_q_args(inp, True), heads=3)
    with pytest.raises(ValueError, match="warps"):
        iq.indexer_q(*indexer_q_args(inp, True), warps=6)
    out = list(poisoned_out(inp))
    out[1] = out[1].double()
    with pytest.raises(ValueError, match="weights_out"):
        iq.indexer_q(*indexer_q_args(inp, True), out=tuple(out))


# ---- against vLLM's own kernel (where vLLM is installed) --------------------------------

SAI = "vllm.model_executor.layers.sparse_attn_indexer"


@pytest.fixture
def vllm_indexer_q(monkeypatch, tmp_path):
    """vLLM's own ``fused_indexer_q_rope_quant`` (its Triton kernel).  Off
    CUDA vLLM hands its modules a placeholder ``triton`` and the function
    refuses to run: there the kernel's source is read from the installed
    vLLM and compiled with the real Triton (the interpreter), and the
    function is called with that kernel and a CUDA platform stand-in (both
    put back after the test)."""
    pytest.importorskip("vllm")
    sai = importlib.import_module(SAI)
    if not hasattr(sai, "fused_indexer_q_rope_quant"):
        pytest.skip("this vLLM has no fused_indexer_q_rope_quant")
    if torch.cuda.is_available():
        return sai.fused_indexer_q_rope_quant
    name = "_fused_indexer_q_rope_quant_kernel"
    src = pathlib.Path(inspect.getsourcefile(sai)).read_text()
    node = next(n for n in ast.parse(src).body
                if isinstance(n, ast.FunctionDef) and n.name == name)
    assert [ast.unparse(d) for d in node.decorator_list] == ["triton.jit"]
    path = tmp_path / "vllm_indexer_q_kernel.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                    + ast.get_source_segment(src, node) + "\n")
    spec = importlib.util.spec_from_file_location("_vllm_indexer_q_kernel_interpreted", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sai, name, getattr(mod, name))
    monkeypatch.setattr(sai, "current_platform", types.SimpleNamespace(
        is_cuda=lambda: True, fp8_dtype=lambda: torch.float8_e4m3fn))
    return sai.fused_indexer_q_rope_quant


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("cs_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_states_vllms_kernel(vllm_indexer_q, device, is_neox, cs_dtype):
    """vLLM's kernel against the reference rounded as that kernel runs here (on
    the CPU: nothing fused, the interpreter's casts; on a GPU: the first value's
    products fused).  The bf16 rounding of each RoPE'd value hides whether a
    product was fused in all but ~2 values in 10^5, and the fp8 cast in all but
    ~1 byte in 10^6 (the reference's two forms at 1027 tokens of 64 heads), so
    these few tokens test the rest of the arithmetic (floor, scale, clamp, the
    weights' products); the GPU tests below meet the fused products' cases too."""
    interpreter = device.type == "cpu"
    inp = indexer_q_inputs(5, device=device, seed=13 + is_neox, cs_dtype=cs_dtype, spread=7.0)
    want = vllm_indexer_q(*indexer_q_args(inp, is_neox))
    assert_matches(want, reference(inp, is_neox, interpreter=interpreter, fused=not interpreter),
                   interpreter=interpreter)


def check_bit_equal_to_vllm(stock, device, tokens, heads, is_neox, seed, shape=SHAPES[0],
                            cs_dtype=torch.float32):
    inp = indexer_q_inputs(tokens, heads, device=device, seed=seed, cs_dtype=cs_dtype)
    want = stock(*indexer_q_args(inp, is_neox))
    got = run_ours(inp, is_neox, *shape)
    # The layout of the outputs allocated here (``got``'s are the test's
    # poisoned ones): vLLM's empty_like keeps a one-token view's strides.
    own = iq.indexer_q(*indexer_q_args(inp, is_neox), heads=shape[0], warps=shape[1])
    for name, a, b, c in zip(("q_fp8", "weights_out"), got, want, own):
        assert c.shape == b.shape and c.dtype == b.dtype and c.stride() == b.stride(), name
        assert torch.equal(as_bytes(a), as_bytes(b)), f"{name} differs from vLLM's kernel"


@pytest.mark.parametrize("is_neox", [True, False])
def test_bit_equal_to_vllm(vllm_indexer_q, device, is_neox):
    if device.type == "cpu" and kernel_fuses_fma():
        pytest.skip("this interpreter fuses the kernel's tl.fma but not the products vLLM's "
                    "kernel leaves to the compiler: it stands for no GPU build")
    check_bit_equal_to_vllm(vllm_indexer_q, device, 3, 64, is_neox, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 256, 1027])
@pytest.mark.parametrize("heads", [64, 32])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("cs_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bit_equal_to_vllm_gpu(vllm_indexer_q, tokens, heads, is_neox, cs_dtype):
    """At 1027 tokens the three seeds hold ~10 fp8 bytes that differ between
    the fused and the unfused RoPE (the reference's two forms, counted on the
    CPU): there equality tells the fused products apart."""
    for seed in range(3):
        check_bit_equal_to_vllm(vllm_indexer_q, torch.device("cuda"), tokens, heads, is_neox,
                                seed=seed * 1000 + tokens, cs_dtype=cs_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
def test_every_shape_bit_equal_to_vllm_gpu(vllm_indexer_q, shape, is_neox):
    for seed in range(3):
        check_bit_equal_to_vllm(vllm_indexer_q, torch.device("cuda"), 1027, 64, is_neox,
                                seed=seed * 1000 + 7, shape=shape)
