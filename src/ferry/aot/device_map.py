"""A device map (module path prefix -> device) turned into convex partitions by construction.

The map is the one accelerate users already write::

    {"transformer.wte": 0, "transformer.h.0": "cuda:0", ..., "transformer.h.5": 1, "lm_head": "cuda:1"}

Keys are module paths of the exported module (`""` is the whole model); a key covers its
module and every submodule, and the longest matching key wins. Values are devices: an int
`i` is `cuda:i`, as in accelerate.

Every op gets a device in three steps, then a stage:

1. An op inside a listed module runs on that module's device. An excluded or unsupported op
   (`exclude=`, host-side size arithmetic, checks) runs on the CPU, outside any delegate.
2. An op outside every listed module (position ids, the causal mask, a residual add at the
   top level) follows its latest delegated producer; one with no delegated producer (it
   reads only inputs and constants) follows its earliest delegated consumer.
3. Each delegated op's *stage* is the largest number of device changes on a path from a
   delegated op to it. One partition per (stage, device).

Step 3 is why the partitions are convex: along an edge the stage never decreases, and it
grows at every change of device, so a path that leaves a partition and returns has
changed device at least twice and cannot end in the same stage.

Weights shared by modules on two devices (tied input and output embeddings) are absorbed
into each delegate that reads them, so each device holds its own copy, uploaded once at
load: a GEMM that read its weight from the peer GPU would stream it over the link at a
fraction of local memory bandwidth on every call, while the copy costs memory that is
known, and reported, before the first run.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Mapping

import torch

from ferry.aot.auto_map import Choice, auto_device_map, parse_budgets
from ferry.aot.partition import DEFAULT_BACKEND, OpSupport, Partition, target_device
from ferry.device import Device
from ferry.errors import ConfigError
from ferry.node_meta import module_path


def parse_device_map(device_map) -> dict[str, Device]:
    """{module path prefix: Device}, validated; every bad entry is a ConfigError."""
    if not isinstance(device_map, Mapping) or not device_map:
        raise ConfigError(
            "device_map must be a non-empty {module path: device} dict, e.g. "
            f"{{'encoder': 'cuda:0', 'decoder': 'cuda:1'}}; got {device_map!r}"
        )
    parsed = {}
    for key, value in device_map.items():
        if not isinstance(key, str):
            raise ConfigError(f"device_map keys are module paths (str), got {key!r}")
        parsed[key.strip()] = _parse_device(key, value)
    return parsed


def _parse_device(key: str, value) -> Device:
    if isinstance(value, bool):
        raise ConfigError(f"device_map[{key!r}] = {value!r} is not a device")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"device_map[{key!r}] = {value}: a GPU index must be >= 0")
        return Device("cuda", value)
    if isinstance(value, torch.device):
        value = str(value)
    if isinstance(value, str) and value.strip().lower() == "disk":
        raise ConfigError(
            f"device_map[{key!r}] = 'disk': ferry keeps every weight in memory it plans at load; "
            "map the module to 'cpu' instead"
        )
    try:
        return Device.parse(value)
    except ValueError as e:
        raise ConfigError(f"device_map[{key!r}]: {e}") from None


def covering_key(path: str, keys) -> str | None:
    """The longest key naming `path` or a module above it."""
    best = None
    for key in keys:
        if (key == "" or path == key or path.startswith(key + ".")) and (best is None or len(key) > len(best)):
            best = key
    return best


def module_paths(exported_program: torch.export.ExportedProgram) -> set[str]:
    """Every module path of the exported model, those that traced no op (an unused or
    identity module, dropout in eval) included: a map may name them."""
    paths = {entry.fqn for entry in exported_program.module_call_graph}
    paths.update(module_path(n) for n in exported_program.graph.nodes if n.op == "call_function")
    paths.update(name.rpartition(".")[0] for name in exported_program.state_dict)
    for path in list(paths):
        parts = path.split(".")
        paths.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return paths


def check_keys(device_map: Mapping[str, Device], paths: set[str]) -> None:
    """A key that names no module of the program is a typo or a path relative to another
    root (the model inside a wrapper): say which, with the nearest paths the program has."""
    for key in device_map:
        if key == "" or key in paths:
            continue
        wrapped = sorted(p for p in paths if p.endswith("." + key))
        if wrapped:
            hint = f"; the exported module wraps it: did you mean {wrapped[0]!r}?"
        else:
            near = difflib.get_close_matches(key, sorted(paths), n=3, cutoff=0.6)
            hint = f"; nearest: {', '.join(map(repr, near))}" if near else f"; top-level modules: {_top_level(paths)}"
        raise ConfigError(f"device_map key {key!r} names no module of the exported program{hint}")


def _top_level(paths) -> str:
    return ", ".join(repr(p) for p in sorted({p.split(".")[0] for p in paths if p})[:12]) or "(none)"


def assign_devices(nodes, device_map: Mapping[str, Device], supported) -> dict[torch.fx.Node, Device]:
    """The device of every delegated op (steps 1 and 2 of the module docstring)."""
    pos = {n: i for i, n in enumerate(nodes)}
    device: dict[torch.fx.Node, Device] = {}
    latest: dict[torch.fx.Node, torch.fx.Node] = {}  # node -> its latest delegated ancestor (itself if delegated)
    pending = []
    for n in nodes:
        if n.op != "call_function":
            continue
        if _is_part(n):  # a tuple's parts stay with the op that made it (below)
            if n.args[0] in latest:
                latest[n] = latest[n.args[0]]
            continue
        ancestors = [latest[p] for p in n.all_input_nodes if p in latest]
        producer = max(ancestors, key=pos.__getitem__, default=None)
        if not supported(n):
            if producer is not None:
                latest[n] = producer
            continue
        key = covering_key(module_path(n), device_map)
        where = device_map[key] if key is not None else device.get(producer)  # type: ignore[arg-type]
        if where is None:
            pending.append(n)
            continue
        device[n], latest[n] = where, n
    first = next((device[n] for n in nodes if n in device), next(iter(device_map.values())))
    for n in reversed(pending):
        consumers = [u for u in _consumers(n) if u in device]
        device[n] = device[min(consumers, key=pos.__getitem__)] if consumers else first
    for n in nodes:
        if _is_part(n) and n.args[0] in device:
            device[n] = device[n.args[0]]
    return device


def _is_part(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem and bool(node.args)


def _consumers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The users of a value, looking through the getitems that unpack a tuple."""
    out: list[torch.fx.Node] = []
    for u in node.users:
        out.extend(u.users if _is_part(u) else (u,))
    return out


