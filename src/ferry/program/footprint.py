"""A program's memory footprint: the bytes loading it allocates on each device, the bytes one
call allocates besides, and the size strings ("20GiB") budgets and limits are written in.

Compile checks a device map against `max_memory` with the first; the runtime checks a file
from elsewhere against `Module(max_memory=...)` with both, before anything is allocated, and
reserves the first, piece by piece, as one allocation per device (runtime/devices/slab.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ferry.backend_registry import ProgramData, data_kwargs, get_backend
from ferry.device import Device
from ferry.errors import ConfigError
from ferry.program.lifetimes import value_lifetimes
from ferry.program.schema import DelegateCall, KernelCall, Method, TensorValue, upload_key
from ferry.program.states import method_states

__all__ = ["MAX_BYTES", "LoadPiece", "call_bytes", "limit_for", "load_bytes", "load_pieces", "parse_bytes", "parse_limits",
           "unknown_limit_keys"]

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


@dataclass(frozen=True)
class LoadPiece:
    """One allocation loading a method makes. A `reserved` one is taken from the load's one
    allocation per device (runtime/devices/slab.py); the rest are made apart: a scratch tensor
    (it may grow at run time, so its storage is its own) and what a backend that does not take
    the reservation allocates itself. Host pieces are never reserved, whatever they say.
    `alignment`: what a planned buffer asks for (None: the device allocator's default)."""

    device: Device
    nbytes: int
    alignment: int | None = None
    reserved: bool = True


def load_pieces(program, method: Method, stage_io: bool = False, data: ProgramData | None = None) -> list[LoadPiece]:
    """The allocations loading `method` makes, device by device: its buffers, device constants and
    state, fixed device I/O (CUDA graphs), scratch, and what its delegates' backends say they
    allocate. A weight or state the module holds once for all methods is counted once per `data`
    (pass one ProgramData for every method of a program; without it, every method counts its own);
    a delegate named `("delegate", index)` in `data.counted` is one loaded already."""
    data = data if data is not None else ProgramData(program.segments)
    pieces = [LoadPiece(b.device, b.size, b.alignment) for b in method.buffers[1:]]
    states = method_states(method)
    for vid, v in enumerate(method.values):
        if not isinstance(v, TensorValue) or (v.device.is_cpu and v.storage not in ("state", "scratch")):
            continue
        if v.storage in ("constant", "state"):  # held once by the module, whichever method asks
            key = upload_key(v) if v.storage == "constant" else ("state", states[vid])
            if key not in data.counted:
                data.counted.add(key)
                pieces.append(LoadPiece(v.device, v.nbytes))
        elif stage_io and v.storage in ("input", "output"):  # staged for graphs (a dynamic one at its bound)
            pieces.append(LoadPiece(v.device, v.nbytes))
        elif v.storage == "scratch":  # an out argument nobody reads: a tensor of its own, made at load
            pieces.append(LoadPiece(v.device, v.nbytes, reserved=False))
    for ins in method.instructions:
        if isinstance(ins, DelegateCall) and ("delegate", ins.delegate) not in data.counted:
            d = program.delegates[ins.delegate]
            backend = get_backend(d.backend_id)
            given = backend.load_pieces(program.segments[d.payload], bool(ins.scratch), **data_kwargs(backend, data))
            pieces += [LoadPiece(device, n, align[0] if align else None, backend.takes_reservation)
                       for device, n, *align in given]
    return pieces


def load_bytes(program, method: Method, stage_io: bool = False, data: ProgramData | None = None) -> dict[Device, int]:
    """Bytes loading `method` allocates per device: its `load_pieces`, added up."""
    need: dict[Device, int] = {}
    for p in load_pieces(program, method, stage_io, data):
        need[p.device] = need.get(p.device, 0) + p.nbytes
    return need


def call_bytes(program, method: Method, handed_out: bool = True, data: ProgramData | None = None) -> dict[Device, int]:
    """Bytes one call of `method` allocates besides what loading did, per device, at the declared
    shapes (the bounds of dynamic dims: the runtime holds every kernel to them, and refuses a
    file whose kernels disagree): the most run-time results alive at once (each is freed after
    its last reader, as eager frees it), what its delegates' calls allocate, and with
    `handed_out` the caller's outputs (made fresh, or copies of the program's memory)."""
    data = data if data is not None else ProgramData(program.segments)
    n = len(method.instructions)
    events: dict[Device, list[int]] = {}

    def live(device: Device, nbytes: int, first: int, last: int) -> None:
        at = events.setdefault(device, [0] * (n + 2))
        at[max(first, 0)] += nbytes
        at[last + 1] -= nbytes

    lifetimes = value_lifetimes(method)
    for vid, v in enumerate(method.values):
        if isinstance(v, TensorValue) and v.storage == "runtime" and vid in lifetimes:
            live(v.device, v.nbytes, *lifetimes[vid])
    for first, v in _fresh_views(method):  # a composite's result may be a copy: live while its base is
        live(v.device, v.nbytes, first, lifetimes.get(v.alias_of, (first, n))[1])  # type: ignore[arg-type]
    for i, ins in enumerate(method.instructions):
        if isinstance(ins, KernelCall):  # what a kernel the load may choose allocates (conv patches)
            extra = _chosen_kernel_bytes(method, ins)
            if extra:
                live(method.tensor(ins.outputs[0]).device, extra, i, i)
        if isinstance(ins, DelegateCall):
            d = program.delegates[ins.delegate]
            backend = get_backend(d.backend_id)
            for device, nbytes in backend.call_bytes(program.segments[d.payload], **data_kwargs(backend, data)).items():
                live(device, nbytes, i, i)
    if handed_out:
        for vid in dict.fromkeys(method.outputs):
            v = method.values[vid]
            if isinstance(v, TensorValue):  # a fresh output for the whole call; the rest, copied at its end
                live(v.device, v.nbytes, 0 if v.storage == "output" else n, n)
    peaks = {}
    for device, at in events.items():
        total = peak = 0
        for change in at:
            total += change
            peak = max(peak, total)
        peaks[device] = peak
    return peaks


def _chosen_kernel_bytes(method: Method, ins: KernelCall) -> int:
    """Bytes a kernel call allocates during a call in a form the load may choose for it
    (ops/fused.py `patch_bytes`), beyond its results."""
    if not ins.kernel.startswith("ferry::conv"):
        return 0
    from ferry.ops.fused import patch_bytes  # torch operators: imported when needed

    return patch_bytes(ins.kernel, [method.values[a] if a >= 0 else None for a in ins.args])


def _fresh_views(method: Method) -> list[tuple[int, TensorValue]]:
    """(instruction, value) for each result declared a view of an op whose schema says nothing
    of aliasing (a composite): it may be a view, or a new tensor (ops/aliasing.py)."""
    from ferry.op_names import resolve_kernel  # torch operators: imported when needed
    from ferry.ops.aliasing import is_view

    out = []
    for i, ins in enumerate(method.instructions):
        if not isinstance(ins, KernelCall):
            continue
        views = [v for o in ins.outputs if isinstance(v := method.values[o], TensorValue) and v.storage == "view"]
        try:
            if views and not is_view(resolve_kernel(ins.kernel)):
                out += [(i, v) for v in views]
        except LookupError:
            continue  # not an operator: the method is refused when it is bound
    return out
