"""A kernel's out argument planned over an input that dies at that kernel, as eager's `relu_`
and `+=` reuse memory: fewer planned bytes, results equal eager's, and a file that claims
such sharing where the kernel cannot do it safely is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ferry
import ferry.aot.emit as emit
from ferry.errors import ProgramError
from ferry.program.schema import KernelCall
from models import fresh_inputs


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        h = torch.sigmoid(self.a(x) + 1.0) * 2  # add, sigmoid, mul: each over the last
        return self.b(h) + x


class ReadLater(torch.nn.Module):
    def forward(self, x):
        h = x * 3
        return torch.sigmoid(h) * h  # h is read after sigmoid: sigmoid may not write over it


class ViewOfItself(torch.nn.Module):
    def forward(self, x):
        h = x * 3
        return h + h.t()  # h is also read through a view: writing over it would overlap partly


def _program(model, *shape):
    example = (torch.randn(*shape),)
    return ferry.compile(torch.export.export(model, example)), example


def _planned_bytes(program) -> int:
    return sum(b.size for b in program.method("forward").buffers)


def _shared(program) -> list[tuple[str, int, int]]:
    """(kernel, input, output) for every kernel whose output has the plan entry of an input (or of
    the base of an input that is a view)."""
    m = program.method("forward")
    out = []
    for ins in m.instructions:
        if isinstance(ins, KernelCall) and len(ins.outputs) == 1 and m.tensor(ins.outputs[0]).plan is not None:
            plan = m.tensor(ins.outputs[0]).plan
            roots = [(a, getattr(m.values[a], "alias_of", None)) for a in ins.args if a >= 0 and a != ins.outputs[0]]
            out += [(ins.kernel, a if r is None else r, ins.outputs[0]) for a, r in roots
                    if getattr(m.values[a if r is None else r], "plan", None) == plan]
    return out


def _matches_eager(program, model, example, tmp_path):
    path = tmp_path / "p.ferry"
    program.save(path)  # saving and loading check the sharing
    module = ferry.Module(path)
    for seed in range(3):
        inputs = fresh_inputs(example, seed)
        torch.testing.assert_close(module(*inputs), model(*inputs))


def test_pointwise_ops_write_over_the_input_that_dies_there_and_plan_fewer_bytes(tmp_path, monkeypatch):
    model = Chain().eval()
    program, example = _program(model, 8, 16)
    kernels = {k for k, _, _ in _shared(program)}
    assert {"aten::add.out", "aten::mul.out"} <= kernels
    assert "in place" in program.method("forward").kernel_choices
    _matches_eager(program, model, example, tmp_path)
    monkeypatch.setattr(emit, "overwrites_safely", lambda op, position: False)
    apart, _ = _program(model, 8, 16)
    assert not _shared(apart) and _planned_bytes(program) < _planned_bytes(apart)


@pytest.mark.parametrize("model", [ReadLater(), ViewOfItself()], ids=["read-later", "view-of-itself"])
def test_an_input_still_needed_is_not_written_over(model, tmp_path):
    program, example = _program(model, 6, 6)
    m = program.method("forward")
    h = next(ins.outputs[0] for ins in m.instructions if ins.kernel == "aten::mul.out")
    assert all(a != h for _, a, _ in _shared(program))
    _matches_eager(program, model, example, tmp_path)


class Square(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        return torch.mm(x * 3, self.w) + 1  # mm's output has its input's layout, but mm reads it all


def test_a_file_sharing_bytes_with_a_kernel_that_cannot_write_over_its_input_is_refused(tmp_path):
    program, _ = _program(Square().eval(), 6, 6)
    m = program.method("forward")
    ins = next(ins for ins in m.instructions if ins.kernel == "aten::mm.out")
    source, out = ins.args[0], ins.outputs[0]  # x * 3: planned, same layout, dead after mm
    assert (m.tensor(source).shape, m.tensor(source).strides) == (m.tensor(out).shape, m.tensor(out).strides)
    values = list(m.values)
    values[out] = dataclasses.replace(values[out], plan=m.tensor(source).plan)
    hostile = dataclasses.replace(program, methods={"forward": dataclasses.replace(m, values=values)})
    with pytest.raises(ProgramError, match="share bytes"):
        hostile.save(tmp_path / "hostile.ferry")


def test_in_a_delegate_a_result_is_written_over_a_view_of_all_of_a_dying_gemm_result(emu_any):
    """`linear` runs as a GEMM whose 2-D result is viewed back to (batch, seq, n): gelu and the
    residual add write over that view's bytes, inside a delegate on an asynchronous device too."""
    from ferry.examples import transformer_block
    from ferry.program import load_program

    model, example = transformer_block()[:2]
    program = ferry.compile(torch.export.export(model, example), ferry.OpSupportPartitioner("emu:0"))
    inner = load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward")
    assert any(k == "aten::gelu.out" for k, _, _ in _shared(ferry.Program({"forward": inner}, [], [])))
    module = ferry.Module(program)
    for seed in range(3):
        inputs = fresh_inputs(example, seed)
        torch.testing.assert_close(module(*inputs), model(*inputs), atol=1e-5, rtol=1e-4)


