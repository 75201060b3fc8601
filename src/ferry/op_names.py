"""Kernel names as programs store them ("aten::add.out"), and back to operators.

A name read from a file selects an operator only if the dispatcher has a schema registered
under exactly that name: never a Python attribute of torch.ops (`load_library`, `__class__`).
"""

from __future__ import annotations

import re

import torch

__all__ = ["kernel_name", "resolve_kernel"]

_NAME_RE = re.compile(r"([a-z_][a-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\Z")


def kernel_name(op: torch._ops.OpOverload) -> str:
    """torch.ops.aten.add.out -> 'aten::add.out'."""
    return f"{op.namespace}::{op._opname}.{op._overloadname}"


def resolve_kernel(name: str) -> torch._ops.OpOverload:
    """'aten::add.out' -> torch.ops.aten.add.out; LookupError when no such operator is registered."""
    m = _NAME_RE.match(name) if isinstance(name, str) else None
    if m is None:
        raise LookupError(f"malformed kernel name {name!r}: expected 'namespace::op.overload', e.g. 'aten::add.out'")
    ns, opname, overload = m.groups()
    try:  # the dispatcher's own table: only registered operators have a schema
        torch._C._get_schema(f"{ns}::{opname}", "" if overload == "default" else overload)
    except RuntimeError:
        raise LookupError(f"no operator {name!r} is registered in this process") from None
    op = getattr(getattr(getattr(torch.ops, ns), opname), overload)
    if not isinstance(op, torch._ops.OpOverload):  # pragma: no cover - the schema lookup above guarantees it
        raise LookupError(f"{name!r} does not name an operator overload")
    return op
