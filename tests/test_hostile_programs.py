"""Hand-built hostile programs (a security review's probes): each is refused with a ProgramError
before it runs, and none writes the program file's mapping, the caller's tensors, a file, or
memory outside its own tensors. Before the fixes several crashed the process (a write to the
read-only mapping of the file) or leaked heap memory."""

import dataclasses

import pytest
import torch

import ferry
from edits import edited
from ferry.errors import ProgramError
from ferry.program.schema import ConstValue, KernelCall, MutableBuffer, TensorValue
from ferry.program.validate import validate_program

# the program of Scale: value 0 the weight (constant: a read-only view of the file), 1 the input x
# (planned; copied in), 2 the product (planned), instruction 0: aten::mul.out(x, w, out=2)


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16))

    def forward(self, x):
        return x * self.w


def program():
    return ferry.compile(torch.export.export(Scale(), (torch.randn(16),)))


def hostile(make):
    """The program with instructions `make(values, add_value)` put first."""
    p = program()
    m = p.method("forward")
    m2 = edited(m, lambda values, add: [*make(values, add), *m.instructions])
    return dataclasses.replace(p, methods={"forward": m2})


def runtime(shape=(16,)):
    return TensorValue("float32", shape, storage="runtime")


CASES = {
    # written through an out argument: the constant weight, read-only file memory
    "out= into a constant": (lambda v, add: [KernelCall("aten::mul.out", (1, 1, 0), (0,))], "constant memory"),
    # in place, declaring no outputs at all
    "add_ on a constant": (lambda v, add: [KernelCall("aten::add_.Tensor", (0, 1, -1), ())], "in place"),
    "fill_ on a view of a constant": (
        lambda v, add: [KernelCall("aten::view.default", (0, add(ConstValue("ints", [4, 4]))),
                                   (add(TensorValue("float32", (4, 4), alias_of=0, storage="view")),)),
                        KernelCall("aten::fill_.Scalar", (len(v) - 1, add(ConstValue("scalar", 1.0))), ())],
        "in place"),
    "resize_ of planned memory": (
        lambda v, add: [KernelCall("aten::resize_.default", (1, add(ConstValue("ints", [1 << 22])), -1), ())],
        "in place"),
    # views torch does not bounds-check, and sparse constructors that trust their indices
    "_reshape_alias past the arena": (
        lambda v, add: [KernelCall("aten::_reshape_alias.default",
                                   (1, add(ConstValue("ints", [1 << 20])), add(ConstValue("ints", [1]))),
                                   (add(TensorValue("float32", (1 << 20,), alias_of=1, storage="view")),))],
        "may not call it"),
    "a sparse tensor with an index far outside": (
        lambda v, add: [KernelCall("aten::_sparse_coo_tensor_with_dims_and_tensors.default",
                                   (add(ConstValue("int", 1)), add(ConstValue("int", 0)), add(ConstValue("ints", [4])),
                                    add(ConstValue("tensors", [])), add(ConstValue("tensors", [])), -1, -1, -1, -1, -1),
                                   (add(runtime((4,))),))],
        "may not call it"),
    "printing": (lambda v, add: [KernelCall("aten::_print.default", (add(ConstValue("str", "owned")),), ())],
                 "may not call it"),
    # an instruction that names more results than its op returns
    "three results of max.dim": (
        lambda v, add: [KernelCall("aten::max.dim", (1, add(ConstValue("int", 0)), -1),
                                   (add(runtime(())), add(TensorValue("int64", (), storage="runtime")),
                                    add(runtime(()))))],
        "returns 2 value"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_instruction_is_refused_before_anything_runs(case, tmp_path):
    make, message = CASES[case]
    p = hostile(make)
    x = torch.randn(16)
    x_before = x.clone()
    with pytest.raises(ProgramError, match=message):  # refused by save's checks, or by load's (a crafted file)
        path = tmp_path / "hostile.ferry"
        p.save(path)
        ferry.Module(path)(x)
    torch.testing.assert_close(x, x_before)  # the caller's tensor is untouched


@pytest.mark.parametrize("target", ["constant", "input"])
def test_a_mutable_buffer_over_the_file_or_the_callers_tensor_is_refused(target):
    p = program()
    m = p.method("forward")
    values = list(m.values)
    if target == "input":
        values[1] = TensorValue("float32", (16,), storage="input", name="x")
    m2 = dataclasses.replace(m, values=values, mutable_buffers=[MutableBuffer(0 if target == "constant" else 1, 2, "b")])
    with pytest.raises(ProgramError, match="must be the program.s state"):
        validate_program(dataclasses.replace(p, methods={"forward": m2}))


def test_an_in_place_write_to_the_callers_input_is_refused():
    p = program()
    m = p.method("forward")
    values = list(m.values)
    values[1] = TensorValue("float32", (16,), storage="input", name="x")
    bad = KernelCall("aten::mul.out", (0, 0, 1), (1,))  # out= the caller's tensor
    m2 = dataclasses.replace(m, values=values, instructions=[bad, *m.instructions])
    with pytest.raises(ProgramError, match="input memory"):
        validate_program(dataclasses.replace(p, methods={"forward": m2}))
