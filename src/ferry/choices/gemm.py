"""The GEMM family: `linear` as one GEMM over rows (compile time), and which kernels run a biased
fp32 GEMM on CUDA (at load): eager's `addmm`, or `mm` and then the bias added.

ATen runs `addmm` with a vector bias through cublasLt's bias epilogue, whose heuristic takes slow
split-K kernels for fp32 at a few hundred rows (on an H200, BERT's 128 x 3072 x 768: 54 µs
against 26 for `mm` then the bias); at other shapes, and in bf16, the epilogue is the faster
(README, `bench/gemm_kernels.py`). No rule of shapes holds across GPUs, so each distinct GEMM is
timed both ways when a method loads, on the GPU it loads on, and the split is kept where it saves
at least 10% and 2 µs. Only fp32 and fp64 are split: in half precision the product would be
rounded before the bias is added. Under deterministic algorithms eager's kernel always runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.fx

from ferry import node_meta as M
from ferry.choices import timing
from ferry.choices.decisions import DECISIONS, Decision, Site
from ferry.choices.graph_edits import Rewrite, call

__all__ = ["OPS", "PATTERNS", "biased_gemm", "blas_settings", "form", "functional_linear", "mm_then_add"]

aten = torch.ops.aten
OPS = frozenset({aten.addmm.out})
_GEMM_DTYPES = (torch.float32, torch.float64)
_MAX_MACS = 1 << 33  # not timed above (4096^3 took 1 s of load); BERT batch 8, ViT batch 4 (2.4e9) are under it
FAMILY = "biased GEMM"
FORMS = ("addmm", "mm + bias")

# where linear.out's GEMM-then-add was measured slower than the functional addmm (an H200: two
# kernels and an extra pass); on the CPU the difference was within noise, and .out keeps the
# result in planned memory
_FOLDING_DEVICES = frozenset({"cuda"})


def functional_linear(op, node: torch.fx.Node, device_type: str) -> str:
    """Compile time: why a `linear` (one the pattern below left: a batched result the delegate
    returns) runs functionally, or "" where its `.out` overload may."""
    x = node.args[0] if node.args else None
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    batched = isinstance(val, torch.Tensor) and val.dim() >= 3 and len(node.args) > 2 and node.args[2] is not None
    if op is aten.linear.default and batched and device_type in _FOLDING_DEVICES:
        return ("over a batch of rows the functional kernel runs one GEMM with the bias fused (addmm); "
                "linear.out runs the GEMM, then adds the bias (measured)")
    return ""


def mm_then_add(bias, mat1, mat2, *, beta=1, alpha=1, out):
    """`addmm.out` as cuBLAS's plain GEMM into `out`, then the bias added in place."""
    torch.mm(mat1, mat2, out=out)
    return out.add_(bias)


def form(op, args: list, kwargs: dict, site: Site) -> Callable | None:
    """The load-time hook (choices/hook.py): `mm_then_add` for an `addmm.out` this GPU runs faster
    that way, else None."""
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if len(args) != 3 or "out" not in kwargs or not all(isinstance(s, (int, float)) for s in (beta, alpha)):
        return None
    bias, mat1, mat2 = args
    return biased_gemm(bias, mat1, mat2, kwargs["out"], site, beta, alpha)


def biased_gemm(bias, mat1, mat2, out, site: Site, beta=1, alpha=1) -> Callable | None:
    """`mm_then_add` where this GPU runs it faster than `addmm.out` for operands like these
    (real tensors or meta tensors of the same shape, strides and dtype); otherwise None."""
    operands = (bias, mat1, mat2, out)
    if beta != 1 or alpha != 1 or not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    if bias.dim() != 1 or any(t.dim() != 2 for t in operands[1:]) or len({t.dtype for t in operands}) != 1:
        return None
    rows, inner = mat1.shape
    if bias.dtype not in _GEMM_DTYPES or rows * inner * out.shape[1] > _MAX_MACS:
        return None
    device = timing.gpu_of(operands, site.device)
    if device is None:
        return None
    key = (FAMILY, str(device), bias.dtype, *blas_settings(), site.replays,
           *((tuple(t.shape), t.stride()) for t in operands))
    decision = DECISIONS.get(key, lambda: _decide(device, operands, site), timing.may_time(site, device))
    return mm_then_add if decision is not None and decision.taken else None


def blas_settings() -> tuple:
    """What changes the kernels cuBLAS picks: TF32, and which BLAS library runs GEMMs."""
    return torch.backends.cuda.matmul.allow_tf32, str(torch.backends.cuda.preferred_blas_library())


