"""The compile-time choice of every op: its `.out` overload into planned memory, or the functional kernel.

An `.out` overload is worth it only when it is a real kernel writing its result in place.
Many are wrappers PyTorch generates (`convolution.out`, `native_layer_norm.out`, `clone.out`,
...): they call the functional kernel into a temporary and copy it into `out`, one extra
pass over memory and one extra allocation per call. Which is which is *measured*, once per
overload and process: the `.out` kernel runs on small CPU tensors of the traced shapes under
PyTorch's profiler, and one that allocates as many bytes as its outputs hold is a wrapper.
(A wrapper is generated once for every device, so the CPU measurement holds for CUDA.)

The functional kernel is also used when eager PyTorch gives the result a layout other than
the contiguous one a planned tensor has (a `relu` of a permuted tensor keeps the permuted
strides): then every view eager allows stays legal; and when an input is not contiguous,
where functional kernels choose their algorithm by layout and some `.out` overloads do not
(`linear.out` over a transposed input runs a batched GEMM of tiny matrices). Functional results are allocated by the
kernel each call and are not planned; each decision is recorded in the program, with why.

Convolutions stay functional on CUDA too, by measurement: cuDNN can write into planned memory
(`cudnn_convolution.out`, then the bias in place), but on an H200 that raised ResNet-18's peak at
batch 32 from 1.04x eager's to 1.23x. The arena grew by the largest convolution output (98 MiB)
while cuDNN's workspace, allocated inside the kernel each call (183 MiB for one 3x3 convolution),
still set the peak at another point of the call.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.fx

from ferry import node_meta as M
from ferry import ops
from ferry.choices.decisions import DECISIONS, Decision
from ferry.choices.gemm import functional_linear
from ferry.op_names import kernel_name
from ferry.ops import writes
from ferry.ops.variants import out_variant

__all__ = ["FORMS", "choose_kernel", "kernel_for", "out_is_wrapper"]

_MEASURE_ELEMENTS = 1 << 22  # inputs larger than this are not materialised to measure


FAMILY = "out kernel"
FORMS = ("functional", "out")  # eager's kernel allocates its result; the .out overload writes planned memory


def choose_kernel(op: torch._ops.OpOverload, node: torch.fx.Node, device_type: str = "cpu") -> Decision:
    """Whether `op` at `node` runs as its `.out` overload into planned memory or functionally,
    and why (`kernel_for` gives the overload an instruction calls)."""
    out = out_variant(op)
    why = _functional_because(op, out, node, device_type)
    return Decision(FAMILY, kernel_name(op), _shape(node), FORMS, (), "functional" if why else "out",
                    why or "writes its result into planned memory", device_type)


def kernel_for(op: torch._ops.OpOverload, decision: Decision) -> torch._ops.OpOverload:
    out = out_variant(op)
    return out if decision.pick == "out" and out is not None else op


def _functional_because(op, out, node: torch.fx.Node, device_type: str) -> str:
    """Why `op` runs functionally, or "" where its `.out` overload is the one to run."""
    if out is None:
        return "no out variant: allocates its result each call"
    if op in ops.FUNCTIONAL_COPIES or op in writes.OUT_KERNELS:
        return ""  # ferry's own copies and kernels (ops/writes.py) write in place, no clone of a whole storage
    if why := functional_linear(op, node, device_type):
        return why
    if not _contiguous(node.meta.get("val")):
        return ("eager gives its result a non-contiguous layout: computed as eager does, so every view eager "
                "allows stays legal")
    if op not in _GEMMS and not all(_contiguous(a.meta.get("val")) for a in node.all_input_nodes):
        # measured on ViT: linear.out over a transposed input runs one small GEMM per row (bmm
        # with a broadcast weight, 2.4x slower end to end) where eager's functional linear
        # copies the input once and runs one large GEMM
        return ("an input has a non-contiguous layout, for which eager's functional kernel picks a faster "
                "algorithm than the .out overload (measured)")
    if _scratches_in_out(out, node):
        return (f"{kernel_name(out)} uses its out tensor as scratch larger than its result (measured): planned "
                "memory would be written past its end")
    if out_is_wrapper(out, node):
        return (f"{kernel_name(out)} computes into a temporary and copies (measured): the functional kernel's "
                "result is used in place")
    return ""


def _shape(node: torch.fx.Node) -> str:
    val = node.meta.get("val")
    return "x".join(map(str, val.shape)) if isinstance(val, torch.Tensor) else ""


# GEMMs take transposed operands as BLAS does, in their .out kernels as in the functional ones:
# the same algorithm whatever the layout (aot/fuse.py gives them a transposed weight)
_GEMMS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def _contiguous(val) -> bool:
    vals = val if isinstance(val, (list, tuple)) else [val]
    for v in vals:
        if isinstance(v, torch.Tensor) and v.numel() > 1 and not _is_contiguous(v):
            return False
    return True


def _is_contiguous(v: torch.Tensor) -> bool:
    """Contiguous, or not known not to be (dynamic shapes are laid out contiguously): no guard."""
    return not M.surely(torch.sym_not(v.is_contiguous()))


def out_is_wrapper(out: torch._ops.OpOverload, node: torch.fx.Node) -> bool:
    """Does `out` allocate a temporary the size of its outputs? Measured once per overload."""
    if _has_backend_kernel(out):
        return False  # a kernel registered for the CPU itself: structured, writes in place
    return _measured_wrapper(out, node)


def _scratches_in_out(out: torch._ops.OpOverload, node: torch.fx.Node) -> bool:
    """Does `out` use an out tensor as scratch larger than its result (`mse_loss.out` writes the
    elementwise loss into `out`, then its mean)? Run once per overload and constant arguments,
    with outputs exactly their size that cannot grow: such a kernel fails to resize them."""
    key = ("out kernel scratch", out, repr([_shape_or_value(a) for a in node.args]),
           repr(sorted((k, _shape_or_value(v)) for k, v in node.kwargs.items())))
    return _measured(key, out, node, _resizes_out, "uses its out tensor as scratch")


def _shape_or_value(a):
    """What the scratch test of an argument depends on: a tensor's shape, anything else itself."""
    if isinstance(a, torch.fx.Node):
        val = a.meta.get("val")
        return tuple(val.shape) if isinstance(val, torch.Tensor) else repr(val)
    if isinstance(a, (list, tuple)):
        return tuple(_shape_or_value(e) for e in a)
    return a


