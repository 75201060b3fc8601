"""Shapes memory is planned from, checked against what the kernels will make.

* Results whose shape or dtype depends on the device that computes them take that device's. The
  trace runs on the CPU, and a few kernels give auxiliary results another shape or dtype on
  CUDA: `native_batch_norm` in eval returns its saved mean and inverse std as (0,) on the CPU
  and as (C,) on CUDA; layer and batch norm keep a bfloat16 input's statistics in bfloat16 on
  the CPU and in float32 on CUDA. An op placed on CUDA is traced again on fake CUDA tensors (no
  GPU needed) and, where that disagrees, the node records CUDA's shape and dtype. Only ops with
  several results are asked (a single result's shape is the op's meaning), and the ops that
  read a result so changed, in any partition or on the CPU.
* A dynamic program's symbolic shapes agree with a trace at the example's sizes: a shape
  function that is wrong at symbolic sizes (`nll_loss_nd` over a dynamic class dim gives a
  0-dim result where the kernel returns one per row) is a CompileError naming the op, not
  memory planned for a shape no kernel makes.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ferry import node_meta as M
from ferry.device import Device
from ferry.errors import CompileError

__all__ = ["check_symbolic_shapes", "fit_to_devices"]

_CPU = Device("cpu", 0)  # where an op no partition places runs, and whose kernels host-backed devices run


def fit_to_devices(nodes, devices: dict) -> None:
    """Give the multi-result ops among `nodes` (in graph order) placed on CUDA (`devices`: node ->
    Device, absent for the CPU) the shapes and dtypes CUDA's kernels make, and every op that reads
    a result so changed, wherever it runs, what it makes of it. A node of dynamic shape is traced
    again at the sizes export traced (a symbolic size is never asked for a value, which would fix
    it): a result of static shape takes the device's; one of dynamic shape that differs is a
    CompileError. Dtypes follow the device at any shape."""
    changed: set[torch.fx.Node] = set()
    for node in nodes:
        val = node.meta.get("val")
        vals = list(val) if isinstance(val, (tuple, list)) else [val]
        device = devices.get(node, _CPU)
        on_cuda = device.type == "cuda"  # host-backed devices run the CPU's kernels: the trace is theirs
        asked = (isinstance(val, (tuple, list)) and on_cuda) or changed.intersection(node.all_input_nodes)
        if (not asked or node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload)
                or not all(isinstance(v, torch.Tensor) for v in vals) or not _hinted(vals)):
            continue
        there = _traced(node, device if on_cuda else _CPU, static=not _static(vals))
        if there is None or len(there) != len(vals):
            continue
        new = [_like(node, v, t) for v, t in zip(vals, there)]
        if any(n is not v for n, v in zip(new, vals)):
            _set_val(node, type(val)(new) if isinstance(val, (tuple, list)) else new[0])
            changed.add(node)
            for user in node.users:
                if user.target is operator.getitem and isinstance(user.args[1], int):
                    _set_val(user, new[user.args[1]])
                    if new[user.args[1]] is not vals[user.args[1]]:
                        changed.add(user)  # its readers are asked again


def _set_val(node: torch.fx.Node, val) -> None:
    node.meta["val"] = val
    if isinstance(val, torch.Tensor) and "tensor_meta" in node.meta:
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)


def check_symbolic_shapes(gm: torch.fx.GraphModule) -> None:
    """CompileError for an op that makes a size only its data decides (`nonzero`, `unique`,
    `item`), and for an op whose symbolic result shape, at the sizes export traced, is not the
    shape the same op gives on tensors of those sizes (a static trace, on fake tensors)."""
    _refuse_data_dependent(gm)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        vals = list(val) if isinstance(val, (tuple, list)) else [val]
        if (node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload)
                or not all(isinstance(v, torch.Tensor) for v in vals) or not _hinted(vals)):
            continue
        ins = [a.meta.get("val") for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if _static(vals) and _static(ins):
            continue
        there = _retraced(node)
        if there is None or len(there) != len(vals):
            continue
        for k, (v, t) in enumerate(zip(vals, there)):
            if isinstance(t, torch.Tensor) and tuple(t.shape) != M.hint_ints(v.shape):
                raise CompileError(
                    f"{node.target} (node {node.name!r}): torch's shape function gives result {k} the shape "
                    f"{tuple(v.shape)} at dynamic sizes, {M.hint_ints(v.shape)} at the traced ones, but the op makes "
                    f"{tuple(t.shape)} there: its memory cannot be planned from the trace; export this part static")


def _refuse_data_dependent(gm: torch.fx.GraphModule) -> None:
    """A value only the data decides: a size (`nonzero`), or a number read back to the host
    (`.item()`) that feeds only host checks or scalar arguments; ferry plans and places neither."""
    in_shapes = set().union(*(_unbacked(_shapes(n.meta.get("val"))) for n in gm.graph.nodes))
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        made = _unbacked(node.meta.get("val")) - set().union(*(_unbacked(a.meta.get("val")) for a in node.all_input_nodes))
        if made & in_shapes:
            raise CompileError(f"{node.target} (node {node.name!r}{_source(node)}) makes a size that depends on the "
                               f"data ({', '.join(sorted(made))}); ferry plans memory ahead of time and needs static "
                               "or bounded shapes: keep ops like nonzero, unique, masked_select and .item() out of "
                               "the program")
        if made:
            users = sorted({getattr(u.target, '__name__', '') if callable(u.target) and not isinstance(
                u.target, torch._ops.OpOverload) else str(u.target) for u in node.users})
            raise CompileError(f"{node.target} (node {node.name!r}{_source(node)}) reads a tensor's value back to the "
                               f"host ({', '.join(sorted(made))}: `.item()`, `.tolist()`, `int(t)`), used by "
                               f"{', '.join(users) or 'nothing'}; ferry does not yet run a program whose ops take "
                               "numbers read from its tensors (a check such as `assert t.max().item() <= n`, or a "
                               "scalar factor): compute the number outside the exported module and pass it as a "
                               "tensor, or export without the check")


def _shapes(val) -> list:
    """The sizes and strides of the tensors in a traced value (what memory is planned from)."""
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [d for v in vals if isinstance(v, torch.Tensor) for d in (*v.shape, *v.stride())]


def _source(node: torch.fx.Node) -> str:
    """`, at file:line` of the model's code that made the node, where export recorded it."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines() if ln.strip().startswith("File")]
    if not lines:
        return ""
    where = lines[-1].split('"')
    line = lines[-1].split("line ")[-1].split(",")[0]
    return f", at {where[1].rsplit('/', 1)[-1]}:{line}" if len(where) > 2 else ""


