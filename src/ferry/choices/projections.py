"""Projections of one input merged at compile time: attention's q, k and v, an MLP's gate and up.

A decode step is a row of matrix-vector products, each bound by reading its weight, and small
ones were far from the bandwidth (an H200, Llama-3.2-1B's shape: k and v, 2 MB each, 5.4 µs
apiece, 0.4 TB/s). One product over the weights stacked along their rows reads as many bytes in
one launch; each projection's result is a slice of its columns. Three kinds are merged:

- `linear` with constant 2-D weights (and biases all or none);
- torchao's int4 products (`_weight_int4pack_mm` on CUDA, `_weight_int4pack_mm_for_cpu`): each
  reads its own 2-D view of the input (cast, and padded to a multiple of 1024 on CUDA); the
  packed tiles stack along their first dimension (rows, or blocks of eight rows) and the scales
  along their second. tinygemm's tile layout is its own,
  so a merge is kept only where the stacked product, run once on the constants' device, equals
  the separate ones;
- torchao's int8 products as they export (`mm(x, _to_copy(t(q))) * view(scale, [n])`): the int8
  weights and per-row scales stacked along their rows, one cast, one product and one scaling.

`merged`: stacked constants by their sources, shared by the methods of one program (prefill and
decode store and upload them once).
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx
from torch._guards import detect_fake_mode

from ferry import node_meta as M
from ferry.choices.graph_edits import Rewrite, attr, call, constant, set_value, value_of
from ferry.ops.aliasing import is_view

__all__ = ["INT4_PRODUCTS", "merge_projections"]

aten = torch.ops.aten
INT4_PRODUCTS = (aten._weight_int4pack_mm.default, aten._weight_int4pack_mm_for_cpu.default)
# ops each int4 product's input passes through on its own (torchao: a 2-D view, a cast, K padded
# to a multiple of 1024): two such chains of the same ops from one node compute the same value
_PER_PRODUCT = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.constant_pad_nd.default,
                aten.pad.default, aten._to_copy.default, aten.clone.default)
# ops between a per-row scale constant and its product: views, and a cast to the product's dtype
_SCALE_CHAIN = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                aten._to_copy.default)


def merge_projections(gm: torch.fx.GraphModule, merged: dict | None = None) -> list[Rewrite]:
    """Merge every group of projections of one input in `gm`, in place; what was done."""
    merged = {} if merged is None else merged
    groups: dict = {}
    for node in gm.graph.nodes:
        key = _linear_key(gm, node) or _int4_key(gm, node) or _int8_key(gm, node)
        if key is not None:
            groups.setdefault(key, []).append(node)  # in graph order: the first is the earliest
    done = []
    for key, nodes in groups.items():
        if len(nodes) > 1 and _MERGES[key[0]](gm, nodes, merged):
            done += [Rewrite("projections merged", n.name) for n in nodes]
    return done


def _returned(node) -> bool:
    return any(u.op == "output" for u in node.users)  # a view as the delegate's result would be copied out


_STRICT_VIEWS = (aten.view.default, aten._unsafe_view.default)  # they need strides that allow them
_SAME_LAYOUT = (aten.alias.default, aten.detach.default)  # views with their input's sizes and strides
_PIECES = (aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default)  # of the last dim: columns


def _columns_serve(node, width: int, direct: bool = True) -> bool:
    """A slice of `width` columns of a wider product can stand in for `node`'s result: every
    view of it that needs strides that allow it reads it directly (or through such views) and
    keeps its rows apart from its columns. `x.reshape(-1)` of a projection, exported as
    `view(-1)` from a contiguous trace, does not fit a slice."""
    for u in node.users:
        if u.op != "call_function":
            continue
        if u.target is aten.as_strided.default:
            return False  # reads memory by strides of its own: a slice's would differ
        if u.target in _STRICT_VIEWS:
            if not (direct and _rows_apart(u, width) and _columns_serve(u, width)):
                return False
        elif u.target in _SAME_LAYOUT:
            if not _columns_serve(u, width, direct):
                return False
        elif (pieces := _last_dim_pieces(u)) is not None:  # columns of columns: each piece's rows apart
            if not all(_columns_serve(piece, cols, direct) for piece, cols in pieces):
                return False
        elif (not isinstance(u.target, torch._ops.OpOverload) or is_view(u.target)) and not _columns_serve(u, width, False):
            return False  # another alias of it (transpose, split): no strict view below
    return True


def _last_dim_pieces(node) -> list | None:
    """(piece node, its static width) for a slice or split of the last dim, else None."""
    val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or node.target not in _PIECES:
        return None
    at = 1 if node.target is aten.slice.Tensor else 2  # slice(x, dim, start, end, step), split(x, sizes, dim)
    dim = node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)
    step = node.args[4] if node.target is aten.slice.Tensor and len(node.args) > 4 else node.kwargs.get("step", 1)
    if not isinstance(dim, int) or dim % val.dim() != val.dim() - 1 or step != 1:
        return None
    pieces = [node] if node.target is aten.slice.Tensor else list(node.users)
    if not all(p.target is operator.getitem or p is node for p in pieces):
        return None
    widths = [p.meta.get("val").shape[-1] if isinstance(p.meta.get("val"), torch.Tensor) else None for p in pieces]
    return None if any(type(w) is not int for w in widths) else list(zip(pieces, widths))


def _rows_apart(view, width: int) -> bool:
    """`view`'s last sizes hold exactly one row of `width` columns (static), the ones before the
    rows: it regroups the rows (row-major over the wider product's row stride) and the columns
    (contiguous), never one with the other."""
    val, size = view.meta.get("val"), 1
    for s in reversed(val.shape if isinstance(val, torch.Tensor) else ()):
        if type(s) is not int:
            return False
        size *= s
        if size >= width:
            return size == width
    return False


def _linear_key(gm, node):
    """What linears must share to be merged (None: not a mergeable projection): input itself,
    2-D constant weights of one dtype, device and width, biases all or none."""
    if node.op != "call_function" or node.target is not aten.linear.default or _returned(node):
        return None
    w = attr(gm, node.args[1])
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    bias = attr(gm, b) if b is not None else None
    if w is None or w.dim() != 2 or (b is not None and (bias is None or bias.shape != w.shape[:1])):
        return None
    if not isinstance(node.meta.get("val"), torch.Tensor) or M.get_device(node.args[1]) != M.get_device(node):
        return None
    if not _columns_serve(node, w.shape[0]):
        return None
    return "linear", node.args[0], w.dtype, w.device, w.shape[1], b is None


def _int4_key(gm, node):
    """What int4 products must share: one input (the same node, or views of one node to one
    shape), the op, group size, device, and packed tiles and scales alike past the stacked dim."""
    if node.op != "call_function" or node.target not in INT4_PRODUCTS or _returned(node) or node.kwargs:
        return None
    x, packed, group, scales = node.args
    p, s, val = attr(gm, packed), attr(gm, scales), node.meta.get("val")
    if p is None or s is None or not isinstance(val, torch.Tensor) or s.dim() != 3 or s.shape[1] != val.shape[-1]:
        return None
    if M.get_device(packed) != M.get_device(node) or M.get_device(scales) != M.get_device(node):
        return None
    if not _columns_serve(node, val.shape[-1]):
        return None
    return "int4", node.target, _source(x), group, p.dtype, p.device, tuple(p.shape[1:]), s.dtype, s.shape[0], s.shape[2]


def _int8_parts(gm, node):
    """torchao's int8 product as it exports, `mm(x, _to_copy(t(q))) * view(scale, [n])`:
    (x, cast, q, the scale's get_attr, the mul, the scale's casts), or None."""
    if node.op != "call_function" or node.target is not aten.mm.default or len(node.users) != 1:
        return None
    x, cast = node.args
    (mul,) = node.users
    if not (isinstance(cast, torch.fx.Node) and cast.target is aten._to_copy.default and len(cast.args) == 1):
        return None
    t = cast.args[0]
    if not (isinstance(t, torch.fx.Node) and t.target is aten.t.default):
        return None
    q = t.args[0]
    if mul.target is not aten.mul.Tensor or mul.args[0] is not node or _returned(mul):
        return None
    scale, casts = _scale_source(mul.args[1])
    return x, cast, q, scale, mul, casts


def _scale_source(scale):
    """The constant under a per-row scale's chain of views and casts (`scale.to(m.dtype).flatten()`:
    a bf16 model's fp32 scales are cast), and the casts, from the constant out."""
    casts: list[torch.fx.Node] = []
    while isinstance(scale, torch.fx.Node) and scale.op == "call_function" and scale.target in _SCALE_CHAIN:
        if scale.target is aten._to_copy.default:
            casts.insert(0, scale)
        scale = scale.args[0]
    return scale, casts


def _int8_key(gm, node):
    """What int8 products must share: one input (as for int4), int8 2-D constant weights of one
    width and device, one cast, and per-row scales (a constant of n values) applied after."""
    parts = _int8_parts(gm, node)
    if parts is None:
        return None
    x, cast, q, scale, mul, casts = parts
    w, sv = attr(gm, q), attr(gm, scale)
    if w is None or sv is None or w.dtype != torch.int8 or w.dim() != 2 or sv.numel() != w.shape[0]:
        return None
    mv, pv = mul.meta.get("val"), node.meta.get("val")
    if not (isinstance(mv, torch.Tensor) and isinstance(pv, torch.Tensor) and mv.shape == pv.shape
            and M.get_device(q) == M.get_device(scale) == M.get_device(node)):
        return None  # (a scale that broadcasts the product to another shape is not a per-column one)
    if not _columns_serve(mul, w.shape[0]):
        return None
    return ("int8", _source(x), w.device, w.shape[1], _kwargs_key(cast), sv.dtype, sv.dim(),
            tuple(_kwargs_key(c) for c in casts))


def _source(x):
    """What `x` computes, as a key: the chain of per-product ops (with their arguments) from the
    node they start at."""
    if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target in _PER_PRODUCT):
        return x
    args = tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in x.args[1:])
    return x.target, _source(x.args[0]), args, _kwargs_key(x)


