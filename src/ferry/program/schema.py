"""The Program data model: plain dataclasses, no torch.fx, the unit that is saved and run.

A method is a table of values (tensors and constants) and a list of instructions whose
arguments are value ids, as in ExecuTorch's EValue table. Every tensor value has a Device;
a planned tensor has a (buffer, offset) in one of the method's per-device buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import torch

from ferry.device import CPU, Device
from ferry.errors import ProgramError

# ---------------------------------------------------------------- dtypes

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ProgramError(f"unknown dtype {name!r}") from None


def element_size(dtype: "torch.dtype | str") -> int:
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    return dtype.itemsize


# ---------------------------------------------------------------- values


@dataclass(frozen=True)
class PlanEntry:
    """Where a planned tensor lives: buffer index in the method's buffer table, byte offset."""

    buffer: int
    offset: int


@dataclass(frozen=True)
class TensorValue:
    """A tensor of the method. `shape` is the planned shape (upper bounds for dynamic dims).

    plan:      set for a planned tensor; None for caller-owned inputs/outputs, views and
               tensors a functional op allocates at run time.
    constant:  index of the program segment that holds its bytes (weights, initial buffers).
    alias_of:  value id this tensor is a view of; it owns no memory.
    """

    dtype: str
    shape: tuple[int, ...]
    device: Device = CPU
    plan: PlanEntry | None = None
    constant: int | None = None
    dynamic: tuple[bool, ...] = ()
    alias_of: int | None = None
    name: str = ""

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)


# kinds of ConstValue.value: none, int, float, bool, str, ints, floats, bools, dtype,
# layout, memory_format, device (a torch device string), tensors (value ids), opt_tensors,
# symint (an int computed each call from dynamic shapes; the value is its upper bound) and
# symints (a list of value ids of int or symint values: sizes such as [2, seq, 64])
CONST_KINDS = (
    "none", "int", "float", "bool", "str", "ints", "floats", "bools",
    "dtype", "layout", "memory_format", "device", "tensors", "opt_tensors", "scalar",
    "symint", "symints",
)


@dataclass(frozen=True)
class ConstValue:
    """A non-tensor argument (int, list of ints, dtype, …) or a list of tensor value ids."""

    kind: str
    value: object


Value = Union[TensorValue, ConstValue]

# ---------------------------------------------------------------- instructions

DEFAULT_ARG = -1  # an argument id meaning "use the schema's default"


@dataclass(frozen=True)
class KernelCall:
    """One operator call. `args` follow the op schema (out arguments included), as value ids
    or DEFAULT_ARG; `outputs` are the values the call defines."""

    kernel: str  # "aten::add.out", "et_copy::_h2d_copy.out"
    args: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class DelegateCall:
    """Run delegate `delegate` of the program on `args`, writing `outputs`."""

    delegate: int
    args: tuple[int, ...]
    outputs: tuple[int, ...]


Instruction = Union[KernelCall, DelegateCall]

# ---------------------------------------------------------------- method / program


@dataclass(frozen=True)
class Buffer:
    """One planned buffer: `size` bytes on `device`. Buffer 0 is reserved for constants."""

    size: int
    device: Device = CPU


@dataclass(frozen=True)
class MutableBuffer:
    """A torch.export buffer the method updates: after each call, `update` is written
    into `value` (planned for the whole method, persistent between calls)."""

    value: int
    update: int
    name: str = ""


@dataclass
class Method:
    name: str
    values: list[Value]
    instructions: list[Instruction]
    inputs: list[int]
    outputs: list[int]
    buffers: list[Buffer]
    mutable_buffers: list[MutableBuffer] = field(default_factory=list)
    # compile report: per device string, the peak of bytes live at one time
    lower_bounds: dict[str, int] = field(default_factory=dict)
    # ops with no out variant: they allocate at run time
    runtime_allocating_ops: list[str] = field(default_factory=list)

    def tensor(self, vid: int) -> TensorValue:
        v = self.values[vid]
        if not isinstance(v, TensorValue):
            raise ProgramError(f"method {self.name!r}: value {vid} is not a tensor")
        return v


@dataclass(frozen=True)
class Delegate:
    """A lowered partition: which backend runs it, its compile specs, its payload segment."""

    backend_id: str
    compile_specs: tuple[tuple[str, bytes], ...]
    payload: int  # segment index

    def spec(self, key: str) -> bytes | None:
        for k, v in self.compile_specs:
            if k == key:
                return v
        return None


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: Device
    dynamic: tuple[bool, ...]
    nbytes: int
    planned: bool


class MethodMeta:
    """What a caller needs before running a method: its buffers and its inputs/outputs."""

    def __init__(self, method: Method):
        self._m = method

    @property
    def name(self) -> str:
        return self._m.name

    def num_memory_planned_buffers(self) -> int:
        return len(self._m.buffers) - 1

    def _buffer(self, i: int) -> Buffer:
        n = self.num_memory_planned_buffers()
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise IndexError(f"method {self._m.name!r} has {n} planned buffers; index {i!r} is out of range")
        return self._m.buffers[i + 1]

    def memory_planned_buffer_size(self, i: int) -> int:
        return self._buffer(i).size

    def memory_planned_buffer_device(self, i: int) -> Device:
        return self._buffer(i).device

    def num_inputs(self) -> int:
        return len(self._m.inputs)

    def num_outputs(self) -> int:
        return len(self._m.outputs)

    def _meta(self, ids: list[int], i: int, what: str) -> TensorMeta:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(ids):
            raise IndexError(f"method {self._m.name!r} has {len(ids)} {what}s; index {i!r} is out of range")
        v = self._m.values[ids[i]]
        if not isinstance(v, TensorValue):
            raise ProgramError(f"{what} {i} of method {self._m.name!r} is not a tensor")
        return TensorMeta(v.torch_dtype, v.shape, v.device, v.dynamic or (False,) * len(v.shape), v.nbytes, v.plan is not None)

    def input_meta(self, i: int) -> TensorMeta:
        return self._meta(self._m.inputs, i, "input")

    def output_meta(self, i: int) -> TensorMeta:
        return self._meta(self._m.outputs, i, "output")


@dataclass
class Program:
    """A compiled program: methods, delegates, and byte segments (constants and payloads).

    Segments are bytes-like objects (bytes, or memoryviews into a mapped file)."""

    methods: dict[str, Method]
    delegates: list[Delegate] = field(default_factory=list)
    segments: list = field(default_factory=list)

    def method(self, name: str) -> Method:
        try:
            return self.methods[name]
        except KeyError:
            raise KeyError(f"program has no method {name!r}; methods: {', '.join(self.methods) or 'none'}") from None

    def method_meta(self, name: str) -> MethodMeta:
        return MethodMeta(self.method(name))

    def save(self, path) -> None:
        from ferry.program.serialize import save_program

        save_program(self, path)

    def to_bytes(self) -> bytes:
        from ferry.program.serialize import program_to_bytes

        return program_to_bytes(self)

    def copy_report(self, method: str | None = None):
        from ferry.report import copy_report

        return copy_report(self, method)
