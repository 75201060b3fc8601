"""Run-time kernels: ATen ops bound once at load, and the et_copy kernels.

The copy kernels take direction and devices from the planned metadata (not from torch's
view of the tensors, which is "cpu" for host-backed devices) and move bytes through the
registered allocators: exactly one allocator copy call of exactly the tensor's bytes.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from ferry.device import Device
from ferry.errors import DeviceError, InputError, ProgramError
from ferry.layout import is_dense, same_strides
from ferry.program.schema import DEFAULT_ARG
from ferry.runtime.devices.allocator import memory_bytes, require_allocator
from ferry.runtime.stages.refs import Fixed


def copy_direction_check(direction: str, src: Device, dst: Device) -> None:
    ok = {
        "h2d": src.is_cpu and not dst.is_cpu,
        "d2h": not src.is_cpu and dst.is_cpu,
        "d2d": not src.is_cpu and not dst.is_cpu and src != dst,
    }[direction]
    if not ok:
        need = {"h2d": "a CPU source and a non-CPU destination", "d2h": "a non-CPU source and a CPU destination",
                "d2d": "two different non-CPU devices"}[direction]
        raise DeviceError(f"_{direction}_copy needs {need}, but the program moves {src} -> {dst}")


class CopyKernel:
    """et_copy::_{h2d,d2h,d2d}_copy.out for one instruction, resolved at load."""

    def __init__(self, direction: str, src: Device, dst: Device, capacity: int | None):
        copy_direction_check(direction, src, dst)
        self.direction, self.src, self.dst = direction, src, dst
        self.capacity = capacity  # bytes `out` may hold; None = not planned (sized per call)
        indices: tuple[int, ...]
        if direction == "h2d":
            alloc, indices = require_allocator(dst), (dst.index,)
            self._copy = lambda d, s, n: alloc.copy_host_to_device(d, s, n, dst.index)
        elif direction == "d2h":
            alloc, indices = require_allocator(src), (src.index,)
            self._copy = lambda d, s, n: alloc.copy_device_to_host(d, s, n, src.index)
        else:
            if src.type != dst.type:
                raise DeviceError(f"_d2d_copy between different device types ({src} -> {dst}) is not supported")
            alloc, indices = require_allocator(dst), (dst.index, src.index)
            self._copy = lambda d, s, n: alloc.copy_device_to_device(d, s, n, dst.index, src.index)
        self._alloc, self._indices = alloc, indices

    def bind_static(self, src: torch.Tensor, out: torch.Tensor):
        """A zero-argument copy between two planned tensors of fixed shape, validated once here:
        per call it is exactly one allocator copy hook call on precomputed byte views."""
        if src.dtype == out.dtype and src.shape == out.shape and src.numel() == 0:
            return lambda: out  # nothing to copy; an empty tensor's strides say nothing about its layout
        if (src.dtype != out.dtype or src.shape != out.shape or not same_strides(src.shape, src.stride(), out.stride())
                or not is_dense(src.shape, src.stride())):
            raise ProgramError(
                f"_{self.direction}_copy between planned tensors {src.dtype}{tuple(src.shape)} -> "
                f"{out.dtype}{tuple(out.shape)}: they must have one dtype, shape and dense layout"
            )
        nbytes = src.numel() * src.element_size()
        bound = self._alloc._bind_copy(self.direction, memory_bytes(out)[:nbytes], memory_bytes(src)[:nbytes], nbytes,
                                       *self._indices)
        direction, where = self.direction, f"{self.src} -> {self.dst}"

        def copy():
            try:
                bound()
            except Exception as e:
                raise DeviceError(f"_{direction}_copy of {nbytes} bytes {where} failed: {e}") from e
            return out

        return copy

    def __call__(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if src.dtype != out.dtype:
            raise InputError(f"_{self.direction}_copy: dtype mismatch, source is {src.dtype}, destination {out.dtype}")
        nbytes = src.numel() * src.element_size()
        if out.shape != src.shape:
            # not planned: `out` was made at its bound for this call, so it may shrink, never grow
            # (growing would reallocate its storage, away from the device memory it views)
            capacity = self.capacity if self.capacity is not None else out.numel() * out.element_size()
            if nbytes > capacity:
                raise InputError(
                    f"_{self.direction}_copy: a {tuple(src.shape)} source needs {nbytes} bytes but the planned "
                    f"destination holds {capacity}; the input exceeds the shape the program was planned for"
                )
        if out.shape != src.shape:
            out.resize_(src.shape)
        if nbytes and not (same_strides(src.shape, src.stride(), out.stride()) and is_dense(src.shape, src.stride())):
            # bytes move as they lie in memory, so both sides need one layout: the destination's
            if not self.src.is_cpu:
                raise InputError(
                    f"_{self.direction}_copy: the {self.src} source of shape {tuple(src.shape)} has strides "
                    f"{src.stride()}, the destination {out.stride()}; laying it out again would allocate device "
                    "memory during execution: pass a tensor with the destination's layout"
                )
            src = torch.empty_strided(out.shape, out.stride(), dtype=src.dtype).copy_(src)
        if nbytes == 0:
            return out
        self._copy(memory_bytes(out), memory_bytes(src), nbytes)
        return out


def bind_aten(op: torch._ops.OpOverload, arg_ids, const_of):
    """Split schema-ordered argument ids into positional and keyword parts once, at load.

    Returns (positional references, keyword references): what `const_of(value id)` makes of each
    argument given (runtime/stages/refs.py), and `Fixed` defaults before a later positional one."""
    schema = op._schema
    if len(arg_ids) != len(schema.arguments):
        raise ProgramError(f"{op}: {len(arg_ids)} arguments given, the schema has {len(schema.arguments)}")
    pos, kw = [], {}
    pending_defaults = []
    for a, vid in zip(schema.arguments, arg_ids):
        if vid == DEFAULT_ARG:
            if not a.kwarg_only:
                pending_defaults.append(Fixed(a.default_value if a.has_default_value() else None))
            continue
        ref = const_of(vid)
        if a.kwarg_only:
            kw[a.name] = ref
        else:
            pos.extend(pending_defaults)
            pending_defaults = []
            pos.append(ref)
    return pos, kw


def _to_meta(x):
    """`x` with every tensor a meta tensor like it, and every device the meta device: a check on
    meta tensors never allocates, even for a factory op told where to."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    if isinstance(x, (list, tuple)) and any(isinstance(e, (torch.Tensor, torch.device)) for e in x):
        return type(x)(_to_meta(e) for e in x)
    return x


