"""The metadata of a program file, described once per record kind.

Each record of the data model (a tensor value, a constant, an instruction, a buffer, a
method, a delegate) is described here by its fields and their field types. One description
drives three things: writing the record as JSON (`encode`), reading it back with every field
checked (`decode`, errors name the JSON path), and checking an in-memory record before it is
saved (`check`, errors name the record). Cross references (value ids in range, buffers that
fit, storage that agrees with plan and alias) are semantic checks: program/validate.py.
"""

from __future__ import annotations

import math
from types import MappingProxyType

from ferry.errors import ProgramError
from ferry.program.fields import (
    MAX_RANK,
    Bool,
    Bytes,
    DeviceField,
    Dtype,
    Field,
    Int,
    OneOf,
    Opt,
    Record,
    Seq,
    Str,
    StrKeyed,
    Tagged,
    bad,
    check_keys,
    is_int,
    jtype,
    show,
)
from ferry.program.schema import (
    CONST_KIND_TABLE,
    CONST_KINDS,
    DEFAULT_ARG,
    STORAGE_KINDS,
    Buffer,
    ConstValue,
    Delegate,
    DelegateCall,
    InputWrite,
    KernelCall,
    Method,
    MutableBuffer,
    PlanEntry,
    QuantizedWeight,
    TensorValue,
)
from ferry.program.signature import MAX_TREE_DEPTH, MAX_TREE_NODES, TREE_KINDS, Signature, Tree, check_tree

_SPECIAL_FLOATS = MappingProxyType({"inf": math.inf, "-inf": -math.inf, "nan": math.nan})


# ---------------------------------------------------------------- constants


def _enc_float(x: float) -> float | str:
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _dec_number(x: object, path: str, allow_bool: bool = False) -> object:
    """A JSON number, or 'inf', '-inf', 'nan' as strings (ints stay ints)."""
    if isinstance(x, str):
        if x in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[x]
        raise bad(path, f"expected a number or 'inf', '-inf', 'nan', got string {show(x)}")
    if is_int(x) or isinstance(x, float) or (allow_bool and isinstance(x, bool)):
        return x
    raise bad(path, f"expected a number, got {jtype(x)}")


def _as_float(x: object, path: str) -> float:
    try:
        return float(x)  # type: ignore[arg-type]
    except OverflowError:
        raise bad(path, f"number {show(x)} is out of float range") from None


def _holds(kind, value) -> bool:
    """Whether `value` is a value of the constant kind (never raises, whatever the value)."""
    try:
        return bool(kind.check(value))
    except (TypeError, ValueError, OverflowError):
        return False


class ConstField(Field):
    """A ConstValue: its kind's row in schema.CONST_KIND_TABLE says what its value may be."""

    keys = ("type", "kind", "value")

    def encode(self, c):
        kind = CONST_KIND_TABLE[c.kind]
        v = c.value
        if kind.floats:
            v = [_enc_float(e) for e in v] if isinstance(v, (list, tuple)) else (
                v if isinstance(v, (bool, int)) else _enc_float(v))
        elif isinstance(v, tuple):
            v = list(v)
        return {"type": "const", "kind": c.kind, "value": v}

    def decode(self, x, path):
        o = check_keys(x, path, self.keys)
        kind = o["kind"]
        if not isinstance(kind, str) or kind not in CONST_KIND_TABLE:
            raise bad(f"{path}.kind", f"unknown constant kind {show(kind)}; kinds: {', '.join(CONST_KINDS)}")
        spec, v = CONST_KIND_TABLE[kind], o["value"]
        if spec.floats:
            if isinstance(v, list):
                v = [_as_float(_dec_number(e, f"{path}.value[{j}]"), f"{path}.value[{j}]") for j, e in enumerate(v)]
            else:
                v = _dec_number(v, f"{path}.value", allow_bool=kind == "scalar")
                if kind == "float" and is_int(v):
                    v = _as_float(v, f"{path}.value")
        if not _holds(spec, v):
            raise bad(f"{path}.value", f"expected {spec.description}, got {jtype(v)} {show(v)}")
        return ConstValue(kind, v)

    def check(self, c, what):
        if not isinstance(c.kind, str) or c.kind not in CONST_KIND_TABLE:
            raise ProgramError(f"{what}: unknown constant kind {show(c.kind)}; kinds: {', '.join(CONST_KINDS)}")
        spec = CONST_KIND_TABLE[c.kind]
        if not _holds(spec, c.value):
            raise ProgramError(f"{what} ({c.kind}) must hold {spec.description}, got {type(c.value).__name__} "
                               f"{show(c.value)}")


class _TaggedValue(Tagged):
    """A value: a tagged tensor record or a constant."""

    def encode(self, x):
        return CONST.encode(x) if isinstance(x, ConstValue) else TENSOR.encode(x)

    def decode(self, x, path):
        if isinstance(x, dict) and x.get("type") == "const":
            return CONST.decode(x, path)
        return super().decode(x, path)

    def check(self, x, what):
        if isinstance(x, ConstValue):
            return CONST.check(x, what)
        if not isinstance(x, TensorValue):
            raise ProgramError(f"{what} must be a TensorValue or ConstValue, got {type(x).__name__}")
        TENSOR.check(x, what)


