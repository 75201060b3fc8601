"""Which devices an operator has a kernel for, from the dispatcher's own table.

An op runs on a device when the dispatcher holds a kernel for that device's dispatch key, or a
composite one (written in other ops, so it runs wherever they do). This is what decides where a
library's custom op (`torch.library`: torchao's quantize ops, transformers' grouped GEMM) may
be placed, and what refuses a placement nothing can run (`_weight_int4pack_mm` on the CPU)
at compile time instead of at the first call.
"""

from __future__ import annotations

import torch

from ferry.device import Device

__all__ = ["COMPOSITE_KEYS", "dispatch_key", "has_kernel"]

COMPOSITE_KEYS = ("CompositeExplicitAutograd", "CompositeImplicitAutograd", "CompositeExplicitAutogradNonFunctional")


def dispatch_key(device: Device) -> str:
    """'CUDA' for cuda devices; 'CPU' for the CPU and host-backed devices (the emulated one runs
    CPU kernels on its memory)."""
    return device.to_torch().type.upper()


def has_kernel(op: torch._ops.OpOverload, device: Device) -> bool:
    """Can `op` run on `device`? An ATen op counts as able where this build of torch cannot tell:
    a CPU-only build holds no CUDA kernels, yet programs for CUDA are compiled on it (a library's
    kernels, registered as it is imported, are in the table on any build)."""
    key = dispatch_key(device)
    if key == "CUDA" and op.namespace == "aten" and not torch.backends.cuda.is_built():
        return True
    try:
        return any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), k) for k in (key, *COMPOSITE_KEYS))
    except RuntimeError:  # an overload only Python knows (aten::sym_size): no table to ask
        return op.namespace == "aten"
