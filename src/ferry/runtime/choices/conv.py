"""Which kernels run a convolution of one image on CUDA in a plan captured as CUDA graphs:
cuDNN's fused call, or one cuBLAS GEMM over the image's patches.

A convolution of one NCHW image is one matrix product: the weight's (out, in x kernel) matrix
times the image's patches, (in x kernel, pixels), which `unfold` (im2col) lays out in one kernel;
for a 1x1 kernel of stride 1 the image itself is that matrix. cuDNN's fp32 kernels leave most of
an H200 idle when the image is small and the channels many; at batch 1 with TF32 off
(bench/results/conv_gemm.json, µs replayed from a graph):

    ResNet's 3x3, 512 channels at 7x7       cuDNN 107.3   im2col + GEMM 27.5
    3x3, 256 channels at 14x14              cuDNN  55.2   im2col + GEMM 24.5
    1x1, 2048 to 512 channels at 7x7        cuDNN  49.3   GEMM          13.0
    3x3, 64 channels at 56x56               cuDNN  17.5   im2col + GEMM 25.5 (cuDNN stays)

No rule of shapes holds across GPUs, so each distinct convolution of ferry's fused ops
(ops/fused.py) is timed both ways when a method loads, and the GEMM kept where it saves at
least 10% and 2 µs (runtime/choices/timing.py).

Only in captured plans: the GEMM form launches up to five kernels for cuDNN's one, and without
graphs that made ResNet-50 at batch 1 slower (bench/results/conv1x1_gemm_experiment.json). Only
fp32 and fp64 where cuDNN would run it, without groups, and not where GEMMs may use TF32 while
cuDNN may not (the result would be less precise than eager's). The patches are a tensor the
call allocates (at most 2^24 elements, 64 MiB in fp32; from the graph's pool). Under deterministic algorithms cuDNN's
call is not made at all (ops/fused.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ferry.ops import fused
from ferry.runtime.choices import gemm as gemm_choice
from ferry.runtime.choices import timing
from ferry.runtime.choices.gemm import GemmDecision

__all__ = ["OPS", "chosen", "conv_as_gemm", "decisions"]

OPS = frozenset({fused.CONV_RELU, fused.CONV_ADD_RELU})
_DTYPES = (torch.float32, torch.float64)
_MAX_PATCHES = 1 << 24  # elements of the patches' matrix (64 MiB in fp32, 128 in fp64); a 1x1 one has none


_choices = timing.Choices()


def decisions() -> list[GemmDecision]:
    """What this process measured: one entry per distinct convolution a captured plan runs."""
    return _choices.values()


def conv_as_gemm(x, weight, bias, z=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1)):
    """relu(conv2d(x, weight, bias, stride, padding, dilation) + z) for one NCHW image (z may be
    None): one GEMM of the weight over the image's patches, then the bias, the residual and the
    ReLU in place on its result."""
    co, ci, kh, kw = weight.shape
    ho, wo = fused._result_shape(x, weight, stride, padding, dilation)[2:]
    if _pointwise(weight, stride, padding):
        patches = x.reshape(ci, ho * wo)  # a view where the layout allows, as planned
    else:
        patches = torch.nn.functional.unfold(x, (kh, kw), dilation, padding, stride)[0]  # (ci*kh*kw, ho*wo)
    y = torch.mm(weight.reshape(co, ci * kh * kw), patches)
    if bias is not None:
        y.add_(bias.view(co, 1))
    if z is not None:
        y.add_(z.reshape(co, ho * wo))
    return y.relu_().view(1, co, ho, wo)


def _pointwise(weight, stride, padding) -> bool:
    return tuple(weight.shape[2:]) == (1, 1) and list(stride) == [1, 1] and list(padding) == [0, 0]


def _relu_form(x, weight, bias, stride, padding, dilation, groups):
    return conv_as_gemm(x, weight, bias, None, stride, padding, dilation)


def _add_relu_form(x, weight, z, bias, stride, padding, dilation, groups):
    return conv_as_gemm(x, weight, bias, z, stride, padding, dilation)


def chosen(op, args: list, measure: bool = True, device: torch.device | None = None) -> Callable | None:
    """The GEMM form of a fused convolution op (its own signature) where this GPU runs it faster
    than cuDNN for arguments like these (real tensors, or meta tensors of the same shape, strides
    and dtype); otherwise None. `device`: the GPU it runs on, where every tensor may be a meta one."""
    residual = op is fused.CONV_ADD_RELU
    if op not in OPS or len(args) != (8 if residual else 7):
        return None
    x, weight, z = args[0], args[1], args[2] if residual else None
    bias, stride, padding, dilation, groups = args[3:] if residual else args[2:]
    if not _one_image(x, weight, bias, z, stride, padding, dilation, groups):
        return None
    device = timing.gpu_of([t for t in (x, weight, bias, z) if t is not None], device)
    if device is None or torch.are_deterministic_algorithms_enabled():
        return None
    key = (str(device), x.dtype, *gemm_choice.blas_settings(), torch.backends.cudnn.allow_tf32, tuple(x.shape),
           tuple(weight.shape), bias is None, residual, *map(tuple, (stride, padding, dilation)))
    decision = _choices.get(key, device, measure, lambda: _decide(device, op, args, residual))
    if decision is None or not decision.use_gemm:
        return None
    return _add_relu_form if residual else _relu_form


def _one_image(x, weight, bias, z, stride, padding, dilation, groups) -> bool:
    tensors = [t for t in (x, weight, bias, z) if t is not None]
    if not all(isinstance(t, torch.Tensor) for t in tensors) or x.dim() != 4 or x.shape[0] != 1 or groups != 1:
        return False
    if not fused.args_fit(x, weight, bias, stride, padding, dilation, groups):
        return False  # eager refuses it: the GEMM must not answer it
    out = fused._result_shape(x, weight, stride, padding, dilation)
    small = _pointwise(weight, stride, padding) or math.prod(weight.shape[1:]) * out[2] * out[3] <= _MAX_PATCHES
    full_precision = x.dtype in _DTYPES and (z is None or z.dtype == x.dtype) and not (
        torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32)  # GEMMs no less precise
    fits_z = z is None or tuple(z.shape) == out
    return fits_z and small and full_precision and all(t.is_contiguous() for t in tensors)


def _decide(device, op, args, residual) -> GemmDecision | None:
    with timing.on(device), torch.no_grad():
        try:
            real = [timing.scratch(a, device) if isinstance(a, torch.Tensor) else a for a in args]
            x, weight = real[0], real[1]
            bias, z = (real[3], real[2]) if residual else (real[2], None)
            conv = real[-4:-1]
            if not fused._cudnn_takes(x, weight, bias, *real[-4:]):
                return None  # eager's convolution is not cuDNN's here: the op runs that, and stays
            times = timing.time_both(lambda: op(*real), lambda: conv_as_gemm(x, weight, bias, z, *conv))
        except torch.cuda.OutOfMemoryError:
            return None
    co, ci, kh, kw = weight.shape
    pixels = math.prod(fused._result_shape(x, weight, *conv)[2:])
    kind = f"conv{kh}x{kw}" + (" + residual" if residual else "")
    return GemmDecision(str(device), str(x.dtype).removeprefix("torch."), co, ci * kh * kw, pixels, *times, kind=kind)
