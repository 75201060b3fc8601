"""Load: the memory of one method — planned buffers, constants, and a slot per value.

Every buffer is allocated once, here, on its device and at its alignment; constants on the
host are views of the program file, device constants are uploaded once. Each value gets a
slot: a tensor (or constant) fixed for the life of the method, or None for what changes per
call (caller tensors, fresh outputs, run-time results, sizes). What a value is comes from
its storage kind in the program; nothing here guesses it. All or nothing: if anything fails,
what was allocated is freed before the error propagates. Given the load's reservation
(runtime/devices/slab.py), device memory is taken from it: one allocation per device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ferry.choices import scratch_space
from ferry.device import Device
from ferry.errors import ProgramError
from ferry.ops import OUT_COPY_KERNELS
from ferry.program.schema import CONST_KIND_TABLE, LIST_KINDS, ConstValue, KernelCall, Method, TensorValue
from ferry.program.states import method_states
from ferry.runtime.devices.allocator import HeldMemory
from ferry.runtime.devices.slab import MemoryReservation, allocate
from ferry.runtime.devices.tensor import make_tensor
from ferry.runtime.stages.shared import DeviceUploads, ProgramState, constant_tensor, upload

__all__ = ["Memory", "constant_tensor", "load_memory"]  # constant_tensor: runtime/stages/shared.py


@dataclass
class Memory:
    """What load leaves for binding: a slot per value and which slots are fixed.

    staged:  device inputs (value id -> input position) and device outputs given fixed
             tensors of their own so CUDA graphs can capture the segments that use them.
    """

    slots: list
    fixed: list[bool]
    owned: list = field(default_factory=list)  # DeviceMemoryBuffers, SlabPieces (and a method's own ProgramState)
    staged_inputs: dict[int, int] = field(default_factory=dict)
    staged_outputs: set[int] = field(default_factory=set)
    arenas: dict[torch.device, torch.Tensor] = field(default_factory=dict)  # see free_arenas; emptied after the load
    wrote_planned: bool = False  # the load wrote a value into planned memory (a mutable buffer's first)

    def free_arenas(self) -> dict[torch.device, torch.Tensor]:
        """The largest planned buffer of each device, none of it written by the load: free until
        the first call (the load's timing carves its stand-ins from it, choices/scratch_space.py)."""
        return {} if self.wrote_planned else dict(self.arenas)

    def close(self) -> None:
        self.arenas = {}  # (a view kept would keep its memory)
        for b in self.owned:
            b.close()
        self.owned = []


def load_memory(segments: list, method: Method, *, pin_host: bool = True, stage_io: bool = False,
                buffers: list[torch.Tensor] | None = None, uploads: DeviceUploads | None = None,
                state: ProgramState | None = None, reservation: MemoryReservation | None = None) -> Memory:
    """Allocate and fill the memory of `method`; `stage_io` gives device inputs and outputs
    fixed tensors (for CUDA graphs). `buffers`: memory the caller already planned for the
    method's buffers (a delegate working in its caller's arena), in place of allocating them.
    `uploads`, `state`: the module's device weights and mutable buffers, shared by its methods
    (without them the method holds its own). `reservation`: where device memory comes from
    (without it, an allocation each)."""
    mem = Memory([None] * len(method.values), [False] * len(method.values))
    try:
        _Loader(segments, method, mem, uploads, state, reservation).load(pin_host, stage_io, buffers)
    except BaseException:
        mem.close()
        raise
    return mem


class _Given:
    """Memory someone else allocated and owns, in the shape of a DeviceMemoryBuffer."""

    def __init__(self, memory: torch.Tensor):
        self.memory = memory


class _Loader:
    def __init__(self, segments, method: Method, mem: Memory, uploads=None, state=None, reservation=None):
        self.segments, self.m, self.mem = segments, method, mem
        self.uploads, self.reservation = uploads, reservation
        if state is None:  # a method loaded on its own holds its state (freed with its memory)
            state = ProgramState(segments, {method.name: method})
            mem.owned.append(state)
        self.state = state

    def load(self, pin_host: bool, stage_io: bool, given: list[torch.Tensor] | None = None) -> None:
        m = self.m
        buffers = [None] + (self._given(given) if given is not None else self._allocate(pin_host))
        for buf, planned in zip(buffers[1:], m.buffers[1:]):
            device, memory = planned.device.to_torch(), buf.memory
            if memory.numel() > self.mem.arenas.get(device, memory[:0]).numel():
                self.mem.arenas[device] = memory
        mutable = {mb.value for mb in m.mutable_buffers}
        states = method_states(m)
        for vid, v in enumerate(m.values):
            if isinstance(v, ConstValue):
                self._const(vid, v)
            elif v.storage == "planned":
                mem = buffers[v.plan.buffer]  # type: ignore[union-attr]
                if mem is None:
                    raise ProgramError(f"value {vid} is planned in buffer 0, which is reserved for constants")
                self._fix(vid, make_tensor(mem.memory, v.shape, v.torch_dtype, v.device, v.plan.offset,  # type: ignore[union-attr]
                                           v.strides))
                if vid in mutable and v.constant is not None:
                    self.mem.wrote_planned = True
                    scratch_space.withdraw()  # (a delegate's arena lies in its caller's, lent out now)
                    self._upload(self.mem.slots[vid], v)
            elif v.storage == "constant":
                self._fix(vid, self._constant(v))
            elif v.storage == "state":
                self._fix(vid, self.state.tensor(states[vid], self.reservation))
            elif v.storage == "scratch":
                # an out argument nobody reads (batch norm's saved statistics in eval, ...): a plain,
                # resizable tensor; if this device's kernel needs it larger than traced, it grows
                # (once) instead of writing over planned neighbours (so never a piece of a slab, whose
                # storage is the whole slab)
                self._fix(vid, torch.empty(v.shape, dtype=v.torch_dtype, device=v.device.to_torch()))
        if stage_io:
            self._stage_io()
        for vid, v in enumerate(m.values):  # a list whose members are all fixed is built once
            if isinstance(v, ConstValue) and v.kind in LIST_KINDS and all(
                    x is None or self.mem.fixed[x] for x in v.value):  # type: ignore[attr-defined]
                self._fix(vid, [None if x is None else self.mem.slots[x] for x in v.value])  # type: ignore[attr-defined]

    def _allocate(self, pin_host: bool) -> list:
        m = self.m
        copies = any(isinstance(i, KernelCall) and i.kernel in OUT_COPY_KERNELS for i in m.instructions)
        return [self._own(b.size, b.device, b.alignment, pin_host and copies and b.device.is_cpu)
                for b in m.buffers[1:]]

    def _given(self, given: list[torch.Tensor]) -> list:
        wanted = self.m.buffers[1:]
        if len(given) != len(wanted) or any(t.numel() < b.size or t.dtype != torch.uint8 for t, b in zip(given, wanted)):
            raise ProgramError(f"method {self.m.name!r} needs buffers of {[b.size for b in wanted]} bytes, "
                               f"was given {[t.numel() for t in given]}")
        return [_Given(t) for t in given]

    def _fix(self, vid: int, value) -> None:
        self.mem.slots[vid], self.mem.fixed[vid] = value, True

    def _const(self, vid: int, v: ConstValue) -> None:
        if v.kind in LIST_KINDS or v.kind == "symint":
            return  # lists are built after their members; sizes are computed each call
        self._fix(vid, CONST_KIND_TABLE[v.kind].runtime(v.value))

    def _own(self, nbytes: int, device: Device, alignment: int | None = None,
             pin: bool = False) -> HeldMemory:
        buf = allocate(nbytes, device, alignment, pin_memory=pin, reservation=self.reservation)
        self.mem.owned.append(buf)
        return buf

    def _empty(self, v: TensorValue) -> torch.Tensor:
        return make_tensor(self._own(v.nbytes, v.device).memory, v.shape, v.torch_dtype, v.device, 0, v.strides)

    def _constant(self, v: TensorValue) -> torch.Tensor:
        """Host constants are views of the mapped file; device constants are uploaded once."""
        if v.device.is_cpu:
            return constant_tensor(self.segments[v.constant], v)
        if self.uploads is not None:
            return self.uploads.get(v, self.reservation)
        t = self._empty(v)
        self._upload(t, v)
        return t

    def _upload(self, dst: torch.Tensor, v: TensorValue) -> None:
        upload(dst, self.segments[v.constant], v)

    def _stage_io(self) -> None:
        """Device inputs (skip_h2d) and fresh device outputs (skip_d2h) get fixed tensors of
        their own (at the bound of a dynamic shape). A call copies each input into its tensor
        on the device, and outputs are handed out as planned outputs are, so the segments that
        use them keep fixed addresses and can be captured. A dynamic one is used by the plans
        bound at one shape (viewed at it: runtime/stages/frame.py); the plan for any shape takes
        the caller's tensors."""
        m = self.m
        for pos, vid in enumerate(m.inputs):
            v = m.values[vid]
            if isinstance(v, TensorValue) and v.storage == "input" and not v.device.is_cpu:
                self._fix(vid, self._empty(v))
                self.mem.staged_inputs[vid] = pos
        for vid in m.outputs:
            v = m.values[vid]
            if isinstance(v, TensorValue) and v.storage == "output" and not v.device.is_cpu:
                self._fix(vid, self._empty(v))
                self.mem.staged_outputs.add(vid)
