"""Which kernels run a biased fp32 GEMM on CUDA: eager's `addmm`, or `mm` and then the bias added.

ATen runs `addmm` with a vector bias through cublasLt and its bias epilogue. For fp32 at a few
hundred rows that heuristic takes split-K kernels which run up to 2.4x longer than cuBLAS's plain
GEMM followed by the bias (an H200, TF32 off, µs per GEMM: BERT's 128 rows by 3072 into 768, 54
against 26; ViT-B/16's 197 rows, 91 against 38). At other shapes the fused epilogue is the faster
(ViT-B/16 batch 4's 788 rows by 768 into 2304: 70 against 83), and in bf16 it always was. No rule
of shapes holds across GPUs, so this is measured on the GPU the program loads on: once per
process for each distinct shape, layout and dtype, both ways, timed with CUDA events while the
GPU runs them back to back, on scratch tensors where the real operand is planned memory that
would be written (that never is). The split is kept only where it saves at least 10% and 2 µs of
GPU time (it costs one more launch). Only fp32 and fp64 are split (in half precision the product
would be rounded before the bias is added, where the epilogue adds it in fp32), and nothing is
timed under a graph capture (eager's kernel then, unless decided before).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["GemmDecision", "biased_gemm", "decisions", "mm_then_add"]

_GEMM_DTYPES = (torch.float32, torch.float64)
_KEEP_IF_ABOVE = 0.9  # the split's time over addmm's: above this, eager's addmm stays
_MIN_SAVING_US = 2.0  # about what the second launch costs the host
_QUEUE_CYCLES = 500_000  # GPU clock cycles (0.3-0.5 ms): longer than queueing one timed run takes


@dataclass(frozen=True)
class GemmDecision:
    """A GEMM of rows x inner by inner x cols with a bias: eager_us for cublasLt's `addmm`,
    gemm_us for cuBLAS's `mm` and then the bias."""

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
    if bias.dtype not in _GEMM_DTYPES:
        return None
    device = _gpu_of(operands)
    if device is None:
        return None
    key = (str(device), bias.dtype, *((tuple(t.shape), t.stride()) for t in operands))
    rows, inner = mat1.shape
    decision = _decision(key, device, lambda: _addmm_pair(device, operands),
                         lambda times: GemmDecision(str(device), _name(bias.dtype), rows, inner, out.shape[1], *times))
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
