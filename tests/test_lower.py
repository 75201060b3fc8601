"""Lowering: partitions become call_delegate nodes; lowered modules; eager execution of the result."""

from __future__ import annotations

import operator

import pytest
import torch

import ferry
from ferry import LoweredBackendModule, LoweredProgram, OpSupportPartitioner, Partition, to_backend
from ferry import node_meta as M
from ferry.aot.lower import call_delegate, is_delegate_node
from models import (
    Add,
    AddChain,
    Attention,
    FanOut,
    Fixed,
    MultiOutput,
    PerAdd,
    Tagger,
    WithParams,
    delegate_nodes,
    export,
    fresh_inputs,
    gpt2_lm,
    small,
    small_cnn,
    transformer_block,
)


def lowered_of(gm, node) -> LoweredBackendModule:
    return getattr(gm, node.args[0].target)


def call_ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_each_partition_becomes_one_call_delegate_read_by_getitem():
    lp = to_backend(export(FanOut(), small()), PerAdd("cuda:0"))
    gm = lp.graph_module
    ds = delegate_nodes(gm)
    assert len(ds) == 4
    for d in ds:
        assert d.target is call_delegate
        assert d.args[0].op == "get_attr"
        assert all(u.target is operator.getitem for u in d.users)
        assert sorted(u.args[1] for u in d.users) == list(range(len(d.users)))
    # nothing but delegates and getitems remains
    assert all(is_delegate_node(n) or n.target is operator.getitem for n in call_ops(gm))


def test_lowered_module_fields():
    lp = to_backend(export(Add(), small()), OpSupportPartitioner("cuda:1"))
    (d,) = delegate_nodes(lp.graph_module)
    mod = lowered_of(lp.graph_module, d)
    assert isinstance(mod, LoweredBackendModule)
    assert mod.backend_id == "torch"
    assert mod.compile_specs == (("target_device", b"cuda:1"),)
    assert mod.compile_spec("target_device") == b"cuda:1"
    assert mod.compile_spec("missing") is None
    sub = mod.original_module
    assert isinstance(sub, torch.fx.GraphModule)
    assert [n.target for n in sub.graph.nodes if n.op == "call_function"] == [torch.ops.aten.add.Tensor]
    assert len([n for n in sub.graph.nodes if n.op == "placeholder"]) == 2
    x, y = fresh_inputs(small())
    (out,) = mod(x, y)
    torch.testing.assert_close(out, x + y)


def test_custom_backend_id_and_specs_are_kept():
    specs = (("target_device", b"cuda:0"), ("max_value", b"7"))
    lp = to_backend(export(Add(), small()), Fixed(Partition(["add"], specs, backend_id="mine")))
    mod = lowered_of(lp.graph_module, delegate_nodes(lp.graph_module)[0])
    assert mod.backend_id == "mine"
    assert mod.compile_specs == specs


def test_delegate_values_carry_metadata():
    lp = to_backend(export(AddChain(), small(shape=(3, 5))), PerAdd("cuda:0"))
    for d in delegate_nodes(lp.graph_module):
        assert isinstance(d.meta["val"], tuple)
        for g in d.users:
            assert g.meta["val"].shape == (3, 5)
            assert g.meta["tensor_meta"].dtype == torch.float32


def test_lowered_program_runs_eagerly_and_equals_eager():
    m = FanOut()
    lp = to_backend(export(m, small()), PerAdd("cuda:0"))
    assert isinstance(lp, LoweredProgram)
    for seed in (1, 2):
        a, b = fresh_inputs(small(), seed)
        torch.testing.assert_close(lp(a, b), m(a, b))


def test_no_partitioner_means_no_delegates():
    m = AddChain()
    lp = to_backend(export(m, small()), None)
    assert not delegate_nodes(lp.graph_module)
    x, y = fresh_inputs(small())
    torch.testing.assert_close(lp(x, y), m(x, y))


def test_multi_output_delegate():
    m = MultiOutput()
    lp = to_backend(export(m, small()), OpSupportPartitioner("cuda:0", ops=["aten.add", "aten.mul"]))
    gm = lp.graph_module
    (d,) = delegate_nodes(gm)
    sub = lowered_of(gm, d).original_module
    assert len(sub.graph.output_node().args[0]) == 2
    assert sorted(u.args[1] for u in d.users) == [0, 1]
    x, y = fresh_inputs(small())
    got = lp(x, y)
    want = m(x, y)
    assert len(got) == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_delegate_output_that_is_also_a_method_output():
    class Two(torch.nn.Module):
        def forward(self, x, y):
            s = x + y
            return s, s * y

    m = Two()
    lp = to_backend(export(m, small()), OpSupportPartitioner("cuda:0"))
    (d,) = delegate_nodes(lp.graph_module)
    assert len(d.users) == 2
    x, y = fresh_inputs(small())
    s, p = lp(x, y)
    torch.testing.assert_close(s, x + y)
    torch.testing.assert_close(p, (x + y) * y)


