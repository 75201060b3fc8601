"""A method's call signature as the model had it, kept as plain data so a file holds no code.

`inputs` is the tree of a call's `(args, kwargs)`, `outputs` the tree of what it returns (dicts,
lists, tuples, named tuples, transformers' ModelOutput). Their leaves are the method's inputs and
returned outputs, in order. An argument torch.export fixed at export (a float, a flag) is a
`constant` leaf: no input of the method, checked at each call as the exported module checks it.
Who builds a signature: aot/signature.py; who calls with one: runtime/stages/call_tree.py."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ferry.errors import ProgramError
from ferry.imported import MAX_TYPE_NAME

# kinds of tree node: "value" is a leaf passed to or returned by the method, "constant" a fixed
# argument; "node" is a container type registered with torch's pytree (ModelOutput, OrderedDict)
TREE_KINDS = ("value", "constant", "none", "tuple", "list", "dict", "namedtuple", "node")
CONTAINERS = ("tuple", "list", "dict", "namedtuple", "node")
MAX_TREE_DEPTH = 64  # nesting a file may declare (a hostile file could nest past the stack)
MAX_TREE_NODES = 1 << 16  # (a model's signature has hundreds)

Scalar = None | bool | int | float | str
Key = str | int


@dataclass(frozen=True)
class Tree:
    """One node of a call's argument or result tree.

    `keys`: a dict's keys, a named tuple's fields, or a node's keys when its context is a list of
    them (what a ModelOutput falls back to, as a dict, where its class is not registered);
    `type`: a named tuple's or node's type name; `context`: a node's pytree context as JSON text;
    `value`: a constant's value."""

    kind: str
    items: tuple[Tree, ...] = ()
    keys: tuple[Key, ...] = ()
    type: str = ""
    context: str = ""
    value: Scalar = None

    def leaves(self) -> list[Tree]:
        """The value and constant leaves, in the order pytree flattens them."""
        out: list[Tree] = []
        stack = [self]
        while stack:
            t = stack.pop()
            if t.kind in ("value", "constant"):
                out.append(t)
            stack.extend(reversed(t.items))
        return out

    def count(self, kind: str = "value") -> int:
        return sum(1 for t in self.leaves() if t.kind == kind)


@dataclass(frozen=True)
class Signature:
    """`inputs`: a tuple of the positional arguments' tuple and the keyword arguments' dict;
    `arg_names`: the positional parameters' names, so a call may pass them by name."""

    inputs: Tree
    outputs: Tree
    arg_names: tuple[str, ...] = ()

    @property
    def args(self) -> Tree:
        return self.inputs.items[0]

    @property
    def kwargs(self) -> Tree:
        return self.inputs.items[1]


def check_tree(t: Tree, what: str) -> None:
    """Each node agrees with its kind (a file's tree is checked before anything reads it)."""
    stack, seen = [(t, what, 0)], 0
    while stack:
        node, where, depth = stack.pop()
        seen += 1
        if depth > MAX_TREE_DEPTH or seen > MAX_TREE_NODES:
            raise ProgramError(f"{what}: nested deeper than {MAX_TREE_DEPTH} or over {MAX_TREE_NODES} nodes")
        _check_node(node, where)
        stack.extend((c, f"{where}[{j}]", depth + 1) for j, c in enumerate(node.items))


def _check_node(t: Tree, where: str) -> None:
    if t.kind not in TREE_KINDS:
        raise ProgramError(f"{where}: unknown tree kind {t.kind!r}; kinds: {', '.join(TREE_KINDS)}")
    if t.kind not in CONTAINERS and t.items:
        raise ProgramError(f"{where}: a {t.kind} has no items, got {len(t.items)}")
    if t.kind != "constant" and t.value is not None:
        raise ProgramError(f"{where}: only a constant has a value")
    if (t.keys or t.kind in ("dict", "namedtuple")) and len(t.keys) != len(t.items):  # (a node's keys: optional)
        raise ProgramError(f"{where}: {len(t.keys)} keys for {len(t.items)} items")
    if t.kind not in ("dict", "namedtuple", "node") and t.keys:
        raise ProgramError(f"{where}: a {t.kind} has no keys")
    if len(set(t.keys)) != len(t.keys):
        raise ProgramError(f"{where}: keys repeat: {list(t.keys)}")
    if t.kind == "namedtuple" and not all(isinstance(k, str) and k.isidentifier() for k in t.keys):
        raise ProgramError(f"{where}: a named tuple's fields are identifiers, got {list(t.keys)}")
    if t.kind in ("namedtuple", "node") and not t.type:
        raise ProgramError(f"{where}: a {t.kind} names its type")
    if len(t.type) > MAX_TYPE_NAME:
        raise ProgramError(f"{where}: a type name of {len(t.type)} characters; at most {MAX_TYPE_NAME}")
    if t.kind not in ("namedtuple", "node") and (t.type or t.context):
        raise ProgramError(f"{where}: only a named tuple or node names a type")
    if t.kind == "node":
        context = node_context(t, where)
        if t.keys and isinstance(context, list) and context != list(t.keys):
            raise ProgramError(f"{where}: keys {list(t.keys)} disagree with the context {context}")


