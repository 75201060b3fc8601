"""Work a delegate would repeat on every call although its result never changes, done once at
compile time: a value computed from constants alone (weights, lifted tensors, sizes export
fixed) is computed here and becomes a constant of the program.

torchvision's Swin Transformer builds each shifted window's attention mask on every call from
zeros, nine slice fills and a few comparisons (about 30 kernels per shifted block in the traced
graph), and each block's relative position bias by gathering its table (two more): eager and
`torch.compile` run them on every call; after the fold they are constants read in place.

Only ops whose result has the same bits on every device are computed (`EXACT`: data movement,
indexing, fills, comparisons, casts, +, -, * and / of two values, min and max), so a folded
constant equals what eager computes on the GPU; a value needing a reduction or a transcendental
function is left to run time, where its rounding is the device's own. Nothing random, nothing
of a dynamic size, nothing a method returns (its caller may write into it) is folded. A view
read at run time is kept as a view of its folded base (an `expand` stays a view, not a copy).
A folded value adds memory for the module's life where eager's lasted one call, so each is at
most MAX_TENSOR_BYTES, no larger than the constants it reads unless it is at most GROWTH_BYTES, and
never a weight cast to a wider dtype (a quantized weight stays quantized), and all of a graph's at most
MAX_TOTAL_BYTES plus 1/16 of its constants; equal values are stored once.
"""

from __future__ import annotations

import torch
import torch.fx

from ferry import node_meta as M
from ferry.choices.graph_edits import Rewrite, attr, constant, constant_value, reads_metadata_only
from ferry.ops.aliasing import is_view, view_source

__all__ = ["EXACT", "GROWTH_BYTES", "MAX_TENSOR_BYTES", "MAX_TOTAL_BYTES", "fold_constants"]

aten = torch.ops.aten
MAX_TENSOR_BYTES = 16 << 20
MAX_TOTAL_BYTES = 16 << 20
GROWTH_BYTES = 1 << 20  # a folded value larger than the constants it reads (a weight cast wider) is at most this

# ops that return a view of their first argument: a folded value read through one stays a view
_VIEWS = frozenset({aten.view, aten._unsafe_view, aten.permute, aten.transpose, aten.t, aten.expand,
                    aten.unsqueeze, aten.squeeze, aten.slice, aten.select, aten.narrow, aten.alias, aten.detach,
                    aten.as_strided, aten.unfold, aten.diagonal, aten.view_as_real, aten.view_as_complex})
# ops whose result is the same bits on every device (no reduction, no transcendental function)
EXACT = _VIEWS | frozenset({
    aten.reshape, aten.clone, aten.contiguous, aten.lift_fresh_copy, aten._to_copy, aten._unsafe_view,
    aten.index, aten.index_select, aten.gather, aten.embedding, aten.cat, aten.stack, aten.flip, aten.roll,
    aten.repeat, aten.slice_scatter, aten.select_scatter, aten.fill, aten.masked_fill, aten.where,
    aten.zeros, aten.ones, aten.full, aten.scalar_tensor, aten.zeros_like, aten.ones_like, aten.full_like,
    aten.new_zeros, aten.new_ones, aten.new_full, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge,
    aten.logical_and, aten.logical_or, aten.logical_not, aten.logical_xor, aten.bitwise_and, aten.bitwise_or,
    aten.bitwise_xor, aten.bitwise_not, aten.neg, aten.abs, aten.sign, aten.mul, aten.div, aten.maximum,
    aten.minimum, aten.clamp, aten.clamp_min, aten.clamp_max, aten.floor, aten.ceil, aten.round, aten.trunc,
    aten.tril, aten.triu, aten.add, aten.sub, aten.arange,
})


def fold_constants(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """Replace each value `gm` computes from constants alone, where a node that is not folded
    reads it, by a constant holding it; the ops only it read are erased by aot/fuse.py's tidy."""
    folded = _foldable(gm)
    budget = MAX_TOTAL_BYTES + _constant_bytes(gm) // 16
    stored: list[tuple[torch.Tensor, str]] = []
    done = []
    for base in _bases(folded):
        val = base.meta["val"]
        nbytes = val.numel() * val.element_size()
        if nbytes > MAX_TENSOR_BYTES or nbytes > max(_read_bytes(gm, base, folded), GROWTH_BYTES):
            continue
        value = constant_value(gm, base, {}, {}, admit=_exact)
        value = None if value is None else _laid_out(value, val)
        if value is None:
            continue
        target = next((t for v, t in stored if _same(v, value)), None)
        size = value.untyped_storage().nbytes()
        if target is None and size > budget:
            continue
        with gm.graph.inserting_before(base):
            if target is None:
                budget -= size
                node = constant(gm, f"_folded_{base.name}", value, base)
                stored.append((value, str(node.target)))
            else:
                node = gm.graph.get_attr(target)
                device = M.get_device(base)
                if device is not None:
                    M.set_device(node, device)
        node.meta["val"] = val
        base.replace_all_uses_with(node)
        done.append(Rewrite("constants folded", base.name))
    return done


def _foldable(gm) -> set:
    """The nodes computed from constants alone by ops of EXACT at static sizes, none of them
    returned or viewed by what is returned."""
    returned = _returned(gm)
    folded: set = set()
    for node in gm.graph.nodes:
        if node in returned or node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        val = node.meta.get("val")
        if not _exact(node) or not isinstance(val, torch.Tensor) or _symbolic(node, val):
            continue
        if all(a in folded or (a.op == "get_attr" and attr(gm, a) is not None) or reads_metadata_only(node, a)
               for a in node.all_input_nodes):
            folded.add(node)
    return folded


def _returned(gm) -> set:
    """What a method returns and every value it is a view of (its caller may write into it)."""
    out = set()
    for node in gm.graph.nodes:
        if node.op != "output":
            continue
        for v in node.all_input_nodes:
            while isinstance(v, torch.fx.Node) and v not in out:
                out.add(v)
                op = v.target if v.op == "call_function" and isinstance(v.target, torch._ops.OpOverload) else None
                v = v.args[view_source(op)] if op is not None and is_view(op) else None
    return out


def _symbolic(node: torch.fx.Node, val: torch.Tensor) -> bool:
    sizes = [*val.shape, *val.stride(), *torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: a)]
    flat = torch.utils._pytree.tree_leaves(sizes)
    return any(isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)) for s in flat)