def _kwargs_key(node) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in node.kwargs.items()))


def _stacked(gm, nodes: list, merged: dict, dim: int = 0, keep: bool = True) -> torch.Tensor:
    """The constants `nodes` name, stacked along `dim`: once per set of sources. `keep=False`: not
    remembered (a stack still to be checked); `_remember` keeps it once it passed."""
    key = _stack_key(gm, nodes, dim)
    if key in merged:
        return merged[key][1]
    stacked = torch.cat([attr(gm, n).detach() for n in nodes], dim)
    if keep:
        _remember(gm, nodes, merged, dim, stacked)
    return stacked


def _remember(gm, nodes: list, merged: dict, dim: int, stacked: torch.Tensor) -> None:
    # the sources are kept with it: a tensor made later at a freed address is another
    merged[_stack_key(gm, nodes, dim)] = (tuple(attr(gm, n) for n in nodes), stacked)


def _stack_key(gm, nodes: list, dim: int) -> tuple:
    return (dim, *((t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
                   for t in (attr(gm, n) for n in nodes)))


def _merge_linears(gm, users: list, merged: dict) -> bool:
    first, x = users[0], users[0].args[0]
    weights = [u.args[1] for u in users]
    biases = [u.args[2] if len(u.args) > 2 else u.kwargs.get("bias") for u in users]
    with gm.graph.inserting_before(first):
        w = constant(gm, f"{weights[0].target}_merged", _stacked(gm, weights, merged), weights[0])
        args = [x, w]
        if biases[0] is not None:
            args.append(constant(gm, f"{biases[0].target}_merged", _stacked(gm, biases, merged), biases[0]))
        xv, wv = x.meta["val"], w.meta["val"]
        # the result's value made directly: sizes may be symbolic (a dynamic prompt), which linear's
        # composite kernel cannot take in some torch releases
        with detect_fake_mode([xv, wv]) or contextlib.nullcontext():
            y = call(gm, first, aten.linear.default, tuple(args), xv.new_empty((*xv.shape[:-1], wv.shape[0])))
            _slice_out(gm, users, y, [attr(gm, u.args[1]).shape[0] for u in users])
    return True


def _merge_int4(gm, nodes: list, merged: dict) -> bool:
    first = nodes[0]
    x, packed, group, scales = first.args
    packs, scale_nodes = [n.args[1] for n in nodes], [n.args[3] for n in nodes]
    stacked_packs = _stacked(gm, packs, merged, keep=False)
    stacked_scales = _stacked(gm, scale_nodes, merged, dim=1, keep=False)
    widths = [n.meta["val"].shape[-1] for n in nodes]
    if not _same_products(first.target, x.meta["val"].dtype, [attr(gm, p) for p in packs],
                          [attr(gm, s) for s in scale_nodes], group, stacked_packs, stacked_scales):
        return False  # nothing kept: a refused stack holds no memory past this call
    _remember(gm, packs, merged, 0, stacked_packs)
    _remember(gm, scale_nodes, merged, 1, stacked_scales)
    with gm.graph.inserting_before(first):
        p = constant(gm, f"{packed.target}_merged", stacked_packs, packed)
        s = constant(gm, f"{scales.target}_merged", stacked_scales, scales)
        xv = x.meta["val"]
        with detect_fake_mode([xv]) or contextlib.nullcontext():
            y = call(gm, first, first.target, (x, p, group, s),
                     xv.new_empty((xv.shape[0], sum(widths)), dtype=first.meta["val"].dtype))
            _slice_out(gm, nodes, y, widths)
    return True


def _merge_int8(gm, nodes: list, merged: dict) -> bool:
    first = nodes[0]
    x, cast, q, scale, mul, casts = _int8_parts(gm, first)
    parts = [_int8_parts(gm, n) for n in nodes]
    widths = [attr(gm, p[2]).shape[0] for p in parts]
    weights = _stacked(gm, [p[2] for p in parts], merged)
    scales = _stacked(gm, [p[3] for p in parts], merged)
    xv = x.meta["val"]
    with gm.graph.inserting_before(first), detect_fake_mode([xv]) or contextlib.nullcontext():
        w = constant(gm, f"{q.target}_merged", weights, q)
        s = constant(gm, f"{scale.target}_merged", scales, scale)
        wt = call(gm, cast, aten.t.default, (w,), aten.t.default(w.meta["val"]))
        wf = call(gm, cast, aten._to_copy.default, (wt,), aten._to_copy.default(wt.meta["val"], **cast.kwargs),
                  dict(cast.kwargs))
        product = call(gm, first, aten.mm.default, (x, wf), aten.mm.default(xv, wf.meta["val"]))
        for c in casts:  # as each product cast its own scales
            s = call(gm, c, aten._to_copy.default, (s,), aten._to_copy.default(s.meta["val"], **c.kwargs),
                     dict(c.kwargs))
        row = call(gm, scale, aten.view.default, (s, [sum(widths)]), s.meta["val"].view(sum(widths)))
        y = call(gm, mul, aten.mul.Tensor, (product, row), aten.mul.Tensor(product.meta["val"], row.meta["val"]))
        _slice_out(gm, [p[4] for p in parts], y, widths)
    for node in nodes:
        gm.graph.erase_node(node)
    return True


_MERGES = {"linear": _merge_linears, "int4": _merge_int4, "int8": _merge_int8}


def _same_products(op, dtype, packs: list, scales: list, group: int, stacked_packs, stacked_scales) -> bool:
    """The stacked product of a few random rows equals each separate one, each projection's
    columns to within bf16 rounding of their own largest value (a small projection's columns
    wrong beside a large one's would pass a bound on the whole); False where the op cannot run on
    the constants' device here (the merge is then not made)."""
    try:
        rows = torch.randn(3, scales[0].shape[0] * group, generator=torch.Generator().manual_seed(0))
        rows = rows.to(device=stacked_packs.device, dtype=dtype)
        with torch.no_grad():
            wants = [op(rows, p, group, s).float() for p, s in zip(packs, scales)]
            got = op(rows, stacked_packs, group, stacked_scales).float()
    except (RuntimeError, NotImplementedError):
        return False
    if got.shape != (rows.shape[0], sum(w.shape[-1] for w in wants)):
        return False
    parts = got.split([w.shape[-1] for w in wants], -1)
    return all(bool((g - w).abs().max() <= 2 ** -7 * w.abs().max().clamp_min(1e-6)) for g, w in zip(parts, wants))


def _slice_out(gm, nodes: list, y, widths: list[int]) -> None:
    """Each of `nodes` replaced by its columns of `y`, in order."""
    start = 0
    for node, width in zip(nodes, widths):
        part = call(gm, node, aten.slice.Tensor, (y, -1, start, start + width),
                    aten.slice.Tensor(y.meta["val"], -1, start, start + width))
        start += width
        node.replace_all_uses_with(part)
        _revalue_views(part)
    for node in nodes:
        gm.graph.erase_node(node)


def _revalue_views(node) -> None:
    """The views that read `node` (and the views of those) valued again: their strides are the
    slice's now, and later rewrites read them (a view one adds must fit the strides it will meet)."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    views, todo = set(), [node]
    while todo:
        for u in todo.pop().users:
            if u not in views and isinstance(u.target, torch._ops.OpOverload) and is_view(u.target):
                views.add(u)
                todo.append(u)
    for view in sorted(views, key=order.__getitem__):
        try:
            set_value(view, value_of(view))
        except (RuntimeError, TypeError):  # sizes given as nodes (dynamic): left as traced
            continue
