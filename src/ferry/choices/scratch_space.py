"""Where a load's timing takes its stand-in tensors: the planned arena of the method loading.

Timing a kernel choice (choices/timing.py) runs each form on stand-ins for the values of a call
(an activation read, the result written). Allocated through the caching allocator, a stand-in of
1-10 MiB takes a 20 MiB segment for the moment it is timed, on top of the load's one allocation
per device: DistilBERT's load reserved 314 MiB at its peak, against eager's 308 for the whole run.
While a method loads, nothing lives in its arena yet (no call has run), and the values a choice
is timed on lie in that arena together when the method runs, so their stand-ins are carved from
it instead. A stand-in the arena has no room for is allocated as before. Once a load writes
planned memory (a mutable buffer's first value: a layout ferry's emitter never writes, but a
file may), nothing more is carved during that load.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import torch

__all__ = ["ScratchSpace", "carved_from", "take", "withdraw"]

ALIGNMENT = 256  # bytes: what CUDA's allocator gives every block


class ScratchSpace:
    """Bytes of one device lent out front to back. A piece is back once its tensor is garbage
    (a stand-in lives for one timing); with every piece back, lending starts at the front again."""

    def __init__(self, memory: torch.Tensor):
        self.memory = memory  # 1-D uint8
        self.withdrawn = False
        self._lent: list[tuple[weakref.ref, int]] = []  # (piece, the byte after it)
        self._lock = threading.Lock()

    def take(self, shape, stride, dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of this layout over free bytes of the space, or None (no room, or withdrawn)."""
        nbytes = extent(shape, stride) * dtype.itemsize
        if nbytes == 0:
            return None
        with self._lock:
            if self.withdrawn:
                return None
            self._lent = [(ref, end) for ref, end in self._lent if ref() is not None]
            start = max((end for _, end in self._lent), default=0)
            start += -(self.memory.data_ptr() + start) % ALIGNMENT
            span = -(-nbytes // dtype.itemsize) * dtype.itemsize
            if start + span > self.memory.numel():
                return None
            piece = self.memory[start:start + span].view(dtype).as_strided(tuple(shape), tuple(stride))
            self._lent.append((weakref.ref(piece), start + span))
        return piece


def extent(shape, stride) -> int:
    """Elements of storage a layout reaches (0 for an empty one)."""
    if 0 in tuple(shape):
        return 0
    return 1 + sum((size - 1) * abs(st) for size, st in zip(shape, stride))


_SPACES: contextvars.ContextVar[Mapping[tuple[str, int], ScratchSpace]] = contextvars.ContextVar(
    "ferry_scratch_spaces", default=MappingProxyType({}))


def _key(device: torch.device) -> tuple[str, int] | None:
    """A device named by its index; None for a GPU named without one (which one is it?)."""
    if device.type == "cpu":
        return ("cpu", 0)  # (an emulated device's memory: its timing is faked in tests)
    return None if device.index is None else (device.type, device.index)


@contextlib.contextmanager
def carved_from(arenas: Mapping[torch.device, torch.Tensor]) -> Iterator[None]:
    """Stand-ins made inside are carved from `arenas` (a 1-D uint8 tensor per device, free until
    the block ends). A device that already has a space here (a delegate loading inside its
    caller's load, in the caller's arena) keeps it: two spaces over one arena would overlap."""
    current = _SPACES.get()
    added = {k: ScratchSpace(m) for d, m in arenas.items() if (k := _key(d)) is not None and k not in current}
    token = _SPACES.set({**current, **added})
    try:
        yield
    finally:
        _SPACES.reset(token)
        for space in added.values():
            space.withdrawn = True  # a piece kept past the load must not make the arena lend again


def take(device: torch.device, shape, stride, dtype: torch.dtype) -> torch.Tensor | None:
    """A stand-in carved from `device`'s space, or None (no space, no room): the caller allocates."""
    key = _key(device)
    space = _SPACES.get().get(key) if key is not None else None
    return space.take(shape, stride, dtype) if space is not None else None


def withdraw() -> None:
    """Planned memory is being written at load: no space of this load lends any more."""
    for space in _SPACES.get().values():
        space.withdrawn = True

