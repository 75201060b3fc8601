"""Programs that write their inputs in place, as eager's in-place ops do (`x.add_(y)`,
`x[0] = ...`, `x.t().relu_()`), and programs with constant outputs (`return y, None, 3`).

After every call the caller's tensors must hold what eager leaves in them, in every placement
(inputs on the CPU or on the device, either backend), at every dynamic size, with CUDA graphs on
the asynchronous emulated device, with outputs copied or viewed; a call that cannot write an
input as eager would is refused before anything runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import ferry
from ferry.program import validate_program
from ferry.runtime import clone_to, device_of
from ferry.runtime.stages.input_writes import written_back
from ferry.views.text import program_json, program_summary

KEEP_ON_DEVICE = ferry.CompileConfig(
    propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))
PLACEMENTS = {
    "cpu": (None, None),
    "emu, inputs on the host": (lambda: ferry.OpSupportPartitioner("emu:0"), None),
    "emu, inputs on the device": (lambda: ferry.OpSupportPartitioner("emu:0"), KEEP_ON_DEVICE),
}


class AddsInPlace(nn.Module):
    def forward(self, x, y):
        x.add_(y)
        return (x * 2).sum(1)


class WritesThroughViews(nn.Module):
    """A row, a transpose and an index assignment: each writes part of the caller's tensor."""

    def forward(self, x, rows, v):
        x[0].mul_(2)
        x.t().relu_()
        x[rows] = v
        return x.sum(0)


class WritesTwoAndReturnsNothing(nn.Module):
    def forward(self, x, y):
        x.mul_(y.sigmoid())
        y.sub_(1)