def test_delegate_absorbs_the_parameters_it_uses():
    m = WithParams()
    ep = export(m, (torch.randn(3, 8),))
    lp = to_backend(ep, OpSupportPartitioner("cuda:0", exclude=["aten.relu"]))
    gm = lp.graph_module
    ds = delegate_nodes(gm)
    # the linear (weights absorbed) and the add of the offset buffer
    subs = [lowered_of(gm, d).original_module for d in ds]
    absorbed = {n.target: getattr(s, n.target) for s in subs for n in s.graph.nodes if n.op == "get_attr"}
    assert len(absorbed) == 3
    values = list(absorbed.values())
    assert any(torch.equal(v, m.lin.weight.detach()) for v in values)
    assert any(torch.equal(v, m.lin.bias.detach()) for v in values)
    assert any(torch.equal(v, m.offset) for v in values)
    # absorbed constants are no longer graph inputs
    kinds = [M.input_info(p).kind for p in lp.placeholders()]
    assert kinds == [M.USER_INPUT]
    assert lp.constants == {}
    assert [p.name for p in lp.user_inputs()] == ["x"]
    x = torch.randn(5, 8)
    torch.testing.assert_close(lp(x), m(x))


def test_constant_used_outside_the_delegate_stays_an_input():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            return (x + self.w) * self.w

    m = Shared()
    lp = to_backend(export(m, (torch.randn(4),)), OpSupportPartitioner("cuda:0", ops=["aten.add"]))
    kinds = sorted(M.input_info(p).kind for p in lp.placeholders())
    assert kinds == [M.PARAMETER, M.USER_INPUT]
    (name,) = lp.constants
    torch.testing.assert_close(lp.constants[name], m.w.detach())
    x = torch.randn(4)
    torch.testing.assert_close(lp(x), m(x))


def test_mutable_buffers_are_runtime_inputs_and_updated():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(3))

        def forward(self, x):
            self.total.add_(x)
            return self.total * 2

    m = Counter()
    ep = export(Counter(), (torch.randn(3),))
    lp = to_backend(ep, OpSupportPartitioner("cuda:0"))
    bufs = [p for p in lp.placeholders() if M.input_info(p).kind == M.BUFFER]
    assert len(bufs) == 1 and M.input_info(bufs[0]).mutable
    (d,) = delegate_nodes(lp.graph_module)
    assert bufs[0] in d.args  # passed in, not absorbed
    for seed in (3, 4):
        (x,) = fresh_inputs((torch.empty(3),), seed)
        torch.testing.assert_close(lp(x), m(x))
    torch.testing.assert_close(lp.constants[bufs[0].name], m.total)


def test_cnn_lowers_into_one_delegate_and_matches():
    m, ex = small_cnn()
    lp = to_backend(export(m, ex), OpSupportPartitioner("cuda:0"))
    assert len(delegate_nodes(lp.graph_module)) == 1
    assert lp.constants == {}  # every weight and statistic absorbed
    x = fresh_inputs(ex)
    torch.testing.assert_close(lp(*x), m(*x), atol=1e-5, rtol=1e-5)


def test_input_and_output_infos_are_recorded():
    lp = to_backend(export(WithParams(), (torch.randn(3, 8),)), None)
    kinds = {M.input_info(p).kind for p in lp.placeholders()}
    assert kinds == {M.USER_INPUT, M.PARAMETER, M.BUFFER}
    targets = {M.input_info(p).target for p in lp.placeholders() if M.input_info(p).kind != M.USER_INPUT}
    assert targets == {"lin.weight", "lin.bias", "offset"}
    infos = M.output_infos(lp.graph_module.graph.output_node())
    assert [i.kind for i in infos] == [M.USER_OUTPUT]


@pytest.mark.parametrize("n", [1, 3])
def test_calling_with_the_wrong_number_of_inputs_is_an_input_error(n):
    lp = to_backend(export(Add(), small()), OpSupportPartitioner("cuda:0"))
    with pytest.raises(ferry.InputError, match="2 input"):
        lp(*small(n=n))


# ---------------------------------------------------------------------------------------------
# what the user wrote survives lowering


def _ops(program_or_gm):
    if isinstance(program_or_gm, ferry.Program):
        out = []
        for m in program_or_gm.methods.values():
            out += [i.kernel for i in m.instructions if hasattr(i, "kernel")]
        for d in program_or_gm.delegates:
            out += _ops(ferry.load_program(program_or_gm.segments[d.payload], segments=program_or_gm.segments))
        return out
    return [str(n.target) for n in program_or_gm.graph.nodes if n.op == "call_function"]


