"""The indexer-query patch on vLLM 0.27.1's DeepSeek-V3.2 indexer: the registry
installs it on the module global the indexer calls, its signature is vLLM's,
and it dispatches: the project's kernel where it serves and takes the call,
vLLM's ``fused_indexer_q_rope_quant`` (with the same arguments) everywhere
else."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from query_checks import INDEXER_Q_ARGS, Recorder, as_bytes, indexer_q_args, indexer_q_inputs
from vllm_dsa_varlen import config, patches
from vllm_dsa_varlen.ops import triton_indexer_q
from vllm_dsa_varlen.vllm_0_27.model_executor.models import deepseek_v2 as ours

pytestmark = pytest.mark.usefixtures("clean_plugin")

V2 = "vllm.model_executor.models.deepseek_v2"


def test_the_registry_installs_it_on_the_indexers_global_and_undoes_it():
    mod = importlib.import_module(V2)
    stock = mod.fused_indexer_q_rope_quant
    patches.apply_all()
    assert mod.fused_indexer_q_rope_quant is not stock
    assert mod.fused_indexer_q_rope_quant.__vllm_dsa_varlen_original__ is stock
    patches.undo_all()
    assert mod.fused_indexer_q_rope_quant is stock


def test_signature_is_vllms():
    mod = importlib.import_module(V2)
    stock = inspect.signature(mod.fused_indexer_q_rope_quant)
    mine = inspect.signature(ours.make_fused_indexer_q_rope_quant(mod.fused_indexer_q_rope_quant,
                                                                  serves=True))
    assert list(mine.parameters) == list(stock.parameters)
    for name, p in stock.parameters.items():
        assert mine.parameters[name].default == p.default, name


@pytest.mark.parametrize("is_neox", [True, False])
def test_serving_calls_take_the_projects_kernel(device, is_neox):
    rec = Recorder()
    fn = ours.make_fused_indexer_q_rope_quant(rec, serves=True, heads=8, warps=2)
    inp = indexer_q_inputs(3, 32, device=device, seed=2)
    got = fn(*indexer_q_args(inp, is_neox))
    want = triton_indexer_q.indexer_q(*indexer_q_args(inp, is_neox))
    assert rec.calls == []
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.parametrize("case", ["not serving", "float32 q", "int16 positions", "96-dim q"])
def test_every_other_call_is_vllms_with_the_same_arguments(device, case):
    rec = Recorder()
    fn = ours.make_fused_indexer_q_rope_quant(rec, serves=case != "not serving")
    inp = indexer_q_inputs(2, 16, device=device, seed=4)
    if case == "float32 q":
        inp["q"] = inp["q"].float()
    if case == "int16 positions":
        inp["positions"] = inp["positions"].short()
    if case == "96-dim q":
        inp["q"] = inp["q"][..., :96]
    assert fn(*indexer_q_args(inp, False)) == "vllm's"
    (args, kwargs), = rec.calls
    assert kwargs == {} and args[-1] is False
    assert len(args) == len(INDEXER_Q_ARGS) + 1
    assert all(a is inp[k] for a, k in zip(args, INDEXER_Q_ARGS))


def test_the_factory_decides_once_and_logs_it(device, plugin_log, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(ours, "_platform", lambda: (True, (9, 0)))
    inp = indexer_q_inputs(1, 16, device=device, seed=1)

    def logged():
        text = " | ".join(r.getMessage() for r in plugin_log)
        plugin_log.clear()
        return text

    monkeypatch.setenv("DSA_VARLEN_FUSED_Q", "off")
    off = ours.wrap_fused_indexer_q_rope_quant(rec)
    assert "vLLM's kernel (DSA_VARLEN_FUSED_Q=off)" in logged()
    assert off(*indexer_q_args(inp, True)) == "vllm's" and len(rec.calls) == 1
    monkeypatch.delenv("DSA_VARLEN_FUSED_Q")
    auto = ours.wrap_fused_indexer_q_rope_quant(rec)
    assert "the project's kernel (sm_90" in logged()
    assert auto(*indexer_q_args(inp, True)) != "vllm's" and len(rec.calls) == 1
    monkeypatch.setenv("DSA_VARLEN_FUSED_Q", "on")
    monkeypatch.setenv("DSA_VARLEN_FUSED_Q_BLOCKS", "8/16/2/2")
    on = ours.wrap_fused_indexer_q_rope_quant(rec)
    text = logged()
    assert "the project's kernel (sm_90" in text and "8 heads per program, 2 warps" in text
    assert on(*indexer_q_args(inp, True)) != "vllm's" and len(rec.calls) == 1
    monkeypatch.setenv("DSA_VARLEN", "off")
    assert ours.wrap_fused_indexer_q_rope_quant(rec)(*indexer_q_args(inp, True)) == "vllm's"
    assert "DSA_VARLEN=off" in logged()


def test_auto_takes_the_measured_kernel_on_sm90_only():
    """``auto`` serves with the project's kernel on sm_90, where it was
    measured, and keeps vLLM's elsewhere."""
    for capability, serves in (((9, 0), True), ((10, 0), False), ((8, 9), False)):
        got, why = config.choose_fused_q(is_cuda=True, capability=capability)
        assert got is serves, why


def test_on_this_machine_the_decision_is_the_platforms(monkeypatch):
    monkeypatch.setenv("DSA_VARLEN_FUSED_Q", "on")
    is_cuda, capability = ours._platform()
    serves, why = config.choose_fused_q(is_cuda=is_cuda, capability=capability, setting="on")
    assert serves == (is_cuda and capability is not None and capability >= (8, 9)), why


@pytest.mark.gpu
def test_traced_by_torch_compile_like_vllms():
    """The indexer's call, compiled as vLLM compiles the model (whole graph,
    ``dynamic=False``, the token dim marked dynamic), launches the same
    kernel: the fp8 query's bytes equal to eager and to vLLM's own function
    compiled the same way.  Compiled, the float scales reach the kernel as
    Inductor passes them and some weights round otherwise than eager (H200,
    torch 2.11; vLLM 0.33's query kernel alike), so the weights are compared
    with vLLM's function compiled the same way."""
    from vllm.model_executor.layers.sparse_attn_indexer import fused_indexer_q_rope_quant

    rec = Recorder()
    fn = ours.make_fused_indexer_q_rope_quant(rec, serves=True)
    dev = torch.device("cuda")
    base = indexer_q_inputs(4, device=dev, seed=9)

    def layer(positions, q, kw, impl=fn):
        return impl(positions, q.view(q.shape[0], 64, 128), base["cos_sin_cache"], kw[:, 128:],
                    0.088, 0.125, True)

    def stock_layer(*args):
        return layer(*args, impl=fused_indexer_q_rope_quant)

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    stock = torch.compile(stock_layer, fullgraph=True, dynamic=False)
    gen = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**31, ()).item()))
    for t in (3, 17, 256):
        args = (torch.randint(0, 4096, (t,), device=dev, generator=gen),
                torch.randn(t, 64 * 128, device=dev, generator=gen).bfloat16(),
                torch.randn(t, 192, device=dev, generator=gen).bfloat16())
        for a in args:  # vLLM marks the token dim of its inputs dynamic
            torch._dynamo.mark_dynamic(a, 0)
        got, eager, want = compiled(*args), layer(*args), stock(*args)
        assert torch.equal(as_bytes(got[0]), as_bytes(eager[0])), "compiled, other q bytes than eager"
        for a, c in zip(got, want):
            assert torch.equal(as_bytes(a), as_bytes(c)), "other bytes than vLLM's, compiled"
    assert rec.calls == []
