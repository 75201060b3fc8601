"""Memory limits: what loading a method will allocate, per device, checked before it does.

A program file says how much memory it wants (its buffers, its device constants, its
delegates' weights). A file from elsewhere may ask for far more than it is worth: with a
limit set, `Module` adds up the bytes loading would allocate on each device and refuses, with
an `AllocationError` naming the device, the need and the limit, before allocating anything.
"""

from __future__ import annotations

from ferry.device import Device
from ferry.errors import AllocationError
from ferry.program.footprint import limit_for, load_bytes, parse_limits

__all__ = ["check_limits", "load_bytes", "parse_limits"]


def check_limits(limits: dict[str, int] | None, need: dict[Device, int], copies: int, method: str) -> None:
    """AllocationError before any allocation when `copies` sets of `need` exceed a limit."""
    if not limits:
        return
    for device, n in sorted(need.items()):
        limit = limit_for(limits, device)
        if limit is not None and n * copies > limit:
            sets = f" ({copies} sets of {n:,})" if copies > 1 else ""
            raise AllocationError(
                f"loading method {method!r} needs {n * copies:,} bytes on {device}{sets}, over the limit of "
                f"{limit:,} bytes set with max_memory; nothing was allocated"
            )
