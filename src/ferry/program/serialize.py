"""The ferry file format: a fixed header, JSON metadata, then 64-byte aligned byte segments.

No pickle, no eval, no code execution: the metadata is JSON read with explicit validation,
segments are raw bytes. A file loaded from a path is memory-mapped read-only and its
segments are memoryviews into the mapping (no copy). docs/format.md is the specification.

Public functions:
    program_to_bytes(program) -> bytes
    save_program(program, path)
    load_program(path_or_bytes) -> Program
    validate_program(program)            (semantic checks on an in-memory Program)
"""

from __future__ import annotations

import base64
import json
import math
import mmap
import os
import re
import secrets
import struct
from itertools import accumulate
from typing import Iterator

from ferry.device import Device
from ferry.errors import ProgramError
from ferry.program.schema import (
    CONST_KINDS,
    DEFAULT_ARG,
    Buffer,
    ConstValue,
    Delegate,
    DelegateCall,
    KernelCall,
    Method,
    MutableBuffer,
    PlanEntry,
    Program,
    TensorValue,
    dtype_from_name,
)

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "SEGMENT_ALIGNMENT",
    "HEADER_SIZE",
    "MAX_JSON_DEPTH",
    "MAX_RANK",
    "program_to_bytes",
    "save_program",
    "load_program",
    "validate_program",
]