_FAST_CHECKED: dict = {}  # registry (a bounded cache): (op, argument signature) -> the parser entry, or None
_FAST_CHECKED_MAX = 8192


def _signature(x):
    """What a meta check of `x` depends on (its metadata, not its data)."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_signature(e) for e in x))
    try:
        hash(x)
    except TypeError:
        return ("R", repr(x))
    return (type(x).__name__, x)


def _checked_once(check):
    """A meta check's answer is a function of the op and the arguments' metadata: a model's
    identical layers, and each shape a dynamic method is bound at, ask it once."""
    def cached(op, args, kwargs, *rest):
        key = (check.__name__, op, _signature(args), _signature(sorted(kwargs.items())), _signature(rest))
        if key in _FAST_CHECKED:
            return _FAST_CHECKED[key]
        answer = check(op, args, kwargs, *rest)
        if len(_FAST_CHECKED) >= _FAST_CHECKED_MAX:
            _FAST_CHECKED.clear()  # (another thread may clear it too: the answer is kept here)
        _FAST_CHECKED[key] = answer
        return answer

    cached.__doc__, cached.__name__ = check.__doc__, check.__name__
    return cached


@_checked_once
def fast_aten(op: torch._ops.OpOverload, args: list, kwargs: dict):
    """PyTorch's C++ argument parser (`torch.mul(a, b, out=c)`) is faster than calling an
    OpOverload (boxed dispatch from Python): about 2.7 µs instead of 4 µs per tiny op. Use it
    for single-out `.out` ops when the parser accepts exactly these arguments, checked once on
    meta tensors (no data touched); otherwise None and the OpOverload is used."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    out_args = [a for a in op._schema.arguments if a.is_out]
    if len(out_args) != 1 or out_args[0].name != "out" or op.namespace != "aten":
        return None
    fn = getattr(torch._C._VariableFunctions, op._opname, None)
    if fn is None:
        return None
    try:
        result = fn(*[_to_meta(a) for a in args], **{k: _to_meta(v) for k, v in kwargs.items()})
    except Exception:
        return None
    if not isinstance(result, torch.Tensor) or result.device.type != "meta":
        return None
    return fn


