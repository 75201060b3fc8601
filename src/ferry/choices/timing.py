"""Timing two ways of running one op on the GPU a method loads on, for the kernel choices made
at load (choices/gemm.py, attention.py, conv.py).

Each choice is timed once per key (shapes, strides, dtype and the settings that change the kernels
underneath), only while a method loads (`Site.measure`), never while a CUDA graph is being captured
(no host waits there), in a plan captured as graphs by replaying graphs of each form (as it will
run), and on scratch tensors filled with a constant: the caller's random streams stay as they
were, and planned memory is written only while nothing lives there (choices/scratch_space.py).
Timing holds the capture lock (ferry/capture.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from ferry.capture import TimingRoom, capture, keep_workspace, on_side_stream
from ferry.choices import scratch_space
from ferry.choices.decisions import Decision, Site

__all__ = ["capturing", "decision", "faster", "gpu_of", "may_time", "on", "real_device", "scratch", "time_both"]

KEEP_IF_ABOVE = 0.9  # the alternative's time over eager's: above this, eager's kernel stays
MIN_SAVING_US = 2.0  # about what a second launch costs the host
_QUEUE_CYCLES = 500_000  # GPU cycles (about 0.25 ms on an H200) the GPU waits while a timed run is queued
_MAX_QUEUE_CYCLES = _QUEUE_CYCLES * 4**4  # about 64 ms: a host slower than that times at its pace


def may_time(site: Site, device: torch.device) -> bool:
    """A new choice may be timed here: a method is loading and no graph is being captured on `device`."""
    return site.measure and not capturing(device)


def decision(family: str, op: str, shape: str, device: torch.device, dtype: torch.dtype, forms: tuple[str, str],
             times: tuple[float, float], min_saving_us: float | None = None,
             keep_if_above: float | None = None) -> Decision:
    """The decision between eager's form (first) and another, timed: the other where `faster`.
    `min_saving_us`: 0 where the other form launches no more kernels than eager's. Left out, the
    margins are this module's, read at the call (tests force a form by setting them)."""
    min_saving_us, keep_if_above = _margins(min_saving_us, keep_if_above)
    pick = forms[1] if faster(*times, min_saving_us=min_saving_us, keep_if_above=keep_if_above) else forms[0]
    why = (f"{forms[1]} saves {times[0] - times[1]:.1f} µs of {times[0]:.1f}" if pick != forms[0]
           else f"{forms[1]} saves less than {1 - keep_if_above:.0%}"
           + (f" and {min_saving_us:g} µs" if min_saving_us else ""))
    return Decision(family, op, f"{shape} {str(dtype).removeprefix('torch.')}", forms, times, pick, why, str(device))


def faster(eager_us: float, other_us: float, min_saving_us: float | None = None,
           keep_if_above: float | None = None) -> bool:
    """The alternative is kept only where it saves at least 10% (`keep_if_above`) and 2 µs
    (`min_saving_us`); left out, each is this module's, read at the call."""
    min_saving_us, keep_if_above = _margins(min_saving_us, keep_if_above)
    return other_us <= keep_if_above * eager_us and eager_us - other_us >= min_saving_us


def _margins(min_saving_us: float | None, keep_if_above: float | None) -> tuple[float, float]:
    return (MIN_SAVING_US if min_saving_us is None else min_saving_us,
            KEEP_IF_ABOVE if keep_if_above is None else keep_if_above)


def gpu_of(operands, device: torch.device | None = None) -> torch.device | None:
    """The CUDA device the operands are on (`device` where the caller knows it: every operand
    may be a meta tensor), or None."""
    device = device or real_device(operands)
    return device if device is not None and device.type == "cuda" else None


def real_device(operands) -> torch.device | None:
    """The one device of the real tensors among `operands` (meta ones take theirs), or None."""
    real = {t.device for t in operands if t.device.type != "meta"}
    return next(iter(real)) if len(real) == 1 else None


def capturing(device: torch.device) -> bool:
    """A graph is being captured on `device`'s current stream: nothing is timed, or remembered."""
    with on(device):
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def on(device: torch.device):
    """`device` made current where it is a CUDA device (nothing to do elsewhere)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def deciding(device: torch.device, site: Site):
    """Where a choice is decided: on `device`, without autograd, and in a plan captured as CUDA
    graphs on its capture stream (`Site.replay_stream`), where its forms are timed. The stand-ins
    the forms read are then allocated on the stream their results are: the caching allocator
    keeps segments per stream, so made on the caller's each took a 20 MiB segment of its own
    beside the forms' (RegNetY's load reserved 128 MiB at its peak, against eager's 106)."""
    with on(device), torch.no_grad():
        stream = site.replay_stream() if device.type == "cuda" else None
        with on_side_stream(stream) if stream is not None else contextlib.nullcontext():
            yield


