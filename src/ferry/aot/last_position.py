"""Outputs cut to their last position: a prefill whose logits only the next token is picked from.

Generation reads one row of a prefill's logits, the last, but transformers' export recipe returns
all of them: at 2048 tokens of a 128k-token vocabulary, a 1 TFLOP head product and 525 MB of bf16
logits for one row of use (Hugging Face's `generate` asks the model for the last row only, and
ExecuTorch's Llama export returns only it). `CompileConfig(last_position_only=["prefill"])` cuts
each result of the methods it names to its last position along dimension 1 (batch first: a
[B, S, V] result becomes [B, 1, V], as eager's `result[:, -1:]`), before anything is placed. A
result that is a `linear` of [B, S, H] rows, used by nothing else (no buffer is written from it),
or a quantized head (a product of the rows flattened to 2-D, per-column scales after it, viewed
back to 3-D), has its rows cut before the product, which then runs on one row per batch element;
any other result is cut as it is, which saves what the result holds but not what computing it
costs. A result whose dimension 1 is not the length of an input's dimension 1 has no positions
there and is refused. `ferry.generate` reads the last position either way.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.export.graph_signature import InputKind, OutputKind

from ferry.choices.graph_edits import call, revalue
from ferry.errors import CompileError

__all__ = ["keep_last_position"]

aten = torch.ops.aten


def keep_last_position(ep: torch.export.ExportedProgram, method: str) -> None:
    """Cut, in place, every result of `ep` (a functional program, ferry's own copy) to its last
    position along dimension 1. CompileError for a result whose dimension 1 is not positions (the
    length of some input's dimension 1: the prompt's)."""
    graph = ep.graph
    out = graph.output_node()
    results = list(out.args[0])
    specs = ep.graph_signature.output_specs
    positions = _positions(ep)
    user = [i for i, spec in enumerate(specs) if spec.kind == OutputKind.USER_OUTPUT]
    vals = [n.meta.get("val") for n in results if isinstance(n, torch.fx.Node)]
    cut: dict[torch.fx.Node, torch.fx.Node] = {}
    with detect_fake_mode(vals) or contextlib.nullcontext():
        for k, i in enumerate(user):
            node = results[i]
            _check(node, positions, method, k)
            if node not in cut:  # a result returned twice is cut once
                alone = results.count(node) == 1 and len(node.users) == 1  # no buffer written from it, no other use
                cut[node] = _cut(ep.graph_module, node, alone)
            results[i] = cut[node]
    out.args = (tuple(results),)
    graph.lint()
    ep.graph_module.recompile()


def _positions(ep: torch.export.ExportedProgram) -> list:
    """Dimension 1 of each user input (the token ids' and the positions' lengths)."""
    names = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder" and n.name in names]
    return [v.shape[1] for v in vals if isinstance(v, torch.Tensor) and v.dim() >= 2]


def _check(node, positions: list, method: str, index: int) -> None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(val, torch.Tensor) and val.dim() >= 2 and any(_same(val.shape[1], p) for p in positions):
        return
    what = (f"of shape {list(val.shape)}" if isinstance(val, torch.Tensor) else "not a tensor")
    raise CompileError(f"last_position_only: result {index} of method {method!r} is {what}, whose dimension 1 is no "
                       "input's dimension 1 (the positions of a [batch, positions, ...] input); leave this method "
                       "out of last_position_only")


def _same(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr


def _cut(gm: torch.fx.GraphModule, node: torch.fx.Node, alone: bool) -> torch.fx.Node:
    """`node`'s last position: a linear of [B, S, H] rows used for nothing else gets its rows cut
    (the graph computes one row); anything else is cut after it."""
    val = node.meta["val"]
    rows = node.args[0] if node.target is aten.linear.default else None
    rows_val = rows.meta.get("val") if isinstance(rows, torch.fx.Node) else None
    if alone and isinstance(rows_val, torch.Tensor) and rows_val.dim() >= 3 and not node.kwargs:
        with gm.graph.inserting_before(node):  # the product over the last rows only
            last = call(gm, node, aten.slice.Tensor, (rows, 1, -1, sys.maxsize),
                        aten.slice.Tensor(rows_val, 1, -1, sys.maxsize))
        node.args = (last, *node.args[1:])
        revalue([node])
        return node
    if alone and _cut_product_rows(gm, node):
        return node
    with gm.graph.inserting_after(node):
        return call(gm, node, aten.slice.Tensor, (node, 1, -1, sys.maxsize), aten.slice.Tensor(val, 1, -1, sys.maxsize))


# products of the rows of a 2-D first operand (addmm: its second), and ops that keep rows apart
_PRODUCTS = {aten.mm.default: 0, aten.addmm.default: 1, aten.linear.default: 0, aten._weight_int8pack_mm.default: 0,
             aten._weight_int4pack_mm.default: 0, aten._weight_int4pack_mm_for_cpu.default: 0}
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_ROW_WISE = frozenset({aten.alias.default, aten._to_copy.default, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor,
                       aten.div.Tensor})


def _cut_product_rows(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A quantized head: `view(f(product(view(x, [-1, H]), w...)), [B, S, V])`, `f` ops that keep
    rows apart (a per-column scale, casts). Cut x's positions before the flattening view, so the
    product runs on B rows; the result is viewed as [B, 1, V]. False where the result is not so
    made (nothing is changed then)."""
    if node.target not in _VIEWS or len(node.meta["val"].shape) != 3:
        return False
    chain, p = [], node.args[0]
    while isinstance(p, torch.fx.Node) and p.op == "call_function" and p.target in _ROW_WISE and len(p.users) == 1:
        if any(isinstance(a, torch.fx.Node) and _has_rows(a) for a in p.args[1:]):
            return False  # an operand with rows of its own
        chain.append(p)
        p = p.args[0]
    if not (isinstance(p, torch.fx.Node) and p.target in _PRODUCTS and len(p.users) == 1 and not p.kwargs):
        return False
    flat = p.args[_PRODUCTS[p.target]]
    if not (isinstance(flat, torch.fx.Node) and flat.target in _VIEWS and len(flat.users) == 1):
        return False
    shape = flat.args[1]
    if not (isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape)):
        return False  # ([-1, H] is cut as it stands; a size of the positions in it would not be)
    x = flat.args[0]
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not (isinstance(xv, torch.Tensor) and xv.dim() == 3):
        return False
    with gm.graph.inserting_before(flat):
        last = call(gm, flat, aten.slice.Tensor, (x, 1, -1, sys.maxsize), aten.slice.Tensor(xv, 1, -1, sys.maxsize))
    flat.args = (last, *flat.args[1:])
    node.args = (node.args[0], [-1, 1, node.meta["val"].shape[-1]])
    revalue([flat, p, *reversed(chain), node])
    return True


def _has_rows(a: torch.fx.Node) -> bool:
    """`a` is a tensor with more than one row (dimension 0 of a 2-D chain), so not a per-column operand."""
    v = a.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and not (isinstance(v.shape[0], int) and v.shape[0] == 1)
