"""Higher-order ops that are ATen ops in disguise, rewritten as those ATen ops.

torchao's int8 dynamic-activation linear, exported on CUDA, multiplies its int8 activations and
weights through `out_dtype(aten.mm, torch.int32, a, b)`: a higher-order op, which ferry's program
format does not hold. What it computes is ATen's: for an int8 x int8 `mm` to int32, `_int_mm`
(what the op itself calls on CUDA; exact, so the CPU's `_int_mm` gives the same integers); for
anything else, its arguments cast to the promoted type, the op, and the result cast to
`out_dtype` (the op's own fallback). A CUDA `_int_mm` of 16 rows or fewer is fitted later
(aot/kernel_limits.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ferry.choices.graph_edits import call

__all__ = ["out_dtype_as_aten"]

aten = torch.ops.aten


def out_dtype_as_aten(gm: torch.fx.GraphModule) -> int:
    """Rewrite every `out_dtype` node of `gm` in place; how many there were."""
    hop = getattr(torch.ops.higher_order, "out_dtype", None)
    if hop is None:
        return 0  # (a torch without it exports none)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop]
    for node in nodes:
        op, dtype, *args = node.args
        vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        with gm.graph.inserting_before(node), detect_fake_mode(vals) or contextlib.nullcontext():
            if _is_int_mm(op, dtype, vals):
                out = call(gm, node, aten._int_mm.default, tuple(args), aten._int_mm.default(*vals))
            else:
                out = _promoted(gm, node, op, dtype, args, vals)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    if nodes:
        gm.graph.lint()
        gm.recompile()
    return len(nodes)


def _is_int_mm(op, dtype, vals) -> bool:
    return (op is aten.mm.default and dtype == torch.int32 and len(vals) == 2
            and all(isinstance(v, torch.Tensor) and v.dtype == torch.int8 for v in vals))


def _promoted(gm, node, op, dtype, args, vals):
    """`op` over its arguments cast to the type they promote to with `dtype`, cast to `dtype`."""
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    promoted = elementwise_dtypes(*tensors, torch.ones(1, dtype=dtype),
                                  type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[0]
    cast_args, cast_vals = [], []
    for a, v in zip(args, vals):
        if isinstance(v, torch.Tensor) and v.dtype != promoted:
            v = aten._to_copy.default(v, dtype=promoted)
            a = call(gm, node, aten._to_copy.default, (a,), v, {"dtype": promoted})
        cast_args.append(a)
        cast_vals.append(v)
    result = op(*cast_vals)
    out = call(gm, node, op, tuple(cast_args), result)
    if result.dtype == dtype:
        return out
    return call(gm, node, aten._to_copy.default, (out,), aten._to_copy.default(result, dtype=dtype), {"dtype": dtype})
