"""Rewrites that give a delegate the fused kernels eager PyTorch runs at inference.

Export traces what a module does in general; eager, at inference, takes shortcuts the trace
does not show. These cost ferry the most on real models (measured on an H200, batch 1):

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
- A value computed from constants alone (Swin's window masks and position biases: ~150 kernels
  per Swin-T call) is computed once at compile time and stored (aot/constant_fold.py).
- A batch norm after a convolution, with fixed statistics, is a per-channel scale and shift:
  folded into the convolution's weights and bias, it costs nothing per call. Unfolded it is
  a kernel and, on CUDA, a host-side copy of its statistics per call (53 per ResNet-50 call).

All run after partitioning, on each delegate's subgraph: partitioners and `exclude=` see the
ops the user wrote. The attention rewrite fires only on exactly `nn.MultiheadAttention`'s own
ops and is checked numerically against them before it replaces them; the fold and the masks
are exact algebra on constants. At dynamic sizes (a batch, a length): linear as a GEMM, the
fold and the fused convolutions are the same algebra at every size; attention's numerical check
runs at the traced sizes and again with the dynamic sizes one larger; a mask is evaluated at
every value its bounded sizes may take (0 to the bound, at most 512 combinations), and stays
otherwise. Patches as a GEMM stay static-only (their packing is laid out per shape).
"""

from __future__ import annotations

import torch
import torch.fx

from ferry.aot import gemm_scales, layout_chains, permuted_reads
from ferry.aot.constant_fold import fold_constants
from ferry.choices import attention, conv, gemm, norms, projections
from ferry.choices.graph_edits import Rewrite, call
from ferry.device import CPU, Device

__all__ = ["Rewrite", "fuse_for_inference", "fusion_notes", "merge_for_compiler"]

aten = torch.ops.aten


def fuse_for_inference(gm: torch.fx.GraphModule, merged: dict | None = None, device: Device = CPU) -> list[Rewrite]:
    """Rewrite `gm` (a delegate's subgraph: constants are get_attr) in place; return what was done.
    The patterns are the op families' own (choices/conv.py, attention.py, gemm.py), run in the
    order they are tested in: q/k/v slices copied once (layout_chains.py), copies dropped,
    convolutions, attention, projections of one input merged, linears as GEMMs, batched products'
    scales taken into the GEMM's alpha and layer scales into the weights (gemm_scales.py); then
    values computed from constants alone are folded (constant_fold.py), chains of copies become one
    view or gather (layout_chains.py), an elementwise op reads a permuted value where it read a copy
    of it (permuted_reads.py), a residual add and the layer norm of its sum become one op, and
    so does an RMS norm written out (choices/norms.py).
    `merged`: the program's stacked weights (projections.merge_projections); `device`: the
    delegate's."""
    done = layout_chains.slices_copied_once(gm) + _drop_copies(gm) + _pools_as_means(gm)
    for pattern in (*conv.PATTERNS, *attention.PATTERNS):
        done += pattern(gm)
    done += projections.merge_projections(gm, merged)
    for pattern in gemm.PATTERNS:
        done += pattern(gm)
    done += gemm_scales.scales_as_alpha(gm) + gemm_scales.layer_scales_into_weights(gm)
    done += fold_constants(gm)
    done += layout_chains.chains_as_gathers(gm)
    done += permuted_reads.reads_through_permutes(gm)
    done += norms.residual_norms(gm) + norms.rms_norms(gm) if not device.is_cpu else []
    if done:
        tidy(gm)
    return done


def merge_for_compiler(gm: torch.fx.GraphModule, merged: dict | None = None) -> list[Rewrite]:
    """What a graph compiler (the inductor backend) does not do itself: grouped KV heads read by
    attention as they are (no repeated copy of the cache), a boolean mask that several attention
    calls share made additive once (each call would convert it again), and projections of one input merged
    into one GEMM over stacked weights (Inductor keeps each linear its own cuBLAS call).
    `merged`: the program's stacked weights, shared by its methods (projections.merge_projections)."""
    done = attention.grouped_heads(gm) + attention.additive_masks(gm) + projections.merge_projections(gm, merged)
    if done:
        tidy(gm)
    return done


def tidy(gm: torch.fx.GraphModule) -> None:
    """Erase what only rewritten nodes read (a dropped mask, unread constants), then recompile."""
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and (node.op == "get_attr" or (node.op == "call_function" and not node.is_impure())):
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


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


_POOLS = {aten.adaptive_avg_pool2d.default: [-1, -2], aten.adaptive_avg_pool3d.default: [-1, -2, -3]}


