"""A loaded method: the four runtime stages, wired together.

load (runtime/stages/load.py) allocates the memory; bind (runtime/stages/bind.py) turns instructions into
Steps; schedule (runtime/stages/schedule.py) orders them, placing host waits and graph segments;
run (runtime/stages/run.py) walks the result. This class only connects them, checks a call's
inputs, re-binds a delegate's planned inputs and outputs into a new plan, and keeps the plans
a method with dynamic sizes binds per shape (and micro-batches' plans).
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections import OrderedDict
from typing import cast

import torch

from ferry.backend_registry import NOT_CAPTURED, CallerPlan
from ferry.choices import scratch_space
from ferry.device import CPU
from ferry.errors import FerryError, InputError
from ferry.layout import contiguous_strides, same_strides
from ferry.program import guards
from ferry.program.schema import ConstValue, Method, TensorValue
from ferry.program.signature import size_name
from ferry.runtime.devices.allocator import get_allocator
from ferry.runtime.devices.streams import CopyStreams
from ferry.runtime.devices.tensor import device_of
from ferry.runtime.stages.bind import BindContext, bind_method, dynamic_values
from ferry.runtime.stages.graph_report import ShapeGraphs, nothing_captured, shape_graphs
from ferry.runtime.stages.load import load_memory
from ferry.runtime.stages.run import Plan
from ferry.runtime.stages.schedule import schedule

__all__ = ["LoadedMethod", "SHAPES_KEPT", "remember", "streams_api_for"]

SHAPES_KEPT = 64  # plans bound per shape a method keeps (least recently used go first)


def remember(kept: dict, key, value) -> None:
    """`kept[key] = value`, the oldest entry let go past SHAPES_KEPT: what a call decided for its
    shapes (a guard met, a bucket, a part size), so the next call at them pays a lookup.
    Tolerates another thread's change meanwhile (a decision is then remembered, or not)."""
    if len(kept) >= SHAPES_KEPT:
        with contextlib.suppress(RuntimeError, StopIteration, KeyError):
            kept.pop(next(iter(kept)))
    kept[key] = value


def streams_api_for(method: Method):
    """The streams API of the asynchronous device type the method uses (CUDA, or a simulated
    device), or None when all its devices run synchronously with the host."""
    types = sorted({v.device.type for v in method.values if isinstance(v, TensorValue) and not v.device.is_cpu})
    for t in types:
        allocator = get_allocator(t)
        api = allocator.streams_api() if allocator is not None else None
        if api is not None:
            return api
    return None


