"""The query-preparation patch on vLLM 0.33.0's DeepSeek-V3.2 attention layer:
the registry installs it on the module global the layer calls, its signature
is vLLM's, and it dispatches: the project's kernel where it serves and takes
the call, vLLM's ``fused_q`` (with the same arguments) everywhere else."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from query_checks import FUSED_Q_ARGS, Recorder, as_bytes, fused_q_args, fused_q_inputs
from vllm_dsa_varlen import patches
from vllm_dsa_varlen.ops import triton_fused_q
from vllm_dsa_varlen.vllm_0_33.models.deepseek_v32 import attention as ours


pytestmark = pytest.mark.usefixtures("clean_plugin")

V32 = "vllm.models.deepseek_v32.attention"


def _call(fn, inp, **kw):
    return fn(*fused_q_args(inp), **kw)


def test_the_registry_installs_it_on_the_layers_global_and_undoes_it():
    mod = importlib.import_module(V32)
    stock = mod.fused_q
    patches.apply_all()
    assert mod.fused_q is not stock
    assert mod.fused_q.__vllm_dsa_varlen_original__ is stock
    patches.undo_all()
    assert mod.fused_q is stock


def test_signature_is_vllms():
    mod = importlib.import_module(V32)
    stock = inspect.signature(mod.fused_q)
    mine = inspect.signature(ours.make_fused_q(mod.fused_q, serves=True, use_pdl=False))
    assert list(mine.parameters) == list(stock.parameters)
    for name, p in stock.parameters.items():
        assert mine.parameters[name].default == p.default, name


@pytest.mark.parametrize("interleave,quantize_mqa", [(False, False), (True, True)])
def test_serving_calls_take_the_projects_kernel(device, interleave, quantize_mqa):
    rec = Recorder()
    fn = ours.make_fused_q(rec, serves=True, use_pdl=False)
    inp = fused_q_inputs(3, 16, 64, device=device, seed=2)
    got = _call(fn, inp, index_rope_interleave=interleave, quantize_mqa=quantize_mqa)
    want = triton_fused_q.fused_q(**inp, index_rope_interleave=interleave, quantize_mqa=quantize_mqa)
    assert rec.calls == []
    for a, b in zip(got, want):
        assert torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.parametrize("case", ["not serving", "no indexer", "int32 positions", "odd rope dim"])
def test_every_other_call_is_vllms_with_the_same_arguments(device, case):
    rec = Recorder()
    fn = ours.make_fused_q(rec, serves=case != "not serving", use_pdl=False)
    inp = fused_q_inputs(2, 16, 64, device=device, seed=4)
    kw = dict(has_indexer=case != "no indexer", index_rope_interleave=True, quantize_mqa=False)
    if case == "int32 positions":
        inp["positions"] = inp["positions"].int()
    if case == "odd rope dim":
        inp["q_pe"] = inp["q_pe"][..., :48]
        inp["q_pe_cos_sin_cache"] = inp["q_pe_cos_sin_cache"][:, :48].contiguous()
    assert _call(fn, inp, **kw) == "vllm's"
    (args, kwargs), = rec.calls
    assert len(args) == len(FUSED_Q_ARGS) and all(a is inp[k] for a, k in zip(args, FUSED_Q_ARGS))
    assert kwargs == kw


def test_the_factory_decides_once_and_logs_it(device, caplog, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(ours, "_platform", lambda: (True, (9, 0), False))
    with caplog.at_level("INFO", logger="vllm.dsa_varlen"):
        fn = ours.wrap_fused_q(rec)
    assert "the project's kernel (sm_90" in caplog.text
    monkeypatch.setenv("DSA_VARLEN_FUSED_Q", "off")
    caplog.clear()
    with caplog.at_level("INFO", logger="vllm.dsa_varlen"):
        off = ours.wrap_fused_q(rec)
    assert "DSA_VARLEN_FUSED_Q=off" in caplog.text
    inp = fused_q_inputs(1, 16, 64, device=device, seed=1)
    assert _call(off, inp) == "vllm's" and len(rec.calls) == 1
    assert _call(fn, inp) != "vllm's" and len(rec.calls) == 1


def test_on_this_machine_the_decision_is_the_platforms():
    is_cuda, capability, _ = ours._platform()
    serves, why = __import__("vllm_dsa_varlen.config", fromlist=["x"]).choose_fused_q(
        is_cuda=is_cuda, capability=capability)
    assert serves == (is_cuda and capability is not None and capability[0] == 9), why


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_mqa", [False, True])
def test_traced_by_torch_compile_like_vllms(monkeypatch, quantize_mqa):
    """The layer's call, compiled as vLLM compiles the model (whole graph,
    ``dynamic=False``, the token dim marked dynamic), launches the same
    kernel: the fp8 indexer query and the MLA query bytes equal to eager.
    Compiled, the float scales reach both kernels as Inductor passes them and
    some weights round otherwise than eager (H200, torch 2.11: ~1.4 % of
    them, vLLM's kernel alike), so the weights are compared with vLLM's own
    ``fused_q`` compiled the same way (with the bf16 query, its MLA query
    too)."""
    from vllm.models.deepseek_v32.common import kernels
    from vllm.models.deepseek_v32.nvidia.ops import fused_q_cutedsl

    # vLLM 0.34's fused_q asks functools.cache'd platform queries (whether its
    # SM100 CuTeDSL kernel serves, whether the GPU takes PDL), which a lone
    # layer's fullgraph compile cannot trace: the same answers, in Python.
    assert not fused_q_cutedsl.current_platform.has_device_capability(100)
    monkeypatch.setattr(fused_q_cutedsl, "is_fused_q_cutedsl_supported", lambda *a, **k: False)
    platform = getattr(kernels, "current_platform", None)
    if platform is not None and hasattr(platform, "is_arch_support_pdl"):
        pdl = bool(platform.is_arch_support_pdl())
        monkeypatch.setattr(platform, "is_arch_support_pdl", lambda *a: pdl)
    rec = Recorder()
    fn = ours.make_fused_q(rec, serves=True, use_pdl=True)
    dev = torch.device("cuda")
    base = fused_q_inputs(4, 64, 64, device=dev, seed=9)

    def layer(positions, q, index_q, kw, ql, impl=fn):
        return impl(positions, q[..., 128:], base["q_pe_cos_sin_cache"], index_q,
                    base["index_q_cos_sin_cache"], ql.transpose(0, 1), base["q_scale"], kw[:, 128:],
                    0.088, 0.125, has_indexer=True, index_rope_interleave=False,
                    quantize_mqa=quantize_mqa)

    def stock_layer(*args):
        return layer(*args, impl=kernels.fused_q)

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    stock = torch.compile(stock_layer, fullgraph=True, dynamic=False)
    gen = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**31, ()).item()))
    for t in (3, 17, 256):
        args = (torch.randint(0, 4096, (t,), device=dev, generator=gen),
                torch.randn(t, 64, 192, device=dev, generator=gen).bfloat16(),
                torch.randn(t, 64, 128, device=dev, generator=gen).bfloat16(),
                torch.randn(t, 192, device=dev, generator=gen).bfloat16(),
                torch.randn(64, t, 512, device=dev, generator=gen).bfloat16())
        for a, dim in zip(args, (0, 0, 0, 0, 1)):  # vLLM marks the token dim dynamic
            torch._dynamo.mark_dynamic(a, dim)
        got, eager, want = compiled(*args), layer(*args), stock(*args)
        same = [torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(got, eager)]
        assert same[0] and same[2], "compiled, the project's kernel gave other bytes than eager"
        assert torch.equal(as_bytes(got[1]), as_bytes(want[1])), \
            "the weights differ from vLLM's compiled fused_q's"
        if not quantize_mqa:
            assert torch.equal(as_bytes(got[2]), as_bytes(want[2]))
    assert rec.calls == []
