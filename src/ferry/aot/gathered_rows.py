"""A table computed from weights row by row and then gathered (`embedding`, `index_select` of
rows) is computed only for the rows gathered; a table of 4-bit integers is stored two to a byte.

A quantized embedding (torchao's `IntxWeightOnlyConfig`, ExecuTorch's `--qembedding`) reaches
ferry as int8 data, scales and zero points, dequantized into the whole table, from which
`embedding` then picks a few rows: a decode step of a 128k-token vocabulary dequantized 262 M
numbers to read 2,048. Every op between the weights and the gather works row by row (views
that keep the first dimension, elementwise ops whose other operands have no row dimension),
so gathering the rows of each weight first and running the same ops on them gives the same
numbers, bit for bit, at the cost of the rows read.

int4 data arrives one value per int8 byte (torchao keeps it unpacked for this format). Where
such a weight is only gathered, its values are stored two to a byte and unpacked after the
gather (a mask, a shift and a sign fix on the rows read): the file and the device hold half.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import cast

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.export.graph_signature import InputKind

from ferry.choices.graph_edits import Rewrite

__all__ = ["gather_rows_first"]

aten = torch.ops.aten

_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
_ELEMENTWISE = frozenset({
    aten._to_copy.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar,
    aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.clamp.default, aten.round.default,
    aten.bitwise_and.Scalar, aten.bitwise_right_shift.Tensor_Scalar, aten.bitwise_xor.Scalar,
})
_WEIGHTS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def gather_rows_first(ep: torch.export.ExportedProgram, state=frozenset()) -> list[Rewrite]:
    """Rewrite `ep` (functional ATen, after decomposition) in place; return what was done.
    `state`: buffers another method updates, left as they are."""
    fake_mode = detect_fake_mode([n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"])
    if fake_mode is None:
        return []
    weights = _weight_tensors(ep, state)
    done = []
    for node in list(ep.graph.nodes):
        table, ids = _gather(node)
        chain = _row_chain(table, weights) if table is not None else None
        if chain is not None:
            _rewrite(ep, node, ids, chain, weights, fake_mode)
            done.append(Rewrite("rows gathered first", node.name))
    if done:
        ep.graph_module.recompile()
    return done


def _gather(node: torch.fx.Node) -> tuple:
    """(table, indices) of a gather of whole rows: `embedding(table, ids)` or
    `index_select(table, 0, ids)`; else (None, None)."""
    if node.op != "call_function":
        return None, None
    if node.target is aten.embedding.default:
        return node.args[0], node.args[1]
    if node.target is aten.index_select.default and node.args[1] == 0:
        return node.args[0], node.args[2]
    return None, None


def _weight_tensors(ep, state) -> dict[torch.fx.Node, tuple[str, torch.Tensor, bool]]:
    """{placeholder: (target, tensor, may be packed)} of the weights, constants and buffers this
    method does not update; a buffer in `state` (another method compiled with this one updates it)
    is read as it is then, never packed."""
    mutated = {s.target for s in ep.graph_signature.output_specs if s.target}
    tensors = {**ep.state_dict, **ep.constants}
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    out = {}
    for spec in ep.graph_signature.input_specs:
        t = tensors.get(spec.target) if spec.target else None
        if spec.kind in _WEIGHTS and isinstance(t, torch.Tensor) and spec.target not in mutated:
            out[by_name[spec.arg.name]] = (spec.target, t, spec.target not in state)
    return out


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _row_chain(table: torch.fx.Node, weights) -> list[torch.fx.Node] | None:
    """The nodes computing `table` row by row from weights, in graph order, when each is used
    only on the way to the gather and some op besides views runs between the weights and it;
    else None."""
    val = _val(table)
    rows = val.shape[0] if isinstance(val, torch.Tensor) and val.ndim else None
    if type(rows) is not int or rows < 2 or table.op != "call_function" or len(table.users) != 1:
        return None
    order = {n: i for i, n in enumerate(table.graph.nodes)}
    chain: set[torch.fx.Node] = set()
    pending = {table}
    while pending:  # latest first: every user a node has in the chain is checked before it
        n = max(pending, key=order.__getitem__)
        pending.discard(n)
        if n is not table and any(u not in chain for u in n.users):
            return None  # used beside the gather: the whole table is needed anyway
        operands = _row_operands(n, rows, weights)
        if operands is None:
            return None
        chain.add(n)
        pending |= set(operands) - chain
    if all(n.op == "placeholder" or n.target in _VIEWS for n in chain):
        return None  # a weight gathered as it is (through views): nothing to save
    return sorted(chain, key=order.__getitem__)


def _row_operands(n: torch.fx.Node, rows: int, weights) -> list[torch.fx.Node] | None:
    """The operands of `n` that carry rows (its other operands broadcast over them), or None when
    `n` is not a row-by-row op of [rows, ...] tensors."""
    val = _val(n)
    if not isinstance(val, torch.Tensor) or val.ndim == 0 or val.shape[0] != rows:
        return None
    if n.op == "placeholder":
        return [] if n in weights else None
    if n.op != "call_function":
        return None
    if n.target in _VIEWS:
        source = _val(n.args[0])
        keeps_rows = isinstance(source, torch.Tensor) and source.ndim and source.shape[0] == rows
        return [_node(n.args[0])] if keeps_rows and _ints(n)[:1] == [rows] else None
    if _is_dequantize(n) and (_ints(n)[:1] != [1] or len(_ints(n)) != val.ndim
                              or any(not _has_rows(a, val.ndim, rows) for a in n.all_input_nodes)):
        return None  # blocks spanning rows, or scales not given per row (their layout is torchao's to read)
    if not _is_dequantize(n) and (n.target not in _ELEMENTWISE
                                  or (n.target is aten._to_copy.default and set(n.kwargs) - {"dtype"})):
        return None  # (a copy that moves or lays out is not ours to move)
    out = []
    for a in n.all_input_nodes:
        v = _val(a)
        if not isinstance(v, torch.Tensor):
            return None
        if v.ndim == val.ndim and v.shape[0] != 1:
            if v.shape[0] != rows:
                return None
            out.append(a)  # a row operand; one of fewer dimensions, or of one row, broadcasts
    return out


def _has_rows(a: torch.fx.Node, ndim: int, rows: int) -> bool:
    v = _val(a)
    return isinstance(v, torch.Tensor) and v.ndim == ndim and v.shape[0] == rows


def _node(a) -> torch.fx.Node:
    assert isinstance(a, torch.fx.Node)
    return a


def _ints(n: torch.fx.Node) -> list:
    """The shape (a view's) or block size (a dequantize's) `n` takes as its second argument."""
    return list(cast(Sequence, n.args[1]))


def _is_dequantize(n: torch.fx.Node) -> bool:
    """torchao's `dequantize_affine` (kept whole by ferry's lowering): elementwise within blocks."""
    return str(n.target) == "torchao.dequantize_affine.default"


def _rewrite(ep, gather: torch.fx.Node, ids: torch.fx.Node, chain: list[torch.fx.Node], weights, fake_mode) -> None:
    graph = ep.graph
    new: dict[torch.fx.Node, torch.fx.Node] = {}
    args: tuple
    with graph.inserting_before(gather):
        lead = _sizes(graph, ids)
        for n in chain:
            if n.op == "placeholder":
                new[n] = _gathered(ep, n, ids, lead, weights, fake_mode)
                continue
            if n.target in _VIEWS:
                args = (new[_node(n.args[0])], [*lead, *_ints(n)[1:]])
            elif _is_dequantize(n):  # blocks of one row: one per gathered row
                args = tuple(new.get(a, a) if isinstance(a, torch.fx.Node) else a for a in n.args)
                args = (args[0], [1] * len(lead) + _ints(n)[1:], *args[2:])
            else:
                args = tuple(new.get(a, a) if isinstance(a, torch.fx.Node) and a in new else a for a in n.args)
            new[n] = _call(graph, n.target, args, dict(n.kwargs), fake_mode, like=n)
    out = new[chain[-1]]
    assert _val(out).shape[len(lead):] == _val(gather).shape[len(lead):]  # [*ids, row]: the gather's result
    gather.replace_all_uses_with(out)
    graph.erase_node(gather)
    for n in reversed(chain):  # the whole table's computation, now unread
        if n.op == "call_function" and not n.users:
            graph.erase_node(n)


def _sizes(graph, ids) -> list:
    """The gather's index sizes as graph values: ints, or `sym_size` nodes for dynamic ones."""
    out = []
    for d, s in enumerate(_val(ids).shape):
        if type(s) is int:
            out.append(s)
        else:
            node = graph.call_function(aten.sym_size.int, (ids, d))
            node.meta["val"] = s
            out.append(node)
    return out


