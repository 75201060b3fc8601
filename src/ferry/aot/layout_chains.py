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

`slices_copied_once`: a permuted tensor whose slices along its first dim are each copied before
use (by a `clone`, or by `matmul`, which copies an operand it cannot view as a batch of matrices)
is copied once, so its slices are contiguous and those copies no longer happen (aot/fuse.py then
drops the clones that keep the layout).

Both move the same bits as eager (copies only, no arithmetic); static sizes only.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ferry.choices.graph_edits import Rewrite, call, constant

__all__ = ["ON", "chains_as_gathers", "slices_copied_once"]

aten = torch.ops.aten
ON = True  # off: every chain runs as traced (an A/B: bench/profile_graphs.py --layout-chains off)

# kernels each op of a chain launches on its own (a roll launches one per rolled dim)
_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.permute.default, aten.transpose.int,
                    aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                    aten.slice.Tensor, aten.select.int, aten.expand.default, aten.alias.default,
                    aten.detach.default, aten.narrow.default})
_COPIES = frozenset({aten.clone.default, aten.contiguous.default, aten.roll.default, aten.flip.default,
                     aten.pad.default, aten.constant_pad_nd.default})
_MOVES = _VIEWS | _COPIES
_MAX_INDEX_BYTES = 1 << 20  # the largest index a gather may store (a run of 4 bytes per 1 KiB moved at the least)
# elementwise ops with one tensor operand: their result keeps the operand's layout, so a copy after them is the
# copy of their operand
_KEEPS_LAYOUT = frozenset({aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.mul.Scalar,
                           aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.neg.default})


def _static(val) -> bool:
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in (*val.shape, *val.stride()))


def _kernels(node: torch.fx.Node) -> int | None:
    """Kernels `node` launches as one op of a chain, or None where it is not pure data movement."""
    if node.op != "call_function" or node.target not in _MOVES:
        return None
    if node.target in _VIEWS:
        return 0
    if node.target is aten.roll.default:
        dims: Any = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
        return max(1, len(dims))
    if node.target in (aten.pad.default, aten.constant_pad_nd.default):
        pads: Any = node.args[1]
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        return 1 if all(p == 0 for p in pads) and mode == "constant" else None
    return 1


def _chain_from(start: torch.fx.Node) -> list[torch.fx.Node]:
    """The data movement from `start`'s input: `start`, then each op the one before alone reads."""
    chain = [start]
    while True:
        users = list(chain[-1].users)
        if len(users) != 1 or _kernels(users[0]) is None or users[0].args[0] is not chain[-1]:
            return chain
        chain.append(users[0])


