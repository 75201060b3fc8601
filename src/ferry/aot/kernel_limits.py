"""Shapes an op accepts that its device's kernel refuses, turned into shapes it takes, exactly.

CUDA's `_int_mm` (int8 x int8 -> int32, on cuBLASLt) needs more than 16 rows in its first
argument. torchao's int8 dynamic-activation linear calls it with one row per token, so a decode
step at batch 1 fails in eager and under torch.compile alike ("self.size(0) needs to be greater
than 16"). Zero rows appended to the int8 activations leave the rows asked for unchanged (an
integer product is exact), so such a product runs on zero rows concatenated to its own and keeps
its first rows: up to 17 rows where the count is static, 16 more where it changes per call. The copy is of
int8 activations, a few KiB at decode. This runs on every delegate of ferry's own backend placed
on CUDA, whatever `fuse_for_inference` says (the inductor backend leaves `_int_mm` to it).
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx
from torch._guards import detect_fake_mode

from ferry.choices.graph_edits import Rewrite, call
from ferry.device import Device

__all__ = ["FITTED_ON", "INT_MM_MIN_ROWS", "fit_kernel_limits"]

aten = torch.ops.aten
INT_MM_MIN_ROWS = 17  # CUDA `_int_mm`: self.size(0) > 16
FITTED_ON = frozenset({"cuda"})  # device types whose kernels have these limits (tests add the emulated device)


def fit_kernel_limits(gm: torch.fx.GraphModule, device: Device) -> list[Rewrite]:
    """Rewrite, in place, each op of `gm` (a delegate's subgraph on `device`) that its kernel
    there could refuse for its shape; what was done."""
    if device.type not in FITTED_ON:
        return []  # the CPU's kernels (and the emulated device's, which are the CPU's) take any rows
    done = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten._int_mm.default and _pad_rows(gm, node):
            done.append(Rewrite("rows padded", node.name))
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _pad_rows(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    a, b = node.args
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return False
    av, bv = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(av, torch.Tensor) and isinstance(bv, torch.Tensor)):
        return False
    rows = av.shape[0]
    if not isinstance(av.shape[1], int):
        return False  # (a weight's inner size: static in every model)
    if isinstance(rows, int) and rows >= INT_MM_MIN_ROWS:
        return False
    pad = INT_MM_MIN_ROWS - rows if isinstance(rows, int) else INT_MM_MIN_ROWS - 1
    with gm.graph.inserting_before(node), detect_fake_mode([av, bv]) or contextlib.nullcontext():
        # zero rows concatenated (constant_pad_nd's trace fixes a dynamic row count to its example)
        size = [pad, av.shape[1]]
        zeros = call(gm, node, aten.full.default, (size, 0), aten.full.default(size, 0, dtype=av.dtype, device=av.device))
        zeros.kwargs = {"dtype": av.dtype, "device": av.device}
        padded = call(gm, node, aten.cat.default, ([a, zeros],), aten.cat.default([av, zeros.meta["val"]]))
        product = call(gm, node, aten._int_mm.default, (padded, b), aten._int_mm.default(padded.meta["val"], bv))
        # the first rows, counted from the end: one slice for a static and a dynamic count alike
        kept = call(gm, node, aten.slice.Tensor, (product, 0, 0, -pad),
                    aten.slice.Tensor(product.meta["val"], 0, 0, -pad))
    node.replace_all_uses_with(kept)
    gm.graph.erase_node(node)
    return True
