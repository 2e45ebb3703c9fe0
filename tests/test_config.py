"""The shared builder-level decisions of :mod:`vllm_dsa_varlen.config` (each
vLLM line's own facts and decision table: the line's indexer tests)."""

import itertools

import pytest

from vllm_dsa_varlen import config
from vllm_dsa_varlen.config import DecodePath, LineFacts, choose_decode_path

SM100, SM90, SM89, SM80 = (10, 0), (9, 0), (8, 9), (8, 0)


def _line(deepgemm_refusal="no DeepGEMM varlen here", stock="stock's words", per_step=None,
          forced_per_step=None, upstream=None):
    asked = []

    def facts(capability):
        asked.append(capability)
        return LineFacts(deepgemm_refusal, stock, per_step, forced_per_step, upstream)

    facts.asked = asked
    return facts


def decide(line=None, **kw):
    base = dict(is_cuda=True, capability=SM90, own_ok=True, next_n=4, fp4_cache=False,
                mode="auto", backend="auto")
    base.update(kw)
    return choose_decode_path(line or _line(), **base)


@pytest.mark.parametrize("kwargs,word", [(dict(mode="off"), "DSA_VARLEN=off"),
                                         (dict(mode="stock"), "DSA_VARLEN=stock"),
                                         (dict(is_cuda=False, capability=None), "CUDA"),
                                         (dict(capability=None), "capability unknown")])
def test_the_platform_refusal_comes_before_the_lines_facts(kwargs, word):
    for backend in config.BACKENDS:
        line = _line(deepgemm_refusal=None, upstream="upstream's own")
        path = decide(line, backend=backend, **kwargs)
        assert not path.use_varlen and not path.warning and word in path.reason
        assert line.asked == []  # the line is asked only about a known device


LINES = [dict(deepgemm_refusal=None), dict(), dict(per_step="flattened"),
         dict(per_step="split", forced_per_step=None),
         dict(per_step="each", forced_per_step="each"), dict(upstream="vLLM runs varlen itself")]


@pytest.mark.parametrize("facts,cap,own_ok,next_n,fp4,backend", itertools.product(
    LINES, [SM80, SM89, SM90, SM100], [False, True], [1, 2, 4], [False, True], config.BACKENDS))
def test_invariants_of_the_shared_decision(facts, cap, own_ok, next_n, fp4, backend):
    """Whatever the line says: upstream varlen is left alone; DeepGEMM varlen
    the plugin drives wins unless ``own`` is forced; the project's kernels
    never take the MXFP4 cache, a GPU without fp8, a cache they do not serve
    or one-token steps; a forced backend that cannot run warns; the per-step
    kind is the line's (its forced one under ``own``)."""
    path = decide(_line(**facts), capability=cap, own_ok=own_ok, next_n=next_n, fp4_cache=fp4,
                  backend=backend)
    assert path.reason and (path.backend is not None) == path.use_varlen
    assert path.describe().startswith("varlen" if path.use_varlen else "stock")
    if facts.get("upstream"):
        assert not path.use_varlen and facts["upstream"] in path.reason
        assert path.warning is (backend != "auto")
        return
    if facts.get("deepgemm_refusal", "x") is None and backend != "own":
        assert path.backend == "deepgemm" and not path.warning and path.per_step is None
        return
    if backend == "deepgemm":
        assert not path.use_varlen and path.warning and "deepgemm but" in path.reason
        return
    can = not fp4 and cap >= config.MIN_FP8_CAPABILITY and own_ok and next_n > 1
    assert path.use_varlen is can
    if can:
        assert path.backend == "own" and not path.warning
        want = facts.get("forced_per_step") if backend == "own" else facts.get("per_step")
        assert path.per_step == want
    else:
        assert path.warning is (backend == "own")
        assert ("own but" in path.reason) is (backend == "own")


def test_bad_arguments_raise():
    for bad in (dict(mode="on"), dict(backend="triton"), dict(backend="cuda"), dict(next_n=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            decide(**bad)


@pytest.mark.parametrize("kernel,label", [("cuda_sm90", "varlen (cuda_sm90)"),
                                          ("portable", "varlen (portable Triton)"),
                                          (None, "varlen (the project's kernels)")])
def test_the_line_names_the_kernel_that_runs(kernel, label):
    path = DecodePath(True, "own", "why", kernel=kernel)
    assert path.describe() == f"{label}: why"
    assert DecodePath(True, "deepgemm", "why").describe() == "varlen (DeepGEMM): why"
    assert DecodePath(False, None, "why").describe() == "stock: why"


@pytest.mark.parametrize("page,head_size,heads,serves", [
    (64, 132, 64, True), (64, 132, 32, True), (64, 132, None, True),  # DeepSeek V3.2's cache
    (16, 132, 64, False), (None, 132, 64, False), (64, 68, 64, False), (64, None, 64, False),
    (64, 132, 16, False), (64, 132, 128, False)])
def test_own_kernel_serves_the_indexer_caches_of_its_kernels(page, head_size, heads, serves):
    """Pages of 64 entries of 128 fp8 values and a float32 scale, 32 or 64
    index heads (unknown: taken)."""
    assert config.own_kernel_serves(page=page, head_size=head_size, heads=heads) is serves


# ---- the query preparation (vLLM 0.33's fused_q, 0.27's indexer query) -------------------

@pytest.mark.parametrize("is_cuda,capability,setting,mode,serves", [
    (True, (9, 0), "auto", "auto", True),
    (True, (9, 0), "on", "auto", True),
    (True, (8, 9), "on", "auto", True),
    (True, (10, 0), "on", "auto", True),
    (True, (8, 0), "on", "auto", False),  # no fp8
    (True, (9, 0), "on", "off", False),
    (True, (9, 0), "on", "stock", False),
    (False, (9, 0), "on", "auto", False),
    (True, (9, 0), "off", "auto", False),
    (True, (9, 0), "auto", "off", False),
    (True, (9, 0), "auto", "stock", False),
    (True, (10, 0), "auto", "auto", False),
    (True, (8, 9), "auto", "auto", False),
    (True, None, "auto", "auto", False),
    (True, None, "on", "auto", False),
    (False, (9, 0), "auto", "auto", False),
])
def test_choose_fused_q(is_cuda, capability, setting, mode, serves):
    got, why = config.choose_fused_q(is_cuda=is_cuda, capability=capability, setting=setting,
                                     mode=mode)
    assert got is serves and why
    assert why.startswith("the project's kernel") is serves


def test_choose_fused_q_refuses_unknown_values():
    with pytest.raises(ValueError, match="setting"):
        config.choose_fused_q(is_cuda=True, capability=(9, 0), setting="always")
    with pytest.raises(ValueError, match="mode"):
        config.choose_fused_q(is_cuda=True, capability=(9, 0), mode="fast")
