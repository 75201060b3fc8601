"""Partitioners: decide which nodes a backend runs, and on which device.

The partitioner protocol
------------------------
A partitioner is any object with a method::

    partition(exported_program: torch.export.ExportedProgram) -> list[ferry.Partition]

Each `Partition` names a set of `call_function` nodes of `exported_program.graph` (by
node name), the backend that runs them (`backend_id`, "torch" by default) and its compile
specs, as (str, bytes) pairs. The compile spec `target_device` (e.g. b"cuda:0") says where
the delegate runs; without it the delegate runs on the CPU. Partitions must be disjoint,
and each must be convex (no path leaves it and comes back), since lowering turns each into
one `call_delegate` node. Writing your own is a few lines, for example one delegate per op::

    class OnePerOp:
        def partition(self, ep):
            return [Partition([n.name], target_device("cuda:0"))
                    for n in ep.graph.nodes if n.op == "call_function"
                    and n.target is torch.ops.aten.mm.default]

or a device per module path (read `node.meta["nn_module_stack"]`).
"""

from __future__ import annotations

import difflib
import operator
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from ferry.device import Device
from ferry.errors import CompileError
from ferry.op_names import REFUSED_NAMESPACES
from ferry.ops.device_kernels import has_kernel

TARGET_DEVICE = "target_device"
DEFAULT_BACKEND = "torch"


def target_device(device: str | Device) -> tuple[tuple[str, bytes], ...]:
    """Compile specs that place a delegate on `device`."""
    return ((TARGET_DEVICE, str(Device.parse(device)).encode()),)


@dataclass(frozen=True)
class Partition:
    nodes: tuple[str, ...]
    compile_specs: tuple[tuple[str, bytes], ...] = ()
    backend_id: str = DEFAULT_BACKEND

    def __init__(self, nodes: Iterable[str], compile_specs=(), backend_id: str = DEFAULT_BACKEND):
        object.__setattr__(self, "nodes", tuple(nodes))
        object.__setattr__(self, "compile_specs", tuple((str(k), bytes(v)) for k, v in compile_specs))
        object.__setattr__(self, "backend_id", backend_id)


class Partitioner(Protocol):
    def partition(self, exported_program: torch.export.ExportedProgram) -> list[Partition]: ...


def _op_key(op) -> str:
    """'aten.add.Tensor' for an overload, 'aten.add' for a packet or a string as given."""
    if isinstance(op, str):
        name = op.strip().replace("::", ".")
        for candidate in (name, f"aten.{name}"):
            if _resolves(candidate):
                return candidate
        raise CompileError(
            f"unknown op {op!r}: name an ATen op like 'aten.add' or 'aten.add.Tensor' (see torch.ops.aten)"
        )
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name.replace("::", ".")
    raise CompileError(f"cannot use {op!r} as an op: pass an OpOverload, an OpOverloadPacket or a name like 'aten.add.Tensor'")


def _resolves(name: str) -> bool:
    """Does 'ns.op' or 'ns.op.overload' name a registered operator?"""
    parts = name.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        return False
    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        return len(parts) == 2 or parts[2] in packet.overloads()
    except (AttributeError, RuntimeError):
        return False


def _matches(target, keys: frozenset[str]) -> bool:
    full = _op_key(target)
    return full in keys or full.rsplit(".", 1)[0] in keys


class OpSupport(OperatorSupportBase):
    """Capability as data: ATen ops and library ops (`torch.library`), optionally restricted to
    `ops`, minus `exclude`, each only where it has a kernel for every one of `devices` (a custom
    op with a CPU kernel alone stays on the CPU: ops/device_kernels.py)."""

    def __init__(self, ops=None, exclude=(), devices=()):
        self.ops = None if ops is None else frozenset(_op_key(o) for o in ops)
        self.exclude = frozenset(_op_key(o) for o in exclude)
        self.devices = tuple(Device.parse(d) for d in devices)

    def warn_unmatched(self, graph: torch.fx.Graph) -> None:
        """A name in `ops` or `exclude` that no op of the program has is almost always a typo or a
        name from another stage (`aten._softmax` where the program has `aten.softmax`): say so,
        with the nearest names the program does have."""
        present: set[str] = set()
        for n in graph.nodes:
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
                full = _op_key(n.target)
                present.update((full, full.rsplit(".", 1)[0]))
        for what, keys in (("ops", self.ops or ()), ("exclude", self.exclude)):
            for key in sorted(set(keys) - present):
                near = difflib.get_close_matches(key, sorted(present), n=3, cutoff=0.5)
                hint = f"; nearest: {', '.join(near)}" if near else f"; the program has: {', '.join(sorted(present)[:12])}"
                warnings.warn(f"{what}={key!r} matches no op in this program{hint}", UserWarning, stacklevel=4)

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:
            src = node.args[0]
            return isinstance(src, torch.fx.Node) and self.is_node_supported(submodules, src)
        if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace in _NOT_DELEGATED:
            return False
        if node.target._schema.is_mutable or not node.target._schema.returns:
            return False  # a check (aten._assert_scalar, ...): defines nothing, runs on the host
        val = node.meta.get("val")
        if val is not None and not all(isinstance(v, torch.Tensor) for v in (val if isinstance(val, (list, tuple)) else [val])):
            return False  # sizes (aten.sym_size, ...) are computed on the host, next to the shapes they read
        if self.ops is not None and not _matches(node.target, self.ops):
            return False
        return not _matches(node.target, self.exclude) and all(has_kernel(node.target, d) for d in self.devices)


# namespaces whose ops a delegate never runs: ferry's copies, and ops that reach outside the
# program's tensors (a program may not call them at all: op_names.py)
_NOT_DELEGATED = frozenset({"et_copy", *REFUSED_NAMESPACES})


def _connected_components(nodes) -> list[set]:
    """Split a node set into groups connected by edges inside the set (direction ignored).

    Splitting a convex, cycle-free partition this way keeps every piece convex and cycle-free."""
    members = set(nodes)
    seen: set = set()
    components = []
    for start in members:
        if start in seen:
            continue
        seen.add(start)
        stack, component = [start], set()
        while stack:
            n = stack.pop()
            component.add(n)
            for m in (*n.all_input_nodes, *n.users):
                if m in members and m not in seen:
                    seen.add(m)
                    stack.append(m)
        components.append(component)
    return components


class OpSupportPartitioner:
    """Groups supported nodes into connected partitions, one delegate each, on `device`."""

    def __init__(self, device: str | Device, ops=None, exclude=(), backend_id: str = DEFAULT_BACKEND):
        self.device = Device.parse(device)
        self.support = OpSupport(ops, exclude, devices=[self.device])
        self.backend_id = backend_id

    def partition(self, exported_program: torch.export.ExportedProgram) -> list[Partition]:
        gm = exported_program.graph_module
        self.support.warn_unmatched(gm.graph)
        proposed = CapabilityBasedPartitioner(gm, self.support, allows_single_node_partition=True).propose_partitions()
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        result = []
        for p in proposed:
            # CapabilityBasedPartitioner also merges unconnected groups; one delegate per connected group
            for component in _connected_components(p.nodes):
                nodes = sorted(component, key=order.__getitem__)
                if all(n.target is operator.getitem for n in nodes):
                    continue
                result.append(Partition([n.name for n in nodes], target_device(self.device), self.backend_id))
        index = {n.name: i for n, i in order.items()}
        result.sort(key=lambda p: min(index[name] for name in p.nodes))
        return result

    def __repr__(self) -> str:
        return f"OpSupportPartitioner({str(self.device)!r})"
