"""A delegate call is checked against its payload when a method loads (issue 36): a file whose
call passes more arguments than the payload takes, expects a result it never returns, hands it
a tensor of another dtype or shape, or a host tensor for an emulated device, is a ProgramError
before anything is allocated; a kernel that returns its result cannot stand where memory is
filled in place. Each case is a mutant of a real compiled program."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ferry
from ferry.program.schema import DelegateCall, KernelCall, TensorValue
from models import fresh_inputs


class _Add(torch.nn.Module):
    def forward(self, x, y):
        return x + y


def _program():
    x = torch.randn(2, 3)
    ep = torch.export.export(_Add(), (x, x.clone()))
    return ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))


def _call(program) -> tuple[int, DelegateCall]:
    m = program.method("forward")
    return next((k, ins) for k, ins in enumerate(m.instructions) if isinstance(ins, DelegateCall))


def _mutate_call(program, **fields):
    m = program.method("forward")
    k, ins = _call(program)
    m.instructions[k] = dataclasses.replace(ins, **fields)
    return program


def _mutate_value(program, vid: int, **fields):
    m = program.method("forward")
    m.values[vid] = dataclasses.replace(m.values[vid], **fields)
    return program


def _mutants():
    def extra_argument(p):
        _, ins = _call(p)
        return _mutate_call(p, args=(*ins.args, ins.args[0]))

    def extra_result(p):
        m = p.method("forward")
        _, ins = _call(p)
        real = m.values[ins.outputs[0]]
        end = m.buffers[real.plan.buffer].size  # a place of its own, at the end of the real one's buffer
        m.buffers[real.plan.buffer] = dataclasses.replace(m.buffers[real.plan.buffer], size=end + 256)
        m.values.append(dataclasses.replace(real, plan=dataclasses.replace(real.plan, offset=end), name="extra"))
        return _mutate_call(p, outputs=(*ins.outputs, len(m.values) - 1))

    def other_dtype(p):
        _, ins = _call(p)
        return _mutate_value(p, ins.args[0], dtype="float64")

    def host_tensor_for_the_device(p):
        m = p.method("forward")
        _, ins = _call(p)
        host = next(i for i in m.inputs if m.values[i].device.is_cpu)  # the caller's tensor, before its copy
        return _mutate_call(p, args=(host, *ins.args[1:]))

    return {"extra argument": (extra_argument, "the call has 3 arguments, its payload's method 2"),
            "extra result": (extra_result, "the call has 2 results, its payload's method 1"),
            "other dtype": (other_dtype, r"argument 0 is a float64\[2, 3\] tensor on emu:0, the payload's method takes "
                                         r"a float32\[2, 3\] tensor on emu:0"),
            "host tensor": (host_tensor_for_the_device, r"argument 0 is a float32\[2, 3\] tensor on cpu:0")}


@pytest.mark.parametrize("case", list(_mutants()))
def test_a_delegate_call_that_disagrees_with_its_payload_is_refused_at_load(emu, case):
    mutate, message = _mutants()[case]
    program = _program()
    good = ferry.load_program(program.to_bytes())
    bad = mutate(ferry.load_program(program.to_bytes()))
    bad = ferry.load_program(bad.to_bytes())  # a file on disk: the program's own checks pass it
    emu.reset_counters()
    module = ferry.Module(bad)
    with pytest.raises(ferry.ProgramError, match=message):
        module.load_method()
    assert emu.allocations == 0 and emu.live_bytes == 0
    ok = ferry.Module(good)
    x, y = fresh_inputs((torch.randn(2, 3), torch.randn(2, 3)), 1)
    torch.testing.assert_close(ok(x, y), x + y)


def test_a_kernel_returning_its_result_cannot_stand_where_one_writes(emu):
    """`et_copy::_h2d_copy.out` replaced by `aten::mul.Tensor`, same arguments (the issue's
    mutant): mul only reads its `other` and returns a new tensor, so the planned result would
    never be written (it gave a wrong answer). Refused when the method loads; nothing stays."""
    program = _program()
    m = program.method("forward")
    k, ins = next((k, i) for k, i in enumerate(m.instructions)
                  if isinstance(i, KernelCall) and i.kernel.startswith("et_copy::_h2d_copy.out"))
    out = m.values[ins.outputs[0]]
    assert isinstance(out, TensorValue) and out.storage == "planned" and ins.outputs[0] in ins.args
    m.instructions[k] = dataclasses.replace(ins, kernel="aten::mul.Tensor")
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    emu.reset_counters()
    with pytest.raises(ferry.ProgramError, match=r"aten::mul.Tensor\): value \d+ is passed as its argument other, "
                                                 "which the kernel does not write"):
        module.load_method()
    assert emu.live_bytes == 0


class SolveTriangular(torch.nn.Module):
    def forward(self, a, b):
        return torch.linalg.solve_triangular(a, b, upper=True)


@pytest.mark.parametrize("sizes", [(3, 2, 3), (3, 3, 2, 2, 3)])
def test_a_delegates_output_its_kernel_lays_out_otherwise_reaches_the_caller_in_every_call_order(emu, sizes):
    """linalg's kernel lays its (n, 1) result out column-major; the delegate's plan bound at a shape
    made that result in memory of its own and the caller read its planned memory, stale from an
    earlier call (OpInfo: the third call of large, small, large was wrong)."""
    d = torch.export.Dim("d", min=2, max=3)
    upper = torch.triu(torch.randn(3, 3)) + 3 * torch.eye(3)
    ep = torch.export.export(SolveTriangular(), (upper, torch.randn(3, 1)), dynamic_shapes=({0: d, 1: d}, {0: d}))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0")))
    for n in sizes:
        a, b = torch.triu(torch.randn(n, n)) + 3 * torch.eye(n), torch.randn(n, 1)
        torch.testing.assert_close(module(a, b), SolveTriangular()(a, b))
