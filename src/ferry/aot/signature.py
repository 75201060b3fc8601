"""The call signature of an exported program (program/signature.py), read from torch.export's
input and output tree specs. It is what lets `ferry.Module` take a model's keyword arguments and
return its dicts, tuples and ModelOutputs, as `ep.module()` does."""

from __future__ import annotations

import json
import warnings

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind

from ferry.program.signature import MAX_TREE_DEPTH, Key, Signature, Tree

__all__ = ["signature_of", "warn_merged_inputs"]


class _Unstorable(Exception):
    """A part of the tree the file cannot hold as plain data."""


def signature_of(ep: torch.export.ExportedProgram, name: str) -> Signature | None:
    """`ep`'s signature; None (the method takes and returns flat tensors) with a warning where a
    part of it is no plain data: a constant argument of another type, a container whose pytree
    context is no JSON."""
    spec = ep.call_spec
    if spec is None or spec.in_spec is None or spec.out_spec is None:
        return None
    ins = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    outs = [s for s in ep.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    try:
        leaves = iter([_input_leaf(s.arg) for s in ins])
        inputs = _tree(spec.in_spec, leaves, 0)
        if next(leaves, None) is not None:
            raise _Unstorable(f"the input tree has fewer leaves than the program's {len(ins)} inputs")
        results = iter([Tree("value")] * len(outs))
        outputs = _tree(spec.out_spec, results, 0)
        if next(results, None) is not None:
            raise _Unstorable(f"the result tree has fewer leaves than the program's {len(outs)} outputs")
    except _Unstorable as e:
        warnings.warn(f"method {name!r}: {e}; the module takes and returns flat tensors", stacklevel=3)
        return None
    if inputs.kind != "tuple" or [t.kind for t in inputs.items] != ["tuple", "dict"]:
        return None
    return Signature(inputs, outputs, _arg_names(ep, len(inputs.items[0].items)))


def warn_merged_inputs(ep: torch.export.ExportedProgram, name: str) -> None:
    """Say so when export was given one tensor object for two inputs: torch.export traces them as
    one, so the program (and `ep.module()`) reads one of them for both, whatever a call passes,
    where eager reads each. Nothing downstream can undo it; exporting with distinct tensors can."""
    example = getattr(ep, "example_inputs", None)
    ins = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    leaves = pytree.tree_leaves(example) if example else []
    if len(leaves) != len(ins):
        return
    first: dict[int, str] = {}
    for leaf, arg in zip(leaves, ins):
        if isinstance(leaf, torch.Tensor) and first.setdefault(id(leaf), arg) != arg:
            warnings.warn(f"method {name!r}: inputs {first[id(leaf)]!r} and {arg!r} were one tensor at export, and "
                          "torch.export traced them as one: the program reads the same values for both, whatever a "
                          "call passes (eager reads each). Export with distinct tensors (e.g. a clone) to keep them "
                          "apart", stacklevel=3)


def _arg_names(ep, count: int) -> tuple[str, ...]:
    """The positional parameters' names (torch.export records them), or none if unknown."""
    graph = getattr(ep, "module_call_graph", None) or []
    names = getattr(graph[0].signature, "forward_arg_names", None) if graph and graph[0].signature else None
    names = tuple(names or ())[:count]
    return names if len(names) == count and len(set(names)) == count else ()


def _input_leaf(arg) -> Tree:
    if not isinstance(arg, ConstantArgument):
        return Tree("value")
    v = arg.value
    if v is None or type(v) in (bool, float, str) or (type(v) is int and -(1 << 63) <= v < (1 << 63)):
        return Tree("constant", value=v)
    raise _Unstorable(f"argument {arg.name!r} was fixed at export to {type(v).__name__} {v!r}, which the file "
                      "cannot hold")


def _tree(spec: pytree.TreeSpec, leaves, depth: int) -> Tree:
    if depth > MAX_TREE_DEPTH:
        raise _Unstorable(f"the tree nests deeper than {MAX_TREE_DEPTH}")
    if spec.is_leaf():
        leaf = next(leaves, None)
        if leaf is None:
            raise _Unstorable("the tree has more leaves than the program has inputs or outputs")
        return leaf
    children = spec.children() if hasattr(spec, "children") else spec.children_specs  # (torch < 2.12)
    items = tuple(_tree(c, leaves, depth + 1) for c in children)
    typ, context = spec.type, spec.context
    if typ in (tuple, list):
        return Tree(typ.__name__, items)
    if typ is dict:
        return Tree("dict", items, _keys(context, typ))
    if typ is type(None):
        return Tree("none")
    if typ is getattr(pytree, "namedtuple", None) and isinstance(context, type):
        typ = context  # (pytree's spec of a named tuple: the marker type, the class as context)
    if pytree.is_namedtuple_class(typ):
        return Tree("namedtuple", items, tuple(typ._fields), f"{typ.__module__}.{typ.__qualname__}")
    return _node(typ, context, items)


def _node(typ: type, context, items: tuple[Tree, ...]) -> Tree:
    """A container registered with pytree (ModelOutput, OrderedDict): its registered name and its
    context as JSON, never as code; a context that needs its own serializer is not stored."""
    serial = pytree.SUPPORTED_SERIALIZED_TYPES.get(typ)
    if serial is not None and serial.to_dumpable_context is not None:
        raise _Unstorable(f"a {_type_name(typ)} needs its own serializer for its context")
    try:
        text = json.dumps(context, allow_nan=False)
    except (TypeError, ValueError):
        raise _Unstorable(f"a {_type_name(typ)}'s pytree context {context!r} is not JSON") from None
    keys = tuple(context) if isinstance(context, (list, tuple)) and len(context) == len(items) else ()
    if not _plain_keys(keys) or len(set(keys)) != len(keys):
        keys = ()  # (kept only where a dict can stand in for the type: see runtime/stages/call_tree.py)
    return Tree("node", items, keys, _type_name(typ), text)


def _type_name(typ: type) -> str:
    """The name a type is found by again: pytree's serialized name, else module.qualname."""
    serial = pytree.SUPPORTED_SERIALIZED_TYPES.get(typ)
    name = getattr(serial, "serialized_type_name", None)
    if isinstance(name, str) and name and name != pytree.NO_SERIALIZED_TYPE_NAME_FOUND:
        return name
    return f"{typ.__module__}.{typ.__qualname__}"


def _keys(context, typ) -> tuple[Key, ...]:
    keys = tuple(context)
    if not _plain_keys(keys):
        raise _Unstorable(f"a {typ.__name__} key is not a string or an integer: {list(keys)!r}")
    return keys


def _plain_keys(keys: tuple) -> bool:
    """Keys a file holds: strings and integers (not bools)."""
    return all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys)
