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

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["GemmDecision", "biased_gemm", "decisions", "mm_then_add"]

_GEMM_DTYPES = (torch.float32, torch.float64)
_KEEP_IF_ABOVE = 0.9  # the split's time over addmm's: above this, eager's addmm stays
_MIN_SAVING_US = 2.0  # about what the second launch costs the host
_MAX_MACS = 1 << 33  # not timed above (4096^3 took 1 s of load); BERT batch 8, ViT batch 4 (2.4e9) are under it
_QUEUE_CYCLES = 500_000  # GPU cycles (about 0.25 ms on an H200): longer than queueing one timed run takes


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
_lock = threading.Lock()  # one measurement at a time: concurrent loads would time each other's GEMMs


def decisions() -> list[GemmDecision]:
    """What this process measured: one entry per distinct biased GEMM a loaded program runs."""
    with _lock:
        return [d for d in _decided.values() if d is not None]


def mm_then_add(bias, mat1, mat2, *, beta=1, alpha=1, out):
    """`addmm.out` as cuBLAS's plain GEMM into `out`, then the bias added in place."""
    torch.mm(mat1, mat2, out=out)
    return out.add_(bias)


def biased_gemm(bias, mat1, mat2, out, beta=1, alpha=1, measure: bool = True) -> Callable | None:
    """`mm_then_add` where this GPU runs it faster than `addmm.out` for operands like these
    (real tensors or meta tensors of the same shape, strides and dtype); otherwise None.
    `measure=False` (a plan bound during a call): only what was measured already is used."""
    operands = (bias, mat1, mat2, out)
    if beta != 1 or alpha != 1 or not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    if bias.dim() != 1 or any(t.dim() != 2 for t in operands[1:]) or len({t.dtype for t in operands}) != 1:
        return None
    rows, inner = mat1.shape
    if bias.dtype not in _GEMM_DTYPES or rows * inner * out.shape[1] > _MAX_MACS:
        return None
    device = _gpu_of(operands)
    if device is None or torch.are_deterministic_algorithms_enabled():
        return None
    key = (str(device), bias.dtype, torch.backends.cuda.matmul.allow_tf32, _blas_library(),
           *((tuple(t.shape), t.stride()) for t in operands))
    with _lock:
        if key not in _decided and measure and not _capturing(device):  # no host waits in a capture
            _decided[key] = _decide(device, operands)
        decision = _decided.get(key)
    return mm_then_add if decision is not None and decision.use_gemm else None


def _blas_library() -> str:
    return str(torch.backends.cuda.preferred_blas_library())


def _gpu_of(operands) -> torch.device | None:
    """The CUDA device the operands are on, or None."""
    device = _real_device(operands)
    return device if device is not None and device.type == "cuda" else None


def _real_device(operands) -> torch.device | None:
    """The one device of the real tensors among `operands` (meta ones take theirs), or None."""
    real = {t.device for t in operands if t.device.type != "meta"}
    return next(iter(real)) if len(real) == 1 else None


def _capturing(device: torch.device) -> bool:
    """A graph is being captured on `device`'s current stream: nothing is timed, or remembered."""
    with _on(device):
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _decide(device: torch.device, operands) -> GemmDecision | None:
    """Both ways timed on scratch tensors (the planned output is never written): the decision,
    or None where there is no memory for them."""
    with _on(device), torch.no_grad():
        try:
            bias, mat1, mat2 = (_scratch(t, device) for t in operands[:3])
            out = _scratch(operands[3], device, written=True)
            times = _time_both(lambda: torch.addmm(bias, mat1, mat2, out=out),
                               lambda: mm_then_add(bias, mat1, mat2, out=out))
        except torch.cuda.OutOfMemoryError:  # eager's kernel stays; any other error is the caller's to see
            return None
    (rows, inner), cols = operands[1].shape, operands[3].shape[1]
    return GemmDecision(str(device), str(bias.dtype).removeprefix("torch."), rows, inner, cols, *times)


def _on(device: torch.device):
    return torch.cuda.device(device)


def _scratch(t: torch.Tensor, device: torch.device, written: bool = False) -> torch.Tensor:
    """A real operand that is only read, as it is (a weight); a stand-in of the same layout for a
    meta one or the one written. Filled with a constant: the caller's random streams stay as they were."""
    if t.device.type != "meta" and not written:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).fill_(0.5)


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
