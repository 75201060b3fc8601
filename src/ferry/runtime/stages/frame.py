"""The frame a bound method runs in: which slots are fixed at load and which a call fills, the
sizes of a dynamic method at one shape, the lists built over its slots, when a call drops what
it no longer reads, and how a call meets the caller's tensors (CallIO)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ferry.layout import contiguous_strides
from ferry.program.schema import LIST_KINDS, ConstValue, Method, TensorValue, root_storage
from ferry.runtime.stages.load import Memory
from ferry.runtime.stages.steps import CallIO, Step

__all__ = ["at_shape", "call_io", "dynamic_values", "fix_lists", "fix_shapes", "members", "own_dynamic",
           "rebuild_lists", "record_shapes", "with_releases"]


def dynamic_values(method: Method) -> tuple[int, ...]:
    """The values whose size a call decides: sizes, and tensors with a dynamic dim (empty for
    a static method)."""
    return tuple(vid for vid, v in enumerate(method.values)
                 if isinstance(v, ConstValue) and v.kind == "symint" or isinstance(v, TensorValue) and any(v.dynamic))


def record_shapes(slots: list, ids: Sequence[int]) -> dict[int, object]:
    """What a call at one shape made of the dynamic values: ints, and (shape, strides)."""
    out: dict[int, object] = {}
    for vid in ids:
        x = slots[vid]
        if isinstance(x, torch.Tensor):
            out[vid] = (tuple(x.shape), tuple(x.stride()))
        elif x is not None:
            out[vid] = int(x)
    return out


def fix_shapes(method: Method, slots: list, fixed: list, shapes: dict[int, Any]) -> dict[int, tuple]:
    """Fix the dynamic values at one call's shapes; returns the shapes of fresh outputs."""
    fresh: dict[int, tuple] = {}
    changed: set[int] = set()
    for vid, s in shapes.items():
        v = method.values[vid]
        if isinstance(v, ConstValue):
            slots[vid], fixed[vid] = s, True
        elif fixed[vid] and v.storage == "planned":  # a view of its memory at this shape (within the bound)
            base, (size, stride) = slots[vid], s
            slots[vid] = base.as_strided(size, stride, base.storage_offset())
            changed.add(vid)
        elif fixed[vid] and v.storage in ("input", "output"):  # staged (load.py): its memory viewed at this shape
            base, (size, stride) = slots[vid], s
            if tuple(stride) == contiguous_strides(tuple(size)):
                slots[vid] = base.as_strided(size, stride, base.storage_offset())
                changed.add(vid)
            else:  # laid out otherwise by the caller (or its kernel): this plan takes the tensor itself
                slots[vid], fixed[vid] = None, False
                if v.storage == "output":
                    fresh[vid] = s  # type: ignore[assignment]
        elif v.storage == "output":
            fresh[vid] = s  # type: ignore[assignment]
    rebuild_lists(method, slots, fixed, changed)
    return fresh


def own_dynamic(method: Method, slots: list, fixed: list) -> dict:
    """A plan bound for any size sizes its dynamic planned tensors each call (resizing them in
    place): it gets tensor objects of its own over their memory, so the sizes one call leaves
    behind never reach another plan (one bound at a shape, which reads the memory at its own
    sizes), and lists holding them are built again over its own. Dynamic inputs and outputs
    staged for graphs are the caller's tensors in it. Returns no fresh shapes."""
    mine = set()
    for vid, v in enumerate(method.values):
        if isinstance(v, TensorValue) and any(v.dynamic) and fixed[vid] and v.storage in ("input", "output"):
            slots[vid], fixed[vid] = None, False
        elif isinstance(v, TensorValue) and any(v.dynamic) and fixed[vid] and isinstance(t := slots[vid], torch.Tensor):
            slots[vid] = t.as_strided(t.size(), t.stride(), t.storage_offset())
            mine.add(vid)
    rebuild_lists(method, slots, fixed, mine)
    return {}


def rebuild_lists(method: Method, slots: list, fixed: list, changed: set[int]) -> None:
    """Lists built at load over members whose tensor objects were replaced: built again."""
    if not changed:
        return
    for vid, v in enumerate(method.values):
        if isinstance(v, ConstValue) and v.kind in LIST_KINDS and fixed[vid] and changed.intersection(
                x for x in v.value if x is not None):  # type: ignore[attr-defined]
            slots[vid] = [None if x is None else slots[x] for x in v.value]  # type: ignore[attr-defined]


