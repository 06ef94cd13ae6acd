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


@pytest.fixture(autouse=True)
def _restore_grad_mode():
    # Benchmark mains run in-process by smoke tests switch autograd off for their whole run; a test must
    # never leave that switch to the tests after it.
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)
