"""Which kernels run attention on CUDA in a plan captured as CUDA graphs: eager's fused ones, or
GEMMs and a softmax.

In fp32 (flash attention takes half precision only) `scaled_dot_product_attention` runs the
memory-efficient kernel, which is slow at short sequences on an H200: ViT-B/16's 12 heads of 197
tokens take 28.9 µs there, q @ kᵀ, the softmax and @ v 18.7. With a causal mask, at 64 tokens or
at ViT's batch 4 the fused kernel is the faster (`bench/gemm_kernels.py`). The fused op of
`nn.MultiheadAttention` (`_native_multi_head_attention`) also runs its two projections as
`addmm`, whose kernels cuBLAS picks slowly at some shapes (runtime/choices/gemm.py). No rule of
shapes holds across GPUs, so each distinct attention is timed both ways when a method loads, on
the GPU it loads on, and the composed form is kept where it saves at least 10% and 2 µs
(runtime/choices/timing.py), by replaying graphs of each form on the plan's capture stream: a
stream leaves a gap after each launch that a replay does not (nn.MultiheadAttention at ViT-B/16's
batch 1, composed against fused: 84.7 against 90.7 µs on a stream, 74.1 against 89.1 replayed,
`bench/gemm_kernels.py`).

Only in plans captured as CUDA graphs: the composed forms launch three kernels for one
(attention) and up to eight for four (multi-head attention), and without graphs a small call
waits on the host's launches, not on the GPU. Only fp32 and fp64 (in half precision the scores
would be rounded before the softmax; with TF32 GEMMs allowed, fp64 only: eager's fp32 kernel is
more precise than one TF32 pass), without a mask, dropout or a causal mask; multi-head
attention only as self-attention, without its weights. Under deterministic algorithms eager's
kernels run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ferry.runtime.choices import gemm as gemm_choice
from ferry.runtime.choices import timing

__all__ = ["AttentionDecision", "OPS", "chosen", "composed_attention", "decisions"]

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
MHA = aten._native_multi_head_attention.default
OPS = frozenset({SDPA, MHA})
_DTYPES = (torch.float32, torch.float64)
_MAX_SCORES = 1 << 24  # elements of q @ kᵀ (64 MiB in fp32): the composed form makes them a tensor


@dataclass(frozen=True)
class AttentionDecision:
    """One attention (`op`: "attention" or "multi-head attention") of `batch` x `heads` x
    `queries` x `keys` with `head_dim`: eager_us for eager's fused kernel, composed_us for GEMMs
    and a softmax."""

    device: str
    dtype: str
    op: str
    batch: int
    heads: int
    queries: int
    keys: int
    head_dim: int
    eager_us: float
    composed_us: float

    @property
    def use_composed(self) -> bool:
        return timing.faster(self.eager_us, self.composed_us)


_choices = timing.Choices()


def decisions() -> list[AttentionDecision]:
    """What this process measured: one entry per distinct attention a captured plan runs."""
    return _choices.values()


def composed_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`scaled_dot_product_attention` without a mask, dropout or grouped heads: one batched GEMM
    for the scores, scaled after it (eager's math scales q and k before: equal to rounding), a
    softmax, one batched GEMM for the result. For one sequence (batch 1) the scale is the GEMM's
    own (its alpha) and the result is written as eager's fused kernel lays it out, (batch,
    queries, heads, dim) in memory, so the transpose and reshape models make of it are views, not
    a copy (ViT-B/16's, timed at load: 18.1 µs against 19.9 before, bench/results/models_M.json)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if q.shape[0] != 1:
        scores = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)
        return torch.matmul(torch.softmax(scores, -1), v)
    (_, h, t, d), s = q.shape, k.shape[2]
    scores = torch.baddbmm(q.new_empty(h, t, s), q[0], k[0].transpose(1, 2), beta=0, alpha=scale)
    out = q.new_empty(1, t, h, d).transpose(1, 2)
    torch.bmm(torch.softmax(scores, -1), v[0], out=out[0])
    return out


def chosen(op, args: list, kwargs: dict, self_attention: bool, measure: bool = True,
           device: torch.device | None = None) -> Callable | None:
    """The composed form of `op` where this GPU runs it faster than eager's fused kernel for
    arguments like these (real tensors, or meta tensors of the same shape, strides and dtype);
    otherwise None. `self_attention`: query, key and value are one value (multi-head attention).
    `device`: the GPU it runs on, where every tensor argument may be a meta one."""
    if torch.are_deterministic_algorithms_enabled():
        return None
    if op is SDPA:
        return _attention(args, kwargs, measure, device)
    if op is MHA and self_attention:
        return _multi_head(args, kwargs, measure, device)
    return None


def _attention(args, kwargs, measure, device: torch.device | None = None) -> Callable | None:
    params = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:])) | kwargs
    q, k, v = (args + [None] * 3)[:3]
    tensors = (q, k, v)
    if params.get("attn_mask") is not None or params.get("dropout_p", 0.0) or params.get("is_causal", False):
        return None
    if params.get("enable_gqa", False) or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return None
    if q.dtype not in _DTYPES or len({t.dtype for t in tensors}) != 1 or k.shape != v.shape:
        return None
    if q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return None  # one-pass TF32 GEMMs: less precise than eager's fp32 kernel (3 x TF32 on sm80+)
    (b, h, t, d), s = q.shape, k.shape[2]
    if k.shape[:2] != (b, h) or k.shape[3] != d or b * h * t * s > _MAX_SCORES:
        return None
    device = timing.gpu_of(tensors, device)
    if device is None:
        return None
    scale = params.get("scale")
    key = ("attention", str(device), q.dtype, *gemm_choice.blas_settings(), scale,
           *((tuple(x.shape), x.stride()) for x in tensors))
    decision = _choices.get(key, device, measure, lambda: _decide_attention(device, tensors, scale))
    return composed_attention if decision is not None and decision.use_composed else None


def _decide_attention(device, tensors, scale) -> AttentionDecision | None:
    with timing.on(device), torch.no_grad():
        try:
            q, k, v = (timing.scratch(t, device) for t in tensors)
            times = timing.time_both(lambda: SDPA(q, k, v, scale=scale), lambda: composed_attention(q, k, v, scale=scale))
        except torch.cuda.OutOfMemoryError:  # eager's kernel stays; any other error is the caller's to see
            return None
    (b, h, t, d), s = q.shape, k.shape[2]
    return AttentionDecision(str(device), str(q.dtype).removeprefix("torch."), "attention", b, h, t, s, d, *times)


_MHA_PARAMS = ("query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias",
               "mask", "need_weights", "average_attn_weights", "mask_type")


def _multi_head(args, kwargs, measure, device=None) -> Callable | None:
    p = dict(zip(_MHA_PARAMS, args)) | kwargs
    x, e, heads = p.get("query"), p.get("embed_dim"), p.get("num_head")
    weights = [p.get(n) for n in ("qkv_weight", "qkv_bias", "proj_weight", "proj_bias")]
    if p.get("mask") is not None or p.get("need_weights", True) or not isinstance(x, torch.Tensor) or x.dim() != 3:
        return None
    if not all(isinstance(w, torch.Tensor) for w in weights) or not isinstance(heads, int) or heads < 1:
        return None
    b, t, width = x.shape
    expected = [(3 * e, e), (3 * e,), (e, e), (e,)]
    if width != e or e % heads or [tuple(w.shape) for w in weights] != expected:
        return None
    if x.dtype not in _DTYPES or any(w.dtype != x.dtype for w in weights) or b * heads * t * t > _MAX_SCORES:
        return None
    device = timing.gpu_of((x, *weights), device)
    if device is None:
        return None
    composed = _composed_multi_head(x, weights, heads, measure, device)
    key = ("multi-head attention", str(device), x.dtype, *gemm_choice.blas_settings(), tuple(x.shape), x.stride(),
           heads, *(w.stride() for w in weights), composed.parts)
    decision = _choices.get(key, device, measure, lambda: _decide_multi_head(device, x, weights, heads, composed))
    return composed if decision is not None and decision.use_composed else None


def _composed_multi_head(x, weights, heads, measure, device):
    """Self-attention as its projections, each GEMM as gemm_choice measures it faster, and the
    attention as this module measures it faster; `.parts` says which were chosen."""
    (b, t, e), (w_in, b_in, w_out, b_out) = x.shape, weights
    rows = torch.empty((b * t, e), dtype=x.dtype, device="meta")
    qkv = torch.empty((b * t, 3 * e), dtype=x.dtype, device="meta")
    split_in = gemm_choice.biased_gemm(b_in, rows, w_in.t(), qkv, measure=measure, device=device) is not None
    split_out = gemm_choice.biased_gemm(b_out, rows, w_out.t(), rows, measure=measure, device=device) is not None
    q, k, v = _heads(qkv, b, t, heads)
    attend = _attention([q, k, v], {}, measure, device) or SDPA
    project_in, project_out = _gemm(split_in), _gemm(split_out)

    def multi_head(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, *_, **__):
        n, length, width = query.shape
        qkv = project_in(qkv_bias, query.reshape(n * length, width), qkv_weight.t())
        y = attend(*_heads(qkv, n, length, num_head)).transpose(1, 2).reshape(n * length, width)
        return project_out(proj_bias, y, proj_weight.t()).view(n, length, width), None  # no weights, as eager's

    multi_head.parts = (split_in, attend is not SDPA, split_out)  # type: ignore[attr-defined]
    return multi_head


def _heads(qkv, batch, length, heads):
    """q, k and v of (batch, heads, length, head_dim), as views of the in-projection's rows."""
    width = qkv.shape[1] // 3
    return qkv.view(batch, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4).unbind(0)


def _gemm(split: bool):
    if split:
        return lambda bias, mat1, mat2: torch.mm(mat1, mat2).add_(bias)
    return torch.addmm


def _decide_multi_head(device, x, weights, heads, composed) -> AttentionDecision | None:
    e = x.shape[2]
    with timing.on(device), torch.no_grad():
        try:
            q = timing.scratch(x, device)
            w = [timing.scratch(t, device) for t in weights]
            times = timing.time_both(lambda: MHA(q, q, q, e, heads, *w, need_weights=False),
                                     lambda: composed(q, q, q, e, heads, *w, need_weights=False))
        except torch.cuda.OutOfMemoryError:
            return None
    b, t = x.shape[:2]
    return AttentionDecision(str(device), str(x.dtype).removeprefix("torch."), "multi-head attention", b, heads, t, t,
                             e // heads, *times)

