"""The few facts ferry keeps on torch.fx nodes, behind accessors (never raw meta keys)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ferry.device import Device

_DEVICE = "ferry_device"
_INPUT = "ferry_input"
_OUTPUTS = "ferry_outputs"

USER_INPUT, PARAMETER, BUFFER, CONSTANT = "user_input", "parameter", "buffer", "constant"
FIXED = "fixed"  # an argument torch.export fixed (a float, a flag): no input of the method, checked per call
USER_OUTPUT, BUFFER_MUTATION, USER_INPUT_MUTATION = "user_output", "buffer_mutation", "user_input_mutation"


def module_path(node: torch.fx.Node) -> str:
    """The dotted path of the innermost module the op was traced in ('' at the top level),
    as torch.export records it."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return str(list(stack.values())[-1][0])


def static_ints(values) -> tuple[int, ...] | None:
    """`values` (a shape, strides) as plain ints, or None when one is symbolic. Never int() an
    export SymInt: it returns the example size and adds a guard that fixes it, in the caller's
    ExportedProgram too (its ShapeEnv is shared), so a dynamic program turns static."""
    out = tuple(values)
    return out if all(type(v) is int for v in out) else None


def surely(b) -> bool:
    """A SymBool taken as true only when it is true at every size (no guard added); a bool as it is."""
    if isinstance(b, torch.SymBool):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(b))
    return bool(b)


def same_sizes(a, b) -> bool:
    """Two shapes (or strides) equal at every size, static or symbolic (no guard added)."""
    return len(a) == len(b) and all(surely(p == q) for p, q in zip(a, b))


def hint_ints(shape) -> tuple[int, ...]:
    """A shape at the sizes export traced (the hint of each symbolic size), adding no guard."""
    return tuple(s if type(s) is int else int(s.node.hint) if s.node.hint is not None else 1 for s in shape)


def get_device(node: torch.fx.Node) -> Device | None:
    return node.meta.get(_DEVICE)


def set_device(node: torch.fx.Node, device: Device) -> None:
    node.meta[_DEVICE] = device


@dataclass(frozen=True)
class InputInfo:
    kind: str  # user_input | parameter | buffer | constant | fixed
    target: str = ""  # fully qualified name of the parameter/buffer/constant
    mutable: bool = False  # a buffer the program updates (this method, or another compiled with it)


@dataclass(frozen=True)
class OutputInfo:
    kind: str  # user_output | buffer_mutation | user_input_mutation
    target: str = ""  # the buffer's qualified name, or the written input's placeholder name


def input_info(node: torch.fx.Node) -> InputInfo:
    """Placeholders without recorded info (hand-built graphs) are user inputs."""
    return node.meta.get(_INPUT) or InputInfo(USER_INPUT)


def set_input_info(node: torch.fx.Node, info: InputInfo) -> None:
    node.meta[_INPUT] = info


def output_infos(output_node: torch.fx.Node) -> list[OutputInfo]:
    n = len(flat_outputs(output_node))
    infos = output_node.meta.get(_OUTPUTS)
    return list(infos) if infos is not None and len(infos) == n else [OutputInfo(USER_OUTPUT)] * n


def set_output_infos(output_node: torch.fx.Node, infos) -> None:
    output_node.meta[_OUTPUTS] = tuple(infos)


def flat_outputs(output_node: torch.fx.Node) -> list:
    (out,) = output_node.args
    return list(out) if isinstance(out, (tuple, list)) else [out]
