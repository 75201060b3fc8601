"""Value lifetimes over a method's instructions: what memory planning and its picture share."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from ferry.program.schema import DEFAULT_ARG, ConstValue, Method, TensorValue, memory_owner


def tensor_ids(method: Method, vid: int) -> list[int]:
    """The tensor value ids an argument id stands for (a list constant stands for its members)."""
    if vid == DEFAULT_ARG or not 0 <= vid < len(method.values):
        return []
    v = method.values[vid]
    if isinstance(v, TensorValue):
        return [vid]
    if isinstance(v, ConstValue) and v.kind in ("tensors", "opt_tensors"):
        members = cast("Iterable[object]", v.value or ())  # a list or tuple once types are checked
        return [x for x in members if isinstance(x, int) and not isinstance(x, bool)
                and 0 <= x < len(method.values) and isinstance(method.values[x], TensorValue)]
    return []


def _host_ends_of_device_copies(method: Method) -> list[int]:
    from ferry.ops import COPY_KERNELS  # (ops registers torch operators: imported when needed)

    host, devices = [], set()
    for ins in method.instructions:
        if getattr(ins, "kernel", None) in COPY_KERNELS and ins.args and ins.outputs:
            ends = [t for a in (ins.args[0], ins.outputs[0]) for t in tensor_ids(method, a)]
            where = [method.tensor(t).device for t in ends]
            if any(d.is_cpu for d in where) and any(not d.is_cpu for d in where):
                host += [t for t, d in zip(ends, where) if d.is_cpu]
                devices |= {d for d in where if not d.is_cpu}
    return host if len(devices) > 1 else []


def value_lifetimes(method: Method) -> dict[int, tuple[int, int]]:
    """(first, last) instruction index of every tensor value that owns memory (not a view).

    A value starts at the instruction that defines it; a method input or a mutable buffer at -1.
    It ends at the last instruction that reads it, or one of its views; a method output or a
    mutable buffer lives to len(instructions). So does host memory a copy to or from a device
    touches when copies of two devices touch host memory: a copy runs asynchronously on its
    device's streams, and the other device's copy, later in program order but on other streams,
    could reuse the bytes before it has run (only the end of the call orders them for certain;
    one device's copies are ordered among themselves)."""
    n = len(method.instructions)
    start: dict[int, int] = {}
    end: dict[int, int] = {}

    def touch(vid: int, i: int) -> None:
        for t in tensor_ids(method, vid):
            r = memory_owner(method.values, t)
            end[r] = max(end.get(r, i), i)

    for i, ins in enumerate(method.instructions):
        for s in getattr(ins, "scratch", ()):  # a delegate's working memory: only while it runs
            start.setdefault(s, i)
            touch(s, i)
        for a in ins.args:
            touch(a, i)
        for o in ins.outputs:
            for t in tensor_ids(method, o):
                start.setdefault(t, i)
            touch(o, i)
    for vid in method.outputs:
        touch(vid, n)
    for vid in _host_ends_of_device_copies(method):
        touch(vid, n)
    mutable = {mb.value for mb in method.mutable_buffers}
    for mb in method.mutable_buffers:
        touch(mb.update, n)
    inputs = set(method.inputs)
    out = {}
    for vid, v in enumerate(method.values):
        if not isinstance(v, TensorValue) or v.alias_of is not None:
            continue
        if vid in mutable:
            out[vid] = (-1, n)
        elif vid in inputs:
            out[vid] = (-1, end.get(vid, -1))
        else:
            s = start.get(vid, -1)
            out[vid] = (s, max(end.get(vid, s), s))
    return out
