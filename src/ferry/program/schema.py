"""The Program data model: plain dataclasses, no torch.fx, the unit that is saved and run.

A method is a table of values (tensors and constants) and a list of instructions whose
arguments are value ids, as in ExecuTorch's EValue table. Every tensor value has a Device;
a planned tensor has a (buffer, offset) in one of the method's per-device buffers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeGuard, Union

import torch

from ferry.alignment import default_alignment
from ferry.device import CPU, Device
from ferry.errors import ProgramError
from ferry.layout import contiguous_strides
from ferry.program.signature import Signature

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


def element_size(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    return dtype.itemsize


# ---------------------------------------------------------------- values


@dataclass(frozen=True)
class PlanEntry:
    """Where a planned tensor lives: buffer index in the method's buffer table, byte offset."""

    buffer: int
    offset: int


# Who owns a tensor's memory: written once by emit, read by the runtime, inspect and the
# picture. kind -> (what inspect calls it, what it means)
STORAGE_KINDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "planned": ("planned", "a fixed place in a buffer allocated at load"),
    "constant": ("constant", "bytes of the program file (weights), read-only"),
    "input": ("caller-owned", "the caller's tensor, passed in each call"),
    "output": ("caller-owned", "a fresh tensor for the caller each call, written through an out argument"),
    "runtime": ("allocated at run time", "returned by a kernel with no out variant, each call"),
    "scratch": ("scratch", "an out argument nobody reads: a resizable tensor made at load"),
    "view": ("view", "a view of another value (alias_of); owns no memory"),
    "state": ("state", "a mutable buffer of the program (a KV cache): held once by the module, shared by every "
              "method that names it, kept between calls"),
})


@dataclass(frozen=True)
class TensorValue:
    """A tensor of the method. `shape` is the planned shape (upper bounds for dynamic dims).

    storage:   who owns its memory, one of STORAGE_KINDS (left out: implied by plan, alias_of
               or constant; caller-owned, run-time and scratch values must state it).
    plan:      (buffer, offset), set exactly when storage is 'planned'.
    constant:  segment holding its bytes: storage 'constant', or the initial value of a
               mutable buffer (storage 'state', or 'planned' in files of before states).
    alias_of:  value id this tensor is a view of (storage 'view').
    strides:   the layout eager gives it, in elements, when that is not contiguous (a
               permutation of the dense layout); empty for contiguous. Memory ferry makes for
               it (planned, fresh outputs, staged I/O) is laid out so.
    """

    dtype: str
    shape: tuple[int, ...]
    device: Device = CPU
    plan: PlanEntry | None = None
    constant: int | None = None
    dynamic: tuple[bool, ...] = ()
    alias_of: int | None = None
    name: str = ""
    strides: tuple[int, ...] = ()
    storage: str = None  # type: ignore[assignment]

    def __post_init__(self):
        # a hand-built value may leave out what its plan, alias or constant already say;
        # caller-owned, run-time and scratch values must say so (emit always writes it)
        if self.storage is None:
            implied = ("view" if self.alias_of is not None else "planned" if self.plan is not None
                       else "constant" if self.constant is not None else None)
            object.__setattr__(self, "storage", implied)

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

    @property
    def layout_strides(self) -> tuple[int, ...]:
        """`strides`, spelled out when the value is contiguous (recorded as ())."""
        return tuple(self.strides) or contiguous_strides(self.shape)


def upload_key(v: TensorValue) -> tuple:
    """What makes two device constants one upload: the same segment, device and layout."""
    return v.constant, v.device, v.dtype, tuple(v.shape), v.layout_strides


def memory_owner(values: list[Value], vid: int) -> int:
    """The value that owns `vid`'s memory: a view's base (validate.py: a view names it), else itself."""
    v = values[vid]
    return v.alias_of if isinstance(v, TensorValue) and v.alias_of is not None else vid


def root_storage(values: list[Value], vid: int) -> str:
    """The storage behind a value: a view's is its base's."""
    v = values[memory_owner(values, vid)]
    return v.storage if isinstance(v, TensorValue) else "constant"


# ---------------------------------------------------------------- constants (non-tensor arguments)

