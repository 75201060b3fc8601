"""The Device value type: where a tensor lives, independent of torch.device.

This module also holds the table of registered device types (type -> its allocator): the
one fact both parsing ("is 'emu' a known type?") and the runtime ("which allocator serves
'emu'?") read. `ferry.runtime.register_allocator` validates and writes it.
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from typing import Protocol

BUILTIN_DEVICE_TYPES = ("cpu", "cuda")


class RegisteredAllocator(Protocol):
    """What this table needs of an allocator (runtime/devices/allocator.py defines the rest)."""

    device_type: str


# a registry (the one table of device types), written only through runtime/devices/allocator.py
_allocators: dict[str, RegisteredAllocator] = {}
_allocators_lock = threading.Lock()

# the canonical spelling, as program files store it: an optional 'rankN:' (a device of another
# process, issue "stages on other ranks"), a lowercase type, ':' and an index
_CANONICAL = re.compile(r"(?:rank(0|[1-9][0-9]{0,8}):)?([a-z_][a-z0-9_]*):(0|[1-9][0-9]{0,17})\Z")
_RANK = re.compile(r"\s*rank\s*([0-9]+)\s*:(.*)\Z", re.IGNORECASE | re.DOTALL)


def registered_allocator(device_type: str):
    """The allocator registered for `device_type`, or None."""
    with _allocators_lock:
        return _allocators.get(device_type)


def _set_allocator(device_type: str, allocator) -> None:
    """Write the table (ferry.runtime.devices.allocator validates first); ValueError if taken."""
    with _allocators_lock:
        existing = _allocators.get(device_type)
        if existing is not None:
            raise ValueError(
                f"an allocator for device type {device_type!r} is already registered ({existing!r}); "
                f"call ferry.runtime.unregister_allocator({device_type!r}) first to replace it"
            )
        _allocators[device_type] = allocator


def _pop_allocator(device_type: str):
    with _allocators_lock:
        return _allocators.pop(device_type, None)


def _allocator_snapshot() -> dict[str, RegisteredAllocator]:
    with _allocators_lock:
        return dict(_allocators)


def known_device_types() -> tuple[str, ...]:
    """cpu and cuda, plus every type with a registered allocator."""
    extra = tuple(t for t in _allocator_snapshot() if t not in BUILTIN_DEVICE_TYPES)
    return BUILTIN_DEVICE_TYPES + tuple(sorted(extra))


@functools.total_ordering
@dataclass(frozen=True)
class Device:
    """A device of one process: `rank` is the torch.distributed rank whose process owns it (0 for
    a program that runs in one process). Its index is the device's index in that process.
    Devices sort by rank first, so a rank's devices list together."""

    type: str
    index: int = 0
    rank: int = 0

    def __post_init__(self):
        if not isinstance(self.type, str) or not self.type:
            raise ValueError(f"device type must be a non-empty string, got {self.type!r}")
        if isinstance(self.index, bool) or not isinstance(self.index, int):
            raise ValueError(f"device index must be an integer, got {self.index!r}")
        if self.index < 0:
            raise ValueError(f"device index must be >= 0, got {self.index} in {self.type}:{self.index}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"device rank must be an integer >= 0, got {self.rank!r}")

    @classmethod
    def parse(cls, text: str | Device) -> Device:
        """Parse 'cuda:1', 'CUDA:1', ' cuda ', 'cpu' (index 0 when absent), 'rank1:cuda:0' (a
        device of the process of rank 1)."""
        if isinstance(text, Device):
            return text
        if not isinstance(text, str):
            raise ValueError(f"expected a device string like 'cuda:0', got {type(text).__name__}")
        ranked = _RANK.match(text)
        if ranked is not None:
            digits, rest = ranked.group(1), ranked.group(2)
            if len(digits.lstrip("0") or "0") > 9 or _RANK.match(rest):
                raise ValueError(f"{text!r}: a device names one rank, 'rankN:' with N < 10**9, e.g. 'rank1:cuda:0'")
            local = cls.parse(rest)
            return cls(local.type, local.index, int(digits))
        s = text.strip().lower()
        kind, sep, idx = s.partition(":")
        kind = kind.strip()
        known = known_device_types()
        if kind not in known:
            raise ValueError(
                f"unknown device type {kind!r} in {text!r}; known types: {', '.join(known)} "
                "(register an allocator with ferry.runtime.register_allocator to add one)"
            )
        if not sep:
            return cls(kind, 0)
        idx = idx.strip()
        if not idx.isdigit():
            raise ValueError(f"device index in {text!r} must be a non-negative integer, got {idx!r}")
        return cls(kind, int(idx))

    @classmethod
    def from_canonical(cls, text: str) -> Device:
        """Exactly '[rankN:]type:index' (as str(device) writes it and program files store it);
        any device type, known here or not. ValueError otherwise."""
        m = _CANONICAL.match(text) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"device {text!r} is not '[rankN:]type:index' (lowercase type, index >= 0), "
                             "e.g. 'cuda:0' or 'rank1:cuda:0'")
        return cls(m.group(2), int(m.group(3)), int(m.group(1) or 0))

    @property
    def is_cpu(self) -> bool:
        return self.type == "cpu"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Device):
            return NotImplemented
        return (self.rank, self.type, self.index) < (other.rank, other.type, other.index)

    @property
    def local(self) -> Device:
        """The same device as its own process names it (rank left out)."""
        return Device(self.type, self.index) if self.rank else self

    def __str__(self) -> str:
        return f"rank{self.rank}:{self.type}:{self.index}" if self.rank else f"{self.type}:{self.index}"

    def to_torch(self):
        """The torch.device holding this device's memory (emulated devices live in host memory)."""
        import torch

        if self.type == "cuda":
            return torch.device("cuda", self.index)
        return torch.device("cpu")


CPU = Device("cpu", 0)