def _resizes_out(out: torch._ops.OpOverload, node: torch.fx.Node) -> bool:
    try:
        try:
            args, kwargs, _ = _example_call(out, node, hints=True)
        except _TooLarge:
            args, kwargs, _ = _example_call(out, node, cap=_SMALL_SIZE, hints=True)
    except _CannotMeasure:
        return False
    names = [a.name for a in out._schema.arguments if a.is_out]
    kwargs.update({name: _unresizable(kwargs[name]) for name in names})
    try:
        with _quiet_stderr():
            out(*args, **kwargs)
    except RuntimeError as e:
        return "not resizable" in str(e)
    except Exception:  # noqa: BLE001 - random inputs an op rejects: measured no further here
        return False
    return False


def _unresizable(like: torch.Tensor) -> torch.Tensor:
    """A tensor of `like`'s shape and dtype whose storage is exactly its bytes and cannot grow."""
    nbytes = like.numel() * like.element_size()
    if nbytes == 0:
        return like
    return torch.frombuffer(bytearray(nbytes), dtype=like.dtype).view(like.shape)


def _has_backend_kernel(op: torch._ops.OpOverload) -> bool:
    name = f"{op.namespace}::{op._opname}" + (f".{op._overloadname}" if op._overloadname != "default" else "")
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"))
    except RuntimeError:
        return False


def _measured_wrapper(out: torch._ops.OpOverload, node: torch.fx.Node) -> bool:
    return _measured(("out kernel wrapper", out), out, node, _measure, "computes into a temporary and copies")


