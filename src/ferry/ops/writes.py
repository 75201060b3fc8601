"""Out kernels for the functional forms of writes into part of a tensor: `copy` and the
`*_scatter` ops, writing into planned memory.

Functionalization turns `cache[:, pos] = x` into `copy` of a view and a `*_scatter` of the
result. ATen's own `.out` overloads of these ops are generated wrappers, and their functional
kernels clone `self`'s whole storage (to keep its strides): for a tensor planned inside a memory
arena, that is the whole arena on every call. These write `out` as eager's result reads, in
passes over the tensors themselves: `copy` writes `src` (broadcast, cast) over `out`; a scatter
writes `self` and then `src` into the view. When the plan writes `out` over `self` (self dies
there, as a KV cache's old value does) a scatter moves only `src` — what eager's
`cache[:, pos] = x` does. (`out` is laid out as planned: contiguous, or eager's dense
permutation; the strides of a copy of a slice are then the result's own, not the slice's.)

Schemas (namespace `ferry`), each the ATen op's arguments plus `out`:

    copy.out(Tensor self, Tensor src, bool non_blocking=False, *, Tensor(a!) out) -> Tensor(a!)
    slice_scatter.out(Tensor self, Tensor src, int dim=0, SymInt? start=None, SymInt? end=None,
                      SymInt step=1, *, Tensor(a!) out) -> Tensor(a!)
    select_scatter.out(Tensor self, Tensor src, int dim, SymInt index, *, Tensor(a!) out) -> Tensor(a!)
    diagonal_scatter.out(Tensor self, Tensor src, int offset=0, int dim1=0, int dim2=1, *,
                         Tensor(a!) out) -> Tensor(a!)
    as_strided_scatter.out(Tensor self, Tensor src, SymInt[] size, SymInt[] stride,
                           SymInt? storage_offset=None, *, Tensor(a!) out) -> Tensor(a!)
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from ferry.layout import element_span

__all__ = ["OUT_KERNELS"]

_NAMESPACE = "ferry"
_OUT = "*, Tensor(a!) out) -> Tensor(a!)"
_SCHEMAS = MappingProxyType({
    "copy": f"copy.out(Tensor self, Tensor src, bool non_blocking=False, {_OUT}",
    "slice_scatter": f"slice_scatter.out(Tensor self, Tensor src, int dim=0, SymInt? start=None, SymInt? end=None, "
                     f"SymInt step=1, {_OUT}",
    "select_scatter": f"select_scatter.out(Tensor self, Tensor src, int dim, SymInt index, {_OUT}",
    "diagonal_scatter": f"diagonal_scatter.out(Tensor self, Tensor src, int offset=0, int dim1=0, int dim2=1, {_OUT}",
    "as_strided_scatter": f"as_strided_scatter.out(Tensor self, Tensor src, SymInt[] size, SymInt[] stride, "
                          f"SymInt? storage_offset=None, {_OUT}",
})
aten = torch.ops.aten


def _start(self: torch.Tensor, src: torch.Tensor, out: torch.Tensor, view: torch.Tensor, op: str) -> None:
    """Checks as eager's kernel makes them, then `out` holds `self` (unless it is `self`'s memory)."""
    if src.dtype != self.dtype or out.dtype != self.dtype:
        raise RuntimeError(f"{op}: self, src and out must have one dtype, got {self.dtype}, {src.dtype}, {out.dtype}")
    if tuple(src.shape) != tuple(view.shape):
        raise RuntimeError(f"{op}: expected src to have the shape of the view it is written into, {tuple(view.shape)}, "
                           f"got {tuple(src.shape)}")
    if out.shape != self.shape:
        out.resize_(self.shape)
    if not (out.data_ptr() == self.data_ptr() and out.stride() == self.stride()):
        out.copy_(self)


def _copy(self, src, non_blocking=False, *, out):
    """eager's `copy(self, src)`: `src` broadcast to `self`'s shape, in `self`'s dtype."""
    if out.dtype != self.dtype:
        raise RuntimeError(f"copy: out must have self's dtype {self.dtype}, got {out.dtype}")
    if out.shape != self.shape:
        out.resize_(self.shape)
    return out.copy_(src)


def _slice_scatter(self, src, dim=0, start=None, end=None, step=1, *, out):
    _start(self, src, out, aten.slice.Tensor(self, dim, start, end, step), "slice_scatter")
    aten.slice.Tensor(out, dim, start, end, step).copy_(src)
    return out


def _select_scatter(self, src, dim, index, *, out):
    _start(self, src, out, aten.select.int(self, dim, index), "select_scatter")
    aten.select.int(out, dim, index).copy_(src)
    return out


def _diagonal_scatter(self, src, offset=0, dim1=0, dim2=1, *, out):
    _start(self, src, out, aten.diagonal.default(self, offset, dim1, dim2), "diagonal_scatter")
    aten.diagonal.default(out, offset, dim1, dim2).copy_(src)
    return out


def _as_strided_scatter(self, src, size, stride, storage_offset=None, *, out):
    """Eager writes `src` at storage positions of `self`'s storage; here those positions are
    laid out in a window of just the storage `self` and the view span, so `out` (laid out as
    planned, not as `self`) gets exactly eager's elements."""
    offset = self.storage_offset() if storage_offset is None else int(storage_offset)
    low, high = element_span(self.shape, self.stride(), self.storage_offset())
    vlow, vhigh = element_span(size, stride, offset)
    if vlow < 0:
        raise RuntimeError(f"as_strided_scatter: storage offset {offset} with strides {tuple(stride)} reaches before "
                           "the storage")
    low, high = min(low, vlow), max(high, vhigh)
    window = self.new_empty((high - low,))
    as_self = window.as_strided(self.shape, self.stride(), self.storage_offset() - low)
    as_self.copy_(self)
    view = window.as_strided(size, stride, offset - low)
    if tuple(src.shape) != tuple(view.shape) or src.dtype != self.dtype:
        raise RuntimeError(f"as_strided_scatter: expected src of shape {tuple(view.shape)} and dtype {self.dtype}, "
                           f"got {tuple(src.shape)} {src.dtype}")
    view.copy_(src)
    if out.shape != self.shape:
        out.resize_(self.shape)
    out.copy_(as_self)
    return out


_KERNELS = MappingProxyType({"copy": _copy, "slice_scatter": _slice_scatter, "select_scatter": _select_scatter,
            "diagonal_scatter": _diagonal_scatter, "as_strided_scatter": _as_strided_scatter})

# Keep a reference: the registrations live as long as this object (see ops/copies.py).
_lib = globals().get("_lib") or torch.library.Library(_NAMESPACE, "FRAGMENT")


def _register() -> None:
    for name, schema in _SCHEMAS.items():
        try:
            getattr(getattr(torch.ops, _NAMESPACE), name).out  # noqa: B018 - already registered
            continue
        except (AttributeError, RuntimeError):
            pass
        _lib.define(schema)
        _lib.impl(f"{name}.out", _KERNELS[name], "CompositeExplicitAutograd")
        torch.library.register_fake(f"{_NAMESPACE}::{name}.out", _fake, lib=_lib)


def _fake(self, src, *args, out, **kwargs):
    """The result has `self`'s shape, as every kernel here makes it (sized on meta tensors, `out`
    may come empty: runtime/stages/sizes.py)."""
    return out.resize_(self.shape) if out.shape != self.shape else out


_register()

# the functional ATen op -> ferry's out kernel for it (copy.default: the overload functionalization makes)
OUT_KERNELS: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {
    getattr(aten, name).default: getattr(getattr(torch.ops, _NAMESPACE), name).out for name in _SCHEMAS
}
