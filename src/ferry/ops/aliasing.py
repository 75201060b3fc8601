"""Which results of an operator may be the memory of which of its inputs, and which out
kernels may write over an input: facts of the operators, read once, for the planner, the
checks of a program and the runtime.

Two sources, because the schemas tell only part of it:

* **The schema.** A result annotated with an argument's alias set (`Tensor(a) self -> Tensor(a)`:
  `view`, `reshape`, `expand_as`, `contiguous`, `split`) may be a view of that argument.
  Kernels registered for a backend keep their schema's word: an unannotated result is fresh
  memory (PyTorch's schema checks test exactly that).
* **The trace.** A composite op (a CompositeImplicitAutograd kernel: Python-level code over
  other ops, which no schema check covers) with unannotated results may hand an input back
  as it is when there is nothing to do: `x.type_as(y)` when the dtypes agree, `atleast_2d`,
  `sum_to_size`, `broadcast_tensors`, `meshgrid`; and the `unsafe_` ops (`unsafe_split`)
  return views by design. Export's fake tensors share storage exactly where eager's results
  do, so the trace says which input a result is at the traced sizes; at other sizes (a
  dynamic program) the runtime checks each call of a composite (`composite_results`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from ferry.layout import element_span

__all__ = [
    "STORAGE_OFFSET_AT", "composite_results", "extent", "is_view", "overwrites_safely",
    "returns_inputs", "schema_alias", "traced_alias", "unannotated", "view_base", "view_source",
]


@functools.cache
def schema_alias(op: torch._ops.OpOverload) -> tuple[int | None, ...]:
    """Per return of `op`, the position of the argument it may be a view of (they share an alias
    set and the result is not written through), or None."""
    args = op._schema.arguments
    out: list[int | None] = []
    for r in op._schema.returns:
        info = r.alias_info
        pos = None
        if info is not None and not info.is_write:
            sets = {i: set(a.alias_info.before_set) for i, a in enumerate(args)
                    if a.alias_info is not None and not a.alias_info.is_write}
            # a list of views (`Tensor(a)[]` of `Tensor(a -> *) self`) names its set on the elements
            pos = next((i for i, s in sets.items() if s & set(info.before_set)), next(iter(sets), None))
        out.append(pos)
    return tuple(out)


@functools.cache
def is_view(op: torch._ops.OpOverload) -> bool:
    """True for ops whose one result (a tensor or a list of tensors) views an argument without
    writing: view, permute, reshape, split, unbind, ..."""
    if op in _UNTRACKED_VIEWS:
        return True
    return len(op._schema.returns) == 1 and schema_alias(op)[0] is not None


def view_source(op: torch._ops.OpOverload) -> int:
    """The argument position a view op's results view (the first argument for `_unsafe_view`)."""
    pos = schema_alias(op)[0] if op._schema.returns else None
    return 0 if pos is None else pos


