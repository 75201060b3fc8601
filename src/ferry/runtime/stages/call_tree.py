"""Calls in the model's own terms. A call's `(args, kwargs)` are flattened into the method's inputs
by its signature (program/signature.py), and its outputs are rebuilt into the model's result
(dicts, tuples, named tuples, ModelOutputs), as `ep.module()` takes and returns them.

Result types are found among those this process already has (pytree's registry, modules already
imported); none is imported and nothing from the file runs. A type the process lacks comes back
as the nearest plain container, with one warning that says what to import."""

from __future__ import annotations

import collections
import functools
import json
import keyword
import math
import warnings
from collections.abc import Callable, Mapping

import torch
import torch.utils._pytree as pytree

from ferry.errors import InputError, ProgramError
from ferry.imported import imported_type
from ferry.program.signature import Signature, Tree, call_text, node_context

__all__ = ["CallTree"]


def _flat_result(outs: list):
    """What a call without a signature returns for its outputs (a file saved before signatures
    were kept): one output as it is, several as a tuple, and None for none."""
    if not outs:
        return None
    return outs[0] if len(outs) == 1 else tuple(outs)


class CallTree:
    """How one method's calls are taken and answered: built once per loaded method."""

    def __init__(self, signature: Signature | None, method: str, inputs: int):
        self.signature, self.method, self.count = signature, method, inputs
        self.flat = signature is None or (all(t.kind == "value" for t in signature.args.items)
                                          and not signature.kwargs.items)
        self._build: Callable[[list], object] = _flat_result
        if signature is not None:
            try:
                self._build = _builder(signature.outputs, method)
            except ProgramError:
                raise
            except (TypeError, ValueError) as e:  # a result type refusing the file's names
                raise ProgramError(f"method {method!r}: the file's result structure cannot be built: {e}") from None
        # a flat call's tensors are taken in the program's order, which for keywords is the order
        # they were given at export, not necessarily forward's: said once where two or more
        self._order_unsure = signature is not None and signature.kwargs.count() >= 2
        # an argument fixed at export to a value: a call of the tensors alone would skip its check
        self._fixed = signature is not None and any(
            leaf.kind == "constant" and leaf.value is not None for leaf in signature.inputs.leaves())

    def _as_flat(self, args: tuple) -> list:
        if self._order_unsure:
            self._order_unsure = False
            names = ", ".join(map(str, self.signature.kwargs.keys))  # type: ignore[union-attr]
            warnings.warn(f"method {self.method!r} was called with its {self.count} tensors by position; those "
                          f"exported as keywords are taken in the order they were given at export ({names}), "
                          "which need not be forward's own order. Pass them by name to be sure.", stacklevel=4)
        return list(args)

    def inputs(self, args: tuple, kwargs: dict) -> list:
        """The method's flat inputs for a call of the model's signature. A call of the flat inputs
        themselves (every tensor in order, no keywords) is taken too, as earlier files took it."""
        if not kwargs and (self.flat or (self._flat_call(args) and not self._fixed)):
            return self._as_flat(args)
        sig = self.signature
        if sig is None:
            raise InputError(f"method {self.method!r} takes its {self.count} inputs by position, flat (got keywords "
                             f"{sorted(kwargs)}): its file keeps no signature (saved before ferry kept them, or "
                             "compile warned that its arguments or results are no plain data)")
        args, kwargs = self._by_position(args, kwargs)
        out: list = []
        try:
            names = sig.arg_names or tuple(f"args[{j}]" for j in range(len(sig.args.items)))
            _check_keywords(sig.kwargs.keys, kwargs)
            if len(args) != len(names):
                raise _Mismatch(f"it takes {len(names)} positional argument(s), got {len(args)}")
            for name, tree, given in zip(names, sig.args.items, args):
                _match(tree, given, name, out)
            _match(sig.kwargs, kwargs, "keyword arguments", out)
        except _Mismatch as e:
            if (not kwargs and not self._fixed and len(args) == self.count
                    and all(isinstance(a, torch.Tensor) for a in args)):
                return self._as_flat(args)
            raise InputError(f"method {self.method!r} was exported as {call_text(sig, self.method)}: {e}") from None
        return out

    def _flat_call(self, args: tuple) -> bool:
        """A call of the flat tensors where the signature takes another count of arguments (a
        decode step called as `module(ids, pos)` for keywords input_ids and cache_position)."""
        return (len(args) == self.count != len(self.signature.args.items)  # type: ignore[union-attr]
                and all(isinstance(a, torch.Tensor) for a in args))

    def result(self, outs: list):
        return self._build(outs)

    def _by_position(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Positional parameters passed by name moved into their place."""
        names = self.signature.arg_names if self.signature else ()
        named = [n for n in names if n in kwargs]
        if not named:
            return args, kwargs
        kwargs = dict(kwargs)
        given = list(args)
        for j, n in enumerate(names):
            if n not in kwargs:
                continue
            if j < len(args):
                raise InputError(f"method {self.method!r}: argument {n!r} is given by position and by name")
            if j != len(given):
                raise InputError(f"method {self.method!r}: argument {names[len(given)]!r} is missing")
            given.append(kwargs.pop(n))
        return tuple(given), kwargs

class _Mismatch(Exception):
    pass


def _check_keywords(names: tuple, kwargs: dict) -> None:
    missing = [n for n in names if n not in kwargs]
    extra = [n for n in kwargs if n not in names]
    if missing or extra:
        said = ([f"missing keyword argument(s) {', '.join(map(repr, missing))}"] if missing else []) + (
            [f"unexpected keyword argument(s) {', '.join(map(repr, extra))}"] if extra else [])
        raise _Mismatch("; ".join(said))


def _match(tree: Tree, given, path: str, out: list) -> None:
    """Append `given`'s leaves to `out` in the order of `tree`, or raise _Mismatch at `path`."""
    kind = tree.kind
    if kind == "value":
        out.append(given)
    elif kind == "constant":
        if not _same_constant(given, tree.value):
            raise _Mismatch(f"{path} was fixed to {tree.value!r} at export and this call passes {_brief(given)}; "
                            "export again with the value you need")
    elif kind == "none":
        if given is not None:
            raise _Mismatch(f"{path} was None at export, this call passes {_brief(given)}")
    elif kind == "dict" or (kind == "node" and isinstance(given, Mapping) and tree.keys):
        if not isinstance(given, Mapping) or set(given) != set(tree.keys):
            want = sorted(map(str, tree.keys))
            have = sorted(map(str, given)) if isinstance(given, Mapping) else _brief(given)
            raise _Mismatch(f"{path} takes the keys {want}, got {have}")
        for k, t in zip(tree.keys, tree.items):
            _match(t, given[k], str(k) if path == "keyword arguments" else f"{path}[{k!r}]", out)
    else:
        items = _children(tree, given, path)
        for j, (t, g) in enumerate(zip(tree.items, items)):
            _match(t, g, f"{path}[{j}]", out)


def _children(tree: Tree, given, path: str) -> list:
    """The items of a tuple, list, named tuple or registered node a call passed where `tree` is."""
    if tree.kind == "node" and type(given) in pytree.SUPPORTED_NODES and not isinstance(given, (tuple, list)):
        items, context = pytree.SUPPORTED_NODES[type(given)].flatten_fn(given)
        if not _same_context(context, tree):
            raise _Mismatch(f"{path} is a {type(given).__name__} unlike the one at export (its context "
                            f"{_as_json(context)} is not {tree.context})")
        items = list(items)
    elif isinstance(given, (tuple, list)):
        items = list(given)
    else:
        raise _Mismatch(f"{path} takes a {tree.kind} of {len(tree.items)}, got {_brief(given)}")
    if len(items) != len(tree.items):
        raise _Mismatch(f"{path} takes {len(tree.items)} items, got {len(items)}")
    return items


def _as_json(context) -> str | None:
    try:
        return json.dumps(context, allow_nan=False)
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=256)
def _parsed(text: str):
    return json.loads(text)