class LoadedMethod:
    def __init__(self, program, method: Method, delegate, *, pin_host: bool = True, cuda_graphs: bool = False,
                 asynchronous: bool = True, memory=None, transport=None, caller: CallerPlan = NOT_CAPTURED,
                 uploads=None, state=None, graph_memory=None, reservation=None):
        self.method, self.name = method, method.name
        # outputs written into the caller's inputs after the call (never handed to the caller)
        self.written_outputs = frozenset(w.output for w in method.input_writes)
        self.caller = caller  # a delegate's method: the plan it runs inside
        self.transport = transport
        self._delegate = delegate
        api = streams_api_for(method) if asynchronous else None
        # graph_memory: the capture streams and pools of the set this method runs in
        self.streams = CopyStreams(api, graph_memory) if api is not None else None
        if self.streams is not None and transport is not None:  # a dead peer must not hang a host wait
            self.streams.bound_waits(transport.timeout, transport.stuck)
        # reservation: the load's one allocation per device (runtime/devices/slab.py) memory comes from
        self.memory = load_memory(program.segments, method, pin_host=pin_host, stage_io=cuda_graphs and api is not None,
                                  buffers=memory, uploads=uploads, state=state, reservation=reservation)
        # a method with dynamic sizes runs its first call at each new shape through the generic
        # plan, which records every size; later calls at that shape run a plan bound at those
        # sizes, as a static method's is (kernel fast paths, views made once, fresh outputs at
        # their real size, graphs per shape). The plans are kept for the last SHAPES_KEPT shapes.
        self._dynamic = dynamic_values(method)
        self._graphs = cuda_graphs
        self._by_shape: OrderedDict[tuple, Plan] = OrderedDict()
        self._parts: Plan | None = None
        self._host_io: frozenset[int] = frozenset()
        self._sizes: OrderedDict[tuple, dict] = OrderedDict()
        try:
            with scratch_space.carved_from(self.memory.free_arenas()):  # what the load times runs there
                self.plan = self._plan(None, cuda_graphs and not self._dynamic, record=self._dynamic, measure=True)
            self.memory.arenas.clear()  # (views of its memory, held no longer than the load)
        except BaseException:
            self.memory.close()
            raise
        self.last_plan = self.plan
        self._warned = False
        if not self._dynamic:
            self._warn_if_nothing_captured()
        self._inputs = [v if isinstance(v := method.values[i], TensorValue) else None for i in method.inputs]
        self._expected = [_expected_cuda_tensor(v) for v in self._inputs]
        self._storage_read = frozenset(method.storage_inputs)
        # int inputs (sizes a caller passes) by position: the bound export recorded
        self._int_bounds: dict[int, int] = {
            i: cast(int, v.value) for i, vid in enumerate(method.inputs)
            if isinstance(v := method.values[vid], ConstValue) and v.kind == "symint"}
        self.output_devices = [v.device if isinstance(v := method.values[vid], TensorValue) else CPU
                               for vid in method.outputs]
        self._guards = [guards.parse(text) for text in method.input_guards]  # (validated on load)
        self._guard_leaves = sorted({leaf for tree in self._guards for leaf in guards.leaves(tree)})
        self._guards_met: dict[tuple, None] = {}  # sizes the guards held at (the last SHAPES_KEPT, first in first out)
        # (most methods: nothing to check per call)
        self._sizes_checked = bool(self._guards or method.size_minimums or method.derived_sizes)

    def _plan(self, io, graphs: bool, per_call: frozenset[int] = frozenset(), shapes: dict | None = None,
              record: tuple[int, ...] = (), measure: bool = False, caller: CallerPlan | None = None) -> Plan:
        api = self.streams.api if self.streams is not None else None
        caller = caller or self.caller
        inside = CallerPlan(True, self.streams) if graphs and not caller.captured else caller  # the outermost's streams
        ctx = BindContext(self._delegates_for(inside), self.streams, api.page_locked if api is not None else None,
                          self.transport, measure, inside)
        bound = bind_method(self.method, self.memory, ctx, io=io, per_call=per_call, shapes=shapes)
        kind = api.device_type if api is not None else None
        # a dynamic method with graphs: the plan that runs each shape's first call (it records the
        # sizes) runs its device work on the capture streams of the devices it works on, as the
        # captured plans do (on CUDA the caller's stream then makes no cuBLAS workspace of its own:
        # 32 MiB); each call pays the streams' ordering. A shape's plan bound without graphs (a call
        # the caller does not expect again) runs on the caller's stream, as eager does
        stands_in = () if graphs or not (record and self._graphs and kind is not None) else tuple(
            dict.fromkeys(w.device.index for w in schedule(bound.steps, kind).segments() if w.device is not None))
        return Plan(self.name, bound, schedule(bound.steps, kind, graphs), schedule(bound.steps, kind), self.streams,
                    list(self.method.outputs), record, schedule(bound.steps, kind, graphs, pending=True),
                    self.transport, stands_in)

    def _delegates_for(self, inside: CallerPlan):
        """The delegate loader a plan binds with. A dynamic method with graphs binds its first plan
        without them, but its plans per shape are captured later: a delegate (loaded once, by the
        first plan) loads as for those (an inductor delegate's load on the capture stream), while
        the plan's own kernel choices stay those of a plan run eagerly."""
        if inside.captured or not (self._graphs and self._dynamic and self.streams is not None):
            return self._delegate
        later = CallerPlan(True, self.streams)
        return lambda index, memory=(), caller=NOT_CAPTURED: self._delegate(
            index, memory, caller if caller.captured else later)

    @property
    def notes(self) -> tuple[str, ...]:
        return self.plan.notes

    def finish(self) -> None:
        """Wait for copies a call left in flight (a micro-batch that failed part way)."""
        if self.transport is not None:
            try:
                self.transport.finish()
            except FerryError:  # the error that stopped the call is the one to report
                pass
        if self.streams is not None:
            self.streams.wait_host()

    @property
    def graphs(self):
        plans = (self.plan, *([self._parts] if self._parts is not None else []), *self._by_shape.values())
        unique = {id(p): p for p in plans}  # a shape that kept the generic plan lists it once
        return [g for p in unique.values() for g in p.graphs]

    def graph_report(self) -> list[ShapeGraphs]:
        """What each plan captured as CUDA graphs (graph_report.py): a static method's one plan;
        a dynamic method's plan for each shape seen (its plan for any shape is never captured)."""
        if not self._dynamic:
            return [shape_graphs(None, self.plan)]
        return [shape_graphs(tuple(s[0] for s in shape if isinstance(s, tuple)), plan)
                for (part, shape), plan in self._by_shape.items() if not part and plan is not self.plan]

    def _warn_if_nothing_captured(self) -> None:
        """Asked for graphs and none can be captured: said once, with why."""
        if self._graphs and not self._warned:
            why = nothing_captured(self.graph_report(), self.streams is not None)
            if why:
                self._warned = True
                warnings.warn(f"method {self.name!r} was loaded with cuda_graphs=True but captures no graph: {why}",
                              RuntimeWarning, stacklevel=4)

    def shape_plans(self) -> int:
        """How many shapes have a plan of their own (a method with dynamic sizes)."""
        return len(self._by_shape)

    def _part_plan(self) -> Plan:
        """The plan for micro-batches (runtime/parallel/microbatch.py), made on first use: the host inputs
        and outputs planned for staging a call's copies are bound per call instead, to the
        part's rows of the caller's (page-locked) batch and of the joined result, so that a
        part never waits for the previous one to leave that staging memory."""
        if self._parts is None:
            m = self.method
            self._host_io = frozenset(vid for vid in (*m.inputs, *m.outputs) if isinstance(v := m.values[vid], TensorValue)
                                      and v.storage == "planned" and v.device.is_cpu)
            self._parts = self._plan(None, self._graphs and not self._dynamic, self._host_io, record=self._dynamic)
        return self._parts

    @property
    def caller_owned_outputs(self) -> frozenset[int]:
        return self.last_plan.caller_owned

    @property
    def constant_outputs(self) -> frozenset[int]:
        return self.plan.io.constant_outputs

    def rebind(self, inputs, outputs, caller: CallerPlan):
        """Tensors a delegate's caller passes the same on every call (its planned inputs and
        outputs): a new plan bound to them like to planned memory (no per-call binding, fast
        kernel paths). Returns the zero-argument call."""
        m = self.method
        io = {vid: t for vid, t in zip(m.inputs, inputs)
              if isinstance(m.values[vid], TensorValue) and m.tensor(vid).storage == "input"}
        for vid, t in zip(m.outputs, outputs):  # outputs an instruction writes into; the rest are copied
            if vid not in io and isinstance(m.values[vid], TensorValue) and m.tensor(vid).storage == "output":
                io[vid] = t
        shapes = None
        if self._dynamic:  # bound at the shapes a call with these tensors recorded, or per call
            shapes = self._sizes.get(_shape_key(inputs))
            if shapes is None:
                return None
        plan = self._plan(io, False, shapes=shapes, caller=caller)
        # outputs the plan does not write in place, also one given but bound otherwise (a shape's
        # plan makes a result its kernel lays out unlike the caller's tensor in memory of its own)
        slots, fixed = plan.bound.slots, plan.bound.fixed
        copy_back = [(t, vid) for vid, t in zip(m.outputs, outputs) if not (fixed[vid] and _writes_into(slots[vid], t))]
        return lambda: plan.run_bound(copy_back)

    def check_inputs(self, inputs, rows: int | None = None, part_of: int | None = None) -> None:
        """What a call on `inputs` must meet; `rows`: the batch the call runs at (padded to a
        shape bucket), where the minimums and guards must hold as well as at the caller's.
        `part_of`: `inputs` are one micro-batch of a call of that many rows (checked whole by the
        caller: `check_sizes`)."""
        if len(inputs) != len(self._inputs):
            raise InputError(f"method {self.name!r} takes {len(self._inputs)} inputs, got {len(inputs)}")
        for i, bound in self._int_bounds.items():
            _check_int_input(self.name, i, inputs[i], bound)
        for i, (t, v, expected) in enumerate(zip(inputs, self._inputs, self._expected)):
            if v is None:
                continue  # a size, computed by the caller (checked above)
            if expected is not None and _is_expected(t, *expected):
                continue
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{_label(i, v)} of {self.name!r} must be a torch.Tensor, got {type(t).__name__}")
            _check_input(self.name, i, t, v)
            if i in self._storage_read and not _owns_its_storage(t):
                raise InputError(f"{_label(i, v)} of {self.name!r} is read through its storage (as_strided with a storage "
                                 "offset), which counts from the start of the tensor: pass a contiguous tensor that "
                                 "owns its storage (x.contiguous().clone()), not a view into a larger one")
        for group in self.method.equal_sizes:  # dims export traced as one dynamic size
            sizes = [_size_of(inputs[i], d) for i, d in group]
            if len(set(sizes)) > 1:
                named = ", ".join(f"{_label(i, self._inputs[i])}{'' if d < 0 else f' dim {d}'} is {n}"
                                  for (i, d), n in zip(group, sizes))
                raise InputError(f"inputs of {self.name!r} disagree on one dynamic size: {named}; the program was "
                                 "exported with these dims equal (one torch.export.Dim)")
        if not self._sizes_checked:
            return
        if part_of is not None:
            self.check_sizes(inputs, None, f"a micro-batch of {_rows_of(inputs)} rows of a call of {part_of}")
            return
        self.check_sizes(inputs)  # as the caller made the call: as ep.module() checks it
        if rows is not None and inputs and rows != _rows_of(inputs):  # and as it runs: padded to a bucket
            self.check_sizes(inputs, rows, f"the call runs padded to the shape bucket of {rows} rows")

    def check_sizes(self, inputs, rows: int | None = None, run_as: str = "") -> None:
        """The minimums and guards export recorded (`torch._check`, a branch on a size): the graph
        is right only where each holds, so ep.module() refuses a call where one fails, and so
        does ferry. `rows`, `run_as`: the batch (dim 0) the graph runs at, where it is not the
        caller's, and why (a bucket, a micro-batch)."""
        def size_of(i: int, d: int) -> int:
            return rows if rows is not None and d == 0 else _size_of(inputs[i], d)

        def named(i: int, d: int) -> str:
            return _label(i, self._inputs[i]) + ("" if d < 0 else f" dim {d}")

        where = f" ({run_as})" if run_as else ""
        for i, d, a, b, root, root_dim in self.method.derived_sizes:  # a*s + b, as export traced the dim
            self._check_derived(size_of, where, i, d, a, b, root, root_dim)
        for i, d, low in self.method.size_minimums:
            if size_of(i, d) < low:
                raise InputError(f"{named(i, d)} of {self.name!r} is {size_of(i, d)}{where}, below {low}, the minimum "
                                 "the program was exported with (export it with a smaller torch.export.Dim min to call "
                                 "it there)")
        if not self._guards:
            return
        key = (rows, *(size_of(i, d) for i, d in self._guard_leaves))
        if key in self._guards_met:
            return
        for tree in self._guards:
            if not guards.evaluate(tree, size_of):
                text = guards.render(tree, self._leaf_name)
                sizes = ", ".join(sorted({f"{self._leaf_name(i, d)} is {size_of(i, d)}" for i, d in guards.leaves(tree)}))
                raise InputError(f"inputs of {self.name!r} fail a check the program was exported under: {text} "
                                 f"({sizes}{'; ' + run_as if run_as else ''}); the graph export traced is right only "
                                 "where it holds (export at sizes that meet it, or without the check in the model)")
        remember(self._guards_met, key, None)

    @property
    def checks_sizes(self) -> bool:
        """Whether a call's sizes have minimums or guards to meet (most methods: none)."""
        return self._sizes_checked

    def runs_at(self, inputs, rows: int | None = None) -> bool:
        """Whether the minimums and guards hold with the batch (dim 0) at `rows` (None: the
        call's own): whether a call on `inputs` may run padded to a shape bucket, or split into
        parts, of that many rows. False too for inputs the call's check will refuse anyway (a
        missing dim)."""
        if not self._sizes_checked:
            return True
        try:
            self.check_sizes(inputs, rows)
        except Exception:  # (InputError; an IndexError of a tensor of too few dims)
            return False
        return True

    def _leaf_name(self, i: int, d: int) -> str:
        return size_name(self.method, i, d)

    def _check_derived(self, size_of, run_as: str, i: int, d: int, a: int, b: int, root: int, root_dim: int) -> None:
        """Input `i`'s dim `d`, exported as a*s + b: that value of the size s where input `root`'s dim
        `root_dim` is s itself; else a value a*s + b takes for some integer s. `size_of(i, d)`: the
        sizes the graph runs at; `run_as`: why they are not the caller's."""
        size, what = size_of(i, d), f"{_label(i, self._inputs[i])} dim {d} of {self.name!r}"
        if root >= 0:
            s = size_of(root, root_dim)
            if size != a * s + b:
                where = _label(root, self._inputs[root]) + ("" if root_dim < 0 else f" dim {root_dim}")
                raise InputError(f"{what} is {size}{run_as}; the program was exported with it {a} * ({where}) + {b} "
                                 f"= {a * s + b}")
        elif (size - b) % a:
            raise InputError(f"{what} is {size}{run_as}; the program was exported with it {a} * s + {b} for a size s "
                             f"(a torch.export.Dim expression): pass a size of that form")

    def execute(self, inputs, bind_outputs=None, graphs: bool = True, finish: bool = True, part: bool = False) -> list:
        """One call. `graphs=False`: a new shape gets a plan without CUDA graphs (a shape the
        caller does not expect again). `part`: one micro-batch (Plan.execute says what
        `finish=False` asks of the caller)."""
        generic = self._part_plan() if part else self.plan
        if not self._dynamic:
            self.last_plan = generic
            return generic.execute(inputs, bind_outputs, finish, part)
        shape = _shape_key(inputs)
        plan = self._by_shape.get((part, shape))
        if plan is None:  # the first call at this shape finishes before its sizes are read
            self.last_plan = generic
            outs = generic.execute(inputs, bind_outputs, True, part)
            self._remember(part, shape, generic.shapes, graphs)
            return outs
        self._by_shape.move_to_end((part, shape))
        if shape in self._sizes:
            self._sizes.move_to_end(shape)
        self.last_plan = plan
        return plan.execute(inputs, bind_outputs, finish, part)

    def execute_padded(self, inputs, rows: int) -> list | None:
        """One call of fewer rows than `rows` on the plan bound at `rows`, the inputs padded as
        they are copied into its planned memory (one copy, not a padded copy and then a
        planned one); None when there is no such plan yet or it binds an input in place."""
        shape = tuple(((rows, *t.shape[1:]), contiguous_strides((rows, *t.shape[1:]))) for t in inputs)
        plan = self._by_shape.get((False, shape))
        if plan is None or not plan.copies_inputs or not all(t.is_contiguous() for t in inputs):
            return None
        self._by_shape.move_to_end((False, shape))
        self.last_plan = plan
        return plan.execute(inputs, pad_to=rows)

    def _remember(self, part: bool, shape: tuple, sizes: dict | None, graphs: bool) -> None:
        if sizes is None:
            return
        per_call = self._host_io if part else frozenset()
        try:
            plan = self._plan(None, self._graphs and graphs, per_call, shapes=sizes)
        except FerryError as e:  # this shape keeps the generic plan: correct, and as fast as before
            warnings.warn(f"method {self.name!r}: calls at input shapes {[s[0] for s in shape if isinstance(s, tuple)]} "
                          f"run without a plan of their own ({e})", RuntimeWarning, stacklevel=4)
            self._by_shape[(part, shape)] = self._part_plan() if part else self.plan
        else:
            self._sizes[shape] = sizes
            self._by_shape[(part, shape)] = plan
            if graphs and not part:
                self._warn_if_nothing_captured()
        for kept in (self._sizes, self._by_shape):
            while len(kept) > SHAPES_KEPT:
                kept.popitem(last=False)

    def close(self) -> None:
        self.memory.close()


