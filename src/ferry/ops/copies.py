"""The et_copy op library: explicit host<->device copies as graph nodes.

Same schemas as ExecuTorch's, so graphs made by either toolchain load in the other. While
tracing, tensors are CPU or fake and the copies are clones; the destination device of a
functional copy is recorded on the node (see ferry.aot.placement), not in the schema.
If another toolchain already defined the namespace, ferry reuses its ops and adds only
what is missing.
"""

from __future__ import annotations

import contextlib
import threading
from types import MappingProxyType

import torch

from ferry.op_names import kernel_name

NAMESPACE = "et_copy"
COPY_OPS = ("_h2d_copy", "_d2h_copy", "_d2d_copy")

_SCHEMAS = MappingProxyType({
    "": "{name}(Tensor self) -> Tensor",
    "out": "{name}.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)",
})

# Keep a reference: the registrations live as long as this object. On importlib.reload the
# module dict survives, so the library made by the first import is reused; making a new one
# would let the old one be collected, which deregisters the ops and invalidates every
# OpOverload (and every graph) made before the reload.
_lib = globals().get("_lib") or torch.library.Library(NAMESPACE, "FRAGMENT")


def _defined(name: str, overload: str) -> bool:
    packet = getattr(getattr(torch.ops, NAMESPACE), name, None) if _namespace_exists() else None
    if packet is None:
        return False
    return (overload or "default") in packet.overloads()


def _namespace_exists() -> bool:
    try:
        getattr(torch.ops, NAMESPACE)
        return True
    except (AttributeError, RuntimeError):
        return False


def _check_out(self: torch.Tensor, out: torch.Tensor, op: str) -> None:
    if self.dtype != out.dtype:
        raise RuntimeError(f"{NAMESPACE}::{op}.out: dtype mismatch, self is {self.dtype} but out is {out.dtype}")


def _functional(self: torch.Tensor) -> torch.Tensor:
    return self.clone(memory_format=torch.contiguous_format)


def _make_out_kernel(name: str):
    def kernel(self: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        _check_out(self, out, name)
        if out.shape != self.shape:
            out.resize_(self.shape)
        out.copy_(self)
        return out

    return kernel


def _fake_functional(self: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(self, memory_format=torch.contiguous_format)


def _fake_out(self: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return out


def _register() -> None:
    for name in COPY_OPS:
        if not _defined(name, ""):
            _lib.define(_SCHEMAS[""].format(name=name))
            _lib.impl(name, _functional, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{name}", _fake_functional, lib=_lib)
        if not _defined(name, "out"):
            _lib.define(_SCHEMAS["out"].format(name=name))
            _lib.impl(f"{name}.out", _make_out_kernel(name), "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{name}.out", _fake_out, lib=_lib)


_register()


# ---------------------------------------------------------------- ATen mode
# Real kernels for PyTorch's dispatcher, so a placed graph runs eagerly on a GPU machine.
# Direction comes from the op; the destination device from `out` (several GPUs work).


def _aten_checks(op: str, self: torch.Tensor, out: torch.Tensor) -> None:
    """Everything is checked before a byte moves; then `out` is resized to `self`'s shape."""
    if self.dtype != out.dtype:
        raise RuntimeError(f"{NAMESPACE}::{op}.out: dtype mismatch, self is {self.dtype}, out is {out.dtype}")
    if not self.is_contiguous() or not out.is_contiguous():
        raise RuntimeError(f"{NAMESPACE}::{op}.out: self and out must be contiguous")
    need = self.numel() * self.element_size()
    have = out.untyped_storage().nbytes() - out.storage_offset() * out.element_size()
    if need > have:
        raise RuntimeError(
            f"{NAMESPACE}::{op}.out: out can hold {have} bytes from its offset but self needs {need} "
            f"({tuple(self.shape)} {self.dtype})"
        )


def _aten_out(op: str, src_cuda: bool, dst_cuda: bool):
    def kernel(self: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        if self.is_cuda != src_cuda or out.is_cuda != dst_cuda:
            want = {"_h2d_copy": "a CPU self and a CUDA out", "_d2h_copy": "a CUDA self and a CPU out",
                    "_d2d_copy": "CUDA self and out"}[op]
            raise RuntimeError(f"{NAMESPACE}::{op}.out needs {want}, got self on {self.device}, out on {out.device}")
        _aten_checks(op, self, out)
        if out.shape != self.shape:
            out.resize_(self.shape)
        if self.numel():
            out.copy_(self)
        return out

    return kernel


_mode = threading.local()  # registry (per thread): whether aten_mode() is on


@contextlib.contextmanager
def aten_mode():
    """Run placed graphs eagerly for real: inside this block the functional `_h2d_copy` moves
    its input to the current CUDA device. Outside it, it is the tracing clone, so tracing and
    eager checks behave the same on machines with and without a GPU. (The `.out` forms and the
    other copies always follow the devices of their tensors.)"""
    prev = getattr(_mode, "on", False)
    _mode.on = True
    try:
        yield
    finally:
        _mode.on = prev


def _h2d_functional_aten(self: torch.Tensor) -> torch.Tensor:
    if getattr(_mode, "on", False) and torch.cuda.is_available():
        return self.to(torch.device("cuda", torch.cuda.current_device()), copy=True)
    return _functional(self)


def _register_aten_mode() -> None:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    kernels = {
        ("_h2d_copy.out", "CUDA"): _aten_out("_h2d_copy", False, True),
        ("_d2h_copy.out", "CUDA"): _aten_out("_d2h_copy", True, False),
        ("_d2d_copy.out", "CUDA"): _aten_out("_d2d_copy", True, True),
        ("_h2d_copy", "CPU"): _h2d_functional_aten,
        ("_d2h_copy", "CUDA"): lambda self: self.to("cpu", copy=True),
        ("_d2d_copy", "CUDA"): lambda self: self.to(torch.device("cuda", torch.cuda.current_device()), copy=True),
    }
    for (name, key), fn in kernels.items():
        if not has(f"{NAMESPACE}::{name}", key):
            _lib.impl(name, fn, key)


_register_aten_mode()

h2d_copy = torch.ops.et_copy._h2d_copy
d2h_copy = torch.ops.et_copy._d2h_copy
d2d_copy = torch.ops.et_copy._d2d_copy

FUNCTIONAL_COPIES = frozenset({h2d_copy.default, d2h_copy.default, d2d_copy.default})
OUT_COPIES = frozenset({h2d_copy.out, d2h_copy.out, d2d_copy.out})
COPY_DIRECTION = MappingProxyType({
    h2d_copy.default: "h2d", d2h_copy.default: "d2h", d2d_copy.default: "d2d",
    h2d_copy.out: "h2d", d2h_copy.out: "d2h", d2d_copy.out: "d2d",
})
FUNCTIONAL_COPY_FOR = MappingProxyType({"h2d": h2d_copy.default, "d2h": d2h_copy.default, "d2d": d2d_copy.default})
# the same table by the kernel names programs store ("et_copy::_h2d_copy.out" -> "h2d")
COPY_KERNELS = {kernel_name(op): direction for op, direction in COPY_DIRECTION.items()}
OUT_COPY_KERNELS = {kernel_name(op): COPY_DIRECTION[op] for op in OUT_COPIES}


def is_copy_node(node) -> bool:
    return node.op == "call_function" and node.target in COPY_DIRECTION
