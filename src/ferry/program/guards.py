"""The checks export recorded on a method's input sizes (`torch._check(n >= 1)`, a branch taken on
`x.shape[0] % 2 == 0`), in a small expression language of ferry's own.

`ExportedProgram.module()` runs such guards as generated Python before every call; ferry's file is
data, so it holds them as text in this language: written by `ferry.compile`, parsed (and its
leaves checked against the method's inputs) when a file loads, evaluated on every call from the
parsed tree. Nothing in it is handed to Python's `eval`.

    guard := number | leaf | op "(" guard ("," guard)* ")"
    leaf  := size(i, d)   dim d of tensor input i      | arg(i)   int input i
    op    := add mul floordiv mod truediv pow max min abs floor ceil trunc round float
             bitand bitor bitxor lshift rshift sqrt exp log log2 sin cos tan asin acos atan
             sinh cosh tanh eq ne lt le gt ge and or not ifelse
    number:= an integer, or a decimal (2.5)

Arithmetic is Python's, as in the guard code export writes: floor division and modulo round
toward minus infinity, `truediv` is `/` (a float), `round` rounds half to even; `and`, `or` and
`ifelse(c, a, b)` (Python's `a if c else b`) evaluate only what Python would. An integer of more
than 4,096 bits anywhere in a guard (a power, a shift, a product, `round` to that many digits),
like a division by zero, makes the guard false: a file cannot make a call compute for long.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from functools import reduce

__all__ = ["GuardError", "MATH", "MAX_DEPTH", "MAX_GUARDS", "MAX_TEXT", "canonical", "evaluate", "leaves", "parse",
           "render", "text"]

MAX_TEXT = 4096  # characters in one guard
MAX_DEPTH = 48  # nesting of one guard
MAX_GUARDS = 256  # guards of one method
BITS = 4096  # the largest integer a guard may make, in bits (sizes are int64)


class GuardError(ValueError):
    """A guard's text is not of the language (a malformed or edited file)."""


class _Undefined(Exception):
    """An operation of a guard has no value at a call's sizes (a division by zero)."""


def _nary(fn) -> Callable:
    def apply(*xs):
        def step(a, b):
            out = fn(a, b)
            if isinstance(out, int) and out.bit_length() > BITS:  # each step: a product of many stays small
                raise OverflowError("a guard's integer is too large")
            return out
        return reduce(step, xs)
    return apply


def _power(a, b):
    if isinstance(b, int) and isinstance(a, int) and abs(a) > 1 and b * (abs(a).bit_length() - 1) > BITS:
        raise OverflowError("a guard's power is too large")
    return a ** b


def _lshift(a, b):
    if b > BITS:
        raise OverflowError("a guard's shift is too large")
    return a << b


def _round(x, digits=None):
    if digits is not None and abs(digits) > 400:  # 10 ** digits: beyond any float's or int64's
        raise OverflowError("a guard rounds to too many digits")
    return round(x) if digits is None else round(x, digits)


