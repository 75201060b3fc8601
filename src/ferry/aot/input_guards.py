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
import functools
import itertools
import math
import re
from typing import cast

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind
from torch.utils._sympy import functions as F
from torch.utils._sympy.printers import PythonPrinter

from ferry import node_meta as M
from ferry.aot.input_sizes import dynamic_sizes, linear_form
from ferry.errors import CompileError
from ferry.program import guards
from ferry.program.schema import ConstValue, Method, TensorValue
from ferry.program.signature import size_name

__all__ = ["input_guards"]

# how many values of one size are tried to see whether a guard of that size alone holds for every
# size a call may bring anyway
ENUMERATED = 4096
GREEDY = 32  # guards tried against the others kept (each try makes at most 64 * ENUMERATED evaluations)

_BINARY = {ast.Add: "add", ast.Mult: "mul", ast.FloorDiv: "floordiv", ast.Mod: "mod", ast.Div: "truediv",
           ast.Pow: "pow", ast.BitAnd: "bitand", ast.BitOr: "bitor", ast.BitXor: "bitxor", ast.LShift: "lshift",
           ast.RShift: "rshift"}
_CHAINED = frozenset({"add", "mul", "bitand", "bitor", "bitxor"})  # n-ary in the language, applied left to right
_COMPARE = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge"}
_CALLS = {"max": "max", "min": "min", "abs": "abs", "float": "float", "int": "trunc", "round": "round",
          "math.floor": "floor", "math.ceil": "ceil", "math.trunc": "trunc", "torch.sym_max": "max",
          "torch.sym_min": "min", "torch.sym_float": "float", "torch.sym_int": "trunc", "torch._sym_sqrt": "sqrt",
          **{f"math.{fn}": fn for fn in guards.MATH}}


class _Untranslatable(Exception):
    pass


def input_guards(ep: torch.export.ExportedProgram, gm: torch.fx.GraphModule, method: Method) -> list[str]:
    """The guards on the user-input sizes of `ep` (placed as `gm`, emitted as `method`: its bounds
    and minimums are checked already), in ferry's guard language, each once. A guard ferry cannot
    write or check, and a bound a guard rules out, are CompileErrors: a program whose calls are
    not checked as export's are could answer unlike the model."""
    position = _positions(ep, gm)
    sources = _sources(ep, position)
    ranges, name = _ranges(method), method.name
    found: dict[str, tuple] = {}
    for code in list(getattr(ep, "_guards_code", None) or []) + _expression_sizes(gm, name):
        try:
            tree = guards.parse(_translate(code, sources, method))
        except (_Untranslatable, SyntaxError, guards.GuardError) as e:
            raise CompileError(f"method {name!r}: export checks its inputs with `{_short(code)}` ({e}), which ferry cannot "
                               "check on each call; a call where it fails would run a graph traced where it held "
                               "(re-export without the check in the model, or with the sizes it reads static)") from None
        if not _holds_at_export(tree, ep, position):
            raise CompileError(f"method {name!r}: ferry reads export's input check `{_short(code)}` as "
                               f"{guards.render(tree, _namer(method))}, which fails at the inputs export traced: a misreading "
                               "that would refuse good calls (please report it)")
        found.setdefault(guards.canonical(tree), tree)
    kept = [t for t in found.values() if not _implied(t, ranges, method)]
    # one implied by the others kept, the longest first (the message names the simplest): each
    # removal leaves a set that implies it; the first GREEDY tried (compile time stays bounded)
    for t in sorted(kept, key=lambda t: -len(guards.text(t)))[:GREEDY]:
        if _implied(t, ranges, method, tuple(u for u in kept if u is not t)):
            kept.remove(t)
    _check_bounds(kept, ranges, method, _sizing_memory(gm))
    if len(kept) > guards.MAX_GUARDS:
        raise CompileError(f"method {name!r}: export checks its inputs with {len(kept)} distinct guards, more than the "
                           f"{guards.MAX_GUARDS} a program file holds (export with fewer dynamic sizes)")
    return [guards.text(t) for t in kept]


