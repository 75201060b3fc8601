"""The field types a program file's records are described by (program/codec.py): each encodes a
value as JSON, decodes it back with every part checked (errors name the JSON path), and checks an
in-memory value before it is saved (errors name the record)."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from ferry.device import Device
from ferry.errors import ProgramError
from ferry.program.schema import INT64, dtype_from_name

MAX_RANK = 64  # most dimensions a tensor may have


def show(x: object) -> str:
    """A short, never-failing repr for error messages (huge ints have no decimal repr)."""
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 96:
        return f"<{x.bit_length()}-bit integer>"
    try:
        r = repr(x)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not escape
        return f"<{type(x).__name__}>"
    return r if len(r) <= 80 else r[:77] + "..."


def jtype(x: object) -> str:
    """The JSON type name of a decoded JSON value."""
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array",
             dict: "object"}
    return names.get(type(x), type(x).__name__)


def bad(path: str, msg: str) -> ProgramError:
    return ProgramError(f"metadata {path}: {msg}")


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---------------------------------------------------------------- field types


class Field:
    """How one field is written, read and checked."""

    def encode(self, x):
        return x

    def decode(self, x, path: str):
        raise NotImplementedError

    def check(self, x, what: str) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Field):
    lo: int = 0
    hi: int = INT64[1]

    def decode(self, x, path):
        if not is_int(x):
            raise bad(path, f"expected an integer, got {jtype(x)}")
        if not self.lo <= x <= self.hi:
            raise bad(path, f"integer {show(x)} is out of range [{self.lo}, {self.hi}]")
        return x

    def check(self, x, what):
        if not is_int(x):
            raise ProgramError(f"{what} must be an integer, got {type(x).__name__} {show(x)}")
        if not self.lo <= x <= self.hi:
            raise ProgramError(f"{what} must be in [{self.lo}, {self.hi}], got {show(x)}")


@dataclass(frozen=True)
class Str(Field):
    nonempty: bool = False

    def decode(self, x, path):
        if not isinstance(x, str):
            raise bad(path, f"expected a string, got {jtype(x)}")
        if self.nonempty and not x:
            raise bad(path, "must be a non-empty string")
        return x

    def check(self, x, what):
        if not isinstance(x, str):
            raise ProgramError(f"{what} must be a string, got {type(x).__name__} {show(x)}")
        if self.nonempty and not x:
            raise ProgramError(f"{what} must be a non-empty string")


class Bool(Field):
    def decode(self, x, path):
        if not isinstance(x, bool):
            raise bad(path, f"expected true or false, got {jtype(x)}")
        return x

    def check(self, x, what):
        if not isinstance(x, bool):
            raise ProgramError(f"{what} must be a bool, got {type(x).__name__}")


class Dtype(Field):
    def decode(self, x, path):
        if not isinstance(x, str):
            raise bad(path, f"expected a dtype name, got {jtype(x)}")
        dtype_from_name(x)
        return x

    def check(self, x, what):
        if not isinstance(x, str):
            raise ProgramError(f"{what}: dtype must be a dtype name string, got {type(x).__name__}")
        try:
            dtype_from_name(x)
        except ProgramError as e:
            raise ProgramError(f"{what}: {e}") from None


@dataclass(frozen=True)
class OneOf(Field):
    names: tuple[str, ...]

    def decode(self, x, path):
        if not isinstance(x, str) or x not in self.names:
            raise bad(path, f"expected one of {', '.join(self.names)}, got {show(x)}")
        return x

    def check(self, x, what):
        if not isinstance(x, str) or x not in self.names:
            raise ProgramError(f"{what} must be one of {', '.join(self.names)}, got {show(x)}")


class DeviceField(Field):
    def encode(self, x):
        return str(x)  # 'cuda:0', or 'rank1:cuda:0' for a device of another process

    def decode(self, x, path):
        if not isinstance(x, str):
            raise bad(path, f"expected a device string, got {jtype(x)}")
        try:
            return Device.from_canonical(x)
        except ValueError as e:
            raise bad(path, str(e)) from None

    def check(self, x, what):
        if not isinstance(x, Device):
            raise ProgramError(f"{what} must be a ferry Device, got {type(x).__name__} {show(x)}")
        try:
            Device.from_canonical(str(x))
        except ValueError:
            raise ProgramError(f"{what}: device type {show(x.type)} is not a lowercase identifier like 'cuda'") from None


class Bytes(Field):
    def encode(self, x):
        return base64.b64encode(bytes(x)).decode("ascii")

    def decode(self, x, path):
        if not isinstance(x, str):
            raise bad(path, f"expected base64 text, got {jtype(x)}")
        try:
            return base64.b64decode(x.encode("ascii"), validate=True)
        except ValueError:  # binascii.Error, or non-ASCII text
            raise bad(path, "value is not valid base64") from None

    def check(self, x, what):
        if not isinstance(x, (bytes, bytearray, memoryview)):
            raise ProgramError(f"{what} value must be bytes, got {type(x).__name__}")


@dataclass(frozen=True)
class Opt(Field):
    inner: Field

    def encode(self, x):
        return None if x is None else self.inner.encode(x)

    def decode(self, x, path):
        return None if x is None else self.inner.decode(x, path)

    def check(self, x, what):
        if x is not None:
            self.inner.check(x, what)


@dataclass(frozen=True)
class Seq(Field):
    """A JSON array; `as_tuple` reads it as a tuple (else a list)."""

    item: Field
    as_tuple: bool = False
    max_len: int | None = None

    def encode(self, x):
        return [self.item.encode(e) for e in x]

    def decode(self, x, path):
        if not isinstance(x, list):
            raise bad(path, f"expected an array, got {jtype(x)}")
        if self.max_len is not None and len(x) > self.max_len:
            raise bad(path, f"{len(x)} dimensions; at most {self.max_len} are supported")
        items = [self.item.decode(e, f"{path}[{j}]") for j, e in enumerate(x)]
        return tuple(items) if self.as_tuple else items

    def check(self, x, what):
        if not isinstance(x, (list, tuple)):
            raise ProgramError(f"{what} must be a list or tuple, got {type(x).__name__}")
        if self.max_len is not None and len(x) > self.max_len:
            raise ProgramError(f"{what}: {len(x)} dimensions; at most {self.max_len} are supported")
        for j, e in enumerate(x):
            self.item.check(e, f"{what}[{j}]")


@dataclass(frozen=True)
class StrKeyed(Field):
    """A JSON object of string keys to values of one field type."""

    value: Field

    def encode(self, x):
        return {k: self.value.encode(v) for k, v in x.items()}

    def decode(self, x, path):
        if not isinstance(x, dict):
            raise bad(path, f"expected an object, got {jtype(x)}")
        return {k: self.value.decode(v, f"{path}[{k!r}]") for k, v in x.items()}

    def check(self, x, what):
        if not isinstance(x, dict):
            raise ProgramError(f"{what} must be a dict with string keys")
        for k, v in x.items():
            Str().check(k, f"{what} key")
            self.value.check(v, f"{what} for {k!r}")


def check_keys(x: object, path: str, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """`x` is a JSON object with exactly `keys`, of which `optional` may be absent."""
    if not isinstance(x, dict):
        raise bad(path, f"expected an object, got {jtype(x)}")
    missing = [k for k in keys if k not in x and k not in optional]
    if missing:
        raise bad(path, f"missing key(s) {', '.join(map(repr, missing))}")
    extra = sorted(k for k in x if k not in keys)
    if extra:
        raise bad(path, f"unknown key(s) {', '.join(map(show, extra))}")
    return x


@dataclass(frozen=True)
class Record(Field):
    """A dataclass written as a JSON object of its fields (plus a "type" tag when given).

    `optional` fields are left out while empty and read as empty when absent: a field added
    within a format version keeps files that do not use it readable by earlier readers."""

    cls: type
    fields: tuple[tuple[str, Field], ...]
    tag: str | None = None
    optional: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        names = tuple(n for n, _ in self.fields)
        return ("type",) + names if self.tag else names

    def encode(self, x):
        out = {"type": self.tag} if self.tag else {}
        out.update((n, f.encode(getattr(x, n))) for n, f in self.fields
                   if n not in self.optional or getattr(x, n))
        return out

    def decode(self, x, path):
        o = check_keys(x, path, self.keys, self.optional)
        return self.cls(**{n: f.decode(o[n], f"{path}.{n}") for n, f in self.fields if n in o})

    def check(self, x, what):
        if not isinstance(x, self.cls):
            raise ProgramError(f"{what} must be a {self.cls.__name__}, got {type(x).__name__}")
        for n, f in self.fields:
            f.check(getattr(x, n), f"{what} {n}")


@dataclass(frozen=True)
class Tagged(Field):
    """One of several records, told apart by their "type" tag."""

    records: tuple[Record, ...]

    def _of(self, x) -> Record | None:
        return next((r for r in self.records if isinstance(x, r.cls)), None)

    def encode(self, x):
        return self._of(x).encode(x)  # type: ignore[union-attr]

    def decode(self, x, path):
        t = x.get("type") if isinstance(x, dict) else None
        for r in self.records:
            if r.tag == t:
                return r.decode(x, path)
        if not isinstance(x, dict):
            raise bad(path, f"expected an object, got {jtype(x)}")
        tags = " or ".join(repr(r.tag) for r in self.records)
        raise bad(f"{path}.type", f"expected {tags}, got {show(t) if 'type' in x else 'nothing'}")

    def check(self, x, what):
        r = self._of(x)
        if r is None:
            names = " or ".join(r.cls.__name__ for r in self.records)
            raise ProgramError(f"{what} must be a {names}, got {type(x).__name__}")
        r.check(x, what)
