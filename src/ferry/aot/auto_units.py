"""The units device_map="auto" places: modules taken whole, as coarse as the budgets allow.

A unit is a module path and the ops it runs. Units start coarse: a module is split into its
submodules only when it is slower than a share of a device's time or its weights exceed the
smallest budget; `refine` splits more when no split of the units fits. A module whose class
is a no-split class (transformers' `_no_split_modules`, seen from the model's classes, or
`no_split_module_classes=`, as in accelerate) and a module without submodules are never
split. Ops a split module runs itself (residual adds, position ids) are counted with the unit
before them, as an explicit map places them with their producer.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from ferry.aot.auto_cost import is_view, op_seconds, val_bytes
from ferry.imported import imported_type
from ferry.node_meta import module_path


@dataclass(frozen=True)
class Value:
    """A tensor the program makes (or a method input, made at -1): where, who reads it, its size.
    A read by the graph's output is at len(order)."""

    made: int
    reads: tuple[int, ...]
    nbytes: int


@dataclass
class Facts:
    """What the chooser reads of a program, gathered once. Positions index `order`: every op."""

    order: list[torch.fx.Node]
    seconds: list[float]  # 0 for an op that no delegate runs
    weights: list[dict[str, int]]  # the weights each op reads: {placeholder name: bytes}
    values: list[Value]
    children: dict[str, list[str]]
    ops_under: dict[str, list[int]]  # positions of the delegated ops under each module path
    classes: dict[str, str]  # module path -> its class's name
    no_split: frozenset[str] = frozenset()  # class names the model itself declares


@dataclass
class Unit:
    path: str
    positions: list[int]
    seconds: float = 0.0
    weights: dict[str, int] = field(default_factory=dict)
    atomic: bool = False  # no submodules, or a no-split class

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())


def gather(exported_program, supported) -> Facts:
    sig = exported_program.graph_signature
    weight_names = set(sig.inputs_to_parameters) | set(sig.inputs_to_buffers) | set(
        getattr(sig, "inputs_to_lifted_tensor_constants", {}))
    nodes = list(exported_program.graph_module.graph.nodes)
    order = [n for n in nodes if n.op == "call_function"]
    pos = {n: i for i, n in enumerate(order)}
    delegated = [supported(n) for n in order]
    seconds = [op_seconds(n) if d else 0.0 for n, d in zip(order, delegated)]
    weights = [{a.name: val_bytes(a.meta.get("val")) for a in n.all_input_nodes if a.name in weight_names} if d else {}
               for n, d in zip(order, delegated)]
    values = []
    for n in nodes:
        if (n.op == "placeholder" and n.name not in weight_names) or (
                n.op == "call_function" and n.target is not operator.getitem and not is_view(n)):
            reads = sorted({pos.get(u, len(order)) for u in _readers(n)})
            values.append(Value(pos.get(n, -1), tuple(reads), val_bytes(n.meta.get("val"))))
    children, ops_under = _tree([n for n, d in zip(order, delegated) if d], pos)
    return Facts(order, seconds, weights, values, children, ops_under, _classes(nodes), _declared_no_split(nodes))


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read a value, looking through views and a tuple's parts."""
    out = []
    for u in node.users:
        out.extend(_readers(u) if u.op == "call_function" and (u.target is operator.getitem or is_view(u)) else [u])
    return out


def _tree(delegated, pos) -> tuple[dict[str, list[str]], dict[str, list[int]]]:
    children: dict[str, list[str]] = {}
    ops_under: dict[str, list[int]] = {"": []}
    for n in delegated:
        parts = module_path(n).split(".") if module_path(n) else []
        ops_under[""].append(pos[n])
        for i in range(1, len(parts) + 1):
            path, parent = ".".join(parts[:i]), ".".join(parts[:i - 1])
            if path not in ops_under:
                ops_under[path] = []
                children.setdefault(parent, []).append(path)
            ops_under[path].append(pos[n])
    return children, ops_under