def _pools_as_means(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """`adaptive_avg_pool2d(x, 1)` -> `mean(x, (-1, -2), keepdim=True)`, as eager's composite
    runs it. The `.out` overload ferry would call goes straight to the pooling kernel, which
    sums each channel's pixels in one thread: 677 of EfficientNet-B0's 1,770 µs on an H100 (its
    squeeze-excitation blocks), where the mean is a few µs each. The same kernel as eager's,
    so the same bits."""
    done = []
    for node in list(gm.graph.nodes):
        dims = _POOLS.get(node.target) if node.op == "call_function" else None
        val = node.meta.get("val")
        if dims is None or not isinstance(val, torch.Tensor) or list(node.args[1]) != [1] * len(dims):
            continue
        if val.is_quantized or not val.is_contiguous():
            continue
        with gm.graph.inserting_before(node):
            mean = call(gm, node, aten.mean.dim, (node.args[0], dims, True), val)
        node.replace_all_uses_with(mean)
        gm.graph.erase_node(node)
        done.append(Rewrite("pool as mean", node.name))
    return done


# kind of rewrite -> (the kernel choice it is noted under, what was done; {n}: how many times)
_NOTES = {
    "grouped heads": ("attention over grouped KV heads", "{n} attention(s) read each KV head for its group of query "
                      "heads (enable_gqa): the traced copies repeating the cache per query head are gone"),
    "projections merged": ("linears of one input merged", "{n} linears reading one input (q/k/v, gate/up) run as "
                           "fewer GEMMs over their weights stacked at compile time, each result a slice"),
    "additive mask": ("boolean attention masks made additive once", "{n} attention(s) read one additive mask made "
                      "once from the boolean mask they share (ATen converts it inside every call)"),
    "rows padded": ("aten::_int_mm.default", "{n} int8 product(s) of 16 rows or fewer (or of a count that may be) "
                    "run on zero rows appended (CUDA's kernel takes 17 or more; an integer product, exact), their "
                    "first rows kept"),
    "copy dropped": ("clones dropped", "{n} copies that keep the layout (dropout at inference) dropped: the value "
                     "itself is read"),
    "conv relu": ("aten::relu.default", "{n} fused with the convolution (and residual add) before it "
                  "(ferry::conv_relu, ferry::conv_add_relu): on CUDA one cuDNN call where eager would run cuDNN"),
    "patches": ("convolutions as patch GEMMs", "{n} convolution(s) whose kernel tiles the input run as one GEMM over "
                "the patches (the input packed into rows once, addmm with the weight laid out at compile time)"),
    "gemm": ("aten::linear.default", "{n} run as eager's one GEMM over a 2-D view (addmm.out / mm.out into planned "
             "memory)"),
    "pool as mean": ("aten::adaptive_avg_pool2d.default", "{n} pooled to one value per channel run as eager runs "
                     "them, as a mean over the spatial dims (its .out kernel loops over each channel's pixels in one "
                     "thread)"),
    "slices copied once": ("permuted values copied once", "{n} permuted value(s) whose slices were each copied "
                           "before a product (q, k and v of one projection) copied once, their slices contiguous"),
    "chain as view": ("data movement as a view", "{n} chain(s) of copies (a pad of nothing, a permute and its "
                      "inverse) whose result is their input reshaped: read as a view"),
    "chain as gather": ("data movement as one gather", "{n} chain(s) of rolls, permutes and copies (window "
                        "partitions) run as one index_select of whole rows, their order a constant"),
    "scale as alpha": ("batched products scaled by a number", "{n} product(s) of q and kᵀ scaled before or after "
                       "(by a number) run as one GEMM whose alpha is the scale (aot/gemm_scales.py): equal to eager "
                       "within rounding"),
    "layer scale into weight": ("products scaled per column", "{n} product(s) whose result a constant scales per "
                                "column (a layer scale) run with the weight and bias scaled at compile time: no kernel "
                                "for the scale (aot/gemm_scales.py), equal to eager within rounding"),
    "read through permute": ("copies read through a permute", "{n} contiguous copy(ies) of a permuted value "
                             "(a window reverse) read only by exactly rounded elementwise ops reshaped: the ops read "
                             "the permuted value, their other operands split to match (aot/permuted_reads.py)"),
    "add + layer norm": ("residual adds with their layer norm", "{n} residual add(s) whose sum a layer norm reads "
                         "run as one ferry::add_layer_norm: the add and the norm as eager runs them, or one kernel "
                         "for both where the load times it faster in a captured plan (choices/norms.py)"),
    "rms norm": ("RMS norms written out", "{n} RMS norm(s) written out op by op (pow, mean, rsqrt, products) run "
                 "as one ferry::rms_norm: those ops as eager runs them, or one kernel where the load times it "
                 "faster in a captured plan (choices/norms.py)"),
    "constants folded": ("values computed from constants", "{n} value(s) computed from constants alone (a "
                         "window mask, a position bias) computed at compile time and stored: their ops no longer run "
                         "per call (aot/constant_fold.py)"),
    "fold": ("aten::_native_batch_norm_legit_no_training.default", "{n} folded into the convolution before each "
             "(weights and bias scaled at compile time)"),
    "attention": ("aten::_native_multi_head_attention.default", "{n} nn.MultiheadAttention traced as separate ops, "
                  "run as eager's fused inference kernel"),
}


def fusion_notes(done: list[Rewrite]) -> dict[str, str]:
    """What `fuse_for_inference` did, as kernel choices of the method (shown by ferry inspect)."""
    count = {kind: sum(r.kind == kind for r in done) for kind in (*_NOTES, "mask dropped", "mask causal")}
    notes = {key: text.format(n=count[kind]) for kind, (key, text) in _NOTES.items() if count[kind]}
    if count["mask dropped"] or count["mask causal"]:
        notes["aten::scaled_dot_product_attention.default"] = (
            f"masks computed from constants, evaluated at compile time: {count['mask dropped']} all true (dropped), "
            f"{count['mask causal']} lower-triangular (is_causal=True); a fused kernel runs as without a mask")
    return notes
