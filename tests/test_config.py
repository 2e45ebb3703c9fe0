"""Decision table of :func:`vllm_dsa_varlen.config.choose_decode_path` and the env parsing."""

import itertools

import pytest

from vllm_dsa_varlen.config import (
    BACKEND_ENV,
    MODE_ENV,
    DeepGemmCaps,
    choose_decode_path,
    read_backend,
    read_mode,
)

DG_VARLEN = DeepGemmCaps(paged_indices=True, metadata_indices=True, paged_clean_logits=False,
                         prefill_clean_logits=False, prefill_max_seqlen_k=True)  # 2.8.x
# The DeepGEMM 2.6.1 vLLM 0.27.1 vendors: clean_logits *and* indices on both functions.
DG_VENDORED = DeepGemmCaps(paged_indices=True, metadata_indices=True, prefill_max_seqlen_k=True)
DG_OLD = DeepGemmCaps()  # a DeepGEMM without run ids (clean_logits, fp32 logits)
DG_HALF = DeepGemmCaps(paged_indices=True, metadata_indices=False)  # kernel only

SM100, SM90, SM89, SM80, SM120 = (10, 0), (9, 0), (8, 9), (8, 0), (12, 0)


def decide(**kw):
    base = dict(is_cuda=True, capability=SM90, deepgemm=DG_OLD, triton_ok=True, next_n=2,
                fp4_cache=False, mode="auto", backend="auto")
    base.update(kw)
    return choose_decode_path(**base)


# (kwargs, expected (use_varlen, backend, warning, per_step), a word the reason must contain)
TABLE = [
    (dict(mode="off", capability=SM100, deepgemm=DG_VARLEN), (False, None, False, None), "off"),
    (dict(is_cuda=False, capability=None), (False, None, False, None), "CUDA"),
    (dict(capability=None), (False, None, False, None), "capability"),
    (dict(capability=SM100, deepgemm=DG_VARLEN, next_n=1), (True, "deepgemm", False, None),
     "sm_100"),
    (dict(capability=SM100, deepgemm=DG_VARLEN, next_n=4), (True, "deepgemm", False, None),
     "run ids"),
    (dict(capability=SM100, deepgemm=DG_VARLEN, next_n=4, fp4_cache=True),
     (True, "deepgemm", False, None), "MXFP4"),
    (dict(capability=(10, 3), deepgemm=DG_VARLEN, next_n=2), (True, "deepgemm", False, None),
     "sm_103"),
    # A default B200 install: vLLM 0.27.1's vendored DeepGEMM takes ids -> DeepGEMM varlen.
    (dict(capability=SM100, deepgemm=DG_VENDORED, next_n=1), (True, "deepgemm", False, None),
     "run ids"),
    (dict(capability=SM100, deepgemm=DG_VENDORED, next_n=3), (True, "deepgemm", False, None),
     "FP8"),
    (dict(capability=SM100, deepgemm=DG_VENDORED, next_n=3, fp4_cache=True),
     (True, "deepgemm", False, None), "MXFP4"),
    # SM100 without a DeepGEMM that takes ids: stock runs native [B, next_n] on uniform
    # steps, so Triton only takes the steps stock would split.
    (dict(capability=SM100, deepgemm=DG_OLD, next_n=3), (True, "triton", False, "split"),
     "splits"),
    (dict(capability=SM100, deepgemm=DG_HALF, next_n=2), (True, "triton", False, "split"),
     "Triton"),
    (dict(capability=SM100, deepgemm=DG_OLD, next_n=1), (False, None, False, None),
     "next_n == 1"),
    (dict(capability=SM100, deepgemm=DG_OLD, next_n=3, fp4_cache=True),
     (False, None, False, None), "MXFP4"),
    (dict(capability=SM100, deepgemm=None, next_n=3, fp4_cache=True), (False, None, False, None),
     "not installed"),
    # Hopper / Ada / Blackwell consumer: DeepGEMM varlen never.  next_n > 2: stock
    # flattens, compared per step; next_n == 2: stock's native kernel on uniform steps,
    # Triton on the steps stock splits; no DeepGEMM at all: Triton every step.
    (dict(capability=SM90, deepgemm=DG_VARLEN, next_n=3), (True, "triton", False, "flattened"),
     "sm_90"),
    (dict(capability=SM90, deepgemm=DG_VENDORED, next_n=4),
     (True, "triton", False, "flattened"), "flattens"),
    (dict(capability=SM90, deepgemm=DG_VARLEN, next_n=2), (True, "triton", False, "split"),
     "splits"),
    (dict(capability=SM90, deepgemm=None, next_n=2), (True, "triton", False, None),
     "no DeepGEMM"),
    (dict(capability=SM90, deepgemm=None, next_n=4), (True, "triton", False, None),
     "no DeepGEMM"),
    (dict(capability=SM90, backend="triton", next_n=2), (True, "triton", False, None), "forced"),
    (dict(capability=SM90, deepgemm=DG_VARLEN, next_n=1), (False, None, False, None),
     "next_n == 1"),
    (dict(capability=SM89, next_n=4), (True, "triton", False, "flattened"), "sm_89"),
    (dict(capability=SM120, next_n=4), (True, "triton", False, "flattened"), "sm_120"),
    (dict(capability=SM80, next_n=4), (False, None, False, None), "fp8"),
    (dict(capability=SM90, next_n=4, triton_ok=False), (False, None, False, None),
     "kernel is unavailable"),
    # Forced backends.
    (dict(capability=SM90, backend="deepgemm", deepgemm=DG_VARLEN, next_n=4),
     (False, None, True, None), "SM10x"),
    (dict(capability=SM100, backend="deepgemm", deepgemm=DG_OLD, next_n=4),
     (False, None, True, None), "indices"),
    (dict(capability=SM100, backend="deepgemm", deepgemm=DG_VARLEN, next_n=4),
     (True, "deepgemm", False, None), "run ids"),
    (dict(capability=SM100, backend="triton", deepgemm=DG_VARLEN, next_n=4),
     (True, "triton", False, None), "forced"),
    (dict(capability=SM100, backend="triton", deepgemm=DG_VARLEN, next_n=4, fp4_cache=True),
     (False, None, True, None), "MXFP4"),
    (dict(capability=SM80, backend="triton", next_n=4), (False, None, True, None), "fp8"),
    (dict(capability=SM90, backend="triton", next_n=4, triton_ok=False),
     (False, None, True, None), "kernel is unavailable"),
    (dict(capability=SM90, backend="triton", next_n=1), (False, None, True, None),
     "next_n == 1"),
]