class Normal(torch.nn.Module):
    def forward(self, x):
        return torch.normal(x * 100, 0.01) + 0  # `normal_` exists, but is another call than normal.Tensor_float_out


def test_an_op_whose_in_place_overload_is_another_call_is_not_written_in_place():
    program, _ = _program(Normal(), 64)
    assert not [k for k, _, _ in _shared(program) if "normal" in k]
    x = torch.randn(64)
    assert (ferry.Module(program)(x) - 100 * x).abs().max() < 1  # std 0.01: far below 1 unless the mean was lost


class AddMM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return torch.addmm(x * 3, x * 2, self.w) + 1  # addmm writes over its `self` (x * 3), as addmm_ does


def _hostile_addmm(make):
    """AddMM's program with the addmm instruction replaced by `make(m, h, out, add)`'s list."""
    from edits import edited

    program, _ = _program(AddMM().eval(), 8, 8)
    m = program.method("forward")
    k = next(k for k, ins in enumerate(m.instructions) if ins.kernel == "aten::addmm.out")
    h, out = m.instructions[k].args[0], m.instructions[k].outputs[0]
    assert _shared(program) and any(a == h and o == out for _, a, o in _shared(program))

    def instructions(values, add):
        return [*m.instructions[:k], *make(m, h, out, add), *m.instructions[k + 1:]]

    return dataclasses.replace(program, methods={"forward": edited(m, instructions)})


def _view(m, base, add, strides=()):
    return add(dataclasses.replace(m.tensor(base), storage="view", alias_of=base, plan=None, strides=strides))


@pytest.mark.parametrize("attack, refusal", [
    ("a view of a view", "does not own memory"),
    ("a view declared as a kernel's own result", "is a view of value"),
    ("the out argument read as another argument", "writes it through an out argument"),
])
def test_a_file_cannot_hide_a_read_of_what_a_kernel_writes_over(attack, refusal, tmp_path):
    from ferry.program.schema import ConstValue, KernelCall

    def make(m, h, out, add):
        args = list(next(i for i in m.instructions if i.kernel == "aten::addmm.out").args)
        if attack == "a view of a view":
            v1 = _view(m, h, add)
            v2 = add(dataclasses.replace(m.tensor(h), storage="view", alias_of=v1, plan=None, strides=(1, 8)))
            return [KernelCall("aten::view.default", (h, add(ConstValue("ints", [8, 8]))), (v1,)),
                    KernelCall("aten::t.default", (v1,), (v2,)),
                    KernelCall("aten::addmm.out", (h, v2, *args[2:]), (out,))]
        if attack == "a view declared as a kernel's own result":
            t = add(dataclasses.replace(m.tensor(h), storage="runtime", plan=None, strides=(1, 8)))
            return [KernelCall("aten::t.default", (h,), (t,)), KernelCall("aten::addmm.out", (h, t, *args[2:]), (out,))]
        return [KernelCall("aten::addmm.out", (h, args[1], out, *args[3:]), (out,))]

    with pytest.raises(ProgramError, match=refusal):
        _hostile_addmm(make).save(tmp_path / "hostile.ferry")
