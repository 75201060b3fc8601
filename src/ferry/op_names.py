"""Kernel names as programs store them ("aten::add.out"), and back to operators.

A name read from a file selects an operator only if the dispatcher has a schema registered
under exactly that name: never a Python attribute of torch.ops (`load_library`, `__class__`).
"""

from __future__ import annotations

import re

import torch

__all__ = ["REFUSED_NAMESPACES", "kernel_name", "resolve_kernel"]

_NAME_RE = re.compile(r"([a-z_][a-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\Z")


def kernel_name(op: torch._ops.OpOverload) -> str:
    """torch.ops.aten.add.out -> 'aten::add.out'."""
    return f"{op.namespace}::{op._opname}.{op._overloadname}"


# Operators that reach outside the tensors a program computes on: a file (from_file maps any
# path read-write, creating it: a hostile program could write a .pth file and so run code),
# the process's collectives (a call with no peer hangs), the profiler. No exported model needs
# them; a program that names one is refused before anything runs.
_REFUSED_OPS = frozenset({"aten::from_file", "debugprims::load_tensor", "aten::save", "aten::_print", "aten::warn",
                          "aten::_reshape_alias",  # a view torch does not bounds-check
                          # fused convolutions that check neither shapes nor devices (their one caller in
                          # torch checked them first): a program reaches them through ferry::conv_relu and
                          # ferry::conv_add_relu, which check (ferry/ops/fused.py)
                          "aten::cudnn_convolution_relu", "aten::cudnn_convolution_add_relu",
                          "aten::miopen_convolution_relu", "aten::miopen_convolution_add_relu"})
REFUSED_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "symm_mem", "profiler",
                                 "debugprims"})


def _unchecked_layout(opname: str) -> bool:
    """Sparse and nested tensors: their constructors trust indices and offsets they are given
    (a sparse index of 10**9 writes the heap when made dense). No exported dense model needs one."""
    return "sparse" in opname or "nested" in opname or opname.endswith("_unsafe")


def resolve_kernel(name: str) -> torch._ops.OpOverload:
    """'aten::add.out' -> torch.ops.aten.add.out; LookupError when no such operator is registered,
    or when it is one a program may not call (files, collectives: `_REFUSED_OPS`)."""
    m = _NAME_RE.match(name) if isinstance(name, str) else None
    if m is None:
        raise LookupError(f"malformed kernel name {name!r}: expected 'namespace::op.overload', e.g. 'aten::add.out'")
    ns, opname, overload = m.groups()
    if _unchecked_layout(opname) and ns not in REFUSED_NAMESPACES:
        raise LookupError(f"{name!r} makes or reads sparse or nested tensors, or trusts indices it does not check: a "
                          "ferry program holds dense tensors only and may not call it")
    if ns in REFUSED_NAMESPACES or f"{ns}::{opname}" in _REFUSED_OPS:
        raise LookupError(f"{name!r} reaches outside the program's tensors (files, other processes, the profiler): "
                          "a ferry program may not call it")
    try:  # the dispatcher's own table: only registered operators have a schema
        torch._C._get_schema(f"{ns}::{opname}", "" if overload == "default" else overload)
    except RuntimeError:
        raise LookupError(f"no operator {name!r} is registered in this process") from None
    op = getattr(getattr(getattr(torch.ops, ns), opname), overload)
    if not isinstance(op, torch._ops.OpOverload):  # pragma: no cover - the schema lookup above guarantees it
        raise LookupError(f"{name!r} does not name an operator overload")
    return op