@pytest.mark.parametrize("kwargs,expected,word", TABLE)
def test_decision_table(kwargs, expected, word):
    path = decide(**kwargs)
    assert (path.use_varlen, path.backend, path.warning, path.per_step) == expected
    assert word.lower() in path.reason.lower()
    assert path.describe().startswith("varlen" if path.use_varlen else "stock")


@pytest.mark.parametrize("cap,dg,triton_ok,next_n,fp4,backend", itertools.product(
    [SM80, SM89, SM90, SM100, SM120], [None, DG_OLD, DG_VARLEN], [False, True], [1, 2, 4],
    [False, True], ["auto", "deepgemm", "triton"]))
def test_invariants_over_the_whole_space(cap, dg, triton_ok, next_n, fp4, backend):
    """Properties every decision must have, whatever the inputs."""
    path = decide(capability=cap, deepgemm=dg, triton_ok=triton_ok, next_n=next_n,
                  fp4_cache=fp4, backend=backend)
    assert (path.backend is not None) == path.use_varlen
    assert path.reason
    if path.backend == "deepgemm":
        assert cap[0] == 10 and dg is not None and dg.varlen
    if path.backend == "triton":
        assert not fp4 and cap >= (8, 9) and triton_ok and next_n > 1
    # Per-step comparison exactly where stock has a decode kernel and the
    # Triton backend was not forced; which of stock's paths it is follows stock.
    if path.per_step is not None:
        assert path.backend == "triton" and backend == "auto" and dg is not None
        stock_flattens = cap[0] != 10 and next_n > 2
        assert path.per_step == ("flattened" if stock_flattens else "split")
    elif path.backend == "triton":
        assert backend == "triton" or dg is None
    if fp4:
        assert path.backend != "triton"
    if backend != "auto" and path.use_varlen:
        assert path.backend == backend
    if backend != "auto" and not path.use_varlen:
        assert path.warning
    if backend == "auto":
        assert not path.warning
        # auto never leaves a usable varlen backend unused
        if cap[0] == 10 and dg is not None and dg.varlen:
            assert path.backend == "deepgemm"


def test_off_and_not_cuda_win_over_everything():
    for backend in ("auto", "deepgemm", "triton"):
        assert not decide(mode="off", capability=SM100, deepgemm=DG_VARLEN, backend=backend,
                          next_n=4).use_varlen
        assert not decide(is_cuda=False, capability=SM100, deepgemm=DG_VARLEN, backend=backend,
                          next_n=4).use_varlen


@pytest.mark.parametrize("bad", [dict(mode="on"), dict(backend="cuda"), dict(next_n=0)])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        decide(**bad)


