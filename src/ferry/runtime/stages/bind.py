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
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ferry.backend_registry import NOT_CAPTURED, CallerPlan
from ferry.device import Device
from ferry.errors import BackendError, ProgramError
from ferry.layout import contiguous_strides, same_strides
from ferry.ops import OUT_COPY_KERNELS
from ferry.program.ranks import RECV, SEND
from ferry.program.schema import (
    DEFAULT_ARG,
    ConstValue,
    DelegateCall,
    KernelCall,
    Method,
    TensorValue,
)
from ferry.runtime.devices.tensor import device_of
from ferry.runtime.stages.frame import (
    call_io,
    dynamic_values,
    fix_lists,
    fix_shapes,
    members,
    own_dynamic,
    record_shapes,
    with_releases,
)
from ferry.runtime.stages.kernel_steps import KernelSteps
from ferry.runtime.stages.kernels import CopyKernel
from ferry.runtime.stages.load import Memory
from ferry.runtime.stages.refs import LAYOUT_VIEWS, ref, resolve
from ferry.runtime.stages.run import empty_on
from ferry.runtime.stages.steps import Bound, CallIO, Step

__all__ = ["LAYOUT_VIEWS", "STEP_KINDS", "BindContext", "Bound", "CallIO", "Step", "bind_method", "dynamic_values",
           "record_shapes"]

# kernels of the sizes arithmetic torch.export records with Python operators
SYM_OPS = MappingProxyType({
    "ferry::sym_add": operator.add, "ferry::sym_sub": operator.sub, "ferry::sym_mul": operator.mul,
    "ferry::sym_floordiv": operator.floordiv, "ferry::sym_mod": operator.mod, "ferry::sym_neg": operator.neg,
})


@dataclass(frozen=True)
class BindContext:
    """What binding a method needs besides the method and its memory, fixed for the plan.

    delegate:     `delegate(i, memory, capture)` gives delegate i's handle (its working memory planned by the caller)
    streams:      a CopyStreams issuing copies on an asynchronous device, or None
    page_locked:  whether a host tensor is page-locked (None: ask the tensor)
    transport:    the copies between ranks of a program split over processes (runtime/parallel/transport.py)
    measure:      the method is loading, so kernels chosen by timing (ferry/choices/) may be timed now; a
                  plan bound during a call uses only what was timed before
    capture:      the captured plan this one runs in (itself, where it runs as CUDA graphs; a delegate's,
                  its caller's): then kernels faster on the GPU that launch more (attention, convolutions
                  of one image) may be chosen, timed by replay on its capture streams. Delegates loaded
                  or bound meanwhile are handed it (backend_registry.CallerPlan). A step whose segment is
                  not captured after all (a failed capture, a host sync beside it) runs the chosen form
                  eagerly: right, not faster.
    """

    delegate: Callable
    streams: Any = None
    page_locked: Callable[[torch.Tensor], bool] | None = None
    transport: Any = None
    measure: bool = False
    capture: CallerPlan = NOT_CAPTURED


def bind_method(method: Method, memory: Memory, ctx: BindContext, *, io: dict[int, torch.Tensor] | None = None,
                per_call: frozenset[int] = frozenset(), shapes: dict[int, object] | None = None) -> Bound:
    """Bind every instruction. `io` fixes more slots (a delegate's planned I/O); `per_call`:
    planned inputs and outputs the caller's tensors stand in for on each call (micro-batches: a
    part's rows of the caller's batch and of the joined result); `shapes`: the sizes and the
    (shape, strides) of every dynamic value at one shape of the call, as `record_shapes` took
    them from a call at that shape: the method is then bound as a static one (views of its
    planned memory at those shapes, sizes as constants)."""
    slots, fixed = list(memory.slots), list(memory.fixed)
    for vid, t in (io or {}).items():
        slots[vid], fixed[vid] = t, True
    for vid in per_call:
        slots[vid], fixed[vid] = None, False
    fresh = fix_shapes(method, slots, fixed, shapes) if shapes is not None else own_dynamic(method, slots, fixed)
    fix_lists(method, slots, fixed)
    b = _Binder(method, slots, fixed, ctx, shapes)
    steps = [b.instruction(i, ins) for i, ins in enumerate(method.instructions)] + b.writebacks()
    return Bound(tuple(with_releases(method, steps, fixed)), slots, tuple(fixed), call_io(method, memory, fixed, fresh))