def _sizing_memory(gm: torch.fx.GraphModule) -> set[tuple[int, int]]:
    """(input, dim) of each dynamic size a tensor of `gm` is sized by (dim -1: an int input)."""
    used: set = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        for size in val.shape if isinstance(val, torch.Tensor) else ():
            if isinstance(size, torch.SymInt):
                used |= size.node.expr.free_symbols
    return {(i, d) for i, d, expr in dynamic_sizes(gm) if d >= 0 or expr.free_symbols & used}


def _short(code: str) -> str:
    return code if len(code) <= 200 else code[:200] + "..."


def _namer(method: Method):
    return functools.partial(size_name, method)


def _check_bounds(kept: list, ranges: dict, method: Method, sizing: set) -> None:
    """Memory is planned at each size's bound: a guard of that size alone that fails there (a
    `% 3 == 0` length with a Dim max of 64) would make the plan a shape no call may bring.
    `sizing`: the sizes (input, dim) some tensor of the method is sized by (an int input may size
    none: `x * n`)."""
    for tree in kept:
        read = set(guards.leaves(tree))
        if len(read) != 1 or not read <= sizing:
            continue
        (leaf,) = read
        low, high = ranges[leaf]
        if not guards.evaluate(tree, _constant(high)):
            meets = [v for v in range(high - 1, max(low or 0, high - ENUMERATED) - 1, -1)
                     if all(guards.evaluate(t, _constant(v)) for t in kept if set(guards.leaves(t)) == read)]
            hint = f"the largest that meets it is {meets[0]}" if meets else "none up to it meets it"
            named = _namer(method)
            raise CompileError(f"method {method.name!r}: {named(*leaf)}'s bound {high} fails export's check "
                               f"{guards.render(tree, named)}; memory is planned at the bound, so export with a "
                               f"torch.export.Dim max that meets it ({hint})")


def _positions(ep: torch.export.ExportedProgram, gm: torch.fx.GraphModule) -> dict[int, int]:
    """Each of the caller's flattened arguments -> its position among the method's inputs (`gm`'s
    user inputs; a constant argument has none)."""
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    placed = [n.name for n in gm.graph.nodes if n.op == "placeholder" and M.input_info(n).kind == M.USER_INPUT]
    return {k: placed.index(name) for k, name in enumerate(names) if name in placed}


def _sources(ep: torch.export.ExportedProgram, position: dict[int, int]) -> dict[str, int | str]:
    """The source text guard code names each user input by (L['x'], L['z']['a'], L['flat_args'][2])
    -> its position among the method's inputs, or for an argument export fixed (a float, an int
    without a Dim) its value as a literal of the language: every call is checked to pass it."""
    spec = ep.call_spec.in_spec
    if spec is None:
        return {}
    count = spec.num_leaves
    args, kwargs = pytree.tree_unflatten(list(range(count)), spec)
    sig = ep.module_call_graph[0].signature if ep.module_call_graph else None
    names = list(sig.forward_arg_names) if sig is not None and sig.forward_arg_names else []
    bound = dict(zip(names, args)) if len(names) >= len(args) else {f"args_{i}": a for i, a in enumerate(args)}
    bound.update(kwargs)
    fixed = _fixed_arguments(ep)
    where: dict[int, int | str] = {**fixed, **position}
    sources: dict[str, int | str] = {f"L['flat_args'][{k}]": w for k, w in where.items()}
    for path, k in pytree.tree_leaves_with_path(bound):
        if k in where:
            key = pytree.keystr(path)
            sources["L" + key] = where[k]
            vararg = re.fullmatch(r"\[(['\"])(.+)_(\d+)\1\](.*)", key)
            if vararg:  # *args: forward_arg_names has args_0, the guard code may say L['args'][0] (never in
                # place of a real input's own source: x[1] is not an argument named x_1)
                sources.setdefault(f"L['{vararg.group(2)}'][{vararg.group(3)}]{vararg.group(4)}", where[k])
    return sources


def _fixed_arguments(ep: torch.export.ExportedProgram) -> dict[int, str]:
    """Flat argument -> its value as a literal, for each number export fixed (a constant input)."""
    out = {}
    for k, spec in enumerate(s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT):
        value = getattr(spec.arg, "value", None)
        if type(value) in (int, bool) or (type(value) is float and math.isfinite(value)):
            out[k] = repr(int(value)) if type(value) is bool else repr(value)
    return out


