"""The stream and event discipline of asynchronous devices, written once against a small API.

A device whose work runs asynchronously to the host (CUDA) hands the runtime a *streams API*:
streams, events, graphs and "run this on device i". `CudaApi` is PyTorch's CUDA;
`ferry.runtime.devices.simulated.SimulatedApi` is a CPU fake that defers device work until the host
waits, so the same code — copy issuing here, scheduling, graph capture — runs in CI, and a
host wait in the wrong place returns a wrong answer there instead of passing by luck.

Copies larger than SMALL_COPY_BYTES run on one copy stream per device (smaller ones stay on
the compute stream, where stream order alone is enough and two fewer events are cheaper). A
copy waits (on the device, via an event) for the compute work already queued on its device,
and compute waits for the copy through an event: no full device synchronisation anywhere.
The host waits only where host code is about to read a `_d2h_copy` result or overwrite
memory a pending `_h2d_copy` still reads (the schedule says where: runtime/stages/schedule.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import torch

from ferry import capture as shared_capture
from ferry.capture import TimingRoom
from ferry.device import Device
from ferry.runtime.devices.graphs import GraphMemory

SMALL_COPY_BYTES = 1 << 20


class CudaApi:
    """PyTorch's CUDA as a streams API: kernels are asynchronous by themselves."""

    device_type = "cuda"

    Stream = staticmethod(lambda index: torch.cuda.Stream(device=index))
    Event = staticmethod(lambda: torch.cuda.Event())
    current_stream = staticmethod(lambda index: torch.cuda.current_stream(index))
    stream = staticmethod(lambda s: torch.cuda.stream(s))
    device = staticmethod(lambda index: torch.cuda.device(index))
    new_graph = staticmethod(lambda: torch.cuda.CUDAGraph())
    new_pool = staticmethod(lambda index: torch.cuda.graph_pool_handle())
    synchronize = staticmethod(lambda index: torch.cuda.synchronize(index))

    @staticmethod
    @contextlib.contextmanager
    def capture(graph, stream, pool=None):
        """Capture on `stream`, allocating from `pool` (a graph pool handle; None: the graph's
        own), as torch.cuda.graph does (the device's cached blocks handed back first), but a
        capture that fails is undone (ferry/capture.py `recording`): torch.cuda.graph's leaves its
        pool recording, so the next segment's capture into the set's pool, and every first run
        allocating there, failed with "already recording to mempool_id"; and leaves the capture
        stream current."""
        torch.cuda.synchronize(stream.device)
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # (torch.cuda.graph's since 2.13)
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with torch.cuda.stream(stream), shared_capture.recording(graph, pool, stream.device_index, mode="global"):
            yield graph

    # a request this large gets a segment of its own size (rounded to 2 MiB); a smaller one of
    # 1-10 MiB, a 20 MiB segment (PyTorch's caching allocator: kMinLargeAlloc, kLargeBuffer)
    own_segment_from = 10 << 20
    # a free block is split only where more than this would be left (kSmallSize): room no larger
    # stays inside the block of what was allocated in front of it
    splits_above = 1 << 20

    @staticmethod
    def splits_blocks() -> bool:
        """Whether the caching allocator hands out the front of a larger free block and keeps the
        rest free (GraphMemory's room behind a slab): not with `max_split_size_mb` (a large block
        is never split) or expandable segments (one segment grows instead)."""
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
        return "max_split_size_mb" not in conf and "expandable_segments:true" not in conf.replace(" ", "").lower()

    # graph pool `pool` made and held open (torch's own graphs and `use_mem_pool` each hold it
    # while they use it) until the function it returns is called
    hold_pool = staticmethod(shared_capture.hold_pool)

    @staticmethod
    @contextlib.contextmanager
    def allocating_in(pool, stream):
        """This thread's allocations on `stream`'s device come from `pool` (held open), on
        `stream`, as `torch.cuda.use_mem_pool` routes them for a MemPool."""
        index = stream.device_index
        with torch.cuda.device(index), torch.cuda.stream(stream):
            torch._C._cuda_beginAllocateCurrentThreadToPool(index, pool)
            try:
                yield
            finally:
                torch._C._cuda_endAllocateToPool(index, pool)
                torch._C._cuda_releasePool(index, pool)

    @staticmethod
    def prepare_capture(stream) -> None:
        """Before graphs are captured on `stream`: its cuBLAS workspace made
        where no module's closing can free it under a live graph (ferry/capture.py)."""
        shared_capture.keep_workspace(stream)

    @staticmethod
    def enqueue(stream, fn: Callable[[], object], touches_host: bool = False):
        """Run `fn`, whose kernels go to `stream` (the caller made it current)."""
        return fn()

    @staticmethod
    def on_device(index: int, fn: Callable[[], object]) -> Callable[[], object]:
        """`fn` run with device `index` current (a switch only when another is current)."""
        current, device = torch.cuda.current_device, torch.cuda.device

        def run():
            if current() == index:
                return fn()
            with device(index):
                return fn()

        return run

    @classmethod
    def results_now(cls, index: int, fn: Callable[[], object]) -> Callable[[], object]:
        """Device work whose results the host holds as it returns (compiled code's own tensors):
        on CUDA, as any device work (its Python runs at once, its kernels on the stream)."""
        return cls.on_device(index, fn)

    @staticmethod
    def page_locked(t: torch.Tensor) -> bool:
        """A captured copy from pageable memory would replay a staging buffer filled at capture."""
        return t.is_pinned()

    @staticmethod
    def keep_alive(t: torch.Tensor, stream) -> None:
        """Memory the caller owns may be freed after the call: keep the caching allocator from
        reusing it before `stream` is done (planned memory lives until close anyway)."""
        if t.is_cuda and t.untyped_storage().nbytes() == t.nbytes:
            t.record_stream(stream)

    @staticmethod
    def end_of_call() -> None:
        """Device outputs are stream-ordered for the caller's next CUDA work: nothing to do."""


