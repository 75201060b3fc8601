"""A loaded method: planned buffers allocated per device, instructions bound to kernels.

Everything that can be decided at load is: each instruction becomes a ready-to-call step
(a functools.partial when all its arguments live in planned memory), so executing a method
is a loop over steps with no lookups, and no allocation on any device.
"""

from __future__ import annotations

import functools
import operator
import warnings

import torch

from ferry.device import Device
from ferry.errors import InputError, InternalError, ProgramError
from ferry.program.schema import (
    DEFAULT_ARG, ConstValue, DelegateCall, KernelCall, Method, Program, TensorValue,
)
from ferry.runtime.allocator import DeviceMemoryBuffer, as_bytes, get_allocator
from ferry.program.lifetimes import tensor_ids
from ferry.runtime.cuda import CopyStreams
from ferry.runtime.cuda_graphs import GraphSegment
from ferry.runtime.kernels import CopyKernel, bind_aten, fast_aten
from ferry.runtime.tensor import device_of, make_tensor

_COPY_KERNELS = {"et_copy::_h2d_copy.out": "h2d", "et_copy::_d2h_copy.out": "d2h", "et_copy::_d2d_copy.out": "d2d"}


def resolve_op(name: str) -> torch._ops.OpOverload:
    from ferry.aot.out_variants import resolve_kernel

    try:
        return resolve_kernel(name)
    except LookupError as e:
        raise ProgramError(str(e)) from None


def _const(v: ConstValue):
    k, x = v.kind, v.value
    if k == "dtype":
        from ferry.program.schema import dtype_from_name

        return dtype_from_name(x)
    if k in ("layout", "memory_format"):
        return getattr(torch, x)
    if k == "device":
        return torch.device(x)
    if k in ("ints", "floats", "bools"):
        return list(x)
    return x


LIST_KINDS = ("tensors", "opt_tensors", "symints")

# kernels of the sizes arithmetic torch.export records with Python operators
SYM_OPS = {
    "ferry::sym_add": operator.add, "ferry::sym_sub": operator.sub, "ferry::sym_mul": operator.mul,
    "ferry::sym_floordiv": operator.floordiv, "ferry::sym_mod": operator.mod, "ferry::sym_neg": operator.neg,
}


def _resolve(ref, slots):
    kind, x = ref
    if kind == "c":
        return x
    if kind == "v":
        return slots[x]
    return [None if e is None else slots[e] for e in x]


def _uses_cuda(method: Method) -> bool:
    return any(b.device.type == "cuda" for b in method.buffers) or any(
        isinstance(v, TensorValue) and v.device.type == "cuda" for v in method.values)


def empty_on(device: Device, shape, dtype: torch.dtype) -> torch.Tensor:
    """A caller-owned tensor on `device`, allocated through the registry (for outputs the caller keeps)."""
    if device.is_cpu:
        return torch.empty(shape, dtype=dtype)
    nbytes = 1
    for s in shape:
        nbytes *= s
    nbytes *= dtype.itemsize
    buf = DeviceMemoryBuffer.create(nbytes, device)
    t = make_tensor(buf.memory, shape, dtype, device)
    t._ferry_buffer = buf
    return t


