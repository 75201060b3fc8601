"""Lowering: partitions become call_delegate nodes; lowered modules; eager execution of the result."""

from __future__ import annotations

import operator

import pytest
import torch

import ferry
from ferry import LoweredBackendModule, LoweredProgram, OpSupportPartitioner, Partition, to_backend
from ferry.aot import meta as M
from ferry.aot.lower import call_delegate, is_delegate_node
from models import (
    Add,
    AddChain,
    FanOut,
    Fixed,
    MultiOutput,
    PerAdd,
    WithParams,
    delegate_nodes,
    export,
    fresh_inputs,
    small,
    small_cnn,
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
