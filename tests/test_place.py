"""PropagateDevicePass: device of every value, and the minimum set of explicit copies."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.passes.infra.pass_base import PassResult

import ferry
from ferry import CompileError, Device, OpSupportPartitioner, Partition, PropagateDevicePass, to_backend
from ferry import node_meta as M
from ferry import ops as O
from ferry.aot.lower import call_delegate
from ferry.aot.place import lowered_module_of
from ferry.node_meta import get_device
from models import (
    Add,
    AddChain,
    FanOut,
    Fixed,
    InputToCpuAndDelegate,
    PerAdd,
    RunningSum,
    SharedOutput,
    copy_nodes,
    count_copies,
    delegate_nodes,
    export,
    fresh_inputs,
    small,
)

CPU = Device("cpu", 0)
CUDA0 = Device("cuda", 0)
CUDA1 = Device("cuda", 1)


def lower(model, partitioner, inputs=None):
    return to_backend(export(model, inputs or small()), partitioner)


def placed(model, partitioner, inputs=None, **flags):
    lp = lower(model, partitioner, inputs)
    PropagateDevicePass(**flags)(lp.graph_module)
    return lp


def by_op(gm):
    return {n.name: n for n in gm.graph.nodes}


def placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def outputs(gm):
    return M.flat_outputs(gm.graph.output_node())


def check_matches_eager(lp, model, n_inputs=2, shape=(2, 3), seed=11):
    args = fresh_inputs(small(shape=shape, n=n_inputs), seed)
    got, want = lp(*args), model(*args)
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    else:
        torch.testing.assert_close(got, want)


def placed_like_eager(model, partitioner, copies, **flags):
    """The graph of `model` placed by `partitioner`, checked to make exactly `copies` ({direction:
    count}) and to run like eager."""
    lp = placed(model, partitioner, **flags)
    assert count_copies(lp.graph_module) == copies
    check_matches_eager(lp, model)
    return lp.graph_module


# ---------------------------------------------------------------------------------------------
# target device


@pytest.mark.parametrize("raw, want", [(b"cuda:1", CUDA1), (b"CUDA:1", CUDA1), (b"  Cuda:0 ", CUDA0), (b"cuda", CUDA0)])
def test_target_device_from_compile_spec(raw, want):
    lp = placed(Add(), Fixed(Partition(["add"], [("target_device", raw)])))
    (d,) = delegate_nodes(lp.graph_module)
    assert get_device(d) == want
    assert all(get_device(c) == want for c in copy_nodes(lp.graph_module, "h2d"))


def test_unknown_device_type_lists_valid_types():
    lp = lower(Add(), Fixed(Partition(["add"], [("target_device", b"tpu:0")])))
    with pytest.raises(ValueError) as e:
        PropagateDevicePass()(lp.graph_module)
    assert "tpu" in str(e.value) and "cuda" in str(e.value) and "cpu" in str(e.value)


def test_bad_index_in_compile_spec():
    lp = lower(Add(), Fixed(Partition(["add"], [("target_device", b"cuda:-1")])))
    with pytest.raises(ValueError):
        PropagateDevicePass()(lp.graph_module)


def test_no_target_device_stays_on_cpu_with_zero_copies():
    gm = placed_like_eager(AddChain(), Fixed(Partition(["add"], [("max_value", b"4")]), Partition(["add_1"])),
                           copies={"h2d": 0, "d2h": 0, "d2d": 0})
    assert len(delegate_nodes(gm)) == 2
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "call_function"):
            assert get_device(n) == CPU, n


def test_call_delegate_without_a_lowered_module_is_a_clear_error():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")
    d = g.call_function(call_delegate, (x, y))
    g.output((g.call_function(operator.getitem, (d, 0)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(CompileError, match="LoweredBackendModule"):
        PropagateDevicePass()(gm)


def test_call_delegate_with_get_attr_of_a_plain_module_is_a_clear_error():
    root = torch.nn.Module()
    root.add_module("not_lowered", torch.nn.ReLU())
    g = torch.fx.Graph()
    x = g.placeholder("x")
    d = g.call_function(call_delegate, (g.get_attr("not_lowered"), x))
    g.output((g.call_function(operator.getitem, (d, 0)),))
    with pytest.raises(CompileError, match="call_delegate"):
        PropagateDevicePass()(torch.fx.GraphModule(root, g))


# ---------------------------------------------------------------------------------------------
# flag on (default)


def test_single_add_copies_order_and_devices():
    gm = placed_like_eager(Add(), OpSupportPartitioner("cuda:0"), copies={"h2d": 2, "d2h": 1, "d2d": 0})
    ops = [n for n in gm.graph.nodes if n.op != "get_attr"]
    kinds = []
    for n in ops:
        if n.op in ("placeholder", "output"):
            kinds.append(n.op)
        elif O.is_copy_node(n):
            kinds.append(O.COPY_DIRECTION[n.target])
        elif n.target is call_delegate:
            kinds.append("delegate")
        elif n.target is operator.getitem:
            kinds.append("getitem")
        else:
            kinds.append(str(n.target))
    assert kinds == ["placeholder", "placeholder", "h2d", "h2d", "delegate", "getitem", "d2h", "output"]
    x, y = placeholders(gm)
    h2d = copy_nodes(gm, "h2d")
    assert [c.args[0] for c in h2d] == [x, y]
    assert all(get_device(c) == CUDA0 for c in h2d)
    (d,) = delegate_nodes(gm)
    assert list(d.args[1:]) == h2d
    assert get_device(d) == CUDA0
    (item,) = d.users
    assert get_device(item) == CUDA0
    (d2h,) = copy_nodes(gm, "d2h")
    assert d2h.args[0] is item and get_device(d2h) == CPU
    assert outputs(gm) == [d2h]
    assert get_device(x) == CPU and get_device(y) == CPU


def test_index_of_target_is_kept():
    lp = placed(Add(), OpSupportPartitioner("cuda:1"))
    gm = lp.graph_module
    assert {get_device(c) for c in copy_nodes(gm, "h2d")} == {CUDA1}
    assert get_device(delegate_nodes(gm)[0]) == CUDA1


def test_chain_on_one_device_has_no_copy_between_delegates():
    gm = placed_like_eager(AddChain(), PerAdd("cuda:0"), copies={"h2d": 2, "d2h": 1, "d2d": 0})
    d0, d1 = delegate_nodes(gm)
    (z,) = d0.users
    assert z in d1.args  # the device value flows straight in
    assert get_device(z) == CUDA0
    # y is read by both delegates through one shared h2d
    y_copy = [c for c in copy_nodes(gm, "h2d") if c.args[0].name == "y"]
    assert len(y_copy) == 1 and {u for u in y_copy[0].users} == {d0, d1}


def test_cross_device_is_one_d2d_and_no_round_trip():
    gm = placed_like_eager(AddChain(), PerAdd("cuda:0", "cuda:1"), copies={"h2d": 3, "d2h": 1, "d2d": 1})
    d0, d1 = delegate_nodes(gm)
    (z,) = d0.users
    (d2d,) = copy_nodes(gm, "d2d")
    assert d2d.args[0] is z
    assert list(d2d.users) == [d1]
    assert get_device(d2d) == CUDA1 and get_device(d0) == CUDA0 and get_device(d1) == CUDA1
    # no host round trip: no h2d reads a d2h
    for c in copy_nodes(gm, "h2d"):
        assert c.args[0].op == "placeholder"
    assert sorted(str(get_device(c)) for c in copy_nodes(gm, "h2d")) == ["cuda:0", "cuda:0", "cuda:1"]


def test_fan_out_shares_one_h2d_per_input():
    gm = placed_like_eager(FanOut(), PerAdd("cuda:0"), copies={"h2d": 2, "d2h": 1, "d2d": 0})
    assert len(delegate_nodes(gm)) == 4
    a, b = placeholders(gm)
    h2d = copy_nodes(gm, "h2d")
    assert sorted(c.args[0].name for c in h2d) == ["a", "b"]
    for c in h2d:
        assert len(c.users) == 2  # t and u (a) / t and w (b)
        assert all(u.target is call_delegate for u in c.users)
    assert list(a.users) == [h2d[0]] and list(b.users) == [h2d[1]]


def test_output_that_feeds_a_delegate_and_a_cpu_op_has_one_shared_d2h():
    gm = placed_like_eager(SharedOutput(), PerAdd("cuda:0"), copies={"h2d": 2, "d2h": 2, "d2d": 0})
    d0, d1 = delegate_nodes(gm)
    (a,) = d0.users
    assert d1 in a.users  # device-side consumer reads it directly
    a_d2h = [c for c in copy_nodes(gm, "d2h") if c.args[0] is a]
    assert len(a_d2h) == 1
    users = set(a_d2h[0].users)
    relu = [n for n in gm.graph.nodes if n.target == torch.ops.aten.relu.default]
    assert users == {relu[0], gm.graph.output_node()}
    assert outputs(gm)[0] is a_d2h[0]
    assert get_device(relu[0]) == CPU


def test_same_value_returned_twice_is_copied_once():
    class Twice(torch.nn.Module):
        def forward(self, x, y):
            s = x + y
            return s, s

    lp = placed(Twice(), OpSupportPartitioner("cuda:0"))
    gm = lp.graph_module
    assert count_copies(gm)["d2h"] == 1
    (d2h,) = copy_nodes(gm, "d2h")
    assert outputs(gm) == [d2h, d2h]


def test_every_value_has_one_device():
    lp = placed(SharedOutput(), PerAdd("cuda:0", "cuda:1"))
    for n in lp.graph_module.graph.nodes:
        if n.op in ("placeholder", "call_function"):
            assert isinstance(get_device(n), Device), n


def test_method_outputs_are_on_the_cpu():
    for part in (PerAdd("cuda:0"), PerAdd("cuda:0", "cuda:1"), OpSupportPartitioner("cuda:1")):
        lp = placed(SharedOutput(), part)
        assert all(get_device(o) == CPU for o in outputs(lp.graph_module))


def test_inserted_nodes_carry_device_val_and_tensor_meta():
    lp = placed(AddChain(), PerAdd("cuda:0", "cuda:1"), inputs=small(shape=(4, 5)))
    copies = copy_nodes(lp.graph_module)
    assert len(copies) == 5
    for c in copies:
        assert isinstance(get_device(c), Device)
        assert c.meta["val"].shape == (4, 5) and c.meta["val"].dtype == torch.float32
        assert tuple(c.meta["tensor_meta"].shape) == (4, 5)


def test_pass_reports_modified_truthfully():
    lp = lower(FanOut(), PerAdd("cuda:0", "cuda:1"))
    gm = lp.graph_module
    p = PropagateDevicePass()
    r1 = p(gm)
    assert isinstance(r1, PassResult) and r1.modified
    before = str(gm.graph)
    devices = {n.name: get_device(n) for n in gm.graph.nodes}
    r2 = PropagateDevicePass()(gm)
    assert not r2.modified
    assert str(gm.graph) == before
    assert {n.name: get_device(n) for n in gm.graph.nodes} == devices


@pytest.mark.parametrize("flags", [
    dict(enable_non_cpu_memory_planning=False),
    dict(skip_h2d_for_method_inputs=True),
    dict(skip_d2h_for_method_outputs=True),
    dict(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True),
])
def test_second_run_is_a_no_op_for_every_mode(flags):
    lp = lower(InputToCpuAndDelegate(), PerAdd("cuda:0"))
    gm = lp.graph_module
    assert PropagateDevicePass(**flags)(gm).modified
    before = str(gm.graph)
    assert not PropagateDevicePass(**flags)(gm).modified
    assert str(gm.graph) == before


def test_cpu_only_graph_is_modified_once_then_not():
    lp = lower(AddChain(), None)
    assert PropagateDevicePass()(lp.graph_module).modified  # devices recorded
    assert not PropagateDevicePass()(lp.graph_module).modified
    assert count_copies(lp.graph_module) == {"h2d": 0, "d2h": 0, "d2d": 0}


# ---------------------------------------------------------------------------------------------
# legacy mode


def test_legacy_mode_inserts_no_copies_and_places_every_value_in_host_memory():
    """The reference tags delegate inputs and outputs with the delegate's device although its
    planner then ignores devices; ferry places values where their memory is (the host), so
    emit and the planner read one fact and decide nothing again. The delegates keep their
    target device and move their own data."""
    gm = placed_like_eager(AddChain(), PerAdd("cuda:0"), enable_non_cpu_memory_planning=False,
                           copies={"h2d": 0, "d2h": 0, "d2d": 0})
    d0, d1 = delegate_nodes(gm)
    for d in (d0, d1):
        assert get_device(d) == CPU
        assert lowered_module_of(gm, d).compile_spec("target_device") == b"cuda:0"
        for a in d.args[1:]:
            assert get_device(a) == CPU
        for u in d.users:
            assert get_device(u) == CPU
    x, y = placeholders(gm)
    assert get_device(x) == CPU and get_device(y) == CPU


def test_legacy_mode_leaves_cpu_ops_on_cpu():
    lp = placed(InputToCpuAndDelegate(), PerAdd("cuda:1"), enable_non_cpu_memory_planning=False)
    gm = lp.graph_module
    sin = [n for n in gm.graph.nodes if n.target == torch.ops.aten.sin.default]
    assert get_device(sin[0]) == CPU
    assert count_copies(gm) == {"h2d": 0, "d2h": 0, "d2d": 0}


@pytest.mark.parametrize("flag", ["skip_h2d_for_method_inputs", "skip_d2h_for_method_outputs"])
def test_skip_flags_with_legacy_mode_fail_at_construction(flag):
    with pytest.raises(ValueError, match="enable_non_cpu_memory_planning"):
        PropagateDevicePass(**{flag: True}, enable_non_cpu_memory_planning=False)


# ---------------------------------------------------------------------------------------------
# skip flags


def test_skip_h2d():
    gm = placed_like_eager(Add(), OpSupportPartitioner("cuda:0"), skip_h2d_for_method_inputs=True,
                           copies={"h2d": 0, "d2h": 1, "d2d": 0})
    x, y = placeholders(gm)
    assert get_device(x) == CUDA0 and get_device(y) == CUDA0
    (d,) = delegate_nodes(gm)
    assert list(d.args[1:]) == [x, y]


def test_skip_d2h():
    gm = placed_like_eager(Add(), OpSupportPartitioner("cuda:0"), skip_d2h_for_method_outputs=True,
                           copies={"h2d": 2, "d2h": 0, "d2d": 0})
    (out,) = outputs(gm)
    assert out.target is operator.getitem and get_device(out) == CUDA0


def test_skip_both():
    gm = placed_like_eager(AddChain(), PerAdd("cuda:0"), skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True,
                           copies={"h2d": 0, "d2h": 0, "d2d": 0})
    assert all(get_device(p) == CUDA0 for p in placeholders(gm))
    assert all(get_device(o) == CUDA0 for o in outputs(gm))


def test_skip_h2d_input_also_read_by_a_cpu_op():
    gm = placed_like_eager(InputToCpuAndDelegate(), PerAdd("cuda:0"), skip_h2d_for_method_inputs=True,
                           copies={"h2d": 0, "d2h": 2, "d2d": 0})
    x, y = placeholders(gm)
    assert get_device(x) == CUDA0 and get_device(y) == CUDA0
    (sin,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.sin.default]
    (src,) = sin.all_input_nodes
    assert O.is_copy_node(src) and O.COPY_DIRECTION[src.target] == "d2h" and src.args[0] is x
    assert get_device(sin) == CPU


def test_skip_h2d_input_only_read_by_cpu_ops_stays_on_cpu():
    class Both(torch.nn.Module):
        def forward(self, x, y):
            return x + 1, torch.sin(y)

    lp = placed(Both(), OpSupportPartitioner("cuda:0", ops=["aten.add"]), skip_h2d_for_method_inputs=True)
    x, y = placeholders(lp.graph_module)
    assert get_device(x) == CUDA0 and get_device(y) == CPU
    assert count_copies(lp.graph_module) == {"h2d": 0, "d2h": 1, "d2d": 0}


class TwoDevices(torch.nn.Module):
    """x read by an add on cuda:0 and an add on cuda:1 (PerAdd('cuda:0', 'cuda:1'))."""

    def forward(self, x, y, z):
        return x + y, x + z


def test_skip_h2d_input_read_on_two_devices_gets_one_d2d():
    m = TwoDevices()
    lp = placed(m, PerAdd("cuda:0", "cuda:1"), inputs=small(n=3), skip_h2d_for_method_inputs=True)
    gm = lp.graph_module
    x, y, z = placeholders(gm)
    assert (get_device(x), get_device(y), get_device(z)) == (CUDA0, CUDA0, CUDA1)
    assert count_copies(gm) == {"h2d": 0, "d2h": 2, "d2d": 1}
    (d2d,) = copy_nodes(gm, "d2d")
    assert d2d.args[0] is x and get_device(d2d) == CUDA1
    check_matches_eager(lp, m, n_inputs=3)


def test_without_skip_input_on_two_devices_gets_one_h2d_per_device():
    lp = placed(TwoDevices(), PerAdd("cuda:0", "cuda:1"), inputs=small(n=3))
    gm = lp.graph_module
    assert count_copies(gm) == {"h2d": 4, "d2h": 2, "d2d": 0}
    x_copies = [c for c in copy_nodes(gm, "h2d") if c.args[0].name == "x"]
    assert sorted(str(get_device(c)) for c in x_copies) == ["cuda:0", "cuda:1"]


def test_buffer_updated_on_the_device_lives_there():
    """State that only one device reads and updates (a KV cache) never crosses the host link,
    with or without the skip flags (skip_h2d concerns user inputs only)."""
    for skip in (False, True):
        lp = placed(RunningSum(), OpSupportPartitioner("cuda:0"), inputs=small(n=1), skip_h2d_for_method_inputs=skip,
                    skip_d2h_for_method_outputs=skip)
        gm = lp.graph_module
        buf = [p for p in placeholders(gm) if M.input_info(p).kind == M.BUFFER]
        user = [p for p in placeholders(gm) if M.input_info(p).kind == M.USER_INPUT]
        assert len(buf) == 1 and len(user) == 1
        assert get_device(buf[0]) == CUDA0 and get_device(user[0]) == (CUDA0 if skip else CPU)
        assert all(c.args[0] is not buf[0] for c in copy_nodes(gm))  # no copy of the buffer either way
        infos = M.output_infos(gm.graph.output_node())
        for info, o in zip(infos, outputs(gm)):
            if info.kind == M.BUFFER_MUTATION:
                assert get_device(o) == CUDA0 and not O.is_copy_node(o)
        assert PropagateDevicePass(skip, skip)(gm).modified is False
        m = RunningSum()
        for seed in (1, 2):
            (x,) = fresh_inputs(small(n=1), seed)
            torch.testing.assert_close(lp(x), m(x))


class CounterReadOnCpu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(2, 3))

    def forward(self, x):
        before = torch.relu(self.total)  # the CPU reads the buffer itself
        self.total.add_(x)
        return self.total * 2, before


def test_buffer_read_on_the_cpu_stays_on_the_cpu():
    lp = placed(CounterReadOnCpu(), OpSupportPartitioner("cuda:0", exclude=["aten.relu"]), inputs=small(n=1))
    gm = lp.graph_module
    (buf,) = [p for p in placeholders(gm) if M.input_info(p).kind == M.BUFFER]
    assert get_device(buf) == CPU
    infos = M.output_infos(gm.graph.output_node())
    for info, o in zip(infos, outputs(gm)):
        if info.kind == M.BUFFER_MUTATION:
            assert get_device(o) == CPU
    m = CounterReadOnCpu()
    for seed in (1, 2):
        (x,) = fresh_inputs(small(n=1), seed)
        for got, want in zip(lp(x), m(x)):
            torch.testing.assert_close(got, want)


def test_skip_h2d_parameters_absorbed_not_placed():
    from models import WithParams

    m = WithParams()
    lp = placed(m, OpSupportPartitioner("cuda:0"), inputs=(torch.randn(3, 8),), skip_h2d_for_method_inputs=True)
    gm = lp.graph_module
    assert [M.input_info(p).kind for p in placeholders(gm)] == [M.USER_INPUT]
    assert count_copies(gm) == {"h2d": 0, "d2h": 1, "d2d": 0}
    x = torch.randn(6, 8)
    torch.testing.assert_close(lp(x), m(x))


def test_skip_d2h_output_also_read_on_cpu():
    gm = placed_like_eager(SharedOutput(), PerAdd("cuda:0"), skip_d2h_for_method_outputs=True,
                           copies={"h2d": 2, "d2h": 1, "d2d": 0})  # one for relu only
    a, b, c = outputs(gm)
    assert get_device(a) == CUDA0 and get_device(b) == CUDA0 and get_device(c) == CPU


# ---------------------------------------------------------------------------------------------
# place() end to end


def test_place_runs_eagerly_like_the_model():
    for model, part in [
        (FanOut(), PerAdd("cuda:0", "cuda:1")),
        (SharedOutput(), PerAdd("cuda:1", "cuda:0")),
        (InputToCpuAndDelegate(), OpSupportPartitioner("cuda:0")),
    ]:
        lp = ferry.place(export(model, small()), part)
        check_matches_eager(lp, model, seed=5)
        check_matches_eager(lp, model, seed=6)
