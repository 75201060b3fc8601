"""Delegate backends, keyed by backend id: the table compile and load both consult.

A backend has two halves: `preprocess(lowered, options, range_constraints) -> bytes` runs at
compile time and turns a lowered subgraph into the payload stored in the program file;
`init(payload, compile_specs) -> handle` runs at load and returns an object whose
`execute(inputs, outputs)` writes the delegate's results into the planned output tensors.
The built-in backends register themselves when `ferry` is imported (ferry/backends/).
"""

from __future__ import annotations

import threading

from ferry.errors import BackendError

__all__ = ["get_backend", "register_backend", "registered_backends"]

_lock = threading.Lock()
_backends: dict[str, object] = {}


def register_backend(backend) -> None:
    with _lock:
        if backend.backend_id in _backends:
            raise ValueError(f"a backend with id {backend.backend_id!r} is already registered")
        _backends[backend.backend_id] = backend


def get_backend(backend_id: str):
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