def _writes_into(slot, t: torch.Tensor) -> bool:
    """The plan's tensor `slot` is `t`'s memory, laid out as `t` is."""
    return slot is t or (isinstance(slot, torch.Tensor) and slot.data_ptr() == t.data_ptr()
                         and slot.shape == t.shape and same_strides(t.shape, slot.stride(), t.stride()))


def _owns_its_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _shape_key(inputs) -> tuple:
    """What a plan bound per shape depends on: each input's shape and strides (kernels lay some
    results out as their inputs are laid out; sizes passed in: their values)."""
    return tuple((tuple(t.shape), t.stride()) if isinstance(t, torch.Tensor) else int(t) for t in inputs)


def _unusable(t: torch.Tensor) -> str:
    """What makes `t` no plain dense tensor with values a program can read, or ''."""
    if t.is_meta:
        return "a meta tensor (it has no data)"
    if t.layout != torch.strided:
        return f"a {str(t.layout).removeprefix('torch.')} tensor"
    if t.is_nested:
        return "a nested tensor"
    if t.is_quantized:
        return "a quantized tensor"
    if t.is_conj() or t.is_neg():
        return "a lazy conjugate or negated view (call .resolve_conj().resolve_neg() first)"
    if t.requires_grad:
        return "a tensor that requires grad (ferry runs inference: pass tensor.detach())"
    return ""


