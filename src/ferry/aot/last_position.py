"""Outputs cut to their last position: a prefill whose logits only the next token is picked from.

Generation reads one row of a prefill's logits, the last, but transformers' export recipe returns
all of them: at 2048 tokens of a 128k-token vocabulary, a 1 TFLOP head product and 525 MB of bf16
logits for one row of use (Hugging Face's `generate` asks the model for the last row only, and
ExecuTorch's Llama export returns only it). `CompileConfig(last_position_only=["prefill"])` cuts
each result of the methods it names to its last position along dimension 1 (batch first: a
[B, S, V] result becomes [B, 1, V], as eager's `result[:, -1:]`), before anything is placed. A
result that is a `linear` of [B, S, H] rows, used by nothing else, has its rows cut before the
product, which then runs on one row per batch element; any other result is cut as it is, which
saves what the result holds but not what computing it costs. `ferry.generate` reads the last
position either way.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.export.graph_signature import OutputKind
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ferry.choices.graph_edits import call
from ferry.errors import CompileError

__all__ = ["keep_last_position"]

aten = torch.ops.aten


def keep_last_position(ep: torch.export.ExportedProgram, method: str) -> None:
    """Cut, in place, every result of `ep` (a functional program, ferry's own copy) to its last
    position along dimension 1. CompileError for a result with no such dimension."""
    graph = ep.graph
    out = graph.output_node()
    results = list(out.args[0])
    vals = [n.meta.get("val") for n in results if isinstance(n, torch.fx.Node)]
    with detect_fake_mode(vals) or contextlib.nullcontext():
        for i, spec in enumerate(ep.graph_signature.output_specs):
            if spec.kind == OutputKind.USER_OUTPUT:
                results[i] = _cut(ep.graph_module, results[i], method, i)
    out.args = (tuple(results),)
    graph.lint()
    ep.graph_module.recompile()


def _cut(gm: torch.fx.GraphModule, node, method: str, index: int) -> torch.fx.Node:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        what = f"a tensor of {val.dim()} dimension(s)" if isinstance(val, torch.Tensor) else "not a tensor"
        raise CompileError(f"last_position_only: result {index} of method {method!r} is {what}, with no positions "
                           "(dimension 1) to keep the last of; leave this method out of last_position_only")
    assert isinstance(node, torch.fx.Node)  # (val came from its meta)
    rows = node.args[0] if node.target is aten.linear.default else None
    rows_val = rows.meta.get("val") if isinstance(rows, torch.fx.Node) else None
    if (isinstance(rows_val, torch.Tensor) and rows_val.dim() >= 3 and len(node.users) == 1
            and not node.kwargs):
        with gm.graph.inserting_before(node):  # the product over the last rows only
            last = call(gm, node, aten.slice.Tensor, (rows, 1, -1, sys.maxsize),
                        aten.slice.Tensor(rows_val, 1, -1, sys.maxsize))
        node.args = (last, *node.args[1:])
        weights = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args[1:]]
        node.meta["val"] = aten.linear.default(last.meta["val"], *weights)
        node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
        return node
    with gm.graph.inserting_after(node):
        return call(gm, node, aten.slice.Tensor, (node, 1, -1, sys.maxsize), aten.slice.Tensor(val, 1, -1, sys.maxsize))
