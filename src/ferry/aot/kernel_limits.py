"""Shapes an op accepts that its device's kernel refuses, turned into shapes it takes, exactly.

CUDA's `_int_mm` (int8 x int8 -> int32, on cuBLASLt) needs more than 16 rows in its first
argument. torchao's int8 dynamic-activation linear calls it with one row per token; its eager
path catches the failure and multiplies in fp32, but its exported graph calls the kernel as it
is, so a decode step at batch 1 fails there and under torch.compile ("self.size(0) needs to be
greater than 16"). Zero rows appended to the int8 activations leave the rows asked for unchanged
(an integer product is exact), so such a product runs on zero rows concatenated to its own and
keeps its first rows: up to 17 rows where the count is static, 17 more where it changes per call
and may be below 17 (a prefill: the copy is of its int8 activations, K bytes a token; a few KiB
at decode). The kernel's other limits (int8 operands, sizes multiples of 8) are a CompileError.
This runs on every delegate of ferry's own backend placed on CUDA, whatever `fuse_for_inference`
says (the inductor backend leaves `_int_mm` to it).
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ferry.choices.graph_edits import Rewrite, call
from ferry.device import Device
from ferry.errors import CompileError

__all__ = ["FITTED_ON", "INT_MM_MIN_ROWS", "fit_kernel_limits"]

aten = torch.ops.aten
INT_MM_MIN_ROWS = 17  # CUDA `_int_mm`: self.size(0) > 16
FITTED_ON = frozenset({"cuda"})  # device types whose kernels have these limits (tests add the emulated device)


def fit_kernel_limits(gm: torch.fx.GraphModule, device: Device) -> list[Rewrite]:
    """Rewrite, in place, each op of `gm` (a delegate's subgraph on `device`) that its kernel
    there could refuse for its shape; what was done. CompileError for a shape no rewrite fits."""
    if device.type not in FITTED_ON:
        return []  # the CPU's kernels (and the emulated device's, which are the CPU's) take any rows
    done = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten._int_mm.default and _pad_rows(gm, node, device):
            done.append(Rewrite("rows padded", node.name))
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _pad_rows(gm: torch.fx.GraphModule, node: torch.fx.Node, device: Device) -> bool:
    a, b = node.args
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return False
    av, bv = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(av, torch.Tensor) and isinstance(bv, torch.Tensor)):
        return False
    _check_fits(node, av, bv, device)
    rows = av.shape[0]
    if statically_known_true(rows >= INT_MM_MIN_ROWS):
        return False  # (a graph fitted once has enough rows: nothing is padded twice)
    pad = INT_MM_MIN_ROWS - rows if isinstance(rows, int) else INT_MM_MIN_ROWS  # a dynamic count may be 0
    with gm.graph.inserting_before(node), detect_fake_mode([av, bv]) or contextlib.nullcontext():
        padded = _with_zero_rows(gm, node, a, av, pad)
        product = call(gm, node, aten._int_mm.default, (padded, b), aten._int_mm.default(padded.meta["val"], bv))
        # the first rows, counted from the end: one slice for a static and a dynamic count alike
        kept = call(gm, node, aten.slice.Tensor, (product, 0, 0, -pad),
                    aten.slice.Tensor(product.meta["val"], 0, 0, -pad))
    node.replace_all_uses_with(kept)
    gm.graph.erase_node(node)
    return True


def _with_zero_rows(gm: torch.fx.GraphModule, node: torch.fx.Node, a: torch.fx.Node, av: torch.Tensor,
                    pad: int) -> torch.fx.Node:
    """`a` with `pad` zero rows after its own: one pad kernel where the row count is static; zeros
    made and concatenated where it is dynamic (constant_pad_nd's trace fixes a dynamic count to
    its example)."""
    if isinstance(av.shape[0], int):
        return call(gm, node, aten.constant_pad_nd.default, (a, [0, 0, 0, pad]),
                    aten.constant_pad_nd.default(av, [0, 0, 0, pad]))
    size = [pad, av.shape[1]]
    kind = {"dtype": av.dtype, "device": av.device}
    zeros = call(gm, node, aten.full.default, (size, 0), aten.full.default(size, 0, **kind), kind)
    return call(gm, node, aten.cat.default, ([a, zeros],), aten.cat.default([av, zeros.meta["val"]]))


def _check_fits(node: torch.fx.Node, av: torch.Tensor, bv: torch.Tensor, device: Device) -> None:
    """CUDA's `_int_mm` also takes only int8 operands whose inner size and columns are positive
    multiples of 8 (torchao's eager path checks this before calling it; its exported graph does
    not): anything else is refused here, at compile time, not at the first call."""
    k, n = av.shape[1], bv.shape[1]
    if av.dtype != torch.int8 or bv.dtype != torch.int8:
        why = f"its operands are {av.dtype} and {bv.dtype}, where {device.type}'s kernel takes int8 only"
    elif not all(isinstance(d, int) and d > 0 and d % 8 == 0 for d in (k, n)):
        why = f"its inner size {k} and columns {n} must be positive multiples of 8 for {device.type}'s kernel"
    else:
        return
    raise CompileError(f"int8 product {node.name!r} (_int_mm, placed on {device}) cannot run there: {why}. Quantize "
                       "that layer otherwise (torchao's quantize_ takes a filter_fn; a vocabulary head of odd width "
                       "is the usual case), or place it on the CPU")
