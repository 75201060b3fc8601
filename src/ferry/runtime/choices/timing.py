"""Timing two ways of running one op on the GPU a method loads on, and remembering the faster.

Shared by the kernel choices made at load (runtime/choices/gemm.py, attention_choice.py,
conv_choice.py).
Each choice is timed once per key (shapes, strides, dtype and the settings that change the kernels
underneath), only while a method loads (`measure`), never while a CUDA graph is being captured
(no host waits there), in a plan captured as graphs by replaying graphs of each form (as it will
run), and on scratch tensors filled with a constant: planned memory is never
written and the caller's random streams stay as they were. One lock for all: concurrent loads
would otherwise time each other's kernels, and graph captures hold it too (runtime/devices/graphs.py): a
host wait or an allocation of the timing while another thread captures would break its capture.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
from collections.abc import Callable

import torch

__all__ = ["Choices", "captured_plan", "capturing", "device_of", "faster", "gpu_of", "in_captured_plan",
           "keep_workspace", "on", "real_device", "scratch", "time_both"]

KEEP_IF_ABOVE = 0.9  # the alternative's time over eager's: above this, eager's kernel stays
MIN_SAVING_US = 2.0  # about what a second launch costs the host
_QUEUE_CYCLES = 500_000  # GPU cycles (about 0.25 ms on an H200) the GPU waits while a timed run is queued
_MAX_QUEUE_CYCLES = _QUEUE_CYCLES * 4**4  # about 64 ms: a host slower than that times at its pace
LOCK = threading.RLock()  # re-entrant: a graph capture holds it, and a plan bound inside may ask for decisions
# the CopyStreams of the plan being bound as CUDA graphs (True where it has none), else None
_captured: contextvars.ContextVar[object] = contextvars.ContextVar("ferry_captured_plan", default=None)
_workspace_graphs: dict = {}  # capture stream -> the graph that made its cuBLAS workspace (see keep_workspace)


@contextlib.contextmanager
def captured_plan(captured: bool, streams=None):
    """While a plan that runs as CUDA graphs is bound (`captured`; `streams`: its CopyStreams,
    whose capture streams its graphs are captured on), and the delegates it loads meanwhile: they
    run inside its graphs, though bound as plans of their own, so the outermost plan's streams hold."""
    if not captured or _captured.get() is not None:
        yield
        return
    token = _captured.set(streams if streams is not None else True)
    try:
        yield
    finally:
        _captured.reset(token)


def in_captured_plan() -> bool:
    return _captured.get() is not None


def _replays() -> bool:
    """The plan being bound captures CUDA graphs on streams of its own: choices are timed by replay."""
    return getattr(getattr(_captured.get(), "api", None), "device_type", None) == "cuda"


def _replay_stream():
    """The stream the plan being bound captures the current CUDA device's graphs on, or None."""
    if not _replays():
        return None
    return _captured.get().capture_stream(torch.cuda.current_device())  # type: ignore[attr-defined]


def faster(eager_us: float, other_us: float) -> bool:
    """The alternative is kept only where it saves at least 10% and 2 µs."""
    return other_us <= KEEP_IF_ABOVE * eager_us and eager_us - other_us >= MIN_SAVING_US


