"""What export checked about a method's input sizes beyond their ranges, as guards a call is held to.

Tracing records a guard wherever the model asked about a dynamic size: `torch._check(n >= 1)`, a
branch on `x.shape[0] % 2 == 0`, `max(a, b) > 6`. The exported program keeps them as Python code
(`ExportedProgram._guards_code`, written when export finished) and `ep.module()` runs that code
before every call: the graph is right only where they hold. A size traced as a product of others
(y of `x.reshape(-1) + y`: x0 * x1) must equal it too. ferry writes both into the method in its
own language (program/guards.py), translated from the code's syntax tree (never run), and checks
them per call. A guard ferry's other checks already imply (a bound, a minimum) is left out.

The guard code is read, not the shape environment's guards: tracing the program again (as
`ep.module()` with symbolic inputs does) adds guards of that trace's own (evaluating `max(a, b)`
guards `a > b`), which export never asked of a call.
"""

from __future__ import annotations

import ast
import math
import re
import warnings
from typing import cast

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind
from torch.utils._sympy.printers import PythonPrinter

from ferry import node_meta as M
from ferry.aot.input_sizes import dynamic_sizes
from ferry.program import guards
from ferry.program.schema import ConstValue, Method, TensorValue

__all__ = ["input_guards"]

# how many values of one size are tried to see whether a guard of that size alone holds for every
# size a call may bring anyway
ENUMERATED = 4096

_BINARY = {ast.Add: "add", ast.Mult: "mul", ast.FloorDiv: "floordiv", ast.Mod: "mod", ast.Div: "truediv",
           ast.Pow: "pow"}
_COMPARE = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge"}
_CALLS = {"max": "max", "min": "min", "abs": "abs", "float": "float", "int": "trunc", "math.floor": "floor",
          "math.ceil": "ceil", "math.trunc": "trunc", "torch.sym_max": "max", "torch.sym_min": "min"}


class _Untranslatable(Exception):
    pass


def input_guards(ep: torch.export.ExportedProgram, gm: torch.fx.GraphModule, method: Method) -> list[str]:
    """The guards on the user-input sizes of `ep` (placed as `gm`, emitted as `method`: its bounds
    and minimums are checked already), in ferry's guard language. A guard ferry cannot write (an
    operation outside the language, a source that is no input's size) is warned about, naming it."""
    position = _positions(ep, gm)
    sources = _sources(ep, position)
    structural = _nonlinear_sizes(gm)
    ranges, found = _ranges(method), []
    for code in list(getattr(ep, "_guards_code", None) or []) + structural:
        try:
            text = _translate(code, sources)
            tree = guards.parse(text)
        except (_Untranslatable, SyntaxError, guards.GuardError) as e:
            warnings.warn(f"method {method.name!r}: export checks its inputs with `{code}` ({e}), which ferry cannot "
                          "write into the file: a call where it fails is not refused, and may answer unlike the model",
                          stacklevel=3)
            continue
        if not _holds_at_export(tree, ep, position):
            warnings.warn(f"method {method.name!r}: export's input check `{code}` fails at the inputs it was traced "
                          "with, as ferry reads it; it is left out", stacklevel=3)
        elif text not in found and not _implied(tree, ranges, method.equal_sizes):
            found.append(text)
    return found


def _positions(ep: torch.export.ExportedProgram, gm: torch.fx.GraphModule) -> dict[int, int]:
    """Each of the caller's flattened arguments -> its position among the method's inputs (`gm`'s
    user inputs; a constant argument has none)."""
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    placed = [n.name for n in gm.graph.nodes if n.op == "placeholder" and M.input_info(n).kind == M.USER_INPUT]
    return {k: placed.index(name) for k, name in enumerate(names) if name in placed}