# what kind of step an instruction is (the binder's `<kind>_step` makes it), first match wins
STEP_KINDS: Mapping[str, Callable[[object], bool]] = MappingProxyType({
    "delegate": lambda ins: isinstance(ins, DelegateCall),
    "copy": lambda ins: getattr(ins, "kernel", None) in OUT_COPY_KERNELS,
    "size": lambda ins: getattr(ins, "kernel", None) in SYM_OPS,
    "transfer": lambda ins: getattr(ins, "kernel", None) in (SEND, RECV),
    "kernel": lambda ins: True,
})


def _device_sync(streams, device: Device) -> Callable[[], None]:
    """The host waits for the work queued on `device` before a transfer touches its memory.
    Nothing to wait for on the CPU, on a device that runs synchronously, or on CUDA: NCCL
    orders its transfer after the current stream, and a staging copy to the host waits."""
    if device.is_cpu or device.type == "cuda" or streams is None or device.type != streams.api.device_type:
        return lambda: None
    synchronize, index = streams.api.synchronize, device.index
    return lambda: synchronize(index)


def _fits(r, want: tuple, dynamic: tuple) -> bool:
    """Result `r` is what the program declares: its shape, or (`dynamic` flags) at most the bound
    in each dynamic dimension; its dtype and device."""
    if not isinstance(r, torch.Tensor) or (r.dtype, r.device) != want[1:]:
        return False
    if not dynamic:
        return tuple(r.shape) == tuple(want[0])
    return r.ndim == len(want[0]) and all(s == b or (dyn and s <= b) for s, b, dyn in zip(r.shape, want[0], dynamic))


