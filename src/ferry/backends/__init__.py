"""The built-in delegate backends; importing this package registers them.

The registry itself is ferry/backend_registry.py (compile and load both read it).
"""

from __future__ import annotations

from ferry.backend_registry import Backend, CallerPlan, DelegateHandle, get_backend, register_backend, registered_backends
from ferry.backends.inductor import InductorBackend
from ferry.backends.torch import TorchBackend

register_backend(TorchBackend())
register_backend(InductorBackend())

__all__ = ["Backend", "CallerPlan", "DelegateHandle", "InductorBackend", "TorchBackend", "get_backend",
           "register_backend", "registered_backends"]
