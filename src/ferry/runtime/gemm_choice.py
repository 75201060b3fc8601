"""Which kernels run GEMM-shaped fp32 work on CUDA: eager's, or a plain cuBLAS GEMM, by measurement.

Two places where eager's kernel is measurably slower than cuBLAS's plain GEMM and a little
elementwise work after it:

- `addmm` with a vector bias. ATen runs it through cublasLt and its bias epilogue; for fp32 at a
  few hundred rows that heuristic takes split-K kernels which run up to 2.4x longer than `mm`
  followed by the bias (an H200, TF32 off, µs per GEMM: BERT's 128 rows by 3072 into 768, 54
  against 26; ViT-B/16's 197 rows, 91 against 38). At other shapes the fused epilogue is the
  faster (ViT-B/16 batch 4's 788 rows by 768 into 2304: 70 against 83), and in bf16 it always was.
- A 1x1 convolution of one image (ferry's fused convolution + ReLU ops), which is one matrix
  product in NCHW: the weight's (out, in) matrix times the image's (in, pixels) one. cuDNN runs
  it as an implicit GEMM whose tiles leave most of the GPU idle when the image is small.

No rule of shapes holds across GPUs, so each is measured on the GPU it runs on: once per process
for each distinct shape, layout and dtype, both ways, timed with CUDA events while the GPU runs
them back to back, on scratch tensors where the real output is planned memory (that is never
written). The GEMM is kept only where it saves at least 10% and 2 µs of GPU time (it costs
launches). Only fp32 and fp64, never under a graph capture (no timing there: eager's kernel), and
a GEMM only where its precision is not below the kernel it replaces (no TF32 GEMM for a
convolution cuDNN runs in full fp32).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["GemmDecision", "biased_gemm", "conv1x1_as_mm", "decisions", "mm_then_add", "pointwise_conv"]

_GEMM_DTYPES = (torch.float32, torch.float64)
_KEEP_IF_ABOVE = 0.9  # the GEMM's time over eager's kernel's: above this, eager's kernel stays
_MIN_SAVING_US = 2.0  # about what a second launch costs the host
_QUEUE_CYCLES = 500_000  # GPU clock cycles (0.3-0.5 ms): longer than queueing one timed run takes


@dataclass(frozen=True)
class GemmDecision:
    """kind: "addmm" (rows x inner by inner x cols, a bias) or "conv1x1" (cols pixels, inner
    channels in, rows out); eager_us: eager's kernel (cublasLt's addmm, cuDNN's convolution);
    gemm_us: cuBLAS's GEMM and the elementwise work after it."""

    kind: str
    device: str
    dtype: str
    rows: int
    inner: int
    cols: int
    eager_us: float
    gemm_us: float

    @property
    def use_gemm(self) -> bool:
        return self.gemm_us <= _KEEP_IF_ABOVE * self.eager_us and self.eager_us - self.gemm_us >= _MIN_SAVING_US


_decided: dict[tuple, GemmDecision | None] = {}


def decisions() -> list[GemmDecision]:
    """What this process measured: one entry per distinct GEMM-shaped kernel it ran or loaded."""
    return [d for d in _decided.values() if d is not None]


# ---------------------------------------------------------------- addmm with a bias


def mm_then_add(bias, mat1, mat2, *, beta=1, alpha=1, out):
    """`addmm.out` as cuBLAS's plain GEMM into `out`, then the bias added in place."""
    torch.mm(mat1, mat2, out=out)
    return out.add_(bias)


def biased_gemm(bias, mat1, mat2, out, beta=1, alpha=1) -> Callable | None:
    """`mm_then_add` where this GPU runs it faster than `addmm.out` for operands like these
    (real tensors or meta tensors of the same shape, strides and dtype); otherwise None."""
    operands = (bias, mat1, mat2, out)
    if beta != 1 or alpha != 1 or not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    if bias.dim() != 1 or any(t.dim() != 2 for t in operands[1:]) or len({t.dtype for t in operands}) != 1:
        return None
    if bias.dtype not in _GEMM_DTYPES:
        return None
    device = _gpu_of(operands)
    if device is None:
        return None
    key = ("addmm", str(device), bias.dtype, *((tuple(t.shape), t.stride()) for t in operands))
    rows, inner = mat1.shape
    decision = _decision(key, device, lambda: _addmm_pair(device, operands),
                         lambda times: GemmDecision("addmm", str(device), _name(bias.dtype), rows, inner,
                                                    out.shape[1], *times))
    return mm_then_add if decision is not None and decision.use_gemm else None