class ReturnsItsInput(nn.Module):
    """The result is the written input itself, and a state buffer is updated too."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls.add_(1)
        return x.mul_(self.calls)


class ConstantOutputs(nn.Module):
    def forward(self, x):
        return x + 1, None, 3, 2.5


def _cases():
    g = torch.Generator().manual_seed(0)
    return {
        "adds": (AddsInPlace, lambda: (torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g))),
        "views": (WritesThroughViews, lambda: (torch.randn(4, 4, generator=g), torch.tensor([1, 3]),
                                               torch.randn(2, 4, generator=g))),
        "two, no result": (WritesTwoAndReturnsNothing, lambda: (torch.randn(5, 2, generator=g), torch.randn(5, 2, generator=g))),
        "returns its input": (ReturnsItsInput, lambda: (torch.randn(3, 2, generator=g),)),
    }


CASES = _cases()


def _on(program, inputs, method="forward"):
    """Copies of `inputs` where the program takes them."""
    meta = program.method_meta(method)
    return [x.clone() if meta.input_meta(i).device.is_cpu else clone_to(x, str(meta.input_meta(i).device))
            for i, x in enumerate(inputs)]


def _host(value):
    if isinstance(value, torch.Tensor):
        return value if device_of(value).is_cpu else clone_to(value, "cpu")
    if isinstance(value, tuple):
        return tuple(_host(v) for v in value)
    return value


def _same_as_eager(model, module, program, make, calls=3):
    eager_model = type(model)()  # its own state (ReturnsItsInput counts its calls)
    for _ in range(calls):
        inputs = make()
        mine = _on(program, inputs)
        want_inputs = [x.clone() for x in inputs]
        want = eager_model(*want_inputs)
        got = module(*mine)
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(_host(got), want)
        for i, (a, b) in enumerate(zip(mine, want_inputs)):
            torch.testing.assert_close(_host(a), b, msg=f"input {i} after the call")


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("case", list(CASES))
def test_written_inputs_hold_what_eager_leaves_in_them(emu, tmp_path, case, placement):
    cls, make = CASES[case]
    partitioner, config = PLACEMENTS[placement]
    ep = torch.export.export(cls(), make())
    program = ferry.compile(ep, partitioner and partitioner(), config)
    program.save(tmp_path / "p.ferry")
    module = ferry.Module(tmp_path / "p.ferry")
    _same_as_eager(cls(), module, module.program, make)
    meta = module.program.method_meta("forward")
    assert meta.written_inputs() == ([0, 1] if case == "two, no result" else [0])
    assert meta.num_outputs() == 1  # (None, for the one that returns nothing)


def test_the_inductor_backend_writes_inputs_kept_on_the_device(emu):
    cls, make = CASES["views"]
    program = ferry.compile(torch.export.export(cls(), make()), ferry.OpSupportPartitioner("emu:0", backend_id="inductor"),
                            KEEP_ON_DEVICE)
    assert {d.backend_id for d in program.delegates} == {"inductor"}
    _same_as_eager(cls(), ferry.Module(program), program, make)


@pytest.mark.parametrize("outputs", ["copy", "view"])
def test_a_dynamic_program_writes_its_input_at_every_size_with_graphs(emu_async, outputs):
    """Large, small, large, each called three times (graphs captured per shape on the
    asynchronous device), inputs kept on the device."""
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(AddsInPlace(), (torch.randn(4, 3), torch.randn(4, 3)), dynamic_shapes=({0: batch}, {0: batch}))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), KEEP_ON_DEVICE)
    module = ferry.Module(program, cuda_graphs=True, outputs=outputs)
    g = torch.Generator().manual_seed(1)
    for n in (4, 4, 4, 2, 2, 2, 4, 1, 2):
        x, y = torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g)
        mx, my = clone_to(x, "emu:0"), clone_to(y, "emu:0")
        got = _host(module(mx, my))
        want = AddsInPlace()(x, y)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(_host(mx), x)
        torch.testing.assert_close(_host(my), y)
    assert any(r.captured for r in module.graph_report())


def test_shape_buckets_and_microbatches_write_the_callers_rows(emu):
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(AddsInPlace(), (torch.randn(4, 3), torch.randn(4, 3)), dynamic_shapes=({0: batch}, {0: batch}))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))
    g = torch.Generator().manual_seed(2)
    for module in (ferry.Module(program, shape_buckets=[2, 4, 8]), ferry.Module(program, microbatches=2)):
        for n in (3, 5, 8):
            x, y = torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g)
            mx = x.clone()
            got = module(mx, y.clone())
            want = AddsInPlace()(x, y)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(mx, x)


def test_an_input_eager_could_not_write_is_refused_before_anything_runs(emu):
    program = ferry.compile(torch.export.export(ReturnsItsInput(), (torch.randn(3, 2),)), ferry.OpSupportPartitioner("emu:0"))
    module = ferry.Module(program)
    x = torch.randn(3, 2, requires_grad=True)
    with pytest.raises(ferry.InputError, match="requires grad"):
        module(x)  # (every ferry input: it runs inference)
    expanded = torch.randn(1, 2).expand(3, 2)
    before = expanded.clone()
    with pytest.raises(ferry.InputError, match="share one memory location"):
        module(expanded)
    assert torch.equal(expanded, before)
    # nothing ran: the state counted no call, and the module still works
    y = torch.randn(3, 2)
    want = y * 1
    assert torch.equal(module(y), want) and torch.equal(y, want)
    assert torch.equal(module(y), want * 2) and torch.equal(y, want * 2)


def test_constant_outputs_come_back_as_eager_returns_them(emu, tmp_path):
    ep = torch.export.export(ConstantOutputs(), (torch.randn(2, 2),))
    for partitioner in (None, ferry.OpSupportPartitioner("emu:0")):
        program = ferry.compile(ep, partitioner)
        program.save(tmp_path / "p.ferry")
        for outputs in ("copy", "view"):
            x = torch.randn(2, 2)
            got = ferry.Module(tmp_path / "p.ferry", outputs=outputs)(x)
            assert got[1:] == (None, 3, 2.5)
            torch.testing.assert_close(got[0], x + 1)
        assert "the constant None" in program_summary(program)


def test_inspect_shows_which_output_is_written_into_which_input():
    program = ferry.compile(torch.export.export(AddsInPlace(), CASES["adds"][1]()))
    text = program_summary(program)
    assert "written into input 0 after the call" in text
    assert program_json(program)["methods"]["forward"]["input_writes"] == [{"output": 0, "input": 0}]


@pytest.mark.parametrize(("writes", "message"), [
    ([(5, 0)], "the method has 2 outputs and 2 inputs"),
    ([(0, 0), (0, 1)], "is in an earlier write too"),
    ([(1, 0)], "cannot be written into input 0"),  # the sum: another shape
])
def test_a_file_with_a_bad_input_write_is_refused(writes, message):
    program = ferry.compile(torch.export.export(AddsInPlace(), CASES["adds"][1]()))
    m = program.method("forward")
    bad = dataclasses.replace(m, input_writes=[ferry.program.InputWrite(o, i) for o, i in writes])
    program.methods["forward"] = bad
    with pytest.raises(ferry.ProgramError, match=message):
        validate_program(program)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("config", [None, KEEP_ON_DEVICE], ids=["inputs on the host", "inputs on the GPU"])
def test_written_inputs_on_a_gpu_hold_what_eager_leaves_in_them(config, graphs):
    cls, make = CASES["views"]
    program = ferry.compile(torch.export.export(cls(), make()), ferry.OpSupportPartitioner("cuda:0"), config)
    module = ferry.Module(program, cuda_graphs=graphs)
    for _ in range(4):  # graphs are captured at the second call and replayed after
        inputs = make()
        mine = _on(program, inputs)
        want_inputs = [x.clone() for x in inputs]
        want = cls()(*want_inputs)
        torch.testing.assert_close(module(*mine).cpu(), want)
        torch.testing.assert_close(mine[0].cpu(), want_inputs[0])


class InstanceNormWithStats(nn.Module):
    """Eager's instance_norm updates the running statistics it is given, which its schema does
    not say: ferry decomposes it, so the update is recorded and written back."""

    def forward(self, x, mean, var):
        return nn.functional.instance_norm(x, mean, var, use_input_stats=True, momentum=0.3)


def test_an_op_that_hides_its_write_is_decomposed_and_the_write_kept(emu):
    g = torch.Generator().manual_seed(3)
    make = lambda: (torch.randn(2, 3, 5, generator=g), torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5)  # noqa: E731
    ep = torch.export.export(InstanceNormWithStats(), make())
    kernels = [getattr(i, "kernel", "") for i in ferry.compile(ep).method("forward").instructions]
    assert "aten::_native_batch_norm_legit_functional.default" in kernels
    assert not any("instance_norm" in k for k in kernels)
    program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))
    assert program.method_meta("forward").written_inputs() == [1, 2]
    _same_as_eager(InstanceNormWithStats(), ferry.Module(program), program, make)


class IndexesByAList(nn.Module):
    def forward(self, x):
        return x[[0, 2]] * 2  # the index is a tensor made inside forward (a lifted constant)


def test_a_tensor_made_inside_forward_is_not_taken_for_a_written_input():
    x = torch.randn(4, 3)
    program = ferry.compile(torch.export.export(IndexesByAList(), (x,)))
    torch.testing.assert_close(ferry.Module(program)(x), IndexesByAList()(x))


class TransposesItsInputInPlace(nn.Module):
    def forward(self, x):
        return x.t_() + 1


def test_an_op_changing_an_inputs_shape_in_place_is_refused_by_name():
    with pytest.raises(ferry.CompileError, match=r"aten.t_.default changes a tensor's sizes or strides in place"):
        ferry.compile(torch.export.export(TransposesItsInputInPlace(), (torch.randn(2, 3),)))


class ReadsAnotherInput(nn.Module):
    def forward(self, x, y):
        x.add_(1)
        return y * 2


def test_a_written_input_sharing_memory_with_another_is_refused(emu):
    """Eager would read the write through the other input; the program reads each as passed."""
    program = ferry.compile(torch.export.export(ReadsAnotherInput(), (torch.randn(3), torch.randn(3))))
    module = ferry.Module(program)
    x = torch.zeros(6)
    for a, b in ((x, x), (x[:4], x[2:5]), (x[:3], x[1:].view(5)[:3])):
        with pytest.raises(ferry.InputError, match="input 1 shares its memory"):
            module(a[:3], b[:3])
    assert torch.equal(x, torch.zeros(6))
    got = module(x[:3], x[3:])  # one storage, apart: fine
    assert torch.equal(got, torch.zeros(3)) and torch.equal(x, torch.tensor([1.0, 1, 1, 0, 0, 0]))


def test_an_inference_tensor_is_written_only_in_inference_mode():
    program = ferry.compile(torch.export.export(ReadsAnotherInput(), (torch.randn(3), torch.randn(3))))
    module = ferry.Module(program)
    with torch.inference_mode():
        x, y = torch.zeros(3), torch.ones(3)
    with pytest.raises(ferry.InputError, match="inference tensor"):
        module(x, y)
    assert torch.equal(x, torch.zeros(3))
    with torch.inference_mode():
        assert torch.equal(module(x, y), 2 * y) and torch.equal(x, torch.ones(3))


def test_programs_compile_inside_inference_mode():
    """The check for hidden writes runs its fakes outside inference mode (no version counters there)."""
    for model, example in ((IndexesByAList(), (torch.randn(4, 3),)),
                           (InstanceNormWithStats(), (torch.randn(2, 3, 5), torch.randn(3), torch.rand(3) + 0.5))):
        ep = torch.export.export(model, example)
        with torch.inference_mode():
            program = ferry.compile(ep)
        got, want = ferry.Module(program)(*[t.clone() for t in example]), model(*[t.clone() for t in example])
        torch.testing.assert_close(got, want)


def test_micro_batches_check_the_callers_tensors_not_stand_ins(emu):
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(AddsInPlace(), (torch.randn(4, 3), torch.randn(4, 3)), dynamic_shapes=({0: batch}, {0: batch}))
    module = ferry.Module(ferry.compile(ep), microbatches=2)
    x, y = torch.randn(6, 3), torch.randn(6, 3)
    assert module.parts("forward", [x, y]) == 2  # what a distributed rank 0 asks first
    with pytest.raises(ferry.InputError, match="shares its memory"):
        module.parts("forward", [x, x])


def test_a_file_whose_written_output_is_not_the_inputs_size_fails_the_call(emu):
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(AddsInPlace(), (torch.randn(4, 3), torch.randn(4, 3)), dynamic_shapes=({0: batch}, {0: batch}))
    program = ferry.compile(ep)
    m = program.method("forward")
    # a hostile file: the written value's dynamic batch declared static
    static = dataclasses.replace(m.tensor(m.outputs[0]), dynamic=(False, False))
    program.methods["forward"] = dataclasses.replace(m, values=[static if i == m.outputs[0] else v
                                                                for i, v in enumerate(m.values)])
    with pytest.raises(ferry.ProgramError, match="cannot be written into input 0"):
        validate_program(program)
    # two dynamic sizes the file does not tie together disagree at a call: refused, nothing written
    x = torch.zeros(4, 3)
    with pytest.raises(ferry.ProgramError, match=r"output 0, \(2, 3\), cannot be written into input 0, \(4, 3\)"):
        written_back(m, [x, x], [torch.ones(2, 3), torch.ones(2)])
    assert torch.equal(x, torch.zeros(4, 3))
