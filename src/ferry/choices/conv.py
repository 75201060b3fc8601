"""The convolution family. At compile time: batch norms folded into the convolution before them,
`relu(conv + z)` as one fused op (ops/fused.py), a convolution that tiles its input as one GEMM
over patches. At load: which kernels run a convolution of one image on CUDA in a plan captured as
CUDA graphs: cuDNN's fused call, or one cuBLAS GEMM over the image's patches.

A convolution of one NCHW image is one matrix product: the weight's (out, in x kernel) matrix
times the image's patches, (in x kernel, pixels), which `unfold` (im2col) lays out in one kernel;
for a 1x1 kernel of stride 1 the image itself is that matrix. cuDNN's fp32 kernels leave most of
an H200 idle when the image is small and the channels many; at batch 1 with TF32 off
(bench/results/conv_gemm.json, µs replayed from a graph):

    ResNet's 3x3, 512 channels at 7x7       cuDNN 107.3   im2col + GEMM 27.5
    3x3, 256 channels at 14x14              cuDNN  55.2   im2col + GEMM 24.5
    1x1, 2048 to 512 channels at 7x7        cuDNN  49.3   GEMM          13.0
    3x3, 64 channels at 56x56               cuDNN  17.5   im2col + GEMM 25.5 (cuDNN stays)

No rule of shapes holds across GPUs, so each distinct convolution of ferry's fused ops
(ops/fused.py) is timed both ways when a method loads, and the GEMM kept where it saves at
least 10% and 2 µs (choices/timing.py). The inductor backend asks the same of each convolution
in a graph it compiles (`gemm_rewrites`), and hands Inductor the GEMM's ops where it is faster.

Only in captured plans: the GEMM form launches up to five kernels for cuDNN's one, and without
graphs that made ResNet-50 at batch 1 slower (bench/results/conv1x1_gemm_experiment.json). Only
fp32 and fp64 where cuDNN would run it, without groups, and not where GEMMs may use TF32 while
cuDNN may not (the result would be less precise than eager's). The patches are a tensor the
call allocates (at most 2^24 elements, 64 MiB in fp32; from the graph's pool). Under deterministic algorithms cuDNN's
call is not made at all (ops/fused.py).
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable

import torch
import torch.fx
from torch.nn.utils.fusion import fuse_conv_bn_weights

from ferry import node_meta as M
from ferry.choices import timing
from ferry.choices.decisions import DECISIONS, Decision, Site
from ferry.choices.gemm import blas_settings
from ferry.choices.graph_edits import Rewrite, attr, call, constant, single_use
from ferry.ops import fused
from ferry.ops.fused import CONV_ADD_RELU, CONV_RELU

__all__ = ["OPS", "PATTERNS", "conv_as_gemm", "form", "gemm_rewrites"]

aten = torch.ops.aten
OPS = frozenset({fused.CONV_RELU, fused.CONV_ADD_RELU})
FAMILY = "convolution of one image"
FORMS = ("cuDNN", "one GEMM over patches")
_CONVS = (aten.conv2d.default, aten.conv1d.default, aten.conv3d.default, aten.convolution.default)
_BATCH_NORM = aten._native_batch_norm_legit_no_training.default
_DTYPES = (torch.float32, torch.float64)



def conv_as_gemm(x, weight, bias, z=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1)):
    """relu(conv2d(x, weight, bias, stride, padding, dilation) + z) for one NCHW image (z may be
    None): one GEMM of the weight over the image's patches, then the bias, the residual and the
    ReLU in place on its result."""
    y = _gemm(x, weight, stride, padding, dilation)
    co, ho, wo = fused.result_shape(x, weight, stride, padding, dilation)[1:]
    if bias is not None:
        y.add_(bias.view(co, 1))
    if z is not None:
        y.add_(z.reshape(co, ho * wo))
    return y.relu_().view(1, co, ho, wo)


def _gemm(x, weight, stride, padding, dilation) -> torch.Tensor:
    """The weight's (out, in x kernel) matrix times the image's patches: (out, pixels)."""
    co, ci, kh, kw = weight.shape
    ho, wo = fused.result_shape(x, weight, stride, padding, dilation)[2:]
    if fused.pointwise(weight, stride, padding):
        patches = x.reshape(ci, ho * wo)  # a view where the layout allows, as planned
    else:
        patches = torch.nn.functional.unfold(x, (kh, kw), dilation, padding, stride)[0]  # (ci*kh*kw, ho*wo)
    return torch.mm(weight.reshape(co, ci * kh * kw), patches)


def _relu_form(x, weight, bias, stride, padding, dilation, groups):
    return conv_as_gemm(x, weight, bias, None, stride, padding, dilation)


def _add_relu_form(x, weight, z, bias, stride, padding, dilation, groups):
    return conv_as_gemm(x, weight, bias, z, stride, padding, dilation)


def form(op, args: list, kwargs: dict, site: Site) -> Callable | None:
    """The load-time hook (choices/hook.py): in a captured plan, the GEMM form of a fused
    convolution op (its own signature) where this GPU runs it faster than cuDNN for arguments like
    these (real tensors, or meta tensors of the same shape, strides and dtype); otherwise None."""
    residual = op is fused.CONV_ADD_RELU
    if not site.captured or kwargs or op not in OPS or len(args) != (8 if residual else 7):
        return None
    x, weight, z = args[0], args[1], args[2] if residual else None
    bias, stride, padding, dilation, groups = args[3:] if residual else args[2:]
    if not _one_image(x, weight, bias, z, stride, padding, dilation, groups):
        return None
    device = timing.gpu_of([t for t in (x, weight, bias, z) if t is not None], site.device)
    if device is None:
        return None
    key = (FAMILY, str(device), x.dtype, *blas_settings(), torch.backends.cudnn.allow_tf32, site.replays,
           tuple(x.shape), tuple(weight.shape), bias is None, residual, *map(tuple, (stride, padding, dilation)))
    decision = DECISIONS.get(key, lambda: _decide(device, op, args, residual, site), timing.may_time(site, device))
    if decision is None or not decision.taken:
        return None
    return _add_relu_form if residual else _relu_form


def _one_image(x, weight, bias, z, stride, padding, dilation, groups) -> bool:
    tensors = [t for t in (x, weight, bias, z) if t is not None]
    if not all(isinstance(t, torch.Tensor) for t in tensors) or x.dim() != 4 or x.shape[0] != 1 or groups != 1:
        return False
    if not fused.args_fit(x, weight, bias, stride, padding, dilation, groups):
        return False  # eager refuses it: the GEMM must not answer it
    out = fused.result_shape(x, weight, stride, padding, dilation)
    small = fused.pointwise(weight, stride, padding) or math.prod(weight.shape[1:]) * out[2] * out[3] <= fused.MAX_PATCHES
    full_precision = x.dtype in _DTYPES and (z is None or z.dtype == x.dtype) and not (
        torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32)  # GEMMs no less precise
    fits_z = z is None or tuple(z.shape) == out
    return fits_z and small and full_precision and all(t.is_contiguous() for t in tensors)


def _decide(device, op, args, residual, site: Site) -> Decision | None:
    """The two forms timed in the room the plan's load left for a call's results where it has
    enough (CUDA graphs: `Site.timing_room`), stand-ins included: in a segment of their own, a
    first-stage image and its result took 20 MiB (MobileNetV3's load reserved 86 MiB at its peak,
    against eager's 70)."""
    with timing.deciding(device, site):
        try:
            nbytes = _timed_bytes(args)
            room = site.timing_room(nbytes) if nbytes else None  # (small blocks: no segment of their own)
            real = _stand_ins(args, device, room)
            x, weight = real[0], real[1]
            bias, z = (real[3], real[2]) if residual else (real[2], None)
            conv = real[-4:-1]
            if not fused.cudnn_takes(x, weight, bias, *real[-4:]):
                return None  # eager's convolution is not cuDNN's here: the op runs that, and stays
            times = timing.time_both(lambda: op(*real), lambda: conv_as_gemm(x, weight, bias, z, *conv),
                                     site.replay_stream(), room=room)
        except torch.cuda.OutOfMemoryError:
            return None
    return _decision(str(op.name()), x, weight, conv, " + residual" if residual else "", device, times)


def _stand_ins(args, device, room) -> list:
    """The op's arguments for timing: weights as they are, one stand-in for each layout of the
    values a call reads (an image and a residual of its shape share one: only read), a large one
    in `room` where lent (a small one there would make the pool a small segment it keeps)."""
    made: dict = {}
    real = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type == "meta":
            key = (tuple(a.shape), a.stride(), a.dtype)
            if key not in made:
                large = room is not None and timing.large_bytes(a.numel() * a.element_size())
                with room.allocating() if large else contextlib.nullcontext():
                    made[key] = timing.scratch(a, device)
            a = made[key]
        elif isinstance(a, torch.Tensor):
            a = timing.scratch(a, device)
        real.append(a)
    return real


def _timed_bytes(args) -> int:
    """Room for timing the forms: the result (each form's in turn, one pool), the patches of a
    GEMM form that is not pointwise, and a stand-in for each layout of the values a call reads
    (`_stand_ins`; counted even where the method's arena will hold them)."""
    x, weight = args[0], args[1]
    stride, padding, dilation = args[-4:-1]
    out = fused.result_shape(x, weight, stride, padding, dilation)
    co, ci, kh, kw = weight.shape
    size = x.element_size()
    patches = 0 if fused.pointwise(weight, stride, padding) else ci * kh * kw * out[2] * out[3] * size
    layouts = {(tuple(a.shape), a.stride(), a.dtype): a.numel() * a.element_size() for a in args
               if isinstance(a, torch.Tensor) and a.device.type == "meta"}
    return timing.large_bytes(math.prod(out) * size, patches, *layouts.values())


def _decision(op: str, x, weight, conv, extra: str, device, times) -> Decision:
    """The decision, its shape told as kernel, then out x inner x pixels of the GEMM."""
    co, ci, kh, kw = weight.shape
    pixels = math.prod(fused.result_shape(x, weight, *conv)[2:])
    return timing.decision(FAMILY, op, f"{kh}x{kw}{extra}, {co}x{ci * kh * kw}x{pixels}", device, x.dtype, FORMS,
                           times)


# ---------------------------------------------------------------- the inductor backend's form


def gemm_rewrites(gm: torch.fx.GraphModule, shapes: dict[torch.fx.Node, torch.Tensor], site: Site) -> list[Decision]:
    """The inductor backend's form of the choice, at load, in a graph of static sizes in a plan
    captured as CUDA graphs: each convolution of one image that one GEMM over its patches runs
    faster (timed, as `form`'s) becomes `im2col` (a reshape of the image for a 1x1 kernel of
    stride 1 without padding), `mm` and the bias; Inductor gathers the patches in a kernel of its
    own, calls cuBLAS for the GEMM and fuses the bias into what follows (a batch norm, a
    residual, a ReLU). Left to itself Inductor calls cuDNN: ResNet-50 at batch 1 took 2.75 ms
    with graphs, and 1.14 with this choice (H200, fp32, TF32 off). `shapes`: a meta tensor per
    node, as the dry run made it. Returns the decisions."""
    if not site.captured:
        return []
    made = []
    for node in list(gm.graph.nodes):
        args = _plain_conv(gm, node, shapes)
        decision = None if args is None else _plain_decision(args, site)
        if args is None or decision is None:
            continue
        made.append(decision)
        if decision.taken:
            _as_gemm(gm, node, args)
    if any(d.taken for d in made):
        gm.recompile()
    return made


def _plain_conv(gm, node, shapes) -> tuple | None:
    """(x, weight, bias, stride, padding, dilation) of a 2-D convolution of one image by a
    constant weight that `_one_image` takes (x a meta tensor, weight and bias real), or None."""
    if not _conv2d(node):
        return None
    x, w, b, stride, padding, dilation, groups = _conv_args(node)
    xv, weight = shapes.get(x) if isinstance(x, torch.fx.Node) else None, attr(gm, w)
    bias = attr(gm, b) if b is not None else None
    if xv is None or weight is None or (b is not None and bias is None) or M.static_ints(xv.shape) is None:
        return None
    if not _one_image(xv, weight, bias, None, stride, padding, dilation, groups):
        return None
    return xv, weight, bias, stride, padding, dilation


def _plain_decision(args: tuple, site: Site) -> Decision | None:
    x, weight, bias, stride, padding, dilation = args
    device = timing.gpu_of([weight], site.device)
    if device is None:
        return None
    key = ("aten.convolution", FAMILY, str(device), x.dtype, *blas_settings(), torch.backends.cudnn.allow_tf32,
           site.replays, tuple(x.shape), tuple(weight.shape), bias is None, *map(tuple, (stride, padding, dilation)))
    return DECISIONS.get(key, lambda: _decide_plain(device, args, site), timing.may_time(site, device))


def _decide_plain(device, args: tuple, site: Site) -> Decision | None:
    """cuDNN's convolution with its bias, as eager runs it, against the patches and one GEMM, bias
    added (Inductor calls cuDNN without the bias and adds it in a kernel of its own, and may lay
    the image out channels last: the timing stands for what its code runs, it is not it)."""
    x_in, weight_in, bias_in, stride, padding, dilation = args
    with timing.deciding(device, site):
        try:
            x, weight = timing.scratch(x_in, device), timing.scratch(weight_in, device)
            bias = None if bias_in is None else timing.scratch(bias_in, device)
            if not fused.cudnn_takes(x, weight, bias, stride, padding, dilation, 1):
                return None  # eager's convolution is not cuDNN's here: Inductor's call stays
            times = timing.time_both(
                lambda: aten.convolution.default(x, weight, bias, stride, padding, dilation, False, [0, 0], 1),
                lambda: _patches_gemm(x, weight, bias, stride, padding, dilation), site.replay_stream())
        except torch.cuda.OutOfMemoryError:
            return None
    return _decision("aten.convolution", x, weight, (stride, padding, dilation), "", device, times)


def _patches_gemm(x, weight, bias, stride, padding, dilation):
    """conv2d(x, weight, bias) of one image as the rewritten graph computes it (`_as_gemm`)."""
    y = _gemm(x, weight, stride, padding, dilation)
    co, ho, wo = fused.result_shape(x, weight, stride, padding, dilation)[1:]
    return (y if bias is None else y.add_(bias.view(co, 1))).view(1, co, ho, wo)


def _as_gemm(gm: torch.fx.GraphModule, node: torch.fx.Node, args: tuple) -> None:
    """Replace convolution `node` by `_patches_gemm`'s ops."""
    x, weight, bias = _conv_args(node)[:3]
    xv, w, _, stride, padding, dilation = args
    co, ci, kh, kw = w.shape
    ho, wo = fused.result_shape(xv, w, stride, padding, dilation)[2:]
    g = gm.graph
    with g.inserting_before(node):
        if fused.pointwise(w, stride, padding):  # (a reshape: Inductor may lay x out otherwise than the dry run did)
            patches = g.call_function(aten.reshape.default, (x, [ci, ho * wo]))
        else:
            cols = g.call_function(aten.im2col.default, (x, [kh, kw], list(dilation), list(padding), list(stride)))
            patches = g.call_function(aten.view.default, (cols, [ci * kh * kw, ho * wo]))
        y = g.call_function(aten.mm.default, (g.call_function(aten.view.default, (weight, [co, ci * kh * kw])), patches))
        if bias is not None:
            y = g.call_function(aten.add.Tensor, (y, g.call_function(aten.view.default, (bias, [co, 1]))))
        out = g.call_function(aten.view.default, (y, [1, co, ho, wo]))
    node.replace_all_uses_with(out)
    g.erase_node(node)


# ---------------------------------------------------------------- compile time


def fold_batch_norms(gm: torch.fx.GraphModule) -> list[Rewrite]:
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
            w = constant(gm, f"{conv.name}_folded_weight", weight, conv.args[1])
            b = constant(gm, f"{conv.name}_folded_bias", bias, conv.args[1])
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
    gamma, beta, mean, var = (attr(gm, a) for a in bn.args[1:5])
    if (bn.args[1] is not None and gamma is None) or (bn.args[2] is not None and beta is None):
        return None  # a scale or shift computed in the graph (a parametrization, FiLM): not a constant
    weight = attr(gm, conv.args[1])
    bias = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
    bias_t = attr(gm, bias) if bias is not None else None
    if weight is None or mean is None or var is None or (bias is not None and bias_t is None):
        return None
    def double(t):
        return None if t is None else t.double()

    # torch's own folding (what torch.ao's fusion uses), in float64, then back to the weight's dtype
    w, b = fuse_conv_bn_weights(weight.double(), double(bias_t), mean.double(), var.double(), float(bn.args[6]),
                                double(gamma), double(beta))
    return w.detach().to(weight.dtype), b.detach().to(weight.dtype)


# ---------------------------------------------------------------- convolution, bias, add, ReLU as one kernel



def fuse_conv_relu(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """`relu(conv(x))` -> `ferry::conv_relu`, `relu(conv(x) + z)` -> `ferry::conv_add_relu`
    (ops/fused.py: one cuDNN call on CUDA where eager would run cuDNN). Only a 2-D
    convolution that nothing else reads, and a `z` of its result's exact shape,
    dtype and layout (no broadcast). The graph is functional here (lowering made it so): an
    in-place `relu_` or `+=` of the module is a `relu` or `add` by now."""
    done = []
    for relu in list(gm.graph.nodes):
        if relu.op != "call_function" or relu.target is not aten.relu.default:
            continue
        src, z = relu.args[0], None
        if single_use(src) and src.target is aten.add.Tensor and not src.kwargs and len(src.args) == 2:
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
            fused = (call(gm, relu, CONV_RELU, (x, w, bias, stride, padding, dilation, groups), relu.meta["val"])
                     if z is None else
                     call(gm, relu, CONV_ADD_RELU, (x, w, z, bias, stride, padding, dilation, groups), relu.meta["val"]))
        relu.replace_all_uses_with(fused)
        for dead in (relu, src, conv) if z is not None else (relu, conv):
            gm.graph.erase_node(dead)
        done.append(Rewrite("conv relu", f"{conv.name} + {'add + ' if z is not None else ''}{relu.name}"))
    return done


def _fusable_conv(node) -> bool:
    """A 2-D, not transposed convolution (of any sizes: the fused op computes the same at each)
    whose one reader is the next op."""
    if not single_use(node) or not _conv2d(node):
        return False
    val, x = node.meta.get("val"), node.args[0]
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and isinstance(xv, torch.Tensor) and val.dim() == 4 and val.is_floating_point()


def _conv2d(node) -> bool:
    """A `conv2d` node, or a `convolution` node that is not transposed (its input may be 2-D too:
    callers check the shapes)."""
    if node.op != "call_function" or node.target not in (aten.conv2d.default, aten.convolution.default):
        return False
    return node.target is aten.conv2d.default or not (_conv_arg(node, "transposed")
                                                       or any(_conv_arg(node, "output_padding")))


def _same_tensor_type(conv, z) -> bool:
    cv = conv.meta.get("val")
    zv = z.meta.get("val") if isinstance(z, torch.fx.Node) else None
    return (isinstance(zv, torch.Tensor) and M.same_sizes(zv.shape, cv.shape) and zv.dtype == cv.dtype
            and M.same_sizes(zv.stride(), cv.stride()))


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


def patches_as_gemm(gm: torch.fx.GraphModule) -> list[Rewrite]:
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
                    laid_out[key] = constant(gm, f"{conv.name}_patch_weight", laid.reshape(o, k).contiguous(),
                                              conv.args[1])
            wnode = laid_out[key]
            split = xv.view(n, c, h // kh, kh, w // kw, kw)
            tiles = call(gm, conv, aten.view.default, (x, list(split.shape)), split)
            dims = [0, 2, 4, *order]
            moved = call(gm, conv, aten.permute.default, (tiles, dims), split.permute(dims))
            packed = call(gm, conv, aten.clone.default, (moved,), split.permute(dims).contiguous(),
                          {"memory_format": torch.contiguous_format})
            flat = call(gm, conv, aten.view.default, (packed, [rows, k]), xv.new_empty(rows, k))
            wt = call(gm, conv, aten.t.default, (wnode,), wnode.meta["val"].t())
            res = out.new_empty(rows, o)
            gemm = (call(gm, conv, aten.mm.default, (flat, wt), res) if bias is None
                    else call(gm, conv, aten.addmm.default, (bias, flat, wt), res))
            grid = res.view(n, h // kh, w // kw, o)
            y = call(gm, conv, aten.view.default, (gemm, list(grid.shape)), grid)
            y = call(gm, conv, aten.permute.default, (y, [0, 3, 1, 2]), grid.permute(0, 3, 1, 2))
            if grid.permute(0, 3, 1, 2).stride() != out.stride():  # eager's result is contiguous
                y = call(gm, conv, aten.clone.default, (y,), out.new_empty(out.shape),
                         {"memory_format": torch.contiguous_format})
        conv.replace_all_uses_with(y)
        gm.graph.erase_node(conv)
        done.append(Rewrite("patches", conv.name))
    return done


def _patch_plan(gm, conv):
    """(input, weight tensor, bias node, patch order) when `conv` tiles its input with constant
    weights, at static shapes, and eager lays its result out contiguous or channels-last; else
    None. The patch order follows the input's layout, so packing it reads runs of memory."""
    if not _conv2d(conv):
        return None
    x, w, bias, stride, padding, dilation, groups = _conv_args(conv)
    weight, xv, out = attr(gm, w), getattr(x, "meta", {}).get("val"), conv.meta.get("val")
    if weight is None or not isinstance(xv, torch.Tensor) or not isinstance(out, torch.Tensor) or weight.dim() != 4:
        return None
    if bias is not None and attr(gm, bias) is None:
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


PATTERNS = (fold_batch_norms, fuse_conv_relu, patches_as_gemm)
