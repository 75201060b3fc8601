"""The Triton kernels of split-KV attention (ops/split_kv.py, which imports this module only where
Triton imports and a kernel is launched). Offsets are 32-bit: split_kv.fits refuses an operand
whose farthest element lies 2**31 or more past its first, and split_kv_attention then runs the
torch ops."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["combine", "stretches"]


@triton.jit
def stretches(Q, K, V, M, P, Out, Counts, sqb, sqh, sqt, skb, skh, skn, svb, svh, svn, smb, smh, smt, smn,
              sob, soh, sot, scale, S, COUNT, HKV, T: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr,
              D: tl.constexpr, DP: tl.constexpr, LENGTH: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr,
              CP: tl.constexpr, COMBINE: tl.constexpr):
    """Program (batch row x KV head, stretch): the unnormalised result, maximum and sum of each
    query row of the KV head's group over one stretch of the cache, stored to P. MASK: 0 none, 1
    additive, 2 boolean. COMBINE: the last program of a KV head to finish (an atomic count in
    Counts, left zero again) combines its rows into Out, so no second launch is needed."""
    bh, sp = tl.program_id(0), tl.program_id(1)
    b, hk = bh // HKV, bh % HKV
    r = tl.arange(0, ROWS)
    r_ok = r < G * T
    h, t = hk * G + r // T, r % T
    d = tl.arange(0, DP)
    d_ok = d < D
    q = tl.load(Q + b * sqb + h[:, None] * sqh + t[:, None] * sqt + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    top = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DP], tl.float32)
    for i in range(0, LENGTH, BLOCK):
        n = sp * LENGTH + i + tl.arange(0, BLOCK)
        n_ok = n < S
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + b * skb + hk * skh + n[:, None] * skn + d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        if MASK != 0:
            m = tl.load(M + b * smb + h[:, None] * smh + t[:, None] * smt + n[None, :] * smn,
                        mask=r_ok[:, None] & n_ok[None, :], other=0)
            if MASK == 1:
                s = s + m.to(tl.float32)
            else:
                s = tl.where(m != 0, s, float("-inf"))
        s = tl.where(n_ok[None, :], s, float("-inf"))
        new = tl.maximum(top, tl.max(s, 1))
        shift = tl.where(new == float("-inf"), 0.0, new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(top - shift)
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(V + b * svb + hk * svh + n[:, None] * svn + d[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        top = new
    row = P + ((bh * COUNT + sp) * (G * T) + r) * (D + 2)
    tl.store(row[:, None] + d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])
    tl.store(row + D, top, mask=r_ok)
    tl.store(row + D + 1, total, mask=r_ok)
    if COMBINE:
        tl.debug_barrier()  # every thread's partials stored before the count says so
        if tl.atomic_add(Counts + bh, 1, sem="acq_rel") == COUNT - 1:
            for j in tl.static_range(G * T):
                _combine_row(P, Out, bh, j, sob, soh, sot, COUNT, HKV, T, G, D, DP, CP)
            tl.atomic_xchg(Counts + bh, 0)  # ready for the next call (a graph replays the same counts)


@triton.jit
def combine(P, Out, sob, soh, sot, COUNT, HKV, T: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
            DP: tl.constexpr, CP: tl.constexpr):
    """Program (batch row x KV head, query row of its group): the row from its stretches."""
    _combine_row(P, Out, tl.program_id(0), tl.program_id(1), sob, soh, sot, COUNT, HKV, T, G, D, DP, CP)


@triton.jit
def _combine_row(P, Out, bh, r, sob, soh, sot, COUNT, HKV, T: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, CP: tl.constexpr):
    """Each stretch weighed by exp(its maximum - the row's); a row no key may attend is zero.
    Partials are read past the SM's L1 (another SM wrote them)."""
    b, hk = bh // HKV, bh % HKV
    h, t = hk * G + r // T, r % T
    c = tl.arange(0, CP)
    c_ok = c < COUNT
    d = tl.arange(0, DP)
    row = P + ((bh * COUNT + c) * (G * T) + r) * (D + 2)
    top = tl.load(row + D, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
    total = tl.load(row + D + 1, mask=c_ok, other=0.0, cache_modifier=".cg")
    best = tl.max(top, 0)
    w = tl.exp(top - tl.where(best == float("-inf"), 0.0, best))
    norm = tl.sum(w * total, 0)
    acc = tl.load(row[:, None] + d[None, :], mask=c_ok[:, None] & (d[None, :] < D), other=0.0, cache_modifier=".cg")
    summed = tl.sum(acc * w[:, None], 0)
    result = tl.where(norm > 0, summed / tl.maximum(norm, 1e-38), 0.0)
    tl.store(Out + b * sob + h * soh + t * sot + d, result.to(Out.dtype.element_ty), mask=d < D)
