"""A batched product scaled by a number, before or after, as one GEMM whose alpha is the number.

Attention written out by hand scales q before its product with kᵀ (torchvision's Swin: `q *
head_dim ** -0.5`) or the scores after it (transformers' eager attention: `matmul(q, kᵀ) *
scaling`). Eager runs the scale as a kernel of its own over q or over the scores; cuBLAS scales
the product in the GEMM's epilogue for nothing (`baddbmm(…, beta=0, alpha=s)`, as eager's
composed attention in choices/attention.py does). Swin-T runs 12 such kernels a call.

Equal to eager within rounding, not bit for bit: eager rounds q·s and sums the rounded
products, the GEMM sums the products and rounds s·Σ once (a batch norm folded into a
convolution differs from eager the same way). Taken only where it launches fewer kernels: the
scaled operand must be a batch of matrices cuBLAS reads in place (else a copy would replace the
scale), and only where the scale is a normal float32 (baddbmm's alpha).
Static sizes only; fp32, fp64 and bf16 (in fp16 eager's scaled intermediate can overflow where
the GEMM's cannot).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from ferry import node_meta as M
from ferry.choices.graph_edits import Rewrite, call, constant, single_use, viewable

__all__ = ["ON", "scales_as_alpha"]

aten = torch.ops.aten
ON = True  # off: each scale a kernel, as traced (bench/profile_graphs.py --gemm-scales off, an A/B)
_PRODUCTS = (aten.matmul.default, aten.bmm.default)
_MULS = (aten.mul.Tensor, aten.mul.Scalar)
_DIVS = (aten.div.Tensor, aten.div.Scalar)
# fp16 left out: its range is narrow enough that eager's scaled q or scores overflow (inf, then NaN
# after a softmax) where the GEMM's unrounded sums scaled once do not
_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def scales_as_alpha(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """`matmul(a·s, b)·t` (either operand, the result, or several of them scaled by numbers) ->
    `view(baddbmm(0, a3, b3, beta=0, alpha=s·t))`, for products of 3-D or more operands of one
    batch shape."""
    done: list[Rewrite] = []
    zeros: dict = {}  # the beta=0 operand, one per dtype and device
    for node in list(gm.graph.nodes) if ON else ():
        if node.op == "call_function" and node.target in _PRODUCTS and _rewrite(gm, node, zeros):
            done.append(Rewrite("scale as alpha", node.name))
    return done


def _rewrite(gm: torch.fx.GraphModule, product: torch.fx.Node, zeros: dict) -> bool:
    a, b = product.args[:2]
    shapes = _batched_shapes(product)
    if shapes is None:
        return False
    sources: list[Any] = []
    alpha, replaced = 1.0, [product]
    for operand, shape3 in zip((a, b), shapes[:2]):
        scaled = _scaled(operand)
        if scaled is not None and _blas_readable(scaled[0], shape3):
            sources.append(scaled[0])
            alpha *= scaled[1]
            replaced += scaled[2]
        else:
            sources.append(operand)
    after = next(iter(product.users)) if single_use(product) else None
    after_scale = _scale_of(after) if after is not None and after.args[0] is product else None
    last: torch.fx.Node = product
    if after is not None and after_scale is not None:
        alpha *= after_scale
        last = after
    if alpha == 1.0 and sources == [a, b] or any(u.op == "output" for u in last.users):
        return False  # nothing to take in; a view as the delegate's result would be copied out
    if not _normal_float(alpha):
        return False  # baddbmm takes alpha as a float32 (beyond its range: refused at the call)
    out = last.meta["val"]
    with gm.graph.inserting_before(product):
        a3, b3 = (_as_3d(gm, product, s, shape3) for s, shape3 in zip(sources, shapes[:2]))
        zero = _zero(gm, product, out, zeros)
        r3 = call(gm, product, aten.baddbmm.default, (zero, a3, b3), out.new_empty(shapes[2]),
                  {"beta": 0, "alpha": alpha})
        result = call(gm, product, aten.view.default, (r3, list(out.shape)), out)
    last.replace_all_uses_with(result)
    for n in dict.fromkeys([last, *replaced]):  # each after its readers
        gm.graph.erase_node(n)
    return True


def _batched_shapes(product: torch.fx.Node):
    """(a's, b's, the result's) 3-D shapes where the product is batched over one static batch
    shape in a floating dtype, else None."""
    a, b = product.args[:2]
    vals: list[Any] = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (a, b, product)]
    av, bv, out = vals
    if not all(isinstance(v, torch.Tensor) for v in (av, bv, out)) or product.kwargs:
        return None
    if not (av.dtype == bv.dtype == out.dtype and av.dtype in _DTYPES) or av.dim() != bv.dim() or av.dim() < 3:
        return None
    if M.static_ints((*av.shape, *bv.shape)) is None or av.shape[:-2] != bv.shape[:-2] or av.shape[-1] != bv.shape[-2]:
        return None
    batch, (m, k), n = math.prod(av.shape[:-2]), av.shape[-2:], bv.shape[-1]
    if 0 in (batch, m, k, n):
        return None
    return (batch, m, k), (batch, k, n), (batch, m, n)


def _scaled(operand) -> tuple[torch.fx.Node, float, list[torch.fx.Node]] | None:
    """(x, s, the nodes between) where the product's operand is x·s, or a copy of x·s (a clone
    that made it contiguous: baddbmm reads x's own strides), each read only by the next."""
    nodes: list[Any] = [operand]
    if single_use(operand) and operand.target is aten.clone.default and set(operand.kwargs) <= {"memory_format"}:
        nodes.append(operand.args[0])
    scale = _scale_of(nodes[-1]) if single_use(nodes[-1]) else None
    return None if scale is None else (nodes[-1].args[0], scale, nodes)


def _scale_of(node) -> float | None:
    """s where `node` is x·s or x/s for a number s, with x of node's own shape and dtype, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in (*_MULS, *_DIVS)):
        return None
    if len(node.args) != 2 or node.kwargs or not isinstance(node.args[0], torch.fx.Node):
        return None
    s: Any = node.args[1]
    x, val = node.args[0].meta.get("val"), node.meta.get("val")
    if type(s) not in (int, float) or not math.isfinite(s) or s == 0:
        return None
    if not (isinstance(x, torch.Tensor) and isinstance(val, torch.Tensor)) or x.shape != val.shape or x.dtype != val.dtype:
        return None
    return float(s) if node.target in _MULS else 1.0 / s


def _normal_float(x: float) -> bool:
    return math.isfinite(x) and torch.finfo(torch.float32).tiny <= abs(x) <= torch.finfo(torch.float32).max


def _blas_readable(node: torch.fx.Node, shape) -> bool:
    """`node` viewed as `shape` is a batch of matrices cuBLAS reads in place (one of the two
    inner strides 1, the other spanning a row, a batch stride of its own): else baddbmm would
    copy it, and taking the scale would trade its kernel for that copy."""
    if not viewable(node.meta["val"], shape):
        return False
    v = node.meta["val"].view(shape)
    (b, m, n), (sb, sm, sn) = v.shape, v.stride()
    rows = (sn == 1 and sm >= max(1, n)) or (sm == 1 and sn >= max(1, m))
    return rows and (b == 1 or sb > 0)


def _as_3d(gm, like: torch.fx.Node, node: torch.fx.Node, shape) -> torch.fx.Node:
    """`node` as the GEMM's 3-D operand: a view where its layout allows, else a contiguous copy
    viewed (what matmul's own reshape does)."""
    val = node.meta["val"]
    if not viewable(val, shape):
        node = call(gm, like, aten.clone.default, (node,), val.contiguous(), {"memory_format": torch.contiguous_format})
        val = node.meta["val"]
    return call(gm, like, aten.view.default, (node, list(shape)), val.view(shape))


def _zero(gm, like: torch.fx.Node, out: torch.Tensor, zeros: dict) -> torch.fx.Node:
    """A one-element zero that baddbmm broadcasts and, with beta=0, never reads: no copy of it
    into the result is made. Made once per dtype and device, before any op reads it."""
    key = (out.dtype, str(M.get_device(like)))
    if key not in zeros:
        first = next(n for n in gm.graph.nodes if n.op != "placeholder")
        with gm.graph.inserting_before(first):
            zeros[key] = constant(gm, "gemm_alpha_zero", torch.zeros(1, 1, 1, dtype=out.dtype), like)
    return zeros[key]