def _decide(device: torch.device, operands, site: Site) -> Decision | None:
    """Both ways timed on scratch tensors (the planned output is never written): the decision,
    or None where there is no memory for them."""
    with timing.deciding(device, site):
        try:
            bias, mat1, mat2 = (timing.scratch(t, device) for t in operands[:3])
            out = timing.scratch(operands[3], device, written=True)
            times = timing.time_both(lambda: torch.addmm(bias, mat1, mat2, out=out),
                                     lambda: mm_then_add(bias, mat1, mat2, out=out), site.replay_stream())
        except torch.cuda.OutOfMemoryError:  # eager's kernel stays; any other error is the caller's to see
            return None
    (rows, inner), cols = operands[1].shape, operands[3].shape[1]
    return timing.decision(FAMILY, "aten::addmm.out", f"{rows}x{inner}x{cols}", device, bias.dtype, FORMS, times)


# ---------------------------------------------------------------- compile time: linear as one GEMM over rows


def linear_as_gemm(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """`linear(x, w, b)` -> `view(addmm(b, view(x, (rows, k)), t(w)), (..., n))` (`mm` without a
    bias), what eager's linear computes for a contiguous input; the rows may be dynamic (a
    batch, a length), the width not. Not where a batched result is the delegate's own output
    (a view there would cost a copy)."""
    done: list[Rewrite] = []
    read: dict = {}  # the size nodes made so far (by expression), before every later linear
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        xv, wv, out = x.meta.get("val"), w.meta.get("val"), node.meta.get("val")
        if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor) and isinstance(out, torch.Tensor)):
            continue
        if xv.dim() < 2 or wv.dim() != 2 or M.static_ints((xv.shape[-1], out.shape[-1])) is None:
            continue
        if not M.surely(xv.is_contiguous()):
            continue
        k, n = xv.shape[-1], out.shape[-1]
        if 0 in (k, n, *(s for s in xv.shape[:-1] if type(s) is int)):
            continue  # an empty operand: a view inferring a size (-1) of zero elements would be ambiguous
        bv = b.meta.get("val") if isinstance(b, torch.fx.Node) else None
        if b is not None and not (isinstance(bv, torch.Tensor) and tuple(bv.shape) == (n,)):
            continue  # addmm broadcasts a bias over rows only: a (rows-like, n) bias stays with linear
        if xv.dim() > 2 and any(u.op == "output" for u in node.users):
            continue  # a view as the delegate's result would be copied out: linear writes the caller's tensor
        rows = math.prod(xv.shape[:-1])
        with gm.graph.inserting_before(node):
            flat = x if xv.dim() == 2 else call(gm, node, aten.view.default, (x, [_inferred_if_symbolic(rows), k]),
                                                  xv.new_empty((rows, k)))
            wt = call(gm, node, aten.t.default, (w,), wv.t())
            res = out.new_empty((rows, n))
            gemm = (call(gm, node, aten.mm.default, (flat, wt), res) if b is None
                    else call(gm, node, aten.addmm.default, (b, flat, wt), res))
            y = gemm if xv.dim() == 2 else call(gm, node, aten.view.default,
                                                (gemm, [*_view_sizes(gm, node, x, xv.shape[:-1], read), n]), out)
        node.replace_all_uses_with(y)
        gm.graph.erase_node(node)
        done.append(Rewrite("gemm", node.name))
    return done


def _inferred_if_symbolic(size):
    """A view's size: an int as it is, a symbolic one as -1 (the one size the view infers; every
    other size given is nonzero, so the inference is unambiguous)."""
    return size if type(size) is int else -1


def _view_sizes(gm, like: torch.fx.Node, x: torch.fx.Node, sizes, read: dict) -> list:
    """`sizes` (x's leading sizes) as a view's argument: ints as they are; one symbolic size
    as -1; several each as a node (`_size_node`)."""
    if sum(type(s) is not int for s in sizes) <= 1:
        return [_inferred_if_symbolic(s) for s in sizes]
    return [s if type(s) is int else _size_node(gm, like, x, i, s, read) for i, s in enumerate(sizes)]


def _size_node(gm, like: torch.fx.Node, x: torch.fx.Node, i: int, size, read: dict) -> torch.fx.Node:
    """x's size `i` (symbolic) as a node: the graph's input of that size where it has one (a
    delegate's size inputs), else the one an earlier linear read, else read from x here (the
    graph runs in order, so a node made before an earlier linear is there for every later one)."""
    expr = size.node.expr
    if expr not in read:
        inputs = (p for p in gm.graph.find_nodes(op="placeholder")
                  if isinstance(p.meta.get("val"), torch.SymInt) and p.meta["val"].node.expr == expr)
        read[expr] = next(inputs, None) or call(gm, like, aten.sym_size.int, (x, i), size)
    return read[expr]


PATTERNS = (linear_as_gemm,)