def _starts(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """First ops of chains: data movement reading a value that is not itself read by a chain's op alone."""
    out = []
    for node in gm.graph.nodes:
        if _kernels(node) is None or not isinstance(node.args[0], torch.fx.Node):
            continue
        src = node.args[0]
        if _kernels(src) is not None and len(src.users) == 1:
            continue  # inside a chain
        out.append(node)
    return out


def _positions(chain: list[torch.fx.Node], src_val: torch.Tensor) -> list[torch.Tensor]:
    """Each chain op's result computed on the positions of the source's elements."""
    t = torch.arange(src_val.numel(), dtype=torch.int64).view(tuple(src_val.shape))
    out = []
    for node in chain:
        op: Any = node.target
        t = t.clone() if op in (aten.pad.default, aten.constant_pad_nd.default) else op(t, *node.args[1:], **node.kwargs)
        out.append(t)
    return out


def _run(z: torch.Tensor, src_val: torch.Tensor) -> int | None:
    """The longest trailing run of the source's elements that `z` (positions, in its order) keeps
    whole and in place within the run; None where not even one row of the last dim stays whole."""
    flat = z.reshape(-1)
    best = None
    run = 1
    for size in reversed(src_val.shape):
        run *= int(size)
        if flat.numel() % run:
            break
        rows = flat.view(-1, run)
        if not bool((rows[:, 0] % run == 0).all()) or not bool((rows == rows[:, :1] + torch.arange(run)).all()):
            break
        best = run
    return best


def _replacement(gm, end: torch.fx.Node, src: torch.fx.Node, z: torch.Tensor, run: int, stored: dict):
    """`src`'s runs gathered in the order `z` takes them, shaped as `end`'s result."""
    src_val, val = src.meta["val"], end.meta["val"]
    flat = call(gm, end, aten.view.default, (src, [-1, run]), src_val.view(-1, run))
    rows = (z.reshape(-1, run)[:, 0] // run).to(torch.int32)
    key = tuple(rows.tolist())
    if key not in stored:
        stored[key] = constant(gm, f"_rows_{end.name}", rows, src)
    gathered_val = src_val.new_empty((rows.numel(), run))
    gathered = call(gm, end, aten.index_select.default, (flat, 0, stored[key]), gathered_val)
    return call(gm, end, aten.view.default, (gathered, list(val.shape)), gathered_val.view(val.shape))


def chains_as_gathers(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """Rewrite each chain of data movement that launches more kernels than a view (none) or one
    gather of whole runs (one) would; return what was done."""
    done: list[Rewrite] = []
    stored: dict = {}
    for start in _starts(gm) if ON else ():
        src = start.args[0]
        assert isinstance(src, torch.fx.Node)
        found = _cheapest_end(src, _chain_from(start))
        if found is None:
            continue
        end, z, run = found
        with gm.graph.inserting_before(end):
            if run is None:
                shape = list(end.meta["val"].shape)
                new = call(gm, end, aten.view.default, (src, shape), src.meta["val"].view(shape))
            else:
                new = _replacement(gm, end, src, z, run, stored)
        end.replace_all_uses_with(new)
        done.append(Rewrite("chain as view" if run is None else "chain as gather", end.name))
    return done


def _cheapest_end(src: torch.fx.Node, chain: list[torch.fx.Node]):
    """(end, positions, run) for the op of `chain` whose result a view of `src` (run None) or one
    gather of its runs gives with the most kernels saved; None where none saves any."""
    src_val: Any = src.meta.get("val")
    if src.op == "get_attr" or not (_static(src_val) and src_val.is_contiguous() and src_val.numel() > 0):
        return None  # (a chain of constants alone is folded: aot/constant_fold.py)
    if not all(_static(n.meta.get("val")) for n in chain):
        return None
    best, most, kernels = None, 0, 0
    for node, z in zip(chain, _positions(chain, src_val), strict=True):
        kernels += _kernels(node) or 0
        if not node.meta["val"].is_contiguous() or any(u.op == "output" for u in node.users):
            continue  # (a returned value owns its memory)
        if z.numel() == src_val.numel() and bool((z.reshape(-1) == torch.arange(z.numel())).all()):
            run, cost = None, 0
        else:
            run, cost = _run(z, src_val), 1
            if run is None or 4 * z.numel() // run > _MAX_INDEX_BYTES:
                continue
        if kernels - cost > most:
            best, most = (node, z, run), kernels - cost
    return best


def _slices(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The slices of `node` along dim 0 its readers take (select(0, i) or unbind(0) items), or None
    where something else reads it."""
    out = []
    for u in node.users:
        if u.target is aten.select.int and u.args[0] is node and u.args[1] == 0:
            out.append(u)
        elif u.target is aten.unbind.int and (u.args[1] if len(u.args) > 1 else 0) == 0:
            items = list(u.users)
            if not all(i.target is operator.getitem for i in items):
                return None
            out.extend(items)
        else:
            return None
    return out


def _copied(view: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
    """Where the slice `view` is copied before use: the nodes on its way (elementwise ops with
    scalars, transposes) and the ops that copy it (a clone, or a matmul that cannot view it as a
    batch of matrices); None where it is read any other way."""
    path, ends, frontier = [], [], [view]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            t = u.target
            if t is aten.clone.default and u.args[0] is n:
                ends.append(u)
            elif t is aten.matmul.default and _matmul_copies(n.meta["val"]):
                ends.append(u)
            elif t in (aten.transpose.int, aten.t.default) or (
                    t in _KEEPS_LAYOUT and u.args[0] is n and not any(isinstance(a, torch.fx.Node) for a in u.args[1:])):
                path.append(u)
                frontier.append(u)
            else:
                return None
    return (path, ends) if ends else None


def _matmul_copies(val) -> bool:
    """`matmul` copies a batched operand it cannot view as [batch, rows, cols]."""
    if not _static(val) or val.dim() < 3:
        return False
    try:
        val.view(-1, val.shape[-2], val.shape[-1])
    except (RuntimeError, ValueError):  # (fake tensors raise the latter)
        return True
    return False


def slices_copied_once(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """Copy once a non-contiguous tensor whose slices are each copied (at least two copies saved)."""
    done = []
    for node in list(gm.graph.nodes) if ON else ():
        val = node.meta.get("val")
        if node.op != "call_function" or not _static(val) or val.is_contiguous() or val.dim() < 2:
            continue
        slices = _slices(node) or []
        walks = [w for w in (_copied(s) for s in slices) if w is not None]
        if len(walks) < 2 or len(walks) < len(slices):
            continue
        readers = list(node.users)
        with gm.graph.inserting_after(node):
            copy = call(gm, node, aten.clone.default, (node,), val.contiguous(),
                        {"memory_format": torch.contiguous_format})
        for u in readers:
            u.replace_input_with(node, copy)
        changed = {*readers, *slices, *(n for path, _ in walks for n in path)}
        for n in gm.graph.nodes:
            if n in changed:
                _revalue(n)
        done.append(Rewrite("slices copied once", node.name))
    return done


def _revalue(n: torch.fx.Node) -> None:
    """`n`'s value again from its arguments' (the layout of what it reads changed)."""
    args: Any = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in n.args]
    op: Any = n.target
    n.meta["val"] = args[0][args[1]] if op is operator.getitem else op(*args, **n.kwargs)
    if isinstance(n.meta["val"], torch.Tensor):
        n.meta["tensor_meta"] = _extract_tensor_metadata(n.meta["val"])