def _stack_types(nodes):
    for n in nodes:
        for path, qualname in (n.meta.get("nn_module_stack") or {}).values():
            yield path, qualname if isinstance(qualname, str) else f"{qualname.__module__}.{qualname.__qualname__}"


def _classes(nodes) -> dict[str, str]:
    return {path: qualname.rpartition(".")[2] for path, qualname in _stack_types(nodes)}


def _declared_no_split(nodes) -> frozenset[str]:
    """The `_no_split_modules` the model's classes declare (transformers' PreTrainedModel does),
    read from classes already imported: a class name recorded by export is never imported."""
    names: set[str] = set()
    for qualname in {q for _, q in _stack_types(nodes)}:
        cls = imported_type(qualname)
        declared = getattr(cls, "_no_split_modules", None) if cls is not None else None
        if isinstance(declared, (list, tuple, set, frozenset)):
            names.update(str(d) for d in declared)
    return frozenset(names)


# ------------------------------------------------------------------ units


def unit(facts: Facts, path: str, no_split: frozenset[str], positions=None) -> Unit:
    positions = sorted(facts.ops_under[path] if positions is None else positions)
    u = Unit(path, positions, atomic=not facts.children.get(path) or facts.classes.get(path) in no_split)
    for p in positions:
        u.seconds += facts.seconds[p]
        u.weights.update(facts.weights[p])
    return u


def expand(facts: Facts, whole: Unit, no_split: frozenset[str]) -> list[Unit]:
    """A unit's submodules, in the order they run, each whole; the ops the module runs itself
    go to the part before them (the first part when none runs before them)."""
    kids = facts.children[whole.path]
    covered = {p for k in kids for p in facts.ops_under[k]}
    parts = sorted((unit(facts, k, no_split) for k in kids), key=lambda u: u.positions[0])
    for p in whole.positions:
        if p not in covered:
            before = max((u for u in parts if u.positions[0] <= p), key=lambda u: u.positions[0], default=parts[0])
            before.positions.append(p)
            before.seconds += facts.seconds[p]
            before.weights.update(facts.weights[p])
    for u in parts:
        u.positions.sort()
    return parts


def coarse_units(facts: Facts, no_split: frozenset[str], split_seconds: float, split_bytes: int) -> list[Unit]:
    """Modules, split into submodules while one is slower than `split_seconds` or its weights
    exceed `split_bytes`; in the order they run."""
    out, todo = [], [unit(facts, "", no_split)]
    while todo:
        u = todo.pop()
        if not u.atomic and (u.seconds > split_seconds or u.weight_bytes > split_bytes):
            todo.extend(expand(facts, u, no_split))
        else:
            out.append(u)
    return sorted(out, key=lambda u: u.positions[0])


def refine(facts: Facts, units: list[Unit], no_split: frozenset[str], sizes: list[int]) -> list[Unit] | None:
    """Finer units, for when no split of `units` fits: those that can be split and need at least
    half the bytes the largest of them needs (`sizes`, per unit), split into their submodules.
    None when none can be split."""
    largest = max((n for u, n in zip(units, sizes) if not u.atomic), default=None)
    if largest is None:
        return None
    out: list[Unit] = []
    for u, n in zip(units, sizes):
        out.extend(expand(facts, u, no_split) if not u.atomic and 2 * n >= largest else [u])
    return out


def tied_users(units: list[Unit]) -> list[tuple[int, int]]:
    """(user, owner) unit indices where a later unit reads a weight an earlier one reads (tied
    embeddings): the user may be placed beside its owner, so the weight is held once."""
    first: dict[str, int] = {}
    pairs = []
    for i, u in enumerate(units):
        owners = {first[w] for w in u.weights if w in first}
        if len(owners) == 1:
            pairs.append((i, owners.pop()))
        for w in u.weights:
            first.setdefault(w, i)
    return pairs