def _same_context(context, tree: Tree) -> bool:
    """A node's pytree context as a call gave it is the one at export (the fields set, in order)."""
    text = _as_json(context)
    return text is not None and json.loads(text) == _parsed(tree.context)


def _same_constant(given, value) -> bool:
    if isinstance(given, torch.Tensor) or type(given) is not type(value) and not (
            isinstance(given, (int, float)) and isinstance(value, (int, float))
            and not isinstance(given, bool) and not isinstance(value, bool)):
        return False
    if isinstance(value, float) and isinstance(given, float) and math.isnan(value):
        return math.isnan(given)
    return given == value


def _brief(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor {x.dtype}{list(x.shape)}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, Mapping):
        return f"a {type(x).__name__} of keys {sorted(map(str, x))}"
    return f"{type(x).__name__} {x!r}"[:80]


# ---------------------------------------------------------------- results


def _builder(tree: Tree, method: str) -> Callable[[list], object]:
    """A function from the method's outputs to the model's result, its types found once."""
    if tree.kind == "value":
        return lambda outs: outs[0]
    make = _maker(tree, method)

    def build(outs: list):
        return make(iter(outs))

    return build


def _maker(tree: Tree, method: str) -> Callable:
    kind = tree.kind
    if kind == "value":
        return next
    if kind == "none":
        return lambda it: None
    parts = [_maker(t, method) for t in tree.items]
    if kind == "tuple":
        return lambda it: tuple(p(it) for p in parts)
    if kind == "list":
        return lambda it: [p(it) for p in parts]
    if kind == "dict":
        return _dict_maker(tree.keys, parts)
    if kind == "namedtuple":
        cls = _named_tuple(tree)
        return lambda it: cls(*[p(it) for p in parts])
    return _node_maker(tree, parts, method)


