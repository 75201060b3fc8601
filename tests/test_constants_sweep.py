"""PyTorch's OpInfo samples held by the module as constants (buffers) instead of passed in: what
compile-time folding computes, what is stored in a constant's own layout, and what an in-place op
writes into a buffer, each checked against eager bit for bit on the emulated device.

Two modes. `plain`: the op reads the buffers as they are and its results are returned as copies.
`strided`: each buffer of two or more dims is held transposed, the op reads it through a
transposed view (the sample's values, not row-major), and each result is read back through its
own memory (`as_strided` with its own sizes and strides), so a constant or a write stored in
another layout than eager's shows. Outcomes: equal to eager on two calls (an in-place op's result
is the buffer it wrote, so the second call reads what the first left), or refused at compile time
with a CompileError. A helper's sweep of 241 ops in these
modes found a transposed constant stored row-major and in-place writes read back through
`as_strided` after torch's functionalization (tests/test_constant_layouts.py); this is the
regression subset CI runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils import _pytree as pytree

import ferry
import opinfo_sweep as sweep

OPS = (
    # in-place writers into a buffer (through a transposed view in `strided`)
    "index_add.inplace", "index_copy.inplace", "index_fill.inplace", "index_put.inplace", "masked_fill.inplace",
    "masked_scatter.inplace", "scatter.inplace", "scatter_add.inplace", "scatter_reduce.sum.inplace",
    # data movement, views and indexing
    "__getitem__", "as_strided", "cat", "diagonal", "expand", "flip", "gather", "index_select", "narrow",
    "nn.functional.pad.constant", "permute", "repeat", "roll", "select_scatter", "slice_scatter", "stack", "t",
    "take_along_dim", "tril", "unfold", "where",
    # exact arithmetic and casts (what the fold computes)
    "abs", "clamp", "eq", "half", "neg", "sign", "to",
)
MODES = ("plain", "strided")


class ConstOp(torch.nn.Module):
    """The sample's tensors as buffers; forward(x) runs the op on them and combines each result
    with x (so the result is an intermediate value, which folding may compute)."""

    def __init__(self, fn, leaves, spec, positions, tensors, strided: bool):
        super().__init__()
        self.fn, self.leaves, self.spec, self.positions, self.strided = fn, leaves, spec, positions, strided
        for k, t in enumerate(tensors):
            t = t.detach().clone()
            self.register_buffer(f"c{k}", t.transpose(-1, -2).contiguous() if strided and t.dim() >= 2 else t)

    def forward(self, x):
        leaves = list(self.leaves)
        for k, pos in enumerate(self.positions):
            b = getattr(self, f"c{k}")
            leaves[pos] = b.transpose(-1, -2) if self.strided and b.dim() >= 2 else b
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        outs = [o for o in pytree.tree_leaves(self.fn(inp, *args, **kwargs)) if isinstance(o, torch.Tensor)]
        res = []
        for o in outs:
            read = o.as_strided(o.size(), o.stride(), o.storage_offset()) if self.strided else o.clone()
            res.append(read | (x > 1e30) if o.dtype == torch.bool else read + (x * 0).to(o.dtype))
        return tuple(res)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN (eager and ferry run the same CPU kernels: no rounding apart)."""
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return torch.equal(a, b)


def model_of(op, strided: bool) -> ConstOp | None:
    """The module for the op's first float32 sample, or None where there is nothing to check
    (no tensor, eager raises, the result is random)."""
    with sweep.quiet():
        sample = next(iter(op.sample_inputs("cpu", torch.float32)), None)
    if sample is None:
        return None
    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    positions = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    tensors = [leaves[i] for i in positions]
    if not tensors or any(t.layout != torch.strided for t in tensors):
        return None
    for i in positions:
        leaves[i] = None
    model = ConstOp(op.op, leaves, spec, positions, tensors, strided).eval()
    try:
        a, b = copy.deepcopy(model)(torch.tensor(0.5)), copy.deepcopy(model)(torch.tensor(0.5))
    except Exception:  # noqa: BLE001 - eager itself refuses the sample in this mode
        return None
    return model if a and all(same_bits(p, q) for p, q in zip(a, b)) else None


@pytest.fixture(scope="module")
def by_id():
    with sweep.quiet():
        return sweep.ops_by_id(torch.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", OPS)
def test_op_on_constants_equals_eager_or_is_refused(name, mode, by_id, emu):
    if name not in by_id:
        pytest.skip(f"{name}: not in this torch's OpInfo database")
    model = model_of(by_id[name], strided=mode == "strided")
    if model is None:
        pytest.skip(f"{name}: no sample eager runs in this mode")
    twin = copy.deepcopy(model)
    try:
        ep = torch.export.export(model, (torch.tensor(0.5),), strict=False)
    except Exception:  # noqa: BLE001 - torch.export's limit, not ferry's
        pytest.skip(f"{name}: torch.export cannot export it")
    try:
        module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0")))
    except ferry.CompileError:
        return  # refused, with a message (test_constant_layouts.py checks the ones that matter)
    for v in (0.5, -1.25):
        got, want = module(torch.tensor(v)), twin(torch.tensor(v))
        assert len(got) == len(want) and all(same_bits(g.cpu(), w) for g, w in zip(got, want)), (name, mode, v)