class TreeField(Field):
    """A call's argument or result tree (program/signature.py), written flat: its nodes in
    preorder, each with its count of items, so a deep tree never nests the file's JSON. A
    constant's value is a constant record (ConstField), which keeps 'inf' the string apart from
    inf the float."""

    keys = ("kind", "n", "keys", "type", "context", "const")

    def encode(self, t: Tree):
        out, stack = [], [t]
        while stack:
            node = stack.pop()
            rec: dict = {"kind": node.kind}
            if node.items:
                rec["n"] = len(node.items)
            if node.keys:
                rec["keys"] = list(node.keys)
            if node.type:
                rec["type"], rec["context"] = node.type, node.context
            if node.kind == "constant":
                rec["const"] = CONST.encode(ConstValue(_SCALAR_KINDS[type(node.value)], node.value))
            out.append(rec)
            stack.extend(reversed(node.items))
        return out

    def decode(self, x, path):
        nodes = Seq(ANY).decode(x, path)
        if not nodes or len(nodes) > MAX_TREE_NODES:
            raise bad(path, f"expected 1 to {MAX_TREE_NODES} tree nodes, got {len(nodes)}")
        parsed = [self._node(e, f"{path}[{j}]") for j, e in enumerate(nodes)]
        tree, used = _tree_from_preorder(parsed, path)
        if used != len(parsed):
            raise bad(path, f"the tree ends at node {used}; {len(parsed) - used} more follow")
        check_tree(tree, path)
        return tree

    def _node(self, e, path):
        o = check_keys(e, path, self.keys, optional=("n", "keys", "type", "context", "const"))
        kind = OneOf(TREE_KINDS).decode(o["kind"], f"{path}.kind")
        n = Int(0, MAX_TREE_NODES).decode(o.get("n", 0), f"{path}.n")
        keys = tuple(Seq(ANY).decode(o.get("keys", []), f"{path}.keys"))
        for j, k in enumerate(keys):
            if not (isinstance(k, str) or is_int(k)):
                raise bad(f"{path}.keys[{j}]", f"expected a string or integer key, got {jtype(k)}")
        if (kind == "constant") != ("const" in o):
            raise bad(path, "a constant, and only a constant, holds a 'const'")
        value = None
        if "const" in o:
            c = CONST.decode(o["const"], f"{path}.const")
            if c.kind not in _SCALAR_KINDS.values():
                raise bad(f"{path}.const.kind", f"expected one of {', '.join(_SCALAR_KINDS.values())}, got {c.kind!r}")
            value = c.value
        return kind, n, keys, Str().decode(o.get("type", ""), f"{path}.type"), \
            Str().decode(o.get("context", ""), f"{path}.context"), value

    def check(self, x, what):
        if not isinstance(x, Tree):
            raise ProgramError(f"{what} must be a Tree, got {type(x).__name__}")
        check_tree(x, what)
        for leaf in x.leaves():
            if leaf.kind == "constant" and type(leaf.value) not in _SCALAR_KINDS:
                raise ProgramError(f"{what}: a constant is None, a bool, an int, a float or a string, "
                                   f"got {type(leaf.value).__name__}")
            if leaf.kind == "constant":
                CONST.check(ConstValue(_SCALAR_KINDS[type(leaf.value)], leaf.value), f"{what} constant")


_SCALAR_KINDS = MappingProxyType({type(None): "none", bool: "bool", int: "int", float: "float", str: "str"})


def _tree_from_preorder(parsed: list, path: str) -> tuple[Tree, int]:
    """The tree whose preorder nodes are `parsed` ((kind, n, keys, type, context, value) each),
    and how many nodes it took; iterative, so no file can nest it past the stack."""
    # a frame: [node fields, items so far]; a node is finished when its items are all built
    stack: list = []
    pos = 0
    while True:
        if pos >= len(parsed):
            raise bad(path, f"the tree's nodes run out: {len(parsed)} nodes, more items declared")
        if len(stack) > MAX_TREE_DEPTH:
            raise bad(path, f"the tree is nested deeper than {MAX_TREE_DEPTH}")
        fields = parsed[pos]
        pos += 1
        stack.append([fields, []])
        while stack and len(stack[-1][1]) == stack[-1][0][1]:
            (kind, _n, keys, typ, context, value), items = stack.pop()
            built = Tree(kind, tuple(items), keys, typ, context, value)
            if not stack:
                return built, pos
            stack[-1][1].append(built)


# ---------------------------------------------------------------- the records

ID = Int()
ARG_ID = Int(DEFAULT_ARG)
IDS = Seq(ID, as_tuple=True)