_LAYOUTS = {name: getattr(torch, name) for name in ("strided", "sparse_coo", "sparse_csr", "sparse_csc",
                                                    "sparse_bsr", "sparse_bsc", "jagged")}
_MEMORY_FORMATS = {name: getattr(torch, name) for name in ("contiguous_format", "preserve_format", "channels_last",
                                                           "channels_last_3d")}
_TORCH_DEVICE = re.compile(r"(cpu|cuda|meta)(:(0|[1-9][0-9]{0,3}))?\Z")
INT64 = (-(2**63), 2**63 - 1)


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_float(x: object) -> bool:
    return isinstance(x, float) or (_is_int(x) and abs(x) < 2**1023)


def _int64(x: object) -> bool:
    return _is_int(x) and INT64[0] <= x <= INT64[1]


def _each(check):
    return lambda v: isinstance(v, (list, tuple)) and all(check(x) for x in v)


def _optional_id(x: object) -> bool:
    return x is None or _is_int(x)


def _scalar(x: object) -> bool:
    return isinstance(x, (bool, float)) or _int64(x)


@dataclass(frozen=True)
class ConstKind:
    """One kind of ConstValue: what a value of it is, what it refers to, what a kernel gets.

    check:    is a Python value of this kind well formed (type and range; ids are checked
              against the method by the validator)
    refs:     None, or what each list member is: 'tensor', 'opt_tensor' (None or a tensor id)
              or 'int' (the id of an int or symint value)
    runtime:  the object a kernel receives for the stored value
    floats:   True when the value holds floats (the file writes inf/nan as strings)
    """

    name: str
    description: str
    check: Callable[[object], bool]
    refs: str | None = None
    runtime: Callable[[Any], object] = staticmethod(lambda v: v)
    floats: bool = False


CONST_KIND_TABLE: dict[str, ConstKind] = {k.name: k for k in (
    ConstKind("none", "None", lambda v: v is None),
    ConstKind("int", "an int64", _int64),
    ConstKind("float", "a float", _is_float, floats=True),
    ConstKind("bool", "a bool", lambda v: isinstance(v, bool)),
    ConstKind("str", "a string", lambda v: isinstance(v, str)),
    ConstKind("scalar", "an int64, float or bool", _scalar, floats=True),
    ConstKind("ints", "a list of int64", _each(_int64), runtime=list),
    ConstKind("floats", "a list of floats", _each(_is_float), runtime=list, floats=True),
    ConstKind("bools", "a list of bools", _each(lambda x: isinstance(x, bool)), runtime=list),
    ConstKind("dtype", "a dtype name", lambda v: isinstance(v, str) and v in _DTYPES, runtime=lambda v: _DTYPES[v]),
    ConstKind("layout", f"a layout ({', '.join(_LAYOUTS)})", lambda v: isinstance(v, str) and v in _LAYOUTS,
              runtime=_LAYOUTS.__getitem__),
    ConstKind("memory_format", f"a memory format ({', '.join(_MEMORY_FORMATS)})",
              lambda v: isinstance(v, str) and v in _MEMORY_FORMATS,
              runtime=_MEMORY_FORMATS.__getitem__),
    ConstKind("device", "a torch device string (cpu, cuda:N, meta)",
              lambda v: isinstance(v, str) and _TORCH_DEVICE.match(v) is not None, runtime=torch.device),
    ConstKind("tensors", "a list of tensor value ids", _each(_is_int), refs="tensor"),
    ConstKind("opt_tensors", "a list of tensor value ids or None", _each(_optional_id), refs="opt_tensor"),
    # an int computed each call from dynamic input shapes; the stored value is its upper bound
    ConstKind("symint", "an int64 (the bound of a size computed each call)", _int64),
    # a list of ids of int or symint values: sizes such as [2, seq, 64]
    ConstKind("symints", "a list of int or symint value ids", _each(_is_int), refs="int"),
)}
CONST_KINDS = tuple(CONST_KIND_TABLE)
LIST_KINDS = tuple(k.name for k in CONST_KIND_TABLE.values() if k.refs is not None)


