"""An emulated device: host memory standing in for an accelerator, with call counters.

It lets every placement, planning and runtime path run on a machine without a GPU,
and lets tests count exactly what the runtime asked for.  It is registered only when
asked for (``register_allocator(EmulatedAllocator())`` or ``with emulated_device():``),
never at import and never in place of a real device.

Besides counting, it checks what a real device would reject: copies whose device side
is not memory it allocated on that index, copies whose host side is device memory,
double frees and frees of memory it does not own.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from dataclasses import dataclass

import torch

from ferry.runtime.devices.allocator import (
    DeviceAllocator,
    allocate_aligned,
    get_allocator,
    register_allocator,
    unregister_allocator,
)
from ferry.runtime.devices.simulated import SimulatedApi

__all__ = ["AllocationRecord", "CopyRecord", "EmulatedAllocator", "emulated_device"]

DIRECTIONS = ("h2d", "d2h", "d2d")


@dataclass(frozen=True)
class CopyRecord:
    """One copy the allocator performed.

    ``index`` is the device index involved: the destination for h2d, the source for d2h,
    the destination for d2d (whose source is ``src_index``; None for h2d/d2h).
    """

    direction: str
    nbytes: int
    index: int
    src_index: int | None = None


@dataclass(frozen=True)
class AllocationRecord:
    """One allocation (also used for the matching free)."""

    nbytes: int
    index: int
    alignment: int
    data_ptr: int


@dataclass
class _Live:
    record: AllocationRecord
    memory: torch.Tensor  # keeps the host memory alive until it is freed


class EmulatedAllocator(DeviceAllocator):
    """Host memory standing in for device memory of type ``device_type``.

    Parameters:
        device_type: the name the device is registered under ("emu" by default).
        num_devices: how many indices exist (None: any index >= 0).
        capacity: bytes each index may hold at once (None: unlimited).
        fill: byte written into fresh allocations (None: leave uninitialised), so reads of
            memory nobody wrote show up as garbage instead of plausible zeros.
        log_limit: the most recent records `copies`, `allocated` and `freed` keep (None: all);
            the counters count everything either way, so a long run does not grow memory.
        asynchronous: run device work as a GPU does, after the host moves on (simulated
            streams, events and graphs: runtime/devices/simulated.py), so a missing host wait gives a
            wrong answer here too.

    Counters (reset by ``reset_counters()``): ``allocations``, ``deallocations``,
    ``failed_allocations``, ``copy_counts[direction]``, ``copy_bytes[direction]``,
    ``copies`` (CopyRecord list), ``allocated`` and ``freed`` (AllocationRecord lists),
    ``peak_live_bytes``.  ``live_bytes`` is state, not a counter: the bytes now allocated.
    """

    def __init__(
        self,
        device_type: str = "emu",
        *,
        num_devices: int | None = None,
        capacity: int | None = None,
        fill: int | None = 0xA5,
        default_alignment: int = 256,
        asynchronous: bool = False,
        log_limit: int | None = 10_000,
    ):
        self.device_type = device_type
        self.log_limit = log_limit
        self._streams = SimulatedApi(device_type) if asynchronous else None
        self.default_alignment = default_alignment
        self.num_devices = num_devices
        self.capacity = capacity
        self.fill = fill
        self.current_device = 0
        self._lock = threading.RLock()
        self._live: dict[int, _Live] = {}  # data_ptr -> allocation (non-empty ones)
        self._starts: list[int] = []  # sorted data_ptrs of self._live
        self._live_empty: dict[int, int] = {}  # index -> number of live zero-byte allocations
        self._live_bytes_per_index: dict[int, int] = {}
        self.live_bytes = 0
        self._attempts = 0
        self._fail_allocation_at: int | None = None
        self._copy_attempts = 0
        self._fail_copy_at: int | None = None
        self.reset_counters()

    # ---- test controls

    def reset_counters(self) -> None:
        """Zero every counter and clear the logs; live allocations stay live."""
        with self._lock:
            self.allocations = 0
            self.deallocations = 0
            self.failed_allocations = 0
            self.copy_counts = {d: 0 for d in DIRECTIONS}
            self.copy_bytes = {d: 0 for d in DIRECTIONS}
            self.copies: list[CopyRecord] = []
            self.allocated: list[AllocationRecord] = []
            self.freed: list[AllocationRecord] = []
            self.peak_live_bytes = self.live_bytes

    def fail_allocation(self, k: int = 1) -> None:
        """Make the k-th allocation from now (1-based) fail, as if the device ran out of memory."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"fail_allocation(k) needs an int k >= 1, got {k!r}")
        with self._lock:
            self._fail_allocation_at = self._attempts + k

    def fail_copy(self, k: int = 1) -> None:
        """Make the k-th copy (any direction) from now (1-based) fail."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"fail_copy(k) needs an int k >= 1, got {k!r}")
        with self._lock:
            self._fail_copy_at = self._copy_attempts + k

    @property
    def live_allocations(self) -> int:
        """How many allocations are live now."""
        with self._lock:
            return len(self._live) + sum(self._live_empty.values())

    def copy_summary(self) -> dict[str, tuple[int, int]]:
        """direction -> (count, bytes)."""
        with self._lock:
            return {d: (self.copy_counts[d], self.copy_bytes[d]) for d in DIRECTIONS}

    def streams_api(self):
        return self._streams

    # ---- lookups

    def _entry_at(self, ptr: int) -> _Live | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        entry = self._live[self._starts[i]]
        start = entry.record.data_ptr
        return entry if start <= ptr < start + entry.record.nbytes else None

    def device_index_of(self, memory_or_tensor) -> int | None:
        """The index whose live allocation holds this CPU tensor's first byte, or None."""
        t = memory_or_tensor
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
            return None
        with self._lock:
            entry = self._entry_at(t.data_ptr())
            return None if entry is None else entry.record.index

    def _owner(self, view: torch.Tensor, nbytes: int) -> _Live | None:
        if view.device.type != "cpu":
            return None
        entry = self._entry_at(view.data_ptr())
        if entry is None:
            return None
        end = entry.record.data_ptr + entry.record.nbytes
        if view.data_ptr() + nbytes > end:
            raise ValueError(
                f"{nbytes} bytes at {view.data_ptr():#x} run past the end of the "
                f"{entry.record.nbytes}-byte {self.device_type}:{entry.record.index} allocation "
                f"at {entry.record.data_ptr:#x}"
            )
        return entry

    # ---- hooks

    def _normalize_index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"device index must be an int, got {type(index).__name__} {index!r}")
        if index == -1:
            index = self.current_device
        if index < 0:
            raise ValueError(f"device index must be >= 0 (or -1 for the current device), got {index}")
        if self.num_devices is not None and index >= self.num_devices:
            raise ValueError(
                f"{self.device_type}:{index} does not exist; this emulated allocator has "
                f"{self.num_devices} device(s) ({self.device_type}:0..{self.num_devices - 1})"
            )
        return index

    def _allocate(self, nbytes: int, index: int, alignment: int) -> torch.Tensor:
        with self._lock:
            self._attempts += 1
            if self._fail_allocation_at == self._attempts:
                self._fail_allocation_at = None
                self.failed_allocations += 1
                raise MemoryError("out of memory (failure injected by EmulatedAllocator.fail_allocation)")
            used = self._live_bytes_per_index.get(index, 0)
            if self.capacity is not None and used + nbytes > self.capacity:
                self.failed_allocations += 1
                raise MemoryError(
                    f"out of memory: {used} of {self.capacity} bytes in use, {nbytes} more requested"
                )
            memory = allocate_aligned(nbytes, alignment)
            if self.fill is not None and nbytes:
                memory.fill_(self.fill)
            record = AllocationRecord(nbytes, index, alignment, memory.data_ptr() if nbytes else 0)
            if nbytes:
                self._live[record.data_ptr] = _Live(record, memory)
                bisect.insort(self._starts, record.data_ptr)
            else:
                self._live_empty[index] = self._live_empty.get(index, 0) + 1
            self._live_bytes_per_index[index] = used + nbytes
            self.live_bytes += nbytes
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
            self.allocations += 1
            self._log(self.allocated, record)
            return memory

    def _deallocate(self, memory: torch.Tensor, index: int) -> None:
        with self._lock:
            if memory.numel() == 0:
                if self._live_empty.get(index, 0) == 0:
                    raise ValueError(
                        f"no live zero-byte allocation on {self.device_type}:{index} (double free?)"
                    )
                self._live_empty[index] -= 1
                record = AllocationRecord(0, index, 0, 0)
            else:
                ptr = memory.data_ptr()
                entry = self._live.get(ptr)
                if entry is None:
                    raise ValueError(
                        f"{memory.numel()} bytes at {ptr:#x} are not a live {self.device_type} allocation "
                        "(double free, or memory from elsewhere)"
                    )
                record = entry.record
                if record.index != index or record.nbytes != memory.numel():
                    raise ValueError(
                        f"memory at {ptr:#x} is a {record.nbytes}-byte allocation on "
                        f"{self.device_type}:{record.index}, freed as {memory.numel()} bytes on "
                        f"{self.device_type}:{index}"
                    )
                del self._live[ptr]
                self._starts.remove(ptr)
            self._live_bytes_per_index[index] -= record.nbytes
            self.live_bytes -= record.nbytes
            self.deallocations += 1
            self._log(self.freed, record)

    def _check_copy_failure(self) -> None:
        self._copy_attempts += 1
        if self._fail_copy_at == self._copy_attempts:
            self._fail_copy_at = None
            raise RuntimeError("copy failure injected by EmulatedAllocator.fail_copy")

    def _device_side(self, name: str, view: torch.Tensor, nbytes: int, index: int) -> None:
        entry = self._owner(view, nbytes)
        if entry is None:
            raise ValueError(f"{name} is not {self.device_type} memory (address {view.data_ptr():#x})")
        if entry.record.index != index:
            raise ValueError(
                f"{name} is {self.device_type}:{entry.record.index} memory, not {self.device_type}:{index}"
            )

    def _host_side(self, name: str, view: torch.Tensor) -> None:
        if view.device.type != "cpu":
            raise ValueError(f"{name} must be host memory, got a tensor on {view.device}")
        entry = self._entry_at(view.data_ptr())
        if entry is not None:
            raise ValueError(
                f"{name} is {self.device_type}:{entry.record.index} memory, not host memory"
            )

    def _log(self, records: list, record) -> None:
        records.append(record)
        if self.log_limit is not None and len(records) > self.log_limit:
            del records[: len(records) - self.log_limit]

    def _record(self, record: CopyRecord) -> None:
        self.copy_counts[record.direction] += 1
        self.copy_bytes[record.direction] += record.nbytes
        self._log(self.copies, record)

    def _copy_h2d(self, dst, src, nbytes, index):
        with self._lock:
            self._check_copy_failure()
            self._device_side("dst", dst, nbytes, index)
            self._host_side("src", src)
            dst.copy_(src)
            self._record(CopyRecord("h2d", nbytes, index))

    def _copy_d2h(self, dst, src, nbytes, index):
        with self._lock:
            self._check_copy_failure()
            self._device_side("src", src, nbytes, index)
            self._host_side("dst", dst)
            dst.copy_(src)
            self._record(CopyRecord("d2h", nbytes, index))

    def _copy_d2d(self, dst, src, nbytes, dst_index, src_index):
        with self._lock:
            self._check_copy_failure()
            self._device_side("dst", dst, nbytes, dst_index)
            self._device_side("src", src, nbytes, src_index)
            dst.copy_(src)
            self._record(CopyRecord("d2d", nbytes, dst_index, src_index))

    def __repr__(self) -> str:
        return (
            f"EmulatedAllocator(device_type={self.device_type!r}, live={self.live_allocations} "
            f"allocations / {self.live_bytes} bytes)"
        )


@contextlib.contextmanager
def emulated_device(device_type: str = "emu", **options):
    """Register a fresh EmulatedAllocator for the block; unregister it afterwards. Yields it."""
    allocator = EmulatedAllocator(device_type, **options)
    register_allocator(allocator)
    try:
        yield allocator
    finally:
        if get_allocator(device_type) is allocator:
            unregister_allocator(device_type)