CUDA_API = CudaApi()


class CopyStreams:
    """One method's copy streams and events on the devices of one streams API.

    `bind` (planned tensors, decided at load) and `run` (tensors bound per call) issue a copy
    the same way: on the device's copy stream, ordered after the compute work already queued
    there, with the compute stream then waiting for the copy (small copies stay on the
    compute stream). The host syncs in `wait_host()`, which the schedule places before host
    code touches memory a copy may still use.
    """

    def __init__(self, api, graph_memory: GraphMemory | None = None) -> None:
        self.api = api
        self._copy: dict[int, object] = {}
        self._events: dict[object, object] = {}
        self._issuers: dict[object, Callable] = {}
        self.graph_memory = graph_memory if graph_memory is not None else GraphMemory()
        self._pending: list = []
        self.capturing = False
        self._bound: tuple[float, Callable[[], None]] | None = None

    def event(self, key):
        """One reusable event per call site: recording again is cheaper than creating."""
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = self.api.Event()
        return ev

    def copy_stream(self, index: int):
        s = self._copy.get(index)
        if s is None:
            s = self._copy[index] = self.api.Stream(index)
        return s

    def capture_stream(self, index: int):
        """The stream graphs of device `index` are captured on: the set's (GraphMemory)."""
        return self.graph_memory.stream(self.api, index)

    def capture_pool(self, index: int):
        """The memory pool graphs of device `index` are captured into (GraphMemory.capture_pool)."""
        return self.graph_memory.capture_pool(self.api, index)

    def capture_failed(self, index: int) -> None:
        """A capture on device `index` failed: later ones use a fresh pool (GraphMemory.spoiled)."""
        self.graph_memory.spoiled(self.api, index)

    def timing_room(self, index: int, nbytes: int) -> TimingRoom | None:
        """The graph pool a load's timing on device `index` may allocate `nbytes` of results
        in, with a context routing allocations there (GraphMemory.lends_room), or None."""
        if not self.graph_memory.lends_room(index, nbytes):
            return None
        return TimingRoom(self.graph_memory.pool(self.api, index), lambda: self.graph_memory.home(self.api, index),
                          lambda: self.capture_failed(index))

    def first_run_memory(self, index: int):
        """Where a segment's first, eager run on device `index` allocates (GraphMemory.first_run)."""
        return self.graph_memory.first_run(self.api, index)

    def run(self, key, kernel, src: torch.Tensor, out: torch.Tensor, devices: tuple[Device, ...]):
        """A copy between tensors bound per call (the caller's, or sized per call)."""
        issue = self._issuers.get(key)
        if issue is None:  # sizes vary per call here: always the copy stream
            issue = self._issuers[key] = self._issuer(key, devices, None)
        if self.capturing:  # inside a graph capture: on the (capturing) current stream
            return self.api.enqueue(self.api.current_stream(issue.index), lambda: kernel(src, out))  # type: ignore[union-attr]
        issue(lambda: kernel(src, out))
        for t in (src, out):
            self.api.keep_alive(t, issue.stream)  # type: ignore[union-attr]
        return out

    def bind(self, key, copy: Callable[[], object], devices: tuple[Device, ...], nbytes: int | None = None):
        """The hot path for copies between planned tensors: everything but the event traffic
        is decided here, at load."""
        issue = self._issuer(key, devices, nbytes)
        streams, api, index = self, self.api, issue.index  # type: ignore[attr-defined]

        def run():
            if streams.capturing:  # inside a graph capture: on the (capturing) current stream
                return api.enqueue(api.current_stream(index), copy)
            issue(copy)

        return run

    def _issuer(self, key, devices: tuple[Device, ...], nbytes: int | None):
        """How a copy between `devices` is issued, decided once per call site."""
        indices = sorted({d.index for d in devices if d.type == self.api.device_type})
        touches_host = any(d.is_cpu for d in devices)
        if nbytes is not None and nbytes <= SMALL_COPY_BYTES and len(indices) == 1:
            return self._on_compute(key, indices[0], touches_host)
        return self._on_copy_stream(key, indices, touches_host)

    def _on_compute(self, key, index: int, touches_host: bool):
        """Small copies on one device stay on its compute stream: the two events a copy stream
        needs cost more than such a copy could overlap, and stream order alone is enough."""
        done, pending, api = self.event(key), self._pending, self.api

        def issue(copy):
            compute = api.current_stream(index)
            api.enqueue(compute, copy, touches_host)
            if touches_host:
                done.record(compute)
                pending.append(done)

        issue.stream, issue.index = None, index  # type: ignore[attr-defined]
        return issue

    def _on_copy_stream(self, key, indices: list[int], touches_host: bool):
        cs = self.copy_stream(indices[0])
        done, pending, api = self.event(key), self._pending, self.api
        ready = [self.event((key, "ready", i)) for i in indices]

        def issue(copy):
            computes = [api.current_stream(i) for i in indices]
            for ev, compute in zip(ready, computes):
                ev.record(compute)  # the copy waits for the compute work already queued
                cs.wait_event(ev)
            with api.stream(cs):
                api.enqueue(cs, copy, touches_host)
            done.record(cs)
            for compute in computes:
                compute.wait_event(done)
            if touches_host:
                pending.append(done)

        issue.stream, issue.index = cs, indices[0]  # type: ignore[attr-defined]
        return issue

    def note_host_dependency(self, key, index: int) -> None:
        """After a graph replays copies touching host memory: the host waits on its stream."""
        ev = self.event(key)
        ev.record(self.api.current_stream(index))
        self._pending.append(ev)

    def bound_waits(self, timeout: float, stuck: Callable[[], None]) -> None:
        """Host waits give up after `timeout` seconds and call `stuck` (which raises): a program
        over ranks, whose device work may wait on a peer that died (runtime/parallel/transport.py)."""
        self._bound = (timeout, stuck)

    def wait_host(self) -> None:
        if self._pending:
            try:
                for ev in self._pending:  # (device work run during a wait may add events: waited for too)
                    if self._bound is None:
                        ev.synchronize()
                    else:
                        self._wait_bounded(ev, *self._bound)
            finally:
                self._pending.clear()

    @staticmethod
    def _wait_bounded(ev, timeout: float, stuck: Callable[[], None]) -> None:
        deadline, spins = time.monotonic() + timeout, 0
        while not ev.query():
            if time.monotonic() > deadline:
                stuck()
            spins += 1
            if spins > 2000:
                time.sleep(min(1e-3, 1e-6 * (spins - 2000)))

    def end_of_call(self) -> None:
        self.api.end_of_call()