def _expected_cuda_tensor(v: TensorValue | None):
    """(torch device, dtype, shape) of a fixed-shape CUDA input: what one call's fast check
    compares (CUDA memory needs no allocator to say whose it is); None for the rest."""
    if v is None or v.device.type != "cuda" or v.dynamic:
        return None
    return v.device.to_torch(), v.torch_dtype, torch.Size(v.shape)


def _is_expected(t, device, dtype, shape) -> bool:
    """`_check_input` would accept `t`: a plain dense CUDA tensor on `device` of `dtype` and `shape`."""
    return (type(t) is torch.Tensor and t.device == device and t.dtype is dtype and t.layout is torch.strided
            and not t.is_nested and not t.is_quantized and t.shape == shape and not t.requires_grad
            and not t.is_conj() and not t.is_neg())


def _label(i: int, v) -> str:
    """An input as a message names it: its position, and its name at export where the file has it."""
    name = getattr(v, "name", "")
    return f"input {i} ({name!r})" if name else f"input {i}"


def _rows_of(inputs) -> int | None:
    """The batch (dim 0) of a call: its first tensor input's."""
    return next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)


def _size_of(x, d: int) -> int:
    """Dim `d` of a tensor input, or an int input's value (d = -1)."""
    return operator.index(x) if d < 0 else x.shape[d]


