"""Inductor's block-size tuning of the kernels a load compiles, timed as the kernels will run.

Inductor tunes a GPU kernel's block sizes at its first launch (coordinate descent, TUNING in
choices/gemv.py), timing each candidate alone: its L2 flushed by a kernel of its own, start and
end events around one launch. For the few-microsecond kernels of a decode step that timing is
mostly the gap around the launch: on an H200 it gave 15-32 µs to a Qwen3 o-projection whose
kernel runs in 3.9-5.7 µs, and any 0.1% gain moves the descent, so noise picks the block sizes:
five fresh compiles of one kernel ran 4.7-6.4 µs (Llama's o), 6.4-11.4 (q/k/v with its norm)
and 3.9-5.7 (Qwen3's o) in a decode step's graph.

While `steady()` is active, each candidate is timed as a decode step's graph runs it instead:
launched back to back in a replayed CUDA graph, over copies of its arguments enough to be out of
L2 when read again (a weight streams from memory at every step), the best of a few replays.
Inductor keeps the pick in its autotune cache as before. Kernels this cannot time so (arguments
reset to zero before each launch, an integer tensor written, a kernel reading more than L2, not
on CUDA, a launch that cannot be captured) are timed Inductor's own way.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch

from ferry.capture import LOCK, capture, on_side_stream
from ferry.ops.aliasing import extent

__all__ = ["STEADY", "copies_past_l2", "steady"]

STEADY = True  # off: Inductor times its candidates its own way (bench/llm.py --steady-tuning off)
_REPLAYS = 10  # replays of each candidate's graph; the best is kept
_MAX_COPIES = 64  # a tiny kernel's argument sets: its launches are timed mostly in L2 anyway
_patched = threading.local()


@contextlib.contextmanager
def steady(enabled: bool = True):
    """Inductor's kernels first launched inside, in this thread, are tuned on replayed timings
    (module docstring); another thread's meanwhile on Inductor's own. A no-op where `enabled` or
    STEADY is off, or where this torch has no Triton autotuner."""
    autotuner = _autotuner() if enabled and STEADY else None
    if autotuner is None or getattr(_patched, "active", False):
        yield
        return
    own_bench = autotuner.bench

    def bench(self, launcher, *args, with_profiler=False, **kwargs):
        mine = getattr(_patched, "active", False) and not with_profiler
        timed = _replayed(self, launcher, args, kwargs) if mine else None
        return own_bench(self, launcher, *args, with_profiler=with_profiler, **kwargs) if timed is None else timed

    with LOCK:  # one patch at a time (another thread's load would restore the wrong method), and
        # no other capture while candidates are captured (ferry/capture.py)
        autotuner.bench = bench
        try:
            _patched.active = True
            yield
        finally:
            _patched.active = False
            autotuner.bench = own_bench
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()  # the copies' blocks, cached for no one: handed back


def copies_past_l2(nbytes: int, device: torch.device, most: int = 32) -> int:
    """How many copies of `nbytes` read in turn leave each out of L2 by the time it is read again:
    one where it is larger than L2 (it evicts itself), else enough to fill L2 once more, at most `most`."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return 1 if nbytes >= l2 else min(most, -(-l2 // max(nbytes, 1)) + 1)


def _autotuner():
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:  # a torch without Inductor's Triton runtime: nothing to tune
        return None
    return CachingAutotuner if callable(getattr(CachingAutotuner, "bench", None)) else None


def _replayed(autotuner, launcher, args: tuple, kwargs: dict) -> float | None:
    """The candidate's ms per launch, timed as the module docstring says; None where Inductor's
    own timing must do (its spilled registers and invalid configs are judged there too)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    device = _gpu(tensors)
    limit = (getattr(autotuner, "inductor_meta", None) or {}).get("spill_threshold", 16)
    if (device is None or getattr(autotuner, "reset_to_zero_arg_names", None) or _writes_integers(autotuner, args, kwargs)
            or (getattr(launcher, "n_spills", None) or 0) > limit):
        return None
    nbytes = sum(_extent(t) for t in tensors)
    if copies_past_l2(nbytes, device) == 1:
        return None  # long enough that Inductor's timing of one launch holds
    try:
        with torch.cuda.device(device):
            return _time_launches(launcher, args, kwargs, copies_past_l2(nbytes, device, _MAX_COPIES))
    except Exception:  # noqa: BLE001 - not capturable, no room for the copies, or a launcher this hook
        # does not know (Inductor's runtime is private): Inductor times it; a dead GPU raises below
        torch.cuda.synchronize(device)
        return None


def _gpu(tensors: list[torch.Tensor]) -> torch.device | None:
    """The one CUDA device of the kernel's tensors, or None (none, several, or not CUDA)."""
    devices = {t.device for t in tensors}
    return devices.pop() if len(devices) == 1 and next(iter(devices)).type == "cuda" else None


def _writes_integers(autotuner, args: tuple, kwargs: dict) -> bool:
    """The kernel writes an integer tensor it is given (or what it writes is not known). Each copy
    is launched a dozen times unrestored: written floats only drift, but a position the kernel
    both reads and advances would index past its tensor."""
    written = getattr(autotuner, "mutated_arg_names", None)
    names = getattr(getattr(autotuner, "fn", None), "arg_names", None)
    if written is None or names is None:
        return True
    values = [*(a for n, a in zip(names, args) if n in written), *(a for n, a in kwargs.items() if n in written)]
    return any(isinstance(a, torch.Tensor) and not (a.is_floating_point() or a.is_complex()) for a in values)


def _time_launches(launcher, args: tuple, kwargs: dict, copies: int) -> float:
    """Never launched on `args` themselves (a kernel may write its inputs): on copies of them."""
    def copied(a):
        return _copy(a) if isinstance(a, torch.Tensor) else a

    sets = [([copied(a) for a in args], {k: copied(a) for k, a in kwargs.items()}) for _ in range(copies)]
    stream = torch.cuda.Stream()
    try:
        with on_side_stream(stream):
            for a, k in sets:  # loaded, and run once before its capture
                launcher(*a, stream=stream.cuda_stream, **k)
            graph = capture(lambda: [launcher(*a, stream=stream.cuda_stream, **k) for a, k in sets], 1)
            graph.replay()
            best = math.inf
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(_REPLAYS):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / copies)
        return best
    finally:
        sets.clear()


def _extent(t: torch.Tensor) -> int:
    """Bytes a kernel may read of `t`: from its first element to its last."""
    low, high = extent(t)
    return high - low


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with its strides (a kernel indexes by them): its extent copied into a new
    buffer as it lies in memory (a broadcast view, stride 0, cannot be copied element by element)."""
    span = _extent(t) // max(t.element_size(), 1)
    flat = torch.empty(span, dtype=t.dtype, device=t.device)
    if span:
        flat.copy_(t.as_strided((span,), (1,)))
    return flat.as_strided(t.shape, t.stride())
