"""What device_map="auto" estimates one op costs: its time, and the bytes of a value.

Time per op is max(FLOPs / 50 TFLOP/s, bytes moved / 3 TB/s) plus 5 us to launch (views move
nothing). Only the ratios between stages matter, so the constants only weigh compute against
memory traffic and launches; the devices are taken to be alike. A tensor entering a stage
from another device costs its bytes over the link (100 GB/s, between NVLink and PCIe) plus
10 us for the copy: that is what makes a cut inside a layer, where more tensors cross, cost
more than a cut between layers.
"""

from __future__ import annotations

import math

import torch

from ferry import node_meta as M
from ferry.ops import aliasing

PEAK_FLOPS = 50e12
MEMORY_BYTES_PER_S = 3e12
LAUNCH_S = 5e-6
LINK_BYTES_PER_S = 100e9
COPY_S = 10e-6


def val_bytes(val) -> int:
    """The bytes of a node's value (a tensor, or the tensors of a tuple); 0 for the rest. A dynamic
    size counts at the size export traced: reading it would add a guard to the caller's program
    (its shape environment is shared), making the dimension static."""
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return sum(math.prod(M.hint_ints(v.shape)) * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _shape(node) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return M.hint_ints(val.shape) if isinstance(val, torch.Tensor) else ()


def op_flops(node: torch.fx.Node) -> int:
    """Multiply-adds x 2 of the GEMMs, convolutions and attention; 0 for the rest."""
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    args = node.args
    out = _shape(node)
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear") and args:
        a = _shape(args[1] if name in ("addmm", "baddbmm") else args[0])
        return 2 * math.prod(out) * (a[-1] if a else 0)
    if name in ("convolution", "conv2d", "conv1d", "conv3d") and len(args) > 1:
        w = _shape(args[1])
        return 2 * math.prod(out) * math.prod(w[1:]) if w else 0
    if name.startswith("scaled_dot_product") or name.startswith("_scaled_dot_product"):
        q, k = _shape(args[0]), _shape(args[1])
        if len(q) >= 2 and len(k) >= 2:
            return 4 * math.prod(q) * k[-2]
    return 0


def is_view(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and aliasing.is_view(node.target)


def op_seconds(node: torch.fx.Node) -> float:
    if is_view(node):
        return 0.0  # a view: no data moves, no kernel runs
    moved = val_bytes(node.meta.get("val")) + sum(val_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    return max(op_flops(node) / PEAK_FLOPS, moved / MEMORY_BYTES_PER_S) + LAUNCH_S


def copy_seconds(nbytes: int, count: int) -> float:
    """The time `count` tensors of `nbytes` in all take to reach a stage from other devices."""
    return nbytes / LINK_BYTES_PER_S + count * COPY_S
