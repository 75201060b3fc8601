"""The program's state: the mutable buffers of its methods (a KV cache), one per name.

Methods compiled together from one model share every mutable buffer of the same name, as the
model's methods do in eager: one tensor, held by the module, updated in place by whichever
method runs. This module reads them from a program and checks that every method naming a state
agrees on it (its dtype, shape, layout, device and initial value), so the module can hold one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.errors import ProgramError
from ferry.program.schema import Method, TensorValue

__all__ = ["State", "method_states", "program_states"]


@dataclass(frozen=True)
class State:
    """One mutable buffer of the program: what it is, and which methods read and update it."""

    name: str
    value: TensorValue
    methods: tuple[str, ...]  # every method holding it
    updated_by: tuple[str, ...] = ()  # those that write it (the others only read it)

    @property
    def nbytes(self) -> int:
        return self.value.nbytes


def method_states(method: Method) -> dict[int, str]:
    """value id -> state name, for the values of `method` that are the program's state: a mutable
    buffer's value, and its update where a delegate writes that over the state in place."""
    out: dict[int, str] = {}
    for mb in method.mutable_buffers:
        v = method.values[mb.value]
        if isinstance(v, TensorValue) and v.storage == "state":
            if not mb.name or mb.name in out.values():
                raise ProgramError(f"method {method.name!r}: mutable buffer of value {mb.value} needs a name of its own "
                                   f"(got {mb.name!r}): the program's state is shared by name")
            out[mb.value] = mb.name
    for mb in method.mutable_buffers:
        u = method.values[mb.update]
        if isinstance(u, TensorValue) and u.storage == "state" and mb.value in out and mb.update not in out:
            out[mb.update] = mb.name
    return out


def _fact(v: TensorValue) -> tuple:
    return v.dtype, tuple(v.shape), v.layout_strides, v.device, v.constant, any(v.dynamic)


def program_states(methods) -> dict[str, State]:
    """name -> State over `methods` (a program's methods dict); ProgramError where two methods
    disagree on a state of the same name."""
    states: dict[str, State] = {}
    for m in methods.values():
        values = {mb.value for mb in m.mutable_buffers}
        writes = {mb.value for mb in m.mutable_buffers if not mb.read_only}
        for vid, name in method_states(m).items():
            if vid not in values:
                continue  # an update written over its state: validate.py checks it agrees with the state
            v = m.tensor(vid)
            if any(v.dynamic):
                raise ProgramError(f"method {m.name!r}: state {name!r} has a dynamic shape; a state is held at one size")
            prior = states.get(name)
            mine = (m.name,) if vid in writes else ()
            if prior is None:
                states[name] = State(name, v, (m.name,), mine)
                continue
            if _fact(prior.value) != _fact(v):
                raise ProgramError(
                    f"state {name!r} is {_show(prior.value)} in method {prior.methods[0]!r} but {_show(v)} in method "
                    f"{m.name!r}: methods share a state by name, so they must agree on it (compile them together from "
                    "one model object, and place that buffer on one device for all)")
            states[name] = State(name, prior.value, (*prior.methods, m.name), (*prior.updated_by, *mine))
    return states


def _show(v: TensorValue) -> str:
    laid = f" laid out with strides {list(v.strides)}" if v.strides else ""
    return f"a {v.dtype}{list(v.shape)} tensor{laid} on {v.device} (initial value: segment {v.constant})"
