"""Argument references of a bound instruction: what is fixed at load, bound once, and what a call
reads from its slots, resolved the fastest way the references allow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from ferry.program.schema import LIST_KINDS, ConstValue, Method, TensorValue

__all__ = ["LAYOUT_VIEWS", "Fixed", "Listed", "NoMeta", "PerCall", "Ref", "arguments", "first_only", "meta_of",
           "one_value", "ref", "resolve"]


@dataclass(frozen=True, eq=False)
class Fixed:
    """An argument fixed at load (planned memory, a weight, a constant): bound once."""

    value: object


@dataclass(frozen=True)
class PerCall:
    """A value of the call (the caller's tensor, a run-time result, a size): read from its slot."""

    vid: int


@dataclass(frozen=True)
class Listed:
    """A list with members of the call: built from their slots when the instruction runs."""

    ids: tuple[int | None, ...]


Ref = Union[Fixed, PerCall, Listed]


def ref(slots, fixed, m: Method, vid: int) -> Ref:
    """How an instruction reads value `vid`: fixed, per call, or a list built per call."""
    if fixed[vid]:
        return Fixed(slots[vid])
    v = m.values[vid]
    if isinstance(v, ConstValue) and v.kind in LIST_KINDS:
        return Listed(tuple(v.value))  # type: ignore[arg-type]
    return PerCall(vid)


# Views export recorded as legal for the layouts the trace saw on the CPU. A kernel on another
# device may lay its result out differently (CUDA attention does), and `view` would then fail
# where eager, tracing on that device, would have chosen differently. Over a value of the call,
# `reshape` is the same view whenever one is possible and a copy otherwise: the graph is
# functional, so no one can tell the two apart.
LAYOUT_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


class NoMeta(Exception):
    pass


def meta_of(m: Method, vid: int, shapes: dict | None = None):
    """A meta tensor (or int) like value `vid`: at its planned shape, or at `shapes`' (one call's)."""
    v = m.values[vid]
    known = shapes.get(vid) if shapes is not None else None
    if isinstance(v, ConstValue) and v.kind in ("int", "symint"):
        return known if known is not None else v.value
    if isinstance(v, TensorValue) and known is not None:
        return torch.empty_strided(known[0], known[1], dtype=v.torch_dtype, device="meta")
    if not isinstance(v, TensorValue) or any(v.dynamic):
        raise NoMeta()
    if v.strides:
        return torch.empty_strided(v.shape, v.strides, dtype=v.torch_dtype, device="meta")
    return torch.empty(v.shape, dtype=v.torch_dtype, device="meta")


def first_only(pos, kw):
    """(value id, the other positional values, keywords) when the first positional argument is
    the only one read per call; else None."""
    if not pos or not isinstance(pos[0], PerCall) or not all(isinstance(r, Fixed) for r in (*pos[1:], *kw.values())):
        return None
    return pos[0].vid, tuple(r.value for r in pos[1:]), {k: r.value for k, r in kw.items()}


def one_value(refs) -> bool:
    """The references are to one value: one id of the call, or one fixed tensor."""
    if all(isinstance(r, PerCall) for r in refs):
        return len({r.vid for r in refs}) == 1
    return (all(isinstance(r, Fixed) for r in refs) and isinstance(refs[0].value, torch.Tensor)
            and all(r.value is refs[0].value for r in refs))


def arguments(slots, pos, kw):
    """A function giving (args, kwargs) of this call: what is fixed is bound once, the values of
    the call are read from the slots."""
    template = [r.value if isinstance(r, Fixed) else None for r in pos]
    plain = [(i, r.vid) for i, r in enumerate(pos) if isinstance(r, PerCall)]
    lists = [(i, r) for i, r in enumerate(pos) if isinstance(r, Listed)]
    fixed_kw = {k: r.value for k, r in kw.items() if isinstance(r, Fixed)}
    call_kw = [(k, r) for k, r in kw.items() if not isinstance(r, Fixed)]
    if not lists and not call_kw:
        def args():
            a = template.copy()
            for i, vid in plain:
                a[i] = slots[vid]
            return a, fixed_kw
        return args

    def general():
        a = template.copy()
        for i, vid in plain:
            a[i] = slots[vid]
        for i, r in lists:
            a[i] = resolve(r, slots)
        return a, ({**fixed_kw, **{k: resolve(r, slots) for k, r in call_kw}} if call_kw else fixed_kw)

    return general


def resolve(r: Ref, slots):
    """The argument a reference stands for in this call."""
    if isinstance(r, Fixed):
        return r.value
    if isinstance(r, PerCall):
        return slots[r.vid]
    return [None if e is None else slots[e] for e in r.ids]
