"""A program's memory footprint: the bytes loading it allocates on each device, and the
size strings ("20GiB") budgets and limits are written in.

Compile checks a device map against `max_memory` with it; the runtime checks a file from
elsewhere against `Module(max_memory=...)` with it: one count for both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

from ferry.backend_registry import ProgramData, data_kwargs, get_backend
from ferry.device import Device
from ferry.errors import ConfigError
from ferry.program.schema import DelegateCall, Method, TensorValue, upload_key
from ferry.program.states import method_states

__all__ = ["MAX_BYTES", "limit_for", "load_bytes", "parse_bytes", "parse_limits", "unknown_limit_keys"]

MAX_BYTES = 2**60  # one exbibyte: a size above it is a mistake, not a budget

_UNITS = MappingProxyType({"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*\Z")


def parse_bytes(value: int | str, what: str = "memory limit") -> int:
    """4096, "512MB", "20GiB" -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a number of bytes or a size like '20GiB', got {_short(value)}")
    if isinstance(value, int):
        return _in_range(value, what)
    m = _SIZE.match(value) if isinstance(value, str) and len(value) <= 64 else None
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what} must be a number of bytes or a size like '20GiB', got {_short(value)}")
    number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    return _in_range(int(number) if number <= MAX_BYTES else MAX_BYTES + 1, what)


def _in_range(n: int, what: str) -> int:
    if not 0 <= n <= MAX_BYTES:
        raise ConfigError(f"{what} must be between 0 bytes and 1 EiB, got {_short(n)}")
    return n


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def parse_limits(limits: int | str | Mapping | None) -> dict[str, int] | None:
    """None, one size for every device (key '*'), or {device: size} with devices as 'cpu',
    'cuda:0', ... (a bare type such as 'cuda' covers all its indices)."""
    if limits is None:
        return None
    if not isinstance(limits, Mapping):
        return {"*": parse_bytes(limits)}
    out = {}
    for key, value in limits.items():
        name = str(key).strip().lower()
        try:
            device = name if ":" not in name else str(Device.parse(name))
        except ValueError as e:
            raise ConfigError(f"max_memory key {_short(key)}: {e}") from None
        out[device] = parse_bytes(value, f"memory limit for {_short(key)}")
    return out


def unknown_limit_keys(limits: Mapping[str, int], devices) -> list[str]:
    """Keys of `limits` that name no device among `devices` (nor their types): a misspelled key
    would otherwise mean no cap at all."""
    known = {"*"} | {str(d) for d in devices} | {d.type for d in devices}
    return sorted(k for k in limits if k not in known)


def limit_for(limits: dict[str, int], device: Device) -> int | None:
    for key in (str(device), device.type, "*"):
        if key in limits:
            return limits[key]
    return None


def load_bytes(program, method: Method, stage_io: bool = False, data: ProgramData | None = None) -> dict[Device, int]:
    """Bytes loading `method` allocates per device: its buffers, device constants and state,
    fixed device I/O (CUDA graphs) and what its delegates' backends say they allocate. A weight
    or state the module holds once for all methods is counted once per `data` (pass one
    ProgramData for every method of a program; without it, every method counts its own)."""
    data = data if data is not None else ProgramData(program.segments)
    need: dict[Device, int] = {}

    def add(device: Device, n: int) -> None:
        need[device] = need.get(device, 0) + n

    for b in method.buffers[1:]:
        add(b.device, b.size)
    states = method_states(method)
    for vid, v in enumerate(method.values):
        if not isinstance(v, TensorValue) or (v.device.is_cpu and v.storage != "state"):
            continue
        if v.storage in ("constant", "state"):  # held once by the module, whichever method asks
            key = upload_key(v) if v.storage == "constant" else ("state", states[vid])
            if key not in data.counted:
                data.counted.add(key)
                add(v.device, v.nbytes)
        elif stage_io and v.storage in ("input", "output") and not any(v.dynamic):
            add(v.device, v.nbytes)
    for ins in method.instructions:
        if isinstance(ins, DelegateCall):
            d = program.delegates[ins.delegate]
            backend = get_backend(d.backend_id)
            for device, n in backend.load_bytes(program.segments[d.payload], bool(ins.scratch),
                                                **data_kwargs(backend, data)).items():
                add(device, n)
    return need
