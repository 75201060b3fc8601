"""Emit: a placed graph becomes a ferry Method (values, instructions, plan) plus segments.

Every non-delegated functional op is emitted as its `.out` overload writing into a planned
value; views become aliases (no memory); ops with no out variant stay functional and are
listed in the method's report because they allocate at run time.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import cast

import torch
import torch.fx

from ferry import node_meta as M
from ferry.aot.config import MethodOptions
from ferry.aot.lower import LoweredBackendModule, is_delegate_node
from ferry.aot.plan import InPlace, PlanValue, plan_memory
from ferry.aot.values import ProgramBuilder, eager_strides, upper_bound
from ferry.backend_registry import data_kwargs, get_backend
from ferry.choices.out_kernels import choose_kernel, kernel_for
from ferry.device import CPU, Device
from ferry.errors import CompileError, UnsupportedByBackend
from ferry.op_names import kernel_name, resolve_kernel
from ferry.ops.aliasing import is_view, overwrites_safely, traced_alias, unannotated, view_source
from ferry.program.dataflow import layout, state_overwrites, whole_root, whole_views
from ferry.program.lifetimes import tensor_ids, value_lifetimes
from ferry.program.schema import (
    DEFAULT_ARG,
    ConstValue,
    Delegate,
    DelegateCall,
    InputWrite,
    KernelCall,
    Method,
    MutableBuffer,
    TensorValue,
    dtype_name,
    memory_owner,
)

_SIZE_OPS = ("add", "sub", "mul", "floordiv", "mod", "neg")


class _MethodEmitter:
    def __init__(self, name, gm, constants, builder: ProgramBuilder, opts: MethodOptions, range_constraints,
                 default_device: Device):
        self.name = name
        self.gm = gm
        self.constants = constants
        self.b = builder
        self.data = builder.data
        self.opts = opts
        self.default_device = default_device  # of values with no recorded device (delegate subgraphs)
        self.rc = range_constraints or {}
        self.values: list = []
        self.instructions: list = []
        self.env: dict[torch.fx.Node, object] = {}  # node -> value id, or tuple of ids
        self.const_ids: dict = {}
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self.input_writes: list[InputWrite] = []
        self.mutable: list[MutableBuffer] = []
        self.mutable_ids: set[int] = set()
        self.state_names: dict[int, str] = {}  # state value -> its buffer's name
        self.written_over: set[int] = set()  # updates a delegate writes over their state in place
        self.caller_owned: set[int] = set()
        self.runtime_alloc: set[int] = set()
        self.unread: set[int] = set()
        self.allocating_ops: list[str] = []
        self.kernel_choices: dict[str, str] = {}  # op -> why it runs functionally
        self.out_ops: dict[int, torch._ops.OpOverload] = {}  # instruction index -> its out kernel

    # ---------------------------------------------------------------- values

    def device_of(self, node) -> Device:
        return M.get_device(node) or self.default_device

    def tensor_value(self, node, val, device, **kw) -> int:
        if isinstance(val, torch.SymInt):
            from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

            if not free_unbacked_symbols(val):  # a size of a dynamic input (x.shape[0]) used as a value
                raise CompileError(
                    f"method {self.name!r}: {node.name!r} reads a dynamic size ({val}) to use it as an argument "
                    "(e.g. x.shape[0] in a reshape/view); ferry cannot emit symbolic size arguments yet: export this "
                    "dimension as static, or keep dynamic dimensions away from reshapes and views"
                )
            raise CompileError(
                f"method {self.name!r}: {node.name!r} is a data-dependent size ({val}); ferry plans memory ahead of "
                "time and needs static or bounded shapes: keep ops like nonzero/unique out of the program"
            )
        if not isinstance(val, torch.Tensor):
            raise CompileError(f"method {self.name!r}: node {node.name!r} has no tensor metadata (meta['val'])")
        if val.layout != torch.strided:
            raise CompileError(f"method {self.name!r}: {node.name!r} is a {str(val.layout).removeprefix('torch.')} "
                               "tensor; ferry programs hold dense (strided) tensors only: pass it dense (.to_dense())")
        shape, dynamic = [], []
        for i, d in enumerate(val.shape):
            s, dyn = upper_bound(d, self.rc, f"dimension {i} of {node.name!r}")
            shape.append(s)
            dynamic.append(dyn)
        strides = () if any(dynamic) else eager_strides(val)  # a constant's too: tensor_bytes keeps that order
        v = TensorValue(dtype_name(val.dtype), tuple(shape), device, dynamic=tuple(dynamic) if any(dynamic) else (),
                        name=node.name, strides=strides, **kw)
        self.values.append(v)
        return len(self.values) - 1

    def symint_value(self, node, val) -> int:
        """A size computed each call (its planned upper bound recorded as the value)."""
        bound, _ = upper_bound(val, self.rc, f"size {node.name!r}")
        self.values.append(ConstValue("symint", bound))
        return len(self.values) - 1

    def const(self, kind: str, value) -> int:
        key = (kind, repr(value))
        if key not in self.const_ids:
            self.values.append(ConstValue(kind, value))
            self.const_ids[key] = len(self.values) - 1
        return self.const_ids[key]

    def arg_value(self, arg, atype, what: str) -> int:
        if isinstance(arg, torch.fx.Node):
            vid = self.env[arg]
            if isinstance(vid, tuple):
                raise CompileError(f"{what}: a multi-output value used directly")
            return cast(int, vid)  # a delegate's module is only ever read by _emit_delegate
        if arg is None:
            return self.const("none", None)
        if isinstance(arg, bool):
            return self.const("bool", arg)
        if isinstance(arg, int):
            return self.const("int", arg)
        if isinstance(arg, float):
            return self.const("float", arg)
        if isinstance(arg, str):
            return self.const("str", arg)
        if isinstance(arg, torch.dtype):
            return self.const("dtype", dtype_name(arg))
        if isinstance(arg, torch.layout):
            return self.const("layout", str(arg).removeprefix("torch."))
        if isinstance(arg, torch.memory_format):
            return self.const("memory_format", str(arg).removeprefix("torch."))
        if isinstance(arg, torch.device):
            return self.const("device", str(arg))
        if isinstance(arg, (list, tuple)):
            nodes = [a for a in arg if isinstance(a, torch.fx.Node)]
            if nodes or (arg and all(a is None or isinstance(a, torch.fx.Node) for a in arg)):
                if all(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) for a in arg):
                    return self.const("tensors", [self.arg_value(a, None, what) for a in arg])
                if all(a is None or (isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)) for a in arg):
                    return self.const("opt_tensors", [None if a is None else self.arg_value(a, None, what) for a in arg])
                if all(isinstance(a, int) or (isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.SymInt))
                       for a in arg):
                    return self.const("symints", [self.arg_value(a, None, what) for a in arg])
                raise CompileError(f"{what}: cannot emit the list argument {arg!r}")
            if all(isinstance(a, bool) for a in arg):
                return self.const("bools", list(arg))
            if all(isinstance(a, int) and not isinstance(a, bool) for a in arg):
                return self.const("ints", list(arg))
            if all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in arg):
                return self.const("floats", [float(a) for a in arg])
        raise CompileError(f"{what}: cannot emit argument {arg!r} of type {type(arg).__name__}")

    def schema_args(self, op, node, extra_out: dict[str, int], device: Device | None = None) -> tuple[int, ...]:
        """The instruction's argument ids in schema order. With `device` (where the node is placed),
        a factory's `device` argument names it: the trace recorded where the model was exported."""
        schema = op._schema
        given = list(node.args)
        kwargs = dict(node.kwargs)
        ids = []
        pos = 0
        for a in schema.arguments:
            if a.name in extra_out:
                ids.append(extra_out[a.name])
                continue
            if not a.kwarg_only and pos < len(given):
                arg = given[pos]
                pos += 1
            elif a.name in kwargs:
                arg = kwargs[a.name]
            else:
                arg = _UNGIVEN
            if device is not None and _names_placement(op, a, arg):
                arg = device.to_torch()
            ids.append(DEFAULT_ARG if arg is _UNGIVEN else self.arg_value(arg, a.type, f"{node.name}.{a.name}"))
        return tuple(ids)

    # ---------------------------------------------------------------- nodes

    def emit(self) -> Method:
        for node in self.gm.graph.nodes:
            getattr(self, f"_emit_{node.op}")(node)
        return self.finish()

    def _emit_placeholder(self, node):
        info = M.input_info(node)
        val = node.meta.get("val")
        if info.kind == M.USER_INPUT and isinstance(val, torch.SymInt):  # a size passed into a delegate
            vid = self.symint_value(node, val)
            self.inputs.append(vid)
            self.env[node] = vid
            return
        if info.kind == M.FIXED:
            return  # an argument torch.export fixed (a float, a flag): the signature checks it per call
        if info.kind == M.USER_INPUT:
            if not isinstance(val, torch.Tensor):
                raise CompileError(f"method {self.name!r}: input {node.name!r} is not a tensor; ferry methods take tensors")
            vid = self.tensor_value(node, val, self.device_of(node))
            self.inputs.append(vid)
            if not self.opts.alloc_graph_input or not self.device_of(node).is_cpu:
                self.caller_owned.add(vid)
        else:
            tensor = self.constants[node.name]
            seg = self.b.state_segment(info.target, tensor) if info.mutable else self.b.constant_segment(tensor)
            vid = self.tensor_value(node, tensor, CPU if not info.mutable else self.device_of(node), constant=seg)
            if info.mutable:
                self.mutable_ids.add(vid)
                self.state_names[vid] = info.target
        self.env[node] = vid

    def _emit_get_attr(self, node):
        attr = getattr(self.gm, node.target)
        if isinstance(attr, LoweredBackendModule):
            self.env[node] = attr
            return
        if not isinstance(attr, torch.Tensor):
            raise CompileError(f"get_attr {node.target!r} is a {type(attr).__name__}, not a tensor")
        seg = self.b.constant_segment(attr)
        self.env[node] = self.tensor_value(node, attr, self.device_of(node), constant=seg)

    def _emit_call_function(self, node):
        if node.target is operator.getitem:
            src = self.env[node.args[0]]
            if not isinstance(src, tuple):
                raise CompileError(f"getitem {node.name!r} on a single value")
            self.env[node] = src[node.args[1]]
            return
        if is_delegate_node(node):
            return self._emit_delegate(node)
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):  # arithmetic on dynamic sizes, computed each call
            return self._emit_size(node, val)
        op = node.target
        if not isinstance(op, torch._ops.OpOverload):
            raise CompileError(
                f"method {self.name!r}: node {node.name!r} calls {op!r}, which is not an operator; "
                "ferry runs ATen ops, et_copy ops and delegates"
            )
        self._check_runnable(op, node, val)
        bases = self._aliased_inputs(op, node)
        if any(b is not None for b in bases):  # (views of) inputs: run as eager does, own no memory
            many = isinstance(val, (tuple, list))
            outs = tuple(self.tensor_value(node, v, self.device_of(node), alias_of=b)
                         for v, b in zip(val if many else [val], bases))
            self.runtime_alloc.update(o for o, b in zip(outs, bases) if b is None)
            self.instructions.append(KernelCall(kernel_name(op), self.schema_args(op, node, {}), outs))
            self.env[node] = outs if many else outs[0]
            return
        if not op._schema.returns:  # a check (e.g. aten._assert_scalar): runs, defines nothing
            self.instructions.append(KernelCall(kernel_name(op), self.schema_args(op, node, {}), ()))
            return
        vals = list(val) if isinstance(val, (tuple, list)) else [val]
        dev = self.device_of(node)
        outs = tuple(self.tensor_value(node, v, dev) for v in vals)
        choice = None if self.opts.functional_kernels else choose_kernel(op, node, dev.type)
        if choice is None or choice.pick == "functional":
            self.runtime_alloc.update(outs)
            self.allocating_ops.append(kernel_name(op))
            self.kernel_choices.setdefault(kernel_name(op), choice.why if choice else "compiled with the rest of the graph")
            self.instructions.append(KernelCall(kernel_name(op), self.schema_args(op, node, {}, dev), outs))
        else:
            out_op = kernel_for(op, choice)
            out_names = [a.name for a in out_op._schema.arguments if a.is_out]
            args = self.schema_args(out_op, node, dict(zip(out_names, outs)))
            self.out_ops[len(self.instructions)] = out_op
            self.instructions.append(KernelCall(kernel_name(out_op), args, outs))
            if isinstance(val, (tuple, list)):
                # outputs nobody reads are not planned: their traced shape can be smaller than what a
                # device's kernel writes (batch norm's saved statistics are (0,) on the CPU and (C,) on
                # CUDA); the runtime gives each its own tensor, so a larger write can't hit a neighbour
                read = {u.args[1] for u in node.users if u.target is operator.getitem}
                self.unread.update(o for k, o in enumerate(outs) if k not in read)
        self.env[node] = outs if isinstance(val, (tuple, list)) else outs[0]

    def _check_runnable(self, op, node, val) -> None:
        """A CompileError naming the op for what a ferry program cannot hold or call: a result that
        is not dense tensors (a Python number read from a tensor, a sparse tensor, nested lists),
        or an operator the loader refuses (op_names.py)."""
        what = f"method {self.name!r}: {kernel_name(op)} (node {node.name!r})"
        try:
            resolve_kernel(kernel_name(op))
        except LookupError as e:
            raise CompileError(f"{what}: {e}") from None
        if not op._schema.returns:
            return
        vals = list(val) if isinstance(val, (tuple, list)) else [val]
        for v in vals:
            if isinstance(v, torch.Tensor) and v.layout != torch.strided:
                raise CompileError(f"{what} makes a {str(v.layout).removeprefix('torch.')} tensor; ferry programs hold "
                                   "dense (strided) tensors only: keep sparse layouts out of the exported program")
            if not isinstance(v, torch.Tensor):
                got = "nothing traced" if v is None else f"a {type(v).__name__}"
                raise CompileError(f"{what} returns {got} where ferry needs tensors: a number read out of a tensor "
                                   "(.item(), .tolist()) or a nested list is data the program cannot plan memory for; "
                                   "keep it out of the exported program, or compute it outside the model")

    def _aliased_inputs(self, op, node) -> list[int | None]:
        """Per result of `node`, the value owning the memory it may be (a view, or an input handed
        back as it is), or None for a result of its own: the schema says so for views, the trace
        for composite ops (ops/aliasing.py)."""
        val = node.meta.get("val")
        n = len(val) if isinstance(val, (tuple, list)) else 1
        if is_view(op):
            arg = node.args[view_source(op)] if view_source(op) < len(node.args) else node.args[0]
            return [memory_owner(self.values, self.arg_value(arg, None, node.name))] * n
        if not unannotated(op):
            return [None] * n
        return [None if a is None else memory_owner(self.values, self.arg_value(a, None, node.name))
                for a in traced_alias(node)]

    def _emit_size(self, node, val):
        out = self.symint_value(node, val)
        op = node.target
        if isinstance(op, torch._ops.OpOverload):  # aten.sym_size.int, ...
            self.instructions.append(KernelCall(kernel_name(op), self.schema_args(op, node, {}), (out,)))
        elif getattr(op, "__name__", None) in _SIZE_OPS and op.__module__ in ("_operator", "operator"):
            args = tuple(self.arg_value(a, None, node.name) for a in node.args)
            self.instructions.append(KernelCall(f"ferry::sym_{op.__name__}", args, (out,)))
        else:
            raise CompileError(f"method {self.name!r}: size {node.name!r} is computed by {op!r}, which ferry cannot run")
        self.env[node] = out

    def _emit_delegate(self, node) -> None:
        lowered = cast(LoweredBackendModule, self.env[node.args[0]])  # a get_attr of the module (place.py checks)
        args = tuple(self.arg_value(a, None, node.name) for a in node.args[1:])
        vals = node.meta.get("val") or ()
        dev = self.device_of(node)
        users = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        backend, index = get_backend(lowered.backend_id), len(self.b.delegates)
        try:
            payload = backend.preprocess(lowered, self.opts, self.rc, **data_kwargs(backend, self.data))
        except UnsupportedByBackend as e:  # e.g. Inductor and dynamic sizes: ferry's own backend runs it
            note = f"runs op by op (backend 'torch'), not with {lowered.backend_id!r}: {e}"
            warnings.warn(f"delegate {index} {note}", UserWarning, stacklevel=2)
            self.kernel_choices[f"delegate {index}"] = note
            backend = get_backend("torch")
            payload = backend.preprocess(lowered, self.opts, self.rc, **data_kwargs(backend, self.data))
        # (after the payload: an op inside that ferry refuses is named by the backend's emit first)
        outs = tuple(self.tensor_value(users.get(k, node), v, dev) for k, v in enumerate(vals))
        self.b.delegates.append(Delegate(backend.backend_id, lowered.compile_specs, self.b.add_segment(payload)))
        if backend.returns_outputs and self.opts.device_placement:
            # compiled code makes its own results: planning them too would hold each twice and copy
            self.runtime_alloc.update(outs)
            name = f"delegate {index} ({backend.backend_id})"
            self.allocating_ops.append(name)
            self.kernel_choices[name] = "compiled code; its results are its own tensors"
        self.instructions.append(DelegateCall(index, args, outs, self._scratch(backend, payload, index)))
        self.env[node] = outs

    def _scratch(self, backend, payload, index: int) -> tuple[int, ...]:
        """The delegate's working memory, as values of this method: planned in the arena of their
        device, alive only while the delegate runs (legacy mode: the delegate keeps its own)."""
        if not self.opts.device_placement:
            return ()
        out = []
        for j, buf in enumerate(backend.memory_needs(payload, **data_kwargs(backend, self.data))):
            self.values.append(TensorValue("uint8", (buf.size,), buf.device, name=f"delegate_{index}_memory_{j}"))
            out.append(len(self.values) - 1)
        return tuple(out)

    def _emit_output(self, node):
        infos = M.output_infos(node)
        for info, out in zip(infos, M.flat_outputs(node)):
            vid = self.arg_value(out, None, "output")
            if info.kind == M.BUFFER_MUTATION:
                target = next(p for p in self.gm.graph.nodes if p.op == "placeholder" and M.input_info(p).target == info.target)
                self.mutable.append(MutableBuffer(self.env[target], vid, info.target))
            else:
                self.outputs.append(vid)
                if info.kind == M.USER_INPUT_MUTATION:
                    placeholder = next(p for p in self.gm.graph.find_nodes(op="placeholder") if p.name == info.target)
                    self.input_writes.append(InputWrite(len(self.outputs) - 1, self.inputs.index(self.env[placeholder])))
                v = self.values[vid]
                if isinstance(v, TensorValue) and (not self.opts.alloc_graph_output or not v.device.is_cpu):
                    if vid not in self.inputs and v.constant is None:
                        self.caller_owned.add(vid)

    # ---------------------------------------------------------------- plan

    def finish(self) -> Method:
        updated = {mb.value for mb in self.mutable}
        for vid in sorted(self.mutable_ids - updated):  # state this method reads and another updates
            self.mutable.append(MutableBuffer(vid, vid, self.state_names[vid]))
        method = Method(
            name=self.name, values=list(self.values), instructions=self.instructions, inputs=self.inputs,
            outputs=self.outputs, buffers=[], mutable_buffers=self.mutable,
        )
        self.written_over = self._states_written_over(method)
        life = value_lifetimes(method)
        plan_values = [PlanValue(vid, self.values[vid].nbytes, self.values[vid].device, first, last)
                       for vid, (first, last) in life.items() if self._planned(vid)]
        plan = plan_memory(plan_values, algorithm=self.opts.memory_planning, alignment=self.opts.alignment,
                           in_place=self._in_place_candidates(method))
        values = list(self.values)
        for vid, entry in plan.entries.items():
            values[vid] = dataclasses.replace(values[vid], plan=entry)
        if plan.in_place:
            self.kernel_choices["in place"] = (f"{len(plan.in_place)} result(s) written over an input that dies there "
                                               "(what eager's relu_ and += do)")
        for vid, v in enumerate(values):
            if isinstance(v, TensorValue):
                values[vid] = dataclasses.replace(v, storage=self._storage(vid, v))
        return Method(
            name=self.name, values=values, instructions=self.instructions, inputs=self.inputs,
            outputs=self.outputs, buffers=plan.buffers, mutable_buffers=self.mutable, input_writes=self.input_writes,
            lower_bounds={str(d): b for d, b in plan.lower_bounds.items()},
            runtime_allocating_ops=sorted(set(self.allocating_ops)),
            kernel_choices=dict(sorted(self.kernel_choices.items())),
        )

    def _states_written_over(self, method: Method) -> set[int]:
        """Updates a delegate may write over their state in place (a KV cache's new token written
        into the cache itself): the state is read once by that call and never after it, and the
        delegate's backend says it writes that result over that argument. Each such update needs
        no memory of its own and no copy into the state after the call."""
        out, allowed = set(), {}
        states = {mb.update: mb.value for mb in method.mutable_buffers}
        for update, (k, arg, result) in state_overwrites(method).items():
            if states[update] not in self.mutable_ids:
                continue
            index = cast(DelegateCall, method.instructions[k]).delegate  # (state_overwrites: a delegate call)
            if index not in allowed:
                d = self.b.delegates[index]
                backend = get_backend(d.backend_id)
                allowed[index] = backend.writes_over(self.b.segments[d.payload], **data_kwargs(backend, self.data))
            if allowed[index].get(result) == arg:
                out.add(update)
        if out:
            self.kernel_choices["state written in place"] = (
                f"{len(out)} mutable buffer update(s) written over the state by the delegate that computes them "
                "(no copy back after the call)")
        return out

    def _in_place_candidates(self, method: Method) -> list[InPlace]:
        """Results a kernel may write over one of its inputs (read as itself or through a `view`
        of all of it): the input is read once there, has the result's layout and device, and the
        kernel reads each element before writing it (ops/aliasing.py: overwrites_safely). The
        planner takes a candidate where the input dies at that kernel; program/dataflow.py checks
        the same of a file."""
        keep = set(method.inputs) | set(method.outputs) | self.mutable_ids
        views = whole_views(method)
        out = []
        for k, op in self.out_ops.items():
            ins = method.instructions[k]
            if len(ins.outputs) != 1 or not self._planned(ins.outputs[0]):
                continue
            o = ins.outputs[0]
            roots = [memory_owner(self.values, t) for a in ins.args for t in tensor_ids(method, a)]
            for p, a in enumerate(ins.args):
                r = whole_root(method, a, views) if a not in (DEFAULT_ARG, o) else None  # a itself, or a view of all of r
                if (r is None or r in keep or not self._planned(r) or roots.count(r) != 1 or any(self.values[r].dynamic)
                        or layout(method, a) != layout(method, o) or self.values[r].device != self.values[o].device):
                    continue
                if overwrites_safely(op, p):
                    out.append(InPlace(o, r))
        return out

    def _planned(self, vid: int) -> bool:
        """Whether a memory-owning value gets a place in a planned buffer."""
        if vid in self.runtime_alloc or vid in self.caller_owned or vid in self.unread or vid in self.written_over:
            return False
        return self.values[vid].constant is None  # (a mutable buffer is the program's state, held by the module)

    def _storage(self, vid: int, v: TensorValue) -> str:
        """Who owns the value's memory: decided here, once, and written into the program."""
        if v.alias_of is not None:
            return "view"
        if vid in self.mutable_ids or vid in self.written_over:
            return "state"
        if v.plan is not None:
            return "planned"
        if v.constant is not None:
            return "constant"
        if vid in self.inputs:
            return "input"
        if vid in self.runtime_alloc:
            return "runtime"
        if vid in self.unread:
            return "scratch"
        if vid in self.caller_owned:
            return "output"
        raise CompileError(f"method {self.name!r}: value {v.name or vid!r} has no storage (a ferry bug: please report it)")


_UNGIVEN = object()  # an argument the node leaves to its schema's default


def _names_placement(op, arg, given) -> bool:
    """`arg` of `op` says where its result is made: a factory's `device` (given, or left to
    default to the CPU), not the `device=None` of `_to_copy`/`*_like`, which follow their input."""
    if arg.name != "device" or str(arg.type) not in ("Device", "Optional[Device]"):
        return False
    takes_tensor = any(isinstance(a.type, torch.TensorType) for a in op._schema.arguments if not a.is_out)
    return not takes_tensor or (given is not _UNGIVEN and given is not None)


def emit_method(name, gm, constants, builder: ProgramBuilder, opts: MethodOptions, range_constraints=None,
                default_device: Device = CPU) -> Method:
    return _MethodEmitter(name, gm, constants, builder, opts, range_constraints, default_device).emit()
