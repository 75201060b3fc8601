"""Shapes CUDA's kernels refuse, made ones they take, exactly (aot/kernel_limits.py): the rewrite
is checked on the CPU, whose kernels take any shape, against the graph as exported."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ferry.aot.kernel_limits import INT_MM_MIN_ROWS, fit_kernel_limits
from ferry.device import CPU, Device
from ferry.errors import CompileError

CUDA = Device("cuda", 0)


class CudaIntMmLimits(TorchDispatchMode):
    """Fails any `_int_mm` run inside it that CUDA's kernel would refuse: the CPU's takes any
    shape, so a rewrite that padded too little would pass unseen. `calls`: how many ran."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._int_mm:
            a, b = args[:2]
            assert a.shape[0] >= INT_MM_MIN_ROWS and a.dtype == b.dtype == torch.int8, (a.shape, a.dtype, b.dtype)
            self.calls += 1
        return func(*args, **(kwargs or {}))


class IntProduct(torch.nn.Module):
    """An int8 product as torchao's dynamic-activation linear makes it: rows of int8 activations
    by an int8 weight, to int32."""

    def __init__(self):
        super().__init__()
        self.register_buffer("weight", torch.randint(-128, 128, (24, 32), dtype=torch.int8,
                                                     generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return torch._int_mm(x, self.weight.t()) * 2


def int8_rows(rows: int, seed: int) -> torch.Tensor:
    return torch.randint(-128, 128, (rows, 32), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [0, 1, 8, INT_MM_MIN_ROWS - 1])
def test_an_int8_product_of_few_rows_runs_on_padded_rows_for_cuda(rows):
    ep = torch.export.export(IntProduct(), (int8_rows(rows, 1),))
    x = int8_rows(rows, 2)
    want = ep.module()(x)
    done = fit_kernel_limits(ep.graph_module, CUDA)
    assert [r.kind for r in done] == ["rows padded"]
    assert fit_kernel_limits(ep.graph_module, CUDA) == []  # fitted once: nothing padded twice
    ops = {n.target for n in ep.graph.nodes}
    assert torch.ops.aten.constant_pad_nd.default in ops and torch.ops.aten.full.default not in ops  # one kernel
    with CudaIntMmLimits() as limits:
        got = ep.module()(x)
    assert limits.calls == 1 and torch.equal(got, want)


def test_a_dynamic_row_count_is_padded_and_sliced_back_at_every_count():
    batch = torch.export.Dim("batch", min=0, max=64)
    ep = torch.export.export(IntProduct(), (int8_rows(4, 1),), dynamic_shapes=({0: batch},))
    assert fit_kernel_limits(ep.graph_module, CUDA)
    assert fit_kernel_limits(ep.graph_module, CUDA) == []
    x = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "x")
    rows = x.meta["val"].shape[0].node
    assert not rows.shape_env.replace(rows.expr).is_number  # still dynamic: the padding fixed no size
    module = ep.module()
    for rows in (40, 0, 17, 1, 16, 3, 40):  # large, small, large: no size kept from a call before
        x = int8_rows(rows, rows)
        with CudaIntMmLimits() as limits:
            got = module(x)
        assert limits.calls == 1 and got.shape == (rows, 24)
        assert torch.equal(got, torch._int_mm(x, IntProduct().weight.t()) * 2)


def test_a_dynamic_count_of_at_least_seventeen_rows_is_left_alone():
    batch = torch.export.Dim("batch", min=INT_MM_MIN_ROWS, max=64)
    ep = torch.export.export(IntProduct(), (int8_rows(20, 1),), dynamic_shapes=({0: batch},))
    assert fit_kernel_limits(ep.graph_module, CUDA) == []


def test_enough_rows_and_other_devices_are_left_alone():
    many = torch.export.export(IntProduct(), (int8_rows(INT_MM_MIN_ROWS, 1),))
    assert fit_kernel_limits(many.graph_module, CUDA) == []
    few = torch.export.export(IntProduct(), (int8_rows(2, 1),))
    assert fit_kernel_limits(few.graph_module, CPU) == []


class OddProduct(torch.nn.Module):
    def __init__(self, out: int, dtype=torch.int8):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out, 32, dtype=torch.int8))
        self.dtype = dtype

    def forward(self, x):
        return torch._int_mm(x.to(self.dtype), self.weight.t())


@pytest.mark.parametrize("out, dtype, why", [(50, torch.int8, "multiples of 8"), (24, torch.uint8, "int8 only")])
def test_what_cuda_cannot_run_is_refused_at_compile_time(out, dtype, why):
    """CUDA's kernel also takes only int8 operands with sizes multiples of 8 (a vocabulary head of
    50,257 columns is the usual case): a CompileError that says what to do, not a failed call."""
    ep = torch.export.export(OddProduct(out, dtype), (int8_rows(1, 1),))
    with pytest.raises(CompileError, match=f"{why}.*filter_fn"):
        fit_kernel_limits(ep.graph_module, CUDA)
