"""The `torch` backend: runs a lowered subgraph with ATen ops in its device's memory.

Its payload is itself a ferry program (one method, `forward`) whose values live on the
delegate's device: the subgraph gets out variants and memory planning like any method, so
the delegate runs in planned device memory, writes straight into the caller's planned output
tensors, and has its constants uploaded to the device once, at load. Its weights are the
program's segments (ProgramData): a weight that delegates of several methods use (prefill and
decode of one model) is stored once in the file and uploaded once per device.
"""

from __future__ import annotations

import dataclasses

import torch

from ferry.aot.emit import emit_method
from ferry.aot.fuse import fuse_for_inference, fusion_notes
from ferry.aot.kernel_limits import fit_kernel_limits
from ferry.aot.place import delegate_target_device
from ferry.aot.values import ProgramBuilder
from ferry.backend_registry import NOT_CAPTURED, Backend, CallerPlan, DelegateHandle, ProgramData
from ferry.device import CPU
from ferry.errors import ProgramError
from ferry.program import Program, load_program, program_to_bytes
from ferry.program.dataflow import in_place_outputs
from ferry.program.footprint import call_bytes
from ferry.program.ranks import localized
from ferry.program.schema import Buffer, TensorValue, upload_key
from ferry.runtime.stages.method import LoadedMethod


class TorchBackend(Backend):
    backend_id = "torch"
    shares_program_data = True
    takes_reservation = True  # its weights and buffers are a LoadedMethod's: taken from the load's reservation

    def preprocess(self, lowered, options, range_constraints=None, data: ProgramData | None = None) -> bytes:
        device = delegate_target_device(lowered) or CPU
        opts = dataclasses.replace(options, device_placement=True, alloc_graph_input=False, alloc_graph_output=False)
        builder = ProgramBuilder(outer=data.store if data is not None else None)
        merged = data.store.merged if data is not None else None
        fused = fit_kernel_limits(lowered.original_module, device)  # what the device's kernels take: always
        fused += fuse_for_inference(lowered.original_module, merged, device) if options.fuse_for_inference else []
        method = emit_method("forward", lowered.original_module, {}, builder, opts, range_constraints, device)
        method.kernel_choices.update(fusion_notes(fused))
        if data is None:
            return program_to_bytes(Program({"forward": method}, builder.delegates, builder.segments))
        return program_to_bytes(Program({"forward": method}, builder.delegates, list(data.segments)), with_segments=False)

    def check_call(self, payload, args: list, outputs: list, *, host_io: bool = False,
                   data: ProgramData | None = None) -> None:
        check_payload_call(payload, args, outputs, host_io, data)

    def writes_over(self, payload, data: ProgramData | None = None) -> dict[int, int]:
        return in_place_outputs(payload_program(payload, data).method("forward"))

    def memory_needs(self, payload, data: ProgramData | None = None) -> list[Buffer]:
        """The buffers the delegate works in: the caller plans them in its own arenas."""
        return list(payload_program(payload, data).method("forward").buffers[1:])

    def load_bytes(self, payload, given_memory: bool, data: ProgramData | None = None) -> dict:
        return payload_load_bytes(payload, given_memory, data)

    def load_pieces(self, payload, given_memory: bool, data: ProgramData | None = None) -> list:
        return payload_load_pieces(payload, given_memory, data)

    def call_bytes(self, payload, data: ProgramData | None = None) -> dict:
        return payload_call_bytes(payload, data)

    def init(self, payload, compile_specs, *, pin_host: bool = True, memory=None,
             caller: CallerPlan = NOT_CAPTURED, data: ProgramData | None = None) -> DelegateHandle:
        """`memory`: tensors for the buffers `memory_needs` named, planned by the caller; without
        them the delegate allocates its own. Its weights come from the module's uploads."""
        program = payload_program(payload, data)
        uploads = data.uploads if data is not None and program.holder_segments else None
        # the delegate's steps run inside one step of the caller, already on its device's stream;
        # a delegate of another rank's stage runs in that rank's process, on its devices
        nested = LoadedMethod(program, localized(program.method("forward")), _no_nested_delegates,
                              asynchronous=False, memory=memory, caller=caller,
                              uploads=uploads, reservation=data.reservation if data is not None else None)
        return _Handle(nested)


def payload_program(payload, data: ProgramData | None = None) -> Program:
    """The payload as a program; one that stores no segments reads the holding program's."""
    try:
        return load_program(payload, segments=data.segments if data is not None else None)
    except ProgramError as e:
        if data is None and "segment" in str(e):
            raise ProgramError(f"{e} (its weights are the segments of the program holding it: pass "
                               "data=ProgramData(program.segments))") from None
        raise


def check_payload_call(payload, args: list, outputs: list, host_io: bool = False,
                       data: ProgramData | None = None) -> None:
    """A call of a payload that is a ferry program agrees with its method: as many arguments and
    results, each a tensor where it takes one, of its dtype, shape and dynamic dims, on its
    device (the rank aside; `host_io`: a program compiled without device placement hands host
    tensors to every delegate, which moves them itself)."""
    m = payload_program(payload, data).method("forward")
    for what, given, declared in (("argument", args, m.inputs), ("result", outputs, m.outputs)):
        if len(given) != len(declared):
            raise ProgramError(f"the call has {len(given)} {what}s, its payload's method {len(declared)}")
        for j, (v, vid) in enumerate(zip(given, declared)):
            w = m.values[vid]
            if _disagree(v, w, host_io):
                raise ProgramError(f"{what} {j} is {_describe(v)}, the payload's method takes {_describe(w)}")


