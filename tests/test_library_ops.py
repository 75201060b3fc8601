"""Ops from libraries (`torch.library`) are placed like ATen ops: on a device that has a kernel
for them, else on the CPU, where compile warns and `ferry inspect` lists them with their copies;
an op placed where nothing can run it is a CompileError at compile time."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry.device import CPU, Device
from ferry.errors import CompileError
from ferry.ops.device_kernels import has_kernel
from ferry.views.text import program_summary

_LIB = torch.library.Library("ferry_libtest", "DEF")  # noqa: TOR901 - kept for the process: its ops stay registered
_LIB.define("host_only(Tensor x) -> Tensor")
_LIB.impl("host_only", lambda x: torch.tanh(x) * 2 + 1, "CPU")
_LIB.define("gpu_only(Tensor x) -> Tensor")
_LIB.impl("gpu_only", lambda x: x * 3, "CUDA")
_LIB.define("both(Tensor x) -> Tensor")
_LIB.impl("both", lambda x: x.exp() - 1, "CPU")
_LIB.impl("both", lambda x: x.exp() - 1, "CUDA")
for _name in ("host_only", "gpu_only", "both"):
    torch.library.register_fake(f"ferry_libtest::{_name}", lambda x: torch.empty_like(x), lib=_LIB)


@torch.library.custom_op("ferry_libtest::anywhere", mutates_args=())
def anywhere(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A composite custom op (no device named): it runs wherever its tensors are."""
    return torch.sin(x) * y + 0.5


@anywhere.register_fake
def _(x, y):
    return torch.empty_like(x)


class Uses(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op, self.lin = op, torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(self.op(torch.relu(self.lin(x)))) * 2


class UsesAnywhere(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return torch.ops.ferry_libtest.anywhere(h, x).relu()


def _top_level_ops(program, method="forward") -> set[str]:
    from ferry.program.schema import KernelCall
    return {ins.kernel for ins in program.method(method).instructions if isinstance(ins, KernelCall)}


def test_the_dispatch_table_says_where_ops_run():
    assert has_kernel(torch.ops.ferry_libtest.host_only.default, CPU)
    assert not has_kernel(torch.ops.ferry_libtest.host_only.default, Device("cuda", 0))
    assert has_kernel(torch.ops.ferry_libtest.anywhere.default, Device("cuda", 0))  # composite
    assert not has_kernel(torch.ops.ferry_libtest.gpu_only.default, CPU)
    assert not has_kernel(torch.ops.aten._weight_int4pack_mm.default, CPU)  # torchao's int4 matmul: CUDA only


def test_a_composite_library_op_runs_in_the_device_delegate(emu):
    torch.manual_seed(0)
    model, x = UsesAnywhere().eval(), torch.randn(8, 16)
    program = ferry.compile(torch.export.export(model, (x,)), ferry.OpSupportPartitioner("emu:0"))
    assert not any("ferry_libtest" in k for k in _top_level_ops(program))  # inside the delegate
    assert ferry.copy_report(program, "forward").count("h2d") == 1  # only the input goes over
    for _ in range(2):
        x = torch.randn(8, 16)
        torch.testing.assert_close(ferry.Module(program).forward(x), model(x))


def test_an_op_with_no_device_kernel_stays_on_the_cpu_and_is_listed():
    torch.manual_seed(0)
    model, x = Uses(torch.ops.ferry_libtest.host_only).eval(), torch.randn(8, 16)
    with pytest.warns(RuntimeWarning, match=r"ferry_libtest::host_only.default has no kernel for cuda:0: runs on the "
                                            r"CPU, 1 call\(s\) with 2 copies"):
        program = ferry.compile(torch.export.export(model, (x,)), ferry.OpSupportPartitioner("cuda:0"))
    assert "ferry_libtest::host_only.default" in _top_level_ops(program)
    text = program_summary(program)
    assert "on the CPU: ferry_libtest::host_only.default: no kernel for cuda:0" in text
    # the same op has a kernel on a host-backed device (the emulated one runs CPU kernels)
    assert has_kernel(torch.ops.ferry_libtest.host_only.default, Device("emu", 0))


def test_an_op_with_kernels_for_both_goes_to_the_device():
    model, x = Uses(torch.ops.ferry_libtest.both).eval(), torch.randn(8, 16)
    program = ferry.compile(torch.export.export(model, (x,)), ferry.OpSupportPartitioner("cuda:0"))
    assert not any("ferry_libtest" in k for k in _top_level_ops(program))
    assert not any(k.startswith("on the CPU") for k in program.method("forward").kernel_choices)


def test_an_op_placed_where_nothing_runs_it_is_a_compile_error():
    model, x = Uses(torch.ops.ferry_libtest.gpu_only).eval(), torch.randn(8, 16)
    ep = torch.export.export(model, (x,))
    with pytest.raises(CompileError, match=r"ferry_libtest::gpu_only.default .* placed on the CPU, which has no kernel "
                                           r"for it; it runs on cuda: .*OpSupportPartitioner\('cuda:0'\)"):
        ferry.compile(ep)


def test_int4_matmul_on_the_cpu_is_a_compile_error():
    """torchao's int4 weights call `_weight_int4pack_mm`, which has a CUDA kernel only."""

    class Int4(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randint(-2**31, 2**31 - 1, (4, 2, 32, 4), dtype=torch.int32))
            self.register_buffer("sz", torch.randn(2, 32, 2, dtype=torch.bfloat16))

        def forward(self, x):
            return torch.ops.aten._weight_int4pack_mm(x, self.w, 128, self.sz)

    ep = torch.export.export(Int4(), (torch.randn(2, 256, dtype=torch.bfloat16),))
    with pytest.raises(CompileError, match=r"aten::_weight_int4pack_mm.default .* no kernel for it"):
        ferry.compile(ep)


@pytest.mark.cuda
def test_library_ops_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    for op in (torch.ops.ferry_libtest.host_only, torch.ops.ferry_libtest.both):
        model, x = Uses(op).eval(), torch.randn(8, 16)
        program = ferry.compile(torch.export.export(model, (x,)), ferry.OpSupportPartitioner("cuda:0"))
        on_cpu = any("ferry_libtest" in k for k in _top_level_ops(program))
        assert on_cpu == (op is torch.ops.ferry_libtest.host_only)
        x = torch.randn(8, 16)
        torch.testing.assert_close(ferry.Module(program).forward(x), model(x))
    model, x = UsesAnywhere().eval(), torch.randn(8, 16)
    program = ferry.compile(torch.export.export(model, (x,)), ferry.OpSupportPartitioner("cuda:0"))
    assert not any("ferry_libtest" in k for k in _top_level_ops(program))
    torch.testing.assert_close(ferry.Module(program).forward(x), model(x))
