"""The one record of a kernel choice, the one cache of them, and where a choice is asked for.

Every kernel choice ferry makes by measuring (an `.out` overload against the functional kernel
at compile time; eager's kernel against a composed form at load) is a `Decision`, made once per
key and process and kept in `DECISIONS`. `ferry run` prints what was timed at load; the program
file keeps, per op, why it runs as it does (`ferry inspect`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ferry.capture import LOCK, TimingRoom

__all__ = ["DECISIONS", "Decision", "Decisions", "Site"]


@dataclass(frozen=True)
class Decision:
    """One choice: for `op` at arguments like `shape` (on `device`), the `forms` weighed (the
    first is what eager runs), their times where they were timed (µs; empty where a check or a
    measurement of memory decided), the form picked and why."""

    family: str
    op: str
    shape: str
    forms: tuple[str, ...]
    times_us: tuple[float, ...]
    pick: str
    why: str
    device: str = ""

    @property
    def taken(self) -> bool:
        """Another form than eager's runs."""
        return self.pick != self.forms[0]

    @property
    def saving_us(self) -> float:
        return self.times_us[0] - self.times_us[self.forms.index(self.pick)] if self.times_us else 0.0


class Decisions:
    """Registry: every decision of this process, by key, each made once (thread-safe; the lock is
    the capture lock, so no decision is timed while a graph is being captured elsewhere)."""

    def __init__(self) -> None:
        self._made: dict[tuple, Decision | None] = {}

    def get(self, key: tuple, decide: Callable[[], Decision | None], may_decide: bool = True) -> Decision | None:
        """The decision for `key`: made now by `decide` where it is new and `may_decide`; else
        what was decided before, or None. `decide` may return None (nothing could be measured)."""
        with LOCK:
            if key not in self._made and may_decide:
                self._made[key] = decide()
            return self._made.get(key)

    def values(self, timed: bool = False) -> list[Decision]:
        """The decisions made (`timed`: only those timed on a GPU), in the order they were made."""
        with LOCK:
            return [d for d in self._made.values() if d is not None and (d.times_us or not timed)]

    def forget(self) -> None:
        """Drop every decision (tests; a process whose GPU settings changed decides again anyway:
        the settings are part of each key)."""
        with LOCK:
            self._made.clear()


DECISIONS = Decisions()


@dataclass(frozen=True)
class Site:
    """Where a kernel choice is asked for, from the binder's context.

    device:   the GPU the op runs on (every operand may be a meta tensor), or None
    measure:  a method is loading, so a new choice may be timed now; a plan bound during a
              call uses only what was decided before
    captured: the plan runs as CUDA graphs, so forms that launch more kernels may be chosen
    streams:  the captured plan's CopyStreams (its graphs are captured on their capture
              streams, and a choice is timed by replaying graphs there), or None
    """

    device: torch.device | None = None
    measure: bool = False
    captured: bool = False
    streams: Any = None

    @property
    def replays(self) -> bool:
        """Choices are timed by replaying graphs on the plan's capture streams (a replay times a
        form of many launches faster than a stream does, so this is part of every key)."""
        return self.captured and self.streams is not None and self.streams.api.device_type == "cuda"

    def replay_stream(self):
        """The stream this plan captures the current CUDA device's graphs on, or None."""
        return self.streams.capture_stream(torch.cuda.current_device()) if self.replays else None

    def timing_room(self, nbytes: int) -> TimingRoom | None:
        """Where forms timed here may allocate `nbytes` of results on the current CUDA device:
        the plan's graph pool where its load left room for them (CopyStreams.timing_room), or
        None (a pool of the timing's own)."""
        lend = getattr(self.streams, "timing_room", None) if self.replays else None
        return lend(torch.cuda.current_device(), nbytes) if lend is not None else None
