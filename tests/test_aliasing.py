"""ops/aliasing.py: which results may be their inputs' memory, read from the schemas and the
trace, and what the planner and the runtime do with it: every placement equals eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import ferry
from ferry import ProgramError
from ferry.ops import aliasing, writes
from ferry.program.schema import TensorValue
from ferry.program.validate import validate_program
from models import fresh_inputs

aten = torch.ops.aten


def test_schema_aliases_name_the_viewed_argument():
    assert aliasing.schema_alias(aten.view.default) == (0,)
    assert aliasing.schema_alias(aten.expand_as.default) == (0,)
    assert aliasing.schema_alias(aten.add.Tensor) == (None,)
    assert aliasing.is_view(aten.split.Tensor) and aliasing.view_source(aten.split.Tensor) == 0  # a list of views
    assert aliasing.is_view(aten._unsafe_view.default)  # a view its schema does not declare
    assert not aliasing.is_view(aten.relu.default) and not aliasing.is_view(aten.add_.Tensor)  # add_ writes


def test_unannotated_aten_ops_ask_the_trace_and_composites_the_runtime():
    assert aliasing.unannotated(aten.type_as.default) and aliasing.returns_inputs(aten.type_as.default)
    assert aliasing.unannotated(aten.unsafe_split.Tensor) and not aliasing.returns_inputs(aten.unsafe_split.Tensor)
    assert not aliasing.unannotated(aten.view.default)  # the schema says it
    assert not aliasing.unannotated(torch.ops.et_copy._h2d_copy.default)  # ferry's ops say what they do


def test_the_trace_names_the_input_a_composite_hands_back():
    class M(nn.Module):
        def forward(self, x, w):
            y = (x * 2).type_as(x)
            z = y.type_as(w.half())
            a, b = torch.broadcast_tensors(x, w)
            return y + 1, z, a + b

    ep = torch.export.export(M(), (torch.randn(4, 8), torch.randn(1, 8))).run_decompositions({})
    nodes = {n.name: n for n in ep.graph.nodes}
    assert [a.name for a in aliasing.traced_alias(nodes["type_as"]) if a is not None] == ["mul"]
    assert aliasing.traced_alias(nodes["type_as_1"]) == [None]  # a dtype change: a tensor of its own
    assert [a.name for a in aliasing.traced_alias(nodes["broadcast_tensors"])] == ["x", "w"]


def test_a_composite_result_that_shares_an_input_undeclared_is_copied():
    x = torch.randn(4)
    same = aliasing.composite_results(lambda t: t, [None])
    assert same(x).data_ptr() != x.data_ptr() and torch.equal(same(x), x)
    declared = aliasing.composite_results(lambda t: t[1:], [0])  # a view of input 0, as declared
    assert declared(x).data_ptr() == x[1:].data_ptr()
    fresh = aliasing.composite_results(lambda t: t + 1, [None])
    assert torch.equal(fresh(x), x + 1)
    pair = aliasing.composite_results(lambda a, b: (a, b + 1), [1, None])  # declared a view of b: not so
    out = pair(x, x.clone())
    assert out[0].data_ptr() != x.data_ptr() and torch.equal(out[0], x)


def test_scatter_kernels_may_write_over_self_only():
    op = writes.OUT_KERNELS[aten.slice_scatter.default]
    assert aliasing.overwrites_safely(op, 0) and not aliasing.overwrites_safely(op, 1)
    assert aliasing.overwrites_safely(aten.add.out, 1) and aliasing.overwrites_safely(aten.relu.out, 0)
    assert not aliasing.overwrites_safely(aten.mm.out, 0)


class TypeAs(nn.Module):
    """The issue's example: `type_as` of the same dtype is its input, read twice after."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = (x * 2).type_as(x)
        return self.a(y) * self.b(y)


class Composites(nn.Module):
    """Composites and unsafe ops whose results are their inputs' memory, read after the input dies,
    and ops returning lists (inside a delegate on the emulated device too)."""

    def forward(self, x, y):
        a = torch.atleast_2d(x * 2)
        b, c = torch.ops.aten.unsafe_split.Tensor(x + 1, 2)
        g, h = torch.meshgrid(y * 3, y, indexing="ij")
        s = (x - 1).sum_to_size(4, 4)
        (d,) = torch.gradient(x * 5, dim=0)  # a list of one tensor: still a list
        return a.exp() + b.sum() + c.sum(), g + h, s * s, d + 1