def test_fused_ops_survive_lowering_on_every_device(emu):
    model, example = Attention(), (torch.randn(2, 8, 32),)
    ep = torch.export.export(model, example)
    traced = ferry.CompileConfig(fuse_for_inference=False)  # lowering alone (aot/fuse.py runs linear as addmm)
    for part in (None, OpSupportPartitioner("emu:0"), OpSupportPartitioner("emu:0", exclude=["aten.silu"])):
        program = ferry.compile(ep, part, traced)
        ops = _ops(program)
        for kept in ("scaled_dot_product_attention", "layer_norm", "linear", "silu"):
            assert sum(kept in k for k in ops) >= 1, (kept, ops)
        assert not any("bmm" in k or "_softmax" in k or "sigmoid" in k for k in ops), "nothing decomposed"
        (x,) = fresh_inputs(example, 3)
        torch.testing.assert_close(ferry.Module(program)(x), model(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["aten.layer_norm", "aten.softmax", "aten.silu", "aten.linear", "silu"])
def test_exclude_takes_the_names_print_shows(emu, name):
    model, example = Attention(), (torch.randn(2, 8, 32),)
    if name.endswith("softmax"):
        model, example = transformer_block()
    part = OpSupportPartitioner("emu:0", exclude=[name])
    program = ferry.compile(torch.export.export(model, example), part)
    short = name.rpartition(".")[2]
    outer = [i.kernel for i in program.method("forward").instructions if hasattr(i, "kernel")]
    assert any(k.split("::")[1].startswith(short) for k in outer), (name, outer)  # it runs on the CPU
    assert ferry.copy_report(program, "forward").count("d2h") >= 1


def test_a_name_that_matches_nothing_warns_with_the_nearest():
    model, example = transformer_block()
    with pytest.warns(UserWarning, match=r"exclude='aten._softmax' matches no op in this program; nearest: .*aten.softmax"):
        ferry.compile(torch.export.export(model, example), OpSupportPartitioner("cuda:0", exclude=["aten._softmax"]))


def test_gpt2_with_its_default_attention_compiles_and_matches(emu):
    pytest.importorskip("transformers")
    model, example = gpt2_lm()
    ep = torch.export.export(model, example)
    for part in (None, OpSupportPartitioner("emu:0"),
                 OpSupportPartitioner("emu:0", exclude=["aten.scaled_dot_product_attention"])):
        program = ferry.compile(ep, part)
        ids = torch.randint(0, 256, example[0].shape)
        with torch.no_grad():
            torch.testing.assert_close(ferry.Module(program)(ids), model(ids), atol=1e-4, rtol=1e-4)


def test_an_lstm_gru_tagger_runs_in_every_placement(emu):
    model, ids = Tagger().eval(), torch.randint(0, 100, (2, 7))
    ep = torch.export.export(model, (ids,))
    for part in (None, OpSupportPartitioner("emu:0"), OpSupportPartitioner("emu:0", exclude=["aten.relu"])):
        program = ferry.compile(ep, part)
        ids = torch.randint(0, 100, (2, 7))
        with torch.no_grad():
            torch.testing.assert_close(ferry.Module(program)(ids), model(ids), atol=1e-5, rtol=1e-5)


class Casts(torch.nn.Module):
    """.to() leaves aten._assert_tensor_metadata checks in the exported graph."""

    def forward(self, x):
        y = (x * 2).to(torch.float64)
        return (y + 1).to(torch.float32) * 3


def test_assert_only_nodes_become_no_delegates_and_no_copies(emu):
    ep = torch.export.export(Casts(), (torch.randn(4),))
    assert any("_assert_tensor_metadata" in str(n.target) for n in ep.graph.nodes), "the model has the checks"
    for part in (OpSupportPartitioner("emu:0"), OpSupportPartitioner("emu:0", exclude=["aten.add"])):
        program = ferry.compile(ep, part)
        for d in program.delegates:  # every delegate computes something
            assert any(not k.startswith("aten::_assert") for k in _ops(ferry.load_program(program.segments[d.payload], segments=program.segments)))
        m = program.method("forward")
        copies = [i for i in m.instructions if hasattr(i, "kernel") and i.kernel.startswith("et_copy::")]
        read = {a for i in m.instructions for a in i.args} | set(m.outputs)
        assert all(c.outputs[0] in read for c in copies), "every copy feeds something"
        x = torch.randn(4)
        torch.testing.assert_close(ferry.Module(program)(x), Casts()(x))


def test_results_take_the_shape_their_device_makes():
    """native_batch_norm in eval returns its saved statistics as (0,) on the CPU and (C,) on CUDA:
    placed on CUDA, the program plans CUDA's shapes (traced again on fake CUDA tensors, no GPU)."""

    class BatchNorm(torch.nn.Module):
        def forward(self, x, w, b, mean, var):
            return torch.ops.aten.native_batch_norm.default(x, w, b, mean, var, False, 0.1, 1e-5)

    example = (torch.randn(2, 3, 4), torch.randn(3), torch.randn(3), torch.randn(3), torch.rand(3) + 0.5)
    ep = torch.export.export(BatchNorm(), example)
    shapes = {}
    for device in ("cpu", "cuda:0"):
        program = ferry.compile(ep, ferry.OpSupportPartitioner(device) if device != "cpu" else None)
        m = program.method("forward")
        shapes[device] = [m.tensor(o).shape for o in m.outputs]
    assert shapes == {"cpu": [(2, 3, 4), (0,), (0,)], "cuda:0": [(2, 3, 4), (3,), (3,)]}


@pytest.mark.parametrize("norm", ["layer", "batch"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_results_take_the_dtype_their_device_makes_and_so_do_their_readers(norm, dynamic):
    """Layer and batch norm keep a bfloat16 input's statistics in bfloat16 on the CPU and in
    float32 on CUDA: placed on CUDA, the program declares float32 (CUDA eager's), and an op that
    reads a statistic declares what it makes of float32 (the OpInfo sweep on an H200 found the
    CPU's dtypes planned there)."""
    aten = torch.ops.aten

    class Norm(torch.nn.Module):
        def forward(self, x, w, b):
            if norm == "layer":
                y, mean, rstd = aten.native_layer_norm.default(x, [4], w, b, 1e-5)
            else:
                y, mean, rstd = aten.native_batch_norm.default(x, w, b, None, None, True, 0.1, 1e-5)
            return y, mean, rstd * 2

    channels = 4 if norm == "layer" else 3
    example = (torch.randn(5, 3, 4, dtype=torch.bfloat16), torch.randn(channels, dtype=torch.bfloat16),
               torch.randn(channels, dtype=torch.bfloat16))
    shapes = {0: torch.export.Dim("n", max=8)} if dynamic else None
    ep = torch.export.export(Norm(), example, dynamic_shapes=(shapes, None, None) if dynamic else None)
    dtypes = {}
    for device, exclude in (("cpu", ()), ("cuda:0", ()), ("cuda:0 reader on the cpu", ("aten.mul.Tensor",))):
        where = device.split()[0]
        program = ferry.compile(ep, ferry.OpSupportPartitioner(where, exclude=exclude) if where != "cpu" else None)
        m = program.method("forward")
        dtypes[device] = [m.tensor(o).dtype for o in m.outputs]
    assert dtypes["cpu"] == ["bfloat16"] * 3
    assert dtypes["cuda:0"] == ["bfloat16", "float32", "float32"]
    assert dtypes["cuda:0 reader on the cpu"] == ["bfloat16", "float32", "float32"]  # outside the partition too
    got = ferry.Module(ferry.compile(ep))(*example)  # the CPU's program still runs as eager on the CPU
    for g, w in zip(got, Norm()(*example)):
        assert g.dtype == w.dtype and torch.allclose(g.float(), w.float())


@pytest.mark.parametrize("device, stats, accepted", [
    ("cpu", "bfloat16", True), ("emu", "bfloat16", True),  # the CPU's kernels: the CPU's dtype
    ("cpu", "float32", True), ("cuda", "float32", True),  # the meta kernel's
    ("cuda", "bfloat16", False),  # CUDA's kernel makes float32: a file saying bfloat16 would round them
])
def test_a_declared_statistics_dtype_is_held_to_what_the_devices_kernel_makes(device, stats, accepted):
    from ferry.device import Device
    from ferry.errors import ProgramError
    from ferry.program.schema import TensorValue
    from ferry.runtime.stages import sizes

    bf16 = {"dtype": torch.bfloat16, "device": "meta"}
    args = [torch.empty(5, 3, 4, **bf16), [4], torch.empty(4, **bf16), torch.empty(4, **bf16), 1e-5]
    where = Device(device, 0)
    want = [TensorValue("bfloat16", (5, 3, 4), where), TensorValue(stats, (5, 3, 1), where),
            TensorValue(stats, (5, 3, 1), where)]
    if accepted:
        sizes._check_sized(torch.ops.aten.native_layer_norm.default, args, {}, want, "the norm")
    else:
        with pytest.raises(ProgramError, match="result 1 would be float32"):
            sizes._check_sized(torch.ops.aten.native_layer_norm.default, args, {}, want, "the norm")
