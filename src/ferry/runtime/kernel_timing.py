"""Timing two ways of running one op on the GPU a method loads on, and remembering the faster.

Shared by the kernel choices made at load (runtime/gemm_choice.py, attention_choice.py,
conv_choice.py).
Each choice is timed once per key (shapes, strides, dtype and the settings that change the kernels
underneath), only while a method loads (`measure`), never while a CUDA graph is being captured
(no host waits there), and on scratch tensors filled with a constant: planned memory is never
written and the caller's random streams stay as they were. One lock for all: concurrent loads
would otherwise time each other's kernels, and graph captures hold it too (runtime/graphs.py): a
host wait or an allocation of the timing while another thread captures would break its capture.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
from collections.abc import Callable

import torch

__all__ = ["Choices", "captured_plan", "capturing", "device_of", "faster", "gpu_of", "in_captured_plan", "on",
           "real_device", "scratch", "time_both"]

KEEP_IF_ABOVE = 0.9  # the alternative's time over eager's: above this, eager's kernel stays
MIN_SAVING_US = 2.0  # about what a second launch costs the host
_QUEUE_CYCLES = 500_000  # GPU cycles (about 0.25 ms on an H200) the GPU waits while a timed run is queued
_MAX_QUEUE_CYCLES = _QUEUE_CYCLES * 4**4  # about 64 ms: a host slower than that times at its pace
LOCK = threading.RLock()  # re-entrant: a graph capture holds it, and a plan bound inside may ask for decisions
_captured = contextvars.ContextVar("ferry_captured_plan", default=False)


@contextlib.contextmanager
def captured_plan(captured: bool):
    """While a plan that runs as CUDA graphs is bound (`captured`), and the delegates it loads
    meanwhile: they run inside its graphs, though bound as plans of their own."""
    if not captured:
        yield
        return
    token = _captured.set(True)
    try:
        yield
    finally:
        _captured.reset(token)


def in_captured_plan() -> bool:
    return _captured.get()


def faster(eager_us: float, other_us: float) -> bool:
    """The alternative is kept only where it saves at least 10% and 2 µs."""
    return other_us <= KEEP_IF_ABOVE * eager_us and eager_us - other_us >= MIN_SAVING_US


class Choices:
    """Decisions by key, made once: `get` times where the key is new, a method is loading and no
    graph is being captured; otherwise it returns what was measured before (or None)."""

    def __init__(self) -> None:
        self.decided: dict[tuple, object] = {}

    def get(self, key: tuple, device: torch.device, measure: bool, decide: Callable[[], object]):
        with LOCK:
            if key not in self.decided and measure and not capturing(device):
                self.decided[key] = decide()
            return self.decided.get(key)

    def values(self) -> list:
        with LOCK:
            return [d for d in self.decided.values() if d is not None]


def gpu_of(operands, device: torch.device | None = None) -> torch.device | None:
    """The CUDA device the operands are on (`device` where the caller knows it: every operand
    may be a meta tensor), or None."""
    device = device_of(operands, device)
    return device if device is not None and device.type == "cuda" else None


def device_of(operands, device: torch.device | None = None) -> torch.device | None:
    return device or real_device(operands)


def real_device(operands) -> torch.device | None:
    """The one device of the real tensors among `operands` (meta ones take theirs), or None."""
    real = {t.device for t in operands if t.device.type != "meta"}
    return next(iter(real)) if len(real) == 1 else None


def capturing(device: torch.device) -> bool:
    """A graph is being captured on `device`'s current stream: nothing is timed, or remembered."""
    with on(device):
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def on(device: torch.device):
    return torch.cuda.device(device)


def scratch(t: torch.Tensor, device: torch.device, written: bool = False) -> torch.Tensor:
    """A real operand that is only read, as it is (a weight); a stand-in of the same layout for a
    meta one or the one written. Filled with a constant: the caller's random streams stay as they were."""
    if t.device.type != "meta" and not written:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).fill_(0.5)


def time_both(first: Callable, second: Callable, reps: int = 10, rounds: int = 3) -> tuple[float, float]:
    """The GPU time of each (µs per call, the best of `rounds` runs of `reps` calls), the two
    taken in turn. Each run is queued behind a kernel that keeps the GPU busy, so the events time
    the kernels back to back, not how fast Python launches them. Where the GPU had finished that
    wait before the host had queued the whole run (its start event already done), the run is
    timed again behind a longer wait: a composed form of many small launches would otherwise be
    timed at the host's pace."""
    best = [math.inf, math.inf]
    for fn in (first, second) * 3:  # warm-up: kernels loaded, cuBLAS's workspace made
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = _QUEUE_CYCLES
    for _ in range(rounds):
        for i, fn in enumerate((first, second)):
            while True:
                torch.cuda._sleep(cycles)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                queued_in_time = not start.query()  # the GPU still in its wait: nothing ran yet
                end.synchronize()
                if queued_in_time or cycles >= _MAX_QUEUE_CYCLES:
                    break
                cycles *= 4
            best[i] = min(best[i], start.elapsed_time(end) * 1e3 / reps)
    return best[0], best[1]
