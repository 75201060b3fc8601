"""Which kernels run a biased fp32 GEMM on CUDA: eager's `addmm`, or `mm` and then the bias added.

ATen runs `addmm` with a vector bias through cublasLt and its bias epilogue. For fp32 at a few
hundred rows that heuristic takes split-K kernels which run up to 2.4x longer than cuBLAS's plain
GEMM followed by the bias (an H200, TF32 off, µs per GEMM: BERT's 128 rows by 3072 into 768, 54
against 26; ViT-B/16's 197 rows, 91 against 38); at other shapes the fused epilogue is the faster
(ViT-B/16 batch 4's 788 rows by 768 into 2304: 70 against 83), and in bf16 it always was. No rule
of shapes holds across GPUs, so this is measured on the GPU the program loads on: once per
process for each distinct shape, layout and dtype, both ways, timed with CUDA events on scratch
tensors (planned memory is never written) while the GPU runs them back to back. The split is
kept only where it saves at least 10% and 2 µs of GPU time (it costs one more launch). Only fp32
and fp64 are split: in half precision the product would be rounded before the bias is added,
where the epilogue adds it in fp32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["GemmDecision", "biased_gemm", "decisions", "mm_then_add"]

_SPLIT_DTYPES = (torch.float32, torch.float64)
_KEEP_IF_ABOVE = 0.9  # the split's time over addmm's: above this, eager's addmm stays
_MIN_SAVING_US = 2.0  # about what the second launch costs the host
_QUEUE_CYCLES = 500_000  # GPU clock cycles (0.3-0.5 ms): longer than queueing one timed run takes


@dataclass(frozen=True)
class GemmDecision:
    device: str
    dtype: str
    rows: int
    inner: int
    cols: int
    addmm_us: float
    split_us: float

    @property
    def split(self) -> bool:
        return (self.split_us <= _KEEP_IF_ABOVE * self.addmm_us
                and self.addmm_us - self.split_us >= _MIN_SAVING_US)


_decided: dict[tuple, GemmDecision | None] = {}


def decisions() -> list[GemmDecision]:
    """What this process measured: one entry per distinct biased GEMM a loaded program runs."""
    return [d for d in _decided.values() if d is not None]


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
    if bias.dtype not in _SPLIT_DTYPES:
        return None
    device = _gpu_of(operands)
    if device is None:
        return None
    key = (str(device), bias.dtype, *((tuple(t.shape), t.stride()) for t in operands))
    if key not in _decided:
        _decided[key] = _decide(device, operands)
    decision = _decided[key]
    return mm_then_add if decision is not None and decision.split else None


def _gpu_of(operands) -> torch.device | None:
    """The CUDA device the operands are on, or None: elsewhere, or a graph is being captured
    (no timing then)."""
    device = _real_device(operands)
    if device is None or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    return device


def _real_device(operands) -> torch.device | None:
    """The one device of the real tensors among `operands` (meta ones take theirs), or None."""
    real = {t.device for t in operands if t.device.type != "meta"}
    return next(iter(real)) if len(real) == 1 else None


def _decide(device: torch.device, operands) -> GemmDecision | None:
    try:
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on_device, torch.no_grad():
            bias, mat1, mat2 = (_scratch(t, device) for t in operands[:3])
            out = _scratch(operands[3], device, written=True)
            fused = lambda: torch.addmm(bias, mat1, mat2, out=out)  # noqa: E731
            split = lambda: mm_then_add(bias, mat1, mat2, out=out)  # noqa: E731
            addmm_us, split_us = _time_both(fused, split)
    except (RuntimeError, torch.cuda.OutOfMemoryError):  # no scratch memory, no timing: eager's kernel stays
        return None
    rows, inner = operands[1].shape
    return GemmDecision(str(device), str(bias.dtype).removeprefix("torch."), rows, inner, operands[3].shape[1],
                        addmm_us, split_us)


def _scratch(t: torch.Tensor, device: torch.device, written: bool = False) -> torch.Tensor:
    """A real operand that is only read, as it is (a weight); a stand-in of the same layout for
    a meta one, or for the one written (planned memory stays untouched)."""
    if t.device.type != "meta" and not written:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).normal_()


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
