"""Which kernels run a 1x1 convolution of one image on CUDA in a plan captured as CUDA graphs:
cuDNN's fused call, or one cuBLAS GEMM over the image's pixels.

A 1x1 convolution of one NCHW image is one matrix product: the weight's (out, in) matrix times
the image's (in, pixels) one. cuDNN runs it as an implicit GEMM whose tiles leave most of an
H200 idle when the image is small and the channels many (ResNet-50 at batch 1, layer 4's 2048 to
512 channels at 7x7: 49.9 µs, against 15.9 for the GEMM, the bias, the residual and the ReLU);
at large images cuDNN is the faster. Each distinct convolution of ferry's fused ops
(fused_kernels.py) is timed both ways when a method loads, and the GEMM kept where it saves at
least 10% and 2 µs (runtime/kernel_timing.py).

Only in captured plans: the GEMM form launches up to four kernels for cuDNN's one, and without
graphs that made ResNet-50 at batch 1 slower (bench/results/conv1x1_gemm_experiment.json). Only
fp32 and fp64 where cuDNN would run it, and not where GEMMs may use TF32 while cuDNN may not (the
result would be less precise than eager's). Under deterministic algorithms cuDNN's call is not
made at all (fused_kernels.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferry import fused_kernels
from ferry.runtime import gemm_choice
from ferry.runtime import kernel_timing as timing
from ferry.runtime.gemm_choice import GemmDecision

__all__ = ["OPS", "chosen", "conv1x1_as_mm", "decisions"]

OPS = frozenset({fused_kernels.CONV_RELU, fused_kernels.CONV_ADD_RELU})
_DTYPES = (torch.float32, torch.float64)


_choices = timing.Choices()


def decisions() -> list[GemmDecision]:
    """What this process measured: one entry per distinct 1x1 convolution a captured plan runs."""
    return _choices.values()


def conv1x1_as_mm(x, weight, bias, z=None):
    """relu(conv1x1(x, weight, bias) + z) for one contiguous NCHW image (z may be None): one GEMM
    over its pixels, then the bias, the residual and the ReLU in place on its result."""
    co, ci, h, w = weight.shape[0], x.shape[1], x.shape[2], x.shape[3]
    y = torch.mm(weight.reshape(co, ci), x.reshape(ci, h * w))  # views where the layout allows, as planned
    if bias is not None:
        y.add_(bias.view(co, 1))
    if z is not None:
        y.add_(z.reshape(co, h * w))
    return y.relu_().view(1, co, h, w)


def _relu_form(x, weight, bias, stride, padding, dilation, groups):
    return conv1x1_as_mm(x, weight, bias)


def _add_relu_form(x, weight, z, bias, stride, padding, dilation, groups):
    return conv1x1_as_mm(x, weight, bias, z)


def chosen(op, args: list, measure: bool = True, device: torch.device | None = None) -> Callable | None:
    """The GEMM form of a fused convolution op (its own signature) where this GPU runs it faster
    than cuDNN for arguments like these (real tensors, or meta tensors of the same shape, strides
    and dtype); otherwise None. `device`: the GPU it runs on, where every tensor may be a meta one."""
    residual = op is fused_kernels.CONV_ADD_RELU
    if op not in OPS or len(args) != (8 if residual else 7):
        return None
    x, weight, z = args[0], args[1], args[2] if residual else None
    bias, stride, padding, dilation, groups = args[3:] if residual else args[2:]
    if not _one_image_1x1(x, weight, bias, z, stride, padding, dilation, groups):
        return None
    device = timing.gpu_of([t for t in (x, weight, bias, z) if t is not None], device)
    if device is None or torch.are_deterministic_algorithms_enabled():
        return None
    key = (str(device), x.dtype, *gemm_choice.blas_settings(), torch.backends.cudnn.allow_tf32, tuple(x.shape),
           tuple(weight.shape), bias is None, residual)
    decision = _choices.get(key, device, measure, lambda: _decide(device, op, args, residual))
    if decision is None or not decision.use_gemm:
        return None
    return _add_relu_form if residual else _relu_form


def _one_image_1x1(x, weight, bias, z, stride, padding, dilation, groups) -> bool:
    tensors = [t for t in (x, weight, bias, z) if t is not None]
    if not all(isinstance(t, torch.Tensor) for t in tensors) or x.dim() != 4 or weight.dim() != 4:
        return False
    one_gemm = (x.shape[0] == 1 and tuple(weight.shape[2:]) == (1, 1) and groups == 1 and list(stride) == [1, 1]
                and list(padding) == [0, 0] and list(dilation) == [1, 1])
    shapes_fit = (weight.shape[1] == x.shape[1] and (bias is None or tuple(bias.shape) == (weight.shape[0],))
                  and (z is None or tuple(z.shape) == (1, weight.shape[0], *x.shape[2:])))
    full_precision = x.dtype in _DTYPES and len({t.dtype for t in tensors}) == 1 and not (
        torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32)  # GEMMs no less precise
    return one_gemm and shapes_fit and full_precision and all(t.is_contiguous() for t in tensors)


def _decide(device, op, args, residual) -> GemmDecision | None:
    with timing.on(device), torch.no_grad():
        try:
            real = [timing.scratch(a, device) if isinstance(a, torch.Tensor) else a for a in args]
            x, weight = real[0], real[1]
            bias, z = (real[3], real[2]) if residual else (real[2], None)
            if not fused_kernels._cudnn_takes(x, weight, bias, *real[-4:]):
                return None  # eager's convolution is not cuDNN's here: the op runs that, and stays
            times = timing.time_both(lambda: op(*real), lambda: conv1x1_as_mm(x, weight, bias, z))
        except torch.cuda.OutOfMemoryError:
            return None
    return GemmDecision(str(device), str(x.dtype).removeprefix("torch."), weight.shape[0], weight.shape[1],
                        x.shape[2] * x.shape[3], *times, kind="conv1x1 + residual" if residual else "conv1x1")