def constant_tensor(segment, v: TensorValue) -> torch.Tensor:
    """A CPU tensor over a program segment (a mapped file region): no copy."""
    dtype = v.torch_dtype
    if v.nbytes == 0:
        return torch.empty(v.shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only mapping: ferry never writes constants
        raw = torch.frombuffer(segment, dtype=torch.uint8, count=v.nbytes)
    return raw.view(dtype).view(v.shape)


class LoadedMethod:
    def __init__(self, program: Program, method: Method, delegate_handle, *, pin_host: bool = True,
                 cuda_graphs: bool = False):
        self.program = program
        self.method = method
        self.name = method.name
        self._owned: list[DeviceMemoryBuffer] = []
        try:
            self._load(delegate_handle, pin_host, cuda_graphs)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- load

    def _load(self, delegate_handle, pin_host, cuda_graphs=False):
        m = self.method
        has_copies = any(isinstance(i, KernelCall) and i.kernel in _COPY_KERNELS for i in m.instructions)
        buffers = [None]
        for buf in m.buffers[1:]:
            b = DeviceMemoryBuffer.create(buf.size, buf.device, pin_memory=pin_host and has_copies and buf.device.is_cpu)
            self._owned.append(b)
            buffers.append(b)
        slots: list = [None] * len(m.values)
        static = [True] * len(m.values)
        mutable_ids = {mb.value for mb in m.mutable_buffers}
        scratch = self._unread_out_args()
        for vid, v in enumerate(m.values):
            if isinstance(v, ConstValue):
                if v.kind in LIST_KINDS:
                    continue  # built after the values they list
                slots[vid] = _const(v)
                if v.kind == "symint":
                    static[vid] = False  # computed each call from the input shapes
            elif v.plan is not None:
                mem = buffers[v.plan.buffer]
                if mem is None:
                    raise ProgramError(f"value {vid} is planned in buffer 0, which is reserved for constants")
                slots[vid] = make_tensor(mem.memory, v.shape, v.torch_dtype, v.device, v.plan.offset)
                if vid in mutable_ids and v.constant is not None:
                    self._fill(slots[vid], v)
            elif v.constant is not None:
                slots[vid] = self._upload_constant(v)
            elif vid in scratch:
                # an out argument nobody reads (batch norm's saved statistics in eval, ...): a plain,
                # resizable PyTorch tensor made once; if the kernel needs it larger on this device
                # than the trace said, it grows (once) instead of writing over planned neighbours
                slots[vid] = torch.empty(v.shape, dtype=v.torch_dtype, device=v.device.to_torch())
            else:
                static[vid] = False  # caller-owned, allocated per call, or a view of one
        self.streams = CopyStreams() if _uses_cuda(m) else None
        staged = self._stage_caller_tensors(slots, static, scratch) if cuda_graphs and self.streams is not None else {}
        self.slots, self.static = slots, static
        self._fix_static_lists()
        self._graphs: list = []
        self._graph_notes: list[str] = []
        self._shape_key = None
        self._delegate_handle = delegate_handle
        bound = [self._bind(i, ins, delegate_handle) for i, ins in enumerate(m.instructions)]
        self.steps = self._schedule(bound, cuda_graphs)
        # the first call checks that every kernel wrote the shapes the program was planned for
        self._first_steps = self._schedule(self._with_shape_checks(bound), False)
        self._checked = False
        self.inputs = list(m.inputs)
        self.outputs = list(m.outputs)
        self._input_values = [v if isinstance(v := m.values[i], TensorValue) else None for i in m.inputs]
        self._per_call_outputs = [
            (vid, v) for vid, v in enumerate(m.values)
            if isinstance(v, TensorValue) and v.plan is None and v.constant is None and v.alias_of is None
            and vid not in m.inputs and vid not in scratch and vid in self._written_through_out and not static[vid]
        ]
        self._input_modes = [
            "copy" if v is not None and v.plan is not None else "stage" if vid in staged else "bind"
            for vid, v in zip(self.inputs, self._input_values)
        ]
        # a staged input handed straight back is the caller's own tensor, not the staging copy
        self._passthrough = [(i, staged[vid]) for i, vid in enumerate(self.outputs) if vid in staged]

    def _stage_caller_tensors(self, slots, static, scratch) -> dict[int, int]:
        """For CUDA graphs: give the method's device inputs and fresh device outputs (skip_h2d /
        skip_d2h) fixed tensors of their own, allocated here. A call copies each input into its
        fixed tensor on the device (stream-ordered, at device bandwidth) and outputs are handed
        out as planned outputs are, so the segments that read or write them keep fixed addresses
        and can be captured. Dynamic shapes keep the caller's tensors (and run without a graph).
        Returns {value id: input position} of the staged inputs."""
        m = self.method
        written = self._written_through_out
        staged = {}
        for pos, vid in enumerate(m.inputs):
            v = m.values[vid]
            if isinstance(v, TensorValue) and v.plan is None and v.device.type == "cuda" and not any(v.dynamic):
                slots[vid], static[vid] = self._owned_empty(v), True
                staged[vid] = pos
        for vid in m.outputs:
            v = m.values[vid]
            if (isinstance(v, TensorValue) and v.plan is None and v.constant is None and v.alias_of is None
                    and v.device.type == "cuda" and not any(v.dynamic) and not static[vid]
                    and vid in written and vid not in scratch and vid not in m.inputs):
                slots[vid], static[vid] = self._owned_empty(v), True
        return staged

    def _owned_empty(self, v: TensorValue) -> torch.Tensor:
        buf = DeviceMemoryBuffer.create(v.nbytes, v.device)
        self._owned.append(buf)
        return make_tensor(buf.memory, v.shape, v.torch_dtype, v.device)

    def _fix_static_lists(self) -> None:
        """A list whose members are all fixed is built once; the others are built per call."""
        for vid, v in enumerate(self.method.values):
            if isinstance(v, ConstValue) and v.kind in LIST_KINDS:
                self.static[vid] = all(self.static[x] for x in v.value if x is not None)
                if self.static[vid]:
                    self.slots[vid] = [None if x is None else self.slots[x] for x in v.value]

    def _unread_out_args(self) -> set[int]:
        """Unplanned values written through an out argument that no instruction, output or
        mutable buffer reads."""
        m = self.method
        read = set(m.outputs) | {mb.update for mb in m.mutable_buffers}
        for ins in m.instructions:
            for a in ins.args:
                if a in ins.outputs:
                    continue
                read.update(tensor_ids(m, a))
                v = m.values[a] if 0 <= a < len(m.values) else None
                if isinstance(v, TensorValue) and v.alias_of is not None:
                    read.add(v.alias_of)
        return {
            o for ins in m.instructions if isinstance(ins, KernelCall) and ins.kernel not in _COPY_KERNELS
            for o in ins.outputs
            if o in ins.args and o not in read and m.tensor(o).plan is None and m.tensor(o).constant is None
        }

    @functools.cached_property
    def caller_owned_outputs(self) -> set[int]:
        """Output positions whose tensors the caller owns without a copy: fresh per call, or an
        unplanned input handed back (the caller's own tensor, e.g. a skip_h2d device input)."""
        fresh = {vid for vid, _ in self._per_call_outputs}
        passed_in = {vid for vid, v in zip(self.inputs, self._input_values) if v.plan is None}
        return {i for i, vid in enumerate(self.outputs) if vid in fresh or vid in passed_in}

    @functools.cached_property
    def constant_outputs(self) -> set[int]:
        """Output positions that are (views of) host constants: memory of the program itself,
        a read-only mapping when the program came from a file, never to be handed out to write."""
        found = set()
        for i, vid in enumerate(self.outputs):
            v = self.method.values[vid]
            root = self.method.values[v.alias_of] if isinstance(v, TensorValue) and v.alias_of is not None else v
            if isinstance(root, TensorValue) and root.constant is not None and root.plan is None and root.device.is_cpu:
                found.add(i)
        return found

    @functools.cached_property
    def _written_through_out(self) -> set[int]:
        """Values an instruction writes into (delegate outputs, copy and out-variant outputs), as
        opposed to values a functional op returns."""
        written = set()
        for ins in self.method.instructions:
            if isinstance(ins, DelegateCall) or (ins.outputs and set(ins.outputs) <= set(ins.args)):
                written.update(ins.outputs)
        return written

    def _fill(self, dst: torch.Tensor, v: TensorValue) -> None:
        src = constant_tensor(self.program.segments[v.constant], v)
        if v.device.is_cpu:
            dst.copy_(src)
        else:
            get_allocator(v.device.type).copy_host_to_device(as_bytes(dst), as_bytes(src), v.nbytes, v.device.index)

    def _upload_constant(self, v: TensorValue) -> torch.Tensor:
        """CPU constants are views of the mapped file; device constants are uploaded once, here."""
        host = constant_tensor(self.program.segments[v.constant], v)
        if v.device.is_cpu:
            return host
        t = self._owned_empty(v)
        if v.nbytes:
            get_allocator(v.device.type).copy_host_to_device(as_bytes(t), as_bytes(host), v.nbytes, v.device.index)
        return t

    # ---------------------------------------------------------------- bind

    def _ref(self, vid):
        """('c', value) for what is fixed at load, ('v', id) for a value of this call, ('l', ids)
        for a list with members of this call (built when the instruction runs)."""
        if self.static[vid]:
            return ("c", self.slots[vid])
        v = self.method.values[vid]
        if isinstance(v, ConstValue) and v.kind in LIST_KINDS:
            return ("l", list(v.value))
        return ("v", vid)

    def _bind(self, index: int, ins, delegate_handle):
        m = self.method
        if isinstance(ins, DelegateCall):
            handle = delegate_handle(ins.delegate)
            args, outs = list(ins.args), list(ins.outputs)
            slots = self.slots
            devs = {m.tensor(o).device for o in outs}
            cuda_index = next((d.index for d in devs if d.type == "cuda"), None)
            run = None
            if all(self.static[a] for a in args) and all(self.static[o] for o in outs) and hasattr(handle, "bind_static"):
                # planned tensors in and out: the delegate binds them once, here
                run = handle.bind_static([slots[a] for a in args], [slots[o] for o in outs])
            if run is None:
                def run():
                    handle.execute([slots[a] for a in args], [slots[o] for o in outs])
            if cuda_index is not None:
                current = torch.cuda.current_device

                def run_on_gpu():
                    if current() == cuda_index:  # the common case: skip the device switch
                        return run()
                    with torch.cuda.device(cuda_index):
                        run()
                return run_on_gpu
            return run
        if ins.kernel in _COPY_KERNELS:
            src_id, out_id = ins.args
            src_v, out_v = m.tensor(src_id), m.tensor(out_id)
            kernel = CopyKernel(_COPY_KERNELS[ins.kernel], src_v.device, out_v.device,
                                out_v.nbytes if out_v.plan is not None else None)
            devices = (src_v.device, out_v.device)
            fixed = self.static[src_id] and self.static[out_id] and not any(src_v.dynamic) and not any(out_v.dynamic)
            if self.streams is not None and any(d.type == "cuda" for d in devices):
                slots = self.slots
                if fixed:
                    return self.streams.bind(index, kernel.bind_static(slots[src_id], slots[out_id]), devices,
                                             src_v.nbytes)
                run = self.streams.run
                return lambda: run(index, kernel, slots[src_id], slots[out_id], devices)
            if fixed:
                return kernel.bind_static(self.slots[src_id], self.slots[out_id])
            if self.static[src_id] and self.static[out_id]:
                return functools.partial(kernel, self.slots[src_id], self.slots[out_id])
            slots = self.slots
            return lambda: kernel(slots[src_id], slots[out_id])
        if ins.kernel in SYM_OPS:  # arithmetic on dynamic sizes
            fn, refs, (out,) = SYM_OPS[ins.kernel], [self._ref(a) for a in ins.args], ins.outputs
            slots = self.slots

            def sym_step():
                slots[out] = fn(*[_resolve(r, slots) for r in refs])

            return sym_step
        op = resolve_op(ins.kernel)
        pos, kw = bind_aten(op, ins.args, self._ref)
        out_is_arg = all(o in ins.args for o in ins.outputs) and bool(ins.outputs)
        dynamic_outs = [o for o in ins.outputs if isinstance(m.values[o], TensorValue)
                        and any(m.tensor(o).dynamic) and m.tensor(o).plan is not None]
        if out_is_arg and dynamic_outs:
            return self._bind_dynamic_out(op, pos, kw, dynamic_outs)
        if out_is_arg and all(r[0] == "c" for r in pos) and all(r[0] == "c" for r in kw.values()):
            args, kwargs = [r[1] for r in pos], {k: r[1] for k, r in kw.items()}
            return functools.partial(fast_aten(op, args, kwargs) or op, *args, **kwargs)
        slots = self.slots
        outputs = ins.outputs

        def step():
            a = [_resolve(r, slots) for r in pos]
            k = {n: _resolve(r, slots) for n, r in kw.items()}
            result = op(*a, **k)
            if not out_is_arg and outputs:
                if len(outputs) == 1:
                    slots[outputs[0]] = result
                else:
                    for o, r in zip(outputs, result):
                        slots[o] = r

        if not out_is_arg and all(self.static[r[1]] if r[0] == "v" else True for r in pos) and self._is_view(ins):
            # a view of planned memory is computed once, here
            step()
            for o in outputs:
                self.static[o] = True
            return None
        return step

    def bind_io(self, inputs, outputs) -> None:
        """Bind tensors the caller passes the same on every call (a delegate's planned inputs and
        outputs) once: the steps are then bound to them like to planned memory, so a call does
        no per-call binding and the kernels take the fast path."""
        m = self.method
        bound = {}
        for vid, t in zip(self.inputs, inputs):
            if m.tensor(vid).plan is None:
                bound[vid] = t
        bound_outputs = set()
        for vid, t in zip(self.outputs, outputs):
            # only outputs an instruction writes into; a view, an input or a run-time result is copied over
            if not self.static[vid] and vid not in bound and vid in self._written_through_out:
                bound[vid] = t
                bound_outputs.add(vid)
        for vid, t in bound.items():
            self.slots[vid], self.static[vid] = t, True
        self._fix_static_lists()
        for name in ("_transient", "caller_owned_outputs"):
            self.__dict__.pop(name, None)
        self._per_call_outputs = [(vid, v) for vid, v in self._per_call_outputs if vid not in bound]
        bound_steps = [self._bind(i, ins, self._delegate_handle) for i, ins in enumerate(m.instructions)]
        self.steps = self._schedule(bound_steps, False)
        self._first_steps = self._schedule(self._with_shape_checks(bound_steps), False)
        self._copy_back = [(t, vid) for vid, t in zip(self.outputs, outputs) if vid not in bound_outputs]

    def run_bound(self) -> None:
        """Run with the tensors given to bind_io."""
        for step in self.steps if self._checked else self._first_steps:
            step()
        self._checked = True
        slots = self.slots
        for t, vid in self._copy_back:
            src = slots[vid]
            if src is t:
                continue
            if t.shape != src.shape:
                t.resize_(src.shape)
            t.copy_(src)

    def _with_shape_checks(self, steps):
        """Steps that, after each out-variant kernel, check its planned outputs kept their planned
        shapes. Planning follows the trace; a kernel that writes a larger output on some device
        than the trace said would write past its slot, so the first call turns that into an error
        instead of a wrong result (outputs nobody reads are not planned, so they may differ)."""
        m, slots = self.method, self.slots
        out = []
        for step, ins in zip(steps, m.instructions):
            planned = [] if step is None or isinstance(ins, DelegateCall) else [
                (o, m.tensor(o).shape) for o in ins.outputs
                if o in ins.args and m.tensor(o).plan is not None and not any(m.tensor(o).dynamic)
            ]
            if not planned:
                out.append(step)
                continue

            def checked(step=step, planned=planned, kernel=ins.kernel):
                step()
                for o, shape in planned:
                    if tuple(slots[o].shape) != shape:
                        raise InternalError(
                            f"{kernel} wrote a {tuple(slots[o].shape)} output where the program planned {shape} "
                            f"(value {m.values[o].name!r}): this device's kernel disagrees with the traced shape, "
                            "so its memory plan is unsafe; please report it to ferry"
                        )

            out.append(checked)
        return out

    def _bind_dynamic_out(self, op, pos, kw, dynamic_outs):
        """Outputs with a dynamic dim are planned at their bound: shrink them to empty before the
        op so it sizes them (no resize warning), then check they stayed within their plan."""
        slots, m = self.slots, self.method
        capacity = [(o, m.tensor(o).nbytes) for o in dynamic_outs]

        def step():
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

        return step

    # ---------------------------------------------------------------- schedule

    def _step_kind(self, ins) -> tuple[str, int | None, bool]:
        """('host' | 'device', cuda index, touches host memory) of one instruction."""
        m = self.method
        devs = {m.tensor(v).device for v in ins.outputs if isinstance(m.values[v], TensorValue)}
        if isinstance(ins, KernelCall) and ins.kernel in _COPY_KERNELS:
            devs |= {m.tensor(ins.args[0]).device}
        cuda = sorted({d.index for d in devs if d.type == "cuda"})
        if not cuda:
            return "host", None, True
        single = cuda[0] if len(cuda) == 1 else -1
        return "device", single, any(d.is_cpu for d in devs)

    def _capturable(self, ins) -> bool:
        """Every address fixed, and host memory page-locked: a captured copy from pageable memory
        would go through a staging buffer filled once, at capture, and replay stale data."""
        ids = [a for a in ins.args if a != DEFAULT_ARG] + list(ins.outputs)
        if not all(self.static[i] for i in ids):
            return False
        m = self.method
        return all(self.slots[i].is_pinned() for i in ids
                   if isinstance(m.values[i], TensorValue) and m.tensor(i).device.is_cpu)

    def _schedule(self, steps, cuda_graphs: bool):
        """Drop load-time-only steps; make the host wait for pending copies exactly where host code
        next touches memory; group device segments (runs of steps on one GPU) into CUDA graphs
        when asked."""
        if self.streams is None:
            return [s for s in steps if s is not None]
        out, pending, segment = [], False, []
        wait = self.streams.wait_host

        def close_segment():
            if not segment:
                return
            index = segment[0][1]
            if cuda_graphs and index != -1 and all(k[3] for k in segment):
                label = f"method {self.name!r} instructions {segment[0][4]}..{segment[-1][4]}"
                g = GraphSegment([k[0] for k in segment], index, self.streams, any(k[2] for k in segment), label)
                self._graphs.append(g)
                out.append(lambda g=g: g(self._shape_key))
            else:
                if cuda_graphs and index != -1:  # a copy between two GPUs simply runs between their graphs
                    self._graph_notes.append(
                        f"instructions {segment[0][4]}..{segment[-1][4]} run without a CUDA graph "
                        "(they read tensors the caller passes per call, or pageable host memory)")
                out.extend(k[0] for k in segment)
            segment.clear()

        for i, (step, ins) in enumerate(zip(steps, self.method.instructions)):
            if step is None:
                continue
            kind, idx, touches_host = self._step_kind(ins)
            if kind == "host":
                close_segment()
                if pending:
                    out.append(wait)
                    pending = False
                out.append(step)
            else:
                # one segment per GPU: a copy between two GPUs runs on its own, between their graphs
                if segment and (idx != segment[0][1] or idx == -1):
                    close_segment()
                segment.append((step, idx, touches_host, self._capturable(ins), i))
                pending = pending or touches_host
        close_segment()
        if pending:
            out.append(wait)
        return out

    def _is_view(self, ins) -> bool:
        """A view that can be made once, at load: of fixed planned memory, with a fixed shape."""
        m = self.method
        if not ins.outputs or not all(isinstance(m.values[o], TensorValue) and m.tensor(o).alias_of is not None
                                      for o in ins.outputs):
            return False
        if any(any(m.tensor(o).dynamic) for o in ins.outputs):
            return False  # its shape follows each call's input shapes
        return all(self.static[a] for a in ins.args if a != DEFAULT_ARG)

    # ---------------------------------------------------------------- run

    def check_inputs(self, inputs) -> None:
        if len(inputs) != len(self.inputs):
            raise InputError(f"method {self.name!r} takes {len(self.inputs)} inputs, got {len(inputs)}")
        for i, (t, v) in enumerate(zip(inputs, self._input_values)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"input {i} of {self.name!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != v.torch_dtype:
                raise InputError(f"input {i} of {self.name!r} must be {v.dtype}, got {str(t.dtype).removeprefix('torch.')}")
            dyn = v.dynamic or (False,) * len(v.shape)
            if t.dim() != len(v.shape) or any(
                (s > b) if d else (s != b) for s, b, d in zip(t.shape, v.shape, dyn)
            ):
                bound = ", ".join(f"<={b}" if d else str(b) for b, d in zip(v.shape, dyn))
                raise InputError(f"input {i} of {self.name!r} must have shape ({bound}), got {tuple(t.shape)}")
            dev = device_of(t)
            if dev != v.device:
                hint = (" (this input is placed on the device by skip_h2d_for_method_inputs: pass a tensor already there)"
                        if not v.device.is_cpu else "")
                raise InputError(f"input {i} of {self.name!r} must be on {v.device}, got a tensor on {dev}{hint}")

    def execute(self, inputs, bind_outputs=None) -> list:
        """Run once. `bind_outputs` are tensors the outputs are written into (delegates)."""
        slots = self.slots
        for vid, v in self._per_call_outputs:
            slots[vid] = None
        for t, vid, mode in zip(inputs, self.inputs, self._input_modes):
            if mode == "bind":
                slots[vid] = t
            elif mode == "stage":
                slots[vid].copy_(t)
            else:
                dst = slots[vid]
                if dst.shape != t.shape:
                    dst.resize_(t.shape)
                dst.copy_(t)
        if bind_outputs is not None:
            for vid, t in zip(self.outputs, bind_outputs):
                if not self.static[vid] and slots[vid] is None:
                    slots[vid] = t
        for vid, v in self._per_call_outputs:
            if slots[vid] is None:
                slots[vid] = empty_on(v.device, v.shape, v.torch_dtype)
        if self._graphs:
            self._shape_key = tuple(tuple(t.shape) for t in inputs)
        try:
            for step in self.steps if self._checked else self._first_steps:
                step()
            self._checked = True
            for mb in self.method.mutable_buffers:
                if slots[mb.update] is not slots[mb.value]:
                    slots[mb.value].copy_(slots[mb.update])
            outs = [slots[vid] for vid in self.outputs]
            for i, pos in self._passthrough:
                outs[i] = inputs[pos]
            if bind_outputs is not None:
                for t, o in zip(bind_outputs, outs):
                    if o is not t:
                        if t.shape != o.shape:
                            t.resize_(o.shape)
                        t.copy_(o)
        finally:
            # drop this call's caller-owned tensors (inputs, per-call outputs, run-time
            # allocations): the method must not keep the caller's device memory alive
            for vid in self._transient:
                slots[vid] = None
        return outs

    @functools.cached_property
    def _transient(self) -> list[int]:
        """Slots that hold per-call tensors (everything not bound once at load)."""
        return [vid for vid, st in enumerate(self.static) if not st]

    def close(self) -> None:
        for b in self._owned:
            b.close()
        self._owned = []
