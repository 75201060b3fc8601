"""Which inputs of a method an op reads through their storage, in the method or its delegates.

`as_strided(x, size, stride, storage_offset)` indexes `x`'s storage, not its elements: eager
reads from wherever the caller's storage starts, ferry from where the tensor's memory starts
(its own planned copy, or a place in an arena). The two agree for a tensor that is its whole
storage; the method records the inputs that must be one, and each call checks them
(runtime/stages/method.py), so a view into a larger storage is refused instead of read differently.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ferry import node_meta as M
from ferry.aot.lower import is_delegate_node
from ferry.op_names import kernel_name
from ferry.ops import is_copy_node
from ferry.ops.aliasing import STORAGE_OFFSET_AT, is_view, view_source

__all__ = ["checked_sizes", "derived_sizes", "equal_sizes", "size_minimums", "storage_inputs"]


def equal_sizes(gm: torch.fx.GraphModule) -> list[list[list[int]]]:
    """Groups of [input position, dim] that export traced as one dynamic size (one symbol): a
    call must give them equal sizes. Dim -1 is an int input of that size (a length passed beside
    the tensor it measures). Only groups of two or more; a dim that is an expression of a size
    (2 * s0) is not listed."""
    groups: dict[str, list[list[int]]] = {}
    for i, d, expr in _dynamic_sizes(gm):
        if expr.is_Symbol:
            groups.setdefault(str(expr), []).append([i, d])
    return [g for g in groups.values() if len(g) > 1]


def _dynamic_sizes(gm: torch.fx.GraphModule) -> list[tuple[int, int, Any]]:
    """(user input position, dim, expression) of every symbolic size of the user inputs: each
    tensor dim, and each int input as dim -1."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and M.input_info(n).kind == M.USER_INPUT]
    return [(i, d, size.node.expr) for i, node in enumerate(inputs)
            for d, size in (enumerate(node.meta["val"].shape) if isinstance(node.meta.get("val"), torch.Tensor)
                            else [(-1, node.meta.get("val"))])
            if isinstance(size, torch.SymInt)]


def checked_sizes(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The symbols a call can set only to a value from 0 to their bound, each checked per call:
    the dims of user-input tensors that are a symbol as it is, and no other input's size is an
    expression of (t = 2*s: any t up to the bound passes, and a derived size is not checked
    against its root). An int input's symbol is one only where a tensor's dim is it too (the
    two are checked equal, `equal_sizes`)."""
    bare: set[str] = set()
    derived: set[str] = set()
    for _, d, expr in _dynamic_sizes(gm):
        if d >= 0:
            (bare if expr.is_Symbol else derived).update(map(str, expr.free_symbols))
    return frozenset(bare - derived)


def derived_sizes(gm: torch.fx.GraphModule) -> list[list[int]]:
    """[input, dim, a, b, root input, root dim] for every input dim export traced as `a*s + b` of
    one size `s` (a Dim's multiple or offset): a call must give it that value of the size where
    another input's dim (or an int input, dim -1) is `s` itself (root input -1: none is, and the
    size must still be one `a*s + b` can take). Other expressions are not listed."""
    dims = _dynamic_sizes(gm)
    roots: dict = {}  # symbol -> the first [input, dim] that is it
    for i, d, expr in dims:
        if expr.is_Symbol:
            roots.setdefault(expr, [i, d])
    found = []
    for i, d, expr in dims:
        if expr.is_Symbol or len(expr.free_symbols) != 1:
            continue
        (sym,) = expr.free_symbols
        a, b = expr.coeff(sym), expr.subs(sym, 0)
        if a.is_Integer and b.is_Integer and a >= 1 and (a * sym + b - expr).expand() == 0 and d >= 0:
            found.append([i, d, int(a), int(b), *roots.get(sym, [-1, 0])])
    return found


def size_minimums(gm: torch.fx.GraphModule, range_constraints) -> list[list[int]]:
    """[input position, dim (-1: an int input), minimum] for every dynamic size export recorded a
    minimum above 2 for: what `ep.module()` checks each call (it checks none of 2 or less, the
    sizes export's 0/1 specialisation assumes away), and so does ferry. A graph traced for t >= 5
    may have taken a branch that is wrong at t = 3."""
    ranges = [(i, d, (range_constraints or {}).get(expr)) for i, d, expr in _dynamic_sizes(gm)]
    return [[i, d, int(r.lower)] for i, d, r in ranges if r is not None and r.lower > 2]


def storage_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Positions (among the user inputs) of the inputs read through their storage."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and M.input_info(n).kind == M.USER_INPUT]
    return sorted({inputs.index(r) for r in _read_roots(gm) if r in inputs})


def _read_roots(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The placeholders of `gm` whose storage an op reads, itself or through a delegate."""
    roots = set()
    for node in gm.graph.nodes:
        if is_delegate_node(node):
            lowered = getattr(gm, node.args[0].target)
            inner = [n for n in lowered.original_module.graph.nodes if n.op == "placeholder"]
            for r in _read_roots(lowered.original_module):
                if r in inner and inner.index(r) + 1 < len(node.args):
                    roots.add(_root(node.args[inner.index(r) + 1]))
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            at = STORAGE_OFFSET_AT.get(kernel_name(node.target))
            offset = node.args[at] if at is not None and at < len(node.args) else node.kwargs.get("storage_offset")
            if at is not None and offset is not None:
                roots.add(_root(node.args[0]))
    return {r for r in roots if r is not None and r.op == "placeholder"}


def _root(node) -> torch.fx.Node | None:
    """The node whose memory `node` is, through views and copies to a device."""
    seen = set()
    while isinstance(node, torch.fx.Node) and node not in seen:
        seen.add(node)
        target = node.target
        if is_copy_node(node) or (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
                                  and is_view(target)):
            pos = 0 if is_copy_node(node) or not isinstance(target, torch._ops.OpOverload) else view_source(target)
            node = node.args[pos] if pos < len(node.args) else None
            continue
        return node
    return None