def _call(graph, op, args, kwargs, fake_mode, like=None) -> torch.fx.Node:
    node = graph.call_function(op, args, kwargs)
    if like is not None:
        node.meta.update({k: v for k, v in like.meta.items() if k != "val"})

    def val(a):
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    with fake_mode:
        node.meta["val"] = op(*torch.fx.node.map_aggregate(args, val), **torch.fx.node.map_aggregate(kwargs, val))
    return node


def _gathered(ep, weight: torch.fx.Node, ids, lead, weights, fake_mode) -> torch.fx.Node:
    """The rows `ids` of a weight, shaped [*ids, *weight's other dims]; int4 values in int8 bytes
    are stored packed and unpacked here."""
    graph = ep.graph
    target, tensor, packable = weights[weight]
    rest = list(tensor.shape[1:])
    if packable and _int4_only(weight, tensor):
        _store(ep, weight, target, _pack(tensor), fake_mode)
        rows = _call(graph, aten.embedding.default, (weight, ids), {}, fake_mode)
        return _unpack(graph, rows, lead, rest, fake_mode)
    table = weight if tensor.ndim == 2 else _call(graph, aten.view.default, (weight, [tensor.shape[0], -1]), {},
                                                  fake_mode)
    rows = _call(graph, aten.embedding.default, (table, ids), {}, fake_mode)
    return rows if tensor.ndim == 2 else _call(graph, aten.view.default, (rows, [*lead, *rest]), {}, fake_mode)


