"""device_map="auto": contiguous stages of modules that fit each device's budget, balanced in time.

The choice is a device map of module paths, so it can be printed and reused as an explicit
map. It works from estimates, made before lowering:

* time: each op costs max(FLOPs / 50 TFLOP/s, bytes moved / 3 TB/s) plus 5 us to launch
  (views move nothing). Only the ratio between stages matters, so the constants only weigh
  compute against memory traffic and launches; the devices are taken to be alike.
* memory: a stage holds the weights its ops read (a weight read on two devices is counted,
  and held, on both), the tensors crossing into and out of it (a delegate's inputs and
  outputs are held for the whole call) and, beside them, the largest working set inside.

Units are modules, taken whole when they are small and split into their submodules when one
costs more than a quarter of a device's share of the time or does not fit the smallest
budget; the chosen map names a module whole again when all its parts went to one device.
Ops outside every unit follow their neighbours, as in an explicit map; for the estimate each
is counted with the unit before it. Accelerators come first, in the order
given; a "cpu" budget only takes what the accelerators cannot hold, as in accelerate.

Compile then checks the real plan against the budgets (ferry.compile): where it overflows a
device, the chooser runs again with that device's budget lowered by what the estimate
missed, a few times at most; the result fits, or is a CompileError, never a program that
does not fit.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ferry import node_meta as M
from ferry.device import Device
from ferry.errors import CompileError, ConfigError
from ferry.node_meta import module_path
from ferry.program.footprint import parse_bytes

PEAK_FLOPS = 50e12
MEMORY_BYTES_PER_S = 3e12
LAUNCH_S = 5e-6
SPLIT_SHARE = 4  # a unit above 1/4 of a device's share of the time is split into its submodules


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


# ------------------------------------------------------------------ the cost of one op


def _val_bytes(val) -> int:
    vals = val if isinstance(val, (tuple, list)) else (val,)
    total = 0
    for v in vals:
        if isinstance(v, torch.Tensor):
            try:
                total += int(v.numel()) * v.element_size()
            except Exception:  # noqa: BLE001 - a symbolic size: count what the hint says
                total += int(v.untyped_storage().nbytes()) if hasattr(v, "untyped_storage") else 0
    return total


def _shape(node) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return M.hint_ints(val.shape) if isinstance(val, torch.Tensor) else ()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def op_flops(node: torch.fx.Node) -> int:
    """Multiply-adds x 2 of the GEMMs, convolutions and attention; 0 for the rest."""
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    args = node.args
    out = _shape(node)
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear") and args:
        a = _shape(args[1] if name in ("addmm", "baddbmm") else args[0])
        return 2 * _numel(out) * (a[-1] if a else 0)
    if name in ("convolution", "conv2d", "conv1d", "conv3d") and len(args) > 1:
        w = _shape(args[1])
        return 2 * _numel(out) * _numel(w[1:]) if w else 0
    if name.startswith("scaled_dot_product") or name.startswith("_scaled_dot_product"):
        q, k = _shape(args[0]), _shape(args[1])
        if len(q) >= 2 and len(k) >= 2:
            return 4 * _numel(q) * k[-2]
    return 0


def op_seconds(node: torch.fx.Node) -> float:
    if _is_view(node):
        return 0.0  # a view: no data moves, no kernel runs
    moved = _val_bytes(node.meta.get("val")) + sum(_val_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    return max(op_flops(node) / PEAK_FLOPS, moved / MEMORY_BYTES_PER_S) + LAUNCH_S


# ------------------------------------------------------------------ units


@dataclass
class Unit:
    """A module taken whole: the span of positions its ops cover, their time, the weights
    they read, and its activation bytes as a delegate would hold them: the inputs it reads,
    the outputs read after it, and the largest set of its other values live at one time."""

    path: str
    first: int
    last: int
    seconds: float = 0.0
    weights: dict[str, int] = field(default_factory=dict)
    inputs: int = 0
    outputs: int = 0
    internal: int = 0


@dataclass
class Facts:
    """What the chooser reads of a program, gathered once. Positions index `order`: every
    op, in graph order; a value read by the graph's output is read at len(order)."""

    order: list[torch.fx.Node]
    seconds: dict[torch.fx.Node, float]  # 0 for an op that no delegate runs
    weights: dict[torch.fx.Node, dict[str, int]]
    made: dict[int, list[tuple[int, int]]]  # position -> (last position read, bytes) of its values
    live: list[int]  # bytes live at each position
    crossing: list[int]  # bytes made before each position and read at or after it (len(order) + 1)
    children: dict[str, list[str]]
    ops_under: dict[str, list[torch.fx.Node]]  # delegated ops only


