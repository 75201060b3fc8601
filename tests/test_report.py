"""The copy report, and the two real-ish models end to end (placed graph vs eager, report structure)."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry import CompileConfig, CopyReport, OpSupportPartitioner, PropagateDeviceConfig
from ferry.node_meta import get_device
from ferry.program.report import CopyRow
from ferry.program.schema import KernelCall
from models import (
    Add,
    AddChain,
    PerAdd,
    count_copies,
    delegate_nodes,
    export,
    fresh_inputs,
    small,
    small_cnn,
    transformer_block,
)


def test_rows_of_a_single_add():
    program = ferry.compile(export(Add(), small(shape=(3, 5))), OpSupportPartitioner("cuda:0"))
    r = ferry.copy_report(program, "forward")
    assert isinstance(r, CopyReport) and r.method == "forward"
    assert [row.direction for row in r.rows] == ["h2d", "h2d", "d2h"]
    for row in r.rows:
        assert isinstance(row, CopyRow)
        assert row.shape == (3, 5)
        assert row.dtype == "float32"
        assert row.nbytes == 3 * 5 * 4
    h1, h2, d = r.rows
    assert (h1.src, h1.dst) == ("cpu:0", "cuda:0")
    assert (d.src, d.dst) == ("cuda:0", "cpu:0")
    assert {h1.value, h2.value} == {"x", "y"}
    assert h1.instruction < h2.instruction < d.instruction
    # the instruction index points at the copy kernel
    m = program.method("forward")
    for row in r.rows:
        ins = m.instructions[row.instruction]
        assert isinstance(ins, KernelCall) and f"_{row.direction}_copy" in ins.kernel


def test_totals_and_count():
    program = ferry.compile(export(AddChain(), small(shape=(4,))), PerAdd("cuda:0", "cuda:1"))
    r = ferry.copy_report(program, "forward")
    assert r.totals() == {"h2d": (3, 48), "d2h": (1, 16), "d2d": (1, 16)}
    assert r.count() == 5 and r.count("h2d") == 3 and r.count("d2d") == 1
    (d2d,) = [row for row in r.rows if row.direction == "d2d"]
    assert (d2d.src, d2d.dst) == ("cuda:0", "cuda:1")


def test_bytes_follow_dtype():
    x = (torch.randn(2, 8, dtype=torch.float16), torch.randn(2, 8, dtype=torch.float16))
    r = ferry.copy_report(ferry.compile(export(Add(), x), OpSupportPartitioner("cuda:0")), "forward")
    assert {row.dtype for row in r.rows} == {"float16"}
    assert r.totals()["h2d"] == (2, 2 * 2 * 8 * 2)


def test_str_prints_a_table():
    program = ferry.compile(export(AddChain(), small(shape=(4,))), PerAdd("cuda:0", "cuda:1"))
    text = str(ferry.copy_report(program, "forward"))
    lines = text.splitlines()
    assert "forward" in lines[0]
    assert len(lines) == 1 + 5 + 1  # title, one line per copy, totals
    assert sum("h2d" in line for line in lines[1:-1]) == 3
    assert any("cuda:0" in line and "cuda:1" in line and "d2d" in line for line in lines[1:-1])
    assert "float32" in text and "[4]" in text
    assert lines[-1].strip().startswith("totals")
    assert "h2d 3" in lines[-1] and "d2h 1" in lines[-1] and "d2d 1" in lines[-1]


def test_no_copies():
    program = ferry.compile(export(Add(), small()), None)
    r = ferry.copy_report(program, "forward")
    assert r.rows == () and r.count() == 0
    assert r.totals() == {"h2d": (0, 0), "d2h": (0, 0), "d2d": (0, 0)}
    assert "(none)" in str(r)


def test_report_for_every_method():
    program = ferry.compile({"a": export(Add(), small()), "b": export(AddChain(), small())},
                            OpSupportPartitioner("cuda:0"),
                            CompileConfig(propagate_device={"b": PropagateDeviceConfig(True, False)}))
    reports = ferry.copy_report(program)
    assert set(reports) == {"a", "b"}
    assert reports["a"].count("h2d") == 2 and reports["b"].count("h2d") == 0
    assert reports["b"].method == "b"


# ---------------------------------------------------------------------------------------------
# real-ish models


def assert_matches_eager(lp, model, example, seeds=(21, 22)):
    for seed in seeds:
        x = fresh_inputs(example, seed)
        with torch.no_grad():
            want = model(*x)
        torch.testing.assert_close(lp(*x), want, atol=1e-5, rtol=1e-5)


def test_cnn_placed_matches_eager():
    model, ex = small_cnn()
    part = OpSupportPartitioner("cuda:0")
    lp = ferry.place(export(model, ex), part)
    assert len(delegate_nodes(lp.graph_module)) == 1
    assert count_copies(lp.graph_module) == {"h2d": 1, "d2h": 1, "d2d": 0}
    assert_matches_eager(lp, model, ex)


def test_cnn_with_relu_on_the_cpu():
    model, ex = small_cnn()
    part = OpSupportPartitioner("cuda:1", exclude=["aten.relu"])
    lp = ferry.place(export(model, ex), part)
    gm = lp.graph_module
    relus = [n for n in gm.graph.nodes if n.target == torch.ops.aten.relu.default]
    assert len(relus) == 2 and all(str(get_device(n)) == "cpu:0" for n in relus)
    assert count_copies(gm) == {"h2d": 3, "d2h": 3, "d2d": 0}
    assert_matches_eager(lp, model, ex)
    r = ferry.copy_report(ferry.compile(export(model, ex), part), "forward")
    assert r.count("h2d") == 3 and r.count("d2h") == 3
    assert r.rows[0].direction == "h2d" and r.rows[0].shape == ex[0].shape
    assert r.rows[-1].direction == "d2h" and r.rows[-1].shape == (2, 5)
    # the copies alternate: in, out (relu), in, out (relu), in, out
    assert [row.direction for row in r.rows] == ["h2d", "d2h"] * 3
    assert all(row.dst == "cuda:1" for row in r.rows if row.direction == "h2d")


@pytest.mark.parametrize("excluded, kernel", [("aten.softmax", "aten::softmax"), ("aten.gelu", "aten::gelu")])
def test_transformer_block_with_one_op_on_the_cpu(excluded, kernel):
    model, ex = transformer_block()
    part = OpSupportPartitioner("cuda:0", exclude=[excluded])
    lp = ferry.place(export(model, ex), part)
    gm = lp.graph_module
    cpu_ops = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith(excluded)]
    assert len(cpu_ops) == 1 and str(get_device(cpu_ops[0])) == "cpu:0"
    assert len(delegate_nodes(gm)) == 2
    assert_matches_eager(lp, model, ex)

    program = ferry.compile(export(model, ex), part)
    r = ferry.copy_report(program, "forward")
    m = program.method("forward")
    (at,) = [i for i, ins in enumerate(m.instructions) if isinstance(ins, KernelCall) and ins.kernel.startswith(kernel)]
    before = [row for row in r.rows if row.instruction < at]
    after = [row for row in r.rows if row.instruction > at]
    assert any(row.direction == "d2h" for row in before)
    assert any(row.direction == "h2d" for row in after)
    # exactly: input in, to the cpu op, back, result out
    assert [row.direction for row in r.rows] == ["h2d", "d2h", "h2d", "d2h"]
    assert r.rows[0].shape == tuple(ex[0].shape) and r.rows[-1].shape == tuple(ex[0].shape)
    assert r.rows[1].shape == r.rows[2].shape  # the cpu op keeps the shape
    assert r.totals()["d2d"] == (0, 0)


def test_transformer_block_with_skip_flags():
    model, ex = transformer_block()
    cfg = CompileConfig(propagate_device=PropagateDeviceConfig(True, True))
    lp = ferry.place(export(model, ex), OpSupportPartitioner("cuda:0", exclude=["aten.gelu"]), cfg)
    assert count_copies(lp.graph_module) == {"h2d": 1, "d2h": 1, "d2d": 0}  # only around the gelu
    assert [str(get_device(p)) for p in lp.user_inputs()] == ["cuda:0"]
    assert_matches_eager(lp, model, ex)


class OnDevices:
    """Wraps a partitioner; the i-th partition runs on devices[i]."""

    def __init__(self, inner, *devices):
        self.inner, self.devices = inner, devices

    def partition(self, ep):
        from ferry import Partition, target_device

        return [Partition(p.nodes, target_device(d), p.backend_id)
                for p, d in zip(self.inner.partition(ep), self.devices, strict=True)]


def test_transformer_block_on_two_devices():
    model, ex = transformer_block()
    part = OnDevices(OpSupportPartitioner("cuda:0", exclude=["aten.softmax"]), "cuda:0", "cuda:1")
    lp = ferry.place(export(model, ex), part)
    counts = count_copies(lp.graph_module)
    # x goes to both devices; v moves cuda:0 -> cuda:1 directly; scores out and back in; result out
    assert counts == {"h2d": 3, "d2h": 2, "d2d": 1}
    assert_matches_eager(lp, model, ex)
    r = ferry.copy_report(ferry.compile(export(model, ex), part), "forward")
    (d2d,) = [row for row in r.rows if row.direction == "d2d"]
    assert (d2d.src, d2d.dst) == ("cuda:0", "cuda:1")
