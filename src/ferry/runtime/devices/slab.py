"""One allocation per device for everything a load keeps: a slab, handed out in pieces.

Allocated one by one through PyTorch's caching allocator, a method's weights of 1-10 MiB and its
arena each land in a 20 MiB segment whose free tail nothing else uses (CUDA graphs allocate from
a pool of their own): ferry held more than eager (EfficientNet-B0 90 vs 72 MiB). A load instead
reserves, per device, one allocation of exactly the pieces it predicts (program/footprint.py
`load_pieces`), each rounded up to the allocator's default alignment, and hands them out front
to back. A request the slab has no room for (a short prediction, a load after the seal) gets an
allocation of its own: never an error, never wrong memory. Host memory is not reserved.

A load whose graphs will be captured makes its slab inside the set's graph pool with room left
free behind it (`MemoryReservation`'s `tails`): what the graphs' kernels allocate then fits in
the slab's own segment instead of one of its own.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable

import torch

from ferry.device import Device
from ferry.errors import AllocationError
from ferry.runtime.devices.allocator import DeviceMemoryBuffer, HeldMemory, require_allocator

__all__ = ["MemoryReservation", "Slab", "SlabPiece", "allocate", "reserved_bytes", "round_up"]


def round_up(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


class SlabPiece(HeldMemory):
    """Bytes of a slab, in the shape of a DeviceMemoryBuffer: `close()` (once; or garbage
    collection) gives them back, and the slab frees itself when the last piece is back."""

    pinned = False
    _gone = "went back to its slab"

    def __init__(self, slab: Slab, memory: torch.Tensor, alignment: int):
        self._memory = memory
        self.nbytes, self.device, self.alignment = memory.numel(), slab.device, alignment
        self._finalizer = weakref.finalize(self, slab._release)

    def __repr__(self) -> str:
        state = "closed" if self._memory is None else f"at {self._memory.data_ptr():#x}"
        return f"SlabPiece({self.nbytes} bytes on {self.device}, {state})"


class Slab:
    """One allocation on one device, handed out front to back (bump allocation). Its memory is
    freed once it is sealed and every piece it handed out is closed; pieces are never freed
    through the allocator one by one (it knows only the slab)."""

    def __init__(self, device: Device, nbytes: int, tail: int = 0, home=None):
        """`home`: a context whose allocations come from a graph pool; `tail`: bytes to leave
        free there right behind the slab (made as one block of both, handed back, then the slab
        taken from its front: the caching allocator splits the block, and the rest stays free in
        the same segment)."""
        self.device, self.tail = device, 0
        probe = None
        with home if home is not None else contextlib.nullcontext():
            if tail and home is not None:
                with contextlib.suppress(AllocationError):  # no room for both: the slab alone
                    block = DeviceMemoryBuffer.create(nbytes + tail, device)
                    probe = block.memory.data_ptr()
                    block.close()
            self._buffer: DeviceMemoryBuffer | None = DeviceMemoryBuffer.create(nbytes, device)
        caching = getattr(self._buffer.allocator, "caching", False)
        if probe is not None and (self._buffer.memory.data_ptr() == probe or not caching):  # the block split:
            self.tail = tail  # the room is free behind the slab (an emulated device keeps no such block)
        self.nbytes, self.alignment = nbytes, self._buffer.alignment
        self.used = 0  # bytes handed out, each piece's padding included
        self._pieces, self._sealed = 0, False
        self._lock = threading.Lock()

    def take(self, nbytes: int, alignment: int | None = None) -> SlabPiece | None:
        """The next `nbytes`, starting at an address aligned to `alignment` (the allocator's
        default when None), or None when the slab has no room for them or is sealed."""
        alignment = alignment or self.alignment
        with self._lock:
            if self._sealed or self._buffer is None:
                return None
            memory = self._buffer.memory
            start = self.used + (-(memory.data_ptr() + self.used)) % alignment
            if start + nbytes > self.nbytes:
                return None
            self.used = min(start + round_up(nbytes, self.alignment), self.nbytes)
            self._pieces += 1
        return SlabPiece(self, memory[start:start + nbytes], alignment)

    @property
    def closed(self) -> bool:
        return self._buffer is None

    def seal(self) -> None:
        """No more pieces are handed out; the memory is freed now if none is held."""
        with self._lock:
            self._sealed = True
            free = self._pieces == 0
        if free:
            self._free()

    def _release(self) -> None:
        with self._lock:
            self._pieces -= 1
            free = self._sealed and self._pieces == 0
        if free:
            self._free()

    def _free(self) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            buffer.close()

    def __repr__(self) -> str:
        state = "freed" if self._buffer is None else f"{self.used} used, {self._pieces} pieces held"
        return f"Slab({self.nbytes} bytes on {self.device}, {state})"


def reserved_bytes(pieces: Iterable[tuple]) -> dict[Device, int]:
    """Per device, the slab a reservation of `pieces` ((device, nbytes[, alignment]) each; host
    pieces left out) allocates: each piece rounded up to the device allocator's default
    alignment, plus room for the padding of a piece that asks for a larger one."""
    sizes: dict[Device, int] = {}
    for device, nbytes, *alignment in pieces:
        if not device.is_cpu:
            default = require_allocator(device.local, "a load's memory").default_alignment
            asked = alignment[0] if alignment and alignment[0] else default
            sizes[device.local] = sizes.get(device.local, 0) + round_up(nbytes, default) + max(asked - default, 0)
    return sizes


class MemoryReservation:
    """What one load allocates on its devices: a slab per device of the `pieces` it predicts
    ((device, nbytes[, alignment]) each; host pieces are left out), each rounded up to the device
    allocator's default alignment so every piece starts aligned. A piece that asks for a larger
    alignment (a buffer compiled with `alignment=4096`) is given room for its padding wherever it
    lands. A device whose slab cannot be allocated in one piece (its free memory fragmented) gets
    each piece allocated on its own, as the load would without a reservation. Sealed when the load
    is over.

    `tails` and `home` (graphs to be captured): per device, bytes to leave free behind its slab,
    in the memory `home(device)` (a context) allocates from; `Slab.tail` says what was left."""

    def __init__(self, pieces: Iterable[tuple], tails: dict[Device, int] | None = None, home=None):
        sizes = reserved_bytes(pieces)
        self.slabs: dict[Device, Slab] = {}
        try:
            for device, nbytes in sizes.items():
                if nbytes:
                    place = () if home is None else ((tails or {}).get(device, 0), home(device))
                    with contextlib.suppress(AllocationError):  # no room for it in one piece (memory
                        self.slabs[device] = Slab(device, nbytes, *place)  # fragmented): each piece alone
        except BaseException:
            self.seal()
            raise

    def take(self, nbytes: int, device: Device, alignment: int | None = None, *,
             pin_memory: bool = False) -> SlabPiece | DeviceMemoryBuffer:
        """`nbytes` on `device`: a piece of its slab, or an allocation of its own when the slab
        has no room (a short prediction) or the device has none (host memory)."""
        slab = self.slabs.get(device.local)
        piece = slab.take(nbytes, alignment) if slab is not None else None
        return piece if piece is not None else DeviceMemoryBuffer.create(nbytes, device, alignment,
                                                                         pin_memory=pin_memory)

    def seal(self) -> None:
        """The load is over: a slab no piece holds is freed now, the others with their last piece."""
        for slab in self.slabs.values():
            slab.seal()

    def __enter__(self) -> MemoryReservation:
        return self

    def __exit__(self, *exc_info) -> None:
        self.seal()


def allocate(nbytes: int, device: Device, alignment: int | None = None, *, pin_memory: bool = False,
             reservation: MemoryReservation | None = None) -> SlabPiece | DeviceMemoryBuffer:
    """Memory a load keeps: from its `reservation` when there is one, else an allocation of its own."""
    if reservation is not None:
        return reservation.take(nbytes, device, alignment, pin_memory=pin_memory)
    return DeviceMemoryBuffer.create(nbytes, device, alignment, pin_memory=pin_memory)
