"""ferry.compile: torch.export program(s) -> placed graph -> planned, emitted Program."""

from __future__ import annotations

from typing import Mapping

import torch

from ferry.aot.config import CompileConfig, PropagateDeviceConfig
from ferry.aot.emit import EmitOptions, ProgramBuilder, emit_method
from ferry.aot.lower import LoweredProgram, to_backend
from ferry.aot.place import PropagateDevicePass
from ferry.errors import CompileError
from ferry.program.schema import Program


def _methods(ep_or_dict) -> dict[str, torch.export.ExportedProgram]:
    if isinstance(ep_or_dict, torch.export.ExportedProgram):
        return {"forward": ep_or_dict}
    if isinstance(ep_or_dict, Mapping) and ep_or_dict:
        for name, ep in ep_or_dict.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise CompileError(f"method names must be identifiers, got {name!r}")
            if not isinstance(ep, torch.export.ExportedProgram):
                raise CompileError(f"method {name!r}: expected a torch.export.ExportedProgram, got {type(ep).__name__}")
        return dict(ep_or_dict)
    raise CompileError(
        "ferry.compile takes a torch.export.ExportedProgram or a non-empty {method name: ExportedProgram} dict, "
        f"got {type(ep_or_dict).__name__}"
    )


def _check_method_names(config: CompileConfig, names: set[str]) -> None:
    """A per-method setting for a method that is not compiled is a typo, not a default."""
    pd = config.propagate_device
    if not isinstance(pd, (Mapping, PropagateDeviceConfig)):
        raise CompileError(f"propagate_device must be a PropagateDeviceConfig or a dict of them, got {pd!r}")
    dicts = [("propagate_device", pd)] if isinstance(pd, Mapping) else [
        ("skip_h2d_for_method_inputs", pd.skip_h2d_for_method_inputs),
        ("skip_d2h_for_method_outputs", pd.skip_d2h_for_method_outputs),
    ]
    for what, d in dicts:
        if isinstance(d, Mapping):
            unknown = sorted(set(d) - names)
            if unknown:
                raise CompileError(f"{what} names method(s) {unknown} that are not compiled; methods: {sorted(names)}")
    for name in names:  # every flag of every compiled method is a bool (or a CompileError now)
        config.propagate_for(name).for_method(name)


def place(exported_program, partitioner=None, config: CompileConfig | None = None, method: str = "forward") -> LoweredProgram:
    """Lower and place one method: every value gets a Device, every transfer an et_copy op."""
    config = config or CompileConfig()
    skip_h2d, skip_d2h = config.propagate_for(method).for_method(method)
    lowered = to_backend(exported_program, partitioner)
    PropagateDevicePass(skip_h2d, skip_d2h, config.enable_non_cpu_memory_planning)(lowered.graph_module)
    return lowered


def compile(ep_or_dict, partitioner=None, config: CompileConfig | None = None) -> Program:  # noqa: A001
    """Compile one program (method 'forward') or several named methods into a ferry Program."""
    config = config or CompileConfig()
    builder = ProgramBuilder()
    opts = EmitOptions(
        enable_non_cpu_memory_planning=config.enable_non_cpu_memory_planning,
        alloc_graph_input=config.alloc_graph_input, alloc_graph_output=config.alloc_graph_output,
        algorithm=config.memory_planning, alignment=config.alignment,
    )
    eps = _methods(ep_or_dict)
    _check_method_names(config, set(eps))
    methods = {}
    for name, ep in eps.items():
        placed = place(ep, partitioner, config, name)
        methods[name] = emit_method(name, placed.graph_module, placed.constants, builder, opts, placed.range_constraints)
    return Program(methods, builder.delegates, builder.segments)