class _Binder(KernelSteps):
    def __init__(self, method: Method, slots: list, fixed: list, ctx: BindContext, shapes: dict | None = None):
        self.m, self.slots, self.fixed, self.ctx = method, slots, fixed, ctx
        self.transport, self.measure, self.delegate = ctx.transport, ctx.measure, ctx.delegate
        self.capture, self.captured = ctx.capture, ctx.capture.captured
        self.streams = ctx.streams
        self.page_locked = ctx.page_locked or (lambda t: t.is_pinned())
        self.shapes = shapes  # bound at one call's shapes: every dynamic value's size is known

    def dynamic(self, v: TensorValue) -> bool:
        return any(v.dynamic) and self.shapes is None

    def _fresh(self, vid: int) -> bool:
        """A tensor made for the caller each call (an output it keeps)."""
        v = self.m.values[vid]
        return isinstance(v, TensorValue) and v.storage == "output" and not self.fixed[vid]

    def ref(self, vid: int):
        return ref(self.slots, self.fixed, self.m, vid)

    def instruction(self, index: int, ins) -> Step | None:
        """The instruction's step, by its kind (STEP_KINDS); None for a size fixed at bind time (a
        method bound at one call's shapes)."""
        if not isinstance(ins, DelegateCall) and ins.outputs and all(
                self.fixed[o] and isinstance(self.m.values[o], ConstValue) for o in ins.outputs):
            return None
        kind = next(k for k, is_kind in STEP_KINDS.items() if is_kind(ins))
        return getattr(self, f"{kind}_step")(index, ins)

    def step(self, index: int, kind: str, name: str, ins, call, *, extra_devices=(), check=None,
             also_reads=()) -> Step:
        """`also_reads`: values the call reads besides its arguments (a view's memory owner)."""
        m = self.m
        devs = {m.tensor(o).device for o in ins.outputs if isinstance(m.values[o], TensorValue)}
        devs |= set(extra_devices)
        args = [t for a in ins.args if a != DEFAULT_ARG for t in [a, *members(m, a)]] + list(also_reads)
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
        handle = self.delegate(ins.delegate, [slots[s] for s in ins.scratch], self.capture)
        args, outs = list(ins.args), list(ins.outputs)
        run = None
        if outs and all(self.m.tensor(o).storage in ("runtime", "state") for o in outs) and any(
                self.m.tensor(o).storage == "runtime" for o in outs):  # dataflow.py: results it returns
            step = self.step(index, "delegate", f"delegate {ins.delegate}", ins, self._returned_outputs(ins, handle))
            return dataclasses.replace(step, returns=True)
        if all(self.fixed[a] for a in args) and all(self.fixed[o] for o in outs):
            run = handle.bind_static([slots[a] for a in args], [slots[o] for o in outs], self.capture)  # planned I/O
        made = [i for i, o in enumerate(outs) if self._fresh(o) and handle.makes_output(i, self.m.tensor(o))]
        if run is None and made:
            run = self._made_outputs(handle, args, outs, made)
            step = self.step(index, "delegate", f"delegate {ins.delegate}", ins, run)
            return dataclasses.replace(step, makes=frozenset(outs[i] for i in made))
        if run is None:
            # dynamic outputs at their bound or another call's size: emptied first, so that the
            # delegate's kernels size them (PyTorch warns when an out= kernel resizes a tensor
            # with elements; a delegate's plan bound at this call's shape writes them as they come)
            stale = [o for o in outs if self.m.tensor(o).storage in ("planned", "output") and self.dynamic(self.m.tensor(o))]

            def run():
                for o in stale:
                    if slots[o] is not None:
                        slots[o].resize_(0)
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
        if not handle.returns_outputs:
            raise ProgramError(f"delegate {ins.delegate}: the program expects it to return its outputs, but its "
                               "backend writes into memory it is given")
        slots, args, outs = self.slots, list(ins.args), list(ins.outputs)
        declared = [self.m.tensor(o) for o in outs]
        # at one call's shapes (a bound plan) each result's shape and layout are known; in the
        # generic plan a dynamic dimension may be anything up to its bound, laid out contiguously
        at = [self.shapes.get(o) if self.shapes is not None else None for o in outs]
        want = [(tuple(a[0]) if a else v.shape, v.torch_dtype, v.device.to_torch()) for v, a in zip(declared, at)]
        bounded = [tuple(v.dynamic) if any(v.dynamic) and a is None else () for v, a in zip(declared, at)]
        kept = handle.storages()  # the delegate's constants
        # a device whose memory is host memory its allocator owns (the emulated one): compiled
        # code (CPU code on it) returns plain host tensors, which are copied into its memory
        # (a result written over the state in place, Backend.writes_over, is not taken)
        taken = [(j, o, tuple(a[1]) if a else None if bounded[j] else v.layout_strides,
                  v.device if v.device.type not in ("cpu", "cuda") else None)
                 for j, (o, v, a) in enumerate(zip(outs, declared, at)) if v.storage != "state"]

        def run():
            inputs = [slots[a] for a in args]
            results = handle.execute(inputs, None)
            if len(results) != len(want) or any(not _fits(r, w, b) for r, w, b in zip(results, want, bounded)):
                got = [(tuple(r.shape), r.dtype, r.device) if isinstance(r, torch.Tensor) else type(r).__name__
                       for r in results]
                raise BackendError(f"delegate {ins.delegate} returned {got}; the program declares {want}")
            shared = kept | {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
            for j, o, st, dev in taken:
                r = results[j]
                st = st if st is not None else contiguous_strides(tuple(r.shape))
                if ((dev is not None and device_of(r) != dev) or r.untyped_storage().data_ptr() in shared
                        or not same_strides(r.shape, r.stride(), st)):  # into memory of its own, on its device
                    if dev is None:
                        r = torch.empty_strided(r.shape, st, dtype=r.dtype, device=r.device).copy_(r)
                    else:
                        r = empty_on(dev, r.shape, r.dtype, st).copy_(r)
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
            slots[out] = fn(*[resolve(r, slots) for r in refs])

        return self.step(index, "size", ins.kernel, ins, call)

    # ---- ATen kernels


    # ---- mutable buffers

    def writebacks(self) -> list[Step]:
        """After the last instruction, each updated mutable buffer gets its new value (on its
        own device: a stream-ordered device copy for device-resident state)."""
        out, slots = [], self.slots
        for mb in self.m.mutable_buffers:
            if mb.read_only or (self.fixed[mb.update] and slots[mb.update] is slots[mb.value]):
                continue  # (read only here, or written in place)
            value, update = mb.value, mb.update
            dev = self.m.tensor(value).device
            call = lambda value=value, update=update: slots[value].copy_(slots[update])  # noqa: E731
            devices = () if dev.is_cpu else (dev,)
            reads = frozenset(v for v in (value, update) if not self.fixed[v])
            out.append(Step(-1, "writeback", f"write back {mb.name or value}", devices, False, True, call,
                            reads=reads))
        return out
