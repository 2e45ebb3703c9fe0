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
                         prefill_clean_logits=False, prefill_max_seqlen_k=True)
DG_OLD = DeepGemmCaps()  # the API vLLM 0.27.1 was built with: no indices
DG_HALF = DeepGemmCaps(paged_indices=True, metadata_indices=False)  # kernel only

SM100, SM90, SM89, SM80, SM120 = (10, 0), (9, 0), (8, 9), (8, 0), (12, 0)


def decide(**kw):
    base = dict(is_cuda=True, capability=SM90, deepgemm=None, triton_ok=True, next_n=2,
                fp4_cache=False, mode="auto", backend="auto")
    base.update(kw)
    return choose_decode_path(**base)


# (kwargs, expected (use_varlen, backend, warning), a word the reason must contain)
TABLE = [
    (dict(mode="off", capability=SM100, deepgemm=DG_VARLEN), (False, None, False), "off"),
    (dict(is_cuda=False, capability=None), (False, None, False), "CUDA"),
    (dict(capability=None), (False, None, False), "capability"),
    (dict(capability=SM100, deepgemm=DG_VARLEN, next_n=1), (True, "deepgemm", False), "sm_100"),
    (dict(capability=SM100, deepgemm=DG_VARLEN, next_n=4), (True, "deepgemm", False), "run ids"),
    (dict(capability=SM100, deepgemm=DG_VARLEN, next_n=4, fp4_cache=True),
     (True, "deepgemm", False), "MXFP4"),
    (dict(capability=(10, 3), deepgemm=DG_VARLEN, next_n=2), (True, "deepgemm", False), "sm_103"),
    # SM100 without a varlen DeepGEMM: Triton when it pays off, else stock.
    (dict(capability=SM100, deepgemm=DG_OLD, next_n=3), (True, "triton", False), "Triton"),
    (dict(capability=SM100, deepgemm=DG_HALF, next_n=3), (True, "triton", False), "Triton"),
    (dict(capability=SM100, deepgemm=DG_OLD, next_n=1), (False, None, False), "next_n == 1"),
    (dict(capability=SM100, deepgemm=DG_OLD, next_n=3, fp4_cache=True), (False, None, False),
     "MXFP4"),
    (dict(capability=SM100, deepgemm=None, next_n=3, fp4_cache=True), (False, None, False),
     "not installed"),
    # Hopper / Ada / Blackwell consumer: DeepGEMM varlen never, Triton for next_n > 2
    # (at next_n == 2 DeepGEMM's native kernel measured faster; forcing works).
    (dict(capability=SM90, deepgemm=DG_VARLEN, next_n=3), (True, "triton", False), "sm_90"),
    (dict(capability=SM90, deepgemm=DG_VARLEN, next_n=2), (False, None, False), "next_n == 2"),
    (dict(capability=SM90, backend="triton", next_n=2), (True, "triton", False), "forced"),
    (dict(capability=SM90, deepgemm=DG_VARLEN, next_n=1), (False, None, False), "next_n == 1"),
    (dict(capability=SM89, next_n=4), (True, "triton", False), "sm_89"),
    (dict(capability=SM120, next_n=4), (True, "triton", False), "sm_120"),
    (dict(capability=SM80, next_n=4), (False, None, False), "fp8"),
    (dict(capability=SM90, next_n=4, triton_ok=False), (False, None, False), "Triton"),
    # Forced backends.
    (dict(capability=SM90, backend="deepgemm", deepgemm=DG_VARLEN, next_n=4),
     (False, None, True), "SM10x"),
    (dict(capability=SM100, backend="deepgemm", deepgemm=DG_OLD, next_n=4),
     (False, None, True), "indices"),
    (dict(capability=SM100, backend="deepgemm", deepgemm=DG_VARLEN, next_n=4),
     (True, "deepgemm", False), "run ids"),
    (dict(capability=SM100, backend="triton", deepgemm=DG_VARLEN, next_n=4),
     (True, "triton", False), "forced"),
    (dict(capability=SM100, backend="triton", deepgemm=DG_VARLEN, next_n=4, fp4_cache=True),
     (False, None, True), "MXFP4"),
    (dict(capability=SM80, backend="triton", next_n=4), (False, None, True), "fp8"),
    (dict(capability=SM90, backend="triton", next_n=4, triton_ok=False), (False, None, True),
     "Triton"),
    (dict(capability=SM90, backend="triton", next_n=1), (False, None, True), "next_n == 1"),
]


@pytest.mark.parametrize("kwargs,expected,word", TABLE)
def test_decision_table(kwargs, expected, word):
    path = decide(**kwargs)
    assert (path.use_varlen, path.backend, path.warning) == expected
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
        assert next_n > 2 or backend == "triton"
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
                                      ("off", "off"), (" OFF ", "off"), ("Auto", "auto")])
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
