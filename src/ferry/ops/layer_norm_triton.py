"""The Triton kernel of ops/layer_norm.py (imported only where Triton imports and a kernel is
launched)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rows"]


@triton.jit
def rows(X, R, W, B, S, Y, M, N, eps, HAS_R: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
         RMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program: BLOCK_M rows of X [M, N] (contiguous) normalised over N in fp32, as ATen's kernel
    computes them (mean, biased variance, rsqrt(var + eps), weight, bias), stored in Y's dtype.
    HAS_R: the rows normalised are X + R, rounded to X's dtype as eager's add rounds them, and
    stored in S too (a residual add and the norm that reads it, in one pass). RMS: an RMS norm
    as transformers writes it (no mean taken out, rsqrt(mean(x²) + eps), the result rounded to
    Y's dtype before the weight multiplies it)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (rows past 2**31 of width 1)
    c = tl.arange(0, BLOCK_N)
    c_ok = c < N
    ok = (r < M)[:, None] & c_ok[None, :]
    at = r[:, None] * N + c[None, :]
    x = tl.load(X + at, mask=ok, other=0.0)
    if HAS_R:
        x = (x.to(tl.float32) + tl.load(R + at, mask=ok, other=0.0).to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + at, x, mask=ok)
    x = x.to(tl.float32)
    if RMS:
        centred = x  # (masked lanes loaded as 0)
    else:
        centred = tl.where(ok, x - (tl.sum(x, 1) / N)[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, 1) / N + eps)
    y = centred * rstd[:, None]
    if RMS:
        y = y.to(Y.dtype.element_ty).to(tl.float32)
    if HAS_W:
        y = y * tl.load(W + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + at, y.to(Y.dtype.element_ty), mask=ok)