class Choices:
    """Decisions by key, made once: `get` times where the key is new, a method is loading and no
    graph is being captured; otherwise it returns what was measured before (or None)."""

    def __init__(self) -> None:
        self.decided: dict[tuple, object] = {}

    def get(self, key: tuple, device: torch.device, measure: bool, decide: Callable[[], object]):
        key = (*key, _replays())  # a replay times a form of many launches faster than a stream does
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
    taken in turn. In a plan captured as CUDA graphs, as its graphs run them: captured on its
    capture stream and replayed (a stream leaves a gap between launches that a replay does not:
    nn.MultiheadAttention composed at ViT-B/16's batch 1, 84.7 µs on a stream, 74.1 replayed).
    Otherwise on the current stream (`_on_stream`)."""
    _warm_up((first, second))
    stream = _replay_stream()
    if stream is None:
        eager_us, other_us = _on_stream((first, second), reps, rounds)
        return eager_us, other_us
    try:
        return _replayed((first, second), stream, reps, rounds)
    except torch.cuda.OutOfMemoryError:
        raise  # the caller's to handle: eager's kernel stays
    except RuntimeError:  # a form that cannot be captured: the plan's capture would fail with it
        torch.cuda.synchronize()
        return _on_stream((first,), reps, rounds)[0], math.inf  # eager's kernel stays


@contextlib.contextmanager
def _on_side_stream(stream):
    """Work on `stream`, ordered after the work queued on the current stream and before its later work."""
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.current_stream().wait_stream(stream)


def _warm_up(fns) -> None:
    for fn in fns * 3:  # kernels loaded, cuBLAS's handles and the current stream's workspace made
        fn()


def _replayed(fns, stream, reps: int, rounds: int) -> tuple[float, float]:
    keep_workspace(stream)
    try:
        with _on_side_stream(stream):
            return _replay_times(fns, reps, rounds)  # its graphs are gone when it returns
    finally:
        # their pool's memory is cached for no one else (a released graph pool is reused by no
        # later capture): handed back, as torch.cuda.graph does before each capture. Without it
        # ResNet-50's reserved peak with graphs rose from 188 to 496 MiB.
        torch.cuda.empty_cache()


def _replay_times(fns, reps: int, rounds: int) -> tuple[float, float]:
    # one pool for the forms: their results are discarded and they replay one after the
    # other, so each may reuse the others' memory (a pool each took a set of segments each:
    # ResNet-50's reserved peak at load +40 MiB)
    graphs = [_capture(fns[0], reps)]
    graphs += [_capture(fn, reps, graphs[0].pool()) for fn in fns[1:]]
    for graph in graphs:
        graph.replay()  # the first replay uploads the graph
    best = [math.inf] * len(graphs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for i, graph in enumerate(graphs):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best[i] = min(best[i], start.elapsed_time(end) * 1e3 / reps)
    return best[0], best[1]


def _capture(fn: Callable, reps: int, pool=None):
    """`reps` calls of `fn` captured on the current stream. Thread-local: a module already loaded
    may run in another thread meanwhile, and its host waits must neither fail nor break this."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        for _ in range(reps):
            fn()
    finally:
        graph.capture_end()
    return graph


def keep_workspace(stream) -> None:
    """Make the cuBLAS workspace of `stream` (one per stream, 32 MiB on an H200) inside a graph
    kept for the life of the process. A graph bakes that workspace's address in; made inside a
    timing graph, it would live in that graph's pool, which is freed after the timing, and
    `torch._C._cuda_clearCublasWorkspaces` (torch.compile's reduce-overhead mode calls it) would
    then hand its memory to anyone while the plan's own graphs still use it. In a kept pool, freed
    memory is reused only by the workspace made again there. Called again before every timing and
    every capture of a plan's graphs (a few µs): the workspace may have been cleared since. One
    pool per capture stream: torch's streams come from a pool of 32 per device."""
    with LOCK, torch.cuda.device(stream.device):
        kept = _workspace_graphs.get(stream)
        a = torch.ones(16, 16, device=stream.device)
        bias = torch.ones(16, device=stream.device)

        def gemms():
            torch.mm(a, a)
            torch.addmm(bias, a, a)  # cublasLt's path, where its workspace is separate

        gemms()  # cuBLAS's handles made first, outside any capture (cublasCreate fails inside one)
        with _on_side_stream(stream):
            graph = _capture(gemms, 1, kept.pool() if kept is not None else None)
        _workspace_graphs[stream] = graph  # the pool lives on in it


def _on_stream(fns, reps: int, rounds: int) -> tuple[float, ...]:
    """Each run is queued behind a kernel that keeps the GPU busy, so the events time the
    kernels back to back, not how fast Python launches them. Where the GPU had finished that
    wait before the host had queued the whole run (its start event already done), the run is
    timed again behind a longer wait: a composed form of many small launches would otherwise be
    timed at the host's pace."""
    best = [math.inf] * len(fns)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = _QUEUE_CYCLES
    for _ in range(rounds):
        for i, fn in enumerate(fns):
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
    return tuple(best)
