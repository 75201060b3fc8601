"""Run: walk a schedule, one call at a time.

A Plan is built once from a bound method and its schedule: each piece of work becomes a
plain callable (a step's call, launched on its device; a host wait; a graph segment), in
two lists — the first call's, with the shape checks and no graphs, and every later call's.
A call then only meets the caller's tensors (copy in, bind, stage) and loops over a list.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ferry.device import Device
from ferry.errors import AllocationError, FerryError, ProgramError
from ferry.runtime.devices.allocator import DeviceMemoryBuffer
from ferry.runtime.devices.graphs import GraphSegment, on_capture_stream
from ferry.runtime.devices.tensor import device_of, make_tensor, pad_rows
from ferry.runtime.stages.frame import record_shapes
from ferry.runtime.stages.schedule import HostWait, Run, Schedule, Segment
from ferry.runtime.stages.steps import Bound, Step

__all__ = ["Plan", "caller_copy", "empty_on"]


def caller_copy(t: torch.Tensor, device: Device) -> torch.Tensor:
    """A copy the caller owns, on `device`, where `t` is (host-backed device memory, such as
    the emulated device's, stays on its device). A constant output (`None`, a number) is returned
    as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    if device.is_cpu or t.device.type != "cpu":
        return t.clone()
    out = empty_on(device, t.shape, t.dtype)
    out.copy_(t)  # host-backed memory: a plain copy, after the call's device work has finished
    return out


def empty_on(device: Device, shape, dtype: torch.dtype, strides=()) -> torch.Tensor:
    """A tensor the caller keeps (a fresh output), allocated through the registry, laid out
    as `strides` say (contiguous when empty)."""
    if device.is_cpu:
        return torch.empty_strided(shape, strides, dtype=dtype) if strides else torch.empty(shape, dtype=dtype)
    if device.type == "cuda":  # torch's caching allocator, as eager's outputs: no buffer object to make
        try:
            where = torch.device("cuda", device.index)
            return (torch.empty_strided(shape, strides, dtype=dtype, device=where) if strides
                    else torch.empty(shape, dtype=dtype, device=where))
        except Exception as exc:  # noqa: BLE001 - out of memory, or no such device
            raise AllocationError(f"allocation of a {dtype} tensor of shape {tuple(shape)} on {device} failed: "
                                  f"{exc}") from exc
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    buf = DeviceMemoryBuffer.create(nbytes, device)
    t = make_tensor(buf.memory, shape, dtype, device, 0, strides or None)
    t._ferry_buffer = buf  # type: ignore[attr-defined]  # the tensor keeps its memory alive
    return t


def _used_on_callers_stream(outs: list) -> None:
    """Results a call before the capture made on a capture stream (runtime/devices/graphs.py
    `on_capture_stream`) are the caller's, used on its current stream: once freed, their memory
    waits for that stream's work before the capture stream reuses it (a caller that changes
    streams between calls would otherwise race with it)."""
    for t in outs:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            with contextlib.suppress(RuntimeError):  # memory the caching allocator does not own
                t.record_stream(torch.cuda.current_stream(t.device))


class Plan:
    """An immutable list of work for one bound method, and the per-call handling of its I/O."""

    def __init__(self, name: str, bound: Bound, sched: Schedule, first: Schedule, streams, outputs: list[int],
                 record: tuple[int, ...] = (), in_flight: Schedule | None = None, transport=None,
                 stands_in: tuple[int, ...] = ()):
        self.name, self.bound, self.io = name, bound, bound.io
        # a plan without graphs that stands in for captured ones (a dynamic method's first call at
        # each shape): the devices whose capture streams every call of it runs on, as a first call does
        self.stands_in = stands_in
        self.transport = transport  # copies between ranks, whose receives may finish at the end
        # the dynamic values whose sizes a call records (a method bound per shape: runtime/stages/method.py)
        self.record = record
        self.shapes: dict[int, object] | None = None
        self._recorded = frozenset(record)
        self.streams = streams
        self.outputs = outputs
        self.graphs: list[GraphSegment] = []
        self._graph_calls: dict[Segment, Callable[[], object]] = {}
        self._key: tuple[tuple[int, ...], ...] | None = None  # input shapes, when graphs replay
        self._labels: dict[int, str] = {}  # id of a step's call -> its label (what a refusal names)
        self.work = tuple(self._compile(sched, first_call=False))
        self.first_work = tuple(self._compile(first, first_call=True))
        # a micro-batch's: its copies are left in flight while the next one is issued (no host wait
        # at the end; runtime/parallel/microbatch.py waits once, after the last), and it starts with the
        # previous one's copies in flight (its first host step waits for them)
        parts = in_flight if in_flight is not None else sched
        self.work_parts = tuple(self._compile(parts, first_call=False))
        self.work_in_flight = tuple(self._compile(parts.without_final_wait(), first_call=False))
        self.notes = sched.notes
        self.checked = False
        self._allocate_unwritten = self._allocate(bound.io.fresh_outputs)  # an output no step writes (empty)
        # a functional kernel's result is fresh each call, so the caller may keep it; not one a
        # graph replays into (the same memory every call)
        replayed = frozenset().union(*(w.writes for w in sched.segments() if w.capture))
        fresh = {i for i, vid in enumerate(outputs)
                 if bound.io.runtime_outputs.get(i) is not None and vid not in replayed}
        self.caller_owned = bound.io.caller_owned | fresh

    # ---- building

    def _launch(self, step: Step) -> Callable[[], object]:
        """A step as the host calls it: device work is launched on its device."""
        api = self.streams.api if self.streams is not None else None
        if api is None or step.kind == "copy" or not any(d.type == api.device_type for d in step.devices):
            return step.call
        (index,) = {d.index for d in step.devices if d.type == api.device_type}
        if step.returns:  # compiled code returning its results: later steps take them
            return api.results_now(index, step.call)
        return api.on_device(index, step.call)

    def _compile(self, sched: Schedule, first_call: bool) -> list[Callable[[], object]]:
        out: list[Callable[[], object]] = []
        for w in sched.work:
            if isinstance(w, HostWait):
                out.append(self.streams.wait_host)
            elif isinstance(w, Run):
                out.extend(self._step_calls(w.step, first_call))
            elif w.capture and not first_call:
                out.append(self._graph(w))
            else:
                for s in w.steps:
                    out.extend(self._step_calls(s, first_call))
        return out

    def _step_calls(self, step: Step, first_call: bool) -> list[Callable[[], object]]:
        calls = [self._launch(step) if not first_call else _labelled(self._launch(step), self.name, step)]
        self._labels[id(calls[0])] = step.label
        fresh = [(vid, v) for vid, v in self.io.fresh_outputs if vid in step.reads | step.writes and vid not in step.makes]
        if fresh:  # made when first written, as eager allocates a result: not held through the whole call
            calls.insert(0, self._allocate(fresh))
        if first_call and step.check is not None:
            calls.append(step.check)
        if step.release:
            slots, dead = self.bound.slots, step.release
            recorded = [v for v in dead if v in self._recorded]

            def release():
                if recorded and self.shapes is not None:  # their sizes, before they go
                    self.shapes.update(record_shapes(slots, recorded))
                for vid in dead:
                    slots[vid] = None

            calls.append(release)
        return calls

    def _graph(self, seg: Segment) -> Callable[[], object]:
        """One graph per segment, shared by the work lists that run it."""
        known = self._graph_calls.get(seg)
        if known is not None:
            return known
        g = GraphSegment([self._launch(s) for s in seg.steps], seg.device.index, self.streams,  # type: ignore[union-attr]
                         seg.touches_host, f"method {self.name!r} {seg.label}", self.bound.slots, seg.writes)
        self.graphs.append(g)
        call = self._graph_calls[seg] = lambda: g(self._key)
        return call

    # ---- a call

    @property
    def copies_inputs(self) -> bool:
        """Every input is copied into planned memory (so a call may pass fewer rows: `pad_to`)."""
        return all(mode == "copy" for _, mode in self.io.inputs)

    def execute(self, inputs, bind_outputs=None, finish: bool = True, part: bool = False,
                pad_to: int | None = None) -> list:
        """Run once. `bind_outputs`: tensors the outputs are written into (a delegate's, or a
        micro-batch's rows of the joined result). `part`: a micro-batch, which may start while
        the previous one's copies are in flight; `finish=False` (a part but the last) returns
        with its own copies in flight: the caller waits with `finish()` before it reads a host
        output, and `bind_outputs` must be memory it keeps alive until then. `pad_to`: the plan
        is bound at that many rows and the inputs have fewer (shape buckets; `copies_inputs`
        only): they are padded as they are copied into planned memory."""
        slots, io = self.bound.slots, self.io
        self.shapes = {} if self.record else None
        if part and not self.checked:
            self.finish()  # a first run's schedule assumes nothing in flight: make it so
        try:
            self._take_inputs(inputs, pad_to)
            self._fresh_outputs(bind_outputs)
            if self.graphs:
                self._key = tuple((pad_to, *t.shape[1:]) if pad_to else tuple(t.shape) for t in inputs)
            before_capture = any(g.graph is None for g in self.graphs)  # work on the capture streams
            first = before_capture and not self.checked
            on_capture = self.stands_in or (tuple(g.index for g in self.graphs) if first else ())
            with self._on_capture_streams(on_capture) if on_capture else contextlib.nullcontext():
                self._run(self._work(part, finish))
            self._allocate_unwritten()
            self.checked = True
            if finish:
                self.finish()
            outs = [slots[vid] for vid in self.outputs]
            for i, pos in io.passthrough:
                outs[i] = inputs[pos]
            if before_capture or self.stands_in:
                _used_on_callers_stream(outs)
            if bind_outputs is not None:
                _copy_into(bind_outputs, outs) if finish else self._copy_in_order(bind_outputs, outs)
            if self.shapes is not None:
                self.shapes.update(record_shapes(slots, [v for v in self.record if slots[v] is not None]))
        finally:
            # drop this call's caller-owned tensors (inputs, fresh outputs, run-time results):
            # the method must not keep the caller's memory alive
            for vid in io.transient:
                slots[vid] = None
        return outs

    @contextlib.contextmanager
    def _on_capture_streams(self, indices: tuple[int, ...]):
        """A plan with graphs runs its first call (its steps one by one, with the shape checks) on
        the capture streams its graphs use, as their first runs do (runtime/devices/graphs.py);
        a plan standing in for captured ones runs every call there."""
        with contextlib.ExitStack() as stack:
            for index in dict.fromkeys(indices):
                stack.enter_context(on_capture_stream(self.streams, index))
            yield

    def _run(self, work: tuple) -> None:
        """Run `work`; a kernel that refuses a later call's values (a token id out of range) is a
        ProgramError naming its step, as on the first call (whose steps are each labelled)."""
        try:
            for call in work:
                call()
        except (FerryError, MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - reported as what it is: the call does not run
            raise refusal(self.name, self._labels.get(id(call), "a step"), e) from e

    def _work(self, part: bool, finish: bool) -> tuple:
        if not self.checked:
            return self.first_work  # with the shape checks
        if part:
            return self.work_parts if finish else self.work_in_flight
        return self.work

    def finish(self) -> None:
        """Wait for the copies a call left in flight; the device outputs are then the caller's."""
        if self.transport is not None:
            self.transport.finish()
        if self.streams is not None:
            self.streams.wait_host()
            self.streams.end_of_call()

    def _take_inputs(self, inputs, pad_to: int | None = None) -> None:
        slots = self.bound.slots
        for t, (vid, mode) in zip(inputs, self.io.inputs):
            if mode == "bind":
                slots[vid] = t
            elif mode == "copy":  # host memory a copy of the previous call may still read
                if self.streams is not None:
                    self.streams.wait_host()
                dst = slots[vid]
                if pad_to is not None:
                    pad_rows(t, pad_to, dst)
                    continue
                if dst.shape != t.shape:
                    dst.resize_(t.shape)
                dst.copy_(t)
            elif mode == "stage":  # a device copy into the fixed tensor, in stream order
                self._device_copy(slots[vid], t)

    def _copy_in_order(self, targets, results) -> None:
        """Outputs not written in place, with copies still in flight: a device result is copied
        in stream order (before the next call can overwrite it); a host one after the host
        waits (a copy in flight may still be writing what it views)."""
        waited = False
        for t, r in zip(targets, results):
            if t is None or r is t:
                continue
            if self.streams is not None and not device_of(r).is_cpu:
                self._device_copy(t, r)
                continue
            if not waited and self.streams is not None:
                self.streams.wait_host()
                waited = True
            t.copy_(r)

    def _device_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.streams.api.on_device(device_of(dst).index, lambda: dst.copy_(src))()

    def _fresh_outputs(self, bind_outputs) -> None:
        """Bind the outputs the caller gives (a delegate's, a micro-batch's rows); the other fresh
        outputs are made by `_allocate` before the first step that writes them."""
        slots = self.bound.slots
        if bind_outputs is not None:
            for vid, t in zip(self.outputs, bind_outputs):
                if t is not None and not self.bound.fixed[vid] and slots[vid] is None:
                    slots[vid] = t

    def _allocate(self, fresh) -> Callable[[], None]:
        """Make fresh outputs (at the call's shape when the plan is bound per shape) not yet bound."""
        slots = self.bound.slots

        def allocate():
            for vid, v in fresh:
                if slots[vid] is None:
                    slots[vid] = empty_on(v.device, v.shape, v.torch_dtype, v.strides)

        return allocate

    def run_bound(self, copy_back: list[tuple[torch.Tensor, int]]) -> None:
        """Run with the tensors bound into the plan; `copy_back`: (caller tensor, value id) of
        outputs that are not written in place (views, inputs, run-time results)."""
        self._run(self.work if self.checked else self.first_work)
        self.checked = True
        slots = self.bound.slots
        _copy_into([t for t, _ in copy_back], [slots[vid] for _, vid in copy_back])


def _labelled(call: Callable[[], object], method: str, step: Step) -> Callable[[], object]:
    """The first call runs each step so that a kernel that refuses the program's own values (a
    program whose shapes or arguments disagree with its kernels) is a ProgramError naming the
    instruction, not an exception from deep inside PyTorch. Later calls run the bare steps."""

    def run():
        try:
            return call()
        except (FerryError, MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - reported as what it is: the program does not run
            raise refusal(method, step.label, e) from e

    return run


def refusal(method: str, label: str, e: Exception) -> ProgramError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return ProgramError(f"method {method!r} {label}: the kernel refused the program's values: "
                        f"{type(e).__name__}: {first}")


def _copy_into(targets, results) -> None:
    for t, r in zip(targets, results):
        if t is not None and r is not t:
            if t.shape != r.shape:
                t.resize_(r.shape)
            t.copy_(r)