def _addmm_pair(device: torch.device, operands) -> tuple[Callable, Callable]:
    bias, mat1, mat2 = (_scratch(t, device) for t in operands[:3])
    out = _scratch(operands[3], device, written=True)
    return lambda: torch.addmm(bias, mat1, mat2, out=out), lambda: mm_then_add(bias, mat1, mat2, out=out)


def _scratch(t: torch.Tensor, device: torch.device, written: bool = False) -> torch.Tensor:
    """A real operand that is only read, as it is (a weight); a stand-in of the same layout for
    a meta one, or for the one written (planned memory stays untouched)."""
    if t.device.type != "meta" and not written:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).normal_()


# ---------------------------------------------------------------- 1x1 convolution of one image


def conv1x1_as_mm(x, weight, bias, z):
    """relu(conv1x1(x, weight, bias) + z) for one contiguous NCHW image (z may be None): one GEMM
    over its pixels, then the bias, the residual and the ReLU in place on its result."""
    co, ci, h, w = weight.shape[0], x.shape[1], x.shape[2], x.shape[3]
    y = torch.mm(weight.view(co, ci), x.view(ci, h * w))
    if bias is not None:
        y.add_(bias.view(co, 1))
    if z is not None:
        y.add_(z.view(co, h * w))
    return y.relu_().view(1, co, h, w)


def pointwise_conv(x, weight, bias, z, stride, padding, groups, cudnn: Callable[[], torch.Tensor]) -> Callable:
    """`cudnn` (the call eager's kernel makes), or `conv1x1_as_mm` over these arguments where
    this GPU runs that faster. The arguments are checked already (fused_kernels)."""
    if not _one_image_1x1(x, weight, z, stride, padding, groups):
        return cudnn
    device = _gpu_of((x, weight))
    if device is None:
        return cudnn
    gemm = lambda: conv1x1_as_mm(x, weight, bias, z)  # noqa: E731
    key = ("conv1x1", str(device), x.dtype, tuple(x.shape), tuple(weight.shape), bias is None, z is None)
    decision = _decision(key, device, lambda: (cudnn, gemm),
                         lambda times: GemmDecision("conv1x1", str(device), _name(x.dtype), weight.shape[0],
                                                    x.shape[1], x.shape[2] * x.shape[3], *times))
    return gemm if decision is not None and decision.use_gemm else cudnn


def _one_image_1x1(x, weight, z, stride, padding, groups) -> bool:
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    return (x.dim() == 4 and x.shape[0] == 1 and tuple(weight.shape[2:]) == (1, 1) and groups == 1
            and list(stride) == [1, 1] and list(padding) == [0, 0] and x.dtype in _GEMM_DTYPES
            and x.is_contiguous() and weight.is_contiguous() and (z is None or z.is_contiguous())
            and not (matmul_tf32 and not cudnn_tf32))


# ---------------------------------------------------------------- measuring


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gpu_of(operands) -> torch.device | None:
    """The CUDA device the operands are on, or None."""
    device = _real_device(operands)
    return device if device is not None and device.type == "cuda" else None


def _real_device(operands) -> torch.device | None:
    """The one device of the real tensors among `operands` (meta ones take theirs), or None."""
    real = {t.device for t in operands if t.device.type != "meta"}
    return next(iter(real)) if len(real) == 1 else None


def _decision(key: tuple, device: torch.device, pair: Callable[[], tuple[Callable, Callable]],
              made: Callable[[tuple[float, float]], GemmDecision]) -> GemmDecision | None:
    """The decision for `key`, measured the first time: `pair()` gives (eager's call, the GEMM's).
    None (eager's kernel) where it cannot be timed: no memory for scratch, or a graph being
    captured, which is not remembered (the next call outside the capture measures)."""
    if key in _decided:
        return _decided[key]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    try:
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on_device, torch.no_grad():
            times = _time_both(*pair())
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        times = None
    _decided[key] = None if times is None else made(times)
    return _decided[key]


def _time_both(first: Callable, second: Callable, reps: int = 10, rounds: int = 3) -> tuple[float, float]:
    """The GPU time of each (µs per call, the best of `rounds` runs of `reps` calls), the two
    taken in turn. Each run is queued behind a kernel that keeps the GPU busy, so the events
    time the kernels back to back, not how fast Python launches them."""
    best = [math.inf, math.inf]
    for fn in (first, second) * 3:  # warm-up: kernels loaded, cuBLAS's workspace made
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for i, fn in enumerate((first, second)):
            torch.cuda._sleep(_QUEUE_CYCLES)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            best[i] = min(best[i], start.elapsed_time(end) * 1e3 / reps)
    return best[0], best[1]
