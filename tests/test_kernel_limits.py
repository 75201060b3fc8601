"""Shapes CUDA's kernels refuse, made ones they take, exactly (aot/kernel_limits.py): the rewrite
is checked on the CPU, whose kernels take any shape, against the graph as exported."""

from __future__ import annotations

import pytest
import torch

from ferry.aot.kernel_limits import INT_MM_MIN_ROWS, fit_kernel_limits
from ferry.device import CPU, Device

CUDA = Device("cuda", 0)


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


@pytest.mark.parametrize("rows", [1, 8, INT_MM_MIN_ROWS - 1])
def test_an_int8_product_of_few_rows_runs_on_padded_rows_for_cuda(rows):
    ep = torch.export.export(IntProduct(), (int8_rows(rows, 1),))
    x = int8_rows(rows, 2)
    want = ep.module()(x)
    done = fit_kernel_limits(ep.graph_module, CUDA)
    assert [r.kind for r in done] == ["rows padded"]
    products = [n for n in ep.graph.nodes if n.target is torch.ops.aten._int_mm.default]
    assert [p.args[0].meta["val"].shape[0] for p in products] == [INT_MM_MIN_ROWS]
    assert torch.equal(ep.module()(x), want)


def test_a_dynamic_row_count_is_padded_by_sixteen_and_sliced_back():
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(IntProduct(), (int8_rows(4, 1),), dynamic_shapes=({0: batch},))
    assert fit_kernel_limits(ep.graph_module, CUDA)
    x = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "x")
    rows = x.meta["val"].shape[0].node
    assert not rows.shape_env.replace(rows.expr).is_number  # still dynamic: the padding fixed no size
    module = ep.module()
    for rows in (1, 3, 16, 17, 40):
        x = int8_rows(rows, rows)
        got = module(x)
        assert got.shape == (rows, 24)
        assert torch.equal(got, torch._int_mm(x, IntProduct().weight.t()) * 2)


def test_enough_rows_and_other_devices_are_left_alone():
    many = torch.export.export(IntProduct(), (int8_rows(INT_MM_MIN_ROWS, 1),))
    assert fit_kernel_limits(many.graph_module, CUDA) == []
    few = torch.export.export(IntProduct(), (int8_rows(2, 1),))
    assert fit_kernel_limits(few.graph_module, CPU) == []
