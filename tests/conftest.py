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
