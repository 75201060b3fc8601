"""Compile configuration. Per-method settings are plain dicts keyed by method name.

`CompileConfig.resolve(names)` turns a configuration into one frozen, validated
`MethodOptions` per method, once; placement, emit and planning read only that. Every bad
setting is a `ConfigError`, found before any work.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Union

from ferry.alignment import AlignmentSpec, alignment_for, resolve_alignment
from ferry.errors import ConfigError

Flag = Union[bool, Mapping[str, bool]]


def _flag_for(value: Flag, method: str, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, Mapping):
        got = value.get(method, False)
        if not isinstance(got, bool):
            raise ConfigError(f"{name}[{method!r}] must be a bool, got {got!r}")
        return got
    raise ConfigError(f"{name} must be a bool or a {{method name: bool}} dict, got {value!r}")


@dataclass(frozen=True)
class PropagateDeviceConfig:
    """Skip flags. Each takes a bool or a {method name: bool} dict (a missing method: False).

    skip_h2d_for_method_inputs:  inputs read by a device delegate are passed in already on
        that device; the caller owns them (never planned, no copy).
    skip_d2h_for_method_outputs: delegate outputs that are method outputs stay on the device
        and are returned as device tensors, owned by the caller.
    """

    skip_h2d_for_method_inputs: Flag = False
    skip_d2h_for_method_outputs: Flag = False

    def for_method(self, method: str) -> tuple[bool, bool]:
        return (
            _flag_for(self.skip_h2d_for_method_inputs, method, "skip_h2d_for_method_inputs"),
            _flag_for(self.skip_d2h_for_method_outputs, method, "skip_d2h_for_method_outputs"),
        )


@dataclass(frozen=True)
class CompileConfig:
    """enable_non_cpu_memory_planning=False is the legacy mode: no copy ops, one CPU pool.

    alloc_graph_input / alloc_graph_output: plan memory for method inputs/outputs (the
    runtime copies caller tensors in and results out). Inputs/outputs the skip flags put on
    a device are never planned, whatever these say.
    memory_planning: "greedy" (lifetimes that do not overlap share memory) or "naive".
    alignment: bytes, an int or a {device type: int} dict; None = ferry's defaults.
    fuse_for_inference: give delegates eager's inference shortcuts (nn.MultiheadAttention as one
    fused op, batch norms folded into the convolutions before them; aot/fuse.py). False keeps
    the traced ops exactly (bit-for-bit with eager's unfused ops).
    last_position_only: names of methods whose results keep only their last position along
    dimension 1 (a prefill's logits, of which generation reads the last row; aot/last_position.py).
    """

    enable_non_cpu_memory_planning: bool = True
    propagate_device: Union[PropagateDeviceConfig, Mapping[str, PropagateDeviceConfig]] = field(
        default_factory=PropagateDeviceConfig
    )
    alloc_graph_input: bool = True
    alloc_graph_output: bool = True
    memory_planning: str = "greedy"
    alignment: AlignmentSpec = None
    fuse_for_inference: bool = True
    last_position_only: Union[str, Collection[str]] = ()

    def __post_init__(self):
        if self.memory_planning not in ("greedy", "naive"):
            raise ConfigError(f"memory_planning must be 'greedy' or 'naive', got {self.memory_planning!r}")
        try:
            resolve_alignment(self.alignment)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name in ("enable_non_cpu_memory_planning", "alloc_graph_input", "alloc_graph_output", "fuse_for_inference"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        names = self.last_position_only
        if isinstance(names, str):
            names = [names]
        if isinstance(names, Mapping) or not isinstance(names, Collection) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"last_position_only must name methods (a str or a list of them), got {names!r}")
        object.__setattr__(self, "last_position_only", frozenset(names))  # (read as a set from here on)

    def propagate_for(self, method: str) -> PropagateDeviceConfig:
        pd = self.propagate_device
        if isinstance(pd, PropagateDeviceConfig):
            return pd
        if isinstance(pd, Mapping):
            got = pd.get(method, PropagateDeviceConfig())
            if not isinstance(got, PropagateDeviceConfig):
                raise ConfigError(f"propagate_device[{method!r}] must be a PropagateDeviceConfig, got {got!r}")
            return got
        raise ConfigError(f"propagate_device must be a PropagateDeviceConfig or a dict of them, got {pd!r}")

    def resolve(self, methods) -> dict[str, MethodOptions]:
        """One validated option set per method name; a per-method setting naming a method
        that is not compiled is a typo, not a default."""
        names = set(methods)
        pd = self.propagate_device
        dicts = [("propagate_device", pd)] if isinstance(pd, Mapping) else [
            ("skip_h2d_for_method_inputs", getattr(pd, "skip_h2d_for_method_inputs", None)),
            ("skip_d2h_for_method_outputs", getattr(pd, "skip_d2h_for_method_outputs", None)),
        ]
        for what, d in [*dicts, ("last_position_only", self.last_position_only)]:
            if isinstance(d, (Mapping, frozenset)):
                unknown = sorted(set(d) - names)
                if unknown:
                    raise ConfigError(f"{what} names method(s) {unknown} that are not compiled; methods: {sorted(names)}")
        return {name: self.options_for(name) for name in methods}

    def options_for(self, name: str) -> MethodOptions:
        """The validated options of one method (per-method dicts may name others)."""
        skip_h2d, skip_d2h = self.propagate_for(name).for_method(name)
        if not self.enable_non_cpu_memory_planning and (skip_h2d or skip_d2h):
            raise ConfigError(
                "skip_h2d_for_method_inputs / skip_d2h_for_method_outputs need enable_non_cpu_memory_planning=True: "
                "without device placement there is no device tensor to pass in or out; enable it or drop the skip flag"
            )
        return MethodOptions(
            name=name, device_placement=self.enable_non_cpu_memory_planning, skip_h2d=skip_h2d, skip_d2h=skip_d2h,
            alloc_graph_input=self.alloc_graph_input, alloc_graph_output=self.alloc_graph_output,
            memory_planning=self.memory_planning, alignment=resolve_alignment(self.alignment),
            fuse_for_inference=self.fuse_for_inference, last_position_only=name in self.last_position_only,
        )


@dataclass(frozen=True)
class MethodOptions:
    """The resolved settings of one method: what placement, emit and planning read.

    device_placement=False is the legacy mode (placement puts every value on the CPU; the
    delegates move their own data). alignment is {device type or 'default': bytes}.
    """

    name: str = "forward"
    device_placement: bool = True
    skip_h2d: bool = False
    skip_d2h: bool = False
    alloc_graph_input: bool = True
    alloc_graph_output: bool = True
    memory_planning: str = "greedy"
    alignment: Mapping[str, int] = field(default_factory=lambda: resolve_alignment(None))
    fuse_for_inference: bool = True
    functional_kernels: bool = False  # every op its functional overload, nothing planned (a graph compiler's input)
    last_position_only: bool = False  # results cut to their last position along dimension 1

    def alignment_of(self, device_type: str) -> int:
        return alignment_for(self.alignment, device_type)
