"""Semantic checks of a program: everything the file's types alone cannot say.

Value ids in range and of the right kind, planned tensors inside their buffer and on its
device, constants the size of their segment, alias chains that end, and each tensor's
storage agreeing with its plan, constant and alias. Runs on every load and save;
`validate_program` is also public for programs built in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from ferry.errors import ProgramError
from ferry.layout import is_dense
from ferry.program import codec, fields, guards
from ferry.program.dataflow import check_dataflow
from ferry.program.schema import (
    CONST_KIND_TABLE,
    DEFAULT_ARG,
    ConstValue,
    DelegateCall,
    Method,
    TensorValue,
    element_size,
)
from ferry.program.signature import check_signature
from ferry.program.states import program_states

__all__ = ["validate_program", "check_types", "check_semantics"]


def segment_size(seg: object, i: int) -> int:
    try:
        with memoryview(seg) as mv:  # type: ignore[arg-type]
            return mv.nbytes
    except TypeError:
        raise ProgramError(
            f"segment {i} must be bytes-like (bytes, bytearray, memoryview), got {type(seg).__name__}"
        ) from None


def validate_program(program: object) -> None:
    """Check that `program` is well formed; raise ProgramError naming the first problem."""
    check_types(program)
    check_semantics(program)


def check_types(program: object) -> None:
    """Every record has the types the file format describes (program/codec.py)."""
    if not all(hasattr(program, a) for a in ("methods", "delegates", "segments")):
        raise ProgramError(f"expected a ferry Program, got {type(program).__name__}")
    fields.Seq(codec.ANY).check(program.segments, "program segments")  # type: ignore[attr-defined]
    fields.Seq(codec.DELEGATE).check(program.delegates, "program delegates")  # type: ignore[attr-defined]
    methods = program.methods  # type: ignore[attr-defined]
    if not isinstance(methods, dict):
        raise ProgramError(f"program methods must be a dict of name -> Method, got {type(methods).__name__}")
    for key, m in methods.items():
        fields.Str(nonempty=True).check(key, "method name")
        codec.METHOD.check(m, f"method {key!r}")
        if m.name != key:
            raise ProgramError(f"method stored under {key!r} is named {fields.show(m.name)}")


def check_semantics(program) -> None:
    """Cross references, sizes and storage facts (types already checked)."""
    seg_sizes = [segment_size(s, i) for i, s in enumerate(program.segments)]
    for i, d in enumerate(program.delegates):
        if d.payload >= len(seg_sizes):
            raise ProgramError(
                f"delegate {i} ({d.backend_id}): payload segment {d.payload} is out of range "
                f"(program has {len(seg_sizes)} segments)"
            )
    for m in program.methods.values():
        _MethodChecks(m, seg_sizes, len(program.delegates)).run()
    program_states(program.methods)


class _MethodChecks:
    def __init__(self, m: Method, seg_sizes: list[int], n_delegates: int):
        self.m, self.seg_sizes, self.n_delegates = m, seg_sizes, n_delegates
        self.pre = f"method {m.name!r}"
        self.n = len(m.values)

    def run(self) -> None:
        m = self.m
        if not m.buffers:
            raise ProgramError(f"{self.pre} has no buffers; buffer 0 (reserved for constants) must exist")
        for b, buf in enumerate(m.buffers):
            fields.Int(1).check(buf.alignment, f"{self.pre} buffer {b} alignment")
            if buf.alignment & (buf.alignment - 1):
                raise ProgramError(f"{self.pre} buffer {b} alignment {buf.alignment} is not a power of two")
        for i, v in enumerate(m.values):
            if isinstance(v, TensorValue):
                self.tensor(v, i)
            else:
                self.const(v, i)
        self.aliases_end()
        for i, v in enumerate(m.values):
            if isinstance(v, TensorValue):
                self.storage(v, f"{self.pre} value {i}")
        self.instructions()
        for j, x in enumerate(m.inputs):
            self.vid(x, f"input {j}")
        for j, x in enumerate(m.outputs):
            self.vid(x, f"output {j}")
        for x in m.storage_inputs:
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < len(m.inputs):
                raise ProgramError(f"{self.pre} storage_inputs names input {x!r}; it has {len(m.inputs)} inputs")
        self.equal_sizes()
        self.size_minimums()
        self.derived_sizes()
        self.input_guards()
        self.input_writes()
        self.io_storage()
        if m.signature is not None:
            check_signature(m.signature, len(m.inputs), len(m.returned_outputs), self.pre)
        for kind, ids in (("value", [mb.value for mb in m.mutable_buffers]),
                          ("update", [mb.update for mb in m.mutable_buffers if not mb.read_only])):
            if len(set(ids)) != len(ids):
                raise ProgramError(f"{self.pre} two mutable buffers share one {kind}: a state is held under one name")
        for j, mb in enumerate(m.mutable_buffers):
            self.tensor_id(mb.value, f"mutable buffer {j} value")
            self.tensor_id(mb.update, f"mutable buffer {j} update")
            if m.tensor(mb.value).storage not in ("state", "planned"):  # written back: never the file or the caller
                raise ProgramError(f"{self.pre} mutable buffer {j}: its value {mb.value} must be the program's state "
                                   f"(or planned memory), not {m.tensor(mb.value).storage!r}")
            if m.tensor(mb.value).storage == "state" and m.tensor(mb.value).constant is None:
                raise ProgramError(f"{self.pre} mutable buffer {j}: its value {mb.value} is the program's state and "
                                   "needs a constant segment (its initial value)")
            update = m.tensor(mb.update)
            if mb.read_only:  # state this method reads and another method updates
                if update.storage != "state":
                    raise ProgramError(f"{self.pre} mutable buffer {j}: its update is its value, which only the "
                                       "program's state may be (read here, updated by another method)")
            elif update.storage == "state" and (m.tensor(mb.value).storage != "state" or update.constant is not None):
                raise ProgramError(f"{self.pre} mutable buffer {j}: its update {mb.update} is stored as the state, so "
                                   "its value must be the state and the update has no segment of its own")
        states = {mb.value for mb in m.mutable_buffers} | {mb.update for mb in m.mutable_buffers}
        for i, v in enumerate(m.values):
            if isinstance(v, TensorValue) and v.storage == "state" and i not in states:
                raise ProgramError(f"{self.pre} value {i}: storage 'state' but no mutable buffer holds it")
        check_dataflow(m)

    # ---- ids

    def vid(self, x: int, what: str, allow_default: bool = False) -> int:
        lo = DEFAULT_ARG if allow_default else 0
        if not lo <= x < self.n:
            raise ProgramError(f"{self.pre} {what}: value id {fields.show(x)} is out of range (method has {self.n} values)")
        return x

    def tensor_id(self, x: int, what: str) -> int:
        i = self.vid(x, what)
        if not isinstance(self.m.values[i], TensorValue):
            raise ProgramError(f"{self.pre} {what}: value {i} is not a tensor")
        return i

    def int_id(self, x: int, what: str) -> int:
        i = self.vid(x, what)
        v = self.m.values[i]
        if not (isinstance(v, ConstValue) and v.kind in ("int", "symint")):
            raise ProgramError(f"{self.pre} {what}: value {i} is not an int or a symint")
        return i

    # ---- values

    def tensor(self, v: TensorValue, i: int) -> None:
        what = f"{self.pre} value {i}"
        nbytes = v.nbytes
        if v.dynamic and len(v.dynamic) != len(v.shape):
            raise ProgramError(f"{what}: dynamic has {len(v.dynamic)} flags for a shape of {len(v.shape)} dimensions")
        if v.strides and not is_dense(v.shape, v.strides):
            raise ProgramError(f"{what}: strides {v.strides} do not lay out shape {list(v.shape)} densely")
        if v.plan is not None:
            b, off = v.plan.buffer, v.plan.offset
            if b >= len(self.m.buffers):
                raise ProgramError(f"{what}: plan buffer {b} is out of range (method has {len(self.m.buffers)} buffers)")
            buf = self.m.buffers[b]
            if off + nbytes > buf.size:
                raise ProgramError(f"{what}: plan offset {off} + {nbytes} bytes exceeds buffer {b} size {buf.size}")
            if buf.device != v.device:
                raise ProgramError(f"{what}: tensor on {v.device} is planned in buffer {b} on {buf.device}")
            if off % element_size(v.dtype):
                raise ProgramError(f"{what}: plan offset {off} is not a multiple of the {v.dtype} element size")
        if v.constant is not None:
            c = v.constant
            if c >= len(self.seg_sizes):
                raise ProgramError(f"{what}: constant segment {c} is out of range (program has {len(self.seg_sizes)} segments)")
            if self.seg_sizes[c] != nbytes:
                raise ProgramError(
                    f"{what}: constant segment {c} has {self.seg_sizes[c]} bytes but the tensor "
                    f"({v.dtype}{list(v.shape)}) needs {nbytes}"
                )
        if v.alias_of is not None:
            a = self.vid(v.alias_of, f"value {i} alias_of")
            if a == i:
                raise ProgramError(f"{what} is an alias of itself")
            if not isinstance(self.m.values[a], TensorValue):
                raise ProgramError(f"{what} is an alias of value {a}, which is not a tensor")

    def storage(self, v: TensorValue, what: str) -> None:
        """The storage kind agrees with the plan, the constant and the alias."""
        s = v.storage
        facts = [("planned", v.plan is not None, "a plan entry"), ("view", v.alias_of is not None, "alias_of")]
        for kind, has, field in facts:
            if (s == kind) != has:
                raise ProgramError(f"{what}: storage {s!r} {'needs' if s == kind else 'cannot have'} {field}")
        needs = s == "constant"  # (a mutable buffer's value, storage 'state', has its initial value: checked above)
        if needs != (v.constant is not None) and s not in ("planned", "state"):
            raise ProgramError(f"{what}: storage {s!r} {'needs' if needs else 'cannot have'} a constant segment")

    def const(self, c: ConstValue, i: int) -> None:
        refs = CONST_KIND_TABLE[c.kind].refs
        if refs is None:
            return
        # check_types made it a list of ids (None only in opt_tensors, skipped below)
        for j, x in enumerate(cast("Sequence[int]", c.value)):
            what = f"value {i} ({c.kind})[{j}]"
            if refs == "tensor" or (refs == "opt_tensor" and x is not None):
                self.tensor_id(x, what)
            elif refs == "int":
                self.int_id(x, what)

    def aliases_end(self) -> None:
        """A view names the value that owns its memory, never another view: lifetimes, planning
        and the in-place check follow one step (emit writes them so)."""
        for i, v in enumerate(self.m.values):
            if isinstance(v, TensorValue) and v.alias_of is not None:
                base = self.m.values[v.alias_of]
                if not isinstance(base, TensorValue) or base.alias_of is not None or v.alias_of == i:
                    raise ProgramError(f"{self.pre} value {i} is a view of value {v.alias_of}, which does not own "
                                       "memory: a view names the value whose memory it is")

    def instructions(self) -> None:
        for k, ins in enumerate(self.m.instructions):
            if isinstance(ins, DelegateCall):
                if ins.delegate >= self.n_delegates:
                    raise ProgramError(
                        f"{self.pre} instruction {k}: delegate {ins.delegate} is out of range "
                        f"(program has {self.n_delegates} delegates)"
                    )
                label = f"instruction {k} (delegate {ins.delegate})"
                for j, s in enumerate(ins.scratch):
                    v = self.m.values[self.tensor_id(s, f"{label} scratch {j}")]
                    if not (isinstance(v, TensorValue) and v.storage == "planned" and v.dtype == "uint8" and len(v.shape) == 1):
                        raise ProgramError(f"{self.pre} {label} scratch {j}: value {s} must be a planned 1-D uint8 tensor")
            else:
                label = f"instruction {k} ({ins.kernel})"
            for j, a in enumerate(ins.args):
                self.vid(a, f"{label} argument {j}", allow_default=not isinstance(ins, DelegateCall))
            for j, o in enumerate(ins.outputs):
                self.vid(o, f"{label} output {j}")

    def input_writes(self) -> None:
        """Each input written at most once, from its own output, of the input's dtype, rank,
        static sizes and device: the write is a copy on one device, never a hidden transfer."""
        m, ins, outs = self.m, set(), set()
        for j, w in enumerate(m.input_writes):
            what = f"{self.pre} input write {j}"
            if not (w.output < len(m.outputs) and w.input < len(m.inputs)):
                raise ProgramError(f"{what} names output {w.output} and input {w.input}; the method has "
                                   f"{len(m.outputs)} outputs and {len(m.inputs)} inputs")
            if w.input in ins or w.output in outs:
                raise ProgramError(f"{what}: input {w.input} or output {w.output} is in an earlier write too")
            ins.add(w.input)
            outs.add(w.output)
            x, o = m.values[m.inputs[w.input]], m.values[m.outputs[w.output]]
            if not (isinstance(x, TensorValue) and isinstance(o, TensorValue)):
                raise ProgramError(f"{what}: input {w.input} and output {w.output} must both be tensors")
            dx, do = x.dynamic or (False,) * len(x.shape), o.dynamic or (False,) * len(o.shape)
            sizes_differ = len(x.shape) != len(o.shape) or dx != do or any(
                a != b for a, b, d in zip(x.shape, o.shape, dx) if not d)  # (dynamic dims: checked per call)
            if x.dtype != o.dtype or sizes_differ or x.device != o.device:
                raise ProgramError(f"{what}: output {w.output} ({o.dtype}{list(o.shape)} on {o.device}) cannot be "
                                   f"written into input {w.input} ({x.dtype}{list(x.shape)} on {x.device})")

    def equal_sizes(self) -> None:
        """Each [input, dim] of `equal_sizes` names a dynamic dim of a tensor input, or an int input (dim -1)."""
        for group in self.m.equal_sizes:
            for pair in group:
                if not (len(pair) == 2 and self._dynamic_size(*pair)):
                    raise ProgramError(f"{self.pre} equal_sizes names {pair!r}, not a dynamic dim of a tensor input "
                                       "or an int input")

    def size_minimums(self) -> None:
        """Each [input, dim, minimum] of `size_minimums` names a dynamic dim of a tensor input, or an
        int input (dim -1), and a minimum no larger than its bound."""
        m = self.m
        for entry in m.size_minimums:
            if not (len(entry) == 3 and self._dynamic_size(entry[0], entry[1])):
                raise ProgramError(f"{self.pre} size_minimums names {entry!r}, not a dynamic size of an input")
            v = m.values[m.inputs[entry[0]]]
            bound = v.shape[entry[1]] if isinstance(v, TensorValue) else cast(int, v.value)  # (an int input)
            if not 0 <= entry[2] <= bound:
                raise ProgramError(f"{self.pre} size_minimums gives {entry!r} a minimum outside 0..{bound}, its bound")

    def _dynamic_size(self, i: int, d: int) -> bool:
        """Input `i`'s dim `d` is dynamic (dim -1: input `i` is an int input)."""
        m = self.m
        v = m.values[m.inputs[i]] if 0 <= i < len(m.inputs) else None
        return (isinstance(v, TensorValue) and 0 <= d < len(v.dynamic) and bool(v.dynamic[d])
                or isinstance(v, ConstValue) and v.kind == "symint" and d == -1)

    def derived_sizes(self) -> None:
        """Each [input, dim, a, b, root input, root dim] of `derived_sizes` names a dynamic dim of a
        tensor input, a >= 1, and a root that is a dynamic size of an input, or none (-1)."""
        for entry in self.m.derived_sizes:
            ok = len(entry) == 6 and entry[1] >= 0 and self._dynamic_size(entry[0], entry[1]) and entry[2] >= 1
            if not ok or not (entry[4] == -1 or self._dynamic_size(entry[4], entry[5])):
                raise ProgramError(f"{self.pre} derived_sizes names {entry!r}: not a dynamic dim of a tensor input "
                                   "as a multiple (>= 1) of a size plus an offset, of an input's size or none (-1)")

    def input_guards(self) -> None:
        """Each of `input_guards` is of ferry's guard language, and reads only dynamic sizes of the
        method's inputs."""
        for text in self.m.input_guards:
            try:
                tree = guards.parse(text)
            except guards.GuardError as e:
                raise ProgramError(f"{self.pre} input_guards: {e}") from None
            bad = [leaf for leaf in guards.leaves(tree) if not self._dynamic_size(*leaf)]
            if bad:
                raise ProgramError(f"{self.pre} input guard {text!r} reads {bad[0]!r}, not a dynamic dim of a tensor "
                                   "input or an int input")

    def io_storage(self) -> None:
        """Caller-owned inputs are method inputs: nothing else could fill them."""
        inputs = set(self.m.inputs)
        for i, v in enumerate(self.m.values):
            if isinstance(v, TensorValue) and v.storage == "input" and i not in inputs:
                raise ProgramError(f"{self.pre} value {i}: storage 'input' but it is not a method input")
        for j, x in enumerate(self.m.inputs):
            v = self.m.values[x]
            if isinstance(v, TensorValue) and v.storage not in ("input", "planned"):
                raise ProgramError(f"{self.pre} input {j} (value {x}) has storage {v.storage!r}; "
                                   "inputs are 'input' or 'planned'")
