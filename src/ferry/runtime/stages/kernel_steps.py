"""Binding an ATen kernel: its fast paths, the forms chosen by timing at load, dynamic sizes,
storage offsets counted from planned memory, kernels a device lacks, composites that may hand
an input back, and the first call's check of the shapes the program planned."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ferry.backend_registry import CallerPlan
from ferry.choices import hook
from ferry.choices.decisions import Site
from ferry.errors import InputError, ProgramError
from ferry.op_names import resolve_kernel
from ferry.ops.aliasing import STORAGE_OFFSET_AT, composite_results, is_view, returns_inputs
from ferry.ops.variants import functional_variant, has_device_kernel
from ferry.program.lifetimes import tensor_ids
from ferry.program.schema import DEFAULT_ARG, KernelCall, Method, TensorValue, memory_owner
from ferry.runtime.stages.frame import members
from ferry.runtime.stages.kernels import _to_meta, bind_aten, check_call, fast_aten, fast_functional, returns_list
from ferry.runtime.stages.refs import (
    LAYOUT_VIEWS,
    Fixed,
    Listed,
    NoMeta,
    PerCall,
    Ref,
    arguments,
    first_only,
    meta_of,
    resolve,
)
from ferry.runtime.stages.sizes import CPU_SIZES_DIFFER, call_check, check_kernel
from ferry.runtime.stages.steps import Step

__all__ = ["KernelSteps", "offset_in_owner"]


def offset_in_owner(method: Method, ins: KernelCall, pos: list, base: torch.Tensor, where: str) -> list:
    """`as_strided`'s arguments `pos`, its storage offset moved by where `base`, the memory owner
    of its input, starts in its storage (an arena, a slab of constants): eager counts the offset
    from the start of the input's own memory. The torch backend's steps and the inductor
    backend's graphs both call it."""
    at = STORAGE_OFFSET_AT[ins.kernel]
    itemsize = method.tensor(ins.args[0]).torch_dtype.itemsize
    start = base.storage_offset() * base.element_size()
    if start % itemsize:
        raise ProgramError(f"method {method.name!r}, {where}, {ins.kernel}: its input starts at byte {start} of "
                           "its memory, not at a multiple of its element size")
    return [*pos[:at], Fixed(pos[at].value + start // itemsize), *pos[at + 1:]]


class KernelSteps:
    """The binder's ATen kernel steps (a mixin of runtime/stages/bind.py's binder, which holds
    the method, its slots and what is fixed)."""

    m: Method
    slots: list
    fixed: list
    shapes: dict | None
    measure: bool
    capture: CallerPlan

    if TYPE_CHECKING:  # the binder's own (runtime/stages/bind.py)
        def dynamic(self, v: TensorValue) -> bool: ...

        def ref(self, vid: int): ...

        def step(self, index: int, kind: str, name: str, ins, call, *, extra_devices=(), check=None,
                 also_reads=()) -> Step: ...

    def kernel_step(self, index: int, ins: KernelCall) -> Step | None:
        m = self.m
        try:
            op = resolve_kernel(ins.kernel)
        except LookupError as e:
            raise ProgramError(f"method {m.name!r} instruction {index}: {e}") from None
        check_call(op, ins.args, ins.outputs, m.values, f"method {m.name!r} instruction {index}")
        pos, kw = bind_aten(op, ins.args, self.ref)
        sized = self._sized(op, pos, kw, ins, index)  # before anything of it runs, here or in a call
        pos, op, owner = self._storage_offset_in_arena(op, ins, pos, index)
        op = self._runnable_here(op, ins)
        writes_out = bool(ins.outputs) and all(o in ins.args for o in ins.outputs)
        if writes_out:
            _check_written(op, ins, f"method {m.name!r} instruction {index} ({ins.kernel})")
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
        gemm = self._chosen(op, pos, kw, ins.outputs) if writes_out and not dynamic else None
        if writes_out and dynamic:
            call = self._dynamic_out(op, pos, kw, dynamic)
        elif writes_out and all(isinstance(r, Fixed) for r in (*pos, *kw.values())):
            args, kwargs = [r.value for r in pos], {k: r.value for k, r in kw.items()}
            call = functools.partial(gemm or fast_aten(op, args, kwargs) or op, *args, **kwargs)
        elif writes_out and first_only(pos, kw) is not None:  # one value of the call, first
            fn, slots = gemm or self._fast_out(op, pos, kw) or op, self.slots
            vid, rest, k = first_only(pos, kw)  # type: ignore[misc]
            call = lambda: fn(slots[vid], *rest, **k)  # noqa: E731
        elif writes_out:
            args, fn = arguments(self.slots, pos, kw), gemm or self._fast_out(op, pos, kw) or op

            def call():
                a, k = args()
                return fn(*a, **k)
        else:
            call = self._run_functional(op, pos, kw, ins.outputs, ins)
        if sized is not None:
            call = _after(sized, call)
        return self.step(index, "kernel", ins.kernel, ins, call, check=self._shape_check(ins), also_reads=owner)

    def _sized(self, op, pos, kw, ins: KernelCall, index: int):
        """The kernel makes what the program declares (runtime/stages/sizes.py): checked here when
        the shapes of its arguments are known at load; else the check each call runs first."""
        label = f"method {self.m.name!r} instruction {index} ({ins.kernel})"
        try:
            check_kernel(self.m, op, pos, kw, ins.outputs, label, self.shapes)
        except NoMeta:
            if is_view(op) and op not in LAYOUT_VIEWS:
                return None  # a view allocates nothing, and the steps after it size the tensor it is
            return call_check(self.m, op, pos, kw, ins.outputs, label, self.slots)
        return None

    def _storage_offset_in_arena(self, op, ins: KernelCall, pos: list, index: int):
        """`as_strided`'s storage offset counts from the start of its input's memory, as in eager,
        where that memory is a tensor of its own: ferry's memory may lie inside an arena (planned
        memory, or a caller's planned tensor handed to a delegate), so the offset is moved by
        where the memory owner starts. Returns (arguments, the op to call, the owners it reads
        each call: a result of this call, which must live until then)."""
        at = STORAGE_OFFSET_AT.get(ins.kernel)
        if at is None or at >= len(pos) or (isinstance(pos[at], Fixed) and pos[at].value is None) or not ins.args:
            return pos, op, ()
        owner = memory_owner(self.m.values, ins.args[0])
        itemsize = self.m.tensor(ins.args[0]).torch_dtype.itemsize
        offset = pos[at].value if isinstance(pos[at], Fixed) else None
        if not isinstance(offset, int) or not isinstance(self.m.values[owner], TensorValue):
            raise ProgramError(f"method {self.m.name!r} instruction {index} ({ins.kernel}): its storage offset must "
                               "be a constant int")
        if self.fixed[owner]:
            return offset_in_owner(self.m, ins, pos, self.slots[owner], f"instruction {index}"), op, ()
        slots = self.slots

        def shifted(*args, **kwargs):  # the owner is a tensor of this call: where it starts, per call
            base = slots[owner]
            args = list(args)
            args[at] += base.storage_offset() * base.element_size() // itemsize
            return op(*args, **kwargs)

        return pos, shifted, (owner,)

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
        if op in LAYOUT_VIEWS and not all(isinstance(r, Fixed) for r in pos):
            op = torch.ops.aten.reshape.default  # see LAYOUT_VIEWS
        fn = self._chosen(op, pos, kw, outputs) or self._fast(op, pos, kw, outputs) or op
        named = resolve_kernel(ins.kernel) if ins is not None else op  # (op may be a wrapper of it)
        if ins is not None and returns_inputs(named):
            fn = composite_results(fn, self._declared_sources(ins))
        args = arguments(slots, pos, kw)
        first = first_only(pos, kw)
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

    def _chosen(self, op, pos, kw, outputs):
        """The form the op's family picks for this instruction (ferry/choices/hook.py: timed once
        per shape, at load), or None for the kernel named. Arguments are given as they are where
        fixed (a weight on its GPU) and as meta tensors like them for values of the call; one
        value is one object (multi-head attention over one input is self-attention)."""
        if not hook.wants(op):
            return None
        metas: dict[int, object] = {}
        try:
            args, kwargs = [self._given(r, metas) for r in pos], {k: self._given(r, metas) for k, r in kw.items()}
        except NoMeta:
            return None
        out = self.m.values[outputs[0]] if outputs else None
        device = out.device.to_torch() if isinstance(out, TensorValue) else None
        return hook.choose(op, args, kwargs, Site(device, self.measure, self.capture.captured, self.capture.streams))

    def _given(self, ref, metas: dict):
        """What is fixed as it is (a weight on its GPU), a meta tensor like it for a value of the
        call (made once per value: `metas`)."""
        if isinstance(ref, Fixed):
            return ref.value
        if isinstance(ref, PerCall):
            if ref.vid not in metas:
                metas[ref.vid] = self._meta(ref)
            return metas[ref.vid]
        return self._meta(ref)

    def _fast_out(self, op, pos, kw):
        """fast_aten for an .out kernel whose arguments include values of the call."""
        try:
            args, kwargs = [self._meta(r) for r in pos], {k: self._meta(r) for k, r in kw.items()}
        except NoMeta:
            return None
        return fast_aten(op, args, kwargs)

    def _meta(self, ref: Ref):
        if isinstance(ref, Fixed):
            return _to_meta(ref.value)
        if isinstance(ref, Listed):
            return [None if e is None else meta_of(self.m, e, self.shapes) for e in ref.ids]
        return meta_of(self.m, ref.vid, self.shapes)

    def _fast(self, op, pos, kw, outputs):
        """The C++ argument parser's entry for `op`, checked once on meta tensors shaped like this
        instruction's values (falls back to the OpOverload)."""
        m = self.m
        if not all(isinstance(m.values[o], TensorValue) and not self.dynamic(m.tensor(o)) for o in outputs):
            return None
        try:
            args, kwargs = [self._meta(r) for r in pos], {k: self._meta(r) for k, r in kw.items()}
        except NoMeta:
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
        args = [t for a in ins.args if a != DEFAULT_ARG for t in [a, *members(m, a)]]
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
            op(*[resolve(r, slots) for r in pos], **{n: resolve(r, slots) for n, r in kw.items()})
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
        past its slot, so the first call turns that into an error instead of a wrong result. A
        kernel known to size results otherwise than its trace (CPU_SIZES_DIFFER) may leave a result
        after its first empty, as eager does (the embedding bag's offset2bag in bfloat16 on the CPU)."""
        m, slots = self.m, self.slots
        planned = [(o, m.tensor(o).shape) for o in ins.outputs if isinstance(m.values[o], TensorValue)
                   and m.tensor(o).storage in ("planned", "runtime") and not any(m.tensor(o).dynamic)]
        if not planned:
            return None
        empty_ok = {o for o in ins.outputs[1:]} if ins.kernel.split("::")[-1].split(".")[0] in CPU_SIZES_DIFFER else set()

        def check():
            for o, shape in planned:
                t = slots[o]
                if o in empty_ok and t is not None and t.numel() == 0:
                    continue
                if t is not None and tuple(t.shape) != shape:  # (None: an undefined result)
                    raise ProgramError(
                        f"{ins.kernel} wrote a {tuple(slots[o].shape)} output where the program planned {shape} "
                        f"(value {m.values[o].name!r}): the program's shapes disagree with its kernels, so its "
                        "memory plan is unsafe (an edited file, or a device whose kernel differs from the CPU "
                        "trace: please report that to ferry)"
                    )

        return check


def _check_written(op, ins: KernelCall, label: str) -> None:
    """Each output an instruction passes as an argument is one the kernel writes (an out or
    in-place argument): a kernel that only reads it returns a new tensor instead, and the
    memory the program planned for the result would never be written."""
    if not isinstance(op, torch._ops.OpOverload):
        return
    schema = op._schema.arguments
    for o in ins.outputs:
        at = [schema[j] if j < len(schema) else None for j, a in enumerate(ins.args) if a == o]
        if not any(arg is not None and arg.alias_info is not None and arg.alias_info.is_write for arg in at):
            names = ", ".join(arg.name if arg is not None else "?" for arg in at)
            raise ProgramError(f"{label}: value {o} is passed as its argument {names}, which the kernel does not "
                               "write, so the result would never reach it (a kernel that returns its result "
                               "stands where one writing through an out argument must)")


def _after(check, call):
    """`call`, once `check` has passed."""
    def run():
        check()
        return call()

    return run


def _compact(t: torch.Tensor) -> None:
    """Lay `t` out contiguously over its own memory (a copy through a temporary)."""
    values = t.clone(memory_format=torch.contiguous_format)
    t.as_strided_(values.shape, values.stride(), t.storage_offset()).copy_(values)