def placements():
    return {"cpu": None, "emu": ferry.OpSupportPartitioner("emu:0")}


@pytest.mark.parametrize("place", ["cpu", "emu"])
@pytest.mark.parametrize("model,example", [(TypeAs, (torch.randn(4, 8),)),
                                           (Composites, (torch.randn(4, 4), torch.randn(3)))])
def test_results_that_are_their_inputs_equal_eager(emu, place, model, example, tmp_path):
    m = model().eval()
    program = ferry.compile(torch.export.export(m, example), placements()[place])
    program.save(tmp_path / "m.ferry")
    module = ferry.Module(tmp_path / "m.ferry")
    for seed in (1, 2):
        inputs = fresh_inputs(example, seed)
        got, want = module(*inputs), m(*inputs)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_type_as_of_the_same_dtype_is_planned_as_a_view():
    program = ferry.compile(torch.export.export(TypeAs(), (torch.randn(4, 8),)))
    m = program.method("forward")
    (v,) = [v for v in m.values if isinstance(v, TensorValue) and v.name == "type_as"]
    assert v.storage == "view" and m.values[v.alias_of].name == "mul"


def test_sum_to_size_that_hands_back_its_input_at_another_size_equals_eager():
    """Traced at batch 4, `sum_to_size(1, 4)` makes a tensor; called at batch 1 it returns its input,
    whose planned memory the next op reuses: the runtime copies it first."""

    class M(nn.Module):
        def forward(self, x):
            y = x * 2
            s = y.sum_to_size(1, 4)
            z = (x + 3) * 5  # planned over y's bytes once y is dead
            return s + z.sum(0, keepdim=True)

    ep = torch.export.export(M(), (torch.randn(4, 4),), dynamic_shapes=({0: torch.export.Dim("b", max=8)},))
    module = ferry.Module(ferry.compile(ep))
    for n in (4, 1, 4, 1, 8):
        x = torch.randn(n, 4)
        torch.testing.assert_close(module(x), M()(x))


def test_a_file_declaring_a_composite_result_a_view_of_no_argument_is_refused():
    program = ferry.compile(torch.export.export(TypeAs(), (torch.randn(4, 8),)))
    m = program.method("forward")
    values = list(m.values)
    vid = next(i for i, v in enumerate(values) if isinstance(v, TensorValue) and v.name == "type_as")
    other = next(i for i, v in enumerate(values) if isinstance(v, TensorValue) and v.storage == "constant")
    values[vid] = dataclasses.replace(values[vid], alias_of=other)
    edited = dataclasses.replace(program, methods={"forward": dataclasses.replace(m, values=values)})
    with pytest.raises(ProgramError, match="none of its arguments"):
        validate_program(edited)


class ReadsStorage(nn.Module):
    """`x` read through its storage (as_strided with an offset, past a view), `y` as it is."""

    def forward(self, x, y):
        return torch.as_strided(x.view(-1), (2, 2), (1, 2), 1) + y


@pytest.mark.parametrize("where", ["cpu", "emu:0"])
def test_an_input_read_through_its_storage_is_named_and_a_view_into_a_larger_one_is_refused(emu, where):
    """Found through views and, on the device, through its copy there and into the delegate: the
    input is listed, a call with a view into a larger storage (whose offset would count from the
    wrong start) gets an InputError, and the module answers as eager afterwards."""
    from ferry import InputError

    x, y = torch.randn(3, 3), torch.randn(2, 2)
    ep = torch.export.export(ReadsStorage(), (x, y))
    program = ferry.compile(ep, ferry.OpSupportPartitioner(where) if where != "cpu" else None)
    assert program.methods["forward"].storage_inputs == [0]
    module = ferry.Module(program)
    with pytest.raises(InputError, match="read through its storage"):
        module(torch.randn(4, 3)[1:], y)
    for _ in range(2):
        x, y = torch.randn(3, 3), torch.randn(4, 2)[2:]  # `y` may be a view: it is read as a tensor
        assert torch.equal(module(x, y), ReadsStorage()(x, y))
