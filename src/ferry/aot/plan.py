"""Ahead-of-time memory planning, per device.

Why: every tensor a method computes gets a fixed (buffer, offset) at compile time, so the
runtime allocates each buffer once at load and nothing during execute; host and device
memory are planned separately because one buffer lives in exactly one memory.

This module is pure: it sees only sizes, devices and lifetimes (`PlanValue`), never
torch.fx, so it can be tested with hand-built inputs.

Offsets are aligned per device type (defaults and why: ferry/alignment.py), and each buffer
records its alignment so the runtime allocates it there: aligned offsets stay aligned in
real addresses.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from ferry.alignment import DEFAULT_ALIGNMENT, AlignmentSpec, alignment_for, resolve_alignment
from ferry.device import CPU, Device
from ferry.program.schema import Buffer, PlanEntry

__all__ = [
    "DEFAULT_ALIGNMENT",
    "ALGORITHMS",
    "InPlace",
    "PlanValue",
    "MemoryPlan",
    "plan_memory",
    "lower_bound",
]

ALGORITHMS = ("greedy", "naive")


@dataclass(frozen=True)
class PlanValue:
    """One tensor to plan. Lifetime [start, end] is inclusive, in instruction indices;
    start = -1 means alive from method start (inputs, mutable buffers)."""

    id: int
    nbytes: int
    device: Device
    start: int
    end: int


@dataclass(frozen=True)
class InPlace:
    """A kernel may write value `value` over the bytes of value `over` (same device and size): it
    reads each element of `over` before writing it there (`relu_`, `+=`, a cache's slice write).
    The planner takes it when `over` is read for the last time where `value` is made."""

    value: int
    over: int


@dataclass(frozen=True)
class MemoryPlan:
    """Per value its (buffer, offset); per buffer its size and device; buffers[0] is the
    reserved constants slot. lower_bounds is the live-bytes peak per group, the size no
    planner can beat (alignment ignored), kept for the compile report. in_place: value -> the
    first value of the chain whose bytes it was given (the candidates taken)."""

    entries: dict[int, PlanEntry]
    buffers: list[Buffer]
    lower_bounds: dict[Device, int]
    in_place: dict[int, int] = field(default_factory=dict)

    def planned_bytes(self) -> dict[Device, int]:
        """Bytes the runtime will allocate per device (buffer 0 holds no planned value and
        is left out, so the keys match lower_bounds)."""
        out: dict[Device, int] = {}
        for buf in self.buffers[1:]:
            out[buf.device] = out.get(buf.device, 0) + buf.size
        return out


# ---------------------------------------------------------------- validation


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate(values: Sequence[PlanValue]) -> None:
    seen: set[int] = set()
    for v in values:
        if not isinstance(v, PlanValue):
            raise ValueError(f"expected PlanValue, got {v!r}")
        if not _is_int(v.id):
            raise ValueError(f"value id must be an integer: {v!r}")
        if v.id in seen:
            raise ValueError(f"duplicate value id {v.id}: {v!r}")
        seen.add(v.id)
        if not _is_int(v.nbytes) or v.nbytes < 0:
            raise ValueError(f"nbytes must be an integer >= 0: {v!r}")
        if not isinstance(v.device, Device):
            raise ValueError(f"device must be a ferry Device: {v!r}")
        if not _is_int(v.start) or not _is_int(v.end):
            raise ValueError(f"start and end must be integers: {v!r}")
        if v.start < -1:
            raise ValueError(f"start must be >= -1 (-1 = alive from method start): {v!r}")
        if v.end < v.start:
            raise ValueError(f"end < start (lifetime is [start, end], inclusive): {v!r}")


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# ---------------------------------------------------------------- lower bound


def lower_bound(values: Sequence[PlanValue]) -> int:
    """Peak of sum(nbytes) over instruction indices: a sweep over start/end events,
    O(n log n), so it stays cheap on 100k-value graphs."""
    events: list[tuple[int, int]] = []
    for v in values:
        if v.nbytes:
            events.append((v.start, v.nbytes))
            events.append((v.end + 1, -v.nbytes))  # dead from end + 1 on
    events.sort()
    peak = live = 0
    i, n = 0, len(events)
    while i < n:
        t = events[i][0]
        while i < n and events[i][0] == t:  # apply every change at t before measuring
            live += events[i][1]
            i += 1
        peak = max(peak, live)
    return peak


# ---------------------------------------------------------------- algorithms


def _plan_naive(values: Sequence[PlanValue], align: int) -> tuple[dict[int, int], int]:
    """No sharing: the baseline greedy must never exceed."""
    offsets: dict[int, int] = {}
    top = 0
    for v in sorted(values, key=lambda v: v.id):
        if v.nbytes == 0:
            offsets[v.id] = 0
            continue
        off = _align_up(top, align)
        offsets[v.id] = off
        top = off + v.nbytes
    return offsets, _align_up(top, align)


class _IntervalIndex:
    """Placed lifetimes, queryable by overlap with [lo, hi], so greedy does not scan every
    placed value for each new one (segment tree over compressed time; `here` holds
    intervals covering a node's whole range, `below` every interval stored in its subtree)."""

    def __init__(self, n: int):
        self._n = n
        self._here: dict[int, list[int]] = {}
        self._below: dict[int, list[int]] = {}

    def add(self, lo: int, hi: int, item: int) -> None:
        stack = [(1, 0, self._n - 1)]
        while stack:
            node, lo_t, hi_t = stack.pop()
            if hi < lo_t or hi_t < lo:
                continue
            self._below.setdefault(node, []).append(item)
            if lo <= lo_t and hi_t <= hi:
                self._here.setdefault(node, []).append(item)
                continue
            m = (lo_t + hi_t) // 2
            stack.append((2 * node, lo_t, m))
            stack.append((2 * node + 1, m + 1, hi_t))

    def query(self, lo: int, hi: int) -> set[int]:
        out: set[int] = set()
        stack = [(1, 0, self._n - 1)]
        while stack:
            node, lo_t, hi_t = stack.pop()
            if hi < lo_t or hi_t < lo or node not in self._below:
                continue
            if lo <= lo_t and hi_t <= hi:
                out.update(self._below[node])
                continue
            here = self._here.get(node)
            if here:
                out.update(here)  # covers this node's whole range, which meets [lo, hi]
            m = (lo_t + hi_t) // 2
            stack.append((2 * node, lo_t, m))
            stack.append((2 * node + 1, m + 1, hi_t))
        return out


def _plan_greedy(values: Sequence[PlanValue], align: int) -> tuple[dict[int, int], int]:
    """Best fit, largest first: big tensors claim space early, small ones fill the holes
    that values with disjoint lifetimes leave between them."""
    offsets: dict[int, int] = {}
    live = []
    for v in values:
        if v.nbytes == 0:
            offsets[v.id] = 0  # occupies nothing, can overlap anything
        else:
            live.append(v)
    if not live:
        return offsets, 0
    times = sorted({t for v in live for t in (v.start, v.end)})
    index = _IntervalIndex(len(times))
    placed: list[tuple[int, int]] = []  # (offset, end offset), indexed by item number
    mask = align - 1  # align is a power of two
    top = 0
    for v in sorted(live, key=lambda v: (-v.nbytes, v.start, v.id)):
        lo = bisect.bisect_left(times, v.start)
        hi = bisect.bisect_left(times, v.end)
        conflicts = [placed[i] for i in index.query(lo, hi)]
        conflicts.sort()
        need = v.nbytes
        best_off, best_gap = -1, -1
        covered = 0  # highest end among conflicts seen so far (they may overlap each other)
        for off, end in conflicts:
            cand = (covered + mask) & ~mask
            gap = off - cand
            if gap >= need and (best_gap < 0 or gap < best_gap):
                best_off, best_gap = cand, gap
            if end > covered:
                covered = end
        if best_off < 0:
            best_off = (covered + mask) & ~mask
        offsets[v.id] = best_off
        index.add(lo, hi, len(placed))
        placed.append((best_off, best_off + v.nbytes))
        top = max(top, best_off + v.nbytes)
    return offsets, _align_up(top, align)


_ALGORITHMS = MappingProxyType({"greedy": _plan_greedy, "naive": _plan_naive})


# ---------------------------------------------------------------- entry point


def _in_place_chains(values: Sequence[PlanValue], candidates: Sequence[InPlace]) -> dict[int, int]:
    """value -> the first value of its chain, for the candidates whose `over` dies exactly where
    `value` is made (in the order given; a value takes the first that fits). Chains (a relu after
    an add) share one place."""
    by_id = {v.id: v for v in values}
    chain: dict[int, int] = {}
    for c in candidates:
        v, r = by_id.get(c.value), by_id.get(c.over)
        if v is None or r is None or c.value in chain or c.value == c.over:
            continue
        if r.end == v.start and r.start < v.start and r.device == v.device and r.nbytes == v.nbytes:
            chain[c.value] = chain.get(c.over, c.over)
    return chain


def _merged(values: Sequence[PlanValue], chain: dict[int, int]) -> list[PlanValue]:
    """One value per chain, alive from its first member's start to its last member's end."""
    span: dict[int, PlanValue] = {}
    for v in values:
        root = chain.get(v.id, v.id)
        got = span.get(root)
        span[root] = v if got is None else PlanValue(root, got.nbytes, got.device, min(got.start, v.start),
                                                     max(got.end, v.end))
    return [PlanValue(root, v.nbytes, v.device, v.start, v.end) for root, v in span.items()]


def plan_memory(
    values: Sequence[PlanValue],
    *,
    algorithm: str = "greedy",
    alignment: AlignmentSpec = None,
    in_place: Sequence[InPlace] = (),
) -> MemoryPlan:
    """Plan every value into one buffer per device (buffers[0] stays the constants slot).

    `alignment`: one int for every device, {device type or 'default': int}, or None for
    ferry's defaults. `in_place`: results a kernel may write over an input (taken where the
    lifetimes allow; "naive" shares nothing). Legacy mode (one host pool) is decided by
    placement: its values all arrive here on the CPU."""
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"unknown memory planning algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    table = resolve_alignment(alignment)
    values = list(values)
    _validate(values)
    chain = _in_place_chains(values, in_place) if algorithm != "naive" else {}
    values = _merged(values, chain)

    groups: dict[Device, list[PlanValue]] = {}
    for v in values:
        groups.setdefault(v.device, []).append(v)
    order = sorted(groups, key=lambda d: (d != CPU, d.type, d.index))

    run = _ALGORITHMS[algorithm]
    entries: dict[int, PlanEntry] = {}
    buffers: list[Buffer] = [Buffer(0, CPU)]
    lower_bounds: dict[Device, int] = {}
    for device in order:
        group = groups[device]
        align = alignment_for(table, device.type)
        offsets, size = run(group, align)
        buf = len(buffers)
        buffers.append(Buffer(size, device, align))
        for v in group:
            entries[v.id] = PlanEntry(buf, offsets[v.id])
        lower_bounds[device] = lower_bound(group)
    for vid, root in chain.items():
        entries[vid] = entries[root]
    return MemoryPlan(entries=entries, buffers=buffers, lower_bounds=lower_bounds, in_place=chain)
