"""A layer norm over the last dim of many short rows, several rows to a program: what a vision
transformer's norms are (Swin-T: 29 a call over 49 to 3,136 rows of 96 to 768 channels).

ATen's CUDA kernel gives each row a block of its own: on an H100 a Swin-T norm of 3,136 rows of 96
takes 4 µs, 0.6 TB/s, and its 29 norms were the largest cost after the GEMMs in a replayed call
(bench/results/profile_graphs_chains_on_h100.json). Here one Triton program normalises
2,048 elements' worth of rows. The arithmetic is ATen's (fp32, mean, biased variance, rsqrt(var
+ eps), then weight and bias) summed in another order: equal to eager within fp32 rounding, not
bit for bit. choices/norms.py times it against ATen's at load and keeps it where faster.
"""

from __future__ import annotations

import torch

from ferry.ops.library import triton_imports

__all__ = ["MAX_WIDTH", "available", "fits", "layer_norm"]

MAX_WIDTH = 8192  # the widest row one program holds in registers
_ELEMENTS = 2048  # elements per program: several short rows, or one long one
_MAX_ROWS = 64
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """Triton imports (the CUDA kernels are built from it)."""
    return triton_imports()


def fits(x, normalized_shape, weight=None, bias=None) -> bool:
    """The kernel computes `layer_norm(x, normalized_shape, weight, bias)`: x contiguous, of a
    half or single precision, normalised over its last dim only (at most MAX_WIDTH wide), the
    weight and bias (each optional) contiguous rows of that width in x's dtype, on x's device
    (a meta tensor stands for a value of the call at load)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES or x.dim() < 1 or not x.is_contiguous():
        return False
    if len(normalized_shape) != 1 or normalized_shape[0] != x.shape[-1] or not 0 < x.shape[-1] <= MAX_WIDTH:
        return False
    for t in (weight, bias):
        if t is not None and not (isinstance(t, torch.Tensor) and t.dtype == x.dtype and tuple(t.shape) == (x.shape[-1],)
                                  and t.is_contiguous() and (t.device == x.device or x.is_meta or t.is_meta)):
            return False
    return x.numel() > 0


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    """`aten.layer_norm`'s signature: the Triton kernel on CUDA where it `fits`, else ATen's."""
    if not (x.device.type == "cuda" and available() and fits(x, normalized_shape, weight, bias)):
        return torch.ops.aten.layer_norm.default(x, normalized_shape, weight, bias, eps, cudnn_enable)
    import triton

    from ferry.ops import layer_norm_triton  # (imports Triton)

    n = x.shape[-1]
    m = x.numel() // n
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(_MAX_ROWS, _ELEMENTS // block_n))
    y = torch.empty_like(x)
    with torch.cuda.device(x.device):
        layer_norm_triton.rows[(triton.cdiv(m, block_m),)](
            x, weight if weight is not None else x, bias if bias is not None else x, y, m, n, float(eps),
            HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=4 if block_m * block_n <= 2048 else 8)
    return y
