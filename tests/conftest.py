"""Shared test set-up.

Without a CUDA GPU the Triton kernels run in Triton's interpreter: the variable
must be set before ``triton`` is first imported, so it is set here.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_FP8_GPU = HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with fp8 support")
    for item in items:
        if "gpu" in item.keywords and not HAS_FP8_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    """The device kernel tests run on: CUDA when present, else the CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def clean_plugin(monkeypatch):
    """The plugin's env unset and its patch registry undone, before and after."""
    from vllm_dsa_varlen import config, patches

    monkeypatch.delenv(config.MODE_ENV, raising=False)
    monkeypatch.delenv(config.BACKEND_ENV, raising=False)
    patches.undo_all()
    yield
    patches.undo_all()


@pytest.fixture
def plugin_log(monkeypatch):
    """Records of the plugin's logger from DEBUG up (vLLM's 'vllm' logger does not
    propagate), with the builder's log-once memory reset for the test."""
    import importlib.util
    import logging

    if importlib.util.find_spec("vllm") is not None:  # the builder patch imports vLLM
        from vllm_dsa_varlen.vllm_0_27.v1.attention.backends.mla import indexer as ours

        monkeypatch.setattr(ours, "_logged", set())
    records = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("vllm.dsa_varlen")
    handler, level = _Keep(level=logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield records
    log.removeHandler(handler)
    log.setLevel(level)