def _sources(ep: torch.export.ExportedProgram, position: dict[int, int]) -> dict[str, int]:
    """The source text guard code names each user input by (L['x'], L['z']['a'], L['flat_args'][2])
    -> its position among the method's inputs."""
    spec = ep.call_spec.in_spec
    if spec is None:
        return {}
    count = spec.num_leaves
    args, kwargs = pytree.tree_unflatten(list(range(count)), spec)
    sig = ep.module_call_graph[0].signature if ep.module_call_graph else None
    names = list(sig.forward_arg_names) if sig is not None and sig.forward_arg_names else []
    bound = dict(zip(names, args)) if len(names) >= len(args) else {f"args_{i}": a for i, a in enumerate(args)}
    bound.update(kwargs)
    sources: dict[str, int] = {f"L['flat_args'][{k}]": position[k] for k in range(count) if k in position}
    for path, k in pytree.tree_leaves_with_path(bound):
        if k not in position:
            continue
        sources["L" + pytree.keystr(path)] = position[k]
        vararg = re.fullmatch(r"\[(['\"])(.+)_(\d+)\1\](.*)", pytree.keystr(path))
        if vararg:  # *args: forward_arg_names has args_0, the guard code may say L['args'][0]
            sources[f"L['{vararg.group(2)}'][{vararg.group(3)}]{vararg.group(4)}"] = position[k]
    return sources


def _nonlinear_sizes(gm: torch.fx.GraphModule) -> list[str]:
    """Guard code for each input dim traced as a product or another non-linear expression of sizes:
    it must equal that expression, as ep.module() checks by solving (ferry's derived sizes cover
    the linear ones, a*s + b). Leaves are named size_<input>_<dim> and arg_<input>."""
    sizes = dynamic_sizes(gm)
    names = {}
    for i, d, expr in sizes:
        if expr.is_Symbol and expr not in names:
            names[expr] = sympy.Symbol(f"arg_{i}" if d < 0 else f"size_{i}_{d}", integer=True)
    out = []
    for i, d, expr in sizes:
        linear = len(expr.free_symbols) == 1 and expr.is_polynomial() and sympy.degree(expr) == 1
        if d >= 0 and not expr.is_Symbol and not linear and expr.free_symbols <= set(names):
            out.append(f"size_{i}_{d} == {PythonPrinter().doprint(expr.xreplace(names))}")
    return out


def _translate(code: str, sources: dict[str, int]) -> str:
    """Guard code (a Python expression) in ferry's guard language; raises _Untranslatable."""
    return _node(ast.parse(code.strip(), mode="eval").body, sources)


def _node(n: ast.expr, sources: dict[str, int]) -> str:
    leaf = _leaf(n, sources)
    if leaf is not None:
        return leaf
    if isinstance(n, ast.Constant) and type(n.value) in (int, bool):
        return str(int(n.value)) if type(n.value) is int else ("eq(0, 0)" if n.value else "eq(0, 1)")
    if isinstance(n, ast.Constant) and type(n.value) is float and math.isfinite(n.value):
        return repr(n.value)
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd, ast.Not)):
        inner = _node(n.operand, sources)
        if isinstance(n.op, ast.Not):
            return f"not({inner})"
        return inner if isinstance(n.op, ast.UAdd) else f"mul(-1, {inner})"
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub):
        return f"add({_node(n.left, sources)}, mul(-1, {_node(n.right, sources)}))"
    if isinstance(n, ast.BinOp) and type(n.op) in _BINARY:
        return f"{_BINARY[type(n.op)]}({_node(n.left, sources)}, {_node(n.right, sources)})"
    if isinstance(n, ast.BoolOp):
        return f"{'and' if isinstance(n.op, ast.And) else 'or'}({', '.join(_node(v, sources) for v in n.values)})"
    if isinstance(n, ast.Compare) and all(type(op) in _COMPARE for op in n.ops):
        sides = [n.left, *n.comparators]
        parts = [f"{_COMPARE[type(op)]}({_node(a, sources)}, {_node(b, sources)})"
                 for op, a, b in zip(n.ops, sides, sides[1:])]
        return parts[0] if len(parts) == 1 else f"and({', '.join(parts)})"
    if isinstance(n, ast.Call) and not n.keywords and ast.unparse(n.func) in _CALLS and n.args:
        return f"{_CALLS[ast.unparse(n.func)]}({', '.join(_node(a, sources) for a in n.args)})"
    raise _Untranslatable(f"`{ast.unparse(n)}` is not a size, a number or an operation ferry checks")


