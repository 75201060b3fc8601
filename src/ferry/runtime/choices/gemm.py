"""Which kernels run a biased fp32 GEMM on CUDA: eager's `addmm`, or `mm` and then the bias added.

ATen runs `addmm` with a vector bias through cublasLt's bias epilogue, whose heuristic takes slow
split-K kernels for fp32 at a few hundred rows (on an H200, BERT's 128 x 3072 x 768: 54 µs
against 26 for `mm` then the bias); at other shapes, and in bf16, the epilogue is the faster
(README, `bench/gemm_kernels.py`). No rule of shapes holds across GPUs, so each distinct GEMM is
timed both ways when a method loads, on the GPU it loads on, and the split is kept where it saves
at least 10% and 2 µs. Only fp32 and fp64 are split: in half precision the product would be
rounded before the bias is added. Under deterministic algorithms eager's kernel always runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ferry.runtime.choices import timing

__all__ = ["GemmDecision", "biased_gemm", "decisions", "mm_then_add"]

_GEMM_DTYPES = (torch.float32, torch.float64)
_MAX_MACS = 1 << 33  # not timed above (4096^3 took 1 s of load); BERT batch 8, ViT batch 4 (2.4e9) are under it


@dataclass(frozen=True)
class GemmDecision:
    """A GEMM of rows x inner by inner x cols: eager_us for eager's kernel, gemm_us for cuBLAS's
    plain GEMM and the elementwise work after it. `kind`: "addmm" (a bias: cublasLt's `addmm`
    against `mm` then the bias), or "conv3x3", "conv1x1 + residual", ... (cuDNN's fused
    convolution of one image, rows channels out, inner inputs of each (channels x kernel), over
    cols pixels: runtime/choices/conv.py)."""

    device: str
    dtype: str
    rows: int
    inner: int
    cols: int
    eager_us: float
    gemm_us: float
    kind: str = "addmm"

    @property
    def use_gemm(self) -> bool:
        return timing.faster(self.eager_us, self.gemm_us)


_choices = timing.Choices()


def decisions() -> list[GemmDecision]:
    """What this process measured: one entry per distinct biased GEMM a loaded program runs, or
    that a composed multi-head attention would (runtime/choices/attention.py)."""
    return _choices.values()


def mm_then_add(bias, mat1, mat2, *, beta=1, alpha=1, out):
    """`addmm.out` as cuBLAS's plain GEMM into `out`, then the bias added in place."""
    torch.mm(mat1, mat2, out=out)
    return out.add_(bias)


def biased_gemm(bias, mat1, mat2, out, beta=1, alpha=1, measure: bool = True,
                device: torch.device | None = None) -> Callable | None:
    """`mm_then_add` where this GPU runs it faster than `addmm.out` for operands like these
    (real tensors or meta tensors of the same shape, strides and dtype); otherwise None.
    `measure=False` (a plan bound during a call): only what was measured already is used.
    `device`: the GPU, where every operand may be a meta tensor."""
    operands = (bias, mat1, mat2, out)
    if beta != 1 or alpha != 1 or not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    if bias.dim() != 1 or any(t.dim() != 2 for t in operands[1:]) or len({t.dtype for t in operands}) != 1:
        return None
    rows, inner = mat1.shape
    if bias.dtype not in _GEMM_DTYPES or rows * inner * out.shape[1] > _MAX_MACS:
        return None
    device = timing.gpu_of(operands, device)
    if device is None or torch.are_deterministic_algorithms_enabled():
        return None
    key = (str(device), bias.dtype, *blas_settings(), *((tuple(t.shape), t.stride()) for t in operands))
    decision = _choices.get(key, device, measure, lambda: _decide(device, operands))
    return mm_then_add if decision is not None and decision.use_gemm else None


def blas_settings() -> tuple:
    """What changes the kernels cuBLAS picks: TF32, and which BLAS library runs GEMMs."""
    return torch.backends.cuda.matmul.allow_tf32, str(torch.backends.cuda.preferred_blas_library())


def _decide(device: torch.device, operands) -> GemmDecision | None:
    """Both ways timed on scratch tensors (the planned output is never written): the decision,
    or None where there is no memory for them."""
    with timing.on(device), torch.no_grad():
        try:
            bias, mat1, mat2 = (timing.scratch(t, device) for t in operands[:3])
            out = timing.scratch(operands[3], device, written=True)
            times = timing.time_both(lambda: torch.addmm(bias, mat1, mat2, out=out),
                                     lambda: mm_then_add(bias, mat1, mat2, out=out))
        except torch.cuda.OutOfMemoryError:  # eager's kernel stays; any other error is the caller's to see
            return None
    (rows, inner), cols = operands[1].shape, operands[3].shape[1]
    return GemmDecision(str(device), str(bias.dtype).removeprefix("torch."), rows, inner, cols, *times)
