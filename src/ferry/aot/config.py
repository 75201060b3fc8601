"""Compile configuration. Per-method settings are plain dicts keyed by method name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Union

from ferry.errors import CompileError

Flag = Union[bool, Mapping[str, bool]]


def _flag_for(value: Flag, method: str, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, Mapping):
        got = value.get(method, False)
        if not isinstance(got, bool):
            raise CompileError(f"{name}[{method!r}] must be a bool, got {got!r}")
        return got
    raise CompileError(f"{name} must be a bool or a {{method name: bool}} dict, got {value!r}")


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
    """

    enable_non_cpu_memory_planning: bool = True
    propagate_device: Union[PropagateDeviceConfig, Mapping[str, PropagateDeviceConfig]] = field(
        default_factory=PropagateDeviceConfig
    )
    alloc_graph_input: bool = True
    alloc_graph_output: bool = True
    memory_planning: str = "greedy"
    alignment: Union[int, Mapping[str, int], None] = None

    def __post_init__(self):
        if self.memory_planning not in ("greedy", "naive"):
            raise CompileError(f"memory_planning must be 'greedy' or 'naive', got {self.memory_planning!r}")
        aligns = self.alignment.values() if isinstance(self.alignment, Mapping) else [self.alignment]
        for a in aligns:
            if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a < 1 or a & (a - 1)):
                raise CompileError(f"alignment must be a power of two (bytes), got {a!r}")
        if not isinstance(self.enable_non_cpu_memory_planning, bool):
            raise CompileError("enable_non_cpu_memory_planning must be a bool")

    def propagate_for(self, method: str) -> PropagateDeviceConfig:
        pd = self.propagate_device
        if isinstance(pd, PropagateDeviceConfig):
            return pd
        if isinstance(pd, Mapping):
            got = pd.get(method, PropagateDeviceConfig())
            if not isinstance(got, PropagateDeviceConfig):
                raise CompileError(f"propagate_device[{method!r}] must be a PropagateDeviceConfig, got {got!r}")
            return got
        raise CompileError(f"propagate_device must be a PropagateDeviceConfig or a dict of them, got {pd!r}")
