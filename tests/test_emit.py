"""Emit: placed graph -> Method. Out variants outside delegates, views as aliases, ops with no out
variant kept functional (and reported), values and devices per the reference (F), constants as
segments, delegate payloads. Programs that can run are compared with eager PyTorch on fresh inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ferry
from ferry import ops  # noqa: F401  (the et_copy ops)
from ferry.aot.fuse import Rewrite, fusion_notes
from ferry.device import Device
from ferry.inspect import program_json, program_summary
from ferry.op_names import kernel_name, resolve_kernel
from ferry.ops.aliasing import is_view
from ferry.ops.variants import out_variant
from ferry.program.lifetimes import tensor_ids
from ferry.program.schema import ConstValue, DelegateCall, KernelCall, TensorValue
from models import (
    Add,
    MultiOutput,
    Owners,
    PerAdd,
    SharedOutput,
    TwoLinears,
    WithParams,
    export,
    roundtrip,
    run_vs_eager,
    small,
    small_cnn,
    transformer_block,
    twice_plus,
)

CPU, CUDA0, EMU0 = Device("cpu", 0), Device("cuda", 0), Device("emu", 0)
aten = torch.ops.aten


def tensors(m, device=None):
    return [v for v in m.values if isinstance(v, TensorValue) and (device is None or v.device == device)]


def is_out_kernel(name: str) -> bool:
    overload = name.rpartition(".")[2]
    return overload == "out" or overload.endswith("_out")


ALL_REWRITES = [Rewrite(kind, "") for kind in ("fold", "attention", "mask dropped", "mask causal", "gemm")]


def check_out_variants(program, payload=False):
    """Outside delegates: every op that computes something is its .out overload writing its
    declared outputs, or its functional kernel for a reason the program records (no out
    variant, a wrapper .out, an eager layout); every view an alias with no memory of its own.
    (In a delegate payload the method outputs are the caller's tensors, so not planned.)"""
    for m in program.methods.values():
        # every op allocating per call is explained; other entries are the inference rewrites' notes
        assert set(m.runtime_allocating_ops) <= set(m.kernel_choices)
        for op in set(m.kernel_choices) - set(m.runtime_allocating_ops):  # and the planner's and emit's notes
            assert op in fusion_notes(ALL_REWRITES) or op == "in place" or op.startswith("delegate "), op
        assert all(m.kernel_choices.values())
        read = set(m.outputs) | {mb.update for mb in m.mutable_buffers}
        for ins in m.instructions:
            for a in ins.args:
                if a not in ins.outputs:
                    read.update(tensor_ids(m, a))
                    read.update(m.values[t].alias_of for t in tensor_ids(m, a) if m.values[t].alias_of is not None)
        for ins in m.instructions:
            if isinstance(ins, DelegateCall):
                continue
            op = resolve_kernel(ins.kernel)
            if ins.kernel.startswith("et_copy::"):
                assert ins.kernel in ("et_copy::_h2d_copy.out", "et_copy::_d2h_copy.out", "et_copy::_d2d_copy.out")
            if not op._schema.returns:  # checks like _assert_tensor_metadata define nothing
                assert ins.outputs == ()
                continue
            if is_view(op):
                for o in ins.outputs:
                    v = m.values[o]
                    assert v.alias_of is not None and v.plan is None, (ins.kernel, v)
                    base = m.values[v.alias_of]
                    assert base.alias_of is None, "aliases point at the value that owns the memory"
                    assert base.device == v.device
                continue
            if ins.kernel in m.kernel_choices:  # functional: its results are allocated by the kernel
                assert not is_out_kernel(ins.kernel) and not set(ins.outputs) & set(ins.args), ins
                assert all(m.values[o].storage == "runtime" for o in ins.outputs), ins
                continue
            assert is_out_kernel(ins.kernel), ins.kernel
            out_positions = [i for i, a in enumerate(op._schema.arguments) if a.is_out]
            assert tuple(ins.args[i] for i in out_positions) == ins.outputs, ins
            for o in ins.outputs:
                # planned, unless the caller binds it (a payload's output) or nothing reads it
                expected = not (payload and o in m.outputs) and o in read
                assert (m.values[o].plan is not None) == expected, (ins.kernel, m.values[o])


# ------------------------------------------------------------------ the reference's emit facts (F)


def test_add_on_cuda_values_and_instructions():
    program = ferry.compile(export(Add(), small((2, 2))), ferry.OpSupportPartitioner("cuda:0"))
    m = program.methods["forward"]
    on_cuda, on_cpu = tensors(m, CUDA0), tensors(m, CPU)
    assert len(on_cuda) == 3 and len(on_cpu) == 3  # 2 h2d + delegate output; 2 inputs + d2h output
    assert len(tensors(m)) == 6
    assert all(v.plan is not None for v in on_cuda + on_cpu)
    assert {m.buffers[v.plan.buffer].device for v in on_cuda} == {CUDA0}
    assert {m.buffers[v.plan.buffer].device for v in on_cpu} == {CPU}
    kinds = [i.kernel if isinstance(i, KernelCall) else "delegate" for i in m.instructions]
    assert kinds == ["et_copy::_h2d_copy.out", "et_copy::_h2d_copy.out", "delegate", "et_copy::_d2h_copy.out"]
    h2d0, h2d1, call, d2h = m.instructions
    assert h2d0.args == (m.inputs[0], h2d0.outputs[0]) and h2d1.args == (m.inputs[1], h2d1.outputs[0])
    assert call.args == (h2d0.outputs[0], h2d1.outputs[0])
    assert d2h.args == (call.outputs[0], d2h.outputs[0]) and m.outputs == [d2h.outputs[0]]
    assert program.delegates[call.delegate].spec("target_device") == b"cuda:0"
    check_out_variants(program)
    back = roundtrip(program)
    assert [v.device for v in tensors(back.methods["forward"])] == [v.device for v in tensors(m)]


def test_cpu_only_model_has_no_device_information():
    program = ferry.compile(export(WithParams(), small((3, 8), n=1)))
    m = program.methods["forward"]
    assert {v.device for v in tensors(m)} == {CPU}
    assert {b.device for b in m.buffers} == {CPU}
    assert not program.delegates
    assert not any(i.kernel.startswith("et_copy::") for i in m.instructions)
    check_out_variants(program)
    run_vs_eager(roundtrip(program), WithParams(), small((3, 8), n=1))


# ------------------------------------------------------------------ out variants outside delegates


@pytest.mark.parametrize("name,build,partitioner", [
    ("with_params", lambda: (WithParams(), small((3, 8), n=1)), None),
    ("two_linears", lambda: (TwoLinears(), small((3, 4), n=1)), None),
    ("cnn", small_cnn, None),
    ("transformer", transformer_block, None),
    ("transformer_softmax_gelu_on_cpu", transformer_block, lambda: ferry.OpSupportPartitioner("emu:0", exclude=["aten.softmax", "aten.gelu"])),
    ("shared_output_per_add", lambda: (SharedOutput(), small()), lambda: PerAdd("emu:0")),
    ("multi_output_add_mul", lambda: (MultiOutput(), small()), lambda: ferry.OpSupportPartitioner("emu:0", ops=["aten.add", "aten.mul"])),
])
def test_functional_ops_become_out_variants(emu, name, build, partitioner):
    model, inputs = build()
    program = ferry.compile(export(model, inputs), partitioner and partitioner())
    check_out_variants(program)
    m = program.methods["forward"]
    read = set(m.outputs) | {t for ins in m.instructions for a in ins.args if a not in ins.outputs
                             for t in tensor_ids(m, a)}
    read |= {m.values[t].alias_of for t in read if m.values[t].alias_of is not None}
    owned = [v for vid, v in enumerate(m.values) if isinstance(v, TensorValue) and v.alias_of is None
             and v.constant is None and vid in read]
    assert owned and all(v.storage in ("planned", "runtime") for v in owned), \
        "defaults plan every value an out kernel writes and is read; the rest are functional results"
    if partitioner is not None:
        assert any(isinstance(i, KernelCall) and i.kernel.startswith("et_copy::") for i in m.instructions)
    run_vs_eager(roundtrip(program), model, inputs)


class Factories(nn.Module):
    """Factory ops and dtype casts have out variants that take no dtype/device (the out tensor
    says it): torch.zeros, torch.full, torch.arange, x.double()."""

    def forward(self, x):
        z = torch.zeros(2, 3) + torch.full((2, 3), 0.5) + torch.arange(3).float()
        return x.double() + z, (x > 0).to(torch.int32)


def test_factory_ops_and_casts_use_out_variants():
    model, inputs = Factories(), small(n=1)
    program = ferry.compile(export(model, inputs))
    check_out_variants(program)
    kernels = {i.kernel for i in program.methods["forward"].instructions}
    assert {"aten::full.out", "aten::zeros.out", "aten::arange.out"} <= kernels
    # _to_copy.out computes into a temporary and copies: the cast runs its functional kernel
    assert "aten::_to_copy.default" in kernels and "(measured)" in program.method("forward").kernel_choices[
        "aten::_to_copy.default"]
    assert any(k.startswith("aten::arange.") and is_out_kernel(k) for k in kernels)
    run_vs_eager(roundtrip(program), model, inputs)


class Views(nn.Module):
    """Views of inputs, of intermediates and of views; a base whose own last use is early but
    whose view is read at the very end (its memory must stay reserved until then)."""

    def forward(self, x, y):
        a = x * 2
        v = a.transpose(0, 1)  # a's memory must live as long as v
        parts = torch.split(y, 1, dim=1)
        b = y + 1
        c = b * 3 + parts[0] + parts[2]
        d = c.unsqueeze(0).expand(2, 2, 3)[1]
        return d + v.t(), v, x.reshape(3, 2)[1:]


def test_views_become_aliases_with_no_plan():
    model, inputs = Views(), small()
    program = ferry.compile(export(model, inputs))
    m = program.methods["forward"]
    check_out_variants(program)
    view_ins = [i for i in m.instructions if is_view(resolve_kernel(i.kernel))]
    assert {resolve_kernel(i.kernel).overloadpacket for i in view_ins} >= {aten.transpose, aten.split, aten.slice}
    aliases = [v for v in tensors(m) if v.alias_of is not None]
    assert aliases and all(v.plan is None for v in aliases)
    for vid in m.inputs:  # views of an input alias that input
        assert any(v.alias_of == vid for v in aliases)
    run_vs_eager(roundtrip(program), model, inputs)
    # inspect shows views as such
    assert "[view]" in program_summary(program)


class UsesCustomOp(nn.Module):
    def forward(self, x, y):
        return torch.relu(twice_plus(x + 1, y)) - y


def test_op_without_out_variant_stays_functional(emu):
    op = torch.ops.ferry_test.twice_plus.default
    assert out_variant(op) is None and not is_view(op)
    model, inputs = UsesCustomOp(), small()
    program = ferry.compile(export(model, inputs))
    m = program.methods["forward"]
    assert "ferry_test::twice_plus.default" in m.runtime_allocating_ops
    assert m.kernel_choices["ferry_test::twice_plus.default"].startswith("no out variant")
    (call,) = [i for i in m.instructions if isinstance(i, KernelCall) and i.kernel == "ferry_test::twice_plus.default"]
    (out,) = call.outputs
    assert out not in call.args, "the functional op has no out argument"
    assert m.values[out].plan is None and m.values[out].device == CPU
    others = [i for i in m.instructions if isinstance(i, KernelCall) and i is not call]
    assert all(is_out_kernel(i.kernel) or not resolve_kernel(i.kernel)._schema.returns
               or is_view(resolve_kernel(i.kernel)) or i.kernel in m.kernel_choices for i in others)
    assert "    ferry_test::twice_plus.default: no out variant" in program_summary(program)
    assert "ferry_test::twice_plus.default" in program_json(program)["methods"]["forward"]["runtime_allocating_ops"]
    run_vs_eager(roundtrip(program), model, inputs, seeds=(1, 2, 3))
    # a device with a kernel for it (the emulated one runs CPU kernels) runs it in its delegate
    program = ferry.compile(export(model, inputs), ferry.OpSupportPartitioner("emu:0"))
    assert not any(isinstance(i, KernelCall) and i.kernel.startswith("ferry_test::")
                   for i in program.methods["forward"].instructions)
    run_vs_eager(roundtrip(program), model, inputs, seeds=(1, 2, 3))


# ------------------------------------------------------------------ out_variant / is_view on ops


@pytest.mark.parametrize("op,want", [
    (aten.add.Tensor, aten.add.out),
    (aten.mul.Scalar, aten.mul.Scalar_out),
    (aten.relu.default, aten.relu.out),
    (aten.addmm.default, aten.addmm.out),
    (aten.sum.dim_IntList, aten.sum.IntList_out),
    (aten.native_layer_norm.default, aten.native_layer_norm.out),  # three outputs
    (aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices.out),  # two outputs
    (aten.full.default, aten.full.out),  # factory ops: the out tensor fixes dtype/layout/device
    (aten.arange.start_step, aten.arange.start_out),
    (aten._to_copy.default, aten._to_copy.out),
    (aten.zeros_like.default, aten.zeros_like.out),
    (aten.clone.default, aten.clone.out),
    (torch.ops.et_copy._h2d_copy.default, torch.ops.et_copy._h2d_copy.out),
    (torch.ops.et_copy._d2h_copy.default, torch.ops.et_copy._d2h_copy.out),
    (torch.ops.et_copy._d2d_copy.default, torch.ops.et_copy._d2d_copy.out),
    (aten.add_.Tensor, None),  # in place
    (aten.add.out, None),  # already an out variant
    (aten.sym_size.int, None),  # returns an int
])
def test_out_variant_of(op, want):
    assert out_variant(op) is want
    if want is not None:
        assert resolve_kernel(kernel_name(want)) is want
        assert is_out_kernel(kernel_name(want))


@pytest.mark.parametrize("op,view", [
    (aten.view.default, True), (aten.permute.default, True), (aten.transpose.int, True),
    (aten.split.Tensor, True), (aten.unbind.int, True), (aten.expand.default, True),
    (aten.slice.Tensor, True), (aten.select.int, True), (aten.alias.default, True), (aten.unsqueeze.default, True),
    (aten.clone.default, False), (aten.add.Tensor, False), (aten.add_.Tensor, False), (aten._to_copy.default, False),
    (aten.add.out, False),
])
def test_is_view(op, view):
    assert is_view(op) is view


def test_kernel_names_round_trip():
    assert kernel_name(aten.add.out) == "aten::add.out"
    assert kernel_name(torch.ops.et_copy._h2d_copy.out) == "et_copy::_h2d_copy.out"
    assert resolve_kernel("aten::add.out") is aten.add.out
    for bad in ("aten::no_such_op.out", "aten::add.no_such_overload", "nonsense"):
        with pytest.raises(LookupError):
            resolve_kernel(bad)


# ------------------------------------------------------------------ constants and delegates


def test_constants_are_segments_and_not_planned():
    model = WithParams()
    program = ferry.compile(export(model, small((3, 8), n=1)))
    m = program.methods["forward"]
    consts = {v.name: v for v in tensors(m) if v.constant is not None}
    assert len(consts) == 3
    state = {"p_lin_weight": model.lin.weight, "p_lin_bias": model.lin.bias, "b_offset": model.offset}
    for name, t in state.items():
        v = consts[name]
        assert v.plan is None and v.device == CPU and v.shape == tuple(t.shape)
        assert bytes(program.segments[v.constant]) == t.detach().numpy().tobytes()


def test_shared_constant_stored_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return x @ self.w + x @ self.w.t()

    model = Tied()
    program = ferry.compile(export(model, small((3, 4), n=1)))
    assert len(program.segments) == 1
    run_vs_eager(roundtrip(program), model, small((3, 4), n=1))


def test_delegate_payload_is_a_program_on_the_delegate_device():
    model, inputs = WithParams(), small((3, 8), n=1)
    program = ferry.compile(export(model, inputs), ferry.OpSupportPartitioner("cuda:0"))
    (d,) = program.delegates
    assert d.backend_id == "torch" and d.spec("target_device") == b"cuda:0"
    payload = ferry.load_program(bytes(program.segments[d.payload]), segments=program.segments)
    pm = payload.methods["forward"]
    assert {v.device for v in tensors(pm) if v.constant is None} == {CUDA0}
    assert all(pm.values[v].plan is None for v in [*pm.inputs, *pm.outputs]), "the caller's planned tensors are used"
    assert {b.device for b in pm.buffers[1:]} <= {CUDA0}
    # the weights live in the payload, not in the outer method
    assert not any(v.constant is not None for v in tensors(program.methods["forward"]))
    check_out_variants(payload, payload=True)


# ------------------------------------------------------------------ sizes that cannot be planned


class NonZero(nn.Module):
    def forward(self, x):
        return torch.nonzero(x) + 1


def test_data_dependent_size_is_a_compile_error():
    with pytest.raises(ferry.CompileError, match=r"aten.nonzero.default .* makes a size that depends on the data"):
        ferry.compile(export(NonZero(), small((3, 4), n=1)))


class ItemChecked(nn.Module):
    """XLM's `assert lengths.max().item() <= slen`: a number read back, feeding only a check."""

    def forward(self, ids, mask):
        lengths = mask.sum(dim=1)
        torch._check(lengths.max().item() <= ids.shape[1])  # (pytest rewrites a test module's `assert`)
        return ids * 2 + lengths[:, None]


class ItemScaled(nn.Module):
    def forward(self, x, s):
        return x * s.max().item()


class ItemSized(nn.Module):
    def forward(self, x, n):
        return x.new_zeros(n.max().item()) + 1


@pytest.mark.parametrize("model, inputs, said", [
    (ItemChecked(), (torch.randint(0, 9, (2, 6)), torch.ones(2, 6, dtype=torch.long)),
     r"aten.item.default \(node 'item', at test_emit.py:\d+\) reads a tensor's value back to the host .*used by le"),
    (ItemScaled(), (torch.randn(2, 3), torch.randn(4)), r"reads a tensor's value back to the host .*used by aten.mul"),
    (ItemSized(), (torch.randn(3), torch.tensor([3])), r"makes a size that depends on the data"),
])
def test_a_number_read_from_the_data_is_refused_saying_what_it_is_used_for(model, inputs, said):
    """A number read back to the host is refused as a size where it sizes a tensor, and as a
    number read back (named with its source line and its users) where it feeds a check or a
    scalar argument: not called a size it is not."""
    with pytest.raises(ferry.CompileError, match=said):
        ferry.compile(torch.export.export(model, inputs, strict=False))


def test_dynamic_sizes_in_reshapes_are_computed_each_call(emu):
    """reshape(b, t, heads, d // heads) reads the batch size: a size computed every call."""
    model, (x,) = transformer_block()
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", max=8)},))
    for partitioner in (None, ferry.OpSupportPartitioner("emu:0", exclude=["aten.softmax"])):
        program = ferry.load_program(ferry.compile(ep, partitioner).to_bytes())
        m = program.method("forward")
        sizes = [v for v in m.values if isinstance(v, ConstValue) and v.kind == "symint"]
        assert sizes and all(v.value <= 8 * 64 for v in sizes)  # recorded at their bounds
        if partitioner is None:  # with a partitioner the reshapes are inside the delegates
            assert any(v.kind == "symints" for v in m.values if isinstance(v, ConstValue))
        module = ferry.Module(program)
        for batch in (2, 5, 1, 8):
            xi = torch.randn(batch, *x.shape[1:])
            with torch.no_grad():
                want = model(xi)
            got = module(xi)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ inspect: who owns each input/output


def test_summary_says_who_owns_inputs_and_outputs():
    ep = export(Owners(), small())
    lines = program_summary(ferry.compile(ep), instructions=False).splitlines()
    assert "  input 0: float32[2, 3] on cpu:0 (planned)" in lines
    assert "  output 0: float32[2, 3] on cpu:0 (planned)" in lines
    assert "  output 1: float32[3, 2] on cpu:0 (view, planned)" in lines
    assert "  output 2: float32[3] on cpu:0 (constant)" in lines
    assert "  output 3: float32[2, 3] on cpu:0 (allocated at run time)" in lines
    config = ferry.CompileConfig(alloc_graph_input=False, alloc_graph_output=False)
    lines = program_summary(ferry.compile(ep, None, config), instructions=False).splitlines()
    assert "  input 1: float32[2, 3] on cpu:0 (caller-owned)" in lines
    assert "  output 0: float32[2, 3] on cpu:0 (caller-owned)" in lines
    assert "  output 1: float32[3, 2] on cpu:0 (view, caller-owned)" in lines
