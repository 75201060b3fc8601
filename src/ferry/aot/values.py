"""What a traced value becomes in a program: the segments and delegates a program's methods
share, a tensor's bytes, a dimension's planned upper bound, the layout eager gives a result."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import sympy
import torch

from ferry import node_meta as M
from ferry.backend_registry import ProgramData
from ferry.errors import CompileError
from ferry.layout import is_dense
from ferry.program.schema import Delegate

__all__ = ["ProgramBuilder", "eager_strides", "tensor_bytes", "upper_bound"]


@dataclass
class ProgramBuilder:
    """Segments and delegates shared by all methods of one program. A payload's builder with an
    `outer` one puts its constants there: the program's weights, stored once for every method."""

    segments: list = field(default_factory=list)
    delegates: list[Delegate] = field(default_factory=list)
    _segment_of: dict = field(default_factory=dict)
    outer: ProgramBuilder | None = None
    _states: dict = field(default_factory=dict)  # state name -> (segment, initial value)
    merged: dict = field(default_factory=dict)  # weights stacked at compile time, by their sources (choices/gemm.py)

    @property
    def data(self) -> ProgramData:
        return ProgramData(self.segments, store=self)

    def add_segment(self, data: bytes) -> int:
        self.segments.append(data)
        return len(self.segments) - 1

    def state_segment(self, name: str, tensor: torch.Tensor) -> int:
        """The initial value of the program's state `name`: one segment for every method naming it,
        which must all start it from the same tensor (as one model's methods do)."""
        prior = self._states.get(name)
        if prior is None:
            self._states[name] = (self.constant_segment(tensor), tensor)
            return self._states[name][0]
        seg, first = prior
        t = tensor.detach()
        if (first.dtype, first.shape) != (t.dtype, t.shape) or not torch.equal(first.cpu(), t.cpu()):
            raise CompileError(f"the methods disagree on mutable buffer {name!r} (a {first.dtype}{list(first.shape)} "
                               f"tensor in one, a {t.dtype}{list(t.shape)} tensor with other values in another): "
                               "methods compiled together share a buffer by name; export them from one model object")
        return seg

    def constant_segment(self, tensor: torch.Tensor) -> int:
        if self.outer is not None:
            return self.outer.constant_segment(tensor)
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        if tensor.numel() and key in self._segment_of:
            return self._segment_of[key][0]
        seg = self.add_segment(tensor_bytes(tensor))
        if tensor.numel():  # the tensor is kept: a tensor made later at its freed address is another one
            self._segment_of[key] = (seg, tensor)
        return seg


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as raw bytes (no numpy needed), in the memory order of the layout it
    is recorded with (`eager_strides`: a dense permutation such as a transposed weight keeps its
    layout, so `as_strided` and `view` read it as eager does), else row-major."""
    t, strides = t.detach().cpu(), eager_strides(t)
    t = torch.empty_strided(t.shape, strides, dtype=t.dtype).copy_(t) if strides else t.contiguous()
    if t.numel() == 0:
        return b""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def upper_bound(dim, range_constraints, what: str) -> tuple[int, bool]:
    if isinstance(dim, int):
        return dim, False
    expr = dim.node.expr
    if isinstance(expr, (int, sympy.Integer)):
        return int(expr), False
    subs = {}
    for sym in expr.free_symbols:
        if str(sym).startswith("u"):  # an unbacked symbol: known only once the data is seen
            raise CompileError(
                f"{what} is a data-dependent size ({sym}); ferry plans memory ahead of time and needs static "
                "or bounded shapes: keep ops like nonzero/unique out of the program"
            )
        vr = range_constraints.get(sym) or next((v for k, v in range_constraints.items() if str(k) == str(sym)), None)
        upper = None if vr is None else vr.upper
        if upper is None or not getattr(upper, "is_finite", True) or str(upper) in ("oo", "int_oo"):
            raise CompileError(
                f"{what} has a dynamic dimension {sym} with no upper bound, so its memory cannot be planned; "
                f"export with a bounded dimension, e.g. torch.export.Dim('{sym}', max=1024)"
            )
        subs[sym] = int(upper)
    return int(expr.subs(subs)), True


def eager_strides(val: torch.Tensor) -> tuple[int, ...]:
    """The layout eager gives `val` when it is a dense permutation other than contiguous (so a
    view eager allows on it stays legal here); () for contiguous or anything else."""
    strides, shape = M.static_ints(val.stride()), M.static_ints(val.shape)
    if strides is None or shape is None or M.surely(val.is_contiguous()) or not is_dense(shape, strides):
        return ()  # (symbolic strides: laid out contiguously)
    return strides
