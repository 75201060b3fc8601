"""Fixtures shared by the test files.

`emu`: a fresh emulated device type "emu" (indices 0 and 1) registered for one test, whose
work runs synchronously with the host. `emu_async`: the same, but its device work runs as a
GPU's does — queued on simulated streams and run only when the host waits — so a missing
host wait gives a wrong answer (runtime/simulated.py).
"""

from __future__ import annotations

import pytest
import torch

from ferry.runtime import emulated_device


@pytest.fixture
def emu():
    with emulated_device(num_devices=2) as allocator:
        yield allocator


@pytest.fixture
def emu_async():
    with emulated_device(num_devices=2, asynchronous=True) as allocator:
        yield allocator


@pytest.fixture(params=["sync", "async"])
def emu_any(request):
    """Both: a test using it runs once with each execution model."""
    with emulated_device(num_devices=2, asynchronous=request.param == "async") as allocator:
        yield allocator


@pytest.fixture
def full_fp32():
    """Compare against eager float32 on the CPU: no TF32 shortcuts on the GPU."""
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev
