"""device_map="auto": the contiguous split of modules that fits each device's budget, balanced in time.

The choice is a device map of module paths, so it can be printed and reused as an explicit
map. It works from estimates, made before lowering (auto_cost: the time of an op; auto_split:
the time and memory of a run of modules as one stage).

Units are modules (auto_units), as coarse as the budgets allow: never split inside a no-split
class (transformers' `_no_split_modules`, read from the model's own classes, or the caller's
`no_split_module_classes`, as in accelerate), split further only while no split fits. For each
set of units, a dynamic program over contiguous splits (auto_split.search) finds the split that
fits with the fastest slowest stage; so whenever some contiguous split at module granularity
fits the estimates, one is found. A unit that reads a weight an earlier unit reads (a tied
`lm_head`) is tried both in its place and beside the weight's owner; among the splits within
TIE_SLACK of the fastest, the one holding the fewest weight bytes wins, then the one copying
least between stages: a tied weight is held once unless that costs real time. Accelerators
come first, in the order given; a "cpu" budget only takes what the accelerators cannot hold,
as in accelerate.

Compile then checks the real plan against the budgets (ferry.compile): where it overflows a
device, the chooser runs again with that device's budget lowered by what the estimate missed,
a few times at most; the result fits, or is a CompileError naming the device, the original
budget and the module that needs the bytes, never a program that does not fit.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import combinations

from ferry.aot.auto_split import Spans, Split, search
from ferry.aot.auto_units import Facts, Unit, coarse_units, gather, refine, tied_users
from ferry.device import Device
from ferry.errors import CompileError, ConfigError
from ferry.program.footprint import parse_bytes

SPLIT_SHARE = 4  # a unit above 1/4 of a device's share of the time starts split into its submodules
TIE_SLACK = 0.1  # splits this close in time are alike: below the estimate's precision
MAX_TIED = 3  # tied users tried beside their owners, in every combination (2**3 searches at most)


def parse_budgets(max_memory) -> dict[Device, int]:
    """{device: bytes} from {"cuda:0": "20GiB", 1: 2**30, "cpu": "64GB"}; ints are GPU indices."""
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise ConfigError(
            "device_map='auto' needs max_memory={device: size}, e.g. {'cuda:0': '20GiB', 'cuda:1': '20GiB'}: "
            f"it names the devices to use and what each may hold; got {max_memory!r}"
        )
    budgets: dict[Device, int] = {}
    for key, value in max_memory.items():
        try:
            if isinstance(key, str) and key.strip().isdigit():
                key = int(key)  # JSON keys are strings: "0" is GPU 0, as the int 0 is
            device = Device("cuda", key) if isinstance(key, int) and not isinstance(key, bool) else Device.parse(key)
            budgets[device] = parse_bytes(value, f"max_memory[{key!r}]")
        except ValueError as e:
            raise ConfigError(f"max_memory: {e}") from None
    return budgets


@dataclass(frozen=True)
class Choice:
    """A chosen map; per device, the weight and activation bytes it was estimated at and the
    modules placed there ((path, weight bytes, bytes alone) each); whether the estimate fits."""

    device_map: dict[str, Device]
    weights: dict[Device, int]
    activations: dict[Device, int]
    fits: bool = True
    placed: dict[Device, list[tuple[str, int, int]]] = field(default_factory=dict)


def auto_device_map(exported_program, budgets: dict[Device, int], supported, no_split_module_classes=(),
                    original: dict[Device, int] | None = None) -> Choice:
    """The device map for `exported_program` under `budgets` ({device: bytes}, maybe lowered by
    compile's retries; errors quote `original`, the caller's)."""
    facts = gather(exported_program, supported)
    if not facts.ops_under[""]:
        return Choice({"": next(iter(budgets))}, {}, {})
    no_split = facts.no_split | _given(no_split_module_classes, facts)
    order = [d for d in budgets if not d.is_cpu] + [d for d in budgets if d.is_cpu]
    devices = [(d.is_cpu, budgets[d]) for d in order]
    share = sum(facts.seconds) / (sum(1 for d in order if not d.is_cpu) or 1)
    units = coarse_units(facts, no_split, share / SPLIT_SHARE, min(budgets.values()))
    while True:
        found = best_split(facts, units, devices, strict=True)
        if found is not None:
            break
        finer = refine(facts, units, no_split, [w + a for w, a in alone(facts, units)])
        if finer is None:
            refuse(facts, units, no_split, original or budgets)
            found = best_split(facts, units, devices, strict=False)
            assert found is not None
            break
        units = finer
    return _choice(facts, units, order, *found)


def _given(names, facts: Facts) -> frozenset[str]:
    """The caller's no-split classes; one that names no module class of the program is told."""
    unknown = sorted(set(names) - set(facts.classes.values()))
    if unknown:
        warnings.warn(f"no_split_module_classes={unknown} matches no module of this program (its classes include "
                      f"{sorted(set(facts.classes.values()))[:8]}): nothing is kept whole for it", stacklevel=4)
    return frozenset(names)