MAGIC = b"FERRY\x00PG"
FORMAT_VERSION = 1
SEGMENT_ALIGNMENT = 64
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, flags, metadata length, segment-area offset
HEADER_SIZE = _HEADER.size  # 32
MAX_JSON_DEPTH = 32  # deepest nesting of JSON arrays/objects accepted in the metadata
MAX_RANK = 64  # most dimensions a tensor may have

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_MAX_INT_DIGITS = 24  # a JSON integer literal longer than this is refused before int()
_DEVICE_TYPE_RE = re.compile(r"[a-z_][a-z0-9_]*\Z")
_DEVICE_RE = re.compile(r"([a-z_][a-z0-9_]*):(0|[1-9][0-9]{0,17})\Z")
_SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _align(n: int) -> int:
    return -(-n // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT


def _show(x: object) -> str:
    """A short, never-failing repr for error messages (huge ints have no decimal repr)."""
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 96:
        return f"<{x.bit_length()}-bit integer>"
    try:
        r = repr(x)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not escape
        return f"<{type(x).__name__}>"
    return r if len(r) <= 80 else r[:77] + "..."


# ================================================================ validation (in memory)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(x: object, what: str, lo: int = 0, hi: int = _INT64_MAX) -> int:
    if not _is_int(x):
        raise ProgramError(f"{what} must be an integer, got {type(x).__name__} {_show(x)}")
    if not lo <= x <= hi:
        raise ProgramError(f"{what} must be in [{lo}, {hi}], got {_show(x)}")
    return x


def _check_str(x: object, what: str, nonempty: bool = False) -> str:
    if not isinstance(x, str):
        raise ProgramError(f"{what} must be a string, got {type(x).__name__} {_show(x)}")
    if nonempty and not x:
        raise ProgramError(f"{what} must be a non-empty string")
    return x


def _check_seq(x: object, what: str) -> list | tuple:
    if not isinstance(x, (list, tuple)):
        raise ProgramError(f"{what} must be a list or tuple, got {type(x).__name__}")
    return x


def _check_device(d: object, what: str) -> Device:
    if not isinstance(d, Device):
        raise ProgramError(f"{what} must be a ferry Device, got {type(d).__name__} {_show(d)}")
    if not isinstance(d.type, str) or not _DEVICE_TYPE_RE.match(d.type):
        raise ProgramError(
            f"{what}: device type {_show(d.type)} is not a lowercase identifier like 'cuda'"
        )
    _check_int(d.index, f"{what}: device index")
    return d


_ITEMSIZE: dict[str, int] = {}


def _itemsize(name: object, what: str) -> int:
    if not isinstance(name, str):
        raise ProgramError(f"{what}: dtype must be a dtype name string, got {type(name).__name__}")
    size = _ITEMSIZE.get(name)
    if size is None:
        try:
            size = dtype_from_name(name).itemsize
        except ProgramError as e:
            raise ProgramError(f"{what}: {e}") from None
        _ITEMSIZE[name] = size
    return size


def _seg_size(seg: object, i: int) -> int:
    try:
        with memoryview(seg) as mv:  # type: ignore[arg-type]
            return mv.nbytes
    except TypeError:
        raise ProgramError(
            f"segment {i} must be bytes-like (bytes, bytearray, memoryview), got {type(seg).__name__}"
        ) from None


def validate_program(program: object) -> None:
    """Check that `program` is well formed; raise ProgramError naming the first problem.

    Checks types, that every value id, buffer, segment and delegate index is in range, that
    planned tensors fit their buffer and sit on its device, that constant segments have the
    tensor's size, dtype names, devices, shapes and sizes. Used by load and save."""
    if not isinstance(program, Program):
        raise ProgramError(f"expected a ferry Program, got {type(program).__name__}")
    segments = _check_seq(program.segments, "program segments")
    seg_sizes = [_seg_size(s, i) for i, s in enumerate(segments)]

    delegates = _check_seq(program.delegates, "program delegates")
    for i, d in enumerate(delegates):
        what = f"delegate {i}"
        if not isinstance(d, Delegate):
            raise ProgramError(f"{what} must be a Delegate, got {type(d).__name__}")
        _check_str(d.backend_id, f"{what} backend_id", nonempty=True)
        specs = _check_seq(d.compile_specs, f"{what} compile_specs")
        for j, pair in enumerate(specs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ProgramError(f"{what} compile spec {j} must be a (key, bytes) pair, got {_show(pair)}")
            _check_str(pair[0], f"{what} compile spec {j} key")
            if not isinstance(pair[1], (bytes, bytearray, memoryview)):
                raise ProgramError(
                    f"{what} compile spec {pair[0]!r} value must be bytes, got {type(pair[1]).__name__}"
                )
        p = _check_int(d.payload, f"{what} payload segment index")
        if p >= len(seg_sizes):
            raise ProgramError(
                f"{what} ({d.backend_id}): payload segment {p} is out of range "
                f"(program has {len(seg_sizes)} segments)"
            )

    if not isinstance(program.methods, dict):
        raise ProgramError(f"program methods must be a dict of name -> Method, got {type(program.methods).__name__}")
    for key, m in program.methods.items():
        _check_str(key, "method name", nonempty=True)
        if not isinstance(m, Method):
            raise ProgramError(f"method {key!r} must be a Method, got {type(m).__name__}")
        if m.name != key:
            raise ProgramError(f"method stored under {key!r} is named {_show(m.name)}")
        _validate_method(m, seg_sizes, len(delegates))


def _validate_method(m: Method, seg_sizes: list[int], n_delegates: int) -> None:
    pre = f"method {m.name!r}"
    values = _check_seq(m.values, f"{pre} values")
    n = len(values)

    def vid(x: object, what: str, allow_default: bool = False) -> int:
        lo = DEFAULT_ARG if allow_default else 0
        if not _is_int(x):
            raise ProgramError(f"{pre} {what}: value id must be an integer, got {type(x).__name__} {_show(x)}")
        if not (lo <= x < n):
            raise ProgramError(f"{pre} {what}: value id {_show(x)} is out of range (method has {n} values)")
        return x

    def tensor_id(x: object, what: str) -> int:
        i = vid(x, what)
        if not isinstance(values[i], TensorValue):
            raise ProgramError(f"{pre} {what}: value {i} is not a tensor")
        return i

    def int_id(x: object, what: str) -> int:
        i = vid(x, what)
        if not (isinstance(values[i], ConstValue) and values[i].kind in ("int", "symint")):
            raise ProgramError(f"{pre} {what}: value {i} is not an int or a symint")
        return i

    buffers = _check_seq(m.buffers, f"{pre} buffers")
    if not buffers:
        raise ProgramError(f"{pre} has no buffers; buffer 0 (reserved for constants) must exist")
    for b, buf in enumerate(buffers):
        if not isinstance(buf, Buffer):
            raise ProgramError(f"{pre} buffer {b} must be a Buffer, got {type(buf).__name__}")
        _check_int(buf.size, f"{pre} buffer {b} size")
        _check_device(buf.device, f"{pre} buffer {b} device")

    for i, v in enumerate(values):
        what = f"{pre} value {i}"
        if isinstance(v, TensorValue):
            _validate_tensor(v, what, i, n, buffers, seg_sizes)
            if v.alias_of is not None:
                a = vid(v.alias_of, f"value {i} alias_of")
                if a == i:
                    raise ProgramError(f"{what} is an alias of itself")
                if not isinstance(values[a], TensorValue):
                    raise ProgramError(f"{what} is an alias of value {a}, which is not a tensor")
        elif isinstance(v, ConstValue):
            _validate_const(v, what, i, tensor_id, int_id)
        else:
            raise ProgramError(f"{what} must be a TensorValue or ConstValue, got {type(v).__name__}")

    # alias chains must end (no cycles)
    done: set[int] = set()
    for i, v in enumerate(values):
        chain: list[int] = []
        seen: set[int] = set()
        j = i
        while j not in done:
            if j in seen:
                raise ProgramError(f"{pre} value {i}: alias_of chain {' -> '.join(map(str, chain))} has a cycle")
            seen.add(j)
            chain.append(j)
            t = values[j]
            if not isinstance(t, TensorValue) or t.alias_of is None:
                break
            j = t.alias_of
        done.update(seen)

    instructions = _check_seq(m.instructions, f"{pre} instructions")
    for k, ins in enumerate(instructions):
        if isinstance(ins, KernelCall):
            _check_str(ins.kernel, f"{pre} instruction {k} kernel name", nonempty=True)
            label = f"instruction {k} ({ins.kernel})"
            for j, a in enumerate(_check_seq(ins.args, f"{pre} {label} args")):
                vid(a, f"{label} argument {j}", allow_default=True)
        elif isinstance(ins, DelegateCall):
            d = _check_int(ins.delegate, f"{pre} instruction {k} delegate index")
            if d >= n_delegates:
                raise ProgramError(
                    f"{pre} instruction {k}: delegate {d} is out of range (program has {n_delegates} delegates)"
                )
            label = f"instruction {k} (delegate {d})"
            for j, a in enumerate(_check_seq(ins.args, f"{pre} {label} args")):
                vid(a, f"{label} argument {j}")
        else:
            raise ProgramError(f"{pre} instruction {k} must be a KernelCall or DelegateCall, got {type(ins).__name__}")
        for j, o in enumerate(_check_seq(ins.outputs, f"{pre} {label} outputs")):
            vid(o, f"{label} output {j}")

    for j, x in enumerate(_check_seq(m.inputs, f"{pre} inputs")):
        vid(x, f"input {j}")
    for j, x in enumerate(_check_seq(m.outputs, f"{pre} outputs")):
        vid(x, f"output {j}")
    for j, mb in enumerate(_check_seq(m.mutable_buffers, f"{pre} mutable_buffers")):
        if not isinstance(mb, MutableBuffer):
            raise ProgramError(f"{pre} mutable buffer {j} must be a MutableBuffer, got {type(mb).__name__}")
        tensor_id(mb.value, f"mutable buffer {j} value")
        tensor_id(mb.update, f"mutable buffer {j} update")
        _check_str(mb.name, f"{pre} mutable buffer {j} name")
    if not isinstance(m.lower_bounds, dict):
        raise ProgramError(f"{pre} lower_bounds must be a dict of device string -> bytes")
    for key, size in m.lower_bounds.items():
        _check_str(key, f"{pre} lower_bounds key")
        _check_int(size, f"{pre} lower bound for {key!r}")
    for j, op in enumerate(_check_seq(m.runtime_allocating_ops, f"{pre} runtime_allocating_ops")):
        _check_str(op, f"{pre} runtime_allocating_ops[{j}]")


def _validate_tensor(
    v: TensorValue, what: str, i: int, n: int, buffers: list | tuple, seg_sizes: list[int]
) -> None:
    itemsize = _itemsize(v.dtype, what)
    shape = _check_seq(v.shape, f"{what} shape")
    if len(shape) > MAX_RANK:
        raise ProgramError(f"{what}: shape has {len(shape)} dimensions; at most {MAX_RANK} are supported")
    numel = 1
    for d, s in enumerate(shape):
        numel *= _check_int(s, f"{what} shape[{d}]")
    nbytes = numel * itemsize
    _check_device(v.device, f"{what} device")
    dyn = _check_seq(v.dynamic, f"{what} dynamic")
    if dyn and len(dyn) != len(shape):
        raise ProgramError(f"{what}: dynamic has {len(dyn)} flags for a shape of {len(shape)} dimensions")
    for d, f in enumerate(dyn):
        if not isinstance(f, bool):
            raise ProgramError(f"{what} dynamic[{d}] must be a bool, got {type(f).__name__}")
    _check_str(v.name, f"{what} name")
    if v.plan is not None:
        if not isinstance(v.plan, PlanEntry):
            raise ProgramError(f"{what} plan must be a PlanEntry or None, got {type(v.plan).__name__}")
        b = _check_int(v.plan.buffer, f"{what} plan buffer")
        off = _check_int(v.plan.offset, f"{what} plan offset")
        if b >= len(buffers):
            raise ProgramError(f"{what}: plan buffer {b} is out of range (method has {len(buffers)} buffers)")
        buf = buffers[b]
        if off + nbytes > buf.size:
            raise ProgramError(f"{what}: plan offset {off} + {nbytes} bytes exceeds buffer {b} size {buf.size}")
        if buf.device != v.device:
            raise ProgramError(f"{what}: tensor on {v.device} is planned in buffer {b} on {buf.device}")
    if v.constant is not None:
        c = _check_int(v.constant, f"{what} constant segment index")
        if c >= len(seg_sizes):
            raise ProgramError(
                f"{what}: constant segment {c} is out of range (program has {len(seg_sizes)} segments)"
            )
        if seg_sizes[c] != nbytes:
            raise ProgramError(
                f"{what}: constant segment {c} has {seg_sizes[c]} bytes but the tensor "
                f"({v.dtype}{list(shape)}) needs {nbytes}"
            )
    if v.alias_of is not None and not _is_int(v.alias_of):
        raise ProgramError(f"{what} alias_of must be a value id or None, got {type(v.alias_of).__name__}")


def _is_float(x: object) -> bool:
    if isinstance(x, float):
        return True
    if _is_int(x):
        try:
            float(x)  # type: ignore[arg-type]
        except OverflowError:
            return False
        return True
    return False


def _validate_const(c: ConstValue, what: str, i: int, tensor_id, int_id) -> None:
    kind, val = c.kind, c.value
    if not isinstance(kind, str) or kind not in CONST_KINDS:
        raise ProgramError(f"{what}: unknown constant kind {_show(kind)}; kinds: {', '.join(CONST_KINDS)}")
    w = f"{what} ({kind})"
    if kind == "none":
        if val is not None:
            raise ProgramError(f"{w} must hold None, got {type(val).__name__}")
    elif kind in ("int", "symint"):
        _check_int(val, w, _INT64_MIN, _INT64_MAX)
    elif kind == "float":
        if not _is_float(val):
            raise ProgramError(f"{w} must hold a float, got {type(val).__name__} {_show(val)}")
    elif kind == "bool":
        if not isinstance(val, bool):
            raise ProgramError(f"{w} must hold a bool, got {type(val).__name__}")
    elif kind in ("str", "layout", "memory_format", "device"):
        _check_str(val, w, nonempty=kind != "str")
    elif kind == "dtype":
        _itemsize(val, w)
    elif kind == "scalar":
        if isinstance(val, bool):
            pass
        elif _is_int(val):
            _check_int(val, w, _INT64_MIN, _INT64_MAX)
        elif not isinstance(val, float):
            raise ProgramError(f"{w} must hold an int, float or bool, got {type(val).__name__}")
    else:
        items = _check_seq(val, w)
        for j, x in enumerate(items):
            if kind == "ints":
                _check_int(x, f"{w}[{j}]", _INT64_MIN, _INT64_MAX)
            elif kind == "floats":
                if not _is_float(x):
                    raise ProgramError(f"{w}[{j}] must be a float, got {type(x).__name__} {_show(x)}")
            elif kind == "bools":
                if not isinstance(x, bool):
                    raise ProgramError(f"{w}[{j}] must be a bool, got {type(x).__name__}")
            elif kind == "tensors":
                tensor_id(x, f"value {i} ({kind})[{j}]")
            elif kind == "opt_tensors":
                if x is not None:
                    tensor_id(x, f"value {i} ({kind})[{j}]")
            elif kind == "symints":
                int_id(x, f"value {i} ({kind})[{j}]")


# ================================================================ writing


def _enc_float(x: float) -> float | str:
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _enc_device(d: Device) -> str:
    return f"{d.type}:{d.index}"


def _enc_value(v) -> dict:
    if isinstance(v, TensorValue):
        return {
            "type": "tensor",
            "dtype": v.dtype,
            "shape": list(v.shape),
            "device": _enc_device(v.device),
            "plan": None if v.plan is None else {"buffer": v.plan.buffer, "offset": v.plan.offset},
            "constant": v.constant,
            "dynamic": list(v.dynamic),
            "alias_of": v.alias_of,
            "name": v.name,
        }
    kind, val = v.kind, v.value
    if kind == "float":
        enc = _enc_float(val)
    elif kind == "floats":
        enc = [_enc_float(x) for x in val]
    elif kind == "scalar":
        enc = val if isinstance(val, int) else _enc_float(val)
    elif kind in ("ints", "bools", "tensors", "opt_tensors", "symints"):
        enc = list(val)
    else:
        enc = val
    return {"type": "const", "kind": kind, "value": enc}


def _enc_instruction(ins) -> dict:
    if isinstance(ins, KernelCall):
        return {"type": "kernel", "kernel": ins.kernel, "args": list(ins.args), "outputs": list(ins.outputs)}
    return {"type": "delegate", "delegate": ins.delegate, "args": list(ins.args), "outputs": list(ins.outputs)}


def _enc_method(m: Method) -> dict:
    return {
        "name": m.name,
        "values": [_enc_value(v) for v in m.values],
        "instructions": [_enc_instruction(i) for i in m.instructions],
        "inputs": list(m.inputs),
        "outputs": list(m.outputs),
        "buffers": [{"size": b.size, "device": _enc_device(b.device)} for b in m.buffers],
        "mutable_buffers": [{"value": b.value, "update": b.update, "name": b.name} for b in m.mutable_buffers],
        "lower_bounds": dict(m.lower_bounds),
        "runtime_allocating_ops": list(m.runtime_allocating_ops),
    }


def _enc_delegate(d: Delegate) -> dict:
    return {
        "backend_id": d.backend_id,
        "compile_specs": [[k, base64.b64encode(bytes(v)).decode("ascii")] for k, v in d.compile_specs],
        "payload": d.payload,
    }


def _byte_view(seg) -> memoryview:
    mv = memoryview(seg)
    if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
        return mv
    try:
        return mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
    except (TypeError, ValueError):
        return memoryview(mv.tobytes())


def _chunks(program: Program) -> Iterator[bytes | memoryview]:
    """Validate `program` and return the file as a sequence of byte chunks."""
    validate_program(program)
    views = [_byte_view(s) for s in program.segments]
    table: list[list[int]] = []
    end = 0
    for v in views:
        off = _align(end)
        table.append([off, v.nbytes])
        end = off + v.nbytes
    meta = {
        "methods": [_enc_method(m) for m in program.methods.values()],
        "delegates": [_enc_delegate(d) for d in program.delegates],
        "segments": table,
    }
    meta_bytes = json.dumps(meta, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
    area = _align(HEADER_SIZE + len(meta_bytes))
    out: list[bytes | memoryview] = [
        _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(meta_bytes), area),
        meta_bytes,
        bytes(area - HEADER_SIZE - len(meta_bytes)),
    ]
    pos = 0
    for (off, size), v in zip(table, views):
        if off > pos:
            out.append(bytes(off - pos))
        out.append(v)
        pos = off + size
    return iter(out)


def program_to_bytes(program: Program) -> bytes:
    """The file image of `program` (validated first; ProgramError if it is malformed)."""
    return b"".join(_chunks(program))


def save_program(program: Program, path) -> None:
    """Write `program` to `path`. The file is written next to `path` and renamed into place,
    so a program currently mapped from `path` stays intact."""
    path = os.fspath(path)
    chunks = _chunks(program)  # validate before touching the file system
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ================================================================ reading


def _jtype(x: object) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "boolean"
    if isinstance(x, (int, float)):
        return "number"
    if isinstance(x, str):
        return "string"
    if isinstance(x, list):
        return "array"
    if isinstance(x, dict):
        return "object"
    return type(x).__name__


def _bad(path: str, msg: str) -> ProgramError:
    return ProgramError(f"metadata {path}: {msg}")


def _obj(x: object, path: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(x, dict):
        raise _bad(path, f"expected an object, got {_jtype(x)}")
    missing = [k for k in keys if k not in x]
    if missing:
        raise _bad(path, f"missing key(s) {', '.join(map(repr, missing))}")
    if len(x) != len(keys):
        extra = sorted(k for k in x if k not in keys)
        raise _bad(path, f"unknown key(s) {', '.join(map(_show, extra))}")
    return x


def _arr(x: object, path: str) -> list:
    if not isinstance(x, list):
        raise _bad(path, f"expected an array, got {_jtype(x)}")
    return x


def _int(x: object, path: str, lo: int = 0, hi: int = _INT64_MAX) -> int:
    if not _is_int(x):
        raise _bad(path, f"expected an integer, got {_jtype(x)}")
    if not lo <= x <= hi:
        raise _bad(path, f"integer {_show(x)} is out of range [{lo}, {hi}]")
    return x


def _opt_int(x: object, path: str, lo: int = 0) -> int | None:
    return None if x is None else _int(x, path, lo)


def _str(x: object, path: str) -> str:
    if not isinstance(x, str):
        raise _bad(path, f"expected a string, got {_jtype(x)}")
    return x


def _bool(x: object, path: str) -> bool:
    if not isinstance(x, bool):
        raise _bad(path, f"expected true or false, got {_jtype(x)}")
    return x


def _float(x: object, path: str) -> float:
    if isinstance(x, str):
        if x in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[x]
        raise _bad(path, f"expected a number or 'inf', '-inf', 'nan', got string {_show(x)}")
    if isinstance(x, float) or _is_int(x):
        try:
            return float(x)  # type: ignore[arg-type]
        except OverflowError:
            raise _bad(path, f"number {_show(x)} is out of float range") from None
    raise _bad(path, f"expected a number, got {_jtype(x)}")


def _device(x: object, path: str) -> Device:
    s = _str(x, path)
    m = _DEVICE_RE.match(s)
    if not m:
        raise _bad(path, f"device {_show(s)} is not 'type:index' (lowercase type, index >= 0), e.g. 'cuda:0'")
    return Device(m.group(1), int(m.group(2)))


_TENSOR_KEYS = ("type", "dtype", "shape", "device", "plan", "constant", "dynamic", "alias_of", "name")
_CONST_KEYS = ("type", "kind", "value")
_INSTR_KEYS = {"kernel": ("type", "kernel", "args", "outputs"), "delegate": ("type", "delegate", "args", "outputs")}
_METHOD_KEYS = (
    "name", "values", "instructions", "inputs", "outputs", "buffers",
    "mutable_buffers", "lower_bounds", "runtime_allocating_ops",
)
_TOP_KEYS = ("methods", "delegates", "segments")


def _dec_const_value(kind: str, x: object, path: str) -> object:
    if kind == "none":
        if x is not None:
            raise _bad(path, f"expected null, got {_jtype(x)}")
        return None
    if kind in ("int", "symint"):
        return _int(x, path, _INT64_MIN)
    if kind == "float":
        return _float(x, path)
    if kind == "bool":
        return _bool(x, path)
    if kind in ("str", "dtype", "layout", "memory_format", "device"):
        return _str(x, path)
    if kind == "scalar":
        if isinstance(x, bool):
            return x
        if _is_int(x):
            return _int(x, path, _INT64_MIN)
        return _float(x, path)
    items = _arr(x, path)
    if kind == "ints":
        return [_int(e, f"{path}[{j}]", _INT64_MIN) for j, e in enumerate(items)]
    if kind == "floats":
        return [_float(e, f"{path}[{j}]") for j, e in enumerate(items)]
    if kind == "bools":
        return [_bool(e, f"{path}[{j}]") for j, e in enumerate(items)]
    if kind in ("tensors", "symints"):
        return [_int(e, f"{path}[{j}]") for j, e in enumerate(items)]
    if kind == "opt_tensors":
        return [_opt_int(e, f"{path}[{j}]") for j, e in enumerate(items)]
    raise _bad(path, f"unknown constant kind {kind!r}")  # pragma: no cover - CONST_KINDS checked before


def _dec_value(x: object, path: str):
    if not isinstance(x, dict):
        raise _bad(path, f"expected an object, got {_jtype(x)}")
    t = x.get("type")
    if t == "tensor":
        o = _obj(x, path, _TENSOR_KEYS)
        plan = o["plan"]
        if plan is not None:
            p = _obj(plan, f"{path}.plan", ("buffer", "offset"))
            plan = PlanEntry(_int(p["buffer"], f"{path}.plan.buffer"), _int(p["offset"], f"{path}.plan.offset"))
        shape = _arr(o["shape"], f"{path}.shape")
        if len(shape) > MAX_RANK:
            raise _bad(f"{path}.shape", f"{len(shape)} dimensions; at most {MAX_RANK} are supported")
        return TensorValue(
            dtype=_str(o["dtype"], f"{path}.dtype"),
            shape=tuple(_int(s, f"{path}.shape[{j}]") for j, s in enumerate(shape)),
            device=_device(o["device"], f"{path}.device"),
            plan=plan,
            constant=_opt_int(o["constant"], f"{path}.constant"),
            dynamic=tuple(_bool(b, f"{path}.dynamic[{j}]") for j, b in enumerate(_arr(o["dynamic"], f"{path}.dynamic"))),
            alias_of=_opt_int(o["alias_of"], f"{path}.alias_of"),
            name=_str(o["name"], f"{path}.name"),
        )
    if t == "const":
        o = _obj(x, path, _CONST_KEYS)
        kind = _str(o["kind"], f"{path}.kind")
        if kind not in CONST_KINDS:
            raise _bad(f"{path}.kind", f"unknown constant kind {_show(kind)}; kinds: {', '.join(CONST_KINDS)}")
        return ConstValue(kind, _dec_const_value(kind, o["value"], f"{path}.value"))
    raise _bad(f"{path}.type", f"expected 'tensor' or 'const', got {_show(t) if 'type' in x else 'nothing'}")


def _dec_ids(x: object, path: str, lo: int = 0) -> tuple[int, ...]:
    return tuple(_int(e, f"{path}[{j}]", lo) for j, e in enumerate(_arr(x, path)))


def _dec_instruction(x: object, path: str):
    if not isinstance(x, dict):
        raise _bad(path, f"expected an object, got {_jtype(x)}")
    t = x.get("type")
    if not isinstance(t, str) or t not in _INSTR_KEYS:
        raise _bad(f"{path}.type", f"expected 'kernel' or 'delegate', got {_show(t) if 'type' in x else 'nothing'}")
    o = _obj(x, path, _INSTR_KEYS[t])
    outputs = _dec_ids(o["outputs"], f"{path}.outputs")
    if t == "kernel":
        return KernelCall(_str(o["kernel"], f"{path}.kernel"), _dec_ids(o["args"], f"{path}.args", DEFAULT_ARG), outputs)
    return DelegateCall(_int(o["delegate"], f"{path}.delegate"), _dec_ids(o["args"], f"{path}.args"), outputs)


def _dec_method(x: object, path: str) -> Method:
    o = _obj(x, path, _METHOD_KEYS)
    lower = o["lower_bounds"]
    if not isinstance(lower, dict):
        raise _bad(f"{path}.lower_bounds", f"expected an object, got {_jtype(lower)}")
    return Method(
        name=_str(o["name"], f"{path}.name"),
        values=[_dec_value(v, f"{path}.values[{j}]") for j, v in enumerate(_arr(o["values"], f"{path}.values"))],
        instructions=[
            _dec_instruction(v, f"{path}.instructions[{j}]")
            for j, v in enumerate(_arr(o["instructions"], f"{path}.instructions"))
        ],
        inputs=list(_dec_ids(o["inputs"], f"{path}.inputs")),
        outputs=list(_dec_ids(o["outputs"], f"{path}.outputs")),
        buffers=[
            Buffer(_int(b["size"], f"{path}.buffers[{j}].size"), _device(b["device"], f"{path}.buffers[{j}].device"))
            for j, b in enumerate(_arr(o["buffers"], f"{path}.buffers"))
            for b in (_obj(b, f"{path}.buffers[{j}]", ("size", "device")),)
        ],
        mutable_buffers=[
            MutableBuffer(
                _int(b["value"], f"{path}.mutable_buffers[{j}].value"),
                _int(b["update"], f"{path}.mutable_buffers[{j}].update"),
                _str(b["name"], f"{path}.mutable_buffers[{j}].name"),
            )
            for j, b in enumerate(_arr(o["mutable_buffers"], f"{path}.mutable_buffers"))
            for b in (_obj(b, f"{path}.mutable_buffers[{j}]", ("value", "update", "name")),)
        ],
        lower_bounds={k: _int(v, f"{path}.lower_bounds[{k!r}]") for k, v in lower.items()},
        runtime_allocating_ops=[
            _str(s, f"{path}.runtime_allocating_ops[{j}]")
            for j, s in enumerate(_arr(o["runtime_allocating_ops"], f"{path}.runtime_allocating_ops"))
        ],
    )


def _dec_delegate(x: object, path: str) -> Delegate:
    o = _obj(x, path, ("backend_id", "compile_specs", "payload"))
    specs = []
    for j, pair in enumerate(_arr(o["compile_specs"], f"{path}.compile_specs")):
        p = f"{path}.compile_specs[{j}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise _bad(p, f"expected a [key, base64 value] pair, got {_jtype(pair)}")
        key = _str(pair[0], f"{p}[0]")
        text = _str(pair[1], f"{p}[1]")
        try:
            value = base64.b64decode(text.encode("ascii"), validate=True)
        except ValueError:  # binascii.Error, or non-ASCII text
            raise _bad(f"{p}[1]", f"compile spec {key!r} value is not valid base64") from None
        specs.append((key, value))
    return Delegate(_str(o["backend_id"], f"{path}.backend_id"), tuple(specs), _int(o["payload"], f"{path}.payload"))


# ---------------------------------------------------------------- JSON parsing, bounded

_JSON_STRING_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NON_BRACKET_RE = re.compile(r"[^\[\]{}]+")
_BRACKET_DELTA = {"[": 1, "{": 1, "]": -1, "}": -1}


_LONG_INT_RE = re.compile(r"(?<![.0-9])-?[0-9]{%d}" % (_MAX_INT_DIGITS + 1))


def _prescan(text: str) -> None:
    """Bound the work json.loads can be made to do: nesting depth (the C parser recurses) and
    integer literal length (int() is quadratic in the digits). Strings are removed first;
    the string pattern tokenises exactly as JSON does, up to the first syntax error."""
    outside = _JSON_STRING_RE.sub("", text)
    m = _LONG_INT_RE.search(outside)
    if m:
        raise ProgramError(f"metadata: an integer literal has more than {_MAX_INT_DIGITS} digits")
    brackets = _NON_BRACKET_RE.sub("", outside)
    depth = max(accumulate(map(_BRACKET_DELTA.__getitem__, brackets))) if brackets else 0
    if depth > MAX_JSON_DEPTH:
        raise ProgramError(f"metadata JSON nests {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed")


def _no_duplicates(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ProgramError(f"metadata: duplicate key {_show(dup)} in a JSON object")
    return d


def _parse_float(s: str) -> float:
    f = float(s)
    if not math.isfinite(f):
        raise ProgramError(f"metadata: number {s[:40]!r} overflows a float (write 'inf' or '-inf' as a string)")
    return f


def _parse_constant(s: str):
    raise ProgramError(f"metadata: {s} is not valid JSON (write 'inf', '-inf', 'nan' as strings)")


def _parse_metadata(raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProgramError(f"metadata is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    _prescan(text)
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except ProgramError:
        raise
    except RecursionError:
        raise ProgramError("metadata JSON nests too deeply") from None
    except ValueError as e:  # json.JSONDecodeError and int/float conversion limits
        raise ProgramError(f"metadata is not valid JSON: {e}") from None


# ---------------------------------------------------------------- header and layout


def _read(view: memoryview) -> Program:
    size = view.nbytes
    if size >= len(MAGIC) and bytes(view[: len(MAGIC)]) != MAGIC:
        raise ProgramError(f"not a ferry program (magic bytes {bytes(view[:8])!r}, expected {MAGIC!r})")
    if size < HEADER_SIZE:
        raise ProgramError(f"file is truncated: {size} bytes, the header alone needs {HEADER_SIZE}")
    magic, version, flags, meta_len, area = _HEADER.unpack(view[:HEADER_SIZE])
    if version > FORMAT_VERSION:
        raise ProgramError(
            f"format version {version} is newer than this ferry supports ({FORMAT_VERSION}); upgrade ferry"
        )
    if version < 1:
        raise ProgramError(f"format version {version} is not valid (versions start at 1)")
    if flags != 0:
        raise ProgramError(f"header flags 0x{flags:x} are unknown to format version {version} (must be 0)")
    if meta_len > size - HEADER_SIZE:
        raise ProgramError(
            f"metadata length {meta_len} exceeds the file: {size} bytes, {size - HEADER_SIZE} after the header "
            "(file truncated or corrupt)"
        )
    meta_end = HEADER_SIZE + meta_len
    if area % SEGMENT_ALIGNMENT or area < meta_end or area > size:
        raise ProgramError(
            f"segment-area offset {area} is invalid: it must be a multiple of {SEGMENT_ALIGNMENT}, "
            f">= the end of the metadata ({meta_end}) and <= the file size ({size})"
        )

    meta = _parse_metadata(bytes(view[HEADER_SIZE:meta_end]))
    top = _obj(meta, "(top level)", _TOP_KEYS)

    # segment table: validated against the file size before any segment is touched
    area_size = size - area
    table: list[tuple[int, int]] = []
    end = 0
    for j, entry in enumerate(_arr(top["segments"], "segments")):
        p = f"segments[{j}]"
        if not isinstance(entry, list) or len(entry) != 2:
            raise _bad(p, f"expected an [offset, size] pair, got {_jtype(entry)}")
        off, n = _int(entry[0], f"{p}[0]"), _int(entry[1], f"{p}[1]")
        if off % SEGMENT_ALIGNMENT:
            raise ProgramError(f"segment {j} offset {off} is not a multiple of {SEGMENT_ALIGNMENT}")
        if off < end:
            raise ProgramError(f"segment {j} offset {off} overlaps or precedes segment {j - 1} (which ends at {end})")
        if off + n > area_size:
            raise ProgramError(
                f"segment {j} (offset {off} + {n} bytes) exceeds the segment area "
                f"({area_size} bytes from file offset {area}); file truncated or corrupt"
            )
        table.append((off, n))
        end = off + n
    if end != area_size:
        raise ProgramError(
            f"file size {size} does not match its layout: the segments end at file offset {area + end}"
        )

    delegates = [_dec_delegate(d, f"delegates[{j}]") for j, d in enumerate(_arr(top["delegates"], "delegates"))]
    methods: dict[str, Method] = {}
    for j, m in enumerate(_arr(top["methods"], "methods")):
        method = _dec_method(m, f"methods[{j}]")
        if method.name in methods:
            raise _bad(f"methods[{j}].name", f"duplicate method name {method.name!r}")
        methods[method.name] = method

    segments = [view[area + off : area + off + n] for off, n in table]
    program = Program(methods=methods, delegates=delegates, segments=segments)
    validate_program(program)
    return program


def load_program(source) -> Program:
    """Load a program from a path (memory-mapped; segments are zero-copy memoryviews into the
    mapping, which stays open while any of them is alive) or from bytes / bytearray /
    memoryview. Raises ProgramError for anything malformed, truncated or too new; OSError
    for a file that cannot be opened."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        if isinstance(source, bytes):
            view = memoryview(source)
        elif isinstance(source, memoryview) and source.readonly and source.c_contiguous:
            view = _byte_view(source)
        else:  # caller-mutable memory: take a private copy
            view = memoryview(bytes(source))
        try:
            return _read(view)
        except ProgramError as e:
            raise ProgramError(f"ferry program ({view.nbytes} bytes): {e}") from None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_program expects a path or bytes, got {type(source).__name__}")
    path = os.fspath(source)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ProgramError(f"ferry program {path!r}: the file is empty")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    try:
        return _read(view)
    except ProgramError as e:
        err = ProgramError(f"ferry program {os.fsdecode(path)!r}: {e}")
    view.release()
    try:
        mm.close()
    except BufferError:  # a segment view is still referenced; the mapping closes with it
        pass
    raise err
