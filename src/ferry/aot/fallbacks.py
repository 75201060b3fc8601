"""Ops left on the CPU for want of a device kernel, and placements nothing can run.

A partitioner delegates an op only to a device that has its kernel (ops/device_kernels.py), so
a library op with a CPU kernel alone (transformers' `grouped_mm_fallback` before it had a CUDA
one) stays on the CPU, with copies around it every call. That is a fact users must see: compile
warns once per op and records it in the method's `kernel_choices`, which `ferry inspect` prints.
An op placed where it has no kernel at all (`_weight_int4pack_mm` on the CPU) is a CompileError
naming the op and the placement, not a failure at the first call.
"""

from __future__ import annotations

import warnings

import torch

from ferry.aot.lower import is_delegate_node
from ferry.device import CPU, Device
from ferry.errors import CompileError
from ferry.node_meta import get_device
from ferry.op_names import kernel_name
from ferry.ops.copies import is_copy_node
from ferry.ops.device_kernels import has_kernel

__all__ = ["kernel_fallbacks"]


def kernel_fallbacks(gm: torch.fx.GraphModule, method: str = "forward") -> dict[str, str]:
    """{'on the CPU: <op>': why} for each op the method runs on the CPU because a device it uses
    has no kernel for it (warned once per op); CompileError for an op on the CPU with no CPU kernel."""
    nodes = list(gm.graph.nodes)
    devices = sorted({d for n in nodes if (d := get_device(n)) is not None and not d.is_cpu})
    found: dict[str, list] = {}  # key -> [devices without a kernel, calls, the copies around them]
    for node in nodes:
        op = node.target
        if (node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or is_copy_node(node)
                or is_delegate_node(node) or not op._schema.returns or (get_device(node) or CPU) != CPU):
            continue
        if not has_kernel(op, CPU):
            raise CompileError(_no_cpu_kernel(method, node, op))
        missing = [str(d) for d in devices if not has_kernel(op, d)]
        if missing:
            entry = found.setdefault(f"on the CPU: {kernel_name(op)}", [missing, 0, set()])
            entry[1] += 1
            entry[2].update(n for n in (*node.all_input_nodes, *node.users) if is_copy_node(n))
    notes = {key: f"no kernel for {', '.join(missing)}: runs on the CPU, {calls} call(s) with {len(copies)} copies "
                  "around them" for key, (missing, calls, copies) in found.items()}
    for key, why in notes.items():
        warnings.warn(f"method {method!r}: {key.removeprefix('on the CPU: ')} has {why}", RuntimeWarning, stacklevel=4)
    return notes


def _no_cpu_kernel(method: str, node: torch.fx.Node, op) -> str:
    runs_on = [t for t in ("cuda",) if has_kernel(op, Device(t, 0))]
    where = (f"it runs on {', '.join(runs_on)}: compile with a partitioner that places it there "
             f"(ferry.OpSupportPartitioner('{runs_on[0]}:0'), or a device map)") if runs_on else \
        "no device ferry knows has a kernel for it"
    return (f"method {method!r}: {kernel_name(op)} (node {node.name!r}) is placed on the CPU, which has no kernel for "
            f"it; {where}")
