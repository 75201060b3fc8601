"""Graph replay of device segments (CUDA graphs; simulated graphs in tests).

A captured segment runs eagerly on its first call (lazy initialisation such as cuBLAS
handles stays out of the graph), on its capture stream, is captured on the second and replayed
from then on. Before each (the first run too) the streams API prepares the capture stream
(`prepare_capture`; on CUDA, its cuBLAS workspace, whose address a graph bakes in, made in a
memory pool kept for the process: ferry/capture.py). Made in the segment's own pool, a
workspace another module's captures later found there would be freed under their graphs by
`torch._C._cuda_clearCublasWorkspaces` (torch.compile's reduce-overhead mode calls it) once this
module closed; made outside any pool, under this one's (tried: replays then fail with
"unspecified launch failure"). Every address in it is fixed — planned memory, the fixed tensors
device inputs are staged into, or what a functional kernel allocated during the capture (from
the set's graph pool: GraphMemory) — which is what makes replay legal. After a replay, the slots of
the values the segment produced point at the tensors the capture made, whose memory the replay
has rewritten. A capture that fails, or records nothing, falls back to running the segment
eagerly, with a warning: never a wrong result.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ferry import capture as shared_capture
from ferry.device import Device
from ferry.runtime.devices.allocator import DeviceMemoryBuffer


class _Graph(Protocol):
    """A captured graph: torch.cuda.CUDAGraph, or a SimGraph in tests."""

    def replay(self) -> None: ...


class GraphMemory:
    """Where one set of planned memory captures its graphs: per device, one capture stream and
    one memory pool, shared by every segment of every method the set runs (prefill's graphs and
    decode's, a graph per shape). What captured kernels allocate (functional results, their
    workspaces) then takes the most one plan needs, not the sum over every graph kept.

    Sharing is safe because a set runs one call at a time, and a call replays only the graphs
    of one plan, captured in one call in the order they replay: memory an earlier graph used
    for temporaries and a later one keeps for a result is rewritten by the earlier one only
    before the later one's replay in a call, or in the next call, when the result is dead (a
    view the caller holds lasts until the set's next call, as documented).

    The pool is also where the load's one allocation per device goes (`home`), with room left
    free behind it for what a call allocates (`tail`): the graphs' results then fill that room,
    where in a pool of their own they took a 20 MiB segment of the caching allocator for a few MB
    (EfficientNet-B0: 22 MiB reserved, empty between calls). Until a call first uses it, the
    load's kernel timing may lend it (`lends_room`). Segments' first, eager runs allocate there
    too until the device's first capture (`first_run`); after it, eager runs and timing graphs
    allocate outside the pool, so no graph ever writes their memory."""

    def __init__(self) -> None:
        self._streams: dict[tuple[str, int], object] = {}
        self._pools: dict[tuple[str, int], object] = {}
        self.tail: dict[int, int] = {}  # per device index: bytes a slab (or make_rooms) left free in the pool
        self.pending: dict[int, tuple[Any, int]] = {}  # per device index: (api, bytes) of room to make
        self._captured: set[int] = set()
        self._ran: set[int] = set()  # devices whose pool a segment's first, eager run allocated in
        self._held: list[tuple[object, Callable[[], None]]] = []  # (pool, its release) this set holds open
        self._fresh: dict[int, object] = {}  # per device index: the pool captures use once the set's was spoiled
        self._release = weakref.finalize(self, _release_pools, self._held)

    def _site(self, api, index: int) -> tuple[object, object]:
        key = (api.device_type, index)
        if key not in self._streams:
            self._streams[key] = api.Stream(index)
        if key not in self._pools:
            self._pools[key] = api.new_pool(index)
        return self._streams[key], self._pools[key]

    def stream(self, api, index: int):
        """The side stream graphs of device `index` are captured on (never the default one:
        torch.cuda.graph's default is one stream made on whichever GPU was current first)."""
        return self._site(api, index)[0]

    def pool(self, api, index: int):
        return self._site(api, index)[1]

    def capture_pool(self, api, index: int):
        """The pool graphs of device `index` are captured into: the set's, unless a capture into
        it failed (`spoiled`)."""
        return self._fresh[index] if index in self._fresh else self.pool(api, index)

    def spoiled(self, api, index: int) -> None:
        """A capture into the pool of device `index` failed. Some torch versions then leave the
        pool recording for their pinned host memory, with no way to end it from Python, and every
        later capture into it fails ("already recording to mempool_id"): later captures use a
        fresh pool (graphs captured before keep theirs), and the room is lent no more. The fresh
        pool is held (graphs of a shape let go meanwhile must not let it go) where it can be: a
        failed hold leaves the segment to run eagerly, as any failed capture does; a fresh pool it
        replaces is let go (its graphs hold it)."""
        before = self._fresh.get(index)
        self._fresh[index] = api.new_pool(index)
        for held in [h for h in self._held if h[0] is before]:
            self._held.remove(held)
            held[1]()
        with contextlib.suppress(RuntimeError):
            self._hold(api, index, self._fresh[index])

    def home(self, api, index: int):
        """A context in which this thread's allocations on device `index` come from its graph
        pool, on its capture stream (where a capture looks for free memory). The set holds the
        pool open from the first such use until `close`."""
        stream, pool = self._site(api, index)
        self._hold(api, index, pool)
        return api.allocating_in(pool, stream)

    def _hold(self, api, index: int, pool) -> None:
        if not any(p is pool for p, _ in self._held):
            self._held.append((pool, api.hold_pool(pool, self.stream(api, index))))

    def room_wanted(self, api, device) -> bool:
        """Whether a load on `device` leaves room for the graphs in the pool: while no graph of the
        device was captured and no earlier load left room there (a later slab would be given that
        room by the allocator's best fit, or, after a capture, memory a replay overwrites)."""
        taken = device.index in self._captured or self.tail.get(device.index) or device.index in self.pending
        return device.type == api.device_type and not taken and api.splits_blocks()

    def slab_home(self, api, device):
        """Where a load's allocation on `device` goes: the graph pool where `room_wanted`, else
        None (the default pool, as without graphs)."""
        return self.home(api, device.index) if self.room_wanted(api, device) else None

    def make_rooms(self) -> None:
        """The room a load left for after itself (`pending`: one larger than the allocator rounds
        to a segment of its own, so no better behind the slab), made now, when the load's kernel
        timing has handed its memory back: made before it, it would add to the load's peak
        (ResNet-50: 188 MiB against eager's 176)."""
        while self.pending:
            index, (api, nbytes) = self.pending.popitem()
            if index in self._captured or self.tail.get(index):
                continue
            with contextlib.suppress(Exception), self.home(api, index):  # (no room: graphs allocate as they go)
                DeviceMemoryBuffer.create(nbytes, Device(api.device_type, index)).close()
                self.tail[index] = nbytes

    def lends_room(self, index: int, nbytes: int) -> bool:
        """Whether a load's kernel timing on device `index` may allocate `nbytes` of its forms'
        results (requests over 1 MiB: smaller ones take the pool's small blocks, as the plan's
        own do) in the room a slab asked for behind it in the pool (`tail`), all of it free
        again before a call needs it: only before any call's first run allocated there (its
        results may still hold part of it) and before any capture (after, a free block there may
        be a replay's temporary). In a pool of its own a timed result of 1-10 MiB took a 20 MiB
        segment on top of the load (Swin-T's layer norms: 182 MiB reserved against eager's 170)."""
        fit = index not in self._captured and index not in self._ran and index not in self._fresh
        return fit and self.tail.get(index, 0) >= nbytes

    def first_run(self, api, index: int):
        """Where a segment's first, eager run allocates: the pool, until a graph of device `index`
        is captured (its temporaries are free memory there afterwards, which an eager result
        could then be given and a replay overwrite)."""
        if index in self._captured:
            return contextlib.nullcontext()
        self._ran.add(index)
        return self.home(api, index)

    def captured(self, index: int) -> None:
        self._captured.add(index)

    def close(self) -> None:
        """The pools are let go (each freed once its graphs and the memory taken from it are),
        and forgotten: a set loaded again makes new ones (torch refuses to hold again a pool
        it was let go)."""
        self._release()
        self._pools.clear()  # (the streams stay: each new one would make a cuBLAS workspace kept for the process)
        self.tail.clear()
        self.pending.clear()
        self._captured.clear()
        self._ran.clear()
        self._fresh.clear()
        self._release = weakref.finalize(self, _release_pools, self._held)


def _release_pools(held: list) -> None:
    while held:
        _, release = held.pop()
        with contextlib.suppress(Exception):  # at interpreter exit the driver may be gone
            release()


@contextlib.contextmanager
def on_capture_stream(streams, index: int):
    """Device work launched inside runs on device `index`'s capture stream, prepared first (CUDA:
    its cuBLAS workspace in the kept pool), ordered after the work queued on the caller's stream
    and before its later work, also when it fails part way. It allocates where first runs do
    (GraphMemory.first_run): the transients of the calls before the first capture then reuse the
    room the captures will, instead of a segment the caching allocator keeps for them."""
    api = streams.api
    stream = streams.capture_stream(index)
    with api.device(index):
        api.prepare_capture(stream)
        caller = api.current_stream(index)
        ready, done = api.Event(), api.Event()
        ready.record(caller)
        stream.wait_event(ready)
    try:
        with api.stream(stream), streams.first_run_memory(index):
            yield
    finally:
        with api.device(index):
            done.record(stream)
            caller.wait_event(done)


class GraphSegment:
    def __init__(self, calls: Sequence[Callable[[], object]], device_index: int, streams, touches_host: bool,
                 label: str, slots: list | None = None, produced: frozenset[int] = frozenset()):
        self.calls = tuple(calls)
        self.index = device_index
        self.streams = streams
        self.api = streams.api
        self.touches_host = touches_host
        self.label = label
        # values of the call the segment produces (functional kernels' results): a replay rewrites
        # the memory the capture allocated for them, so their slots get those tensors back
        self.slots, self.produced = slots, produced
        self.kept: dict[int, object] = {}
        self.runs = 0
        self.graph: _Graph | None = None
        self.key = None
        self.failed = False
        self.failure = ""  # why its capture failed

    def _eager(self) -> None:
        for call in self.calls:
            call()

    def __call__(self, key=None) -> None:
        if self.failed:
            return self._eager()
        if self.graph is not None:
            if key != self.key:
                warnings.warn(f"{self.label}: input shapes changed since capture; running without the graph",
                              RuntimeWarning, stacklevel=3)
                return self._eager()
            return self._replay()
        self.runs += 1
        if self.runs == 1:
            return self._first_run()
        return self._capture(key)

    def _first_run(self) -> None:
        """Eager, on the capture stream (`on_capture_stream`): on the caller's stream the first
        call would make that stream's cuBLAS workspace too (32 MiB on an H200, held for the
        process) where every later call replays graphs that use the capture stream's."""
        with on_capture_stream(self.streams, self.index):
            self._eager()

    def _replay(self) -> None:
        assert self.graph is not None  # only called once a capture succeeded
        self.graph.replay()
        if self.kept:
            for vid, t in self.kept.items():
                self.slots[vid] = t  # type: ignore[index]
        if self.touches_host:
            self.streams.note_host_dependency(("graph", id(self)), self.index)

    def _capture(self, key) -> None:
        graph = self.api.new_graph()
        self.streams.wait_host()
        self.streams.capturing = True
        failure = None
        try:  # the lock first: another thread's warnings context (a pool's hold) then cannot undo this one's
            with shared_capture.LOCK, warnings.catch_warnings(record=True) as caught:  # (a kernel timed meanwhile
                warnings.simplefilter("always")  # would break the capture)
                stream = self.streams.capture_stream(self.index)
                with self.api.device(self.index):
                    self.api.prepare_capture(stream)
                    with self.api.capture(graph, stream, self.streams.capture_pool(self.index)):
                        self._eager()
            for w in caught:
                if "Graph is empty" in str(w.message):  # its work went to another stream or device
                    raise RuntimeError("the captured graph is empty")
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        except Exception as e:  # an op that cannot be captured (host sync, pageable copy, ...)
            failure = e
        finally:
            self.streams.capturing = False  # before any eager run: its copies need their events
        if failure is not None:
            self.streams.capture_failed(self.index)
            self.failed, self.failure = True, f"{type(failure).__name__}: {str(failure)[:200]}"
            warnings.warn(f"{self.label}: graph capture failed ({type(failure).__name__}: {failure}); "
                          "running it eagerly from now on", RuntimeWarning, stacklevel=3)
            self.api.synchronize(self.index)
            return self._eager()
        self.graph, self.key = graph, key
        self.streams.graph_memory.captured(self.index)
        self.kept = {vid: self.slots[vid] for vid in self.produced} if self.slots is not None else {}
        return self._replay()
