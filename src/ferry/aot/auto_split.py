"""The search of device_map="auto": the best contiguous split of units over devices.

`Spans` estimates every contiguous run of units [a, b] as one stage on one device:

* time: the units' op time, plus the tensors that enter the stage from elsewhere (their bytes
  over the link and a launch each, auto_cost.copy_seconds);
* memory: the weights its units read (a weight read twice in the stage counted once), the
  tensors entering it (held for the whole call, as a delegate holds its inputs) and the
  largest set of the stage's own tensors live at one time: those made earlier in the stage
  and still to be read, plus the working set of the unit running then.

`search` is a dynamic program over (device, units placed so far): each device in order takes
the next run of units (or none). It runs twice. First for the fastest split, scored
lexicographically by the bytes by which its worst device overflows its budget (0 when it
fits), the time of its CPU stages (the CPU takes only what the accelerators cannot hold, as
in accelerate), the time of its slowest accelerator stage (what bounds pipelined throughput)
and the bytes it holds; every term combines monotonically (max, sum, max, sum), so the split
found fits whenever one does: no greedy filling, no cut forced by where a device happened to
fill. Then, among the splits that fit with every accelerator stage within a slack of that
slowest time (the estimate is no finer), for the leanest: the fewest weight bytes held (a
tied weight held once), the least time copying between stages (fewer and smaller tensors
crossing: cuts between blocks, not inside them; no stage that saves nothing), the fewest
bytes held. A fastest split alone would treat stages that are not the slowest as free, and
cut them anywhere.

A unit reading a weight an earlier unit reads (tied output embeddings) may be taken out of
the sequence and run beside its owner, on the owner's device: the weight is then held once,
and its input crosses back. `Spans(beside=)` estimates that placement; auto_map compares both.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import NamedTuple

from ferry.aot.auto_cost import copy_seconds
from ferry.aot.auto_units import Facts, Unit


class Run(NamedTuple):
    """A run of units [first, last] as one stage: seconds (copies in included), of which
    copies, and bytes of weights and activations."""

    last: int
    seconds: float
    copies: float
    weights: int
    activations: int


@dataclass(frozen=True)
class Score:
    over: int  # bytes by which the worst device overflows its budget
    cpu_seconds: float
    slowest: float  # the slowest accelerator stage
    held: int  # bytes held on all devices
    weights: int  # of which weights (a weight held on two devices counts twice)
    copies: float  # seconds spent copying into stages, all stages together

    def key(self, lean: float | None = None):
        if lean is None:
            return (self.over, self.cpu_seconds, self.slowest, self.held)
        return (self.cpu_seconds, self.weights, self.copies, self.held)

    def then(self, run: Run, is_cpu: bool, over: int) -> Score:
        """This score with one more stage."""
        return Score(max(self.over, over, 0), self.cpu_seconds + (run.seconds if is_cpu else 0.0),
                     self.slowest if is_cpu else max(self.slowest, run.seconds), self.held + run.weights + run.activations,
                     self.weights + run.weights, self.copies + run.copies)


@dataclass(frozen=True)
class Split:
    """Per device, in the order given: the run of units [start, end) it takes (empty: start == end),
    and the estimate of each stage: (weights, activations, seconds)."""

    runs: list[tuple[int, int]]
    estimates: list[tuple[int, int, float]]
    score: Score


class Spans:
    """Estimates of each contiguous run of `seq` as one stage; `beside` maps a unit index of
    `seq` to units placed on its device though they run elsewhere in the program."""

    def __init__(self, facts: Facts, seq: list[Unit], beside: dict[int, list[Unit]] | None = None):
        self.n = n = len(seq)
        self.seq, self.beside = seq, beside or {}
        groups = seq + [t for ts in self.beside.values() for t in ts]
        unit_of = _unit_of(len(facts.order), groups)
        self.internal = _internal(facts, groups, unit_of)
        # (made in unit, the later units that read it, sorted, bytes); a read beside an owner is at n
        self.crossing: list[tuple[int, tuple[int, ...], int]] = []
        satellite_in = [(0, 0)] * len(groups)
        for v in facts.values:
            made = unit_of[v.made] if v.made >= 0 else -1
            read = {unit_of[r] if r < len(unit_of) else len(groups) for r in v.reads} - {made}
            for g in read:
                if n <= g < len(groups):
                    satellite_in[g] = (satellite_in[g][0] + v.nbytes, satellite_in[g][1] + 1)
            later = tuple(sorted({min(r, n) for r in read if r > made}))
            if made < n and later:  # a tensor made beside its owner is counted with it
                self.crossing.append((made, later, v.nbytes))
        self.made_bytes = [0] * (n + 1)
        self.by_last: list[list[tuple[int, int]]] = [[] for _ in range(n + 1)]
        for made, later, nbytes in self.crossing:
            if made >= 0:
                self.made_bytes[made] += nbytes
            self.by_last[later[-1]].append((made, nbytes))
        self.extra, g = {}, n
        for owner, ts in self.beside.items():
            self.extra[owner] = self._satellite(ts, range(g, g + len(ts)), satellite_in)
            g += len(ts)

    def _satellite(self, units: list[Unit], groups: range, satellite_in) -> tuple[float, float, dict[str, int], int]:
        """What the units placed beside an owner add to its stage: time, of which copies,
        weights, activations (they run apart from the rest of the stage: the larger counts)."""
        seconds, copies, weights, act = 0.0, 0.0, {}, 0
        for g, t in zip(groups, units):
            in_bytes, in_count = satellite_in[g]
            copies += copy_seconds(in_bytes, in_count)
            seconds += t.seconds
            weights.update(t.weights)
            act = max(act, in_bytes + self.internal[g])
        return seconds + copies, copies, weights, act

    def runs_from(self, a: int, cap: float):
        """A Run for each run of units [a, b], while its weights stay within `cap` (they only
        grow with b)."""
        in_at, count_at = [0] * (self.n + 1), [0] * (self.n + 1)
        for made, later, nbytes in self.crossing:
            if made < a:
                i = bisect_left(later, a)
                if i < len(later):
                    in_at[later[i]] += nbytes
                    count_at[later[i]] += 1
        weights: dict[str, int] = {}
        seconds, weight_bytes, in_bytes, in_count, through, peak = 0.0, 0, 0, 0, 0, 0
        extra_seconds, extra_copies, extra_act = 0.0, 0.0, 0
        for b in range(a, self.n):
            if b > a:
                through += self.made_bytes[b - 1] - sum(nb for m, nb in self.by_last[b - 1] if m >= a)
            groups = [self.seq[b].weights]
            if b in self.extra:
                t_seconds, t_copies, t_weights, t_act = self.extra[b]
                extra_seconds, extra_copies = extra_seconds + t_seconds, extra_copies + t_copies
                extra_act = max(extra_act, t_act)  # (a stage may hold two owners, each with its tied user)
                groups.append(t_weights)
            for more in groups:
                for name, nbytes in more.items():
                    if name not in weights:
                        weights[name] = nbytes
                        weight_bytes += nbytes
            if weight_bytes > cap:
                return
            seconds += self.seq[b].seconds
            in_bytes, in_count = in_bytes + in_at[b], in_count + count_at[b]
            peak = max(peak, through + self.internal[b])
            copies = copy_seconds(in_bytes, in_count) + extra_copies
            yield Run(b, seconds + extra_seconds + copies, copies, weight_bytes, max(in_bytes + peak, extra_act))


def _unit_of(positions: int, groups: list[Unit]) -> list[int]:
    """The unit index of every op position; an op in no unit (one no delegate runs) goes with
    the unit of the op before it."""
    unit_of = [-1] * positions
    for g, u in enumerate(groups):
        for p in u.positions:
            unit_of[p] = g
    last = 0
    for p in range(positions):
        if unit_of[p] < 0:
            unit_of[p] = last
        last = unit_of[p]
    return unit_of


def _internal(facts: Facts, groups: list[Unit], unit_of: list[int]) -> list[int]:
    """Per unit, the most bytes of its own tensors live at one op: a tensor read outside its unit
    is live to the unit's end."""
    end = [max(u.positions) for u in groups]
    delta = [0] * (len(unit_of) + 1)
    for v in facts.values:
        if v.made < 0:
            continue
        g = unit_of[v.made]
        inside = all(r < len(unit_of) and unit_of[r] == g for r in v.reads)
        last = max(v.reads, default=v.made) if inside else end[g]
        delta[v.made] += v.nbytes
        delta[max(last, v.made) + 1] -= v.nbytes
    internal, live = [0] * len(groups), 0
    for p in range(len(unit_of)):
        live += delta[p]
        internal[unit_of[p]] = max(internal[unit_of[p]], live)
    return internal