def _int4_only(weight, tensor: torch.Tensor) -> bool:
    """An int8 matrix of values in [-8, 7] with an even row length, read only by this gather."""
    if tensor.dtype != torch.int8 or tensor.ndim != 2 or tensor.shape[1] % 2 or tensor.numel() == 0:
        return False
    if len(weight.users) != 1:
        return False
    return bool(((tensor >= -8) & (tensor <= 7)).all())


# (device, shape, sum) of packed bytes -> those bytes, while some program holds them: methods compiled
# together from one model pack its weight into one tensor (torch unwraps a quantized weight into
# a copy of its data per method), which the program then stores once (aot/values.py keeps one
# segment per tensor address)
_PACKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _pack(q: torch.Tensor) -> torch.Tensor:
    """[rows, 2k] int4 values -> [rows, k] bytes: the even column in the low nibble; the very
    tensor packed before from the same values, while a program compiled meanwhile holds it."""
    nibbles = (q.to(torch.int16) & 15).to(torch.uint8)
    packed = torch.nn.Parameter((nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous(), requires_grad=False)
    key = (str(packed.device), tuple(packed.shape), int(packed.sum(dtype=torch.int64)))
    known = _PACKED.get(key)
    if known is not None and torch.equal(known, packed):
        return known
    _PACKED[key] = packed
    return packed


def _unpack(graph, packed: torch.fx.Node, lead, rest, fake_mode) -> torch.fx.Node:
    """Gathered bytes [*ids, k] -> int8 values [*ids, 2k] in [-8, 7]."""
    low = _call(graph, aten.bitwise_and.Scalar, (packed, 15), {}, fake_mode)
    high = _call(graph, aten.bitwise_right_shift.Tensor_Scalar, (packed, 4), {}, fake_mode)
    pairs = _call(graph, aten.stack.default, ([low, high], -1), {}, fake_mode)
    nibbles = _call(graph, aten.view.default, (pairs, [*lead, *rest]), {}, fake_mode)
    signed = _call(graph, aten._to_copy.default, (nibbles,), {"dtype": torch.int8}, fake_mode)
    flipped = _call(graph, aten.bitwise_xor.Scalar, (signed, 8), {}, fake_mode)
    return _call(graph, aten.sub.Tensor, (flipped, 8), {}, fake_mode)


def _store(ep, weight: torch.fx.Node, target: str, tensor: torch.Tensor, fake_mode) -> None:
    """`weight` now holds `tensor` (a new shape and dtype) in the program's state dict or constants."""
    if target in ep.constants:  # new dicts: the caller's program keeps its own
        ep._constants = {**ep.constants, target: tensor}
    else:
        ep._state_dict = {**ep.state_dict, target: tensor}
    weight.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
