"""Types by name from the modules this process has already imported. What a program file or a
trace names is looked up, never imported, and no module's `__getattr__` runs (a lazy module's
would import): naming a type in a file runs no code."""

from __future__ import annotations

import sys

__all__ = ["imported_type"]


def imported_type(name: str) -> type | None:
    """The type `module.Qual.Name` if its module is imported and defines it, else None."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj: object = module
        for attr in parts[cut:]:
            obj = vars(obj).get(attr) if hasattr(obj, "__dict__") else None
            if obj is None:
                return None
        return obj if isinstance(obj, type) else None
    return None