def scratch(t: torch.Tensor, device: torch.device, written: bool = False) -> torch.Tensor:
    """A real operand that is only read, as it is (a weight); a stand-in of the same layout for a
    meta one or the one written, carved from the loading method's arena where it has room
    (choices/scratch_space.py). Filled with a constant: the caller's random streams stay as they were."""
    if t.device.type != "meta" and not written:
        return t
    stand_in = scratch_space.take(device, t.shape, t.stride(), t.dtype)
    if stand_in is None:
        stand_in = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return stand_in.fill_(0.5)


def rounded(nbytes: int) -> int:
    """What the caching allocator hands out for a request of `nbytes` (512-byte steps)."""
    return -(-nbytes // 512) * 512


def large_bytes(*sizes: int) -> int:
    """The room requests of `sizes` bytes take among a pool's large blocks: those of 1 MiB or
    less take its small blocks (a 2 MiB segment of their own, which a plan's pool has anyway)."""
    return sum(rounded(n) for n in sizes if n > 1 << 20)


def time_both(first: Callable, second: Callable, stream=None, reps: int = 10, rounds: int = 3,
              room: TimingRoom | None = None) -> tuple[float, float]:
    """The GPU time of each (µs per call, the best of `rounds` runs of `reps` calls), the two
    taken in turn. In a plan captured as CUDA graphs, as its graphs run them: captured on its
    capture stream and replayed (a stream leaves a gap between launches that a replay does not:
    nn.MultiheadAttention composed at ViT-B/16's batch 1, 84.7 µs on a stream, 74.1 replayed).
    Otherwise on the current stream (`_on_stream`). `stream`: the plan's capture stream
    (`Site.replay_stream`), or None. `room`: where the forms' results are allocated meanwhile
    (`Site.timing_room`; None: the default pool and each capture's own)."""
    if stream is None:
        _warm_up((first, second))
        eager_us, other_us = _on_stream((first, second), reps, rounds)
        return eager_us, other_us
    keep_workspace(stream)
    allocating = room.allocating if room is not None else contextlib.nullcontext
    with on_side_stream(stream), allocating():  # the caller's stream runs nothing: its cuBLAS workspace is not made
        _warm_up((first, second))
    try:
        return _replayed((first, second), stream, reps, rounds, room.pool if room is not None else None)
    except BaseException as e:
        if room is not None:
            room.spoiled()  # torch may have left its pool unfit for the plan's captures
        if isinstance(e, torch.cuda.OutOfMemoryError) or not isinstance(e, RuntimeError):
            raise  # the caller's to handle: eager's kernel stays
        # a form that cannot be captured: the plan's capture would fail with it
        torch.cuda.synchronize()
        with on_side_stream(stream), allocating():
            return _on_stream((first,), reps, rounds)[0], math.inf  # eager's kernel stays


def _warm_up(fns) -> None:
    for fn in fns * 3:  # kernels loaded, cuBLAS's handles and the current stream's workspace made
        fn()


def _replayed(fns, stream, reps: int, rounds: int, pool=None) -> tuple[float, float]:
    # the warm-up's blocks, cached in the default pool, are handed back before the capture fills
    # a pool of its own (torch.cuda.graph does so too): held, the two had ResNet-50's load
    # reserve 198 MiB at its peak against eager's 176 (each convolution timed at 154 + 22 + 22)
    torch.cuda.empty_cache()
    try:
        with on_side_stream(stream):
            return _replay_times(fns, reps, rounds, pool)  # its graphs are gone when it returns
    finally:
        # their pool's memory is cached for no one else (a released graph pool is reused by no
        # later capture): handed back, as torch.cuda.graph does before each capture. Without it
        # ResNet-50's reserved peak with graphs rose from 188 to 496 MiB.
        torch.cuda.empty_cache()


def _replay_times(fns, reps: int, rounds: int, pool=None) -> tuple[float, float]:
    # one pool for the forms: their results are discarded and they replay one after the
    # other, so each may reuse the others' memory (a pool each took a set of segments each:
    # ResNet-50's reserved peak at load +40 MiB); `pool` where given, else a fresh one
    graphs = [capture(fns[0], reps, pool)]
    graphs += [capture(fn, reps, graphs[0].pool()) for fn in fns[1:]]
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