def _measured(key: tuple, out, node: torch.fx.Node, measure, what: str) -> bool:
    """A fact about an `.out` overload measured once per key (kept in the one cache of decisions)."""
    def decide() -> Decision:
        found = measure(out, node)
        return Decision(FAMILY, kernel_name(out), key[-1] if len(key) > 2 else "", FORMS, (),
                        "functional" if found else "out", what if found else f"measured: it does not ({what})")

    decision = DECISIONS.get(key, decide)
    return decision is not None and decision.pick == "functional"


def _measure(out: torch._ops.OpOverload, node: torch.fx.Node) -> bool:
    """Run `out` once on materialised example inputs under the profiler; a wrapper shows an
    allocation at least as large as its outputs. Anything that keeps us from measuring
    (data-dependent inputs, huge shapes) counts as a wrapper: the functional kernel is
    always correct and is what eager runs."""
    try:
        # whether an overload copies does not depend on sizes: a dynamic one takes the size traced
        # (measured once per overload, so a dynamic first use must not decide for every later one)
        try:
            args, kwargs, out_bytes = _example_call(out, node, hints=True)
        except _TooLarge:  # measure smaller ones
            args, kwargs, out_bytes = _example_call(out, node, cap=_SMALL_SIZE, hints=True)
    except _CannotMeasure:
        return True
    try:
        with _quiet_stderr(), torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as prof:
            out(*args, **kwargs)
    except Exception:  # noqa: BLE001 - random inputs an op rejects: fall back to the functional kernel
        return True
    allocated = sum(max(e.cpu_memory_usage, 0) for e in prof.function_events)
    return out_bytes > 0 and allocated >= out_bytes


class _CannotMeasure(Exception):
    pass


class _TooLarge(_CannotMeasure):
    pass


# every size capped at this when the traced ones are too large to materialise: equal sizes stay
# equal and broadcast 1s stay 1, so most ops (elementwise, GEMMs, norms) still accept the call;
# one that does not (cat, view: sizes related by arithmetic) counts as a wrapper
_SMALL_SIZE = 8


def _materialise(x, cap=None, hints: bool = False):
    """A real tensor (or value) like a traced one. `hints`: a dynamic size takes the size export
    traced (no guard is added); otherwise it cannot be measured."""
    if isinstance(x, torch.fx.Node):
        return _materialise(x.meta.get("val"), cap, hints)
    if isinstance(x, (list, tuple)):
        return type(x)(_materialise(e, cap, hints) for e in x)
    if isinstance(x, torch.SymInt):
        if not hints or x.node.hint is None:
            raise _CannotMeasure()
        return int(x.node.hint)
    if isinstance(x, torch.Tensor):
        dims = M.static_ints(x.shape)
        if dims is None:
            if not hints:
                raise _CannotMeasure()
            dims = M.hint_ints(x.shape)
        shape = dims if cap is None else tuple(min(s, cap) for s in dims)
        if cap is None and math.prod(shape) > _MEASURE_ELEMENTS:
            raise _TooLarge()
        if x.is_floating_point() or x.is_complex():  # (float8: drawn in float32, then rounded)
            return torch.randn(shape, dtype=x.dtype if x.element_size() > 1 else torch.float32).to(x.dtype)
        return torch.zeros(shape, dtype=x.dtype)  # indices: zeros are in range
    return x


def _example_call(out: torch._ops.OpOverload, node: torch.fx.Node, cap=None, hints: bool = False):
    args = [_materialise(a, cap, hints) for a in node.args]
    accepted = {a.name for a in out._schema.arguments}  # out variants drop dtype/device/layout
    kwargs = {k: _materialise(v, cap, hints) for k, v in node.kwargs.items() if k in accepted}
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    outs = [a.name for a in out._schema.arguments if a.is_out]
    results = [_materialise(v, cap, hints) for v in vals]
    if len(outs) != len(results) or not all(isinstance(r, torch.Tensor) for r in results):
        raise _CannotMeasure()
    kwargs.update({name: torch.empty_like(r) for name, r in zip(outs, results)})
    return args, kwargs, sum(r.numel() * r.element_size() for r in results)


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints start/stop lines to file descriptor 2: not the user's business."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(fd, 2)
    finally:
        os.close(fd)

