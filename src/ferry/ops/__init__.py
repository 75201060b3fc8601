"""Operator facts and kernels every layer reads: the bottom of the house above device/errors.

- `copies`: the et_copy library (explicit host<->device copies as graph nodes);
- `aliasing`: which results of an operator may be (views of) which of its inputs, from the
  schemas and from what the trace saw;
- `fused`: ferry's fused inference kernels (a convolution with its bias, residual and ReLU);
- `layer_norm`: a layer norm of many short rows, a residual add with the norm of its sum, and
  an RMS norm (Triton kernels on CUDA, chosen at load where faster: choices/norms.py);
- `split_kv`: a decode step's attention with the KV cache split across the GPU (two Triton
  kernels on CUDA), chosen at load where it is faster (choices/attention.py);
- `writes`: out kernels for the functional forms of writes into part of a tensor (`copy`,
  the `*_scatter` ops), which write planned memory instead of cloning a whole storage.
"""

from ferry.ops import aliasing, fused, layer_norm, split_kv, writes  # noqa: F401  (all but aliasing register ferry:: ops)
from ferry.ops.copies import (
    COPY_DIRECTION,
    COPY_KERNELS,
    COPY_OPS,
    FUNCTIONAL_COPIES,
    FUNCTIONAL_COPY_FOR,
    NAMESPACE,
    OUT_COPIES,
    OUT_COPY_KERNELS,
    aten_mode,
    d2d_copy,
    d2h_copy,
    h2d_copy,
    is_copy_node,
)

__all__ = [
    "COPY_DIRECTION", "COPY_KERNELS", "COPY_OPS", "FUNCTIONAL_COPIES", "FUNCTIONAL_COPY_FOR", "NAMESPACE", "OUT_COPIES",
    "OUT_COPY_KERNELS", "aliasing", "aten_mode", "fused", "layer_norm", "d2d_copy", "d2h_copy", "h2d_copy",
    "is_copy_node", "split_kv", "writes",
]
