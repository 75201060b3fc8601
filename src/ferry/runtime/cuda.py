"""CUDA: the allocator, and the stream/event discipline of asynchronous copies.

Allocation goes through PyTorch's CUDA caching allocator (torch.empty on the device), not raw
cudaMalloc: ferry's kernels and delegates run through PyTorch, so one allocator means one pool
(no memory stranded between two allocators), stream-aware reuse, allocations that are legal
inside CUDA-graph capture, and PyTorch's OOM errors with the CUDA text. ferry still allocates
everything at load, so the caching allocator's run-time behaviour never matters.

Copies larger than SMALL_COPY_BYTES run on one copy stream per device (smaller ones stay on
the compute stream, where stream order alone is enough and two fewer events are cheaper). A copy waits (on the GPU, via an event) for the
compute work already queued on its device, and compute waits for the copy through an event:
no full device synchronisation anywhere. The host waits only where host code is about to
read a `_d2h_copy` result or overwrite memory a pending `_h2d_copy` still reads.
"""

from __future__ import annotations

import functools

import torch

from ferry.device import Device
from ferry.runtime.allocator import DeviceAllocator

MIN_ALIGNMENT = 256
SMALL_COPY_BYTES = 1 << 20


class CudaAllocator(DeviceAllocator):
    device_type = "cuda"
    default_alignment = MIN_ALIGNMENT

    def _normalize_index(self, index: int) -> int:
        if index == -1:
            return torch.cuda.current_device()
        if index < -1:
            raise ValueError(f"CUDA device index must be >= 0, or -1 for the current device; got {index}")
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"CUDA device index {index} is out of range: this machine has {count} GPU(s)")
        return index

    def _allocate(self, nbytes: int, index: int, alignment: int) -> torch.Tensor:
        # the caching allocator hands out 512-byte aligned blocks; ask for slack only when
        # a larger alignment is requested
        alignment = max(alignment, MIN_ALIGNMENT)
        slack = 0 if alignment <= 512 else alignment
        base = torch.empty(nbytes + slack, dtype=torch.uint8, device=torch.device("cuda", index))
        if not slack:
            return base
        start = (-base.data_ptr()) % alignment
        return base[start:start + nbytes]

    def _deallocate(self, memory: torch.Tensor, index: int) -> None:
        # the tensor's storage returns to the caching allocator when the last reference goes
        return None

    # Asynchronous only with page-locked host memory: PyTorch stages a non-blocking copy to or
    # from pageable memory through its own pinned buffer, which ferry's events cannot see.
    def _copy_h2d(self, dst, src, nbytes, index):
        dst.copy_(src, non_blocking=src.is_pinned())

    def _copy_d2h(self, dst, src, nbytes, index):
        dst.copy_(src, non_blocking=dst.is_pinned())

    def _copy_d2d(self, dst, src, nbytes, dst_index, src_index):
        dst.copy_(src, non_blocking=True)

    def _bind_copy(self, direction, dst, src, nbytes, *indices):
        # page-locked or not is fixed for planned memory: ask once, not on every copy
        host = {"h2d": src, "d2h": dst}.get(direction)
        return functools.partial(dst.copy_, src, non_blocking=True if host is None else host.is_pinned())


class CopyStreams:
    """Per-method stream discipline for copies on CUDA devices.

    `bind` (planned tensors, decided at load) and `run` (tensors bound per call) issue a copy the
    same way: on the device's copy stream, ordered after the compute work already queued there,
    with the compute stream then waiting for the copy (small copies stay on the compute stream).
    The host syncs in `wait_host()`, called before host code touches memory a copy may still use.
    """

    def __init__(self):
        self._copy: dict[int, torch.cuda.Stream] = {}
        self._events: dict[object, torch.cuda.Event] = {}
        self._issuers: dict[object, object] = {}
        self._capture: dict[int, torch.cuda.Stream] = {}
        self._pending: list[torch.cuda.Event] = []
        self.capturing = False

    def event(self, key) -> torch.cuda.Event:
        """One reusable event per call site: recording again is cheaper than creating."""
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = torch.cuda.Event()
        return ev

    def copy_stream(self, index: int) -> torch.cuda.Stream:
        s = self._copy.get(index)
        if s is None:
            s = self._copy[index] = torch.cuda.Stream(device=index)
        return s

    def capture_stream(self, index: int) -> torch.cuda.Stream:
        """The side stream CUDA graphs of device `index` are captured on."""
        return self._capture.get(index) or self._capture.setdefault(index, torch.cuda.Stream(device=index))

    def run(self, key, kernel, src: torch.Tensor, out: torch.Tensor, devices: tuple[Device, ...]):
        """A copy between tensors bound per call (the caller's, or sized per call)."""
        if self.capturing:
            return kernel(src, out)  # inside a CUDA graph: stay on the capture stream
        issue = self._issuers.get(key)
        if issue is None:  # sizes vary per call here: always the copy stream
            issue = self._issuers[key] = self._issuer(key, devices, None)
        issue(lambda: kernel(src, out))
        # memory the caller owns may be freed after this call: keep the caching allocator from
        # reusing it before the copy stream is done (planned memory lives until close anyway)
        cs = issue.stream
        for t in (src, out):
            if t.is_cuda and t.untyped_storage().nbytes() == t.nbytes:
                t.record_stream(cs)
        return out

    def bind(self, key, copy, devices: tuple[Device, ...], nbytes: int | None = None):
        """The hot path for copies between planned tensors: everything but the event traffic is
        decided here, at load."""
        issue = self._issuer(key, devices, nbytes)
        streams = self

        def run():
            if streams.capturing:
                return copy()
            issue(copy)

        return run

    def _issuer(self, key, devices: tuple[Device, ...], nbytes: int | None):
        """How a copy between `devices` is issued, decided once per call site. Copies up to
        SMALL_COPY_BYTES on one GPU stay on its compute stream: the two events a copy stream
        needs cost more than such a copy could overlap, and stream order alone is enough."""
        cuda = sorted({d.index for d in devices if d.type == "cuda"})
        touches_host = any(d.is_cpu for d in devices)
        done = self.event(key)
        pending = self._pending
        current = torch.cuda.current_stream
        if nbytes is not None and nbytes <= SMALL_COPY_BYTES and len(cuda) == 1:
            index = cuda[0]

            def on_compute(copy):
                copy()
                if touches_host:
                    done.record(current(index))
                    pending.append(done)

            return on_compute
        cs = self.copy_stream(cuda[0])
        ready = [self.event((key, "ready", i)) for i in cuda]
        stream_ctx = torch.cuda.stream

        def on_copy_stream(copy):
            computes = [current(i) for i in cuda]
            for ev, compute in zip(ready, computes):
                ev.record(compute)  # the copy waits for the compute work already queued
                cs.wait_event(ev)
            with stream_ctx(cs):
                copy()
            done.record(cs)
            for compute in computes:
                compute.wait_event(done)
            if touches_host:
                pending.append(done)

        on_copy_stream.stream = cs
        return on_copy_stream

    def note_host_dependency(self, key, index: int) -> None:
        """After a captured graph replays copies touching host memory: host waits on its stream."""
        ev = self.event(key)
        ev.record(torch.cuda.current_stream(index))
        self._pending.append(ev)

    def wait_host(self) -> None:
        if self._pending:
            for ev in self._pending:
                ev.synchronize()
            self._pending.clear()


def register_if_available() -> None:
    from ferry.runtime.allocator import get_allocator, register_allocator

    if torch.cuda.is_available() and get_allocator("cuda") is None:
        register_allocator(CudaAllocator())