def _leaf(n: ast.expr, sources: dict[str, int]) -> str | None:
    """`n` as a leaf: a tensor input's `.size()[d]`, an int input, or a structural name."""
    if isinstance(n, ast.Name):
        m = re.fullmatch(r"size_(\d+)_(\d+)|arg_(\d+)", n.id)
        if m is None:
            return None
        return f"arg({m.group(3)})" if m.group(3) else f"size({m.group(1)}, {m.group(2)})"
    if (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute)
            and n.value.func.attr == "size" and not n.value.args and isinstance(n.slice, ast.Constant)
            and type(n.slice.value) is int):
        where = ast.unparse(n.value.func.value)
        if where in sources:
            return f"size({sources[where]}, {n.slice.value})"
        raise _Untranslatable(f"`{where}` is no tensor input of the method")
    if isinstance(n, ast.Subscript) and ast.unparse(n).startswith("L["):
        if ast.unparse(n) in sources:
            return f"arg({sources[ast.unparse(n)]})"
        raise _Untranslatable(f"`{ast.unparse(n)}` is no input of the method")
    return None


def _holds_at_export(tree, ep: torch.export.ExportedProgram, position: dict[int, int]) -> bool:
    """Whether the guard holds at the inputs export traced (where it must): a check that ferry's
    reading of the sources is right. True where export kept no example inputs."""
    example = getattr(ep, "example_inputs", None)
    if not example:
        return True
    flat = pytree.tree_leaves(example)
    at = {p: flat[k] for k, p in position.items() if k < len(flat)}

    def size_of(i: int, d: int) -> int:
        return int(at[i]) if d < 0 else at[i].shape[d]

    try:
        return guards.evaluate(tree, size_of)
    except (KeyError, IndexError, AttributeError, TypeError):
        return False


def _ranges(method: Method) -> dict[tuple[int, int], tuple[int | None, int]]:
    """(input, dim) -> the (lowest, highest) size a call on `method` is checked to bring, of each
    dynamic tensor dim and int input (dim -1; lowest None: an int may be negative)."""
    lows = {(i, d): low for i, d, low in method.size_minimums}
    ranges: dict[tuple[int, int], tuple[int | None, int]] = {}
    for i, vid in enumerate(method.inputs):
        v = method.values[vid]
        if isinstance(v, TensorValue):
            for d, dyn in enumerate(v.dynamic or ()):
                if dyn:
                    ranges[(i, d)] = (lows.get((i, d), 0), v.shape[d])
        elif isinstance(v, ConstValue) and v.kind == "symint":
            ranges[(i, -1)] = (lows.get((i, -1)), cast(int, v.value))
    return ranges


def _implied(tree, ranges: dict, equal_sizes: list) -> bool:
    """Whether a call meeting ferry's other checks meets the guard anyway: two sizes checked equal
    (`equal_sizes`), or a guard of one size that holds at every size its range lets a call bring
    (a range of at most ENUMERATED values: each is tried)."""
    read = set(guards.leaves(tree))
    if tree[0] == "eq" and len(read) == 2 and all(isinstance(a, tuple) and a[0] in ("size", "arg") for a in tree[1:]):
        return any(read <= {tuple(pair) for pair in group} for group in equal_sizes)
    if len(read) != 1:
        return False
    low, high = ranges.get(next(iter(read)), (None, None))
    if low is None or high is None or high - low >= ENUMERATED:
        return False
    return all(guards.evaluate(tree, _constant(v)) for v in range(low, high + 1))


def _constant(v: int):
    return lambda i, d: v