PLAN = Record(PlanEntry, (("buffer", ID), ("offset", ID)))
TENSOR = Record(TensorValue, (
    ("dtype", Dtype()), ("shape", Seq(Int(), as_tuple=True, max_len=MAX_RANK)), ("device", DeviceField()),
    ("plan", Opt(PLAN)), ("constant", Opt(ID)), ("dynamic", Seq(Bool(), as_tuple=True)), ("alias_of", Opt(ID)),
    ("name", Str()), ("strides", Seq(Int(), as_tuple=True, max_len=MAX_RANK)), ("storage", OneOf(tuple(STORAGE_KINDS))),
), tag="tensor")
CONST = ConstField()
VALUE = _TaggedValue((TENSOR, Record(ConstValue, (), tag="const")))
INSTRUCTION = Tagged((
    Record(KernelCall, (("kernel", Str(nonempty=True)), ("args", Seq(ARG_ID, as_tuple=True)), ("outputs", IDS)),
           tag="kernel"),
    Record(DelegateCall, (("delegate", ID), ("args", IDS), ("outputs", IDS), ("scratch", IDS)), tag="delegate"),
))
BUFFER = Record(Buffer, (("size", Int()), ("device", DeviceField()), ("alignment", Int(1, 1 << 30))))
MUTABLE_BUFFER = Record(MutableBuffer, (("value", ID), ("update", ID), ("name", Str())))
QUANTIZED_WEIGHT = Record(QuantizedWeight, (
    ("name", Str(nonempty=True)), ("scheme", Str(nonempty=True)), ("dtype", Dtype()),
    ("shape", Seq(Int(), as_tuple=True, max_len=MAX_RANK)), ("parts", StrKeyed(Str())), ("nbytes", Int()),
    ("details", Str()),
))
INPUT_WRITE = Record(InputWrite, (("output", ID), ("input", ID)))
SIGNATURE = Record(Signature, (("inputs", TreeField()), ("outputs", TreeField()), ("arg_names", Seq(Str(), as_tuple=True))))
METHOD = Record(Method, (
    ("name", Str(nonempty=True)), ("values", Seq(VALUE)), ("instructions", Seq(INSTRUCTION)),
    ("inputs", Seq(ID)), ("outputs", Seq(ID)), ("buffers", Seq(BUFFER)), ("mutable_buffers", Seq(MUTABLE_BUFFER)),
    ("lower_bounds", StrKeyed(Int())), ("runtime_allocating_ops", Seq(Str())), ("kernel_choices", StrKeyed(Str())),
    ("device_map", StrKeyed(Str())), ("max_memory", StrKeyed(Int())), ("storage_inputs", Seq(ID)),
    ("equal_sizes", Seq(Seq(Seq(Int(lo=-1), max_len=2), max_len=MAX_RANK * 1024), max_len=1 << 16)),
    ("size_minimums", Seq(Seq(Int(lo=-1), max_len=3), max_len=1 << 16)),  # dim -1: an int input
    ("derived_sizes", Seq(Seq(Int(lo=-(1 << 62), hi=1 << 62), max_len=6), max_len=1 << 16)),
    ("input_guards", Seq(Str(), max_len=256)),  # guards.MAX_GUARDS
    ("quantized_weights", Seq(QUANTIZED_WEIGHT)), ("input_writes", Seq(INPUT_WRITE)), ("signature", Opt(SIGNATURE)),
), optional=("device_map", "max_memory", "storage_inputs", "equal_sizes", "size_minimums", "derived_sizes", "input_guards",
             "quantized_weights", "input_writes", "signature"))


class _SpecPairs(Field):
    """Compile specs: (key, bytes) pairs, written as [key, base64] arrays."""

    def encode(self, x):
        return [[k, Bytes().encode(v)] for k, v in x]

    def decode(self, x, path):
        out = []
        for j, pair in enumerate(Seq(ANY).decode(x, path)):
            p = f"{path}[{j}]"
            if not isinstance(pair, list) or len(pair) != 2:
                raise bad(p, f"expected a [key, base64 value] pair, got {jtype(pair)}")
            key = Str().decode(pair[0], f"{p}[0]")
            try:
                out.append((key, Bytes().decode(pair[1], f"{p}[1]")))
            except ProgramError:
                raise bad(f"{p}[1]", f"compile spec {key!r} value is not valid base64") from None
        return tuple(out)

    def check(self, x, what):
        Seq(ANY).check(x, what)
        for j, pair in enumerate(x):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ProgramError(f"{what} {j} must be a (key, bytes) pair, got {show(pair)}")
            Str().check(pair[0], f"{what} {j} key")
            Bytes().check(pair[1], f"{what} {pair[0]!r}")


class _Any(Field):
    def decode(self, x, path):
        return x

    def check(self, x, what):
        return None


ANY = _Any()
DELEGATE = Record(Delegate, (("backend_id", Str(nonempty=True)), ("compile_specs", _SpecPairs()), ("payload", ID)))