def _node_maker(tree: Tree, parts: list, method: str) -> Callable:
    typ = _find_type(tree.type)
    node = pytree.SUPPORTED_NODES.get(typ) if typ is not None else None
    if node is not None:
        context = node_context(tree, f"method {method!r}'s result")
        _check_fits(node, context, tree, method)
        unflatten = node.unflatten_fn
        return lambda it: unflatten([p(it) for p in parts], context)
    plain = "a dict" if tree.keys else "a tuple"
    module = tree.type.rpartition(".")[0] or tree.type
    warnings.warn(f"method {method!r} returns a {tree.type}, a type this process has not registered with pytree; "
                  f"it comes back as {plain}. `import {module}` before loading the program to get the type "
                  "itself", stacklevel=4)
    return _dict_maker(tree.keys, parts) if tree.keys else lambda it: tuple(p(it) for p in parts)


def _dict_maker(keys: tuple, parts: list) -> Callable:
    return lambda it: dict(zip(keys, [p(it) for p in parts]))


def _check_fits(node, context, tree: Tree, method: str) -> None:
    """The file's context fits the type: built from it and flattened again, the type gives back
    as many items and the same context (else every call would fail, or put results under other
    keys)."""
    try:
        items, again = node.flatten_fn(node.unflatten_fn([torch.empty(0)] * len(tree.items), context))
        fits = len(list(items)) == len(tree.items) and _same_context(again, tree)
    except Exception:  # noqa: BLE001 - whatever the type's own code raises on a context unlike its own
        fits = False
    if not fits:
        raise ProgramError(f"method {method!r}: the file's context {tree.context[:80]} does not fit its result type "
                           f"{tree.type}")


def _named_tuple(tree: Tree) -> type:
    """The process's own named tuple of that name and fields, else a fresh one like it."""
    typ = _find_type(tree.type)
    if (isinstance(typ, type) and pytree.is_namedtuple_class(typ) and typ.__bases__ == (tuple,)
            and tuple(getattr(typ, "_fields", ())) == tree.keys):
        return typ  # (a plain named tuple: a subclass with a __new__ of its own is not built from a file)
    short = tree.type.rsplit(".", 1)[-1]
    name = short if short.isidentifier() and not keyword.iskeyword(short) else "Result"
    return collections.namedtuple(name, [str(k) for k in tree.keys], rename=True)  # type: ignore[misc]


def _find_type(name: str) -> type | None:
    """A type by name from pytree's registry or a module already imported, never importing one."""
    typ = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name)
    return typ if isinstance(typ, type) else imported_type(name)
