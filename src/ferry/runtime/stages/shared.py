"""What a module holds once for all its methods: device copies of the program's weights, and
the program's state (its mutable buffers: a KV cache).

Methods compiled together from one model (prefill and decode) read the same weights and update
the same cache. Each weight is uploaded to a device once, whichever method or delegate asks for
it first, and freed when the module closes; each state is one tensor per set of memory (a
module with `concurrency=k` holds k caches, one per concurrent caller), made when the first
method naming it loads and set to its initial value again by `reset`. Made while a method loads,
both take their memory from that load's reservation (runtime/devices/slab.py) when given one.
"""

from __future__ import annotations

import threading
import warnings

import torch

from ferry.program.schema import TensorValue, upload_key
from ferry.program.states import program_states
from ferry.progress import Progress, tell
from ferry.runtime.devices.allocator import HeldMemory, memory_bytes, require_allocator
from ferry.runtime.devices.slab import MemoryReservation, allocate
from ferry.runtime.devices.tensor import make_tensor

__all__ = ["DeviceUploads", "ProgramState", "constant_tensor", "upload"]


def constant_tensor(segment, v: TensorValue) -> torch.Tensor:
    """A CPU tensor over a program segment (a mapped file region): no copy."""
    if v.nbytes == 0:
        return torch.empty(v.shape, dtype=v.torch_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only mapping: ferry never writes constants
        raw = torch.frombuffer(segment, dtype=torch.uint8, count=v.nbytes)
    return raw.view(v.torch_dtype).as_strided(v.shape, v.layout_strides)  # (the bytes are in that memory order)


def upload(dst: torch.Tensor, segment, v: TensorValue) -> None:
    """Fill `dst` (on v's device) with the bytes of `segment`."""
    src = constant_tensor(segment, v)
    if v.device.is_cpu:
        dst.copy_(src)
    elif v.nbytes:
        require_allocator(v.device).copy_host_to_device(memory_bytes(dst), memory_bytes(src), v.nbytes, v.device.index)


def _filled(v: TensorValue, segments, owned: list, pin: bool = False,
            reservation: MemoryReservation | None = None) -> torch.Tensor:
    """A tensor of its own for `v`, holding its segment's bytes; its memory is appended to
    `owned` only once filled (a failed upload frees it)."""
    buf = allocate(v.nbytes, v.device, pin_memory=pin, reservation=reservation)
    try:
        t = make_tensor(buf.memory, v.shape, v.torch_dtype, v.device, 0, v.strides)
        upload(t, segments[v.constant], v)
    except BaseException:
        buf.close()
        raise
    owned.append(buf)
    return t


def _drop_since(made: dict, owned: list, mark: int) -> None:
    """Forget the entries of `made` after the first `mark` and free their memory (one
    allocation each, in the same order in `owned`)."""
    for key in list(made)[mark:]:
        del made[key]
    for buf in owned[mark:]:
        buf.close()
    del owned[mark:]


class DeviceUploads:
    """One device copy per (segment, device, layout) of the program's weights."""

    def __init__(self, segments, progress: Progress | None = None):
        self.segments = segments
        self.progress, self.uploaded = progress, 0  # bytes uploaded, told to `progress` (ferry/progress.py)
        self._made: dict[tuple, torch.Tensor] = {}
        self._owned: list[HeldMemory] = []
        self._lock = threading.Lock()

    def get(self, v: TensorValue, reservation: MemoryReservation | None = None) -> torch.Tensor:
        """The device copy of `v`'s weight, uploaded on first use (into `reservation`, if given)."""
        key = upload_key(v)
        with self._lock:
            t = self._made.get(key)
            if t is None:
                t = self._made[key] = _filled(v, self.segments, self._owned, reservation=reservation)
                self.uploaded += v.nbytes
                tell(self.progress, "upload weights", self.uploaded, 0, "B")
            return t

    def __len__(self) -> int:
        return len(self._made)

    def keys(self) -> set[tuple]:
        """The upload keys held (program/schema.py `upload_key`): a load counts them as made."""
        with self._lock:
            return set(self._made)

    def mark(self) -> int:
        return len(self._made)

    def rollback(self, mark: int) -> None:
        """Free what was uploaded since `mark` (a load that failed part way leaves nothing)."""
        with self._lock:
            _drop_since(self._made, self._owned, mark)

    def close(self) -> None:
        with self._lock:
            self._made.clear()
            for b in self._owned:
                b.close()
            self._owned = []


class ProgramState:
    """The program's mutable buffers, one tensor each, for one set of memory."""

    def __init__(self, segments, methods, pin_host: bool = False):
        self.segments = segments
        self.states = program_states(methods)
        self.pin_host = pin_host
        self.tensors: dict[str, torch.Tensor] = {}
        self._owned: list[HeldMemory] = []

    def tensor(self, name: str, reservation: MemoryReservation | None = None) -> torch.Tensor:
        """The state `name`, made (in `reservation`, if given) and set to its initial value on first use."""
        t = self.tensors.get(name)
        if t is None:
            v = self.states[name].value
            t = self.tensors[name] = _filled(v, self.segments, self._owned, pin=self.pin_host and v.device.is_cpu,
                                             reservation=reservation)
        return t

    def mark(self) -> int:
        return len(self.tensors)

    def rollback(self, mark: int) -> None:
        """Free the states made since `mark` (a load that failed part way leaves nothing)."""
        _drop_since(self.tensors, self._owned, mark)

    def reset(self, names=None) -> None:
        """Set states (all, or those named) back to their initial values, in place: CUDA graphs
        captured over them stay valid."""
        for name in self.tensors if names is None else names:
            if name in self.tensors:  # (a copy on the device's current stream: after the calls queued there)
                v = self.states[name].value
                self.tensors[name].copy_(constant_tensor(self.segments[v.constant], v))

    def close(self) -> None:
        self.tensors.clear()
        for b in self._owned:
            b.close()
        self._owned = []
