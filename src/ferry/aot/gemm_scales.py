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
from ferry.choices.graph_edits import Rewrite, attr, call, constant, single_use, static_value, viewable

__all__ = ["ON", "layer_scales_into_weights", "scales_as_alpha"]

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


# ---------------------------------------------------------------- a layer scale, into the weight

_ROW_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def layer_scales_into_weights(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """`s · permute(view(x @ Wᵀ + b))`, s a constant with one value per output column of the
    product (a layer scale: ConvNeXt, CaiT, DINOv2, BEiT) -> the product with `s·W` and `s·b`,
    computed once here. Eager runs the scale as a kernel of its own after the GEMM (ConvNeXt-T:
    18 a call). Equal to eager within rounding (s·W rounded once, against s·(x·Wᵀ) rounded per
    element). Only where the weight and bias are constants no other node reads (else the scaled
    copy would add memory) and the scale has no zero or non-finite value (eager's 0·inf is NaN)."""
    done: list[Rewrite] = []
    for node in list(gm.graph.nodes) if ON else ():
        if node.op == "call_function" and node.target is aten.mul.Tensor and _layer_scale(gm, node):
            done.append(Rewrite("layer scale into weight", node.name))
    return done


def _layer_scale(gm: torch.fx.GraphModule, mul: torch.fx.Node) -> bool:
    if len(mul.args) != 2 or mul.kwargs:
        return False
    operands: Any = mul.args
    pair = next(((y, s) for y, s in (operands, operands[::-1])
                 if isinstance(y, torch.fx.Node) and attr(gm, s) is not None and len(s.users) == 1), None)
    if pair is None:
        return False
    y, s_node = pair
    found = _product_columns(y)
    yv, out = y.meta.get("val"), mul.meta.get("val")
    if found is None or not (static_value(yv) and static_value(out)) or out.shape != yv.shape:
        return False
    product, axis = found
    scale = _per_column(attr(gm, s_node), yv, axis)
    if scale is None or out.dtype != yv.dtype or yv.dtype not in _DTYPES:
        return False
    if any(u.op == "output" for u in mul.users) or not _scale_weights(gm, product, scale):
        return False  # (a result of the delegate: the view chain would be copied out in the scale's place)
    mul.replace_all_uses_with(y)
    gm.graph.erase_node(mul)
    return True


def _product_columns(y: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """(the GEMM, the axis of `y` its columns lie along) where `y` is a GEMM's result through views
    of its rows and permutes, each read by the next alone; else None."""
    if not single_use(y):
        return None
    chain = []
    node: Any = y
    while node.op == "call_function" and node.target in (*_ROW_VIEWS, aten.permute.default):
        chain.append(node)
        node = node.args[0]
        if not single_use(node):
            return None
    if node.op != "call_function" or node.target not in (aten.addmm.default, aten.mm.default, aten.linear.default):
        return None
    axis = node.meta["val"].dim() - 1
    for step in reversed(chain):
        before, after = step.args[0].meta["val"], step.meta["val"]
        if step.target is aten.permute.default:
            axis = [d % after.dim() for d in step.args[1]].index(axis)
        elif axis != before.dim() - 1 or after.dim() == 0 or after.shape[-1] != before.shape[-1]:
            return None  # a view that merges or splits the columns
        else:
            axis = after.dim() - 1
    return node, axis


def _per_column(scale: torch.Tensor, yv: torch.Tensor, axis: int) -> torch.Tensor | None:
    """`scale` as one value per column (n,), where it broadcasts over `yv` along `axis` alone."""
    n = yv.shape[axis]
    if scale.dtype != yv.dtype or scale.dim() > yv.dim() or scale.numel() != n or n == 0:
        return None
    full = (1,) * (yv.dim() - scale.dim()) + tuple(scale.shape)
    if full[axis] != n or any(d != 1 for i, d in enumerate(full) if i != axis):
        return None
    flat = scale.reshape(n)
    return flat if bool(torch.isfinite(flat).all()) and not bool((flat == 0).any()) else None


def _scale_weights(gm: torch.fx.GraphModule, product: torch.fx.Node, scale: torch.Tensor) -> bool:
    """The product's weight and bias replaced by scaled constants of their own, where each is a
    constant (a weight maybe transposed) that only this product reads; else nothing changes."""
    weight: Any
    bias: Any
    if product.target is aten.linear.default:
        weight, rows_of_weight = product.args[1], True
        bias = product.args[2] if len(product.args) > 2 else product.kwargs.get("bias")
    else:
        weight = product.args[-1]
        bias = product.args[0] if product.target is aten.addmm.default else None
        rows_of_weight = False
    source: Any = weight
    if not rows_of_weight and single_use(weight) and weight.target in (aten.t.default, aten.permute.default) \
            and (weight.target is aten.t.default or list(weight.args[1]) in ([1, 0], [-1, -2])):
        source, rows_of_weight = weight.args[0], True  # Wᵀ: its source's rows are the columns
    w = attr(gm, source)
    b = attr(gm, bias) if bias is not None else None
    if w is None or len(source.users) != 1 or w.dim() != 2 or w.dtype != scale.dtype:
        return False
    if bias is not None and (b is None or len(bias.users) != 1 or tuple(b.shape) != tuple(scale.shape)):
        return False
    n = scale.numel()
    if w.shape[0 if rows_of_weight else 1] != n:
        return False
    with gm.graph.inserting_before(source):
        scaled = constant(gm, f"{source.target}_scaled", w * (scale.view(n, 1) if rows_of_weight else scale.view(1, n)),
                          source)
    source.replace_all_uses_with(scaled)
    gm.graph.erase_node(source)
    if bias is not None and b is not None:
        with gm.graph.inserting_before(bias):
            scaled_bias = constant(gm, f"{bias.target}_scaled", b * scale, bias)
        bias.replace_all_uses_with(scaled_bias)
        gm.graph.erase_node(bias)
    return True
