"""Editing a traced graph at compile time: the record of a rewrite and the few node helpers the
op families' patterns share (choices/conv.py, attention.py, gemm.py; aot/fuse.py runs them), and
the value of a node computed from constants alone (attention masks, aot/constant_fold.py)."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple, TypeGuard

import sympy
import torch
import torch.fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ferry import node_meta as M

__all__ = ["Rewrite", "attr", "call", "constant", "constant_value", "reads_metadata_only", "revalue", "set_value",
           "shape_at", "single_use", "size_at", "static_value", "value_of", "viewable"]

aten = torch.ops.aten
CONSTANT_ELEMENTS = 1 << 22  # the largest tensor a value computed at compile time may have


class Rewrite(NamedTuple):
    kind: str  # "copy dropped", "fold", "conv relu", "patches", "attention", "mask dropped", "mask causal", "gemm",
    # "projections merged", "grouped heads", "additive mask", "rows padded"
    where: str  # the node or module call it applied to


def attr(gm, node):
    """The tensor a get_attr node names, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        return None
    t = gm
    for part in str(node.target).split("."):
        t = getattr(t, part, None)
    return t if isinstance(t, torch.Tensor) and not t.is_meta else None


def constant(gm, name: str, value: torch.Tensor, like: torch.fx.Node) -> torch.fx.Node:
    target = name
    while hasattr(gm, target):
        target += "_"
    gm.register_buffer(target, value)
    node = gm.graph.get_attr(target)
    device = M.get_device(like)
    if device is not None:
        M.set_device(node, device)
    val = like.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["val"] = val.new_empty(value.shape, dtype=value.dtype)
    return node


def call(gm, like: torch.fx.Node, op, args, val, kwargs: dict | None = None) -> torch.fx.Node:
    """A new node calling `op`, with `like`'s metadata (device, module stack) and value `val`."""
    node = gm.graph.call_function(op, args, kwargs)
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")})
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):  # its own, not `like`'s
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    return node


def value_of(node: torch.fx.Node, vals: dict | None = None):
    """`node`'s value computed from its arguments' (from `vals` where given there, else their own):
    a node's value again after what it reads changed layout or size."""
    vals = vals or {}
    args: Any = [vals.get(a, a.meta.get("val")) if isinstance(a, torch.fx.Node) else a for a in node.args]
    op: Any = node.target
    return args[0][args[1]] if op is operator.getitem else op(*args, **node.kwargs)


def set_value(node: torch.fx.Node, val) -> None:
    """`node`'s value and its tensor_meta (of a tensor, or of each of a list of them: unbind's)."""
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    elif isinstance(val, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in val):
        node.meta["tensor_meta"] = type(val)(_extract_tensor_metadata(v) for v in val)


def revalue(nodes) -> None:
    """Each node's value (and tensor_meta) again, in the order given, from its arguments'."""
    for n in nodes:
        set_value(n, value_of(n))


def static_value(val) -> TypeGuard[torch.Tensor]:
    """A tensor whose sizes and strides are all ints (no symbolic size)."""
    return isinstance(val, torch.Tensor) and all(type(s) is int for s in (*val.shape, *val.stride()))


def viewable(val: torch.Tensor, shape) -> bool:
    """`val.view(shape)` works: its layout needs no copy to take that shape."""
    try:
        val.view(shape)
    except (RuntimeError, ValueError):  # (a fake tensor's view raises the latter)
        return False
    return True


def single_use(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and len(node.users) == 1


def size_at(size, binding: dict) -> int:
    """A size (an int or a symbolic one) at the symbols' values in `binding`; ValueError where it
    has none."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    try:
        value = sympy.sympify(size.node.expr.xreplace(binding))
    except ArithmeticError:  # a size divided by one that is 0 here
        raise ValueError(f"size {size} has no value here") from None
    if not value.is_Integer:
        raise ValueError(f"size {size} has no value here")
    return int(value)


def shape_at(t: torch.Tensor, binding: dict) -> tuple[int, ...] | None:
    try:
        return tuple(size_at(s, binding) for s in t.shape)
    except ValueError:
        return None


# ops that read only the dtype and device of their first argument (new_*), or also its sizes and
# strides (*_like): computed from constants whatever that argument holds
_READS_DTYPE = frozenset({aten.new_zeros, aten.new_ones, aten.new_full})
_READS_LAYOUT = frozenset({aten.zeros_like, aten.ones_like, aten.full_like})


def _deterministic(node: torch.fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded not in node.target.tags  # type: ignore[union-attr]


def constant_value(gm, node, memo: dict, binding: dict, admit: Callable[[torch.fx.Node], bool] = _deterministic,
                   limit: int = CONSTANT_ELEMENTS):
    """The value of `node` where it depends on constants and sizes alone (computed on the CPU,
    symbolic sizes at their values in `binding`; at most `limit` elements each), else None.
    `admit`: whether a node's op may be computed here (by default, any that draws no random
    numbers). `memo` keeps every node's value across calls."""
    if node in memo:
        return memo[node]
    memo[node] = None
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt) or (type(val) is int and node.op == "placeholder"):
        try:
            memo[node] = size_at(val, binding)
        except ValueError:
            memo[node] = None
    elif node.op == "get_attr":
        memo[node] = attr(gm, node)
    elif (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and admit(node)
          and _fits(val, binding, limit)):
        values = _input_values(gm, node, memo, binding, admit, limit)
        if values is not None:
            args = torch.fx.node.map_arg(node.args, values.__getitem__)
            kwargs = dict(torch.fx.node.map_arg(node.kwargs, values.__getitem__))
            if "device" in kwargs:
                kwargs["device"] = torch.device("cpu")
            try:
                result = node.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - not computable here: left to run time
                result = None
            if isinstance(result, torch.Tensor) and result.numel() <= limit:
                memo[node] = result
    return memo[node]


def _input_values(gm, node, memo, binding, admit, limit) -> dict | None:
    """Each input node of `node` -> its value; the first argument of an op that reads only its
    metadata -> an empty tensor of that metadata. None where one has no value here."""
    values = {}
    for a in node.all_input_nodes:
        meta_only = reads_metadata_only(node, a)
        value = _stand_in(a, node, binding) if meta_only else constant_value(gm, a, memo, binding, admit, limit)
        if value is None:
            return None
        values[a] = value
    return values


def reads_metadata_only(node: torch.fx.Node, arg: torch.fx.Node) -> bool:
    """`node`'s op reads nothing of `arg` but its dtype, device, sizes and strides."""
    packet = getattr(node.target, "overloadpacket", None)
    return packet in _READS_DTYPE | _READS_LAYOUT and bool(node.args) and node.args[0] is arg


def _stand_in(arg: torch.fx.Node, node: torch.fx.Node, binding: dict) -> torch.Tensor | None:
    """An empty host tensor with what `node` reads of `arg`: its dtype (new_*), its sizes and
    strides too (*_like)."""
    val = arg.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    if node.target.overloadpacket in _READS_DTYPE:  # type: ignore[union-attr]
        return torch.empty(0, dtype=val.dtype)
    shape = shape_at(val, binding)
    try:
        stride = tuple(size_at(s, binding) for s in val.stride())
    except ValueError:
        return None
    return None if shape is None else torch.empty_strided(shape, stride, dtype=val.dtype)


def _fits(val, binding: dict, limit: int) -> bool:
    """A traced tensor of at most `limit` elements at the sizes of `binding`."""
    shape = shape_at(val, binding) if isinstance(val, torch.Tensor) else None
    return shape is not None and math.prod(shape) <= limit