def search(spans: Spans, devices: list[tuple[bool, int]], strict: bool, limit: float | None = None) -> Split | None:
    """The best split of `spans` over `devices` ((is the CPU, budget) each, in order).

    Without `limit`: the fastest, by (overflow, CPU time, slowest accelerator stage, bytes
    held); `strict`: only splits that fit (None when none does), else the one that overflows
    least. With `limit`: among the splits that fit and whose accelerator stages all take at
    most `limit` seconds, the leanest, by (CPU time, weight bytes held, time spent copying
    into stages, bytes held): every term a sum, so the program is exact for this order too."""
    n = spans.n
    cap = max(b for _, b in devices) if strict or limit is not None else float("inf")
    table = [list(spans.runs_from(a, cap)) for a in range(n)]
    best: list[Score | None] = [Score(0, 0.0, 0.0, 0, 0, 0.0)] + [None] * n
    back: list[list[tuple[int, Run] | None]] = []
    for is_cpu, budget in devices:
        new = list(best)
        choice: list[tuple[int, Run] | None] = [None] * (n + 1)
        for a in range(n):
            s = best[a]
            if s is None:
                continue
            for run in table[a]:
                over = run.weights + run.activations - budget
                if (strict or limit is not None) and over > 0:
                    continue
                if limit is not None and not is_cpu and run.seconds > limit:
                    continue
                cand = s.then(run, is_cpu, over)
                if new[run.last + 1] is None or cand.key(limit) < new[run.last + 1].key(limit):  # type: ignore[union-attr]
                    new[run.last + 1], choice[run.last + 1] = cand, (a, run)
        best = new
        back.append(choice)
    final = best[n]
    return None if final is None else _backtrack(back, n, final)


def _backtrack(back, n: int, score: Score) -> Split:
    runs, estimates, j = [], [], n
    for choice in reversed(back):
        if choice[j] is None:
            runs.append((j, j))
            estimates.append((0, 0, 0.0))
            continue
        a, run = choice[j]
        runs.append((a, j))
        estimates.append((run.weights, run.activations, run.seconds))
        j = a
    return Split(runs[::-1], estimates[::-1], score)