def node_context(t: Tree, where: str):
    """A node's pytree context, read from its JSON text (never code)."""
    try:
        return json.loads(t.context)
    except (ValueError, RecursionError):
        raise ProgramError(f"{where}: the context of {t.type} is not valid JSON") from None


def check_signature(sig: Signature, inputs: int, outputs: int, what: str) -> None:
    """`sig` is a (args, kwargs) tree whose leaves are the method's `inputs` and `outputs` (each
    tree's nodes were checked with the record's types: check_tree)."""
    top = sig.inputs
    if top.kind != "tuple" or [t.kind for t in top.items] != ["tuple", "dict"]:
        raise ProgramError(f"{what} inputs: expected a tuple of the arguments' tuple and the keywords' dict")
    if not all(isinstance(k, str) for k in sig.kwargs.keys):
        raise ProgramError(f"{what} inputs: keyword names are strings, got {list(sig.kwargs.keys)}")
    if sig.arg_names and len(sig.arg_names) != len(sig.args.items):
        raise ProgramError(f"{what}: {len(sig.arg_names)} argument names for {len(sig.args.items)} arguments")
    names = [*sig.arg_names, *sig.kwargs.keys]
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ProgramError(f"{what}: argument names repeat or are empty: {names}")
    if sig.outputs.count("constant"):
        raise ProgramError(f"{what} outputs: a result is a value of the method, never a constant leaf")
    if sig.inputs.count() != inputs or sig.outputs.count() != outputs:
        raise ProgramError(f"{what}: the signature has {sig.inputs.count()} inputs and {sig.outputs.count()} "
                           f"outputs; the method has {inputs} and {outputs}")


def value_names(sig: Signature) -> list[str]:
    """Each value the call passes (the method's inputs, in order) named as the caller wrote it:
    `n`, `ys[1]`, `z['a']`, `p.scale` (a named tuple's field)."""
    names = sig.arg_names or tuple(f"arg{j}" for j in range(len(sig.args.items)))
    out: list[str] = []

    def walk(t: Tree, name: str) -> None:
        if t.kind == "value":
            out.append(name)
        for j, item in enumerate(t.items):
            key = t.keys[j] if t.keys else j
            walk(item, f"{name}.{key}" if t.kind == "namedtuple" else f"{name}[{key!r}]")

    for name, t in zip(names, sig.args.items):
        walk(t, name)
    for key, t in zip(sig.kwargs.keys, sig.kwargs.items):
        walk(t, str(key))
    return out


def size_name(method, i: int, d: int) -> str:
    """Input `i`'s dim `d` (an int input: d = -1) as a message names it: `x.shape[1]`, `n`,
    `z['a'].shape[0]` (the name the caller passes it by, else its position)."""
    names = value_names(method.signature) if method.signature is not None else []
    name = names[i] if i < len(names) else getattr(method.values[method.inputs[i]], "name", "") or f"input {i}"
    return name if d < 0 else f"{name}.shape[{d}]"


def call_text(sig: Signature, method: str) -> str:
    """The call a method takes and what it returns, for people: `forward(x, ys: [T, T], *,
    mask: T) -> {'h': T}` (T: a tensor or other value the method takes or returns)."""
    names = sig.arg_names or tuple(f"arg{j}" for j in range(len(sig.args.items)))
    parts = [f"{n}: {tree_text(t)}" if t.kind != "value" else n for n, t in zip(names, sig.args.items)]
    if sig.kwargs.items:
        parts += ["*"] + [f"{k}: {tree_text(t)}" if t.kind != "value" else str(k)
                          for k, t in zip(sig.kwargs.keys, sig.kwargs.items)]
    return f"{method}({', '.join(parts)}) -> {tree_text(sig.outputs)}"


def tree_text(t: Tree) -> str:
    if t.kind == "value":
        return "T"
    if t.kind == "constant":
        return repr(t.value)
    if t.kind == "none":
        return "None"
    inner = [tree_text(c) for c in t.items]
    name = t.type.rsplit(".", 1)[-1]
    if t.kind == "list":
        return f"[{', '.join(inner)}]"
    if t.kind in ("dict", "node") and t.keys:
        return ("" if t.kind == "dict" else name) + "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(t.keys, inner)) + "}"
    return name + f"({', '.join(inner)}{',' if len(inner) == 1 and t.kind == 'tuple' else ''})"
