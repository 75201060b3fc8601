"""Types by name from the modules this process has already imported. What a program file or a
trace names is looked up, never imported, and no object's own attribute hooks run (a lazy
module's `__getattr__` would import): naming a type in a file runs no code."""

from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["MAX_TYPE_NAME", "imported_type"]

MAX_TYPE_NAME = 512  # characters in a type's dotted name (a file's names are checked against it)


def imported_type(name: str) -> type | None:
    """The type `module.Qual.Name` if its module is imported and defines it, else None. The path
    is walked through modules and classes only, by their own namespaces."""
    if len(name) > MAX_TYPE_NAME:
        return None
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj: object = module
        for attr in parts[cut:]:
            obj = _namespace(obj).get(attr)
            if obj is None:
                return None
        return obj if issubclass(type(obj), type) else None  # type: ignore[return-value]
    return None


def _namespace(obj: object) -> dict:
    kind = type(obj)  # (not isinstance: that would ask the object for its __class__)
    if issubclass(kind, ModuleType):
        return object.__getattribute__(obj, "__dict__")
    if issubclass(kind, type):
        return type.__getattribute__(obj, "__dict__")
    return {}
