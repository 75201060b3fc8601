"""Memory limits: what loading a method, then calling it, will allocate per device, checked
before loading does.

A program file says how much memory it wants (its buffers, its device constants, its
delegates' weights, and the shapes of the results a call makes). A file from elsewhere may ask
for far more than it is worth: with a limit set, `Module` adds up the bytes loading would
allocate on each device and the most one call allocates besides, and refuses, with an
`AllocationError` naming the device, the need and the limit, before allocating anything.
"""

from __future__ import annotations

from ferry.device import Device
from ferry.errors import AllocationError
from ferry.program.footprint import call_bytes, limit_for, load_pieces, parse_limits
from ferry.runtime.devices.slab import reserved_bytes

__all__ = ["allocated_by_load", "call_bytes", "check_limits", "parse_limits"]


def allocated_by_load(program, method, stage_io: bool = False) -> dict[Device, int]:
    """Bytes loading `method` allocates per device, as the load allocates them: the device pieces
    it reserves as their one allocation holds them (each aligned: runtime/devices/slab.py), the
    rest as asked for (program/footprint.py `load_bytes` counts every piece as asked for)."""
    pieces = load_pieces(program, method, stage_io)
    reserved = [p for p in pieces if p.reserved and not p.device.is_cpu]
    need = {d.local: n for d, n in reserved_bytes((p.device, p.nbytes, p.alignment) for p in reserved).items()}
    for p in pieces:
        if not (p.reserved and not p.device.is_cpu):
            need[p.device.local] = need.get(p.device.local, 0) + p.nbytes
    return need


def check_limits(limits: dict[str, int] | None, need: dict[Device, int], copies: int, method: str,
                 per_call: dict[Device, int] | None = None) -> None:
    """AllocationError before any allocation when `copies` sets of `need` (loading) and
    `per_call` (the most a call allocates besides) exceed a limit."""
    if not limits:
        return
    per_call = per_call or {}
    for device in sorted(set(need) | set(per_call)):
        n = need.get(device, 0) + per_call.get(device, 0)
        limit = limit_for(limits, device)
        if limit is not None and n * copies > limit:
            sets = f" ({copies} sets of {n:,})" if copies > 1 else ""
            call = f", {per_call[device]:,} of them for a call's results" if per_call.get(device) else ""
            raise AllocationError(
                f"loading method {method!r} needs {n * copies:,} bytes on {device}{sets}{call}, over the limit of "
                f"{limit:,} bytes set with max_memory; nothing was allocated"
            )