def stages(nodes, device: Mapping[torch.fx.Node, Device]) -> dict[torch.fx.Node, int]:
    """Step 3: the number of device changes on the longest path into each node; -1 for
    nodes no delegated op reaches (inputs, constants, host arithmetic on them)."""
    stage: dict[torch.fx.Node, int] = {}
    for n in nodes:
        here = device.get(n)
        best = -1 if here is None else 0
        for p in n.all_input_nodes:
            if stage.get(p, -1) >= 0:
                best = max(best, stage[p] + (device.get(p) != here))
        stage[n] = best
    return stage


AUTO = "auto"


def parse_no_split(names, auto: bool) -> tuple[str, ...]:
    """no_split_module_classes: class names, as accelerate takes them; only "auto" reads them."""
    if names is None:
        return ()
    if not auto:
        raise ConfigError("no_split_module_classes goes with device_map='auto' (an explicit map already says "
                          "where every module goes)")
    if isinstance(names, str) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError("no_split_module_classes must be a list of module class names, e.g. "
                          f"['LlamaDecoderLayer']; got {names!r}")
    return tuple(n.strip() for n in names)


class DeviceMapPartitioner:
    """Partitions from a device map: one delegate per contiguous run of ops on one device.

    `device_map` is {module path: device}, or "auto" with `max_memory` ({device: size}): ferry
    then chooses the map (aot/auto_map.py), never splitting a module whose class is named in
    `no_split_module_classes` (as in accelerate) or in the model's own `_no_split_modules`.
    `last_map` is the map the last `partition` call followed, given or chosen; compile stores
    it in the program, where `ferry inspect` shows it, ready to pass back as an explicit map.
    `budgets` ({Device: bytes}, or None) is what compile checks the planned program against."""

    def __init__(self, device_map, exclude=(), backend_id: str = DEFAULT_BACKEND, max_memory=None,
                 no_split_module_classes=None):
        self.auto = isinstance(device_map, str) and device_map.strip().lower() == AUTO
        if isinstance(device_map, str) and not self.auto:
            raise ConfigError(f"device_map must be a {{module path: device}} dict or 'auto', got {device_map!r}")
        self.no_split = parse_no_split(no_split_module_classes, self.auto)
        self.device_map = {} if self.auto else parse_device_map(device_map)
        self.budgets = parse_budgets(max_memory) if self.auto or max_memory is not None else None
        # what the chooser works to: the budgets, lowered where a real plan overflowed one
        self._working = dict(self.budgets or {})
        self._choice: Choice | None = None
        # an op goes to an accelerator of the map only where every one of them has its kernel
        accelerators = {d for d in [*self.device_map.values(), *(self.budgets or {})] if not d.is_cpu}
        self.support = OpSupport(None, exclude, devices=sorted(accelerators))
        self.backend_id = backend_id
        self.last_map: dict[str, Device] = dict(self.device_map)

    def map_for(self, exported_program: torch.export.ExportedProgram) -> dict[str, Device]:
        """The map this program is split by: the one given, checked against its modules, or
        the one chosen under the budgets."""
        if self.auto:
            assert self.budgets is not None
            self._choice = auto_device_map(exported_program, self._working, self._supported, self.no_split,
                                           original=self.budgets)
            return self._choice.device_map
        check_keys(self.device_map, module_paths(exported_program))
        return self.device_map

    def _supported(self, node: torch.fx.Node) -> bool:
        return self.support.is_node_supported({}, node)

    def devices(self, exported_program: torch.export.ExportedProgram) -> dict[str, Device]:
        """{node name: device} for every op that runs in a delegate."""
        nodes = list(exported_program.graph_module.graph.nodes)
        self.last_map = self.map_for(exported_program)
        device = assign_devices(nodes, self.last_map, self._supported)
        return {n.name: d for n, d in device.items()}

    def partition(self, exported_program: torch.export.ExportedProgram) -> list[Partition]:
        graph = exported_program.graph_module.graph
        self.support.warn_unmatched(graph)
        nodes = list(graph.nodes)
        by_name = self.devices(exported_program)
        device = {n: by_name[n.name] for n in nodes if n.name in by_name}
        stage = stages(nodes, device)
        groups: dict[tuple[int, Device], list[str]] = {}
        for n in nodes:
            if n in device:
                groups.setdefault((stage[n], device[n]), []).append(n.name)
        return [Partition(names, target_device(d), self.backend_id) for (_, d), names in groups.items()]

    @property
    def last_choice(self) -> Choice | None:
        """What "auto" chose last: the map, its estimates and whether they fit; None otherwise."""
        return self._choice

    def tighten(self, need: Mapping[Device, int]) -> None:
        """After the real plan of the last choice needed `need` bytes per device: lower the
        working budget of each device it overflowed by what the estimate missed there, and
        below that estimate, so that the next choice puts less on it."""
        assert self.budgets is not None and self._choice is not None
        estimate = {d: self._choice.weights[d] + self._choice.activations[d] for d in self._choice.weights}
        for device, n in need.items():
            budget = self.budgets.get(device)
            if budget is None or n <= budget or device not in estimate:
                continue
            lowered = min(budget - (n - estimate[device]), estimate[device] - 1, self._working[device])
            self._working[device] = max(0, lowered)

    def __repr__(self) -> str:
        shown = AUTO if self.auto else {k: str(v) for k, v in self.device_map.items()}
        return f"DeviceMapPartitioner({shown!r})"
