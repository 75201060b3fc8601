"""What a kernel will allocate, known before it runs.

A program file states each result's shape; a kernel computes it. Run on meta tensors
(metadata only, no memory), the kernel says what it would make. The binder asks at load for
every step whose arguments have known shapes, so a file whose shapes disagree with its
kernels is refused before anything runs; a step that meets sizes only a call decides (a
dynamic method's generic plan) asks before each run. Either way no kernel makes a result
larger than the program declares, and the declared sizes are what `max_memory` counts at
load (program/footprint.py, `call_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from ferry.errors import ProgramError
from ferry.ops.variants import functional_variant
from ferry.program.schema import ConstValue, Method, TensorValue
from ferry.runtime.stages.kernels import _checked_once
from ferry.runtime.stages.kernels import _to_meta as as_meta  # (every device the meta device)
from ferry.runtime.stages.refs import LAYOUT_VIEWS, Fixed, Listed, NoMeta, Ref, meta_of, resolve

__all__ = ["META", "STATISTICS_DIFFER", "call_check", "check_kernel", "check_results", "declared", "meta_results",
           "sizing_meta"]

META = torch.device("meta")

# results whose size the meta kernel says otherwise than a device's kernel: batch norm's saved
# statistics in eval are empty on the CPU, one per channel on meta (and CUDA). A file may
# declare either; what either allocates is bounded by the input's channels. op packet -> results
STATISTICS_DIFFER = MappingProxyType({
    name: frozenset({1, 2}) for name in ("_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
                                         "native_batch_norm")
})


# kernels whose results the CPU kernel sizes or types otherwise than the meta kernel (and CUDA's):
# the embedding bag's offset2bag and max_indices; batch norm's saved statistics out of training
# (empty on the CPU); layer and batch norm's statistics of half-precision inputs (of the input's
# dtype on the CPU, float32 elsewhere). A file traced on the CPU declares the CPU's, so on a
# device that runs the CPU's kernels a declaration is held to either; on CUDA to the meta
# kernel's (compile records CUDA's: aot/device_shapes.py). op packet names
CPU_SIZES_DIFFER = frozenset({"embedding_bag", "_embedding_bag", "_embedding_bag_forward_only",
                              "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
                              "_native_batch_norm_legit", "native_batch_norm", "_batch_norm_with_update_functional",
                              "_batch_norm_with_update", "native_layer_norm"})


def check_kernel(m: Method, op, pos: list, kw: dict, outputs, label: str, shapes: dict | None = None) -> None:
    """ProgramError unless `op` on these arguments (references, as bind_aten made them) makes the
    `outputs` the method declares; NoMeta where only a call knows the arguments' sizes."""
    op = torch.ops.aten.reshape.default if op in LAYOUT_VIEWS else op  # (run so over values of a call)
    args = [sizing_meta(m, r, shapes) for r in pos]
    kwargs = {k: sizing_meta(m, r, shapes) for k, r in kw.items()}
    _check_sized(op, args, kwargs, declared(m, outputs), label)


def call_check(m: Method, op, pos: list, kw: dict, outputs, label: str, slots: list):
    """The check of `check_kernel` on the arguments of each call, before the kernel runs."""
    op = torch.ops.aten.reshape.default if op in LAYOUT_VIEWS else op
    want = declared(m, outputs)

    def check():
        _check_sized(op, [resolve(r, slots) for r in pos], {k: resolve(r, slots) for k, r in kw.items()}, want, label)

    return check


def _check_sized(op, args: list, kwargs: dict, want: list, label: str) -> None:
    try:
        check_results(op, meta_results(op, args, kwargs), want, label)
    except ProgramError:
        if getattr(op, "_opname", "") not in CPU_SIZES_DIFFER or any(
                isinstance(v, TensorValue) and v.device.type == "cuda" for v in want):
            raise  # CUDA's kernels make what the meta kernel says: the CPU's sizes and dtypes are no excuse there
        metas = [as_meta(a) for a in args], {k: as_meta(v) for k, v in kwargs.items()}
        made = _as_fakes(op, *metas, device=torch.device("cpu"))
        made = [torch.empty(r.shape, dtype=r.dtype, device=META) if isinstance(r, torch.Tensor) else r
                for r in (made if isinstance(made, (list, tuple)) else [made])]
        check_results(op, _described(made), want, label)


def declared(m: Method, outputs) -> list:
    return [m.values[o] if isinstance(m.values[o], TensorValue) else None for o in outputs]


def sizing_meta(m: Method, r: Ref, shapes: dict | None = None):
    """A meta argument like reference `r`; NoMeta where only a call knows it: a tensor of a
    dynamic size, or a size computed per call (its traced value says nothing about a call's)."""
    if isinstance(r, Fixed):
        return as_meta(r.value)
    if isinstance(r, Listed):
        return [None if e is None else _meta_value(m, e, shapes) for e in r.ids]
    return _meta_value(m, r.vid, shapes)


def _meta_value(m: Method, vid: int, shapes: dict | None):
    v = m.values[vid]
    if isinstance(v, ConstValue) and v.kind == "symint" and (shapes is None or vid not in shapes):
        raise NoMeta()
    return as_meta(meta_of(m, vid, shapes))


