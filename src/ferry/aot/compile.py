"""ferry.compile: torch.export program(s) -> placed graph -> planned, emitted Program."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ferry.aot.config import CompileConfig, MethodOptions
from ferry.aot.emit import ProgramBuilder, emit_method
from ferry.aot.lower import LoweredProgram, to_backend
from ferry.aot.place import PropagateDevicePass
from ferry.errors import CompileError
from ferry.program import Program


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


def place(exported_program, partitioner=None, config: CompileConfig | None = None, method: str = "forward") -> LoweredProgram:
    """Lower and place one method: every value gets a Device, every transfer an et_copy op."""
    options = (config or CompileConfig()).options_for(method)
    return _place(exported_program, partitioner, options)


def _place(exported_program, partitioner, options: MethodOptions) -> LoweredProgram:
    lowered = to_backend(exported_program, partitioner)
    PropagateDevicePass.for_options(options)(lowered.graph_module)
    return lowered


def compile(ep_or_dict, partitioner=None, config: CompileConfig | None = None) -> Program:  # noqa: A001
    """Compile one program (method 'forward') or several named methods into a ferry Program."""
    eps = _methods(ep_or_dict)
    options = (config or CompileConfig()).resolve(eps)
    builder = ProgramBuilder()
    methods = {}
    for name, ep in eps.items():
        placed = _place(ep, partitioner, options[name])
        methods[name] = emit_method(name, placed.graph_module, placed.constants, builder, options[name],
                                    placed.range_constraints)
    return Program(methods, builder.delegates, builder.segments)