@pytest.mark.parametrize("raw,want", [(None, "auto"), ("", "auto"), ("auto", "auto"),
                                      ("off", "off"), (" OFF ", "off"), ("Auto", "auto"),
                                      ("stock", "stock"), ("Stock ", "stock")])
def test_read_mode(raw, want):
    env = {} if raw is None else {MODE_ENV: raw}
    assert read_mode(env) == want


@pytest.mark.parametrize("raw,want", [(None, "auto"), ("deepgemm", "deepgemm"),
                                      ("Triton", "triton"), ("auto", "auto")])
def test_read_backend(raw, want):
    env = {} if raw is None else {BACKEND_ENV: raw}
    assert read_backend(env) == want


@pytest.mark.parametrize("reader,name,raw", [(read_mode, MODE_ENV, "on"),
                                             (read_mode, MODE_ENV, "1"),
                                             (read_backend, BACKEND_ENV, "cutlass")])
def test_bad_env_values_name_the_variable_and_the_choices(reader, name, raw):
    with pytest.raises(ValueError) as err:
        reader({name: raw})
    msg = str(err.value)
    assert name in msg and repr(raw) in msg and "auto" in msg


def test_readers_use_os_environ(monkeypatch):
    monkeypatch.setenv(MODE_ENV, "off")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert read_mode() == "off" and read_backend() == "triton"


# ---- the query preparation (vLLM 0.33's fused_q, 0.27's indexer query) ------------------------------------

from vllm_dsa_varlen import config  # noqa: E402


def test_fused_q_setting_is_read_and_checked():
    assert config.read_fused_q({}) == "auto"
    assert config.read_fused_q({"VLLM_DSA_VARLEN_FUSED_Q": " OFF "}) == "off"
    assert config.read_fused_q({"VLLM_DSA_VARLEN_FUSED_Q": "on"}) == "on"
    with pytest.raises(ValueError, match="VLLM_DSA_VARLEN_FUSED_Q"):
        config.read_fused_q({"VLLM_DSA_VARLEN_FUSED_Q": "triton"})


@pytest.mark.parametrize("is_cuda,capability,setting,mode,measured,serves", [
    (True, (9, 0), "auto", "auto", True, True),
    (True, (9, 0), "auto", "auto", False, False),  # a kernel not measured faster there
    (True, (9, 0), "on", "auto", False, True),
    (True, (9, 0), "on", "auto", True, True),
    (True, (8, 9), "on", "auto", False, True),
    (True, (10, 0), "on", "auto", True, True),
    (True, (8, 0), "on", "auto", True, False),  # no fp8
    (True, (9, 0), "on", "off", True, False),
    (True, (9, 0), "on", "stock", True, False),
    (False, (9, 0), "on", "auto", True, False),
    (True, (9, 0), "off", "auto", True, False),
    (True, (9, 0), "auto", "off", True, False),
    (True, (9, 0), "auto", "stock", True, False),
    (True, (10, 0), "auto", "auto", True, False),
    (True, (8, 9), "auto", "auto", True, False),
    (True, None, "auto", "auto", True, False),
    (True, None, "on", "auto", True, False),
    (False, (9, 0), "auto", "auto", True, False),
])
def test_choose_fused_q(is_cuda, capability, setting, mode, measured, serves):
    got, why = config.choose_fused_q(is_cuda=is_cuda, capability=capability, setting=setting,
                                     mode=mode, measured=measured)
    assert got is serves and why
    assert why.startswith("the project's kernel") is serves
    if not measured and setting == "auto" and capability == (9, 0):
        assert "not measured" in why and "VLLM_DSA_VARLEN_FUSED_Q=on" in why


def test_choose_fused_q_refuses_unknown_values():
    with pytest.raises(ValueError, match="setting"):
        config.choose_fused_q(is_cuda=True, capability=(9, 0), setting="always")
    with pytest.raises(ValueError, match="mode"):
        config.choose_fused_q(is_cuda=True, capability=(9, 0), mode="fast")


def test_fused_q_blocks_setting():
    assert config.read_fused_q_blocks({}) is None
    assert config.read_fused_q_blocks({"VLLM_DSA_VARLEN_FUSED_Q_BLOCKS": " 8/16/2/2 "}) == (8, 16, 2, 2)
    for bad in ("8/16/2", "8/16/3/2", "a/b/c/d", "0/16/2/2"):
        with pytest.raises(ValueError, match="VLLM_DSA_VARLEN_FUSED_Q_BLOCKS"):
            config.read_fused_q_blocks({"VLLM_DSA_VARLEN_FUSED_Q_BLOCKS": bad})
