"""Partitioners: OpSupportPartitioner, custom partitioners, and the errors lowering raises for bad ones."""

from __future__ import annotations

import operator

import pytest
import torch

import ferry
from ferry import CompileError, Device, OpSupportPartitioner, Partition, target_device
from ferry.aot.lower import to_backend
from ferry.node_meta import get_device
from models import (
    AddChain,
    ByModulePath,
    FanOut,
    Fixed,
    PerAdd,
    TwoLinears,
    count_copies,
    delegate_nodes,
    export,
    fresh_inputs,
    small,
)


class Mixed(torch.nn.Module):
    """add -> mul -> relu -> add, and an independent sub."""

    def forward(self, x, y):
        a = x + y
        b = a * y
        c = torch.relu(b)
        return c + x, x - y


class Independent(torch.nn.Module):
    def forward(self, a, b, c, d):
        return a + b, c + d


def core(ep):
    return ep.run_decompositions()


def names_by_target(ep, target):
    return {n.name for n in ep.graph.nodes if n.op == "call_function" and n.target == target}


def test_target_device_spec():
    assert target_device("CUDA:1") == (("target_device", b"cuda:1"),)
    assert target_device(Device("cuda", 0)) == (("target_device", b"cuda:0"),)
    with pytest.raises(ValueError):
        target_device("tpu:0")


def test_partition_normalizes_specs():
    p = Partition(iter(["a", "b"]), [("target_device", bytearray(b"cuda:0"))])
    assert p.nodes == ("a", "b")
    assert p.compile_specs == (("target_device", b"cuda:0"),)
    assert p.backend_id == "torch"


def test_connected_ops_make_one_partition_with_target_device():
    ep = core(export(AddChain(), small()))
    parts = OpSupportPartitioner("cuda:0").partition(ep)
    assert len(parts) == 1
    assert set(parts[0].nodes) == names_by_target(ep, torch.ops.aten.add.Tensor)
    assert dict(parts[0].compile_specs)["target_device"] == b"cuda:0"
    assert parts[0].backend_id == "torch"


def test_device_is_parsed():
    ep = core(export(AddChain(), small()))
    (p,) = OpSupportPartitioner(" CUDA:1 ").partition(ep)
    assert dict(p.compile_specs)["target_device"] == b"cuda:1"
    with pytest.raises(ValueError):
        OpSupportPartitioner("tpu:0")


def test_unconnected_ops_make_separate_partitions():
    ep = core(export(Independent(), small(n=4)))
    parts = OpSupportPartitioner("cuda:0").partition(ep)
    assert len(parts) == 2
    assert all(len(p.nodes) == 1 for p in parts)
    lowered = to_backend(export(Independent(), small(n=4)), OpSupportPartitioner("cuda:0"))
    assert len(delegate_nodes(lowered.graph_module)) == 2


def test_partitions_are_ordered_and_disjoint():
    ep = core(export(Mixed(), small()))
    parts = OpSupportPartitioner("cuda:0").partition(ep)
    all_names = [n for p in parts for n in p.nodes]
    assert len(all_names) == len(set(all_names))
    pos = {n.name: i for i, n in enumerate(ep.graph.nodes)}
    firsts = [min(pos[n] for n in p.nodes) for p in parts]
    assert firsts == sorted(firsts)


def test_ops_restricts():
    ep = core(export(Mixed(), small()))
    parts = OpSupportPartitioner("cuda:0", ops=[torch.ops.aten.add.Tensor]).partition(ep)
    names = {n for p in parts for n in p.nodes}
    assert names == names_by_target(ep, torch.ops.aten.add.Tensor)
    # the two adds are not connected to each other: two partitions
    assert len(parts) == 2


@pytest.mark.parametrize("spec", [torch.ops.aten.mul, torch.ops.aten.mul.Tensor, "aten.mul", "aten::mul.Tensor"])
def test_ops_accepts_packets_overloads_and_names(spec):
    ep = core(export(Mixed(), small()))
    parts = OpSupportPartitioner("cuda:0", ops=[spec]).partition(ep)
    assert [p.nodes for p in parts] == [tuple(names_by_target(ep, torch.ops.aten.mul.Tensor))]


def test_exclude_removes():
    ep = core(export(Mixed(), small()))
    parts = OpSupportPartitioner("cuda:0", exclude=["aten.relu"]).partition(ep)
    names = {n for p in parts for n in p.nodes}
    assert not names & names_by_target(ep, torch.ops.aten.relu.default)
    assert names_by_target(ep, torch.ops.aten.mul.Tensor) <= names
    assert names_by_target(ep, torch.ops.aten.sub.Tensor) <= names


def test_exclude_wins_over_ops():
    ep = core(export(Mixed(), small()))
    parts = OpSupportPartitioner("cuda:0", ops=["aten.add", "aten.mul"], exclude=[torch.ops.aten.mul.Tensor]).partition(ep)
    names = {n for p in parts for n in p.nodes}
    assert names == names_by_target(ep, torch.ops.aten.add.Tensor)


def test_bad_op_spec_is_a_compile_error():
    with pytest.raises(CompileError):
        OpSupportPartitioner("cuda:0", ops=[42])


def test_placed_result_matches_eager_with_exclude():
    m = Mixed()
    placed = ferry.place(export(m, small()), OpSupportPartitioner("cuda:0", exclude=["aten.relu"]))
    x, y = fresh_inputs(small())
    for got, want in zip(placed(x, y), m(x, y)):
        torch.testing.assert_close(got, want)
    relu = [n for n in placed.graph_module.graph.nodes if n.target == torch.ops.aten.relu.default]
    assert len(relu) == 1 and get_device(relu[0]) == Device("cpu", 0)