MATH = ("sqrt", "exp", "log", "log2", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh")


# op -> (fewest arguments, most (None: any), function)
OPS: dict[str, tuple[int, int | None, Callable | None]] = {
    "add": (2, None, _nary(operator.add)), "mul": (2, None, _nary(operator.mul)),
    "floordiv": (2, 2, operator.floordiv), "mod": (2, 2, operator.mod), "truediv": (2, 2, operator.truediv),
    "pow": (2, 2, _power), "max": (2, None, max), "min": (2, None, min), "abs": (1, 1, abs),
    "floor": (1, 1, math.floor), "ceil": (1, 1, math.ceil), "trunc": (1, 1, math.trunc), "float": (1, 1, float),
    "round": (1, 2, _round), "bitand": (2, None, _nary(operator.and_)), "bitor": (2, None, _nary(operator.or_)),
    "bitxor": (2, None, _nary(operator.xor)), "lshift": (2, 2, _lshift), "rshift": (2, 2, operator.rshift),
    **{name: (1, 1, getattr(math, name)) for name in MATH},
    "eq": (2, 2, operator.eq), "ne": (2, 2, operator.ne), "lt": (2, 2, operator.lt), "le": (2, 2, operator.le),
    "gt": (2, 2, operator.gt), "ge": (2, 2, operator.ge), "not": (1, 1, operator.not_),
    # evaluated lazily, as Python does (_value): an operand Python skips may not divide by zero
    "and": (2, None, None), "or": (2, None, None), "ifelse": (3, 3, None),
}
INFIX = {"add": "+", "mul": "*", "floordiv": "//", "mod": "%", "truediv": "/", "pow": "**", "eq": "==",
         "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "and": "and", "or": "or", "bitand": "&",
         "bitor": "|", "bitxor": "^", "lshift": "<<", "rshift": ">>"}

_TOKEN = re.compile(r"\s*(?:(-?\d+(?:\.\d*(?:e[-+]?\d+)?|e[-+]?\d+))|(-?\d+)|([a-z][a-z0-9]*)|([(),]))", re.ASCII)


def parse(text: str):
    """The tree of `text`: a number, ("size", i, d), ("arg", i), or (op, *arguments). Raises
    GuardError on anything else."""
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise GuardError(f"a guard is a string of at most {MAX_TEXT} characters")
    tokens = _tokens(text)
    tree, at = _parse(tokens, 0, 0)
    if at != len(tokens):
        raise GuardError(f"guard {text!r}: unexpected {tokens[at][1]!r} after a whole expression")
    return tree


def _tokens(text: str) -> list[tuple[str, object]]:
    out, at = [], 0
    text = text.rstrip()
    while at < len(text):
        m = _TOKEN.match(text, at)
        if m is None or m.end() == at:
            raise GuardError(f"guard {text!r}: cannot read {text[at:at + 12]!r}")
        dec, num, name, punct = m.groups()
        if dec and not math.isfinite(float(dec)) or num and len(num) > BITS // 3:
            raise GuardError(f"guard {text!r}: the number {(dec or num)[:20]!r} is out of range")
        out.append(("number", float(dec)) if dec else ("number", int(num)) if num else
                   ("name", name) if name else ("punct", punct))
        at = m.end()
    return out


def _parse(tokens, at: int, depth: int):
    if depth > MAX_DEPTH:
        raise GuardError(f"a guard nests deeper than {MAX_DEPTH}")
    if at >= len(tokens):
        raise GuardError("a guard ends where an expression should be")
    kind, value = tokens[at]
    if kind == "number":
        return value, at + 1
    if kind != "name" or at + 1 >= len(tokens) or tokens[at + 1] != ("punct", "("):
        raise GuardError(f"a guard has {value!r} where a number or a call should be")
    args, at = [], at + 2
    while True:
        arg, at = _parse(tokens, at, depth + 1)
        args.append(arg)
        if at < len(tokens) and tokens[at] == ("punct", ","):
            at += 1
            continue
        if at < len(tokens) and tokens[at] == ("punct", ")"):
            return _node(str(value), args), at + 1
        raise GuardError(f"a guard's call of {value!r} is not closed")


def _node(name: str, args: list):
    if name in ("size", "arg"):
        want = 1 if name == "arg" else 2
        if len(args) != want or not all(type(a) is int for a in args):
            raise GuardError(f"{name}() takes {want} integer literal(s), got {args!r}")
        if args[0] < 0 or (name == "size" and args[1] < 0):
            raise GuardError(f"{name}() of a negative position: {args!r}")
        return (name, *args)
    if name not in OPS:
        raise GuardError(f"a guard calls {name!r}, not an operation of the language ({', '.join(OPS)})")
    low, high, _ = OPS[name]
    if len(args) < low or (high is not None and len(args) > high):
        raise GuardError(f"{name}() takes {low}{'' if high == low else ' or more' if high is None else f'..{high}'} "
                         f"arguments, got {len(args)}")
    return (name, *args)


COMMUTATIVE = frozenset({"add", "mul", "max", "min", "eq", "ne", "bitand", "bitor", "bitxor"})
ASSOCIATIVE = frozenset({"add", "mul", "max", "min", "bitand", "bitor", "bitxor"})
_FLIPPED = {"gt": "lt", "ge": "le"}


def text(tree) -> str:
    """The guard's text in the language (what `parse` reads back as `tree`)."""
    if not isinstance(tree, tuple):
        return repr(tree)
    return f"{tree[0]}({', '.join(text(a) for a in tree[1:])})"


def canonical(tree) -> str:
    """One text for guards that differ only in the order or grouping of a commutative
    operation's operands or in the side a comparison is written from (x > y is y < x)."""
    return text(_canonical(tree))


def _canonical(tree):
    if not isinstance(tree, tuple) or tree[0] in ("size", "arg"):
        return tree
    op, args = tree[0], [_canonical(a) for a in tree[1:]]
    if op in _FLIPPED:
        op, args = _FLIPPED[op], args[::-1]
    if op in ASSOCIATIVE:  # a * (b * c) is a * b * c
        args = [a for x in args for a in (x[1:] if isinstance(x, tuple) and x[0] == op else [x])]
    if op in COMMUTATIVE:  # (and/or keep their order: Python may skip a later operand)
        args = sorted(args, key=text)
    return (op, *args)


def leaves(tree) -> list[tuple[int, int]]:
    """[(input, dim)] a guard reads: dim -1 for an int input (arg)."""
    if not isinstance(tree, tuple):
        return []
    if tree[0] == "size":
        return [(tree[1], tree[2])]
    if tree[0] == "arg":
        return [(tree[1], -1)]
    return [leaf for a in tree[1:] for leaf in leaves(a)]


def evaluate(tree, size_of: Callable[[int, int], int]) -> bool:
    """Whether the guard holds where `size_of(input, dim)` gives the call's sizes (dim -1: an int
    input's value). A guard that cannot be evaluated there (a division by a size of 0) fails."""
    try:
        return bool(_value(tree, size_of))
    except _Undefined:
        return False


def _value(tree, size_of):
    if not isinstance(tree, tuple):
        return tree
    if tree[0] == "size":
        return size_of(tree[1], tree[2])
    op = tree[0]
    if op == "arg":
        return size_of(tree[1], -1)
    if op == "and" or op == "or":  # Python's: the first operand that decides it, as it is
        for a in tree[1:]:
            v = _value(a, size_of)
            if bool(v) == (op == "or"):
                return v
        return v
    if op == "ifelse":
        return _value(tree[2] if _value(tree[1], size_of) else tree[3], size_of)
    fn = OPS[op][2]
    assert fn is not None
    args = [_value(a, size_of) for a in tree[1:]]
    try:
        out = fn(*args)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as e:  # undefined there, as in Python
        raise _Undefined from e
    if isinstance(out, int) and out.bit_length() > BITS:
        raise _Undefined
    return out


def render(tree, name_of: Callable[[int, int], str]) -> str:
    """The guard as people read it: Python's infix, every operation in parentheses but the
    outermost, each leaf named by `name_of(input, dim)`."""
    out = _render(tree, name_of)
    return out[1:-1] if isinstance(tree, tuple) and tree[0] not in ("size", "arg") and out.startswith("(") else out


def _render(tree, name_of) -> str:
    if not isinstance(tree, tuple):
        return repr(tree)
    op, args = tree[0], tree[1:]
    if op in ("size", "arg"):
        return name_of(tree[1], tree[2] if op == "size" else -1)
    if op == "mul" and args[0] == -1:  # how the guard code's minus signs are kept
        return "(-" + _render(args[1] if len(args) == 2 else ("mul", *args[1:]), name_of) + ")"
    parts = [_render(a, name_of) for a in args]
    if op == "add":
        return "(" + parts[0] + "".join(f" - {p[2:-1]}" if p.startswith("(-") else f" + {p}" for p in parts[1:]) + ")"
    if op in INFIX:
        return "(" + f" {INFIX[op]} ".join(parts) + ")"
    if op == "ifelse":
        return f"({parts[1]} if {parts[0]} else {parts[2]})"
    return f"(not {parts[0]})" if op == "not" else f"{op}({', '.join(parts)})"