def view_base(node, through=None):
    """The node a chain of views of `node` starts from. `through(node)`: the argument position to
    follow past a node that is not a view (a cast, an in-place op's returned input), or None to
    stop there."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        op = node.target
        at = view_source(op) if isinstance(op, torch._ops.OpOverload) and is_view(op) else (
            through(node) if through is not None else None)
        if at is None:
            break
        source = node.args[at] if at < len(node.args) else (
            node.kwargs.get(op._schema.arguments[at].name) if isinstance(op, torch._ops.OpOverload) else None)
        if not isinstance(source, torch.fx.Node):
            break
        node = source
    return node


# views whose schema does not say so (`reshape` of a fresh copy becomes `clone` + `_unsafe_view`):
# eager returns a view here too, and copying through the `.out` overload would be a wasted pass
_UNTRACKED_VIEWS = frozenset({torch.ops.aten._unsafe_view.default})


@functools.cache
def unannotated(op: torch._ops.OpOverload) -> bool:
    """`op` returns tensors its schema says nothing about: fresh memory by the schema's word, but
    composites (and the `unsafe_` ops, whose results are views by design) may break it, so the
    trace is asked which input, if any, each result is."""
    schema = op._schema
    if op.namespace != "aten" or schema.is_mutable or not any(_is_tensorish(r.type) for r in schema.returns):
        return False  # (ferry's own ops and the copies say what they do; their nodes share their input's trace)
    return all(r.alias_info is None for r in schema.returns)


@functools.cache
def returns_inputs(op: torch._ops.OpOverload) -> bool:
    """A composite op whose schema leaves its tensor results unannotated: whether it returns an
    input as it is may depend on sizes, so at sizes other than the trace's the runtime checks
    (`composite_results`)."""
    if not unannotated(op):
        return False
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"))
    except RuntimeError:
        return False


def _is_tensorish(t) -> bool:
    return "Tensor" in str(t)


def traced_alias(node: torch.fx.Node) -> list[torch.fx.Node | None]:
    """Per result of `node` (one, or each of a list), the input node whose memory the trace
    shows it shares (export's fake tensors keep eager's aliasing), or None."""
    val = node.meta.get("val")
    results = list(val) if isinstance(val, (list, tuple)) else [val]
    storages: list[tuple[StorageWeakRef, torch.fx.Node]] = []
    for arg in node.all_input_nodes:
        v = arg.meta.get("val")
        if isinstance(v, torch.Tensor) and _has_storage(v):
            storages.append((StorageWeakRef(v.untyped_storage()), arg))
    out: list[torch.fx.Node | None] = []
    for r in results:
        ref = StorageWeakRef(r.untyped_storage()) if isinstance(r, torch.Tensor) and _has_storage(r) else None
        out.append(next((arg for s, arg in storages if ref is not None and s == ref), None))
    return out


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
        return True
    except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
        return False


def composite_results(fn, declared: list[int | None]):
    """`fn` (a composite op's call) with its results kept to what the program declares: a result
    declared fresh (`declared[i]` None) that shares memory with an input, or one declared a view
    of input `declared[i]` that lies elsewhere in an input's memory, is copied. At the traced
    sizes the declaration holds and nothing is copied; at other sizes of a dynamic program a
    composite may return an input where the trace made a new tensor (`sum_to_size` to the same
    size), and the planner may reuse that input's memory while the result is still read."""

    def call(*args, **kwargs):
        result = fn(*args, **kwargs)
        many = isinstance(result, (list, tuple))
        results = list(result) if many else [result]
        inputs = [t for t in _tensors(args, kwargs)]
        for i, r in enumerate(results):
            if not isinstance(r, torch.Tensor) or not inputs:
                continue
            base = declared[i] if i < len(declared) else None
            source = _input_at(args, kwargs, base)
            if source is not None and _within(r, source):
                continue
            if any(_same_storage(r, t) for t in inputs):
                results[i] = r.clone()
        return (type(result)(results) if isinstance(result, tuple) else results) if many else results[0]

    return call


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (e for e in a if isinstance(e, torch.Tensor))


def _input_at(args, kwargs, position: int | None):
    """The tensor at flat input `position` (tensors counted in order, list members included)."""
    if position is None:
        return None
    for k, t in enumerate(_tensors(args, kwargs)):
        if k == position:
            return t
    return None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.untyped_storage().nbytes() > 0
    except (RuntimeError, NotImplementedError):
        return False


def _within(r: torch.Tensor, base: torch.Tensor) -> bool:
    """`r`'s bytes lie inside `base`'s (a view of it, or it itself)."""
    if not _same_storage(r, base):
        return False
    lo, hi = extent(base)
    rlo, rhi = extent(r)
    return lo <= rlo and rhi <= hi


def extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte address a tensor's elements occupy (a view: only its own span of the storage)."""
    low, high = element_span(t.shape, t.stride())
    return t.data_ptr() + low * t.element_size(), t.data_ptr() + high * t.element_size()


# ---------------------------------------------------------------- reading through a storage

# ops whose `storage_offset` argument indexes their input's storage, not its elements (as_strided:
# it may read any element of the storage, not only the input's)
STORAGE_OFFSET_AT: Mapping[str, int] = MappingProxyType({
    "aten::as_strided.default": 3, "aten::as_strided_copy.default": 3, "aten::as_strided_scatter.default": 4,
    "ferry::as_strided_scatter.out": 4,
})


# ---------------------------------------------------------------- writing over an input


def overwrites_safely(op: torch._ops.OpOverload, position: int) -> bool:
    """Whether `op`, an out overload, may write its out argument over the very memory (same
    bytes, shape and strides) of its argument at `position`: any argument of a pointwise ATen op
    (each element is read before it is written), `self` of an ATen op whose in-place overload
    takes the same arguments (`relu_`, `add_`: that call exactly), and `self` of ferry's write
    kernels (the write into a slice of the cache eager's `index_copy_` makes). What eager's
    in-place ops save, the memory plan saves too. Not `normal.Tensor_float_out`: `normal_`
    exists but is another call, and the out kernel fills `out` before it reads the mean."""
    from ferry.ops import writes  # (imported here: ops/writes.py registers operators)

    if position >= len(op._schema.arguments) or op._schema.arguments[position].is_out:
        return False
    if op in writes.OUT_KERNELS.values():
        return position == 0
    if op.namespace != "aten":
        return False
    args = _signature_of(op)
    packet = op.overloadpacket
    same = [getattr(packet, name) for name in packet.overloads()]
    if any(torch.Tag.pointwise in o.tags for o in same if _signature_of(o) == args):
        return True
    in_place = getattr(torch.ops.aten, packet.__name__ + "_", None)
    if position != 0 or in_place is None:
        return False
    return any(_signature_of(getattr(in_place, name)) == args for name in in_place.overloads())


def _signature_of(op: torch._ops.OpOverload) -> tuple:
    """The names and types of an overload's arguments, its out arguments left out."""
    return tuple((a.name, str(a.type)) for a in op._schema.arguments if not a.is_out)