def alone(facts: Facts, units: list[Unit]) -> list[tuple[int, int]]:
    """(weights, activations) of each unit as a stage of its own."""
    spans = Spans(facts, units)
    return [next((r.weights, r.activations) for r in spans.runs_from(k, float("inf"))) for k in range(len(units))]


def variants(units: list[Unit]):
    """(units in sequence, {owner index in it: units placed beside it}) for each combination of
    tied users moved beside their owners, the plain sequence first."""
    pairs = tied_users(units)[:MAX_TIED]
    for r in range(len(pairs) + 1):
        for moved in combinations(pairs, r):
            users = {u for u, _ in moved}
            if users & {o for _, o in moved}:
                continue  # an owner moved beside another owner: not a placement worth trying
            index = {i: k for k, i in enumerate(i for i in range(len(units)) if i not in users)}
            beside: dict[int, list[Unit]] = {}
            for u, o in moved:
                beside.setdefault(index[o], []).append(units[u])
            yield [units[i] for i in index], beside


def best_split(facts: Facts, units: list[Unit], devices, strict: bool):
    """(split, sequence, beside) of the best placement of `units`, or None when none fits
    (`strict`): the fastest, then the leanest within TIE_SLACK of its time (auto_split)."""
    options = [(seq, beside, Spans(facts, seq, beside)) for seq, beside in variants(units)]
    fastest = [(split, seq, beside) for seq, beside, spans in options
               if (split := search(spans, devices, strict)) is not None]
    if not fastest:
        return None
    top = min(fastest, key=lambda f: f[0].score.key())
    if top[0].score.over > 0:
        return top  # nothing fits: the split that overflows least
    limit = top[0].score.slowest * (1 + TIE_SLACK)
    lean = [(split, seq, beside) for seq, beside, spans in options
            if (split := search(spans, devices, True, limit)) is not None]
    return min(lean, key=lambda f: f[0].score.key(limit))


def _choice(facts: Facts, units: list[Unit], order: list[Device], split: Split, seq: list[Unit],
            beside: dict[int, list[Unit]]) -> Choice:
    size = {id(u): wa for u, wa in zip(units, alone(facts, units))}
    device_map, weights, activations, placed = {}, {}, {}, {}
    for device, (a, b), (w, act, _) in zip(order, split.runs, split.estimates):
        if a == b:
            continue
        here = seq[a:b] + [t for k in range(a, b) for t in beside.get(k, [])]
        device_map.update({u.path: device for u in here})
        weights[device], activations[device] = w, act
        placed[device] = [(u.path, size[id(u)][0], sum(size[id(u)])) for u in here]
    return Choice(collapse(device_map, facts.children), weights, activations, split.score.over == 0, placed)


def refuse(facts: Facts, units: list[Unit], no_split, budgets: dict[Device, int]) -> None:
    """A CompileError when the weights alone cannot fit: a module that cannot be split holding
    more than the largest budget, or more weights in all than all the budgets together."""
    device, largest = max(budgets.items(), key=lambda kv: kv[1])
    for u in units:
        if u.weight_bytes > largest:
            why = (f"its class {facts.classes.get(u.path)} is not split (no_split_module_classes)"
                   if facts.children.get(u.path) else "it has no submodules to split it into")
            raise CompileError(
                f"device_map='auto': module {u.path or '(the whole model)'!r} alone needs {u.weight_bytes:,} bytes "
                f"of weights, more than the largest budget ({device}: {largest:,} bytes), short by "
                f"{u.weight_bytes - largest:,} bytes ({why}); raise max_memory or add a device")
    held = {w: n for u in units for w, n in u.weights.items()}
    total, room = sum(held.values()), sum(budgets.values())
    if total > room:
        raise CompileError(
            f"device_map='auto': the model's weights alone are {total:,} bytes, more than max_memory allows on all "
            f"devices together ({room:,} bytes), short by {total - room:,} bytes; raise max_memory or add a device")


def diagnose(choice: Choice, device: Device) -> str:
    """The module placed on `device` that needs the most, in words, for a budget error."""
    placed = choice.placed.get(device)
    if not placed:
        return ""
    path, weights, total = max(placed, key=lambda p: p[2])
    return (f"; of the modules placed there, {path or '(the whole model)'!r} needs the most: {weights:,} bytes of "
            f"weights and {total - weights:,} of activations on its own (estimated)")


def collapse(device_map: dict[str, Device], children: dict[str, list[str]]) -> dict[str, Device]:
    """Name a module whole where all its parts went to one device: the shortest equal map."""
    def devices_under(path: str) -> set[Device]:
        if path in device_map:
            return {device_map[path]}
        return set().union(*(devices_under(k) for k in children.get(path, []))) if children.get(path) else set()

    def walk(path: str, out: dict[str, Device]) -> None:
        under = devices_under(path)
        if len(under) == 1 and path:
            out[path] = next(iter(under))
        elif path in device_map:
            out[path] = device_map[path]
        else:
            for k in children.get(path, []):
                walk(k, out)

    out: dict[str, Device] = {}
    walk("", out)
    return out
