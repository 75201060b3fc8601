"""Bind: every instruction of a loaded method becomes an immutable Step.

A Step says what the scheduler needs — its kind, the devices it touches, whether it touches
host memory while doing so, whether it can be captured in a graph — and carries the call,
with every argument that is fixed at load already resolved (a functools.partial over planned
tensors, a copy bound to precomputed byte views). Views of fixed memory are made here, once,
and need no step. Binding reads the program's storage facts and the loaded slots; it never
changes the loaded memory: re-binding (a delegate's planned inputs and outputs, given once)
returns a new Bound with its own frame.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ferry.device import Device
from ferry.errors import BackendError, InputError, ProgramError
from ferry.layout import same_strides
from ferry.op_names import resolve_kernel
from ferry.ops import OUT_COPY_KERNELS
from ferry.ops.aliasing import STORAGE_OFFSET_AT, composite_results, returns_inputs
from ferry.ops.variants import functional_variant, has_device_kernel
from ferry.program.lifetimes import tensor_ids
from ferry.program.ranks import RECV, SEND
from ferry.program.schema import (
    DEFAULT_ARG,
    LIST_KINDS,
    ConstValue,
    DelegateCall,
    KernelCall,
    Method,
    TensorValue,
    memory_owner,
    root_storage,
)
from ferry.runtime.choices import attention as attention_choice
from ferry.runtime.choices import conv as conv_choice
from ferry.runtime.choices.gemm import biased_gemm
from ferry.runtime.choices.timing import captured_plan, in_captured_plan
from ferry.runtime.stages.kernels import CopyKernel, _to_meta, bind_aten, check_call, fast_aten, fast_functional, returns_list
from ferry.runtime.stages.load import Memory

__all__ = ["Bound", "CallIO", "Step", "bind_method"]

# kernels of the sizes arithmetic torch.export records with Python operators
SYM_OPS = {
    "ferry::sym_add": operator.add, "ferry::sym_sub": operator.sub, "ferry::sym_mul": operator.mul,
    "ferry::sym_floordiv": operator.floordiv, "ferry::sym_mod": operator.mod, "ferry::sym_neg": operator.neg,
}


@dataclass(frozen=True)
class Step:
    """One instruction, ready to run.

    devices:       the non-CPU devices it touches (empty for host work)
    touches_host:  it moves data between host memory and a device (a copy with a CPU end)
    capturable:    its host memory is page-locked (and it is device work a graph can hold)
    check:         run after the first call: the kernel kept its planned output shapes
    reads:         values of this call (not fixed at load) it reads or writes into
    writes:        values of this call it produces (a functional kernel's results, views of them)
    makes:         fresh outputs (made for the caller each call) the step allocates itself: a
                   delegate that makes them as late as its own plan allows

    A graph may capture a run of steps when every value of the call they read is produced
    earlier in that run: every address they touch is then fixed at load or by the capture.
    """

    index: int
    kind: str  # "kernel" | "copy" | "delegate" | "size" | "writeback"
    name: str
    devices: tuple[Device, ...]
    touches_host: bool
    capturable: bool
    call: Callable[[], object]
    check: Callable[[], None] | None = None
    reads: frozenset[int] = frozenset()
    writes: frozenset[int] = frozenset()
    release: tuple[int, ...] = ()  # values of the call no later step reads: dropped right after
    makes: frozenset[int] = frozenset()  # outputs made for the caller that this step allocates itself

    @property
    def label(self) -> str:
        return f"#{self.index} {self.name}" if self.index >= 0 else self.name


@dataclass(frozen=True)
class CallIO:
    """How a call meets the caller's tensors.

    inputs:          (value id, mode) per input: 'copy' into planned memory, 'stage' into a
                     fixed device tensor, 'bind' the caller's tensor, 'fixed' (bound once)
    fresh_outputs:   (value id, tensor value) of outputs made for the caller each call
    transient:       slots cleared after each call (the caller's memory is not kept alive)
    caller_owned:    output positions the caller owns without a copy
    constant_outputs: output positions that are (views of) host constants
    passthrough:     (output position, input position): a staged input handed straight back
    runtime_outputs: output position -> value id of outputs a functional kernel makes each call
    """

    inputs: tuple[tuple[int, str], ...]
    fresh_outputs: tuple[tuple[int, TensorValue], ...]
    transient: tuple[int, ...]
    caller_owned: frozenset[int]
    constant_outputs: frozenset[int]
    passthrough: tuple[tuple[int, int], ...]
    runtime_outputs: dict[int, int]


@dataclass(frozen=True)
class Bound:
    """A bound method: its steps (None for work done at bind time), the frame of slots a call
    reads and writes, and how a call meets the caller's tensors."""

    steps: tuple[Step | None, ...]
    slots: list
    fixed: tuple[bool, ...]
    io: CallIO


def bind_method(method: Method, memory: Memory, *, delegate, streams=None, page_locked=None,
                io: dict[int, torch.Tensor] | None = None, per_call: frozenset[int] = frozenset(),
                shapes: dict[int, object] | None = None, transport=None, measure: bool = False,
                captured: bool = False) -> Bound:
    """Bind every instruction. `delegate(i)` gives delegate i's handle; `streams` (a CopyStreams)
    issues copies on an asynchronous device; `io` fixes more slots (a delegate's planned I/O);
    `per_call`: planned inputs and outputs the caller's tensors stand in for on each call
    (micro-batches: a part's rows of the caller's batch and of the joined result); `shapes`:
    the sizes and the (shape, strides) of every dynamic value at one shape of the call, as
    `record_shapes` took them from a call at that shape: the method is then bound as a static
    one (views of its planned memory at those shapes, sizes as constants). `transport` runs the
    copies between ranks of a program split over processes (runtime/parallel/transport.py). `measure`:
    the method is loading, so kernels chosen by timing (runtime/choices/gemm.py) may be timed now;
    a plan bound during a call uses only what was timed before. `captured`: the plan runs as CUDA
    graphs, so kernels that are faster on the GPU but launch more (runtime/choices/attention.py,
    conv_choice.py) may be chosen; the delegates bound meanwhile inherit it (False: as the plan
    being bound around this one, if any). A step whose segment is not captured after all (a
    capture that failed, a host sync beside it) runs the chosen form eagerly: right, not faster."""
    with captured_plan(captured, streams):
        return _bind_method(method, memory, delegate, streams, page_locked, io, per_call, shapes, transport, measure)


def _bind_method(method, memory, delegate, streams, page_locked, io, per_call, shapes, transport, measure) -> Bound:
    slots, fixed = list(memory.slots), list(memory.fixed)
    for vid, t in (io or {}).items():
        slots[vid], fixed[vid] = t, True
    for vid in per_call:
        slots[vid], fixed[vid] = None, False
    fresh_shapes = _fix_shapes(method, slots, fixed, shapes) if shapes is not None else _own_dynamic(method, slots, fixed)
    _fix_lists(method, slots, fixed)
    b = _Binder(method, slots, fixed, delegate, streams, page_locked or (lambda t: t.is_pinned()), shapes, transport,
                measure, in_captured_plan())
    steps = [b.instruction(i, ins) for i, ins in enumerate(method.instructions)]
    steps += b.writebacks()
    return Bound(tuple(_with_releases(method, steps, fixed)), slots, tuple(fixed),
                 _call_io(method, memory, fixed, fresh_shapes))


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


def _fix_shapes(method: Method, slots: list, fixed: list, shapes: dict[int, Any]) -> dict[int, tuple]:
    """Fix the dynamic values at one call's shapes; returns the shapes of fresh outputs."""
    fresh: dict[int, tuple] = {}
    changed: set[int] = set()
    for vid, s in shapes.items():
        v = method.values[vid]
        if isinstance(v, ConstValue):
            slots[vid], fixed[vid] = s, True
        elif v.storage == "output":
            fresh[vid] = s  # type: ignore[assignment]
        elif fixed[vid] and v.storage == "planned":  # a view of its memory at this shape (within the bound)
            base, (size, stride) = slots[vid], s
            slots[vid] = base.as_strided(size, stride, base.storage_offset())
            changed.add(vid)
    _rebuild_lists(method, slots, fixed, changed)
    return fresh


def _own_dynamic(method: Method, slots: list, fixed: list) -> dict:
    """A plan bound for any size sizes its dynamic planned tensors each call (resizing them in
    place): it gets tensor objects of its own over their memory, so the sizes one call leaves
    behind never reach another plan (one bound at a shape, which reads the memory at its own
    sizes), and lists holding them are built again over its own. Returns no fresh shapes."""
    mine = set()
    for vid, v in enumerate(method.values):
        if isinstance(v, TensorValue) and any(v.dynamic) and fixed[vid] and isinstance(t := slots[vid], torch.Tensor):
            slots[vid] = t.as_strided(t.size(), t.stride(), t.storage_offset())
            mine.add(vid)
    _rebuild_lists(method, slots, fixed, mine)
    return {}


def _rebuild_lists(method: Method, slots: list, fixed: list, changed: set[int]) -> None:
    """Lists built at load over members whose tensor objects were replaced: built again."""
    if not changed:
        return
    for vid, v in enumerate(method.values):
        if isinstance(v, ConstValue) and v.kind in LIST_KINDS and fixed[vid] and changed.intersection(
                x for x in v.value if x is not None):  # type: ignore[attr-defined]
            slots[vid] = [None if x is None else slots[x] for x in v.value]  # type: ignore[attr-defined]


def _compact(t: torch.Tensor) -> None:
    """Lay `t` out contiguously over its own memory (a copy through a temporary)."""
    values = t.clone(memory_format=torch.contiguous_format)
    t.as_strided_(values.shape, values.stride(), t.storage_offset()).copy_(values)


def _with_releases(method: Method, steps: list[Step | None], fixed: list[bool]) -> list[Step | None]:
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


def _fix_lists(method: Method, slots: list, fixed: list) -> None:
    """A list constant whose members are all fixed is built once."""
    for vid, v in enumerate(method.values):
        if isinstance(v, ConstValue) and v.kind in LIST_KINDS and not fixed[vid] and all(
                x is None or fixed[x] for x in v.value):  # type: ignore[attr-defined]
            slots[vid] = [None if x is None else slots[x] for x in v.value]  # type: ignore[attr-defined]
            fixed[vid] = True


def _call_io(m: Method, memory: Memory, fixed: list[bool], fresh_shapes: dict[int, tuple]) -> CallIO:
    def mode(vid: int) -> str:
        v = m.values[vid]
        if not isinstance(v, TensorValue):  # a size passed into a delegate
            return "bind"
        if fixed[vid] and vid not in memory.staged_inputs and v.storage != "planned":
            return "fixed"
        if v.storage == "planned":
            return "copy" if fixed[vid] else "bind"
        return "stage" if vid in memory.staged_inputs else "bind"

    passthrough = tuple((i, memory.staged_inputs[vid]) for i, vid in enumerate(m.outputs) if vid in memory.staged_inputs)
    fresh = tuple((vid, _at(v, fresh_shapes.get(vid))) for vid, v in enumerate(m.values)
                  if isinstance(v, TensorValue) and v.storage == "output" and not fixed[vid])
    owned = {i for i, vid in enumerate(m.outputs)
             if not fixed[vid] and isinstance(m.values[vid], TensorValue) and m.tensor(vid).storage in ("output", "input")}
    constant = {i for i, vid in enumerate(m.outputs)
                if root_storage(m.values, vid) == "constant" and m.tensor(vid).device.is_cpu}
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


def _at(v: TensorValue, shape_strides) -> TensorValue:
    """`v` at one call's shape (a fresh output is then made at its real size, never resized)."""
    if shape_strides is None:
        return v
    shape, strides = shape_strides
    return dataclasses.replace(v, shape=tuple(shape), strides=tuple(strides), dynamic=())


def _members(m: Method, vid: int) -> list[int]:
    """The tensor ids a list constant stands for (none for anything else)."""
    v = m.values[vid]
    if isinstance(v, ConstValue) and v.kind in LIST_KINDS:
        return [x for x in v.value if x is not None]  # type: ignore[attr-defined]
    return []


def _device_sync(streams, device: Device) -> Callable[[], None]:
    """The host waits for the work queued on `device` before a transfer touches its memory.
    Nothing to wait for on the CPU, on a device that runs synchronously, or on CUDA: NCCL
    orders its transfer after the current stream, and a staging copy to the host waits."""
    if device.is_cpu or device.type == "cuda" or streams is None or device.type != streams.api.device_type:
        return lambda: None
    synchronize, index = streams.api.synchronize, device.index
    return lambda: synchronize(index)


def _ref(slots, fixed, m: Method, vid: int):
    """('c', value) for what is fixed, ('v', id) for a value of this call, ('l', ids) for a
    list with members of this call (built when the instruction runs)."""
    if fixed[vid]:
        return ("c", slots[vid])
    v = m.values[vid]
    if isinstance(v, ConstValue) and v.kind in LIST_KINDS:
        return ("l", list(v.value))  # type: ignore[call-overload]
    return ("v", vid)


# Views export recorded as legal for the layouts the trace saw on the CPU. A kernel on another
# device may lay its result out differently (CUDA attention does), and `view` would then fail
# where eager, tracing on that device, would have chosen differently. Over a value of the call,
# `reshape` is the same view whenever one is possible and a copy otherwise: the graph is
# functional, so no one can tell the two apart.
LAYOUT_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


class _NoMeta(Exception):
    pass


def _meta_of(m: Method, vid: int, shapes: dict | None = None):
    """A meta tensor (or int) like value `vid`: at its planned shape, or at `shapes`' (one call's)."""
    v = m.values[vid]
    known = shapes.get(vid) if shapes is not None else None
    if isinstance(v, ConstValue) and v.kind in ("int", "symint"):
        return known if known is not None else v.value
    if isinstance(v, TensorValue) and known is not None:
        return torch.empty_strided(known[0], known[1], dtype=v.torch_dtype, device="meta")
    if not isinstance(v, TensorValue) or any(v.dynamic):
        raise _NoMeta()
    if v.strides:
        return torch.empty_strided(v.shape, v.strides, dtype=v.torch_dtype, device="meta")
    return torch.empty(v.shape, dtype=v.torch_dtype, device="meta")


def _first_only(pos, kw):
    """(value id, the other positional values, keywords) when the first positional argument is
    the only one read per call; else None."""
    if not pos or pos[0][0] != "v" or any(r[0] != "c" for r in pos[1:]) or any(r[0] != "c" for r in kw.values()):
        return None
    return pos[0][1], tuple(r[1] for r in pos[1:]), {k: r[1] for k, r in kw.items()}


def _one_value(refs) -> bool:
    """The references are to one value: one id of the call, or one fixed tensor."""
    kinds = {r[0] for r in refs}
    if kinds == {"v"}:
        return len({r[1] for r in refs}) == 1
    return kinds == {"c"} and all(r[1] is refs[0][1] for r in refs) and isinstance(refs[0][1], torch.Tensor)


def _arguments(slots, pos, kw):
    """A function giving (args, kwargs) of this call: what is fixed is bound once, the values of
    the call are read from the slots."""
    template = [r[1] if r[0] == "c" else None for r in pos]
    plain = [(i, r[1]) for i, r in enumerate(pos) if r[0] == "v"]
    lists = [(i, r) for i, r in enumerate(pos) if r[0] == "l"]
    fixed_kw = {k: r[1] for k, r in kw.items() if r[0] == "c"}
    call_kw = [(k, r) for k, r in kw.items() if r[0] != "c"]
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
            a[i] = _resolve(r, slots)
        return a, ({**fixed_kw, **{k: _resolve(r, slots) for k, r in call_kw}} if call_kw else fixed_kw)

    return general


def _resolve(ref, slots):
    kind, x = ref
    if kind == "c":
        return x
    if kind == "v":
        return slots[x]
    return [None if e is None else slots[e] for e in x]


class _Binder:
    def __init__(self, method: Method, slots: list, fixed: list, delegate, streams, page_locked,
                 shapes: dict | None = None, transport=None, measure: bool = False, captured: bool = False):
        self.m, self.slots, self.fixed, self.transport, self.measure = method, slots, fixed, transport, measure
        self.captured = captured
        self.delegate, self.streams, self.page_locked = delegate, streams, page_locked
        self.shapes = shapes  # bound at one call's shapes: every dynamic value's size is known

    def dynamic(self, v: TensorValue) -> bool:
        return any(v.dynamic) and self.shapes is None

    def _fresh(self, vid: int) -> bool:
        """A tensor made for the caller each call (an output it keeps)."""
        v = self.m.values[vid]
        return isinstance(v, TensorValue) and v.storage == "output" and not self.fixed[vid]

    def ref(self, vid: int):
        return _ref(self.slots, self.fixed, self.m, vid)

    def instruction(self, index: int, ins) -> Step | None:
        if not isinstance(ins, DelegateCall) and ins.outputs and all(
                self.fixed[o] and isinstance(self.m.values[o], ConstValue) for o in ins.outputs):
            return None  # a size fixed at bind time (a method bound at one call's shapes)
        if isinstance(ins, DelegateCall):
            return self.delegate_step(index, ins)
        if ins.kernel in OUT_COPY_KERNELS:
            return self.copy_step(index, ins)
        if ins.kernel in SYM_OPS:
            return self.size_step(index, ins)
        if ins.kernel in (SEND, RECV):
            return self.transfer_step(index, ins)
        return self.kernel_step(index, ins)

    def step(self, index: int, kind: str, name: str, ins, call, *, extra_devices=(), check=None) -> Step:
        m = self.m
        devs = {m.tensor(o).device for o in ins.outputs if isinstance(m.values[o], TensorValue)}
        devs |= set(extra_devices)
        args = [t for a in ins.args if a != DEFAULT_ARG for t in [a, *_members(m, a)]]
        reads = frozenset(a for a in args if not self.fixed[a])  # per call: must come from the same segment
        writes = frozenset(o for o in ins.outputs if not self.fixed[o] and o not in ins.args)
        ids = [a for a in args if self.fixed[a]] + [o for o in ins.outputs if self.fixed[o]]
        # a fresh output is made for each call: a replay would hand every call the captured memory
        capturable = kind != "size" and not any(self._fresh(v) for v in reads | writes) and all(
            self.page_locked(self.slots[i]) for i in ids
            if isinstance(m.values[i], TensorValue) and m.tensor(i).device.is_cpu and m.tensor(i).nbytes)
        return Step(index, kind, name, tuple(sorted(d for d in devs if not d.is_cpu)),
                    any(d.is_cpu for d in devs) and any(not d.is_cpu for d in devs), capturable, call, check,
                    reads, writes)

    # ---- delegates

    def delegate_step(self, index: int, ins: DelegateCall) -> Step:
        slots = self.slots
        handle = self.delegate(ins.delegate, [slots[s] for s in ins.scratch])
        args, outs = list(ins.args), list(ins.outputs)
        run = None
        if outs and self.m.tensor(outs[0]).storage == "runtime":  # dataflow.py: then all of them are
            run = self._returned_outputs(ins, handle)
        elif all(self.fixed[a] for a in args) and all(self.fixed[o] for o in outs) and hasattr(handle, "bind_static"):
            run = handle.bind_static([slots[a] for a in args], [slots[o] for o in outs])  # planned I/O, bound once
        made = [i for i, o in enumerate(outs) if self._fresh(o) and hasattr(handle, "makes_output")
                and handle.makes_output(i, self.m.tensor(o))]
        if run is None and made:
            run = self._made_outputs(handle, args, outs, made)
            step = self.step(index, "delegate", f"delegate {ins.delegate}", ins, run)
            return dataclasses.replace(step, makes=frozenset(outs[i] for i in made))
        if run is None:
            def run():
                handle.execute([slots[a] for a in args], [slots[o] for o in outs])
        return self.step(index, "delegate", f"delegate {ins.delegate}", ins, run)

    def _made_outputs(self, handle, args: list[int], outs: list[int], made: list[int]) -> Callable[[], None]:
        """A delegate whose outputs are the caller's fresh tensors makes them itself: as late as its
        own plan allows, as eager allocates a result when its kernel runs (a language model's
        logits are then not held through the whole call). One already bound (a micro-batch's rows
        of the joined result) is written into as before."""
        slots = self.slots

        def run():
            results = handle.execute([slots[a] for a in args], [slots[o] for o in outs])
            for i in made:
                if slots[outs[i]] is None:
                    slots[outs[i]] = results[i]

        return run

    def _returned_outputs(self, ins: DelegateCall, handle) -> Callable[[], None]:
        """A delegate that makes its own results (compiled code): each is checked against what the
        program declares, every call, and becomes the value of its output. A result laid out
        otherwise is copied to the declared layout; one sharing memory with the delegate's
        inputs or constants is copied too (compiled code may return a view of either, and the
        plan may reuse an input's bytes, or the caller write into what it is given)."""
        if not getattr(handle, "returns_outputs", False):
            raise ProgramError(f"delegate {ins.delegate}: the program expects it to return its outputs, but its "
                               "backend writes into memory it is given")
        slots, args, outs = self.slots, list(ins.args), list(ins.outputs)
        declared = [self.m.tensor(o) for o in outs]
        want = [(v.shape, v.torch_dtype, v.device.to_torch()) for v in declared]
        strides = [v.layout_strides for v in declared]
        kept: set[int] = getattr(handle, "storages", set)()  # the delegate's constants

        def run():
            inputs = [slots[a] for a in args]
            results = handle.execute(inputs, None)
            if len(results) != len(want) or any(not isinstance(r, torch.Tensor) or (tuple(r.shape), r.dtype, r.device) != w
                                                for r, w in zip(results, want)):
                got = [(tuple(r.shape), r.dtype, r.device) if isinstance(r, torch.Tensor) else type(r).__name__
                       for r in results]
                raise BackendError(f"delegate {ins.delegate} returned {got}; the program declares {want}")
            shared = kept | {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
            for o, r, st in zip(outs, results, strides):
                if r.untyped_storage().data_ptr() in shared or not same_strides(r.shape, r.stride(), st):
                    r = torch.empty_strided(r.shape, st, dtype=r.dtype, device=r.device).copy_(r)
                slots[o] = r

        return run

    # ---- copies

    def copy_step(self, index: int, ins: KernelCall) -> Step:
        m, slots = self.m, self.slots
        if len(ins.args) != 2 or len(ins.outputs) != 1 or ins.args[1] != ins.outputs[0]:
            raise ProgramError(f"method {m.name!r} instruction {index}: {ins.kernel} takes (self, out) and "
                               f"defines out, got args {ins.args} outputs {ins.outputs}")
        src_id, out_id = ins.args[0], ins.outputs[0]
        src_v, out_v = m.tensor(src_id), m.tensor(out_id)
        capacity = out_v.nbytes if out_v.storage == "planned" else None
        kernel = CopyKernel(OUT_COPY_KERNELS[ins.kernel], src_v.device, out_v.device, capacity)
        devices = (src_v.device, out_v.device)
        fixed = self.fixed[src_id] and self.fixed[out_id] and not self.dynamic(src_v) and not self.dynamic(out_v)
        if self.streams is not None and any(not d.is_cpu for d in devices):
            if fixed:
                call = self.streams.bind(index, kernel.bind_static(slots[src_id], slots[out_id]), devices, src_v.nbytes)
            else:
                run = self.streams.run
                call = lambda: run(index, kernel, slots[src_id], slots[out_id], devices)  # noqa: E731
        elif fixed:
            call = kernel.bind_static(slots[src_id], slots[out_id])
        else:
            call = lambda: kernel(slots[src_id], slots[out_id])  # noqa: E731
        step = self.step(index, "copy", ins.kernel, ins, call, extra_devices=(src_v.device,))
        if any(v.device.is_cpu and not self.fixed[i] for i, v in ((src_id, src_v), (out_id, out_v))):
            # host memory bound per call: a graph would replay the copy into the capture's
            step = dataclasses.replace(step, capturable=False)
        return step

    # ---- copies between ranks

    def transfer_step(self, index: int, ins: KernelCall) -> Step:
        """A host step: the transport waits for the device, moves the planned tensor and waits
        for the peer (program/ranks.py made it; runtime/parallel/transport.py runs it)."""
        m, transport = self.m, self.transport
        if transport is None:
            raise ProgramError(f"method {m.name!r} instruction {index}: {ins.kernel} needs the ranks of a "
                               "distributed job; load the program with ferry.distributed.Module")
        vid, peer, tag, cuda, *deferred = ins.args
        slots, sync = self.slots, _device_sync(self.streams, m.tensor(vid).device)
        fixed_tensor = slots[vid] if self.fixed[vid] else None

        def get() -> torch.Tensor:  # planned memory, or host memory bound per call (a part's rows)
            return fixed_tensor if fixed_tensor is not None else slots[vid]

        def const(a: int):
            v = m.values[a]
            return v.value if isinstance(v, ConstValue) else None

        if ins.kernel == SEND:
            call = transport.bind_send(get, const(peer), const(tag), const(cuda), sync)
        else:
            call = transport.bind_recv(get, const(peer), const(tag), const(cuda), const(deferred[0]), sync)
        reads = frozenset({vid} if not self.fixed[vid] else ())  # a receive writes into it
        device = m.tensor(vid).device
        if const(cuda) is not None and device.type == "cuda" and self.streams is not None:
            # NCCL on GPU memory: a device step in stream order (never captured in a graph)
            return Step(index, "transfer", ins.kernel, (device,), False, False, call, reads=reads)
        return Step(index, "transfer", ins.kernel, (), False, False, call, reads=reads)

    # ---- sizes

    def size_step(self, index: int, ins: KernelCall) -> Step:
        fn, refs, slots = SYM_OPS[ins.kernel], [self.ref(a) for a in ins.args], self.slots
        if len(ins.outputs) != 1:
            raise ProgramError(f"method {self.m.name!r} instruction {index}: {ins.kernel} defines one size")
        (out,) = ins.outputs

        def call():
            slots[out] = fn(*[_resolve(r, slots) for r in refs])

        return self.step(index, "size", ins.kernel, ins, call)

    # ---- ATen kernels

    def kernel_step(self, index: int, ins: KernelCall) -> Step | None:
        m = self.m
        try:
            op = resolve_kernel(ins.kernel)
        except LookupError as e:
            raise ProgramError(f"method {m.name!r} instruction {index}: {e}") from None
        check_call(op, ins.args, ins.outputs, m.values, f"method {m.name!r} instruction {index}")
        pos, kw = bind_aten(op, ins.args, self.ref)
        pos, op = self._storage_offset_in_arena(op, ins, pos, index)
        op = self._runnable_here(op, ins)
        writes_out = bool(ins.outputs) and all(o in ins.args for o in ins.outputs)
        if not writes_out and self._view_of_fixed(ins):
            try:  # a view of fixed memory: made once, here
                self._run_functional(op, pos, kw, ins.outputs, ins)()
            except Exception as e:  # noqa: BLE001 - the program's own shapes do not allow this view
                raise ProgramError(f"method {m.name!r} instruction {index} ({ins.kernel}): the view does not fit "
                                   f"the program's values: {str(e).strip().splitlines()[0]}") from e
            for o in ins.outputs:
                self.fixed[o] = True
            return None
        tensors = [o for o in ins.outputs if isinstance(m.values[o], TensorValue)]
        dynamic = [o for o in tensors if m.tensor(o).storage in ("planned", "output") and self.dynamic(m.tensor(o))]
        gemm = self._chosen_gemm(op, pos, kw) if writes_out and not dynamic else None
        if writes_out and dynamic:
            call = self._dynamic_out(op, pos, kw, dynamic)
        elif writes_out and all(r[0] == "c" for r in list(pos) + list(kw.values())):
            args, kwargs = [r[1] for r in pos], {k: r[1] for k, r in kw.items()}
            call = functools.partial(gemm or fast_aten(op, args, kwargs) or op, *args, **kwargs)
        elif writes_out and _first_only(pos, kw) is not None:  # one value of the call, first
            fn, slots = gemm or self._fast_out(op, pos, kw) or op, self.slots
            vid, rest, k = _first_only(pos, kw)  # type: ignore[misc]
            call = lambda: fn(slots[vid], *rest, **k)  # noqa: E731
        elif writes_out:
            args, fn = _arguments(self.slots, pos, kw), gemm or self._fast_out(op, pos, kw) or op

            def call():
                a, k = args()
                return fn(*a, **k)
        else:
            call = self._run_functional(op, pos, kw, ins.outputs, ins)
        return self.step(index, "kernel", ins.kernel, ins, call, check=self._shape_check(ins))

    def _storage_offset_in_arena(self, op, ins: KernelCall, pos: list, index: int):
        """`as_strided`'s storage offset counts from the start of its input's memory, as in eager,
        where that memory is a tensor of its own: ferry's memory may lie inside an arena (planned
        memory, or a caller's planned tensor handed to a delegate), so the offset is moved by
        where the memory owner starts. Returns (arguments, the op to call)."""
        at = STORAGE_OFFSET_AT.get(ins.kernel)
        if at is None or at >= len(pos) or pos[at] == ("c", None) or not ins.args:
            return pos, op
        owner = memory_owner(self.m.values, ins.args[0])
        itemsize = self.m.tensor(ins.args[0]).torch_dtype.itemsize
        if pos[at][0] != "c" or not isinstance(pos[at][1], int) or not isinstance(self.m.values[owner], TensorValue):
            raise ProgramError(f"method {self.m.name!r} instruction {index} ({ins.kernel}): its storage offset must "
                               "be a constant int")
        if self.fixed[owner]:
            base = self.slots[owner]
            start = base.storage_offset() * base.element_size()
            if start % itemsize:
                raise ProgramError(f"method {self.m.name!r} instruction {index} ({ins.kernel}): its input starts "
                                   f"at byte {start}, not at a multiple of its element size")
            return [*pos[:at], ("c", pos[at][1] + start // itemsize), *pos[at + 1:]], op
        slots = self.slots

        def shifted(*args, **kwargs):  # the owner is a tensor of this call: where it starts, per call
            base = slots[owner]
            args = list(args)
            args[at] += base.storage_offset() * base.element_size() // itemsize
            return op(*args, **kwargs)

        return pos, shifted

    def _runnable_here(self, op, ins: KernelCall):
        """An out kernel its device has no kernel for (`narrow_copy.out` on CUDA; a program may be
        compiled where that is not known) runs as its functional twin, then a copy into `out`."""
        devices = {self.m.tensor(o).device.type for o in ins.outputs if isinstance(self.m.values[o], TensorValue)}
        outs = [a.name for a in op._schema.arguments if a.is_out] if isinstance(op, torch._ops.OpOverload) else []
        if len(devices) != 1 or "cpu" in devices or outs != ["out"] or has_device_kernel(op, next(iter(devices))):
            return op
        twin = functional_variant(op)
        if twin is None:
            return op

        def copied(*args, out, **kwargs):
            result = twin(*args, **kwargs)
            if out.shape != result.shape:  # (a dynamic size: `out` was emptied for this call's size)
                out.resize_(result.shape)
            return out.copy_(result)

        return copied

    def _run_functional(self, op, pos, kw, outputs, ins: KernelCall | None = None):
        """A functional op (no out variant, or a view): its results become the output slots."""
        slots = self.slots
        if op in LAYOUT_VIEWS and any(r[0] != "c" for r in pos):
            op = torch.ops.aten.reshape.default  # see LAYOUT_VIEWS
        fn = self._chosen_composed(op, pos, kw, outputs) or self._fast(op, pos, kw, outputs) or op
        named = resolve_kernel(ins.kernel) if ins is not None else op  # (op may be a wrapper of it)
        if ins is not None and returns_inputs(named):
            fn = composite_results(fn, self._declared_sources(ins))
        args = _arguments(slots, pos, kw)
        first = _first_only(pos, kw)
        one = len(outputs) == 1 and not returns_list(named)  # (a list of one tensor is a list)
        if one and first is not None:  # the common case: one value of the call, first
            (out,), (vid, rest, k) = outputs, first

            def call():
                slots[out] = fn(slots[vid], *rest, **k)
        elif one:
            (out,) = outputs

            def call():
                a, k = args()
                slots[out] = fn(*a, **k)
        else:
            def call():
                a, k = args()
                for o, r in zip(outputs, fn(*a, **k)):
                    slots[o] = r

        return call

    def _declared_sources(self, ins: KernelCall) -> list[int | None]:
        """Per result, the position among the call's tensors (list members counted, in argument
        order) of the input the program declares it a view of, or None for a result of its own."""
        m = self.m
        owners = [memory_owner(m.values, t) for a in ins.args for t in tensor_ids(m, a)]
        bases = [v.alias_of if isinstance(v := m.values[o], TensorValue) else None for o in ins.outputs]
        return [owners.index(b) if b is not None and b in owners else None for b in bases]

    def _chosen_gemm(self, op, pos, kw):
        """`mm` and then the bias added, for an `addmm.out` this GPU runs faster that way
        (timed once per shape, at load: runtime/choices/gemm.py); None keeps the kernel named."""
        if op is not torch.ops.aten.addmm.out or len(pos) != 3 or "out" not in kw:
            return None
        scalars = [kw.get(k, ("c", 1)) for k in ("beta", "alpha")]
        if any(r[0] != "c" for r in scalars):
            return None
        try:
            bias, mat1, mat2, out = (self._given(r) for r in (*pos, kw["out"]))
        except _NoMeta:
            return None
        return biased_gemm(bias, mat1, mat2, out, scalars[0][1], scalars[1][1], measure=self.measure)

    def _chosen_composed(self, op, pos, kw, outputs):
        """In a plan captured as CUDA graphs, a composed form of more, smaller kernels where this
        GPU runs it faster (timed once per shape, at load): attention as GEMMs and a softmax
        (runtime/choices/attention.py), a convolution of one image as one GEMM over its patches
        (runtime/choices/conv.py); else None."""
        if not self.captured or (op not in attention_choice.OPS and op not in conv_choice.OPS):
            return None
        try:
            args, kwargs = [self._given(r) for r in pos], {k: self._given(r) for k, r in kw.items()}
        except _NoMeta:
            return None
        out = self.m.values[outputs[0]] if outputs else None
        device = out.device.to_torch() if isinstance(out, TensorValue) else None
        if op in conv_choice.OPS:
            return None if kwargs else conv_choice.chosen(op, args, measure=self.measure, device=device)
        one_input = len(pos) >= 3 and _one_value(pos[:3])
        return attention_choice.chosen(op, args, kwargs, one_input, measure=self.measure, device=device)

    def _given(self, ref):
        """What is fixed as it is (a weight on its GPU), a meta tensor like it for a value of the call."""
        return ref[1] if ref[0] == "c" else self._meta(ref)

    def _fast_out(self, op, pos, kw):
        """fast_aten for an .out kernel whose arguments include values of the call."""
        try:
            args, kwargs = [self._meta(r) for r in pos], {k: self._meta(r) for k, r in kw.items()}
        except _NoMeta:
            return None
        return fast_aten(op, args, kwargs)

    def _meta(self, ref):
        kind, x = ref
        if kind == "c":
            return _to_meta(x)
        if kind == "l":
            return [None if e is None else _meta_of(self.m, e, self.shapes) for e in x]
        return _meta_of(self.m, x, self.shapes)

    def _fast(self, op, pos, kw, outputs):
        """The C++ argument parser's entry for `op`, checked once on meta tensors shaped like this
        instruction's values (falls back to the OpOverload)."""
        m = self.m
        if not all(isinstance(m.values[o], TensorValue) and not self.dynamic(m.tensor(o)) for o in outputs):
            return None
        try:
            args, kwargs = [self._meta(r) for r in pos], {k: self._meta(r) for k, r in kw.items()}
        except _NoMeta:
            return None
        return fast_functional(op, args, kwargs, [(self.shape(o), m.tensor(o).torch_dtype) for o in outputs])

    def shape(self, vid: int) -> tuple[int, ...]:
        known = self.shapes.get(vid) if self.shapes is not None else None
        return tuple(known[0]) if known is not None else self.m.tensor(vid).shape

    def _view_of_fixed(self, ins: KernelCall) -> bool:
        """A view that can be made once: of fixed memory of a fixed shape, with a fixed shape (a
        view of a tensor whose size a call decides lies where that size puts it)."""
        m = self.m
        outs = [m.values[o] for o in ins.outputs]
        if not outs or not all(isinstance(v, TensorValue) and v.storage == "view" and not self.dynamic(v) for v in outs):
            return False
        args = [t for a in ins.args if a != DEFAULT_ARG for t in [a, *_members(m, a)]]
        return all(self.fixed[a] and not (isinstance(v := m.values[a], TensorValue) and self.dynamic(v)) for a in args)

    def _dynamic_out(self, op, pos, kw, dynamic_outs):
        """Outputs with a dynamic dim are planned (or, a delegate's, handed in) at their bound or
        at another call's size: shrink them to empty before the op so it sizes them (PyTorch
        warns when an out= kernel resizes a tensor with elements), then check they stayed within
        their plan."""
        slots, m = self.slots, self.m
        capacity = [(o, m.tensor(o).nbytes) for o in dynamic_outs]

        def call():
            for o, _ in capacity:
                slots[o].resize_(0)
            op(*[_resolve(r, slots) for r in pos], **{n: _resolve(r, slots) for n, r in kw.items()})
            for o, cap in capacity:
                t = slots[o]
                if t.numel() * t.element_size() > cap:
                    raise InputError(
                        f"{op}: a {tuple(t.shape)} result exceeds the {cap} bytes planned for it; "
                        "the inputs are larger than the bounds the program was exported with"
                    )
                if not t.is_contiguous():  # a kernel that lays out what it sizes (linalg's column-major):
                    _compact(t)  # planned memory of a dynamic size is contiguous, as copies expect

        return call

    def _shape_check(self, ins: KernelCall):
        """After the first call: planned outputs kept their planned shapes. Planning follows the
        trace; a kernel that writes a larger output on some device than the trace said would write
        past its slot, so the first call turns that into an error instead of a wrong result."""
        m, slots = self.m, self.slots
        planned = [(o, m.tensor(o).shape) for o in ins.outputs if isinstance(m.values[o], TensorValue)
                   and m.tensor(o).storage in ("planned", "runtime") and not any(m.tensor(o).dynamic)]
        if not planned:
            return None

        def check():
            for o, shape in planned:
                if slots[o] is not None and tuple(slots[o].shape) != shape:  # (None: an undefined result)
                    raise ProgramError(
                        f"{ins.kernel} wrote a {tuple(slots[o].shape)} output where the program planned {shape} "
                        f"(value {m.values[o].name!r}): the program's shapes disagree with its kernels, so its "
                        "memory plan is unsafe (an edited file, or a device whose kernel differs from the CPU "
                        "trace: please report that to ferry)"
                    )

        return check

    # ---- mutable buffers

    def writebacks(self) -> list[Step]:
        """After the last instruction, each updated mutable buffer gets its new value (on its
        own device: a stream-ordered device copy for device-resident state)."""
        out, slots = [], self.slots
        for mb in self.m.mutable_buffers:
            if self.fixed[mb.update] and slots[mb.update] is slots[mb.value]:
                continue
            value, update = mb.value, mb.update
            dev = self.m.tensor(value).device
            call = lambda value=value, update=update: slots[value].copy_(slots[update])  # noqa: E731
            devices = () if dev.is_cpu else (dev,)
            reads = frozenset(v for v in (value, update) if not self.fixed[v])
            out.append(Step(-1, "writeback", f"write back {mb.name or value}", devices, False, True, call,
                            reads=reads))
        return out
