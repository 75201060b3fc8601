"""Rewrites that give a delegate the fused kernels eager PyTorch runs at inference.

Export traces what a module does in general; eager, at inference, takes shortcuts the trace
does not show. Three of them cost ferry the most on real models (measured on an H200, batch 1):

- `nn.MultiheadAttention` runs one fused op (`_native_multi_head_attention`) in eager under
  `no_grad`; its trace is ~25 ops (projections, views, transposes, a contiguous copy, SDPA).
  ViT-B/16 spent ~1.4 ms per call more than eager on them.
- An attention mask computed from constants alone (transformers builds one from `arange`
  when a model is exported without an attention mask) is evaluated at compile time: all
  true, it is dropped; lower-triangular, it becomes `is_causal=True`. Eager, given no mask,
  runs fused attention; with the traced mask, whose last dimension is broadcast (stride 0),
  CUDA fell back to its unfused kernel (BERT: 24 extra GEMMs per call).
- `linear` over a batch of rows is, in eager, one GEMM over a 2-D view of its input (bias
  fused: `addmm`). ferry runs exactly that, as `addmm.out`/`mm.out` into planned memory: one
  ATen call per linear where the functional `linear` makes four or five (views, `t`, the GEMM),
  the views of planned tensors around it made once at load, and its result inside the plan
  (`linear.out` is a wrapper that computes into a temporary and copies).
- A batch norm after a convolution, with fixed statistics, is a per-channel scale and shift:
  folded into the convolution's weights and bias, it costs nothing per call. Unfolded it is
  a kernel and, on CUDA, a host-side copy of its statistics per call (53 per ResNet-50 call).

All run after partitioning, on each delegate's subgraph: partitioners and `exclude=` see the
ops the user wrote. The attention rewrite fires only on exactly `nn.MultiheadAttention`'s own
ops and is checked numerically against them before it replaces them; the fold and the masks
are exact algebra on constants. Nothing is rewritten over a dynamic size.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import torch
import torch.fx
from torch.nn.utils.fusion import fuse_conv_bn_weights

from ferry.aot import meta as M
from ferry.ops.fused import CONV_ADD_RELU, CONV_RELU

__all__ = ["Rewrite", "fuse_for_inference", "fusion_notes"]

aten = torch.ops.aten
_CONVS = (aten.conv2d.default, aten.conv1d.default, aten.conv3d.default, aten.convolution.default)
_BATCH_NORM = aten._native_batch_norm_legit_no_training.default
_SDPA = aten.scaled_dot_product_attention.default
_CHECK_ELEMENTS = 1 << 22  # the largest activation a numerical check materialises
# what the traced ops of one nn.MultiheadAttention (self-attention, packed projections) may be
_MHA_OPS = {aten.linear.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
            aten.squeeze.dims, aten.squeeze.default, aten.clone.default, aten.select.int, aten.split.Tensor,
            aten.split_with_sizes.default, aten.unbind.int, aten.expand.default, aten.t.default,
            aten.mm.default, aten.addmm.default, _SDPA, operator.getitem}
_MHA_CLASS = "torch.nn.modules.activation.MultiheadAttention"


class Rewrite(NamedTuple):
    kind: str  # "copy dropped", "fold", "conv relu", "patches", "attention", "mask dropped", "mask causal", "gemm"
    where: str  # the node or module call it applied to


def fuse_for_inference(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """Rewrite `gm` (a delegate's subgraph: constants are get_attr) in place; return what was done."""
    done = (_drop_copies(gm) + _fold_batch_norms(gm) + _fuse_conv_relu(gm) + _patches_as_gemm(gm)
            + _fuse_attention(gm) + _simplify_attention_masks(gm) + _linear_as_gemm(gm))
    if done:
        for node in reversed(list(gm.graph.nodes)):  # what only a dropped mask read, then unread constants
            if not node.users and (node.op == "get_attr" or (node.op == "call_function" and not node.is_impure())):
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    return done


# ---------------------------------------------------------------- copies that change nothing


def _drop_copies(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """`clone(x)` laid out as `x` is -> `x`. A dropout at inference is such a clone once export
    has made the graph functional (ViT-B/16: 39 per call, BERT 25, GPT-2 13), where eager's
    dropout returns its input: 0.1 ms per ViT call at batch 4 on an H200. The graph is
    functional, so nothing can tell the two apart, except a returned value, which must own its
    memory (kept), and a clone that changes the layout (`.contiguous()` of a transpose: kept)."""
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.clone.default:
            continue
        x, val = node.args[0], node.meta.get("val")
        xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not (isinstance(val, torch.Tensor) and isinstance(xv, torch.Tensor)) or any(u.op == "output" for u in node.users):
            continue
        if val.shape != xv.shape or val.dtype != xv.dtype or val.stride() != xv.stride():
            continue
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)
        done.append(Rewrite("copy dropped", node.name))
    return done


# ---------------------------------------------------------------- batch norm into convolution


def _fold_batch_norms(gm: torch.fx.GraphModule) -> list[Rewrite]:
    done = []
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target is not _BATCH_NORM:
            continue
        conv = bn.args[0]
        folded = _foldable(gm, conv, bn)
        if folded is None:
            continue
        weight, bias = folded
        with gm.graph.inserting_before(conv):
            w = _constant(gm, f"{conv.name}_folded_weight", weight, conv.args[1])
            b = _constant(gm, f"{conv.name}_folded_bias", bias, conv.args[1])
        args = list(conv.args)
        args[1] = w
        if len(args) > 2:
            args[2] = b
        conv.args = tuple(args)
        if len(conv.args) < 3:
            conv.kwargs = {**conv.kwargs, "bias": b}
        for user in list(bn.users):
            user.replace_all_uses_with(conv)
            gm.graph.erase_node(user)
        gm.graph.erase_node(bn)
        done.append(Rewrite("fold", f"{bn.name} into {conv.name}"))
    return done


def _foldable(gm, conv, bn):
    """The folded (weight, bias) of `conv` when `bn` is its only reader and both read constants."""
    if not (isinstance(conv, torch.fx.Node) and conv.op == "call_function" and conv.target in _CONVS
            and len(conv.users) == 1 and all(u.target is operator.getitem and u.args[1] == 0 for u in bn.users)):
        return None
    if conv.target is aten.convolution.default and conv.args[6]:
        return None  # a transposed convolution lays its weight out (in, out, ...)
    gamma, beta, mean, var = (_attr(gm, a) for a in bn.args[1:5])
    if (bn.args[1] is not None and gamma is None) or (bn.args[2] is not None and beta is None):
        return None  # a scale or shift computed in the graph (a parametrization, FiLM): not a constant
    weight = _attr(gm, conv.args[1])
    bias = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
    bias_t = _attr(gm, bias) if bias is not None else None
    if weight is None or mean is None or var is None or (bias is not None and bias_t is None):
        return None
    def double(t):
        return None if t is None else t.double()

    # torch's own folding (what torch.ao's fusion uses), in float64, then back to the weight's dtype
    w, b = fuse_conv_bn_weights(weight.double(), double(bias_t), mean.double(), var.double(), float(bn.args[6]),
                                double(gamma), double(beta))
    return w.detach().to(weight.dtype), b.detach().to(weight.dtype)


def _attr(gm, node):
    """The tensor a get_attr node names, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        return None
    t = gm
    for part in str(node.target).split("."):
        t = getattr(t, part, None)
    return t if isinstance(t, torch.Tensor) and not t.is_meta else None


def _constant(gm, name: str, value: torch.Tensor, like: torch.fx.Node) -> torch.fx.Node:
    target = name
    while hasattr(gm, target):
        target += "_"
    gm.register_buffer(target, value)
    node = gm.graph.get_attr(target)
    device = M.get_device(like)
    if device is not None:
        M.set_device(node, device)
    val = like.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["val"] = val.new_empty(value.shape)
    return node


# ---------------------------------------------------------------- convolution, bias, add, ReLU as one kernel



def _fuse_conv_relu(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """`relu(conv(x))` -> `ferry::conv_relu`, `relu(conv(x) + z)` -> `ferry::conv_add_relu`
    (ops/fused.py: one cuDNN call on CUDA where eager would run cuDNN). Only a 2-D
    convolution of static shape that nothing else reads, and a `z` of its result's exact shape,
    dtype and layout (no broadcast). The graph is functional here (lowering made it so): an
    in-place `relu_` or `+=` of the module is a `relu` or `add` by now."""
    done = []
    for relu in list(gm.graph.nodes):
        if relu.op != "call_function" or relu.target is not aten.relu.default:
            continue
        src, z = relu.args[0], None
        if _single_use(src) and src.target is aten.add.Tensor and not src.kwargs and len(src.args) == 2:
            a, b = src.args
            conv, z = (a, b) if _fusable_conv(a) and _same_tensor_type(a, b) else (b, a)
            if a is b or not (_fusable_conv(conv) and _same_tensor_type(conv, z)):
                continue  # (relu(y + y): the add is y's one reader, but y is read twice)
        elif _fusable_conv(src):
            conv = src
        else:
            continue
        x, w, bias, stride, padding, dilation, groups = _conv_args(conv)
        with gm.graph.inserting_before(relu):
            fused = (_call(gm, relu, CONV_RELU, (x, w, bias, stride, padding, dilation, groups), relu.meta["val"])
                     if z is None else
                     _call(gm, relu, CONV_ADD_RELU, (x, w, z, bias, stride, padding, dilation, groups), relu.meta["val"]))
        relu.replace_all_uses_with(fused)
        for dead in (relu, src, conv) if z is not None else (relu, conv):
            gm.graph.erase_node(dead)
        done.append(Rewrite("conv relu", f"{conv.name} + {'add + ' if z is not None else ''}{relu.name}"))
    return done


def _single_use(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and len(node.users) == 1


def _fusable_conv(node) -> bool:
    """A 2-D, not transposed convolution of static shape whose one reader is the next op."""
    if not _single_use(node) or node.target not in (aten.conv2d.default, aten.convolution.default):
        return False
    if node.target is aten.convolution.default and (_conv_arg(node, "transposed") or any(_conv_arg(node, "output_padding"))):
        return False
    val, x = node.meta.get("val"), node.args[0]
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return (isinstance(val, torch.Tensor) and isinstance(xv, torch.Tensor) and val.dim() == 4
            and val.is_floating_point() and M.static_ints(val.shape) is not None and M.static_ints(xv.shape) is not None)


def _same_tensor_type(conv, z) -> bool:
    cv = conv.meta.get("val")
    zv = z.meta.get("val") if isinstance(z, torch.fx.Node) else None
    return (isinstance(zv, torch.Tensor) and tuple(zv.shape) == tuple(cv.shape) and zv.dtype == cv.dtype
            and zv.stride() == cv.stride())


def _conv_args(conv) -> tuple:
    """(input, weight, bias, stride, padding, dilation, groups) of a conv2d or convolution node,
    defaults filled in (folding may have given the bias as a keyword)."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    return tuple(_pair(_conv_arg(conv, n)) if n in ("stride", "padding", "dilation") else _conv_arg(conv, n)
                 for n in names)


