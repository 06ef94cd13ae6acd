"""Shared pytest setup.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, i.e. when
``taps_kernels.triton`` is first imported; conftest runs before any test module imports
``taps_kernels``, so this is the one place to switch the interpreter on for CPU-only machines.
On a CUDA machine the kernels compile for the GPU instead and the variable is left alone.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_thread():
    # The tests use tiny matmuls: extra threads only add contention on shared 2-core machines.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