def with_releases(method: Method, steps: list[Step | None], fixed: list[bool]) -> list[Step | None]:
    """A result of a functional kernel (or a view of one) is dropped after the last step that
    reads it, as eager frees a tensor when its last reference goes: without this a call would
    hold every intermediate of the model until it returns."""
    keep = set(method.inputs) | set(method.outputs) | {v for mb in method.mutable_buffers for v in (mb.value, mb.update)}
    last: dict[int, int] = {}
    for i, s in enumerate(steps):
        if s is not None:
            for v in s.reads | s.writes:
                last[v] = i
    release: dict[int, list[int]] = {}
    for v, i in last.items():
        value = method.values[v]
        if v not in keep and not fixed[v] and isinstance(value, TensorValue) and value.storage in ("runtime", "view"):
            release.setdefault(i, []).append(v)
    return [dataclasses.replace(s, release=tuple(release[i])) if s is not None and i in release else s
            for i, s in enumerate(steps)]


def fix_lists(method: Method, slots: list, fixed: list) -> None:
    """A list constant whose members are all fixed is built once."""
    for vid, v in enumerate(method.values):
        if isinstance(v, ConstValue) and v.kind in LIST_KINDS and not fixed[vid] and all(
                x is None or fixed[x] for x in v.value):  # type: ignore[attr-defined]
            slots[vid] = [None if x is None else slots[x] for x in v.value]  # type: ignore[attr-defined]
            fixed[vid] = True


def call_io(m: Method, memory: Memory, fixed: list[bool], fresh_shapes: dict[int, tuple]) -> CallIO:
    def mode(vid: int) -> str:
        v = m.values[vid]
        if not isinstance(v, TensorValue):  # a size passed into a delegate
            return "bind"
        if fixed[vid] and vid not in memory.staged_inputs and v.storage != "planned":
            return "fixed"
        if v.storage == "planned":
            return "copy" if fixed[vid] else "bind"
        return "stage" if vid in memory.staged_inputs and fixed[vid] else "bind"

    passthrough = tuple((i, memory.staged_inputs[vid]) for i, vid in enumerate(m.outputs) if vid in memory.staged_inputs)
    fresh = tuple((vid, at_shape(v, fresh_shapes.get(vid))) for vid, v in enumerate(m.values)
                  if isinstance(v, TensorValue) and v.storage == "output" and not fixed[vid])
    owned = {i for i, vid in enumerate(m.outputs)
             if not fixed[vid] and isinstance(m.values[vid], TensorValue) and m.tensor(vid).storage in ("output", "input")}
    constant = {i for i, vid in enumerate(m.outputs)
                if isinstance(m.values[vid], TensorValue) and root_storage(m.values, vid) == "constant"
                and m.tensor(vid).device.is_cpu}
    return CallIO(
        inputs=tuple((vid, mode(vid)) for vid in m.inputs),
        fresh_outputs=fresh,
        transient=tuple(vid for vid, f in enumerate(fixed) if not f),
        caller_owned=frozenset(owned | {i for i, _ in passthrough}),
        constant_outputs=frozenset(constant),
        passthrough=passthrough,
        runtime_outputs={i: vid for i, vid in enumerate(m.outputs)
                         if isinstance(m.values[vid], TensorValue) and m.tensor(vid).storage == "runtime"},
    )


def at_shape(v: TensorValue, shape_strides) -> TensorValue:
    """`v` at one call's shape (a fresh output is then made at its real size, never resized)."""
    if shape_strides is None:
        return v
    shape, strides = shape_strides
    return dataclasses.replace(v, shape=tuple(shape), strides=tuple(strides), dynamic=())


def members(m: Method, vid: int) -> list[int]:
    """The tensor ids a list constant stands for (none for anything else)."""
    v = m.values[vid]
    if isinstance(v, ConstValue) and v.kind in LIST_KINDS:
        return [x for x in v.value if x is not None]  # type: ignore[attr-defined]
    return []