def _conv_arg(conv, name: str):
    for i, arg in enumerate(conv.target._schema.arguments):
        if arg.name == name:
            if i < len(conv.args):
                return conv.args[i]
            return conv.kwargs.get(name, arg.default_value)
    raise KeyError(name)  # pragma: no cover - both schemas have every name asked for


def _pair(v) -> list:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * 2 if len(v) == 1 else v


# ---------------------------------------------------------------- a convolution over patches as one GEMM


def _patches_as_gemm(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """A 2-D convolution whose kernel, larger than 1x1, tiles its input (stride = kernel, no
    padding or dilation, one group, constant weights: ViT's patch embedding, ConvNeXt's stem
    and downsampling) -> one copy of the input into patch rows, `addmm` with the weight laid
    out at compile time, and the result viewed back (copied once more only where eager's
    result is contiguous). Measured on an H200 (batch 1-8): cuDNN took 1.3-1.8x the GEMM's
    time on ViT-B/16's embedding and ConvNeXt-T's last downsampling (level on the smaller
    ones), and inside that downsampling allocated 9 MiB per call, which set ferry's peak."""
    done, laid_out = [], {}  # one re-laid copy of a weight however many convolutions read it
    for conv in list(gm.graph.nodes):
        plan = _patch_plan(gm, conv)
        if plan is None:
            continue
        x, weight, bias, order = plan
        xv, out = x.meta["val"], conv.meta["val"]
        n, c, h, w = xv.shape
        o, _, kh, kw = weight.shape
        rows, k = n * (h // kh) * (w // kw), c * kh * kw
        laid = weight.permute(0, 2, 3, 1) if order == (3, 5, 1) else weight  # (o, kh, kw, c) or (o, c, kh, kw)
        with gm.graph.inserting_before(conv):
            key = (conv.args[1], order)
            if key not in laid_out:
                with gm.graph.inserting_after(conv.args[1]):
                    laid_out[key] = _constant(gm, f"{conv.name}_patch_weight", laid.reshape(o, k).contiguous(),
                                              conv.args[1])
            wnode = laid_out[key]
            split = xv.view(n, c, h // kh, kh, w // kw, kw)
            tiles = _call(gm, conv, aten.view.default, (x, list(split.shape)), split)
            dims = [0, 2, 4, *order]
            moved = _call(gm, conv, aten.permute.default, (tiles, dims), split.permute(dims))
            packed = _call(gm, conv, aten.clone.default, (moved,), split.permute(dims).contiguous())
            packed.kwargs = {"memory_format": torch.contiguous_format}
            flat = _call(gm, conv, aten.view.default, (packed, [rows, k]), xv.new_empty(rows, k))
            wt = _call(gm, conv, aten.t.default, (wnode,), wnode.meta["val"].t())
            res = out.new_empty(rows, o)
            gemm = (_call(gm, conv, aten.mm.default, (flat, wt), res) if bias is None
                    else _call(gm, conv, aten.addmm.default, (bias, flat, wt), res))
            grid = res.view(n, h // kh, w // kw, o)
            y = _call(gm, conv, aten.view.default, (gemm, list(grid.shape)), grid)
            y = _call(gm, conv, aten.permute.default, (y, [0, 3, 1, 2]), grid.permute(0, 3, 1, 2))
            if grid.permute(0, 3, 1, 2).stride() != out.stride():  # eager's result is contiguous
                y = _call(gm, conv, aten.clone.default, (y,), out.new_empty(out.shape))
                y.kwargs = {"memory_format": torch.contiguous_format}
        conv.replace_all_uses_with(y)
        gm.graph.erase_node(conv)
        done.append(Rewrite("patches", conv.name))
    return done


def _patch_plan(gm, conv):
    """(input, weight tensor, bias node, patch order) when `conv` tiles its input with constant
    weights, at static shapes, and eager lays its result out contiguous or channels-last; else
    None. The patch order follows the input's layout, so packing it reads runs of memory."""
    if not (conv.op == "call_function" and conv.target in (aten.conv2d.default, aten.convolution.default)):
        return None
    if conv.target is aten.convolution.default and (_conv_arg(conv, "transposed") or any(_conv_arg(conv, "output_padding"))):
        return None
    x, w, bias, stride, padding, dilation, groups = _conv_args(conv)
    weight, xv, out = _attr(gm, w), getattr(x, "meta", {}).get("val"), conv.meta.get("val")
    if weight is None or not isinstance(xv, torch.Tensor) or not isinstance(out, torch.Tensor) or weight.dim() != 4:
        return None
    if bias is not None and _attr(gm, bias) is None:
        return None
    if M.static_ints(xv.shape) is None or M.static_ints(out.shape) is None or xv.dim() != 4 or not xv.is_floating_point():
        return None
    kernel = list(weight.shape[2:])
    if kernel == [1, 1]:
        return None  # pointwise: cuDNN runs it as a GEMM over the input as laid out, with no packing copy
    if (stride != kernel or padding != [0, 0] or dilation != [1, 1] or groups != 1
            or xv.shape[2] % kernel[0] or xv.shape[3] % kernel[1]):
        return None
    if not (M.surely(out.is_contiguous()) or M.surely(out.is_contiguous(memory_format=torch.channels_last))):
        return None
    nhwc = M.surely(xv.is_contiguous(memory_format=torch.channels_last)) and not M.surely(xv.is_contiguous())
    return x, weight, bias, (3, 5, 1) if nhwc else (1, 3, 5)


# ---------------------------------------------------------------- multi-head attention


def _fuse_attention(gm: torch.fx.GraphModule) -> list[Rewrite]:
    done = []
    for path, members in _attention_modules(gm).items():
        region = _attention_region(gm, members)
        if region is None or not _same_result(gm, members, region):
            continue
        x, weights, heads, out = region
        with gm.graph.inserting_before(out):
            fused = gm.graph.call_function(aten._native_multi_head_attention.default,
                                           (x, x, x, x.meta["val"].shape[2], heads, *weights),
                                           {"need_weights": False})
            first = gm.graph.call_function(operator.getitem, (fused, 0))
        val = out.meta["val"].new_empty(out.meta["val"].shape)  # the fused kernel's result is contiguous
        fused.meta.update({k: v for k, v in out.meta.items() if k != "val"})
        fused.meta["val"] = (val, val.new_empty((0,)))
        first.meta.update({k: v for k, v in out.meta.items() if k != "val"})
        first.meta["val"] = val
        out.replace_all_uses_with(first)
        for node in reversed(members):
            gm.graph.erase_node(node)
        done.append(Rewrite("attention", f"{path} ({len(members)} ops)"))
    return done


def _attention_modules(gm) -> dict[str, list[torch.fx.Node]]:
    """The call_function nodes of each call of an nn.MultiheadAttention (exactly that class: a
    subclass may do more), by the module stack's key for that call, in graph order."""
    found: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for key, (_path, kind) in (node.meta.get("nn_module_stack") or {}).items():
            name = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
            if name == _MHA_CLASS:
                found.setdefault(key, []).append(node)
                break
    return found


def _attention_region(gm, members):
    """(x, [in_w, in_b, out_w, out_b], heads, output node) when `members` is self-attention
    over one input with packed projections and no mask; None otherwise."""
    if any(n.target not in _MHA_OPS for n in members):
        return None  # anything else is not what the fused kernel computes
    inside = set(members)
    inputs = []
    for n in members:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outs = [n for n in members if any(u not in inside for u in n.users)]
    sdpa = [n for n in members if n.target is _SDPA]
    if len(outs) != 1 or len(sdpa) != 1 or len(inputs) != 5 or _has_mask_or_dropout(sdpa[0]):
        return None
    acts = [a for a in inputs if a.op != "get_attr"]
    if len(acts) != 1:
        return None
    x, out = acts[0], outs[0]
    xv, ov = x.meta.get("val"), out.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(ov, torch.Tensor) and xv.dim() == 3):
        return None
    shape = M.static_ints(xv.shape)
    if shape is None or M.static_ints(ov.shape) != shape:
        return None  # dynamic sizes: the numerical check needs concrete ones
    embed = shape[2]
    shapes = {tuple(_attr(gm, a).shape): a for a in inputs if a.op == "get_attr" and _attr(gm, a) is not None}
    want = [(3 * embed, embed), (3 * embed,), (embed, embed), (embed,)]
    if any(s not in shapes for s in want):
        return None
    q = sdpa[0].args[0].meta.get("val")
    q_shape = M.static_ints(q.shape) if isinstance(q, torch.Tensor) else None
    if q_shape is None or len(q_shape) != 4:
        return None
    return x, [shapes[s] for s in want], q_shape[1], out


def _has_mask_or_dropout(sdpa) -> bool:
    args = list(sdpa.args[3:]) + [sdpa.kwargs.get(k) for k in ("attn_mask", "dropout_p", "is_causal", "scale")]
    return any(a not in (None, 0, 0.0, False) for a in args)


def _same_result(gm, members, region) -> bool:
    """Run the traced ops and the fused op on one random input with the real weights."""
    x, weights, heads, out = region
    xv = x.meta["val"]
    shape = M.static_ints(xv.shape)  # static: _attention_region checked
    if shape is None or math.prod(shape) > _CHECK_ELEMENTS or not xv.dtype.is_floating_point:
        return False
    values = {w: _attr(gm, w).cpu() for w in weights}
    gen = torch.Generator().manual_seed(0)
    values[x] = torch.randn(shape, generator=gen).to(xv.dtype)
    try:
        with torch.no_grad():
            for n in members:
                args = torch.fx.node.map_arg(n.args, values.__getitem__)
                kwargs = torch.fx.node.map_arg(n.kwargs, values.__getitem__)
                values[n] = n.target(*args, **kwargs)
            fused = aten._native_multi_head_attention.default(values[x], values[x], values[x], shape[2], heads,
                                                              *(values[w] for w in weights), need_weights=False)[0]
    except Exception:  # noqa: BLE001 - an op the check cannot run here: keep the traced ops
        return False
    want = values[out]
    full = xv.dtype in (torch.float32, torch.float64)
    rtol, atol = (1e-4, 1e-5) if full else (2e-2, 2e-2)  # half precision rounds after every op
    return fused.shape == want.shape and torch.allclose(fused.float(), want.float(), rtol=rtol,
                                                        atol=atol * float(want.abs().max()) + 1e-6)


def fusion_notes(done: list[Rewrite]) -> dict[str, str]:
    """What `fuse_for_inference` did, as kernel choices of the method (shown by ferry inspect)."""
    count = {kind: sum(r.kind == kind for r in done)
             for kind in ("copy dropped", "fold", "conv relu", "patches", "attention", "mask dropped", "mask causal",
                          "gemm")}
    notes = {}
    if count["copy dropped"]:
        notes["clones dropped"] = (
            f"{count['copy dropped']} copies that keep the layout (dropout at inference) dropped: the value itself is read")
    if count["conv relu"]:
        notes["aten::relu.default"] = (
            f"{count['conv relu']} fused with the convolution (and residual add) before it (ferry::conv_relu, "
            "ferry::conv_add_relu): on CUDA one cuDNN call where eager would run cuDNN")
    if count["patches"]:
        notes["convolutions as patch GEMMs"] = (
            f"{count['patches']} convolution(s) whose kernel tiles the input run as one GEMM over the patches "
            "(the input packed into rows once, addmm with the weight laid out at compile time)")
    if count["gemm"]:
        notes["aten::linear.default"] = (
            f"{count['gemm']} run as eager's one GEMM over a 2-D view (addmm.out / mm.out into planned memory)")
    if count["fold"]:
        notes["aten::_native_batch_norm_legit_no_training.default"] = (
            f"{count['fold']} folded into the convolution before each (weights and bias scaled at compile time)")
    if count["attention"]:
        notes["aten::_native_multi_head_attention.default"] = (
            f"{count['attention']} nn.MultiheadAttention traced as separate ops, run as eager's fused inference kernel")
    if count["mask dropped"] or count["mask causal"]:
        notes["aten::scaled_dot_product_attention.default"] = (
            f"masks computed from constants, evaluated at compile time: {count['mask dropped']} all true (dropped), "
            f"{count['mask causal']} lower-triangular (is_causal=True); a fused kernel runs as without a mask")
    return notes


# ---------------------------------------------------------------- attention masks known at compile time

_SDPA_PARAMS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _simplify_attention_masks(gm: torch.fx.GraphModule) -> list[Rewrite]:
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        kwargs = {**dict(zip(_SDPA_PARAMS, node.args[3:])), **node.kwargs}
        mask = kwargs.get("attn_mask")
        value = _constant_value(gm, mask, {}) if isinstance(mask, torch.fx.Node) else None
        if value is None or value.dtype != torch.bool:
            continue
        shapes = _fits(value, *(a.meta.get("val") for a in node.args[:2]))
        if shapes is None:
            continue
        q, k = shapes
        if bool(value.all()):
            kind = "mask dropped"
        elif not kwargs.get("is_causal") and _is_causal(value, q, k):
            kwargs["is_causal"], kind = True, "mask causal"
        else:
            continue
        kwargs["attn_mask"] = None
        node.args, node.kwargs = tuple(node.args[:3]), kwargs
        done.append(Rewrite(kind, node.name))
    return done


def _is_causal(mask: torch.Tensor, q: tuple, k: tuple) -> bool:
    rows, cols = q[-2], k[-2]
    if rows != cols or mask.dim() < 2 or tuple(mask.shape[-2:]) != (rows, cols):
        return False
    return bool((mask == torch.ones(rows, cols, dtype=torch.bool).tril()).all())


def _fits(mask: torch.Tensor, q, k):
    """(q, k) as static shapes when `mask` broadcasts to the attention weights' shape without
    growing it (else eager raises, and so must ferry); None otherwise."""
    qs = M.static_ints(q.shape) if isinstance(q, torch.Tensor) else None
    ks = M.static_ints(k.shape) if isinstance(k, torch.Tensor) else None
    if qs is None or ks is None or mask.dim() > len(qs):
        return None
    weights = (*qs[:-1], ks[-2])
    try:
        return (qs, ks) if torch.broadcast_shapes(tuple(mask.shape), weights) == weights else None
    except RuntimeError:
        return None


def _small(val) -> bool:
    """A traced result of static shape small enough to compute at compile time."""
    shape = M.static_ints(val.shape) if isinstance(val, torch.Tensor) else None
    return shape is not None and math.prod(shape) <= _CHECK_ELEMENTS


def _constant_value(gm, node, memo: dict):
    """The value of `node` when it depends on constants alone (evaluated on the CPU), else None."""
    if node in memo:
        return memo[node]
    memo[node] = None
    if node.op == "get_attr":
        memo[node] = _attr(gm, node)
    elif (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
          and torch.Tag.nondeterministic_seeded not in node.target.tags and _small(node.meta.get("val"))):
        inputs = [_constant_value(gm, a, memo) for a in node.all_input_nodes]
        if all(isinstance(v, torch.Tensor) for v in inputs):
            values = dict(zip(node.all_input_nodes, inputs))
            args = torch.fx.node.map_arg(node.args, values.__getitem__)
            kwargs = dict(torch.fx.node.map_arg(node.kwargs, values.__getitem__))
            if "device" in kwargs:
                kwargs["device"] = torch.device("cpu")
            try:
                result = node.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - not computable here: left to run time
                result = None
            if isinstance(result, torch.Tensor) and result.numel() <= _CHECK_ELEMENTS:
                memo[node] = result
    return memo[node]


# ---------------------------------------------------------------- linear as one GEMM over rows


def _linear_as_gemm(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """`linear(x, w, b)` -> `view(addmm(b, view(x, (rows, k)), t(w)), (..., n))` (`mm` without a
    bias), what eager's linear computes for a contiguous input; x of static shape only, and not
    where a batched result is the delegate's own output (a view there would cost a copy)."""
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        xv, wv, out = x.meta.get("val"), w.meta.get("val"), node.meta.get("val")
        if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor) and isinstance(out, torch.Tensor)):
            continue
        shape, out_shape = M.static_ints(xv.shape), M.static_ints(out.shape)
        if shape is None or out_shape is None or len(shape) < 2 or wv.dim() != 2 or not M.surely(xv.is_contiguous()):
            continue
        bv = b.meta.get("val") if isinstance(b, torch.fx.Node) else None
        if b is not None and not (isinstance(bv, torch.Tensor) and tuple(bv.shape) == (out_shape[-1],)):
            continue  # addmm broadcasts a bias over rows only: a (rows-like, n) bias stays with linear
        if len(shape) > 2 and any(u.op == "output" for u in node.users):
            continue  # a view as the delegate's result would be copied out: linear writes the caller's tensor
        rows = (math.prod(shape[:-1]), shape[-1])
        with gm.graph.inserting_before(node):
            flat = x if len(shape) == 2 else _call(gm, node, aten.view.default, (x, list(rows)), xv.new_empty(rows))
            wt = _call(gm, node, aten.t.default, (w,), wv.t())
            res = out.new_empty((rows[0], out_shape[-1]))
            gemm = (_call(gm, node, aten.mm.default, (flat, wt), res) if b is None
                    else _call(gm, node, aten.addmm.default, (b, flat, wt), res))
            y = gemm if len(shape) == 2 else _call(gm, node, aten.view.default, (gemm, list(out_shape)), out)
        node.replace_all_uses_with(y)
        gm.graph.erase_node(node)
        done.append(Rewrite("gemm", node.name))
    return done


def _call(gm, like: torch.fx.Node, op, args, val) -> torch.fx.Node:
    """A new node calling `op`, with `like`'s metadata (device, module stack) and value `val`."""
    node = gm.graph.call_function(op, args)
    node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    node.meta["val"] = val
    return node