@dataclass(frozen=True)
class ConstValue:
    """A non-tensor argument (int, list of ints, dtype, …) or a list of value ids."""

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
    """Run delegate `delegate` of the program on `args`, writing `outputs`.

    `scratch`: planned uint8 tensors the delegate works in while it runs (its own buffers,
    placed in the method's arena of their device so delegates share memory with each other
    and with the method wherever lifetimes allow)."""

    delegate: int
    args: tuple[int, ...]
    outputs: tuple[int, ...]
    scratch: tuple[int, ...] = ()


Instruction = Union[KernelCall, DelegateCall]

# ---------------------------------------------------------------- method / program


@dataclass(frozen=True)
class Buffer:
    """One planned buffer: `size` bytes on `device`, allocated at `alignment` bytes (None: the
    device type's default), so offsets aligned within it are aligned in real addresses.
    Buffer 0 is reserved for constants."""

    size: int
    device: Device = CPU
    alignment: int = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.alignment is None and isinstance(self.device, Device):
            object.__setattr__(self, "alignment", default_alignment(self.device.type))


@dataclass(frozen=True)
class MutableBuffer:
    """A torch.export buffer the method updates: after each call, `update` is written into
    `value`, the program's state of that `name` (storage 'state': one tensor held by the module,
    the same for every method naming it, persistent between calls)."""

    value: int
    update: int
    name: str = ""

    @property
    def read_only(self) -> bool:
        """State this method reads and never writes (another method of the program updates it)."""
        return self.update == self.value


@dataclass(frozen=True)
class InputWrite:
    """An input the method writes in place, as eager's `x.add_(y)` does: after each call, the
    method's output at position `output` (a value of the input's dtype and shape, on its device)
    is copied into the caller's tensor passed at input position `input`; the call returns the
    other outputs."""

    output: int
    input: int


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight the model held as a tensor subclass (torchao's int8/int4 weights), stored as its
    inner tensors, each a constant of the method: what `ferry inspect` shows. `parts`: inner
    tensor -> its dtype and shape ("int8[4096, 2048]"); `details`: the subclass's own settings
    (block size, packing); `nbytes`: the bytes of all parts."""

    name: str
    scheme: str
    dtype: str
    shape: tuple[int, ...]
    parts: dict[str, str]
    nbytes: int
    details: str = ""


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
    # ops computed by their functional kernel: they allocate their results at run time
    runtime_allocating_ops: list[str] = field(default_factory=list)
    # op -> why it is computed functionally (no out variant, a wrapper .out, an eager layout)
    kernel_choices: dict[str, str] = field(default_factory=dict)
    # the device map the method was split by (module path -> device), given or chosen by
    # device_map="auto", and the budgets (device -> bytes) it was checked against
    device_map: dict[str, str] = field(default_factory=dict)
    max_memory: dict[str, int] = field(default_factory=dict)
    # positions of the inputs an op reads through their storage (as_strided with a storage offset,
    # in this method or a delegate): a call must pass each as a tensor that is its whole storage
    storage_inputs: list[int] = field(default_factory=list)
    equal_sizes: list[list[list[int]]] = field(default_factory=list)  # [input, dim] pairs one dynamic size
    size_minimums: list[list[int]] = field(default_factory=list)  # [input, dim (-1: an int input), minimum]
    derived_sizes: list[list[int]] = field(default_factory=list)  # [input, dim, a, b, root input, root dim]
    input_guards: list[str] = field(default_factory=list)  # what export checked of input sizes (program/guards.py)
    quantized_weights: list[QuantizedWeight] = field(default_factory=list)  # facts for people, not read to run
    input_writes: list[InputWrite] = field(default_factory=list)  # inputs written in place, by output position
    signature: Signature | None = None  # the model's (args, kwargs) and result trees; None: flat tensors

    @property
    def returned_outputs(self) -> list[int]:
        """Positions of the outputs a call returns: every output but those written into inputs."""
        written = {w.output for w in self.input_writes}
        return [i for i in range(len(self.outputs)) if i not in written]

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
        """The outputs a call returns (inputs written in place are not among them)."""
        return len(self._m.returned_outputs)

    def written_inputs(self) -> list[int]:
        """Positions of the inputs a call writes in place, as eager's in-place ops do."""
        return sorted(w.input for w in self._m.input_writes)

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
        return self._meta([self._m.outputs[k] for k in self._m.returned_outputs], i, "output")