def gather(exported_program, supported) -> Facts:
    nodes = list(exported_program.graph_module.graph.nodes)
    sig = exported_program.graph_signature
    weight_names = set(sig.inputs_to_parameters) | set(sig.inputs_to_buffers) | set(
        getattr(sig, "inputs_to_lifted_tensor_constants", {}))
    order = [n for n in nodes if n.op == "call_function"]
    delegated = [n for n in order if supported(n)]
    pos = {n: i for i, n in enumerate(order)}
    seconds = dict.fromkeys(order, 0.0) | {n: op_seconds(n) for n in delegated}
    weights = {n: {a.name: _val_bytes(a.meta.get("val")) for a in n.all_input_nodes if a.name in weight_names}
               for n in delegated}
    made: dict[int, list[tuple[int, int]]] = {}
    delta, delta_crossing = [0] * (len(order) + 2), [0] * (len(order) + 2)
    for n in order:
        if n.target is operator.getitem or _is_view(n):
            continue  # a view or a tuple's part: its bytes are its source's
        last = max((pos.get(u, len(order)) for u in _readers(n)), default=pos[n])
        size = _val_bytes(n.meta.get("val"))
        made.setdefault(pos[n], []).append((last, size))
        delta[pos[n]] += size
        delta[min(last, len(order) - 1) + 1] -= size
        delta_crossing[pos[n] + 1] += size
        delta_crossing[last + 1] -= size
    live, crossing = _running(delta[:len(order)]), _running(delta_crossing[:len(order) + 1])
    children: dict[str, list[str]] = {}
    ops_under: dict[str, list[torch.fx.Node]] = {"": []}
    for n in delegated:
        parts = module_path(n).split(".") if module_path(n) else []
        ops_under[""].append(n)
        for i in range(1, len(parts) + 1):
            path, parent = ".".join(parts[:i]), ".".join(parts[:i - 1])
            if path not in ops_under:
                ops_under[path] = []
                children.setdefault(parent, []).append(path)
            ops_under[path].append(n)
    return Facts(order, seconds, weights, made, live, crossing, children, ops_under)


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and any(r.alias_info is not None for r in target._schema.returns)


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read a value, looking through views and a tuple's parts."""
    out = []
    for u in node.users:
        out.extend(_readers(u) if u.op == "call_function" and (u.target is operator.getitem or _is_view(u)) else [u])
    return out or list(node.users)


def _running(deltas: list[int]) -> list[int]:
    out, total = [], 0
    for d in deltas:
        total += d
        out.append(total)
    return out


def _unit(facts: Facts, path: str, ops, pos) -> Unit:
    u = Unit(path, min(pos[n] for n in ops), max(pos[n] for n in ops))
    for n in ops:
        _count(u, facts, n, pos[n])
    return _measure(u, facts)


def _count(u: Unit, facts: Facts, n: torch.fx.Node, at: int) -> None:
    u.seconds += facts.seconds[n]
    u.weights.update(facts.weights[n])
    u.first, u.last = min(u.first, at), max(u.last, at)


def _measure(u: Unit, facts: Facts) -> Unit:
    """Inputs, outputs and internal bytes of the span first..last."""
    u.inputs, u.outputs, u.internal = facts.crossing[u.first], 0, 0
    for p in range(u.first, u.last + 1):
        u.outputs += sum(size for last, size in facts.made.get(p, ()) if last > u.last)
        u.internal = max(u.internal, facts.live[p] - u.inputs - u.outputs)
    return u


def units(facts: Facts, split_seconds: float, split_bytes: int) -> list[Unit]:
    """Modules, split into submodules while too slow or too large; the ops an expanded
    module runs itself (residual adds, position ids) go to the unit before them."""
    pos = {n: i for i, n in enumerate(facts.order)}
    result: list[Unit] = []
    glue: list[torch.fx.Node] = []
    todo = [""]
    while todo:
        path = todo.pop()
        whole = _unit(facts, path, facts.ops_under[path], pos)
        kids = facts.children.get(path, [])
        if kids and (whole.seconds > split_seconds or activation_bytes([whole]) + sum(whole.weights.values()) > split_bytes):
            covered = {n for k in kids for n in facts.ops_under[k]}
            glue.extend(n for n in facts.ops_under[path] if n not in covered)
            todo.extend(kids)
        else:
            result.append(whole)
    result.sort(key=lambda u: u.first)
    if not result:
        return result
    for n in glue:  # count each outside op with the unit before it (or the first unit)
        i = max((j for j, u in enumerate(result) if u.first <= pos[n]), default=0)
        _count(result[i], facts, n, pos[n])
    return [_measure(u, facts) for u in result]


# ------------------------------------------------------------------ stages


def activation_bytes(run: list[Unit]) -> int:
    """A run of units as one delegate: its inputs and outputs are held for the whole call;
    inside, a unit's own working set, and the values between it and its neighbours."""
    if not run:
        return 0
    inner = max(u.internal + (u.inputs if k else 0) + (u.outputs if k < len(run) - 1 else 0) for k, u in enumerate(run))
    return run[0].inputs + run[-1].outputs + inner