@_checked_once
def fast_functional(op: torch._ops.OpOverload, args: list, kwargs: dict, expect: list):
    """The C++ argument parser's entry for a functional op, when on meta tensors shaped like
    this instruction's values it picks an overload giving the outputs the program expects
    (`expect`: (shape, dtype) per output); otherwise None and the OpOverload is used."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    fn = getattr(torch._C._VariableFunctions, op._opname, None)
    if fn is None:
        return None
    try:
        result = fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the parser does not take these arguments
        return None
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(results) != len(expect) or not all(
            isinstance(r, torch.Tensor) and r.device.type == "meta" and tuple(r.shape) == s and r.dtype == d
            for r, (s, d) in zip(results, expect)):
        return None
    return fn


# which constant kinds (or a tensor) an argument of each schema type may be
_KINDS_FOR = MappingProxyType({
    "Tensor": {"tensor", "float", "int", "bool", "scalar", "symint"},  # numbers become 0-dim tensors
    "int": {"int", "symint", "dtype", "layout", "memory_format", "bool"},  # ScalarType, Layout, ... are ints
    "float": {"float", "int", "symint"},
    "number": {"scalar", "int", "float", "bool", "symint"},
    "bool": {"bool"},
    "str": {"str"},
    "Device": {"device"},
    "List[int]": {"ints", "symints"},
    "List[float]": {"floats"},
    "List[bool]": {"bools"},
    "List[Tensor]": {"tensors"},
    "List[Optional[Tensor]]": {"opt_tensors", "tensors"},
})


def _accepts(type_str: str) -> set[str] | None:
    """The value kinds an argument of this schema type takes; None: not checked."""
    if type_str.startswith("Optional[") and type_str.endswith("]"):
        inner = _accepts(type_str[9:-1])
        return None if inner is None else inner | {"none"}
    return _KINDS_FOR.get(type_str)


def check_call(op: torch._ops.OpOverload, arg_ids, outputs, values, what: str) -> None:
    """ProgramError unless the instruction's arguments are what `op`'s schema takes: their
    number, each one's kind, defaults only where the schema has one, outputs at the out
    positions. A program file cannot make a kernel receive what it does not expect."""
    schema = op._schema
    if len(arg_ids) != len(schema.arguments):
        raise ProgramError(f"{what}: {len(arg_ids)} arguments for {op}, whose schema has {len(schema.arguments)}")
    for a, vid in zip(schema.arguments, arg_ids):
        if vid == DEFAULT_ARG:
            if not (a.has_default_value() or str(a.type).startswith("Optional[")):
                raise ProgramError(f"{what}: argument {a.name!r} of {op} has no default")
            continue
        v = values[vid]
        kind = "tensor" if not hasattr(v, "kind") else v.kind
        accepted = _accepts(str(a.type))
        empty_list = kind in ("ints", "floats", "bools", "tensors", "opt_tensors", "symints") and not v.value
        any_list = str(a.type).startswith(("List", "Optional[List"))
        if accepted is not None and kind not in accepted and not (empty_list and any_list):
            raise ProgramError(f"{what}: argument {a.name!r} of {op} is {str(a.type)}, but value {vid} is a {kind}")
    out_args = [i for i, a in enumerate(schema.arguments) if a.is_out]
    if out_args and tuple(arg_ids[i] for i in out_args) != tuple(outputs):
        raise ProgramError(f"{what}: {op} writes its out arguments, which must be the instruction's outputs")
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write and not a.is_out]
    if written:  # in place (add_, fill_, set_, resize_): ferry programs write only through out arguments
        raise ProgramError(f"{what}: {op} writes its argument {written[0]!r} in place; a program writes only "
                           "through out arguments")
    returns = schema.returns
    if not out_args and not returns_list(op) and len(outputs) != len(returns):
        raise ProgramError(f"{what}: {op} returns {len(returns)} value(s), but the instruction names {len(outputs)}")


def returns_list(op: torch._ops.OpOverload) -> bool:
    """`op` returns one list of tensors (split, unbind): an instruction names each member."""
    returns = op._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.ListType)
