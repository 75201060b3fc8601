"""A permuted tensor copied only so that a pointwise op can read it reshaped: the op reads the
permuted view instead, its other operands reshaped to match, and no copy runs.

torchvision's Swin puts windows back with a view, a permute, a contiguous copy and a view that
merges dims (8 windows of 7 rows into 56 rows); the residual add after it is the copy's only
reader. An elementwise op pairs the same elements whatever the layout: split the add's other
operand into the permuted shape (a view of a contiguous tensor), add there, and merge the sum's
dims back (a view of the contiguous result). One kernel a block fewer, the same bits.

Taken where the copy's result reaches its readers only through views that merge adjacent dims,
every reader is an exactly rounded elementwise op (+, -, ×, /, min/max, comparisons, logical ops,
`where`: the same bits from a CPU kernel's vectorised and scalar paths) with its other tensor
operands of the same shape and dtype (viewable in the permuted shape), and each reader's result
stays contiguous. Static sizes only.
"""

from __future__ import annotations

import torch
import torch.fx

from ferry.choices.graph_edits import Rewrite, call, single_use, static_value, value_of, viewable

__all__ = ["ON", "reads_through_permutes"]

aten = torch.ops.aten
ON = True  # off: the copies run as traced (an A/B: bench/profile_graphs.py --permuted-reads off)
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.alias.default)
# elementwise ops whose every result is exactly rounded: the same bits whichever kernel path runs
# (a CPU kernel vectorises only operands of unit inner stride; its scalar path gives atan2, pow,
# logaddexp, gelu's backward, or an add with alpha in bf16 (fused multiply-add) other last bits)
_EXACT = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
                    aten.minimum.default, aten.fmax.default, aten.fmin.default, aten.eq.Tensor, aten.ne.Tensor,
                    aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor, aten.logical_and.default,
                    aten.logical_or.default, aten.logical_xor.default, aten.where.self})


def reads_through_permutes(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """Rewrite each copy whose readers can read the permuted value it copies; return what was done."""
    done = []
    for node in list(gm.graph.nodes) if ON else ():
        if node.op == "call_function" and node.target is aten.clone.default and _lift(gm, node):
            done.append(Rewrite("read through permute", node.name))
    return done


def _lift(gm: torch.fx.GraphModule, copy: torch.fx.Node) -> bool:
    src = copy.args[0]
    if not isinstance(src, torch.fx.Node) or set(copy.kwargs) - {"memory_format"}:
        return False
    src_val, val = src.meta.get("val"), copy.meta.get("val")
    if not (static_value(src_val) and static_value(val)) or src_val.is_contiguous() or not val.is_contiguous():
        return False
    end, between = _reshaped_end(copy)
    end_val = end.meta["val"]
    if not end_val.is_contiguous() or not _merges(tuple(val.shape), tuple(end_val.shape)) or not end.users:
        return False
    plans = [_reader_plan(u, end, src, tuple(val.shape)) for u in end.users]
    if any(p is None for p in plans):
        return False
    for reader, others, new_val in plans:  # type: ignore[misc]
        _rewrite_reader(gm, reader, end, src, others, new_val)
    for n in reversed([copy, *between]):
        if not n.users:
            gm.graph.erase_node(n)
    return True


def _reshaped_end(copy: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The last of the reshapes that alone read the copy (or the copy), and the reshapes."""
    end, between = copy, []
    while single_use(end):
        nxt = next(iter(end.users))
        if nxt.target not in _RESHAPES or nxt.args[0] is not end or not static_value(nxt.meta.get("val")):
            break
        between.append(nxt)
        end = nxt
    return end, between


def _merges(fine: tuple[int, ...], coarse: tuple[int, ...]) -> bool:
    """`coarse` is `fine` with runs of adjacent dims merged (dims of one dropped or added)."""
    fine, coarse = tuple(s for s in fine if s != 1), tuple(s for s in coarse if s != 1)
    i = 0
    for size in coarse:
        product = 1
        while product < size and i < len(fine):
            product *= fine[i]
            i += 1
        if product != size:
            return False
    return i == len(fine)


def _reader_plan(reader: torch.fx.Node, end: torch.fx.Node, src: torch.fx.Node, shape: tuple[int, ...]):
    """(reader, its other tensor operands, its value computed in `shape`) where the reader is an
    exactly rounded elementwise op (without an alpha), its other tensor operands have end's shape
    and dtype and a layout viewable in `shape`, and its value computed there is contiguous; else
    None."""
    if reader.op != "call_function" or reader.target not in _EXACT or reader.kwargs.get("alpha", 1) != 1:
        return None
    end_val, out = end.meta["val"], reader.meta.get("val")
    if not (isinstance(out, torch.Tensor) and out.is_contiguous() and tuple(out.shape) == tuple(end_val.shape)):
        return None
    vals, others = {end: src.meta["val"]}, []
    for a in (*reader.args, *reader.kwargs.values()):
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a):
            return None
        if a is end or not isinstance(a, torch.fx.Node):
            continue
        v = a.meta.get("val")
        if not (static_value(v) and tuple(v.shape) == tuple(end_val.shape) and v.dtype == end_val.dtype and viewable(v, shape)):
            return None
        others.append(a)
        vals[a] = v.view(shape)
    try:
        new_val = value_of(reader, vals)
    except Exception:  # noqa: BLE001 - an op that cannot say: left as traced
        return None
    if not (isinstance(new_val, torch.Tensor) and new_val.is_contiguous() and new_val.dtype == out.dtype
            and tuple(new_val.shape) == shape):
        return None
    return reader, others, new_val


def _rewrite_reader(gm, reader: torch.fx.Node, end: torch.fx.Node, src: torch.fx.Node, others, new_val) -> None:
    """`reader` computed in the permuted shape, reading `src` for `end`, its result viewed back."""
    out, shape = reader.meta["val"], list(new_val.shape)
    with gm.graph.inserting_before(reader):
        swap = {end: src, **{o: call(gm, reader, aten.view.default, (o, shape), o.meta["val"].view(shape)) for o in others}}
        args = tuple(swap.get(a, a) if isinstance(a, torch.fx.Node) else a for a in reader.args)
        kwargs = {k: swap.get(a, a) if isinstance(a, torch.fx.Node) else a for k, a in reader.kwargs.items()}
        lifted = call(gm, reader, reader.target, args, new_val, kwargs)
        back = call(gm, reader, aten.view.default, (lifted, list(out.shape)), new_val.view(out.shape))
    reader.replace_all_uses_with(back)
    gm.graph.erase_node(reader)
