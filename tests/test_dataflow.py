"""Programs whose dataflow is unsound are refused before anything runs (program/dataflow.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ferry
from ferry.errors import ProgramError
from ferry.program import KernelCall, TensorValue, validate_program
from models import small, transformer_block


def _program():
    model, example = transformer_block()
    return ferry.compile(torch.export.export(model, example))


def _planned(m):
    return [vid for vid, v in enumerate(m.values) if isinstance(v, TensorValue) and v.storage == "planned"
            and vid not in m.inputs and v.nbytes]


def test_a_compiled_program_passes():
    validate_program(_program())


def test_the_instruction_list_repeated_is_refused():
    p = _program()
    m = p.method("forward")
    m.instructions = m.instructions + m.instructions
    with pytest.raises(ProgramError, match="already defines"):
        validate_program(p)


def test_a_read_before_any_write_is_refused():
    p = _program()
    m = p.method("forward")
    m.instructions = m.instructions[1:]  # the first instruction's result is now read unwritten
    with pytest.raises(ProgramError, match="before anything writes it"):
        validate_program(p)


def test_two_live_values_sharing_bytes_are_refused():
    p = _program()
    m = p.method("forward")
    a, b = _planned(m)[:2]
    m.values[b] = dataclasses.replace(m.values[b], plan=m.values[a].plan)
    with pytest.raises(ProgramError, match="alive at the same time and share bytes"):
        validate_program(p)


def test_a_buffer_larger_than_its_values_is_refused():
    p = _program()
    m = p.method("forward")
    m.buffers[1] = dataclasses.replace(m.buffers[1], size=2**31)
    with pytest.raises(ProgramError, match="larger than its values"):
        validate_program(p)


def test_a_planned_result_must_come_through_an_out_argument():
    p = _program()
    m = p.method("forward")
    k = next(i for i, ins in enumerate(m.instructions) if isinstance(ins, KernelCall) and ins.kernel == "aten::add.out")
    ins = m.instructions[k]
    out = ins.outputs[0]
    m.instructions[k] = KernelCall("aten::add.Tensor", tuple(a for a in ins.args if a != out), ins.outputs)
    with pytest.raises(ProgramError, match="must be written through an out argument"):
        validate_program(p)


def test_size_arithmetic_on_a_tensor_is_refused():
    p = _program()
    m = p.method("forward")
    t = _planned(m)[0]
    m.values.append(ferry.program.ConstValue("symint", 4))
    m.instructions.append(KernelCall("ferry::sym_add", (t, t), (len(m.values) - 1,)))
    with pytest.raises(ProgramError, match="not a size"):
        validate_program(p)


def test_a_delegate_output_must_be_memory_it_writes():
    p = ferry.compile(torch.export.export(*_add()), ferry.OpSupportPartitioner("cuda:0"))
    m = p.method("forward")
    call = next(ins for ins in m.instructions if not hasattr(ins, "kernel"))
    o = call.outputs[0]
    m.values[o] = dataclasses.replace(m.values[o], storage="scratch", plan=None)
    with pytest.raises(ProgramError, match="a delegate's outputs are memory it writes into"):
        validate_program(p)
    # 'runtime' passes here (a backend may return its results); binding checks that this one does
    # (tests/test_inductor_backend.py)


def _add():
    class Add(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    return Add(), small()
