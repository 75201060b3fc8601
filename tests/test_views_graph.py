"""The graph the page draws, as data: nodes per input, instruction and output, copies with
their direction and bytes, edges from the last writer of a value to its readers."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry import OpSupportPartitioner, Partition, target_device
from ferry.device import CPU, Device
from ferry.examples import transformer_block
from ferry.program import Buffer, Delegate, DelegateCall, KernelCall, Method, MutableBuffer, PlanEntry, Program, TensorValue
from ferry.program.report import copy_report
from ferry.views.graph import build_graph

CUDA0, CUDA1 = Device("cuda", 0), Device("cuda", 1)


def chain() -> Program:
    """Hand-built: x (cpu) -h2d-> delegate on cuda:0 -d2d-> relu on cuda:1 -d2h-> output (cpu).
    Three planned buffers, one per device, each value 16 bytes. The host ends of copies to two
    devices live through the whole call (program/lifetimes.py): x and back are live together."""

    def t(name, device, buffer, offset):
        return TensorValue("float32", (4,), device, PlanEntry(buffer, offset), name=name)

    values = [t("x", CPU, 1, 0), t("x_d", CUDA0, 2, 0), t("y_d", CUDA0, 2, 64), t("y_1", CUDA1, 3, 0),
              t("z_1", CUDA1, 3, 64), t("back", CPU, 1, 64)]
    instructions = [
        KernelCall("et_copy::_h2d_copy.out", (0, 1), (1,)),
        DelegateCall(0, (1,), (2,)),
        KernelCall("et_copy::_d2d_copy.out", (2, 3), (3,)),
        KernelCall("aten::relu.out", (3, 4), (4,)),
        KernelCall("et_copy::_d2h_copy.out", (4, 5), (5,)),
    ]
    method = Method("forward", values, instructions, inputs=[0], outputs=[5],
                    buffers=[Buffer(0, CPU), Buffer(192, CPU), Buffer(128, CUDA0), Buffer(128, CUDA1)],
                    lower_bounds={"cpu:0": 32, "cuda:0": 32, "cuda:1": 32})
    # a backend this process does not have: its payload is never read
    return Program({"forward": method}, [Delegate("vendor", (("target_device", b"cuda:0"),), 0)], [b"\x00"])


class _TwoDevices:
    def partition(self, ep):
        names = [n.name for n in ep.graph.nodes if n.op == "call_function"]
        h = len(names) // 2
        return [Partition(names[:h], target_device("cuda:0")), Partition(names[h:], target_device("cuda:1"))]


@pytest.fixture(scope="module")
def compiled():
    model, inputs = transformer_block()
    ep = torch.export.export(model, tuple(inputs))
    return [ferry.compile(ep, OpSupportPartitioner("cuda:0", exclude=["aten.softmax"])), ferry.compile(ep, _TwoDevices())]


def test_nodes_in_program_order_with_their_kind_device_and_label():
    g = build_graph(chain(), chain().method("forward"))
    assert [nd.key for nd in g.nodes] == ["in0", "i0", "i1", "i2", "i3", "i4", "out0"]
    assert [nd.row for nd in g.nodes] == list(range(7))
    assert [nd.kind for nd in g.nodes] == ["input", "copy", "delegate", "copy", "instr", "copy", "output"]
    assert [nd.label for nd in g.nodes] == ["input 0: x", "h2d copy", "delegate 0 (vendor)", "d2d copy", "relu.out",
                                            "d2h copy", "output 0"]
    assert [str(nd.device) for nd in g.nodes] == ["cpu:0", "cuda:0", "cuda:0", "cuda:1", "cuda:1", "cpu:0", "cpu:0"]
    assert [nd.index for nd in g.nodes] == [None, 0, 1, 2, 3, 4, None]
    assert g.nodes[2].title.startswith("#1 delegate 0: backend 'vendor' on cuda:0\ncompile specs: target_device=cuda:0")
    assert g.nodes[4].info == "%z_1  float32[4]  b3+64"


def test_every_copy_node_has_the_direction_and_bytes_of_the_copy_report(compiled):
    for program in [chain(), *compiled]:
        m = program.method("forward")
        g = build_graph(program, m)
        copies = {nd.index: nd for nd in g.nodes if nd.kind == "copy"}
        rows = copy_report(program, "forward").rows
        assert sorted(copies) == [r.instruction for r in rows] and rows
        for r in rows:
            nd = copies[r.instruction]
            assert (str(nd.src_device), str(nd.device)) == (r.src, r.dst)
            assert nd.label == f"{r.direction} copy" and nd.nbytes == r.nbytes
        assert [(nd.src_device, nd.device) for nd in copies.values()] == g.copies()
        assert all(nd.src_device is None and nd.nbytes == 0 for nd in g.nodes if nd.kind != "copy")
    directions = {r.direction for p in compiled for r in copy_report(p, "forward").rows}
    assert directions == {"h2d", "d2h", "d2d"}


def test_edges_run_from_the_last_writer_to_each_reader():
    g = build_graph(chain(), chain().method("forward"))
    assert [(g.nodes[e.src].key, g.nodes[e.dst].key, e.values) for e in g.edges] == [
        ("in0", "i0", [0]), ("i0", "i1", [1]), ("i1", "i2", [2]), ("i2", "i3", [3]), ("i3", "i4", [4]),
        ("i4", "out0", [5]),
    ]
    assert g.devices() == {CPU, CUDA0, CUDA1}


def test_a_value_read_twice_is_one_edge_and_a_rewritten_value_links_to_its_last_writer():
    a = TensorValue("float32", (2,), CPU, PlanEntry(1, 0), name="a")
    b = TensorValue("float32", (2,), CPU, PlanEntry(1, 64), name="b")
    m = Method("f", [a, b], [KernelCall("aten::add.out", (0, 0, 1), (1,)), KernelCall("aten::mul.out", (1, 1, 1), (1,))],
               inputs=[0], outputs=[1], buffers=[Buffer(0), Buffer(128)])
    g = build_graph(Program({"f": m}, [], []), m)
    assert [(g.nodes[e.src].key, g.nodes[e.dst].key, e.values) for e in g.edges] == [
        ("in0", "i0", [0]), ("i0", "i1", [1]), ("i1", "out0", [1]),
    ]


def test_mutable_buffers_are_a_state_node_and_an_update_node():
    s = TensorValue("float32", (2,), CPU, PlanEntry(1, 0), name="count")
    s2 = TensorValue("float32", (2,), CPU, PlanEntry(1, 64), name="count2")
    m = Method("f", [s, s2], [KernelCall("aten::add.out", (0, 0, 1), (1,))], inputs=[], outputs=[],
               buffers=[Buffer(0), Buffer(128)], mutable_buffers=[MutableBuffer(0, 1, "count")])
    g = build_graph(Program({"f": m}, [], []), m)
    assert [(nd.key, nd.kind, nd.label) for nd in g.nodes] == [
        ("st0", "state", "buffer count"), ("i0", "instr", "add.out"), ("up0", "update", "update count"),
    ]
    assert g.nodes[0].title.startswith("mutable buffer 'count', kept between calls\n%count float32[2] on cpu:0")
    assert [(e.src, e.dst) for e in g.edges] == [(0, 1), (1, 2)]