def meta_results(op: torch._ops.OpOverload, args: list, kwargs: dict) -> tuple:
    """(shape, dtype) per result `op` makes from arguments like these (meta tensors), None for a
    result that is not a tensor; or a str saying why the kernel cannot tell before it runs.
    Devices become the meta device (a factory op would otherwise allocate where it was told);
    out arguments start empty, so the kernel sizes them; an out kernel with no meta kernel asks
    its functional twin."""
    return _meta_results(op, [as_meta(a) for a in args], {k: as_meta(v) for k, v in kwargs.items()})


@_checked_once
def _meta_results(op, args: list, kwargs: dict):
    args, kwargs = list(args), dict(kwargs)
    outs = []
    for i, a in enumerate(op._schema.arguments):
        where = kwargs if a.kwarg_only else None
        if a.name == "device" and (where is not None or i < len(args)):
            if where is not None:
                kwargs["device"] = META
            else:
                args[i] = META
        elif a.name == "pin_memory" and a.kwarg_only:
            kwargs.pop("pin_memory", None)
        elif a.is_out and isinstance(kwargs.get(a.name), torch.Tensor):
            outs.append(a.name)
            kwargs[a.name] = torch.empty(0, dtype=kwargs[a.name].dtype, device=META)
    try:
        return _described(op(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - no meta kernel, or arguments the kernel refuses
        why = _first_line(e)
    try:
        return _described(_as_fakes(op, args, kwargs))
    except Exception as e:  # noqa: BLE001 - a kernel written for fake tensors says why on them
        if "fake_device" in why:
            why = _first_line(e)
    rule = SIZE_RULES.get(getattr(op, "_opname", ""))
    if rule is not None:
        return _described(rule(*args, **{k: v for k, v in kwargs.items() if k not in outs}))
    twin = functional_variant(op) if outs else None
    if twin is not None:
        try:
            return _described(twin(*args, **{k: v for k, v in kwargs.items() if k not in outs}))
        except Exception:  # noqa: BLE001 - the first answer says more
            pass
    return why


def _geqrf_sizes(a, *_, **__):
    m, n = a.shape[-2:]
    return a.new_empty(a.shape), a.new_empty((*a.shape[:-2], min(m, n)))


def _histogram_sizes(x, bins, *_, **__):
    k = bins if isinstance(bins, int) else bins.shape[0] - 1
    return x.new_empty((k,)), x.new_empty((k + 1,))


# kernels with no meta kernel (nor a fake one), sized from their arguments as their docs say:
# op packet -> (arguments as meta tensors) -> results as meta tensors
SIZE_RULES: Mapping[str, Callable[..., tuple]] = MappingProxyType({"geqrf": _geqrf_sizes, "histogram": _histogram_sizes})


def _as_fakes(op, args: list, kwargs: dict, device: torch.device | None = None):
    """`op` on fake tensors over the same meta tensors: some meta kernels are written for the
    fake tensors export traces with and read `fake_device` (`_weight_int4pack_mm`, which
    torchao's int4 weights call); with `device`, fakes of that device (whose kernels size some
    results otherwise: CPU_SIZES_DIFFER)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode() as mode:
        def fake(a):
            return FakeTensor(mode, a, device or a.device) if isinstance(a, torch.Tensor) else a

        return op(*[fake(a) if not isinstance(a, list) else [fake(e) for e in a] for a in args],
                  **{k: fake(v) for k, v in kwargs.items()})


def _described(result) -> tuple:
    if result is None:  # (an op that returns nothing)
        return ()
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    if any(isinstance(r, torch.Tensor) and r.device.type != "meta" for r in results):
        raise RuntimeError("the kernel made a tensor outside the meta device")  # (never allocate to size)
    return tuple((tuple(r.shape), r.dtype) if isinstance(r, torch.Tensor) else None for r in results)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def check_results(op, results: tuple | str, declared: list, label: str) -> None:
    """ProgramError unless each result `op` makes is the declared tensor (`declared`: a
    TensorValue, or None for a result that is not one): its dtype, and its shape (a dynamic
    dim within its bound; STATISTICS_DIFFER: empty, too)."""
    if isinstance(results, str):
        raise ProgramError(f"{label}: ferry cannot tell the size of its results before running it ({results}), so "
                           "it cannot bound the memory it allocates; such a kernel cannot run from a program file")
    if len(results) != len(declared):
        raise ProgramError(f"{label}: the kernel makes {len(results)} results, the program declares {len(declared)}")
    for j, (r, v) in enumerate(zip(results, declared)):
        if not isinstance(v, TensorValue):
            continue
        empty_ok = j in STATISTICS_DIFFER.get(getattr(op, "_opname", ""), ()) and tuple(v.shape) == (0,)
        if r is None or r[1] != v.torch_dtype or not (_fits(r[0], v) or empty_ok):
            got = "no tensor" if r is None else f"{str(r[1]).removeprefix('torch.')}{list(r[0])}"
            want = f"{v.dtype}{list(v.shape)}" + (" (the bounds of its dynamic dims)" if any(v.dynamic) else "")
            raise ProgramError(f"{label}: its result {j} would be {got}, but the program declares {want}; the "
                               "program's shapes disagree with its kernels (an edited file?), so the memory it "
                               "needs is unknown: nothing was run")


def _fits(shape: tuple, v: TensorValue) -> bool:
    dynamic = v.dynamic or (False,) * len(v.shape)
    return len(shape) == len(v.shape) and all(s <= b if d else s == b for s, b, d in zip(shape, v.shape, dynamic))