def _check_int_input(name: str, i: int, n, bound: int) -> None:
    """An int input: an integer (a Python, NumPy or 0-dim tensor one) no larger than its bound
    (the memory of what it sizes is planned for it)."""
    try:
        n = operator.index(n)
    except TypeError:
        raise InputError(f"input {i} of {name!r} must be an int, got {type(n).__name__}") from None
    if n > bound:
        raise InputError(f"input {i} of {name!r} is {n}, above {bound}, the bound the program was exported with "
                         "(export it with a larger bound, e.g. torch._check(n <= ...), to call it there)")


def _check_input(name: str, i: int, t: torch.Tensor, v: TensorValue) -> None:
    kind = _unusable(t)
    if kind:
        raise InputError(f"{_label(i, v)} of {name!r} is {kind}; pass a plain dense tensor with its values")
    if t.dtype != v.torch_dtype:
        raise InputError(f"{_label(i, v)} of {name!r} must be {v.dtype}, got {str(t.dtype).removeprefix('torch.')}")
    dyn = v.dynamic or (False,) * len(v.shape)
    if t.dim() != len(v.shape) or any((s > b) if d else (s != b) for s, b, d in zip(t.shape, v.shape, dyn)):
        bound = ", ".join(f"<={b}" if d else str(b) for b, d in zip(v.shape, dyn))
        raise InputError(f"{_label(i, v)} of {name!r} must have shape ({bound}), got {tuple(t.shape)}")
    dev = device_of(t)
    if dev != v.device:
        hint = (" (this input is placed on the device by skip_h2d_for_method_inputs: pass a tensor already there)"
                if not v.device.is_cpu else "")
        raise InputError(f"{_label(i, v)} of {name!r} must be on {v.device}, got a tensor on {dev}{hint}")
