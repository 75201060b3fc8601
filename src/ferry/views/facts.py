"""What the views say about a program, said once: byte sizes, a value's shape and owner, an
instruction's device, a copy's direction, the bytes each device holds. The text view and the
HTML page both read these; neither keeps its own copy.
"""

from __future__ import annotations

from ferry.device import CPU, Device
from ferry.errors import BackendError, ProgramError
from ferry.ops import COPY_KERNELS
from ferry.program import Program
from ferry.program.footprint import load_bytes
from ferry.program.lifetimes import tensor_ids, value_lifetimes
from ferry.program.schema import STORAGE_KINDS, Delegate, DelegateCall, KernelCall, Method, PlanEntry, TensorValue, root_storage

__all__ = [
    "copy_direction", "delegate_of", "device_memory", "fmt_bytes", "instruction_device", "is_copy", "owner",
    "parse_device", "plan_of", "planned_lifetimes", "reads", "shape_text", "short_kernel",
]


def fmt_bytes(n: int) -> str:
    """8192 -> '8.0 KiB'; below 1 KiB exact bytes."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024:
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def shape_text(v: TensorValue) -> str:
    """'float32[2, 16]'."""
    return f"{v.dtype}[{', '.join(str(s) for s in v.shape)}]"


def plan_of(v: TensorValue) -> PlanEntry:
    """A planned value's (buffer, offset): storage 'planned' always has one (validate.py checks)."""
    if v.plan is None:
        raise ProgramError(f"value %{v.name} has storage {v.storage!r} but no plan entry")
    return v.plan


def owner(m: Method, vid: int) -> str:
    """Who holds the memory of a value, in words, as the program states it."""
    v = m.tensor(vid)
    short = STORAGE_KINDS[v.storage][0]
    return short if v.storage != "view" else f"view, {STORAGE_KINDS[root_storage(m.values, vid)][0]}"


def parse_device(text: str, fallback: Device) -> Device:
    """A device named in a program: canonical as files store it ('cuda:0', 'rank1:cuda:0'), else
    as a user writes it ('CUDA', 'cuda:1'); `fallback` when it is neither (a hand-made spec)."""
    for parse in (Device.from_canonical, Device.parse):
        try:
            return parse(text.strip())
        except ValueError:
            pass
    return fallback


def copy_direction(kernel: str) -> str | None:
    """'h2d', 'd2h' or 'd2d' for a copy kernel (the one table, `ferry.ops.COPY_KERNELS`), else None."""
    return COPY_KERNELS.get(kernel)


def is_copy(ins) -> bool:
    return isinstance(ins, KernelCall) and ins.kernel in COPY_KERNELS


def short_kernel(kernel: str) -> str:
    """'h2d copy' for a copy, 'mm.out' for 'aten::mm.out', the name otherwise."""
    direction = copy_direction(kernel)
    if direction is not None:
        return f"{direction} copy"
    return kernel.removeprefix("aten::").removesuffix(".default")


def reads(m: Method, ins) -> list[int]:
    """The tensor values an instruction reads, in argument order, each once."""
    seen: dict[int, None] = {}
    for a in ins.args:
        for t in tensor_ids(m, a):
            seen.setdefault(t, None)
    return list(seen)


def delegate_of(program: Program, ins: DelegateCall) -> Delegate | None:
    return program.delegates[ins.delegate] if 0 <= ins.delegate < len(program.delegates) else None


def instruction_device(program: Program, m: Method, ins) -> Device:
    """Where an instruction runs: a delegate's target device, else the device of what it writes
    (or reads, when it writes nothing)."""
    if isinstance(ins, DelegateCall):
        outs = [m.tensor(o) for o in ins.outputs if 0 <= o < len(m.values) and isinstance(m.values[o], TensorValue)]
        fallback = outs[0].device if outs else CPU
        d = delegate_of(program, ins)
        spec = d.spec("target_device") if d is not None else None
        return parse_device(spec.decode(errors="replace"), fallback) if spec else (CPU if d is not None else fallback)
    for vid in (*ins.outputs, *ins.args):
        for t in tensor_ids(m, vid):
            return m.tensor(t).device
    return CPU


def planned_lifetimes(m: Method) -> dict[int, tuple[int, int]]:
    """(first, last) instruction of every planned value: the lifetimes the planner used."""
    return {vid: life for vid, life in value_lifetimes(m).items() if m.tensor(vid).storage == "planned"}


def device_memory(program: Program, m: Method) -> dict[str, dict[str, int | None]]:
    """Per device: planned bytes, the rest loading allocates (weights, constants, a backend's
    own buffers), their total and the budget compile checked it against."""
    planned: dict[str, int] = {}
    for b in m.buffers[1:]:
        planned[str(b.device)] = planned.get(str(b.device), 0) + b.size
    try:
        total = {str(d): n for d, n in load_bytes(program, m).items()}
    except BackendError:  # a backend this process does not have: its weights are unknown here
        total = dict(planned)
    rows: dict[str, dict[str, int | None]] = {}
    for dev in sorted(set(planned) | set(total) | set(m.max_memory)):
        p, t = planned.get(dev, 0), max(total.get(dev, 0), planned.get(dev, 0))
        rows[dev] = {"planned": p, "weights": t - p, "total": t, "budget": m.max_memory.get(dev)}
    return rows
