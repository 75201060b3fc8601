"""Fused inference kernels ferry's compiler targets: a convolution with its bias, an optional
residual add and the ReLU after it, as one call.

On CUDA, where eager's convolution would run cuDNN, each is one cuDNN call
(`cudnn_convolution_relu` / `cudnn_convolution_add_relu`, the kernels TorchScript's frozen-module
optimisations use). Measured on an H200 (bench/models.py, README): ResNet-18 with CUDA graphs at
batch 1 went from 1.32 to 1.24 ms, and one tensor per convolution instead of two took the peak of
ResNet-18 at batch 32 from 1.04x eager's to 0.93x, MobileNetV3's from 1.00x to 0.75x. Elsewhere
(the CPU, a shape eager runs with another kernel, deterministic algorithms) it is the convolution,
then the add and the ReLU in place on its result: the work eager does, without a second tensor.

Schemas (namespace `ferry`):

    conv_relu(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding,
              SymInt[] dilation, SymInt groups) -> Tensor
    conv_add_relu(Tensor input, Tensor weight, Tensor z, Tensor? bias, SymInt[] stride,
                  SymInt[] padding, SymInt[] dilation, SymInt groups) -> Tensor

`conv_add_relu` is relu(conv(input, weight, bias) + z).
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch

from ferry.ops.library import NAMESPACE, new_fragment

__all__ = ["CONV_ADD_RELU", "CONV_RELU", "MAX_PATCHES", "patch_bytes", "pointwise"]

_ARGS = "SymInt[] stride, SymInt[] padding, SymInt[] dilation, SymInt groups"
_SCHEMAS = MappingProxyType({
    "conv_relu": f"conv_relu(Tensor input, Tensor weight, Tensor? bias, {_ARGS}) -> Tensor",
    "conv_add_relu": f"conv_add_relu(Tensor input, Tensor weight, Tensor z, Tensor? bias, {_ARGS}) -> Tensor",
})
aten = torch.ops.aten


def _conv(x, weight, bias, stride, padding, dilation, groups):
    return aten.convolution.default(x, weight, bias, stride, padding, dilation, False, [0] * len(stride), groups)


def _conv_relu(x, weight, bias, stride, padding, dilation, groups):
    return _conv(x, weight, bias, stride, padding, dilation, groups).relu_()


def _conv_add_relu(x, weight, z, bias, stride, padding, dilation, groups):
    out = _conv(x, weight, bias, stride, padding, dilation, groups)
    _check_z(out.shape, z, out.device)
    return out.add_(z).relu_()


def _check_z(shape, z, device) -> None:
    """`z` has the result's exact shape and device (a program file may claim anything: cuDNN is
    never handed a `z` smaller than what it reads, or on another GPU)."""
    if tuple(z.shape) != tuple(shape) or z.device != device:
        raise ValueError(f"conv_add_relu: z has shape {tuple(z.shape)} on {z.device}, the convolution's result "
                         f"{tuple(shape)} on {device}")


MAX_PATCHES = 1 << 24  # elements of a GEMM form's patches matrix (64 MiB in fp32, 128 in fp64; choices/conv.py)


def pointwise(weight, stride, padding) -> bool:
    """A 1x1 convolution of stride 1 and no padding: the image itself is its patches matrix."""
    return tuple(weight.shape[2:]) == (1, 1) and list(stride) == [1, 1] and list(padding) == [0, 0]


def patch_bytes(kernel: str, args: list) -> int:
    """Bytes of the patches a fused convolution of one CUDA image allocates during a call if the
    load runs it as one GEMM over them (a choice the file does not record: choices/conv.py
    `form`), else 0. `args`: the call's values in schema order (a TensorValue's shape and dtype,
    a ConstValue's value). The memory a call needs counts them (program/footprint.py)."""
    if kernel.split(".")[0] not in ("ferry::conv_relu", "ferry::conv_add_relu") or len(args) < 7:
        return 0
    x, weight = args[0], args[1]
    stride, padding, dilation, groups = (getattr(a, "value", None) for a in args[-4:])
    shaped = all(hasattr(t, "shape") and len(t.shape) == 4 for t in (x, weight))
    if not shaped or getattr(x, "device", None) is None or x.device.type != "cuda":
        return 0
    one_image = x.shape[0] == 1 or bool(x.dynamic and x.dynamic[0])  # (a dynamic batch: its calls of one)
    if not one_image or x.torch_dtype not in (torch.float32, torch.float64):  # the forms the GEMM takes
        return 0
    if groups != 1 or not all(isinstance(v, (list, tuple)) for v in (stride, padding, dilation)):
        return 0
    if pointwise(weight, stride, padding):
        return 0
    out = result_shape(x, weight, stride, padding, dilation)
    n = math.prod(weight.shape[1:]) * out[2] * out[3]
    return n * torch.empty((), dtype=x.torch_dtype).element_size() if n <= MAX_PATCHES else 0


