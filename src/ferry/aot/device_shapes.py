"""Results whose shape depends on the device that computes them take that device's shape.

The trace runs on the CPU, and a few kernels give auxiliary results another shape on CUDA:
`native_batch_norm` in eval returns its saved mean and inverse std as (0,) on the CPU and as
(C,) on CUDA. Memory is planned from the trace, so an op placed on CUDA is traced again on
fake CUDA tensors (no GPU needed) and, where that disagrees, the node records CUDA's shape.
Only ops with several results are asked: a single result's shape is the op's meaning.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._guards import detect_fake_mode

from ferry.aot import meta as M
from ferry.device import Device

__all__ = ["fit_to_device"]


def fit_to_device(nodes, device: Device) -> int:
    """Give the multi-result ops among `nodes` (placed on `device`) the shapes that device's
    kernels make; returns how many changed."""
    if device.type != "cuda":
        return 0  # host-backed devices run the CPU's kernels: the trace is theirs
    changed = 0
    for node in nodes:
        val = node.meta.get("val")
        if (node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload)
                or not isinstance(val, (tuple, list)) or not _static(val)):
            continue
        there = _on_device(node, device)
        if there is None or len(there) != len(val):
            continue
        new = [_like(v, t) for v, t in zip(val, there)]
        if any(n is not v for n, v in zip(new, val)):
            node.meta["val"] = type(val)(new)
            for user in node.users:
                if user.target is operator.getitem and isinstance(user.args[1], int):
                    user.meta["val"] = new[user.args[1]]
            changed += 1
    return changed


def _static(vals) -> bool:
    return all(isinstance(v, torch.Tensor) and M.static_ints(v.shape) is not None for v in vals)


def _on_device(node: torch.fx.Node, device: Device):
    """The node's results computed on fake tensors of `device`, or None when that cannot be asked."""
    mode = detect_fake_mode([node.meta.get("val")])
    if mode is None:
        return None
    where = device.to_torch()

    def fake(x):
        if isinstance(x, torch.fx.Node):
            v = x.meta.get("val")
            if isinstance(v, torch.Tensor):
                return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=where)
            return v
        if isinstance(x, (list, tuple)):
            return type(x)(fake(e) for e in x)
        return x

    try:
        with mode:
            args, kwargs = fake(list(node.args)), {k: fake(v) for k, v in node.kwargs.items()}
            out = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op fake CUDA cannot run: the trace's shapes stand
        return None
    return list(out) if isinstance(out, (tuple, list)) else None


def _like(traced: torch.Tensor, there) -> torch.Tensor:
    """`traced`, or a CPU fake tensor of the device's shape when the shapes differ."""
    if not isinstance(there, torch.Tensor) or tuple(there.shape) == tuple(traced.shape):
        return traced
    mode = detect_fake_mode([traced])
    with mode:
        return torch.empty(tuple(there.shape), dtype=traced.dtype, device=traced.device)
