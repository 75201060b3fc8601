"""Fixtures shared by the test files.

`emu`: a fresh emulated device type "emu" (indices 0 and 1) registered for one test, whose
work runs synchronously with the host. `emu_async`: the same, but its device work runs as a
GPU's does — queued on simulated streams and run only when the host waits — so a missing
host wait gives a wrong answer (runtime/devices/simulated.py).

Every `cuda` test runs with TF32 off (`full_fp32`, which a test on the CPU may name too).

`fresh`: no kernel decisions (ferry/choices/decisions.py) carried over from other tests. `timed`: any
device counts as a GPU and the timing of a kernel choice is faked: `timed.times` are the
(eager µs, alternative µs) it returns, `timed.calls` counts the measurements. `count_calls(module,
name)`: `module.name` wrapped for one test; returns the list of each call's positional arguments.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ferry.choices import timing as kernel_timing
from ferry.choices.decisions import DECISIONS
from ferry.runtime import emulated_device


@pytest.fixture
def emu():
    with emulated_device(num_devices=2) as allocator:
        yield allocator


@pytest.fixture(params=["oldest stream first", "newest stream first"])
def emu_async(request):
    """The asynchronous device, once with each order of running streams that could both run:
    a missing wait between two streams gives a wrong answer in one of the two."""
    with emulated_device(num_devices=2, asynchronous=True) as allocator:
        allocator.streams_api().newest_first = request.param == "newest stream first"
        yield allocator


@pytest.fixture(params=["sync", "async"])
def emu_any(request):
    """Both: a test using it runs once with each execution model."""
    with emulated_device(num_devices=2, asynchronous=request.param == "async") as allocator:
        yield allocator


@contextlib.contextmanager
def _no_tf32():
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev


@pytest.fixture
def full_fp32():
    """Compare against eager float32 on the CPU: no TF32 shortcuts on the GPU."""
    with _no_tf32():
        yield


@pytest.fixture(autouse=True)
def cuda_tests_in_full_fp32(request):
    """Every `cuda` test starts with TF32 off, whatever an earlier test in the process left:
    torchao's `quantize_` turns it on for the whole process (`set_float32_matmul_precision("high")`),
    and a float32 result compared with the CPU's then differs by TF32's rounding. A test that
    wants TF32 sets it itself."""
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    with _no_tf32():
        yield


@pytest.fixture
def fresh():
    """No kernel decision of an earlier test: the one cache (ferry.choices.decisions) emptied."""
    DECISIONS.forget()
    yield
    DECISIONS.forget()


@pytest.fixture
def timed(monkeypatch, fresh):
    class Timer:
        times, calls, rooms = (100.0, 40.0), 0, []

        def __call__(self, eager, other, stream=None, room=None):
            eager(), other()  # both are run, as the real timing does
            Timer.calls += 1
            Timer.rooms.append(room)
            return Timer.times

    monkeypatch.setattr(kernel_timing, "gpu_of", lambda operands, device=None: device or kernel_timing.real_device(operands))
    monkeypatch.setattr(kernel_timing, "on", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(kernel_timing, "time_both", Timer())
    Timer.rooms = []
    return Timer


@pytest.fixture
def count_calls(monkeypatch):
    def patch(module, name: str) -> list:
        calls, real = [], getattr(module, name)

        def counted(*args, **kwargs):
            calls.append(args)
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
        return calls
    return patch
