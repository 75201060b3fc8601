"""Which ATen overload writes into planned memory: the `.out` twin of each functional op.

An op with no out variant stays functional and allocates at run time (the compile report
lists it). The `*_scatter` ops take ferry's own out kernels (ops/scatter.py). Which results
alias an input (views) is ops/aliasing.py's to say.
"""

from __future__ import annotations

import functools

import torch

from ferry.ops import writes
from ferry.ops.copies import FUNCTIONAL_COPIES

_TENSOR_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})


def _sig(args) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in args]


@functools.cache
def out_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of `op`'s packet taking the same arguments plus one out per return."""
    if op in FUNCTIONAL_COPIES:
        return op.overloadpacket.out
    if op in writes.OUT_KERNELS:
        return writes.OUT_KERNELS[op]
    schema = op._schema
    if schema.is_mutable or not schema.returns:
        return None
    if any(not isinstance(r.type, torch.TensorType) for r in schema.returns):
        return None
    want = _sig(schema.arguments)
    # out variants of factory-like ops (full, zeros, arange, _to_copy, *_like) drop the
    # TensorOptions arguments: the out tensor fixes dtype, layout and device (torchgen's rule)
    names = {n for n, _ in want}
    without_options = [a for a in want if a[0] not in _TENSOR_OPTIONS] if _TENSOR_OPTIONS <= names else None
    packet = op.overloadpacket
    loose = None
    for name in packet.overloads():
        cand = getattr(packet, name)
        cargs = cand._schema.arguments
        outs = [a for a in cargs if a.is_out]
        if len(outs) != len(schema.returns):
            continue
        got = _sig([a for a in cargs if not a.is_out])
        if got == want:
            return cand
        if loose is None and without_options is not None and got == without_options:
            loose = cand
    return loose


@functools.cache
def functional_variant(out: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of `out`'s packet taking its arguments without the outs (`narrow_copy.out` ->
    `narrow_copy.default`), or None."""
    outs = [a for a in out._schema.arguments if a.is_out]
    if not outs:
        return None
    want = _sig([a for a in out._schema.arguments if not a.is_out])
    packet = out.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        if not any(a.is_out for a in cand._schema.arguments) and _sig(cand._schema.arguments) == want \
                and len(cand._schema.returns) == len(outs):
            return cand
    return None


def has_device_kernel(op: torch._ops.OpOverload, device_type: str) -> bool:
    """Whether the dispatcher can run `op` on tensors of `device_type` (host-backed devices run the
    CPU's kernels): a kernel of its own, or a composite one."""
    key = "CUDA" if device_type == "cuda" else "CPU"
    name = op.name()
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k) for k in (
        key, "CompositeExplicitAutograd", "CompositeImplicitAutograd", "CompositeExplicitAutogradNonFunctional"))
