"""The layer-norm family, at load: in a plan captured as CUDA graphs, ATen's layer norm or
ops/layer_norm.py's Triton kernel, which normalises several short rows per program where ATen's
gives each row a block (Swin-T's 3,136 rows of 96 on an H100: 4 µs a norm). Each distinct norm
is timed both ways on the GPU it loads on and the Triton kernel kept where it saves 10%
(choices/timing.py); both launch one kernel. Only captured: uncaptured, the Python launch costs
the host more than the kernel saves. Equal to eager within rounding (ops/layer_norm.py).

A residual add whose sum a layer norm reads (a transformer block's `x = x + attn(...)`, then
`norm(x)`) is one `ferry::add_layer_norm` from compile time on (`residual_norms`), on a device
other than the CPU: the op is the add and the norm as eager runs them, and at load the kernel
that reads both rows once and writes the sum and its norm is timed against them and kept where
it saves 10% (one kernel where there were two). An RMS norm written out op by op (transformers'
Llama, Qwen, T5) is one `ferry::rms_norm` from compile time on (`rms_norms`), its one-pass kernel
timed against the ops as eager runs them (six kernels or more)."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._prims_common import make_contiguous_strides_for

from ferry import node_meta as M
from ferry.choices import timing
from ferry.choices.decisions import DECISIONS, Decision, Site
from ferry.choices.graph_edits import Rewrite, call, single_use
from ferry.ops import layer_norm as rows_norm
from ferry.ops.layer_norm import ADD_LAYER_NORM, RMS_NORM

__all__ = ["ADD_THEN_NORM", "FORMS", "FUSED_FORMS", "ON", "OPS", "RESIDUALS", "RMS", "decision", "form",
           "fused_decision", "residual_norms", "rms_decision", "rms_norms"]

aten = torch.ops.aten
LAYER_NORM = aten.layer_norm.default
OPS = frozenset({LAYER_NORM, ADD_LAYER_NORM, RMS_NORM})
FORMS = ("ATen", "rows per program (Triton)")
FUSED_FORMS = ("add, then the norm", "add and norm in one kernel (Triton)")
RMS_FORMS = ("ATen, op by op", "one pass (Triton)")
ON = True  # off: ATen's kernel always, untimed (bench/profile_graphs.py --layer-norms off, an A/B)
RESIDUALS = True  # off: no add_layer_norm at compile time (bench/profile_graphs.py --residual-norms off)
RMS = True  # off: RMS norms stay written out, op by op (bench/profile_graphs.py --rms-norms off)
ADD_THEN_NORM = rows_norm.add_then_norm  # the op's two ATen calls, run where its kernel is not chosen
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# per op: how many buffers of the input's size in fp32 its forms allocate at once at most (the
# result; the add's sum too; the RMS norm's fp32 upcast and squares as eager computes them)
_LIVE_BUFFERS = {LAYER_NORM: 1, ADD_LAYER_NORM: 2, RMS_NORM: 3}


def form(op, args: list, kwargs: dict, site: Site) -> Callable | None:
    """The load-time hook (choices/hook.py): the Triton form where it was timed faster here."""
    if op is ADD_LAYER_NORM:
        return _fused_form(args, kwargs, site)
    if op is RMS_NORM:
        made = rms_decision(args, kwargs, site)
        return rows_norm.rms_norm if made is not None and made.taken else rows_norm.rms_then_scale
    made = decision(args, kwargs, site)
    return rows_norm.layer_norm if made is not None and made.taken else None


def _fused_form(args: list, kwargs: dict, site: Site) -> Callable | None:
    """One kernel for the add and the norm where timed faster than the two apart; else the two
    apart, the norm in the form its own choice picks."""
    x, residual, shape, weight, bias, eps = _fused_params(args, kwargs)
    alone = decision([x, shape, weight, bias, eps], {}, site)  # the sum is x's shape and dtype
    apart = functools.partial(ADD_THEN_NORM, norm=rows_norm.layer_norm) if alone is not None and alone.taken else None
    made = fused_decision(args, kwargs, site, apart)
    return rows_norm.add_layer_norm if made is not None and made.taken else apart or ADD_THEN_NORM


def fused_decision(args: list, kwargs: dict, site: Site, apart: Callable | None = None) -> Decision | None:
    """The timed choice for one `add_layer_norm`: the kernel against `apart` (the two apart as
    they would run; the op's own ATen calls where None), or None where the kernel does not
    compute it or nothing may be timed."""
    x, residual, shape, weight, bias, eps = _fused_params(args, kwargs)
    fit = rows_norm.fits(x, shape, weight, bias) and rows_norm.fits_residual(x, residual)
    forms = (apart or ADD_LAYER_NORM, rows_norm.add_layer_norm)
    return _timed(fit, (x, residual, weight, bias), site,
                  ("add + layer norm", tuple(x.shape), x.dtype, weight is not None, bias is not None, apart is not None),
                  lambda device: _decide(device, (x, residual), shape, weight, bias, eps, site, forms, ADD_LAYER_NORM,
                                         FUSED_FORMS))


def _fused_params(args: list, kwargs: dict):
    """(input, residual, normalized_shape, weight, bias, eps): the norm's, with the residual."""
    residual = args[1] if len(args) > 1 else kwargs.get("residual")
    x, shape, weight, bias, eps = _params([args[0] if args else kwargs.get("input"), *args[2:]], kwargs)
    return x, residual, shape, weight, bias, eps


def decision(args: list, kwargs: dict, site: Site) -> Decision | None:
    """The timed choice for one layer norm (its arguments real or meta tensors), or None where
    the Triton kernel does not compute it or nothing may be timed: uncaptured, no Triton, not on
    a GPU, a layout or dtype it does not take (ops/layer_norm.fits)."""
    x, shape, weight, bias, eps = _params(args, kwargs)
    return _timed(rows_norm.fits(x, shape, weight, bias), (x, weight, bias), site,
                  ("layer norm", tuple(x.shape), x.dtype, weight is not None, bias is not None),
                  lambda device: _decide(device, (x,), shape, weight, bias, eps, site,
                                         (LAYER_NORM, rows_norm.layer_norm), LAYER_NORM, FORMS))


def rms_decision(args: list, kwargs: dict, site: Site) -> Decision | None:
    """The timed choice for one `ferry::rms_norm`: the one-pass kernel against the op's own ATen
    calls, or None where the kernel does not compute it or nothing may be timed (as `decision`)."""
    x, weight, eps = _given(args, kwargs, ("input", "weight", "eps"))
    if not (isinstance(x, torch.Tensor) and x.dim() > 0):
        return None
    eps = float(1e-6 if eps is None else eps)
    forms = (lambda x, shape, w, b, eps: rows_norm.rms_then_scale(x, w, eps),
             lambda x, shape, w, b, eps: rows_norm.rms_norm(x, w, eps))
    return _timed(rows_norm.fits(x, [x.shape[-1]], weight), (x, weight), site,
                  ("rms norm", tuple(x.shape), x.dtype, weight is not None),
                  lambda device: _decide(device, (x,), [x.shape[-1]], weight, None, eps, site, forms, RMS_NORM,
                                         RMS_FORMS))


def _timed(fit: bool, tensors: tuple, site: Site, key: tuple, decide: Callable) -> Decision | None:
    """The decision for `key` (its family first, then what sets the kernels apart), timed by
    `decide(device)` where a Triton form computes the op (`fit`) in a captured plan on a GPU;
    else None: ATen's kernels stay."""
    if not (ON and site.captured and fit and rows_norm.available()):
        return None
    device = timing.gpu_of([t for t in tensors if t is not None], site.device)
    if device is None:
        return None
    return DECISIONS.get((key[0], str(device), site.replays, *key[1:]), lambda: decide(device),
                         timing.may_time(site, device))


def _given(args: list, kwargs: dict, names: tuple) -> list:
    """An op's arguments by name, positional or keyword; None for one not given."""
    given = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
    return [given.get(n) for n in names]


def _params(args: list, kwargs: dict):
    x, shape, weight, bias, eps = _given(args, kwargs, ("input", "normalized_shape", "weight", "bias", "eps"))
    return x, list(shape or ()), weight, bias, float(1e-5 if eps is None else eps)


def _decide(device, rows: tuple, shape, weight, bias, eps, site: Site, forms: tuple, op, names: tuple
            ) -> Decision | None:
    """Time `forms` (eager's, then the Triton kernel; each takes `rows`, then the norm's
    arguments) on scratch copies of the arguments: the decision for `op`, its forms called `names`."""
    with timing.deciding(device, site):
        try:
            rows = tuple(timing.scratch(t, device) for t in rows)
            w, b = (timing.scratch(t, device) if t is not None else None for t in (weight, bias))
            room = site.timing_room(_LIVE_BUFFERS[op] * timing.rounded(rows[0].numel() * 4))
            times = timing.time_both(lambda: forms[0](*rows, shape, w, b, eps), lambda: forms[1](*rows, shape, w, b, eps),
                                     site.replay_stream(), room=room)
        except Exception:  # noqa: BLE001 - out of memory, or Triton could not build its kernel here: ATen's stays
            return None
    x = rows[0]
    return timing.decision("layer norm", str(op.name()), f"{x.numel() // x.shape[-1]}x{x.shape[-1]}", device, x.dtype,
                           names, times, min_saving_us=0)


# ---------------------------------------------------------------- compile time: a residual add with its norm


def _contiguous(val: torch.Tensor) -> bool:
    """Row-major at every size (no guard added on a dynamic one)."""
    return M.same_sizes(val.stride(), make_contiguous_strides_for(val.shape))


def residual_norms(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """`layer_norm(a + b)` -> `ferry::add_layer_norm(a, b, ...)`, its first result read wherever
    the sum was (aot/fuse.py: in a delegate on a device other than the CPU, where no kernel of
    ferry's would run it and the sum would lose its planned memory for nothing). Only a
    plain add of two contiguous tensors of the sum's own shape and dtype (no broadcast, no alpha),
    normalised over its last dim, the weight and bias constants or inputs (None or tensors)."""
    if not RESIDUALS:
        return []
    done = []
    order = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    for norm in list(gm.graph.nodes):
        if norm.op != "call_function" or norm.target is not LAYER_NORM or not _fusable(norm):
            continue
        total = norm.args[0]
        x, residual = total.args
        _, shape, weight, bias, eps = _params(list(norm.args), norm.kwargs)
        for t in (weight, bias):
            if isinstance(t, torch.fx.Node) and order[t] > order[total]:  # a constant a rewrite put later
                total.prepend(t)
                order[t] = order[total] - 0.5
        with gm.graph.inserting_before(total):
            both = call(gm, norm, ADD_LAYER_NORM, (x, residual, shape, weight, bias, eps),
                        (total.meta["val"], norm.meta["val"]))
            summed = call(gm, total, operator.getitem, (both, 0), total.meta["val"])
            normed = call(gm, norm, operator.getitem, (both, 1), norm.meta["val"])
        total.replace_all_uses_with(summed)
        norm.replace_all_uses_with(normed)
        gm.graph.erase_node(norm)
        gm.graph.erase_node(total)
        done.append(Rewrite("add + layer norm", f"{total.name} + {norm.name}"))
    return done


def _fusable(norm: torch.fx.Node) -> bool:
    total = norm.args[0] if norm.args else None
    if not isinstance(total, torch.fx.Node) or total.target is not aten.add.Tensor or total.kwargs or len(total.args) != 2:
        return False
    _, shape, weight, bias, _ = _params(list(norm.args), norm.kwargs)
    val = total.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in _DTYPES or val.dim() < 1 or not _contiguous(val):
        return False
    if len(shape) != 1 or M.static_ints(shape) is None or M.static_ints(shape) != M.static_ints([val.shape[-1]]):
        return False
    for t in total.args:
        v = t.meta.get("val") if isinstance(t, torch.fx.Node) else None
        if not (isinstance(v, torch.Tensor) and v.dtype == val.dtype and M.same_sizes(v.shape, val.shape)
                and _contiguous(v)):
            return False
    return all(t is None or (isinstance(t, torch.fx.Node) and t.op in ("get_attr", "placeholder")) for t in (weight, bias))


# ---------------------------------------------------------------- compile time: an RMS norm written out

def rms_norms(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """transformers' RMS norm written out (`x.to(float32)`, `pow(2)`, `mean(-1, keepdim=True)`,
    `+ eps`, `rsqrt`, `x * r`, `.to(dtype)`, `weight * y`: six kernels or more in eager) ->
    `ferry::rms_norm(x, weight, eps)`, whose kernel is those ATen calls (the same bits) until the
    load times ops/layer_norm.py's one-pass kernel faster. Only where each step is read by the
    next alone (the upcast by its square and its product), the weight is a constant or input of
    the last dim's width in x's dtype, and x is a float tensor (aot/fuse.py: a delegate on a
    device other than the CPU, as residual_norms)."""
    if not RMS:
        return []
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.rsqrt.default:
            continue
        found = _rms_pattern(node)
        if found is None:
            continue
        x, weight, eps, last, erased = found
        with gm.graph.inserting_before(last):
            fused = call(gm, last, RMS_NORM, (x, weight, eps), last.meta["val"])
        last.replace_all_uses_with(fused)
        for n in erased:  # the readers first
            gm.graph.erase_node(n)
        done.append(Rewrite("rms norm", last.name))
    return done


def _rms_pattern(rsqrt: torch.fx.Node):
    """(x, weight or None, eps, the last node, the nodes replaced, readers first) where `rsqrt`
    is the middle of an RMS norm as transformers writes it, else None."""
    total: Any = rsqrt.args[0]
    if not (_only_reader(total, rsqrt) and total.target in (aten.add.Tensor, aten.add.Scalar)
            and len(total.args) == 2 and not total.kwargs and type(total.args[1]) is float):
        return None
    mean: Any = total.args[0]
    if not (_only_reader(mean, total) and mean.target is aten.mean.dim and list(mean.args[1:]) == [[-1], True]
            and not mean.kwargs):
        return None
    square: Any = mean.args[0]
    if not (_only_reader(square, mean) and square.target is aten.pow.Tensor_Scalar and square.args[1] == 2):
        return None
    upcast: Any = square.args[0]
    product: Any = next(iter(rsqrt.users)) if len(rsqrt.users) == 1 else None
    if product is None or product.target is not aten.mul.Tensor or rsqrt not in product.args or product.kwargs:
        return None
    x: Any = upcast.args[0] if _is_cast(upcast, torch.float32) else upcast
    if (product.args[0] if product.args[1] is rsqrt else product.args[1]) not in (upcast, x):
        return None
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not (isinstance(xv, torch.Tensor) and xv.dtype in _DTYPES and xv.dim() >= 1):
        return None
    if square.meta["val"].dtype != torch.float32 or product.meta["val"].dtype != torch.float32:
        return None  # a norm computed in half precision throughout: the op computes in fp32
    if upcast is not x and set(upcast.users) - {square, product}:
        return None
    last, erased = product, [product, rsqrt, total, mean, square] + ([upcast] if upcast is not x else [])
    if xv.dtype != torch.float32:
        down = next(iter(product.users)) if len(product.users) == 1 else None
        if not _is_cast(down, xv.dtype):
            return None
        last, erased = down, [down, *erased]
    weight, scaled = _rms_weight(last, xv)
    if scaled is not None:
        last, erased = scaled, [scaled, *erased]
    return x, weight, float(total.args[1]), last, erased


def _rms_weight(normed: torch.fx.Node, xv: torch.Tensor):
    """(weight, the product with it) where `normed` is read only by `weight * normed` (either
    order) of a constant or input of x's last width and dtype; else (None, None)."""
    scaled = next(iter(normed.users)) if len(normed.users) == 1 else None
    if scaled is None or scaled.target is not aten.mul.Tensor or scaled.kwargs or len(scaled.args) != 2:
        return None, None
    weight: Any = scaled.args[0] if scaled.args[1] is normed else scaled.args[1]
    wv = weight.meta.get("val") if isinstance(weight, torch.fx.Node) and weight.op in ("get_attr", "placeholder") else None
    if not (isinstance(wv, torch.Tensor) and wv.dtype == xv.dtype and M.same_sizes(wv.shape, [xv.shape[-1]])):
        return None, None
    return weight, scaled


def _only_reader(node, reader) -> bool:
    return single_use(node) and reader in node.users


def _is_cast(node, dtype: torch.dtype) -> bool:
    """`node` is `x.to(dtype)` and nothing else (no device, layout or memory format change)."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten._to_copy.default
            and set(node.kwargs) == {"dtype"} and node.kwargs["dtype"] == dtype and len(node.args) == 1)
