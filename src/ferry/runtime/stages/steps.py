"""What binding makes of a method: its Steps (the scheduler's input), how a call meets the
caller's tensors (CallIO), and the Bound method that carries both with its frame of slots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ferry.device import Device
from ferry.program.schema import TensorValue

__all__ = ["Bound", "CallIO", "Step"]


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
    returns:       its call hands back tensors it made, which later steps take (compiled code
                   returning its results): a simulated device runs it at host time

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
    returns: bool = False  # hands back tensors it made (compiled code returning its results)

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
