"""Schedule: a pure function from bound steps to the order of work.

Given which device type runs asynchronously to the host (CUDA; the simulated device in
tests), it decides three things and nothing else:

* host waits: the host waits for pending copies exactly where host code is next about to
  run after a copy that touched host memory (it may read a `_d2h_copy` result or overwrite
  what an `_h2d_copy` still reads), and at the end of a call that left such a copy pending;
* segments: maximal runs of asynchronous steps on one device, ended by host work or by a
  copy between two devices (which runs on its own, between the segments of its two ends);
* capture: with graphs asked for, a segment whose every step is capturable is marked for
  capture; the others run step by step, with a note saying why. A step that cannot be
  captured (it reads a tensor the caller passes per call, or copies to or from memory bound
  per call) does not spoil its neighbours: it ends the captured run before it, and what
  reads only planned memory after it starts a new one.

It touches no stream, event or tensor, so every decision is tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from ferry.device import Device
from ferry.runtime.stages.steps import Step

__all__ = ["HostWait", "Run", "Schedule", "Segment", "schedule"]


@dataclass(frozen=True)
class Run:
    """A host step, run where it stands."""

    step: Step


@dataclass(frozen=True)
class HostWait:
    """The host waits for the copies issued so far."""


@dataclass(frozen=True)
class Segment:
    """Asynchronous steps on one device (`device` None: a copy between two devices)."""

    device: Device | None
    steps: tuple[Step, ...]
    touches_host: bool
    capture: bool

    @property
    def writes(self) -> frozenset[int]:
        """Values of the call the segment produces: after a replay, their slots point at the
        tensors the capture made (the replay rewrote their memory)."""
        return frozenset().union(*(s.writes for s in self.steps))

    @property
    def label(self) -> str:
        return f"instructions {self.steps[0].label}..{self.steps[-1].label}"


Work = Union[Run, HostWait, Segment]


@dataclass(frozen=True)
class Schedule:
    work: tuple[Work, ...]
    notes: tuple[str, ...] = ()

    def segments(self) -> list[Segment]:
        return [w for w in self.work if isinstance(w, Segment)]

    def without_final_wait(self) -> Schedule:
        """The same work, leaving the copies of the end in flight (a micro-batch but the last:
        the caller waits once, after the last part)."""
        if self.work and isinstance(self.work[-1], HostWait):
            return Schedule(self.work[:-1], self.notes)
        return self


def _device_of(step: Step, async_type: str) -> Device | None:
    """The one asynchronous device a step runs on; None for a copy between two of them."""
    devs = {d for d in step.devices if d.type == async_type}
    return next(iter(devs)) if len(devs) == 1 else None


def schedule(steps: Sequence[Step | None], async_type: str | None, graphs: bool = False,
             pending: bool = False) -> Schedule:
    """The order of work for `steps` (None entries: done at bind time) when devices of
    `async_type` run asynchronously (None: every step runs where it stands). `pending`: copies
    touching host memory may still be in flight when the call starts (the previous micro-batch
    left them), so the first host step waits for them too."""
    work: list[Work] = []
    notes: list[str] = []
    segment: list[Step] = []
    current = _Run()
    pending = pending and async_type is not None

    def close():
        if segment:
            work.append(_segment(segment, async_type, graphs, notes))
            segment.clear()

    for step in steps:
        if step is None:
            continue
        if async_type is None or not any(d.type == async_type for d in step.devices):
            close()
            if pending:
                work.append(HostWait())
                pending = False
            work.append(Run(step))
            continue
        device = _device_of(step, async_type)
        if segment and (device is None or device != _device_of(segment[0], async_type)
                        or graphs and current.joins(step) != current.capturable):
            close()
        if not segment:
            current = _Run()
        current.add(step)
        segment.append(step)
        pending = pending or step.touches_host
    close()
    if pending:
        work.append(HostWait())
    return Schedule(tuple(work), tuple(notes))


class _Run:
    """Whether the segment being built could be captured so far, and what it produced."""

    def __init__(self):
        self.capturable, self.produced = True, set()

    def joins(self, step: Step) -> bool:
        """Whether `step` could be captured at the end of this run (were the run captured)."""
        return step.capturable and step.reads <= (self.produced if self.capturable else set())

    def add(self, step: Step) -> None:
        self.capturable = self.joins(step)
        self.produced |= step.writes


def _self_contained(steps: list[Step]) -> bool:
    """Every value of the call a step reads is produced by an earlier step of the run."""
    produced: set[int] = set()
    for s in steps:
        if not s.reads <= produced:
            return False
        produced |= s.writes
    return True


def _segment(steps: list[Step], async_type: str, graphs: bool, notes: list[str]) -> Segment:
    device = _device_of(steps[0], async_type)
    capture = graphs and device is not None and all(s.capturable for s in steps) and _self_contained(steps)
    seg = Segment(device, tuple(steps), any(s.touches_host for s in steps), capture)
    if graphs and device is not None and not capture and not all(s.kind == "copy" and s.reads for s in steps):
        # (copies of memory bound per call, a micro-batch's: by design, and one launch each anyway)
        notes.append(f"{seg.label} run without a graph (they read tensors the caller passes per call, "
                     "or pageable host memory)")
    return seg