class Stage:
    def __init__(self, device: Device, budget: int):
        self.device, self.budget = device, budget
        self.units: list[Unit] = []
        self.seconds = 0.0
        self.weights: dict[str, int] = {}

    def bytes_with(self, u: Unit) -> int:
        extra = sum(b for name, b in u.weights.items() if name not in self.weights)
        return self.weight_bytes + extra + activation_bytes(self.units + [u])

    def take(self, u: Unit) -> None:
        self.units.append(u)
        self.seconds += u.seconds
        self.weights.update(u.weights)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def activation_bytes(self) -> int:
        return activation_bytes(self.units)

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes


def fill(units_: list[Unit], budgets: dict[Device, int], limit_s: float) -> tuple[list[Stage], int]:
    """Greedy: each device in turn takes units while its time stays within `limit_s` (the
    CPU: no time limit) and its bytes within its budget. Returns the stages and how many
    units were placed; for a contiguous split, taking as much as fits is optimal."""
    stages, i = [], 0
    for device, budget in budgets.items():
        stage = Stage(device, budget)
        while i < len(units_):
            u = units_[i]
            if stage.bytes_with(u) > budget or (not device.is_cpu and stage.units and stage.seconds + u.seconds > limit_s):
                break
            stage.take(u)
            i += 1
        stages.append(stage)
    return stages, i


def choose(units_: list[Unit], budgets: dict[Device, int]) -> list[Stage]:
    """The contiguous split with the smallest slowest accelerator stage that fits, found by
    bisection on that time. The CPU takes only what the accelerators cannot hold."""
    accelerators = {d: b for d, b in budgets.items() if not d.is_cpu}
    hosts = {d: b for d, b in budgets.items() if d.is_cpu}
    total = sum(u.seconds for u in units_)
    for pool in (accelerators, {**accelerators, **hosts}):
        if not pool:
            continue
        stages, placed = fill(units_, pool, float("inf"))
        if placed < len(units_):
            continue
        if pool is not accelerators:
            return stages  # overflow to the CPU: the accelerators hold as much as they can
        lo, hi = max((u.seconds for u in units_), default=0.0), total
        for _ in range(48):
            mid = (lo + hi) / 2
            if fill(units_, pool, mid)[1] == len(units_):
                hi = mid
            else:
                lo = mid
        return fill(units_, pool, hi)[0]
    raise shortfall(units_, budgets)


def shortfall(units_: list[Unit], budgets: dict[Device, int]) -> CompileError:
    """The error when no split fits: the device that runs out and by how many bytes."""
    biggest = max(budgets.items(), key=lambda kv: kv[1])
    for u in units_:
        alone = Stage(*biggest)
        alone.take(u)
        if alone.bytes > biggest[1]:
            return CompileError(
                f"device_map='auto': module {u.path or '(the whole model)'!r} alone needs {alone.bytes:,} bytes, more "
                f"than the largest budget ({biggest[0]}: {biggest[1]:,} bytes), short by {alone.bytes - biggest[1]:,} "
                "bytes; raise max_memory or add a device"
            )
    stages, placed = fill(units_, budgets, float("inf"))
    last = stages[-1]
    rest = Stage(last.device, last.budget)
    for u in last.units + units_[placed:]:
        rest.take(u)
    held = ", ".join(f"{s.device} {s.bytes:,} of {s.budget:,}" for s in stages[:-1])
    first = (last.units or units_[placed:])[0].path
    return CompileError(
        f"device_map='auto': the model does not fit in max_memory: after the devices before it take what they can "
        f"({held}), {last.device}, the last device, would need {rest.bytes:,} bytes for {first!r} and everything after "
        f"it, over its budget of {last.budget:,}: short by {rest.bytes - last.budget:,} bytes; "
        "raise max_memory or add a device"
    )


@dataclass(frozen=True)
class Choice:
    """A chosen map and, per device, the weight and activation bytes it was estimated at."""

    device_map: dict[str, Device]
    weights: dict[Device, int]
    activations: dict[Device, int]


def auto_device_map(exported_program, budgets: dict[Device, int], supported) -> Choice:
    """The device map for `exported_program` under `budgets` ({device: bytes})."""
    facts = gather(exported_program, supported)
    if not facts.ops_under[""]:
        return Choice({"": next(iter(budgets))}, {}, {})
    accelerators = sum(1 for d in budgets if not d.is_cpu) or 1
    total = sum(facts.seconds.values())
    chosen = [s for s in choose(units(facts, total / (accelerators * SPLIT_SHARE), min(budgets.values())), budgets)
              if s.units]
    device_map = collapse({u.path: s.device for s in chosen for u in s.units}, facts.children)
    return Choice(device_map, {s.device: s.weight_bytes for s in chosen}, {s.device: s.activation_bytes for s in chosen})


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