def _exact(node: torch.fx.Node) -> bool:
    """An op of EXACT whose arguments keep it exact: CUDA divides a tensor by a number as a
    multiplication by its reciprocal, sums `a + alpha * b` in one rounding where the CPU may
    take two, computes a float `arange` in other precision, and casts a float out of an
    integer's range to another value. A cast to a wider dtype is not folded either: it would
    store a weight the model keeps narrow (int8, bf16) at its wider size."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in EXACT:
        return False
    val = node.meta.get("val")
    if packet in _ARITHMETIC:
        return bool(node.kwargs.get("alpha", 1) == 1) and _same_rounding(node, val)
    if packet is aten.div:
        return node.kwargs.get("rounding_mode") is not None and isinstance(val, torch.Tensor) and not (
            val.dtype.is_floating_point or any(_floating(a) for a in node.all_input_nodes))  # type: ignore[return-value]
    if packet is aten.round:
        return bool(node.kwargs.get("decimals", 0) == 0) and len(node.args) == 1  # decimals: scaled, rounded, back
    if packet is aten.arange:
        ints = [a for a in node.args if type(a) is int]
        return len(ints) == len(node.args) and isinstance(val, torch.Tensor) and (
            not val.dtype.is_floating_point or (val.dtype in (torch.float32, torch.float64)
                                                and max((abs(a) for a in ints), default=0) <= 1 << 24))
    if packet is aten._to_copy:
        source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(source, torch.Tensor) and isinstance(val, torch.Tensor) and val.element_size() > \
                source.element_size():
            return False  # widened: the model stores the narrow one (a quantized weight), so must ferry
        return not (isinstance(val, torch.Tensor) and not val.dtype.is_floating_point and _floating(node.args[0]))
    return True


_ARITHMETIC = frozenset({aten.add, aten.sub, aten.mul, aten.abs, aten.sign})
_HALF = (torch.float16, torch.bfloat16)


def _same_rounding(node: torch.fx.Node, val) -> bool:
    """Arithmetic the CPU rounds as CUDA does. Not complex (CUDA contracts a*c - b*d into one
    fused multiply-add); in half precision only between tensors of the result's dtype: CUDA
    computes `w + 0.1` with 0.1 as a float, the CPU rounds it to the half type first, and a 0-dim
    float buffer is a float scalar to the CPU but a half-cast tensor to CUDA."""
    if not isinstance(val, torch.Tensor) or val.dtype.is_complex:
        return False
    if val.dtype not in _HALF:
        return True
    operands = [a for a in node.args if not isinstance(a, (list, tuple))]
    return all(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
               and a.meta["val"].dtype == val.dtype and a.meta["val"].dim() > 0 for a in operands)


def _floating(node) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)


def _bases(folded: set) -> list[torch.fx.Node]:
    """The nodes to store, in graph order: each folded value a node outside the fold reads, or
    where it is a view of another folded value, the first of its chain that is not a view."""
    bases: dict[torch.fx.Node, None] = {}
    for node in folded:
        if all(u in folded for u in node.users):
            continue
        base = node
        while base.target.overloadpacket in _VIEWS and base.args[0] in folded:
            base = base.args[0]
        if base.target.overloadpacket not in _VIEWS:  # a view of a weight itself: nothing to compute
            bases[base] = None
    order = {n: i for i, n in enumerate(next(iter(folded)).graph.nodes)} if folded else {}
    return sorted(bases, key=order.__getitem__)


def _laid_out(value: torch.Tensor, val: torch.Tensor) -> torch.Tensor | None:
    """`value` with the traced strides (the plan's readers expect them), in memory of its own."""
    if tuple(value.shape) != tuple(val.shape) or value.dtype != val.dtype:
        return None
    out = torch.empty_strided(tuple(val.shape), val.stride(), dtype=val.dtype)
    if out.untyped_storage().nbytes() != out.numel() * out.element_size():
        return None  # overlapping or with gaps: not a tensor of its own
    return out.copy_(value)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits in the same layout (so -0.0 is not 0.0, and a NaN equals itself)."""
    if (a.dtype, a.shape, a.stride()) != (b.dtype, b.shape, b.stride()):
        return False
    return bool(torch.equal(_bits(a), _bits(b)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _read_bytes(gm, base: torch.fx.Node, folded: set) -> int:
    """The bytes of the constants `base` is computed from."""
    seen, todo = {base}, [base]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen and (a in folded or a.op == "get_attr"):
                seen.add(a)
                todo.append(a)
    return _constant_bytes(gm, [n for n in seen if n.op == "get_attr"])


def _constant_bytes(gm, nodes=None) -> int:
    """The bytes of the constants get_attr `nodes` name (default: all of `gm`'s), each storage once."""
    seen = {}
    for node in gm.graph.nodes if nodes is None else nodes:
        t = attr(gm, node) if node.op == "get_attr" else None
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