def _unbacked(val) -> set[str]:
    """The data-dependent size symbols (u0, u1, ...) in a traced value."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    vals = val if isinstance(val, (list, tuple)) else [val]
    out: set[str] = set()
    for v in vals:
        if isinstance(v, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            try:
                out |= {str(s) for s in free_unbacked_symbols(v)}
            except Exception:  # noqa: BLE001 - a layout without sizes to ask (sparse): nothing to say
                pass
        elif isinstance(v, (list, tuple)):
            out |= _unbacked(v)
    return out


def _hinted(vals) -> bool:
    """Every size has the value export traced (none is data-dependent)."""
    return all(type(d) is int or d.node.hint is not None for v in vals for d in v.shape)


def _static(vals) -> bool:
    return all(isinstance(v, torch.Tensor) and M.static_ints(v.shape) is not None for v in vals)


def _retraced(node: torch.fx.Node):
    """The node's results on static fake tensors of the sizes export traced, or None."""
    return _traced(node, Device("cpu", 0), static=True)


def _traced(node: torch.fx.Node, device: Device, static: bool):
    """The node's results computed on fake tensors of `device` (`static`: of the sizes export
    traced, not symbolic), or None when that cannot be asked."""
    mode = detect_fake_mode([node.meta.get("val")])
    if mode is None:
        return None
    where = device.to_torch()

    def fake(x):
        if isinstance(x, torch.fx.Node):
            v = x.meta.get("val")
            if isinstance(v, torch.Tensor):
                if static:
                    return torch.empty(M.hint_ints(v.shape), dtype=v.dtype, device=where)
                return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=where)
            if isinstance(v, torch.SymInt) and static:
                return int(v.node.hint) if v.node.hint is not None else v
            return v
        if isinstance(x, (list, tuple)):
            return type(x)(fake(e) for e in x)
        return x

    try:
        with mode:
            args, kwargs = fake(list(node.args)), {k: fake(v) for k, v in node.kwargs.items()}
            out = node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - an op fake tensors cannot run: the trace's shapes stand
        return None
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _like(node: torch.fx.Node, traced: torch.Tensor, there) -> torch.Tensor:
    """`traced`, or a fake tensor of the device's shape and dtype where they differ (the device's
    shape only where it is static: `there` was traced at the example's sizes)."""
    if not isinstance(there, torch.Tensor):
        return traced
    static = M.static_ints(traced.shape) is not None
    if not static and tuple(there.shape) != M.hint_ints(traced.shape):
        raise CompileError(f"{node.target} (node {node.name!r}) gives a result of shape {tuple(traced.shape)} on the "
                           f"CPU and {tuple(there.shape)} on the device at the traced sizes: a shape that differs "
                           "by device is planned only where it is static; export this part static")
    shape = tuple(there.shape) if static else traced.shape
    if tuple(shape) == tuple(traced.shape) and there.dtype == traced.dtype:
        return traced
    with detect_fake_mode([traced]) or contextlib.nullcontext():
        if tuple(shape) == tuple(traced.shape):  # the dtype alone: the trace's layout kept
            return torch.empty_strided(shape, traced.stride(), dtype=there.dtype, device=traced.device)
        return torch.empty(shape, dtype=there.dtype, device=traced.device)