def _expression_sizes(gm: torch.fx.GraphModule, name: str) -> list[str]:
    """Guard code for each input dim traced as an expression of sizes that ferry's derived sizes
    (a*s + b, a >= 1) do not cover: a product, 10 - s. It must equal that expression, as
    ep.module() checks by solving. Leaves are named size_<input>_<dim> and arg_<input>; a dim of
    sizes no input has is a CompileError (its calls could not be checked)."""
    sizes = dynamic_sizes(gm)
    names: dict = {}
    for i, d, expr in sizes:
        if expr.is_Symbol and expr not in names:
            names[expr] = sympy.Symbol(f"arg_{i}" if d < 0 else f"size_{i}_{d}", integer=True)
    for i, d, expr in sizes:  # a size no input has, of which a dim is a*s + b: (dim - b) // a (checked exact)
        form = linear_form(expr) if d >= 0 else None
        if form is not None and form[0] not in names:
            sym, a, b = form
            names[sym] = F.FloorDiv(sympy.Symbol(f"size_{i}_{d}", integer=True) - b, a)
    out = []
    for i, d, expr in sizes:
        if d < 0 or expr.is_Symbol or linear_form(expr) is not None:
            continue
        if not expr.free_symbols <= set(names):
            raise CompileError(f"method {name!r}: dim {d} of input {i} was traced as {expr}, of sizes no input has: "
                               "ferry cannot check a call against it (export that dim with a torch.export.Dim of "
                               "its own, or static)")
        out.append(f"size_{i}_{d} == {PythonPrinter().doprint(expr.xreplace(names))}")
    return out


def _translate(code: str, sources: dict[str, int | str], method: Method) -> str:
    """Guard code (a Python expression) in ferry's guard language; raises _Untranslatable."""
    return _Translator(sources, method).node(ast.parse(code.strip(), mode="eval").body)


class _Translator:
    """Guard code's syntax tree -> the guard language. A static dim of an input and an argument
    export fixed become their values (each call is checked to bring them)."""

    def __init__(self, sources: dict[str, int | str], method: Method):
        self.sources, self.method = sources, method

    def node(self, n: ast.expr) -> str:
        leaf = self.leaf(n)
        if leaf is not None:
            return leaf
        if isinstance(n, ast.Constant) and isinstance(n.value, int):  # (a bool too)
            return str(int(n.value))
        if isinstance(n, ast.Constant) and type(n.value) is float and math.isfinite(n.value):
            return repr(n.value)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd, ast.Not)):
            inner = self.node(n.operand)
            if isinstance(n.op, ast.Not):
                return f"not({inner})"
            return inner if isinstance(n.op, ast.UAdd) else f"mul(-1, {inner})"
        if isinstance(n, ast.BinOp) and (isinstance(n.op, ast.Sub) or type(n.op) in _BINARY):
            op = "add" if isinstance(n.op, ast.Sub) else _BINARY[type(n.op)]
            right = f"mul(-1, {self.node(n.right)})" if isinstance(n.op, ast.Sub) else self.node(n.right)
            left = self.node(n.left)
            if op in _CHAINED and left.startswith(op + "("):  # a + b + c: one add of three, not nested
                return f"{left[:-1]}, {right})"
            return f"{op}({left}, {right})"
        if isinstance(n, ast.IfExp):
            return f"ifelse({self.node(n.test)}, {self.node(n.body)}, {self.node(n.orelse)})"
        if isinstance(n, ast.BoolOp):
            return f"{'and' if isinstance(n.op, ast.And) else 'or'}({', '.join(self.node(v) for v in n.values)})"
        if isinstance(n, ast.Compare) and all(type(op) in _COMPARE for op in n.ops):
            sides = [n.left, *n.comparators]
            parts = [f"{_COMPARE[type(op)]}({self.node(a)}, {self.node(b)})" for op, a, b in zip(n.ops, sides, sides[1:])]
            return parts[0] if len(parts) == 1 else f"and({', '.join(parts)})"
        if isinstance(n, ast.Call) and not n.keywords and ast.unparse(n.func) in _CALLS and n.args:
            return f"{_CALLS[ast.unparse(n.func)]}({', '.join(self.node(a) for a in n.args)})"
        raise _Untranslatable(f"`{ast.unparse(n)}` is not a size, a number or an operation ferry checks")

    def leaf(self, n: ast.expr) -> str | None:
        """`n` as a leaf: a tensor input's `.size()[d]`, an int input, or a structural name."""
        if isinstance(n, ast.Name):
            m = re.fullmatch(r"size_(\d+)_(\d+)|arg_(\d+)", n.id)
            if m is None:
                return None
            return f"arg({m.group(3)})" if m.group(3) else f"size({m.group(1)}, {m.group(2)})"
        if (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute)
                and n.value.func.attr == "size" and not n.value.args and isinstance(n.slice, ast.Constant)
                and type(n.slice.value) is int):
            i = self.sources.get(ast.unparse(n.value.func.value))
            v = self.method.values[self.method.inputs[i]] if isinstance(i, int) else None
            if not isinstance(v, TensorValue) or not -len(v.shape) <= n.slice.value < len(v.shape):
                raise _Untranslatable(f"`{ast.unparse(n.value.func.value)}` is no tensor input of the method with "
                                      f"a dim {n.slice.value}")
            d = n.slice.value % len(v.shape)
            return f"size({i}, {d})" if v.dynamic and v.dynamic[d] else str(v.shape[d])
        if isinstance(n, ast.Subscript) and ast.unparse(n).startswith("L["):
            i = self.sources.get(ast.unparse(n))
            if isinstance(i, str):
                return i  # an argument export fixed: its value
            v = self.method.values[self.method.inputs[i]] if isinstance(i, int) else None
            if not (isinstance(v, ConstValue) and v.kind == "symint"):
                raise _Untranslatable(f"`{ast.unparse(n)}` is no int input of the method")
            return f"arg({i})"
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


