"""`out_dtype`, the higher-order op torchao's int8 products export through on CUDA, runs as the
ATen ops it stands for (aot/higher_order.py): results equal eager's, on the CPU and emu:0."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.out_dtype import out_dtype

import ferry
from test_quantized import delegate_kernels

aten = torch.ops.aten


class IntProduct(torch.nn.Module):
    """torchao's `safe_int_mm` as it traces: int8 rows by an int8 weight to int32 (CUDA), or the
    same on float copies (its CPU path), then scaled."""

    def __init__(self, floats: bool):
        super().__init__()
        self.floats = floats
        self.register_buffer("weight", torch.randint(-128, 128, (24, 32), dtype=torch.int8,
                                                     generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        a, b = x, self.weight.t()
        if self.floats:
            a, b = a.float(), b.float()
        return out_dtype(aten.mm.default, torch.int32, a, b).float() * 0.5


def int8_rows(rows: int, seed: int) -> torch.Tensor:
    return torch.randint(-128, 128, (rows, 32), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("floats", [False, True], ids=["int8", "float"])
@pytest.mark.parametrize("device", ["cpu", "emu:0"])
def test_out_dtype_runs_as_aten_and_equals_eager(emu, floats, device):
    model = IntProduct(floats)
    ep = torch.export.export(model, (int8_rows(5, 1),))
    assert any("out_dtype" in str(n.target) for n in ep.graph.nodes)  # what torchao's export holds
    program = ferry.compile(ep, None if device == "cpu" else ferry.OpSupportPartitioner(device))
    kernels = [k.split(".")[0] for k in delegate_kernels(program)] if device != "cpu" else \
        [i.kernel.split(".")[0] for i in program.method("forward").instructions if hasattr(i, "kernel")]
    # int8 operands: the kernel out_dtype itself calls; floats: its cast, op and cast
    assert ("aten::mm" in kernels, "aten::_int_mm" in kernels) == (floats, not floats), kernels
    module = ferry.Module(program.to_bytes())
    x = int8_rows(5, 2)
    got = module.forward(x)
    assert torch.equal(got, model(x))