def _disagree(v, w, host_io: bool) -> bool:
    if isinstance(v, TensorValue) != isinstance(w, TensorValue):
        return True
    if not isinstance(v, TensorValue):
        return False
    same_device = (v.device.type, v.device.index) == (w.device.type, w.device.index) or (host_io and v.device.is_cpu)
    return (v.dtype, v.shape, any(v.dynamic) and v.dynamic) != (w.dtype, w.shape, any(w.dynamic) and w.dynamic) or (
        not same_device)


def _describe(v) -> str:
    if not isinstance(v, TensorValue):
        return f"a {getattr(v, 'kind', type(v).__name__)} value"
    return f"a {v.dtype}{list(v.shape)} tensor on {v.device}"


def payload_load_pieces(payload, given_memory: bool, data: ProgramData | None = None) -> list:
    """[(device, nbytes[, alignment]), ...] `init` allocates for a payload that is a ferry program:
    the weights it uploads (a weight of the holding program once: `data.counted`), and its buffers
    unless the caller plans them (`given_memory`)."""
    program = payload_program(payload, data)
    m = program.method("forward")
    counted = data.counted if data is not None and program.holder_segments else set()  # weights held once
    pieces: list[tuple] = []
    for v in m.values:
        if isinstance(v, TensorValue) and v.storage == "constant" and not v.device.is_cpu and upload_key(v) not in counted:
            counted.add(upload_key(v))
            pieces.append((v.device, v.nbytes))
    if not given_memory:
        pieces += [(b.device, b.size, b.alignment) for b in m.buffers[1:]]
    return pieces


def payload_load_bytes(payload, given_memory: bool, data: ProgramData | None = None) -> dict:
    """Bytes `init` allocates per device for a payload that is a ferry program: its
    `payload_load_pieces`, added up."""
    need: dict = {}
    for device, n, *_ in payload_load_pieces(payload, given_memory, data):
        need[device] = need.get(device, 0) + n
    return need


def payload_call_bytes(payload, data: ProgramData | None = None) -> dict:
    """Bytes one call of a payload that is a ferry program allocates: its run-time results (its
    outputs are the caller's memory, counted by the caller)."""
    program = payload_program(payload, data)
    return call_bytes(program, program.method("forward"), handed_out=False)


def _no_nested_delegates(index, memory=(), caller=None):
    raise ProgramError("a torch-backend payload must not contain delegates")


class _Handle(DelegateHandle):
    def __init__(self, method):
        self.method = method
        self._host_io = None
        devs = [v.device for v in method.method.values if hasattr(v, "device") and not v.device.is_cpu]
        self.device = devs[0] if devs else CPU

    def execute(self, inputs, outputs) -> list:
        """Run into `outputs` (None: made here and returned); returns the outputs."""
        if self._host_io is None:
            self._host_io = self._needs_host_io(inputs)
        if not self._host_io:
            return self.method.execute(inputs, bind_outputs=outputs)
        # legacy mode (no device placement): this delegate moves its own inputs and outputs
        dev = self.device.to_torch()
        results = self.method.execute([t.to(dev) for t in inputs])
        for out, r in zip(outputs, results):
            if out is not None:
                if out.shape != r.shape:  # a dynamic output the caller emptied first
                    out.resize_(r.shape)
                out.copy_(r)
        return [r if out is None else out for out, r in zip(outputs, results)]

    def makes_output(self, position: int, declared: TensorValue) -> bool:
        """Whether `execute` given None for output `position` makes a tensor the caller may keep,
        as the outer program declares it: one this delegate's plan allocates fresh each call,
        on that device, of that dtype and layout (not a view of an input or of its constants,
        and not one the legacy mode hands back on the delegate's device)."""
        m = self.method.method
        vid = m.outputs[position]
        v = m.values[vid]
        return (isinstance(v, TensorValue) and v.storage == "output" and v.device == declared.device
                and v.dtype == declared.dtype and v.layout_strides == declared.layout_strides
                and self._host_io is not True)

    def bind_static(self, inputs, outputs, caller: CallerPlan):
        """The caller passes the same planned tensors (and sizes) every call: bind them once and
        return the zero-argument call, or None when this delegate must move its own data (legacy
        mode) or has dynamic sizes no call at these shapes has recorded yet."""
        m = self.method.method
        if self._needs_host_io(inputs) or not all(isinstance(m.values[v], TensorValue) for v in m.outputs):
            return None
        run = self.method.rebind(inputs, outputs, caller)
        if run is not None:
            self._host_io = False
        return run

    def _needs_host_io(self, inputs) -> bool:
        return self.device.type == "cuda" and any(
            isinstance(t, torch.Tensor) and t.device.type != "cuda" for t in inputs)

    def close(self) -> None:
        self.method.close()
