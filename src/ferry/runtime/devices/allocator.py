"""Device allocators: the interface, the process-wide registry, and DeviceMemoryBuffer.

Memory is a torch tensor: one allocation is a 1-D ``torch.uint8`` tensor of exactly
``nbytes`` elements whose ``data_ptr()`` is aligned.  Host and emulated memory are
CPU tensors; CUDA memory is a CUDA tensor.

A ``DeviceAllocator``'s public methods validate their arguments and add context to
errors ("allocation of 4096 bytes on cuda:1 failed: out of memory"); a backend
implements only the small underscore hooks.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from types import MappingProxyType
from typing import cast

import torch

from ferry import device as _device
from ferry.alignment import check_alignment, default_alignment
from ferry.device import Device
from ferry.errors import AllocationError, DeviceError, DeviceIndexError

__all__ = [
    "DeviceAllocator",
    "DeviceMemoryBuffer",
    "HeldMemory",
    "allocate_aligned",
    "as_bytes",
    "get_allocator",
    "memory_bytes",
    "register_allocator",
    "registered_allocators",
    "registered_device_types",
    "require_allocator",
    "unregister_allocator",
]

_DIRECTIONS = MappingProxyType({
    "h2d": "host-to-device",
    "d2h": "device-to-host",
    "d2d": "device-to-device",
})


# ----------------------------------------------------------------------------------------
# small validation helpers


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_alignment(alignment) -> int:
    if isinstance(alignment, bool) or not isinstance(alignment, int):
        raise TypeError(f"alignment must be an int, got {type(alignment).__name__} {alignment!r}")
    return check_alignment(alignment)


def as_bytes(tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """A flat ``torch.uint8`` view (no copy) of a contiguous tensor's bytes."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.uint8 and tensor.dim() == 1 and tensor.is_contiguous():
        return tensor
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous to be viewed as bytes (shape {tuple(tensor.shape)}, "
            f"strides {tuple(tensor.stride())}); call .contiguous() first"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(f"{name} is a lazy conjugate/negative view; call .resolve_conj().resolve_neg() first")
    return tensor.reshape(-1).view(torch.uint8)


def memory_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bytes as they lie in memory (contiguous, or a permuted layout): what a
    byte copy between two tensors of one layout moves."""
    if t.is_contiguous() or t.numel() == 0:
        return as_bytes(t)
    return as_bytes(torch.as_strided(t, (t.numel(),), (1,), t.storage_offset()))


def _exact_slice(base: torch.Tensor, nbytes: int, alignment: int) -> torch.Tensor:
    """The first ``alignment``-aligned run of ``nbytes`` bytes inside the host tensor ``base``,
    as a tensor whose storage is exactly those bytes (it keeps ``base`` alive)."""
    pad = (-base.data_ptr()) % alignment
    if pad + nbytes > base.numel():  # pragma: no cover - callers over-allocate enough
        raise AllocationError(f"cannot place {nbytes} bytes aligned to {alignment} in a {base.numel()}-byte block")
    # numpy's view of the block has the buffer protocol, and frombuffer makes a storage of just
    # the bytes asked for: torch never sees the slack around them
    return torch.frombuffer(base.numpy(), dtype=torch.uint8, count=nbytes, offset=pad)


def allocate_aligned(nbytes: int, alignment: int, *, device="cpu", pin_memory: bool = False) -> torch.Tensor:
    """Host memory of exactly ``nbytes`` bytes whose address is ``alignment``-aligned.

    The tensor's storage is the allocation itself, never a larger block: torch kernels that
    work on a tensor's whole storage (the ``*_scatter`` ops clone it, ``as_strided`` indexes
    it) then see what was planned and nothing else. torch's own allocations are aligned to
    64 bytes (and page-locked ones to a page), which covers the usual request; a larger
    alignment takes a block with slack and a storage over the aligned part of it.
    """
    if torch.device(device).type != "cpu":
        raise ValueError(f"allocate_aligned makes host memory, not memory on {device}")
    memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    if nbytes == 0 or memory.data_ptr() % alignment == 0:
        return memory
    del memory
    base = torch.empty(nbytes + alignment - 1, dtype=torch.uint8, pin_memory=pin_memory)
    return _exact_slice(base, nbytes, alignment)


# ----------------------------------------------------------------------------------------
# the interface


class DeviceAllocator:
    """Interface one device type implements.

    Public methods validate and add context; backends implement the underscore hooks:

    - ``_allocate(nbytes, index, alignment) -> torch.Tensor`` (1-D uint8, ``nbytes`` long,
      ``data_ptr() % alignment == 0``)
    - ``_deallocate(memory, index)``
    - ``_copy_h2d(dst, src, nbytes, index)`` / ``_copy_d2h(dst, src, nbytes, index)``
    - optionally ``_copy_d2d(dst, src, nbytes, dst_index, src_index)``
    - optionally ``_normalize_index(index)`` (e.g. to accept -1 for "current device")
    - optionally ``device_index_of(tensor)`` for host-backed device memory
    - optionally ``_bind_copy(direction, dst, src, nbytes, *indices)``: a copy a method repeats
      on every call, with whatever can be decided once decided here
    - optionally ``streams_api()``: for a device that runs asynchronously to the host

    Copy hooks receive flat uint8 tensors of exactly ``nbytes`` bytes.
    """

    device_type: str = ""
    default_alignment: int = default_alignment("device")
    # memory freed is kept and handed out again, the front of a larger free block first (PyTorch's
    # caching allocator): a slab then knows whether the room behind it is free (devices/slab.py)
    caching: bool = False

    # ---- helpers

    def _where(self, index) -> str:
        return f"{self.device_type}:{index}"

    def _normalize_index(self, index: int) -> int:
        """Map a caller's device index to a concrete one; the default accepts only >= 0."""
        return _check_int("device index", index, 0)

    @property
    def supports_device_to_device(self) -> bool:
        """True when this allocator implements ``_copy_d2d``."""
        return type(self)._copy_d2d is not DeviceAllocator._copy_d2d

    # ---- public API

    def allocate(self, nbytes: int, index: int, alignment: int | None = None) -> torch.Tensor:
        """Allocate ``nbytes`` on device ``index``; returns a 1-D uint8 tensor, aligned."""
        _check_int("nbytes", nbytes, 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"device index must be an int, got {type(index).__name__} {index!r}")
        try:
            index = self._normalize_index(index)
        except ValueError as exc:  # no such device: the allocation cannot happen
            raise DeviceIndexError(f"allocation of {nbytes} bytes on {self._where(index)} failed: {exc}") from None
        alignment = _check_alignment(self.default_alignment if alignment is None else alignment)
        where = self._where(index)
        try:
            memory = self._allocate(nbytes, index, alignment)
        except Exception as exc:
            raise AllocationError(f"allocation of {nbytes} bytes on {where} failed: {exc}") from exc
        problem = self._check_allocation(memory, nbytes, alignment)
        if problem is not None:
            if isinstance(memory, torch.Tensor):
                try:  # best effort: do not leak what the backend handed out
                    self._deallocate(memory, index)
                except Exception:
                    pass
            raise AllocationError(
                f"allocation of {nbytes} bytes on {where} failed: {type(self).__name__}._allocate "
                f"returned {problem}; expected a 1-D torch.uint8 tensor of {nbytes} bytes aligned to {alignment}"
            )
        return memory

    @staticmethod
    def _check_allocation(memory, nbytes: int, alignment: int) -> str | None:
        if not isinstance(memory, torch.Tensor):
            return f"a {type(memory).__name__}"
        if memory.dtype != torch.uint8 or memory.dim() != 1:
            return f"a {memory.dtype} tensor of shape {tuple(memory.shape)}"
        if memory.numel() != nbytes:
            return f"{memory.numel()} bytes"
        if not memory.is_contiguous():
            return "a non-contiguous tensor"
        if nbytes and memory.data_ptr() % alignment:
            return f"address {memory.data_ptr():#x}, not aligned to {alignment}"
        return None

    def deallocate(self, memory: torch.Tensor, index: int) -> None:
        """Free memory returned by ``allocate(..., index)``."""
        if not isinstance(memory, torch.Tensor):
            raise TypeError(f"memory must be a torch.Tensor, got {type(memory).__name__}")
        index = self._normalize_index(index)
        try:
            self._deallocate(memory, index)
        except Exception as exc:
            raise DeviceError(
                f"deallocation of {memory.numel() * memory.element_size()} bytes on "
                f"{self._where(index)} failed: {exc}"
            ) from exc

    def copy_host_to_device(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, index: int) -> None:
        """Copy ``nbytes`` from host ``src`` into device ``dst`` (on device ``index``)."""
        index = self._normalize_index(index)
        d, s = self._copy_args("h2d", dst, src, nbytes, self._where(index))
        if nbytes == 0:
            return
        self._run_copy("h2d", f"to {self._where(index)}", nbytes, self._copy_h2d, d, s, nbytes, index)

    def copy_device_to_host(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, index: int) -> None:
        """Copy ``nbytes`` from device ``src`` (on device ``index``) into host ``dst``."""
        index = self._normalize_index(index)
        d, s = self._copy_args("d2h", dst, src, nbytes, self._where(index))
        if nbytes == 0:
            return
        self._run_copy("d2h", f"from {self._where(index)}", nbytes, self._copy_d2h, d, s, nbytes, index)

    def copy_device_to_device(
        self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, dst_index: int, src_index: int
    ) -> None:
        """Copy ``nbytes`` from device ``src_index``'s ``src`` into device ``dst_index``'s ``dst``."""
        dst_index = self._normalize_index(dst_index)
        src_index = self._normalize_index(src_index)
        where = f"from {self._where(src_index)} to {self._where(dst_index)}"
        d, s = self._copy_args("d2d", dst, src, nbytes, where)
        if nbytes == 0:
            return
        self._run_copy("d2d", where, nbytes, self._copy_d2d, d, s, nbytes, dst_index, src_index)

    def device_index_of(self, memory_or_tensor) -> int | None:
        """Which index of this device type owns the memory behind a CPU tensor, or None."""
        return None

    def _copy_args(self, direction, dst, src, nbytes, where):
        _check_int("nbytes", nbytes, 0)
        d = as_bytes(dst, "dst")
        s = as_bytes(src, "src")
        if nbytes > d.numel() or nbytes > s.numel():
            raise ValueError(
                f"{_DIRECTIONS[direction]} copy of {nbytes} bytes {where} does not fit: "
                f"dst has {d.numel()} bytes, src has {s.numel()} bytes"
            )
        return d[:nbytes], s[:nbytes]

    def _run_copy(self, direction, where, nbytes, hook, *args):
        try:
            hook(*args)
        except Exception as exc:
            raise DeviceError(f"{_DIRECTIONS[direction]} copy of {nbytes} bytes {where} failed: {exc}") from exc

    # ---- hooks

    def streams_api(self):
        """The streams API of an asynchronous device (runtime/devices/streams.py), or None: copies and
        kernels on this device finish before the host goes on."""
        return None

    def _bind_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, nbytes: int, *indices: int):
        """A zero-argument copy between two fixed byte views (``indices``: the device index, or
        destination and source index for d2d). The default calls the copy hook each time."""
        hooks: dict[str, Callable[..., None]] = {"h2d": self._copy_h2d, "d2h": self._copy_d2h, "d2d": self._copy_d2d}
        hook = hooks[direction]
        return functools.partial(hook, dst, src, nbytes, *indices)

    def _allocate(self, nbytes: int, index: int, alignment: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement _allocate")

    def _deallocate(self, memory: torch.Tensor, index: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _deallocate")

    def _copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, index: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _copy_h2d")

    def _copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, index: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _copy_d2h")

    def _copy_d2d(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, dst_index: int, src_index: int) -> None:
        raise DeviceError(f"{self.device_type} does not support device-to-device copies")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_type={self.device_type!r})"


# ----------------------------------------------------------------------------------------
# the registry (the table itself lives in ferry.device: parsing reads it too)


def register_allocator(allocator: DeviceAllocator) -> None:
    """Make ``allocator`` the process-wide allocator of its ``device_type``."""
    if not isinstance(allocator, DeviceAllocator):
        raise TypeError(f"register_allocator expects a DeviceAllocator, got {type(allocator).__name__}")
    kind = allocator.device_type
    if not isinstance(kind, str) or not kind or kind != kind.strip().lower() or ":" in kind:
        raise ValueError(
            f"{allocator!r} has device_type {kind!r}; it must be a non-empty lowercase name without ':' or spaces"
        )
    if kind == "cpu":
        raise ValueError("cannot register an allocator for 'cpu': host memory is built in")
    _device._set_allocator(kind, allocator)


def get_allocator(device_type: str) -> DeviceAllocator | None:
    """The registered allocator of ``device_type``, or None."""
    return _device.registered_allocator(device_type)


def require_allocator(device: Device, need: str = "") -> DeviceAllocator:
    """The allocator of ``device``'s type; DeviceError saying how to register one if there is none."""
    allocator = _device.registered_allocator(device.type)
    if allocator is None:
        needed = f" (needed for {need})" if need else ""
        raise DeviceError(
            f"no allocator is registered for device type {device.type!r}{needed}; register one with "
            "ferry.runtime.register_allocator(...) (CUDA registers itself when a GPU is present; the "
            "emulated device needs ferry.runtime.register_allocator(ferry.runtime.EmulatedAllocator()))"
        )
    return allocator


def unregister_allocator(device_type: str) -> DeviceAllocator | None:
    """Remove and return the allocator of ``device_type`` (None if there was none)."""
    return _device._pop_allocator(device_type)


def registered_device_types() -> tuple[str, ...]:
    """Device types with a registered allocator, sorted."""
    return tuple(sorted(_device._allocator_snapshot()))


def registered_allocators() -> tuple[DeviceAllocator, ...]:
    """A snapshot of every registered allocator, ordered by device type."""
    table = _device._allocator_snapshot()
    return tuple(cast(DeviceAllocator, table[k]) for k in sorted(table))  # (only register_allocator writes it)


# ----------------------------------------------------------------------------------------
# DeviceMemoryBuffer


def _free(allocator: DeviceAllocator | None, memory: torch.Tensor, index: int) -> None:
    if allocator is not None:
        allocator.deallocate(memory, index)


class HeldMemory:
    """Memory held until `close()` (once) or garbage collection runs `_finalizer`: the shape of
    DeviceMemoryBuffer and of a slab's piece (runtime/devices/slab.py)."""

    _memory: torch.Tensor | None
    _finalizer: weakref.finalize
    _gone = "was freed"  # what became of the memory, for the error a closed one raises

    @property
    def memory(self) -> torch.Tensor:
        """The memory: a 1-D uint8 tensor of ``nbytes`` bytes."""
        if self._memory is None:
            raise ValueError(f"{self!r} is closed; its memory {self._gone}")
        return self._memory

    @property
    def closed(self) -> bool:
        return self._memory is None

    def close(self) -> None:
        """Give the memory back now; later calls do nothing."""
        if self._memory is None:
            return
        self._memory = None
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class DeviceMemoryBuffer(HeldMemory):
    """Owns one allocation; frees it exactly once.

    Freed by ``close()``, by leaving a ``with`` block, or when garbage collected.
    Host buffers (``Device('cpu')``) are plain torch memory, optionally page-locked.
    """

    def __init__(
        self,
        memory: torch.Tensor,
        device: Device,
        allocator: DeviceAllocator | None,
        alignment: int,
        pinned: bool = False,
    ):
        self._memory: torch.Tensor | None = memory
        self.nbytes = memory.numel()
        self.device = device
        self.alignment = alignment
        self.pinned = pinned
        self.allocator = allocator
        self._finalizer = weakref.finalize(self, _free, allocator, memory, device.index)

    @classmethod
    def create(
        cls,
        nbytes: int,
        device: Device | str,
        alignment: int | None = None,
        *,
        pin_memory: bool = False,
    ) -> DeviceMemoryBuffer:
        """Allocate ``nbytes`` on ``device`` through its registered allocator (or torch, for cpu).

        ``pin_memory`` page-locks host buffers when CUDA is available and is ignored otherwise.
        """
        device = Device.parse(device)
        _check_int("nbytes", nbytes, 0)
        if device.is_cpu:
            alignment = _check_alignment(default_alignment("cpu") if alignment is None else alignment)
            pin = bool(pin_memory) and torch.cuda.is_available()
            try:
                memory = allocate_aligned(nbytes, alignment, pin_memory=pin)
            except Exception as exc:
                raise AllocationError(f"allocation of {nbytes} bytes on {device} failed: {exc}") from exc
            return cls(memory, device, None, alignment, pinned=pin)

        allocator = require_allocator(device, f"{nbytes} bytes on {device}")
        if alignment is None:
            alignment = allocator.default_alignment
        memory = allocator.allocate(nbytes, device.index, alignment)
        return cls(memory, device, allocator, alignment)

    def __repr__(self) -> str:
        state = "closed" if self._memory is None else f"at {self._memory.data_ptr():#x}"
        pinned = ", pinned" if self.pinned else ""
        return f"DeviceMemoryBuffer({self.nbytes} bytes on {self.device}{pinned}, {state})"

