"""The sizes a call on a method must bring, as `ExportedProgram.module()` checks them: sizes export
traced as one symbol are equal, a size exported as `a*s + b` has that form, a size is no smaller
than a minimum above 2. Also which sizes the compile-time rewrites may rely on (`checked_sizes`):
only those each call is checked for.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ferry import node_meta as M

__all__ = ["checked_sizes", "derived_sizes", "dynamic_sizes", "equal_sizes", "linear_form", "size_minimums"]


def equal_sizes(gm: torch.fx.GraphModule) -> list[list[list[int]]]:
    """Groups of [input position, dim] that export traced as one dynamic size (one symbol): a
    call must give them equal sizes. Dim -1 is an int input of that size (a length passed beside
    the tensor it measures). Only groups of two or more; a dim that is an expression of a size
    (2 * s0) is not listed."""
    groups: dict[str, list[list[int]]] = {}
    for i, d, expr in dynamic_sizes(gm):
        if expr.is_Symbol:
            groups.setdefault(str(expr), []).append([i, d])
    return [g for g in groups.values() if len(g) > 1]


def dynamic_sizes(gm: torch.fx.GraphModule) -> list[tuple[int, int, Any]]:
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
    for _, d, expr in dynamic_sizes(gm):
        if d >= 0:
            (bare if expr.is_Symbol else derived).update(map(str, expr.free_symbols))
    return frozenset(bare - derived)


def derived_sizes(gm: torch.fx.GraphModule) -> list[list[int]]:
    """[input, dim, a, b, root input, root dim] for every input dim export traced as `a*s + b` of
    one size `s` (a Dim's multiple or offset): a call must give it that value of the size where
    another input's dim (or an int input, dim -1) is `s` itself (root input -1: none is, and the
    size must still be one `a*s + b` can take). Other expressions are not listed."""
    dims = dynamic_sizes(gm)
    roots: dict = {}  # symbol -> the first [input, dim] that is it
    for i, d, expr in dims:
        if expr.is_Symbol:
            roots.setdefault(expr, [i, d])
    found = []
    for i, d, expr in dims:
        form = linear_form(expr)
        if form is not None and d >= 0:
            sym, a, b = form
            found.append([i, d, a, b, *roots.get(sym, [-1, 0])])
    return found


def linear_form(expr) -> tuple[Any, int, int] | None:
    """(s, a, b) where `expr` is a*s + b of one symbol s, integers a >= 1 and b, and not s itself:
    the sizes `derived_sizes` lists."""
    if expr.is_Symbol or len(expr.free_symbols) != 1:
        return None
    (sym,) = expr.free_symbols
    a, b = expr.coeff(sym), expr.subs(sym, 0)
    if a.is_Integer and b.is_Integer and a >= 1 and (a * sym + b - expr).expand() == 0:
        return sym, int(a), int(b)
    return None


def size_minimums(gm: torch.fx.GraphModule, range_constraints) -> list[list[int]]:
    """[input position, dim (-1: an int input), minimum] for every dynamic size export recorded a
    minimum above 2 for: what `ep.module()` checks each call (it checks none of 2 or less, the
    sizes export's 0/1 specialisation assumes away), and so does ferry. A graph traced for t >= 5
    may have taken a branch that is wrong at t = 3."""
    ranges = [(i, d, (range_constraints or {}).get(expr)) for i, d, expr in dynamic_sizes(gm)]
    return [[i, d, int(r.lower)] for i, d, r in ranges if r is not None and r.lower > 2]
