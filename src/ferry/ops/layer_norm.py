"""A layer norm over the last dim of many short rows, several rows to a program: what a vision
transformer's norms are (Swin-T: 29 a call over 49 to 3,136 rows of 96 to 768 channels).

ATen's CUDA kernel gives each row a block of its own: on an H100 a Swin-T norm of 3,136 rows of 96
takes 4 µs, 0.6 TB/s, and its 29 norms were the largest cost after the GEMMs in a replayed call
(bench/results/profile_graphs_chains_on_h100.json). Here one Triton program normalises
2,048 elements' worth of rows. The arithmetic is ATen's (fp32, mean, biased variance, rsqrt(var
+ eps), then weight and bias) summed in another order: equal to eager within fp32 rounding, not
bit for bit. choices/norms.py times it against ATen's at load and keeps it where faster.

`ferry::add_layer_norm(input, residual, normalized_shape, weight, bias, eps) -> (sum, normed)`:
a residual add and the layer norm of its sum, which a transformer block makes one after the
other (`x = x + attn(...)`, then `norm(x)`). The op itself is the two ATen calls, the same bits
as eager; `add_layer_norm` is the kernel that reads both rows once and writes the sum and the
norm (one kernel of two, and the sum not read back), which choices/norms.py may pick at load.

`ferry::rms_norm(input, weight, eps) -> Tensor`: the RMS norm transformers writes out op by op
(Llama, Qwen, Mistral, Phi-3, T5: in fp32, x times rsqrt(mean(x²) + eps), rounded to x's dtype,
then times the weight), six kernels in eager. The op itself is those ATen calls, the same bits;
`rms_norm` is the kernel that computes it in one pass (the mean of squares summed in another
order: equal within fp32 rounding), which choices/norms.py may pick at load.
"""

from __future__ import annotations

import torch

from ferry.ops.library import new_fragment, triton_imports

__all__ = ["ADD_LAYER_NORM", "MAX_WIDTH", "RMS_NORM", "add_layer_norm", "add_then_norm", "available", "fits",
           "fits_residual", "layer_norm", "rms_norm", "rms_then_scale"]

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


def fits_residual(x, residual) -> bool:
    """`add_layer_norm`'s kernel takes this residual: x's shape, dtype, device and layout."""
    return (isinstance(residual, torch.Tensor) and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.is_contiguous() and (residual.device == x.device or x.is_meta or residual.is_meta))


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    """`aten.layer_norm`'s signature: the Triton kernel on CUDA where it `fits`, else ATen's."""
    if not (x.device.type == "cuda" and available() and fits(x, normalized_shape, weight, bias)):
        return torch.ops.aten.layer_norm.default(x, normalized_shape, weight, bias, eps, cudnn_enable)
    y = torch.empty_like(x)
    _launch(x, None, weight, bias, None, y, eps)
    return y


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """`ferry::add_layer_norm`'s signature: one Triton kernel on CUDA where it fits, else the op's
    own two ATen calls."""
    fit = x.device.type == "cuda" and available() and fits(x, normalized_shape, weight, bias)
    if not (fit and fits_residual(x, residual)):
        return add_then_norm(x, residual, normalized_shape, weight, bias, eps)
    total, y = torch.empty_like(x), torch.empty_like(x)
    _launch(x, residual, weight, bias, total, y, eps)
    return total, y


def rms_norm(x, weight=None, eps=1e-6):
    """`ferry::rms_norm`'s signature: the Triton kernel on CUDA where it fits, else the op's own
    ATen calls."""
    if not (x.device.type == "cuda" and available() and x.dim() > 0 and fits(x, [x.shape[-1]], weight)):
        return rms_then_scale(x, weight, eps)
    y = torch.empty_like(x)
    _launch(x, None, weight, None, None, y, eps, rms=True)
    return y


def rms_then_scale(x, weight=None, eps=1e-6):
    """What eager computes, through torch's bindings (the load runs this where the kernel is not
    chosen: the dispatcher's call back into the op's Python kernel costs the host more)."""
    upcast = x if x.dtype == torch.float32 else x.to(torch.float32)
    scale = torch.mean(torch.pow(upcast, 2), -1, keepdim=True).add_(eps).rsqrt_()  # (one value a row: in place)
    y = torch.mul(upcast, scale)
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if weight is None else torch.mul(weight, y)


def _launch(x, residual, weight, bias, total, y, eps, rms: bool = False) -> None:
    import triton

    from ferry.ops import layer_norm_triton  # (imports Triton)

    n = x.shape[-1]
    m = x.numel() // n
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(_MAX_ROWS, _ELEMENTS // block_n))
    with torch.cuda.device(x.device):
        layer_norm_triton.rows[(triton.cdiv(m, block_m),)](
            x, residual if residual is not None else x, weight if weight is not None else x,
            bias if bias is not None else x, total if total is not None else y, y, m, n, float(eps),
            HAS_R=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms, BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=4 if block_m * block_n <= 2048 else 8)


def add_then_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5, norm=torch.layer_norm):
    """What eager computes: the sum, then `norm` of it (ATen's layer norm: the op's own kernel).
    Through torch's bindings: the dispatcher's call back into the op's Python kernel costs the
    host more than the two launches (12 µs a call against 3 on a CPU), so the load runs this."""
    total = torch.add(x, residual)
    return total, norm(total, normalized_shape, weight, bias, eps)


def _register() -> torch.library.Library | None:
    lib = new_fragment("add_layer_norm")
    if lib is None:
        return None
    lib.define("add_layer_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, "
               "Tensor? bias=None, float eps=1e-05) -> (Tensor, Tensor)")
    lib.impl("add_layer_norm", add_then_norm, "CompositeExplicitAutograd")
    torch.library.register_fake("ferry::add_layer_norm", add_then_norm, lib=lib)
    lib.define("rms_norm(Tensor input, Tensor? weight=None, float eps=1e-06) -> Tensor")
    lib.impl("rms_norm", rms_then_scale, "CompositeExplicitAutograd")
    torch.library.register_fake("ferry::rms_norm", rms_then_scale, lib=lib)
    return lib


_lib = globals().get("_lib") or _register()  # kept: the registrations live as long as it does
ADD_LAYER_NORM = torch.ops.ferry.add_layer_norm.default
RMS_NORM = torch.ops.ferry.rms_norm.default
