"""Delegate backends: what a backend and the handle it loads can do, declared once, and the
table of backends, keyed by id, that compile and load both consult.

A backend has two halves: `preprocess(lowered, options, range_constraints) -> bytes` runs at
compile time and turns a lowered subgraph into the payload stored in the program file;
`init(payload, compile_specs, ...) -> DelegateHandle` runs at load, and the handle's
`execute(inputs, outputs)` writes the delegate's results into the planned output tensors.
What more a backend or a handle can do is declared by the attributes and methods of the base
classes below, whose defaults say "no"; ferry never asks an object what it happens to have.
The built-in backends register themselves when `ferry` is imported (ferry/backends/).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ferry.errors import BackendError

__all__ = ["NOT_CAPTURED", "Backend", "CallerPlan", "DelegateHandle", "ProgramData", "data_kwargs", "get_backend",
           "register_backend", "registered_backends"]


@dataclass(frozen=True)
class CallerPlan:
    """What a delegate loaded or bound inside a caller's plan takes from it.

    captured: the caller's plan runs as CUDA graphs, which the delegate's steps run inside, so
              kernel forms that launch more may be chosen for it (ferry/choices/)
    streams:  the CopyStreams on whose capture streams the caller's graphs are captured (kernel
              choices are timed by replaying graphs there), or None
    """

    captured: bool = False
    streams: Any = None


NOT_CAPTURED = CallerPlan()  # a plan not captured, or loaded on its own


@dataclass(frozen=True)
class ProgramData:
    """What a payload shares with the program that holds it (a backend that declares
    `shares_program_data`): the weights of every method are stored once, as the program's
    segments, and uploaded to each device once.

    segments: the program's segment table (at compile time, the one being built)
    store:    at compile time, where a payload puts a tensor: `store.constant_segment(t) -> index`
              (the same tensor of two methods gets one segment)
    uploads:  at load time, the module's device copies of segments, one per (segment, device,
              layout), shared by every method and delegate: `uploads.get(value, reservation)`
    reservation: at load time, for a backend that `takes_reservation`, the load's one allocation
              per device (runtime/devices/slab.py `MemoryReservation`) that its memory comes from
    """

    segments: Sequence
    store: Any = None
    uploads: Any = None
    reservation: Any = None
    # already counted by load_bytes (or held by the module): upload keys, ("state", name), ("delegate", index)
    counted: set = field(default_factory=set)


class DelegateHandle:
    """A loaded delegate. Subclasses implement `execute`; the rest are declared capabilities."""

    returns_outputs = False  # execute(inputs, None) returns results of its own (compiled code)

    def execute(self, inputs: list, outputs: list | None) -> list | None:
        raise NotImplementedError

    def bind_static(self, inputs: list, outputs: list, caller: CallerPlan) -> Callable[[], object] | None:
        """The caller passes the same planned tensors every call: a zero-argument call bound to
        them once, or None (this handle binds nothing ahead)."""
        return None

    def makes_output(self, position: int, declared) -> bool:
        """`execute` given None for output `position` makes a fresh tensor the caller may keep, as
        the program declares it (`declared`, a TensorValue)."""
        return False

    def storages(self) -> set[int]:
        """Addresses of the memory of its constants (a result viewing one is copied by the caller)."""
        return set()

    def close(self) -> None:
        """Free what it holds; a closed handle is not called again."""


class Backend:
    """A delegate backend. Subclasses set `backend_id` and implement `preprocess` and `init`."""

    backend_id = ""
    returns_outputs = False  # its handles return results of their own: the method plans none for them
    # its payloads keep their weights in the program's segments: every method below then gets
    # `data=ProgramData(...)` as a keyword argument (ferry passes none to a backend without it)
    shares_program_data = False
    # `init` takes `overwrites={result: argument}`: results its caller keeps in that argument's
    # memory (a KV cache updated in place; see `writes_over`). A backend whose handles return
    # results of their own writes those there itself; ferry passes nothing to one without it
    takes_overwrites = False
    # `init` takes the device memory `load_pieces` lists from `data.reservation` (the load's one
    # allocation per device); a backend without it allocates its own, and nothing is reserved for it
    takes_reservation = False

    def preprocess(self, lowered, options, range_constraints=None) -> bytes:
        raise NotImplementedError

    def init(self, payload: bytes, compile_specs, *, pin_host: bool = True, memory: list | None = None,
             caller: CallerPlan = NOT_CAPTURED) -> DelegateHandle:
        """The handle of a payload. `memory`: tensors for the buffers `memory_needs` named,
        planned by the caller (None: it allocates its own)."""
        raise NotImplementedError

    def check_call(self, payload: bytes, args: list, outputs: list, *, host_io: bool = False) -> None:
        """Raise ProgramError where a call's arguments or results (program values) disagree with
        what the payload takes and returns; nothing is checked by default (an opaque payload).
        `host_io`: the program was compiled without device placement, so host tensors stand for
        the delegate's device ones (it moves them itself)."""

    def writes_over(self, payload: bytes) -> dict[int, int]:
        """{result position: argument position}: results the delegate may write over the memory of
        that argument when the caller passes one tensor as both (a KV cache updated in place:
        the old value is read for the last time where the new one is written); none by default."""
        return {}

    def memory_needs(self, payload: bytes) -> list:
        """The buffers (program.schema.Buffer) the delegate works in, which the caller plans in its
        own arenas; none by default (it allocates what it needs)."""
        return []

    def load_bytes(self, payload: bytes, given_memory: bool) -> dict:
        """Bytes `init` allocates per device (the weights it uploads; its buffers unless
        `given_memory`), for memory limits checked before loading; unknown by default."""
        return {}

    def load_pieces(self, payload: bytes, given_memory: bool, data: ProgramData | None = None) -> list:
        """`load_bytes` allocation by allocation, [(device, nbytes[, alignment]), ...], so that a
        reservation of them holds each one's alignment padding; by default one per device. (`data`: as every
        method gets it, for a backend that `shares_program_data`.)"""
        extra = {} if data is None else {"data": data}
        return list(self.load_bytes(payload, given_memory, **extra).items())

    def call_bytes(self, payload: bytes) -> dict:
        """Bytes one call of the delegate allocates per device besides what `init` did (results
        made at run time), for memory limits checked before loading; unknown by default."""
        return {}


def data_kwargs(backend: Backend, data: ProgramData | None) -> dict:
    """`{"data": data}` for a backend that shares the program's data, else nothing."""
    return {"data": data} if backend.shares_program_data and data is not None else {}


_lock = threading.Lock()
_backends: dict[str, Backend] = {}  # registry: backend id -> backend


def register_backend(backend: Backend) -> None:
    if not isinstance(backend, Backend):
        raise TypeError(f"{type(backend).__name__} is not a ferry backend: subclass ferry.backends.Backend "
                        "(it declares what a backend can do) and register an instance")
    with _lock:
        if backend.backend_id in _backends:
            raise ValueError(f"a backend with id {backend.backend_id!r} is already registered")
        _backends[backend.backend_id] = backend


def get_backend(backend_id: str) -> Backend:
    with _lock:
        b = _backends.get(backend_id)
    if b is None:
        raise BackendError(
            f"no backend {backend_id!r} is registered (known: {', '.join(registered_backends()) or 'none'}); "
            "register it with ferry.backends.register_backend before compiling or loading the program"
        )
    return b


def registered_backends() -> tuple[str, ...]:
    with _lock:
        return tuple(sorted(_backends))
