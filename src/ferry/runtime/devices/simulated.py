"""A streams API that simulates an asynchronous device on the CPU.

Device work (kernels, copies) is queued on streams and runs only when the host waits for it
(an event or device synchronize) or when another stream's wait needs it. So a program that
forgets a host wait reads memory a copy has not written yet and gets a wrong answer — the
failure real GPUs show only under load — and the scheduling and capture code of the runtime
runs in CI with the same calls it makes on CUDA. Used by `EmulatedAllocator(asynchronous=True)`.

Semantics follow CUDA's: a stream runs its work in order; `event.record(s)` marks the end of
the work queued on `s` so far; `s.wait_event(e)` makes later work on `s` wait for that mark;
`event.synchronize()` blocks the host until the mark is reached. Graph capture records the
work queued on the capture stream instead of queuing it; a host wait while capturing fails as
it does on CUDA; replay queues the recorded work again.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Literal, Union

import torch

from ferry.errors import InternalError

__all__ = ["SimulatedApi"]


class _Mark:
    """One recording of an event: reached when the work queued before it has run."""

    def __init__(self):
        self.reached = False


# a stream's work item: ("run", fn, touches_host) | ("mark", _Mark) | ("wait", _Mark)
_Work = Union[tuple[Literal["run"], Callable[[], object], bool], tuple[Literal["mark", "wait"], _Mark]]


class SimStream:
    def __init__(self, api: SimulatedApi, index: int, name: str):
        self.api, self.index, self.name = api, index, name
        self.queue: list[_Work] = []

    def wait_event(self, event: SimEvent) -> None:
        if event.mark is not None:
            self.api._queue(self, ("wait", event.mark))

    def __repr__(self) -> str:
        return f"SimStream({self.name} on device {self.index}, {len(self.queue)} queued)"


class SimEvent:
    def __init__(self, api: SimulatedApi):
        self.api = api
        self.mark: _Mark | None = None

    def record(self, stream: SimStream) -> None:
        self.mark = _Mark()
        self.api._queue(stream, ("mark", self.mark))

    def synchronize(self) -> None:
        self.api._host_wait(lambda: self.mark is None or self.mark.reached)

    def query(self) -> bool:
        """Whether the work before the recording has run (the device makes what progress it can:
        False when it is stuck, as a stream waiting on a peer that never sends is)."""
        while not (self.mark is None or self.mark.reached):
            if not self.api._step():
                return False
        return True


class SimPool:
    """A graph memory pool's handle: which graphs share one (tests read `graph.pool`), and how
    often it was held open and let go."""

    def __init__(self, index: int):
        self.index = index
        self.holds = 0
        self.let_go = False
        self.spoiled = False  # a capture into it failed (see SimulatedApi.capture)


class SimGraph:
    def __init__(self, api: SimulatedApi):
        self.api = api
        self.work: list[_Work] = []
        self.index: int | None = None
        self.pool: SimPool | None = None

    def replay(self) -> None:
        if self.index is None:
            raise RuntimeError("replay of a graph that was never captured")
        stream = self.api.current_stream(self.index)
        for item in self.work:
            self.api._queue(stream, item)


class SimulatedApi:
    """Streams, events and graphs of one simulated asynchronous device type."""

    def __init__(self, device_type: str = "emu"):
        self.device_type = device_type
        self._default: dict[int, SimStream] = {}
        self._current: dict[int, SimStream] = {}
        self._streams: list[SimStream] = []
        self._capturing: tuple[SimStream, SimGraph] | None = None
        self.launched = 0  # work items queued (kernels and copies)
        self.prepared: list[SimStream] = []  # the streams prepare_capture was called for, in order
        self.allocating_to: SimPool | None = None  # the pool allocations go to now (allocating_in)
        # which stream's work runs first when several could: the oldest stream's by default; the
        # newest's in tests of a wait from an older stream to a newer (a missing one then shows)
        self.newest_first = False

    # ---- the streams API

    def Stream(self, index: int) -> SimStream:  # noqa: N802 - mirrors torch.cuda.Stream
        s = SimStream(self, index, f"stream {len(self._streams)}")
        self._streams.append(s)
        return s

    def Event(self) -> SimEvent:  # noqa: N802 - mirrors torch.cuda.Event
        return SimEvent(self)

    def current_stream(self, index: int) -> SimStream:
        if index not in self._current:
            self._default[index] = self._current[index] = self.Stream(index)
            self._default[index].name = "default"
        return self._current[index]

    @contextlib.contextmanager
    def stream(self, s: SimStream):
        before = self.current_stream(s.index)
        self._current[s.index] = s
        try:
            yield s
        finally:
            self._current[s.index] = before

    @contextlib.contextmanager
    def device(self, index: int):
        yield index

    def new_graph(self) -> SimGraph:
        return SimGraph(self)

    def new_pool(self, index: int) -> SimPool:
        return SimPool(index)

    @contextlib.contextmanager
    def capture(self, graph: SimGraph, stream: SimStream, pool: SimPool | None = None):
        if self._capturing is not None:
            raise RuntimeError("a graph is already being captured")
        if pool is not None and pool.index != stream.index:
            raise RuntimeError(f"a graph on device {stream.index} captured into device {pool.index}'s pool")
        if pool is not None and pool.spoiled:  # as torch versions that leave a failed capture's pool recording
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id (a capture into it failed)")
        graph.index, graph.pool = stream.index, pool
        self._capturing = (stream, graph)
        try:
            with self.stream(stream):
                yield graph
        except BaseException:
            if pool is not None:
                pool.spoiled = True
            raise
        finally:
            self._capturing = None
        if not graph.work:
            warnings.warn("The CUDA Graph is empty (simulated: no work reached the capture stream)", UserWarning,
                          stacklevel=3)

    own_segment_from, splits_above = 10 << 20, 1 << 20  # as CUDA's caching allocator

    @staticmethod
    def splits_blocks() -> bool:
        return True

    @staticmethod
    def hold_pool(pool: SimPool, stream: SimStream) -> Callable[[], None]:
        if pool.let_go:  # as torch's allocator asserts (create_or_incref_pool)
            raise RuntimeError("a graph pool held again after it was let go")
        pool.holds += 1

        def release():
            pool.holds -= 1
            pool.let_go = pool.holds == 0

        return release

    @contextlib.contextmanager
    def allocating_in(self, pool: SimPool, stream: SimStream):
        """Allocations made meanwhile would come from `pool` (tests read `allocating_to`)."""
        if pool.holds < 1:
            raise RuntimeError("allocation into a graph pool nobody holds open")
        before, self.allocating_to = self.allocating_to, pool
        try:
            with self.stream(stream):
                yield
        finally:
            self.allocating_to = before

    def prepare_capture(self, stream: SimStream) -> None:
        """Nothing to make (CUDA makes cuBLAS's workspace here): recorded, for tests."""
        self.prepared.append(stream)

    def synchronize(self, index: int) -> None:
        self._host_wait(lambda: not any(s.queue for s in self._streams if s.index == index))

    def enqueue(self, stream: SimStream, fn: Callable[[], object], touches_host: bool = False):
        self._queue(stream, ("run", fn, touches_host))
        return None

    def on_device(self, index: int, fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: self.enqueue(self.current_stream(index), fn)

    def results_now(self, index: int, fn: Callable[[], object]) -> Callable[[], object]:
        """Device work whose results the host holds as soon as it returns (a delegate's compiled
        code, which returns tensors of its own: on CUDA its Python runs at once and only its
        kernels wait). Here the code computes them too, so it runs at host time, after the work
        queued on the device's stream so far. It cannot be captured: a replay would compute new
        tensors, not rewrite the captured ones as CUDA's does (the segment runs eagerly instead)."""

        def run():
            stream = self.current_stream(index)
            if self._capturing is not None and stream is self._capturing[0]:
                raise RuntimeError("a simulated graph cannot capture code that returns tensors of its own")
            self._host_wait(lambda: not stream.queue)
            return fn()

        return run

    @staticmethod
    def page_locked(t: torch.Tensor) -> bool:
        return True  # simulated host memory is all page-locked

    @staticmethod
    def keep_alive(t: torch.Tensor, stream) -> None:
        return None

    def end_of_call(self) -> None:
        """The caller reads device outputs directly (host memory standing in for the device),
        so the call's device work finishes now — but a copy into host memory still queued
        means the runtime returned before waiting for it: a ferry bug, reported as one."""
        unwaited = [item for s in self._streams for item in s.queue if item[0] == "run" and item[2]]
        if unwaited:

            raise InternalError(f"a method returned with {len(unwaited)} copies to or from host memory not waited for")
        self._host_wait(lambda: not any(s.queue for s in self._streams))

    # ---- the simulation

    def _queue(self, stream: SimStream, item: _Work) -> None:
        if self._capturing is not None and stream is self._capturing[0]:
            self._capturing[1].work.append(item)
            return
        if item[0] == "run":
            self.launched += 1
        stream.queue.append(item)

    def _host_wait(self, done: Callable[[], bool]) -> None:
        if self._capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing (simulated host wait)")
        while not done():
            if not self._step():
                raise RuntimeError("simulated streams deadlocked: every stream waits on a mark never recorded")

    def _abandon(self, index: int) -> None:
        """Device work that raised (a kernel refusing its values) ends the call: the rest of the
        device's queued work is dropped, its marks reached, so the next call starts clean rather
        than behind the failed call's leftovers (a real GPU's fault would end the process's use
        of it; this device lets the module go on, as a host-side refusal does)."""
        for s in self._streams:
            if s.index == index:
                for item in s.queue:
                    if item[0] == "mark":
                        item[1].reached = True
                s.queue.clear()

    def _step(self) -> bool:
        """Run the first runnable item of any stream; False when none can run."""
        for s in (reversed(self._streams) if self.newest_first else self._streams):
            if not s.queue:
                continue
            item = s.queue[0]
            if item[0] == "wait" and not item[1].reached:
                continue
            s.queue.pop(0)
            if item[0] == "run":
                try:
                    item[1]()
                except BaseException:
                    self._abandon(s.index)
                    raise
            elif item[0] == "mark":
                item[1].reached = True
            return True
        return False
