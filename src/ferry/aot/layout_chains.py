"""Data movement a traced graph spells as several copies, done as one copy or none.

Export writes a change of layout as a chain of ops, and a torch-backend delegate runs each copy
in it as a kernel (~2 µs each at Swin-T's sizes on an H100, where the whole model is ~1.5 ms):

- torchvision's Swin partitions windows with a roll over two dims (two kernels), a view, a
  permute and a contiguous copy, and puts them back the same way after attention: three kernels
  each way where one gather of rows does the same;
- it takes q, k and v from one projection through a permute, and each of the three is then copied
  before its product (q explicitly, k and v inside `matmul`): one copy of the permuted projection
  makes all three contiguous.

`chains_as_gathers`: a chain of data movement from one contiguous tensor (views, permutes,
rolls, slices, selects, copies, each read only by the next) is evaluated at compile time on the
positions of the tensor's elements. Where its result is the tensor itself reshaped, it becomes a
view; where it moves runs of elements that stay whole (a row of channels), one `index_select`
of those runs, the runs' positions a constant of the program. Taken only where it launches fewer
kernels than the chain.

`slices_copied_once`: a permuted tensor whose slices along its first dim are all copied before
use (by a `clone` that changes their layout, or by `matmul`, which copies an operand it cannot
view as a batch of matrices) is copied once, where that saves at least two copies: its slices are
then contiguous, and each of those copies is either gone or keeps the layout (aot/fuse.py drops
such clones).

Both move the same bits as eager (copies only, no arithmetic); static sizes only.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from ferry.choices.graph_edits import Rewrite, call, constant, set_value, static_value, value_of, viewable

__all__ = ["ON", "chains_as_gathers", "slices_copied_once"]

aten = torch.ops.aten
ON = True  # off: every chain runs as traced (an A/B: bench/profile_graphs.py --layout-chains off)
MAX_ELEMENTS = 1 << 23  # the largest source whose positions are worked out (8M: 64 MiB of int64 per step)

_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.permute.default, aten.transpose.int,
                    aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                    aten.slice.Tensor, aten.select.int, aten.expand.default, aten.alias.default,
                    aten.detach.default, aten.narrow.default})
_COPIES = frozenset({aten.clone.default, aten.roll.default, aten.flip.default, aten.pad.default,
                     aten.constant_pad_nd.default})
_PADS = (aten.pad.default, aten.constant_pad_nd.default)
# readers whose elements do not depend on their input's layout, besides pointwise ops
_LAYOUT_FREE = frozenset({aten.layer_norm.default, aten.native_layer_norm.default})
_RESHAPES = (aten.view.default, aten._unsafe_view.default)
# elementwise ops of one tensor operand: the result is dense, laid out in the operand's order of strides
_ELEMENTWISE = frozenset({aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.mul.Scalar,
                          aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.neg.default})


def _kernels(node: torch.fx.Node) -> int | None:
    """Kernels `node` launches as one op of a chain (a roll: one per rolled dim), or None where it
    is not pure data movement of its first argument alone (another tensor or a size it reads)."""
    if node.op != "call_function" or node.target not in _VIEWS | _COPIES or len(node.all_input_nodes) != 1:
        return None
    if not isinstance(node.args[0], torch.fx.Node):
        return None
    if node.target in _VIEWS:
        return 0
    if node.target is aten.roll.default:
        dims: Any = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
        return max(1, len(dims))
    if node.target in _PADS:
        pads: Any = node.args[1]
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        return 1 if mode == "constant" and all(p == 0 for p in pads) else None
    return 1


def _chains(gm: torch.fx.GraphModule) -> Iterator[list[torch.fx.Node]]:
    """Each maximal chain: data movement from a value, then each op that alone reads the one before."""
    for node in list(gm.graph.nodes):
        src: Any = node.args[0] if node.op == "call_function" and node.args else None
        if _kernels(node) is None or (_kernels(src) is not None and len(src.users) == 1):
            continue  # (not data movement, or inside a chain begun before it)
        chain = [node]
        while len(chain[-1].users) == 1:
            nxt = next(iter(chain[-1].users))
            if _kernels(nxt) is None or nxt.args[0] is not chain[-1]:
                break
            chain.append(nxt)
        yield chain


def _positions(chain: list[torch.fx.Node], src_val: torch.Tensor) -> Iterator[torch.Tensor]:
    """Each chain op's result computed on the positions of the source's elements (only values
    matter here: a view is a reshape)."""
    t = torch.arange(src_val.numel(), dtype=torch.int64).view(tuple(src_val.shape))
    for node in chain:
        op: Any = node.target
        if op in _PADS:
            t = t.clone()  # (a pad of nothing)
        elif op in _RESHAPES:
            t = t.reshape(node.args[1])  # type: ignore[arg-type]
        else:
            t = op(t, *node.args[1:], **node.kwargs)
        yield t


def _run(z: torch.Tensor, src_val: torch.Tensor) -> int | None:
    """The longest trailing run of the source's elements that `z` (positions, in its order) keeps
    whole and in order; None where not even a row of the last dim stays whole."""
    flat, best, run = z.reshape(-1), None, 1
    for size in reversed(src_val.shape):
        run *= int(size)
        if flat.numel() % run:
            break
        rows = flat.view(-1, run)
        if not bool((rows[:, 0] % run == 0).all()) or not bool((rows == rows[:, :1] + torch.arange(run)).all()):
            break
        best = run
    return best


def _cheapest_end(src: torch.fx.Node, chain: list[torch.fx.Node]):
    """(end, positions, run) for the op of `chain` whose result a view of `src` (run None) or one
    gather of its runs gives with the most kernels saved; None where none saves any."""
    src_val: Any = src.meta.get("val")
    if src.op == "get_attr" or not (static_value(src_val) and src_val.is_contiguous() and 0 < src_val.numel() <= MAX_ELEMENTS):
        return None  # (a chain of constants alone is folded: aot/constant_fold.py)
    if sum(_kernels(n) or 0 for n in chain) == 0 or not all(static_value(n.meta.get("val")) for n in chain):
        return None
    best: tuple[torch.fx.Node, torch.Tensor, int | None] | None = None
    most = kernels = 0
    for node, z in zip(chain, _positions(chain, src_val), strict=True):
        kernels += _kernels(node) or 0
        val = node.meta["val"]
        if kernels <= most or any(u.op == "output" for u in node.users):
            continue  # (a returned value owns its memory)
        if z.numel() == src_val.numel() and bool((z.reshape(-1) == torch.arange(z.numel())).all()):
            if val.is_contiguous() or _readers_unchanged(node, src_val.view(val.shape)):
                best, most = (node, z, None), kernels
        elif val.is_contiguous() and kernels > 1 + most and (run := _run(z, src_val)) is not None:
            best, most = (node, z, run), kernels - 1
    return best


def _readers_unchanged(node: torch.fx.Node, new_val: torch.Tensor) -> bool:
    """Whether every op reading `node` gives the same result reading `new_val` in its place: an op
    whose elements do not depend on its input's layout (pointwise, or a layer norm, which copies
    a permuted input contiguous first; not a reduction, whose order of summing follows the
    strides, nor an op reading memory by offsets) with the same value (shape, layout, dtype).
    Swin's patch embedding copies its output to channels-first and permutes it back for a layer
    norm, whose result is contiguous either way."""
    for u in node.users:
        tags = getattr(u.target, "tags", ())
        if u.target not in _LAYOUT_FREE and torch.Tag.pointwise not in tags:
            return False
        old = u.meta.get("val")
        try:
            new = value_of(u, {node: new_val})
        except Exception:  # noqa: BLE001 - an op that cannot say: left as traced
            return False
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and new.dtype == old.dtype
                and tuple(new.shape) == tuple(old.shape) and new.stride() == old.stride()):
            return False
    return True


def _gathered(gm, end: torch.fx.Node, src: torch.fx.Node, z: torch.Tensor, run: int, rows_at) -> torch.fx.Node:
    """`src`'s runs of `run` elements gathered in the order `z` takes them, shaped as `end`'s result."""
    src_val, val = src.meta["val"], end.meta["val"]
    flat = call(gm, end, aten.view.default, (src, [-1, run]), src_val.view(-1, run))
    rows = z.reshape(-1, run)[:, 0] // run
    index = rows_at(rows.to(torch.int32 if src_val.numel() // run < 2**31 else torch.int64), src)
    gathered_val = src_val.new_empty((rows.numel(), run))
    gathered = call(gm, end, aten.index_select.default, (flat, 0, index), gathered_val)
    return call(gm, end, aten.view.default, (gathered, list(val.shape)), gathered_val.view(val.shape))


def _rows_constants(gm: torch.fx.GraphModule):
    """Row orders as constants of `gm`, each stored once, defined before any op reads one."""
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    stored: dict[tuple, torch.fx.Node] = {}

    def rows_at(rows: torch.Tensor, like: torch.fx.Node) -> torch.fx.Node:
        key = (rows.dtype, tuple(rows.tolist()))
        if key not in stored:
            with gm.graph.inserting_before(first):
                stored[key] = constant(gm, "_rows", rows, like)
        return stored[key]

    return rows_at


def chains_as_gathers(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """Rewrite each chain of data movement that launches more kernels than a view (none) or one
    gather of whole runs (one) would; return what was done."""
    done: list[Rewrite] = []
    rows_at = _rows_constants(gm)
    for chain in _chains(gm) if ON else ():
        src = chain[0].args[0]
        assert isinstance(src, torch.fx.Node)
        found = _cheapest_end(src, chain)
        if found is None:
            continue
        end, z, run = found
        with gm.graph.inserting_before(end):
            if run is None:
                shape = list(end.meta["val"].shape)
                new = call(gm, end, aten.view.default, (src, shape), src.meta["val"].view(shape))
            else:
                new = _gathered(gm, end, src, z, run, rows_at)
        end.replace_all_uses_with(new)
        done.append(Rewrite("chain as view" if run is None else "chain as gather", end.name))
    return done


# ---------------------------------------------------------------- slices copied once


def _slices(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """Every slice of `node` along dim 0 (select(0, i) for each i, or unbind(0)'s items) where
    nothing else reads it; else None."""
    out, indices = [], set()
    for u in node.users:
        if u.target is aten.select.int and u.args[0] is node and u.args[1] == 0:
            out.append(u)
            indices.add(u.args[2])
        elif u.target is aten.unbind.int and (u.args[1] if len(u.args) > 1 else 0) == 0:
            if not all(i.target is operator.getitem for i in u.users):
                return None
            out.extend(u.users)
            indices.update(i.args[1] for i in u.users)
        else:
            return None
    n = node.meta["val"].shape[0]
    return out if {i % n for i in indices if isinstance(i, int)} == set(range(n)) else None


def _walk(view: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
    """The ops that carry the slice `view` to where it is copied (elementwise ops with scalars,
    transposes) and the ops that copy it (clones, matmuls); None where it is read any other way."""
    path, ends, frontier = [], [], [view]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.target in (aten.clone.default, aten.matmul.default):
                ends.append(u)
            elif u.target in (aten.transpose.int, aten.t.default) or (u.target in _ELEMENTWISE and u.args[0] is n
                                                                       and len(u.all_input_nodes) == 1):
                path.append(u)
                frontier.append(u)
            else:
                return None
    return path, ends


def _copies(end: torch.fx.Node, vals: dict) -> bool:
    """Whether `end` copies what it reads, given the values in `vals` (else the nodes' own)."""
    def val(n):
        return vals.get(n, n.meta.get("val"))

    if end.target is aten.clone.default:
        x = end.args[0]
        return any(u.op == "output" for u in end.users) or val(end).stride() != val(x).stride()
    return any(_matmul_copies(val(a)) for a in end.args[:2] if isinstance(a, torch.fx.Node))


def _matmul_copies(val) -> bool:
    """`matmul` copies a batched operand it cannot view as [batch, rows, cols]."""
    return static_value(val) and val.dim() >= 3 and not viewable(val, (-1, val.shape[-2], val.shape[-1]))


def _values_after_copy(node: torch.fx.Node, copy_val, slices, walks) -> dict | None:
    """The values the slices, the ops on their way and the copying ops take once `node` is copied
    (contiguous); None where a copying op's own value would change or fewer than two copies go."""
    vals: dict = {node: copy_val}
    readers = {s.args[0] for s in slices if s.target is operator.getitem}
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    changed = sorted({*readers, *slices, *(n for path, _ in walks for n in path)}, key=order.__getitem__)
    for n in changed:
        vals[n] = value_of(n, vals)
    ends = {e for _, es in walks for e in es}
    saved = 0
    for e in ends:
        after = value_of(e, vals)
        if tuple(after.shape) != tuple(e.meta["val"].shape) or after.stride() != e.meta["val"].stride():
            return None
        saved += _copies(e, {}) and not _copies(e, {**vals, e: after})
    return vals if saved >= 2 else None


def slices_copied_once(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """Copy once a non-contiguous tensor whose slices are each copied (at least two copies saved)."""
    done = []
    for node in list(gm.graph.nodes) if ON else ():
        val = node.meta.get("val")
        if node.op != "call_function" or not static_value(val) or val.is_contiguous() or val.dim() < 2:
            continue
        slices = _slices(node)
        walks = [w for w in map(_walk, slices or ()) if w is not None]
        if not slices or len(walks) < len(slices):
            continue
        vals = _values_after_copy(node, val.contiguous(), slices, walks)
        if vals is None:
            continue
        readers = list(node.users)
        with gm.graph.inserting_after(node):
            copy = call(gm, node, aten.clone.default, (node,), vals.pop(node),
                        {"memory_format": torch.contiguous_format})
        for u in readers:
            u.replace_input_with(node, copy)
        for n, v in vals.items():
            set_value(n, v)
        done.append(Rewrite("slices copied once", node.name))
    return done