# ----------------------------------------------------------------------------- custom partitioners


def test_one_delegate_per_add():
    m = FanOut()
    lowered = to_backend(export(m, small()), PerAdd("cuda:0"))
    ds = delegate_nodes(lowered.graph_module)
    assert len(ds) == 4
    for d in ds:
        mod = getattr(lowered.graph_module, d.args[0].target)
        assert mod.compile_spec("target_device") == b"cuda:0"
        ops = [n.target for n in mod.original_module.graph.nodes if n.op == "call_function"]
        assert ops == [torch.ops.aten.add.Tensor]
    a, b = fresh_inputs(small())
    torch.testing.assert_close(lowered(a, b), m(a, b))


def test_per_add_devices():
    lowered = to_backend(export(AddChain(), small()), PerAdd("cuda:0", "cuda:1"))
    specs = [getattr(lowered.graph_module, d.args[0].target).compile_spec("target_device") for d in delegate_nodes(lowered.graph_module)]
    assert specs == [b"cuda:0", b"cuda:1"]


def test_device_per_module_path():
    m = TwoLinears()
    ex = (torch.randn(2, 4),)
    part = ByModulePath({"a": "cuda:0", "b": "cuda:1"})
    placed = ferry.place(export(m, ex), part)
    gm = placed.graph_module
    ds = delegate_nodes(gm)
    assert [get_device(d) for d in ds] == [Device("cuda", 0), Device("cuda", 1)]
    for d in ds:  # each delegate holds only its module's linear (weights absorbed)
        sub = getattr(gm, d.args[0].target).original_module
        assert any(n.target == torch.ops.aten.linear.default for n in sub.graph.nodes)
        assert len([n for n in sub.graph.nodes if n.op == "get_attr"]) == 2
    # relu and the adds stay on the CPU between the two devices
    assert count_copies(gm) == {"h2d": 2, "d2h": 2, "d2d": 0}
    x = fresh_inputs(ex)
    torch.testing.assert_close(placed(*x), m(*x))


# ----------------------------------------------------------------------------- errors


def test_overlapping_partitions_are_a_compile_error():
    ep = export(AddChain(), small())
    add = sorted(names_by_target(core(ep), torch.ops.aten.add.Tensor))[0]
    with pytest.raises(CompileError, match="disjoint"):
        to_backend(ep, Fixed(Partition([add]), Partition([add])))


@pytest.mark.parametrize("name", ["no_such_node", "x", "output"])
def test_unknown_or_non_call_nodes_are_a_compile_error(name):
    with pytest.raises(CompileError, match=name):
        to_backend(export(AddChain(), small()), Fixed(Partition([name])))


def test_partitioner_must_return_partitions():
    with pytest.raises(CompileError, match="Partition"):
        to_backend(export(AddChain(), small()), Fixed(["add"]))


class NonConvex(torch.nn.Module):
    def forward(self, x):
        a = x + 1
        b = torch.relu(a)
        return a * b


def test_non_convex_partition_is_a_compile_error():
    ep = export(NonConvex(), (torch.randn(3),))
    c = core(ep)
    add = names_by_target(c, torch.ops.aten.add.Tensor)
    mul = names_by_target(c, torch.ops.aten.mul.Tensor)
    with pytest.raises(CompileError, match="convex"):
        to_backend(ep, Fixed(Partition([*add, *mul], target_device("cuda:0"))))


def test_op_support_partitions_are_convex():
    # relu unsupported between add and mul: the partitioner must not group add and mul
    ep = export(NonConvex(), (torch.randn(3),))
    placed = ferry.place(ep, OpSupportPartitioner("cuda:0", exclude=["aten.relu"]))
    assert len(delegate_nodes(placed.graph_module)) == 2
    x = torch.randn(3)
    torch.testing.assert_close(placed(x), NonConvex()(x))


def test_getitems_follow_their_multi_output_op():
    class MaxDim(torch.nn.Module):
        def forward(self, x):
            v, i = torch.max(x, dim=1)
            return v * 2, i

    ep = export(MaxDim(), (torch.randn(3, 4),))
    c = core(ep)
    mx = [n.name for n in c.graph.nodes if n.op == "call_function" and n.target != operator.getitem
          and "max" in str(n.target)]
    assert mx
    lowered = to_backend(ep, Fixed(Partition(mx, target_device("cuda:0"))))
    (d,) = delegate_nodes(lowered.graph_module)
    assert len([u for u in d.users if u.target is operator.getitem]) == 2
    x = torch.randn(3, 4)
    v, i = lowered(x)
    want_v, want_i = MaxDim()(x)
    torch.testing.assert_close(v, want_v)
    assert torch.equal(i, want_i)


class _MaxDim(torch.nn.Module):
    def forward(self, x):
        v, i = torch.max(x, dim=1)
        return v * 2, i


def _max_names(ep):
    c = core(ep)
    (mx,) = [n for n in c.graph.nodes if n.op == "call_function" and "max" in str(n.target)]
    items = sorted(u.name for u in mx.users)
    (mul,) = names_by_target(c, torch.ops.aten.mul.Tensor)
    return mx.name, items, mul


def test_getitem_without_its_op_is_a_compile_error():
    ep = export(_MaxDim(), (torch.randn(3, 4),))
    mx, items, mul = _max_names(ep)
    with pytest.raises(CompileError, match=items[0]):
        to_backend(ep, Fixed(Partition([items[0]], target_device("cuda:0"))))
    with pytest.raises(CompileError, match=mx):
        to_backend(ep, Fixed(Partition([items[0], mul], target_device("cuda:0")),
                             Partition([mx], target_device("cuda:1"))))