def result_shape(x, weight, stride, padding, dilation) -> tuple[int, ...]:
    spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1
               for size, k, s, p, d in zip(x.shape[2:], weight.shape[2:], stride, padding, dilation)]
    return (x.shape[0], weight.shape[0], *spatial)


def args_fit(x, weight, bias, stride, padding, dilation, groups) -> bool:
    """The arguments make a 2-D convolution eager accepts, devices apart (a tensor may be a meta one)."""
    o = weight.shape[0] if weight.dim() == 4 else -1
    return not (x.dim() != 4 or weight.dim() != 4 or min(weight.shape) < 1 or groups < 1 or o % groups
                or x.shape[1] != weight.shape[1] * groups or any(len(a) != 2 for a in (stride, padding, dilation))
                or min(stride) < 1 or min(dilation) < 1 or min(padding) < 0
                or (bias is not None and tuple(bias.shape) != (o,))
                or x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype)
                or min(result_shape(x, weight, stride, padding, dilation)) < 1)


def _check_args(x, weight, bias, stride, padding, dilation, groups) -> None:
    bad = (not args_fit(x, weight, bias, stride, padding, dilation, groups)
           or weight.device != x.device or (bias is not None and bias.device != x.device))
    if bad:
        raise ValueError(f"convolution arguments do not fit: input {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}, stride {list(stride)}, "
                         f"padding {list(padding)}, dilation {list(dilation)}, groups {groups}")


def cudnn_takes(x, weight, bias, stride, padding, dilation, groups) -> bool:
    """cuDNN is what eager's convolution would run here (not the depthwise or the slow
    fallback kernels eager picks for some shapes and dtypes), so the fused call is the same
    convolution with its epilogue. The fused path has no 1-D or 3-D form. Arguments a
    convolution refuses are refused here, before cuDNN sees them (what aten.convolution checks)."""
    if x.dim() != 4 or torch.backends.cudnn.deterministic or torch.are_deterministic_algorithms_enabled():
        return False  # cuDNN's fused call has no deterministic mode: eager's convolution then add and ReLU
    if x.shape[0] == 0:
        return False  # an empty batch (a dynamic one may be): eager's convolution returns an empty result
    _check_args(x, weight, bias, stride, padding, dilation, groups)
    backend = torch._C._select_conv_backend(x, weight, bias, stride, padding, dilation, False, [0, 0], groups, None)
    return backend == torch._C._ConvBackend.Cudnn  # type: ignore[attr-defined]


def _conv_relu_cuda(x, weight, bias, stride, padding, dilation, groups):
    if cudnn_takes(x, weight, bias, stride, padding, dilation, groups):
        return aten.cudnn_convolution_relu.default(x, weight, bias, stride, padding, dilation, groups)
    return _conv_relu(x, weight, bias, stride, padding, dilation, groups)


def _conv_add_relu_cuda(x, weight, z, bias, stride, padding, dilation, groups):
    if z.dtype == x.dtype and cudnn_takes(x, weight, bias, stride, padding, dilation, groups):
        _check_z(result_shape(x, weight, stride, padding, dilation), z, x.device)
        return aten.cudnn_convolution_add_relu.default(x, weight, z, 1.0, bias, stride, padding, dilation, groups)
    return _conv_add_relu(x, weight, z, bias, stride, padding, dilation, groups)


def _fake_conv_add_relu(x, weight, z, bias, stride, padding, dilation, groups):
    return _conv(x, weight, bias, stride, padding, dilation, groups)


def _register() -> torch.library.Library | None:
    """Define the two ops once per process (a second import, or reload, finds them defined)."""
    lib = new_fragment("conv_relu")
    if lib is None:
        return None
    for schema in _SCHEMAS.values():
        lib.define(schema)
    lib.impl("conv_relu", _conv_relu, "CompositeExplicitAutograd")
    lib.impl("conv_add_relu", _conv_add_relu, "CompositeExplicitAutograd")
    lib.impl("conv_relu", _conv_relu_cuda, "CUDA")
    lib.impl("conv_add_relu", _conv_add_relu_cuda, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::conv_relu", _conv, lib=lib)  # the shapes of the convolution
    torch.library.register_fake(f"{NAMESPACE}::conv_add_relu", _fake_conv_add_relu, lib=lib)
    return lib


_lib = globals().get("_lib") or _register()  # kept: the registrations live as long as it does
CONV_RELU = torch.ops.ferry.conv_relu.default
CONV_ADD_RELU = torch.ops.ferry.conv_add_relu.default