def _implied(tree, ranges: dict, method: Method, given: tuple = ()) -> bool:
    """Whether every call ferry's other checks let through meets the guard anyway (a bound, a
    minimum, sizes checked equal or `a*s + b` of another, the `given` guards of no other sizes),
    found by trying each combination of the sizes it reads (at most 64 * ENUMERATED evaluations); a
    guard of no size held at export."""
    read = sorted(set(guards.leaves(tree)))
    if not read:
        return True  # of static sizes and fixed arguments only: it held where export traced them
    if len(read) == 1 and tree[0] in ("le", "lt") and type(tree[2]) in (int, float) and tree[1] == _leaf_of(read[0]):
        return guards.evaluate(tree, _constant(ranges[read[0]][1]))  # below the bound checked anyway
    spans = [ranges.get(leaf, (None, None)) for leaf in read]
    given = tuple(g for g in given if set(guards.leaves(g)) <= set(read))
    if any(low is None for low, _ in spans):
        return False
    if math.prod(high - low + 1 for low, high in spans) * (1 + len(given)) > 64 * ENUMERATED:
        return False
    for values in itertools.product(*(range(low, high + 1) for low, high in spans)):
        sizes = dict(zip(read, values))
        if (_consistent(sizes, method) and all(guards.evaluate(g, _lookup(sizes)) for g in given)
                and not guards.evaluate(tree, _lookup(sizes))):
            return False
    return True


def _leaf_of(key: tuple[int, int]):
    return ("arg", key[0]) if key[1] < 0 else ("size", *key)


def _consistent(sizes: dict, method: Method) -> bool:
    """Whether sizes of some inputs pass ferry's checks of equal and derived sizes among them."""
    for group in method.equal_sizes:
        if len({sizes[k] for pair in group if (k := (pair[0], pair[1])) in sizes}) > 1:
            return False
    for i, d, a, b, root, root_dim in method.derived_sizes:
        size = sizes.get((i, d))
        if size is None:
            continue
        if (root, root_dim) in sizes and size != a * sizes[(root, root_dim)] + b:
            return False
        if root < 0 and (size - b) % a:
            return False
    return True


def _lookup(sizes: dict):
    return lambda i, d: sizes[(i, d)]


def _constant(v: int):
    return lambda i, d: v
