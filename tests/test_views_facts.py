"""The facts every view reads once: byte sizes, copy directions, devices, owners, bytes per device."""

from __future__ import annotations

import pytest

from ferry.device import CPU, Device
from ferry.ops import COPY_KERNELS
from ferry.program import Buffer, Delegate, DelegateCall, KernelCall, Method, PlanEntry, Program, TensorValue
from ferry.views.facts import (
    copy_direction,
    device_memory,
    fmt_bytes,
    instruction_device,
    is_copy,
    owner,
    parse_device,
    short_kernel,
)
from test_views_graph import CUDA0, CUDA1, chain


def test_fmt_bytes_units():
    assert [fmt_bytes(n) for n in (0, 1023, 1024, 1536, 2**20 - 1, 2**20, 3 * 2**30, 2**40, 5 * 2**50)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "1024.0 KiB", "1.0 MiB", "3.0 GiB", "1.0 TiB", "5120.0 TiB"]


def test_copy_directions_come_from_the_ops_table():
    for kernel, direction in COPY_KERNELS.items():
        assert copy_direction(kernel) == direction
        assert short_kernel(kernel) == f"{direction} copy"
        assert is_copy(KernelCall(kernel, (0, 1), (1,)))
    # a name in the et_copy namespace that is no copy kernel is not a copy
    for kernel in ("aten::mm.out", "et_copy::_x2y_copy.out"):
        assert copy_direction(kernel) is None and not is_copy(KernelCall(kernel, (0, 1), (1,)))
    assert not is_copy(DelegateCall(0, (0,), (1,)))
    assert short_kernel("aten::mm.default") == "mm" and short_kernel("aten::mm.out") == "mm.out"
    assert short_kernel("my::op.out") == "my::op.out"


@pytest.mark.parametrize("text, expected", [
    ("cuda:1", Device("cuda", 1)),
    ("rank1:cuda:0", Device("cuda", 0, 1)),
    ("npu:3", Device("npu", 3)),  # any type, as files store it
    (" CUDA ", Device("cuda", 0)),  # as a user writes it
    ("cpu", CPU),
    ("cuda:x", Device("emu", 7)),  # neither: the fallback
    ("", Device("emu", 7)),
])
def test_parse_device(text, expected):
    assert parse_device(text, Device("emu", 7)) == expected


def _with_delegate(delegates, outputs=(1,)) -> tuple[Program, Method]:
    values = [TensorValue("float32", (4,), CPU, PlanEntry(1, 0)), TensorValue("float32", (4,), CUDA1, PlanEntry(2, 0))]
    m = Method("f", values, [DelegateCall(0, (0,), outputs)], inputs=[0], outputs=[1],
               buffers=[Buffer(0), Buffer(64), Buffer(64, CUDA1)])
    return Program({"f": m}, delegates, [b""]), m


def test_instruction_device():
    program = chain()
    m = program.method("forward")
    assert [str(instruction_device(program, m, ins)) for ins in m.instructions] == [
        "cuda:0", "cuda:0", "cuda:1", "cuda:1", "cpu:0"]
    spec = lambda text: [Delegate("torch", (("target_device", text),), 0)]  # noqa: E731
    assert instruction_device(*_with_delegate(spec(b"cuda:0")), DelegateCall(0, (0,), (1,))) == CUDA0
    assert instruction_device(*_with_delegate([Delegate("torch", (), 0)]), DelegateCall(0, (0,), (1,))) == CPU  # no spec
    assert instruction_device(*_with_delegate([]), DelegateCall(0, (0,), (1,))) == CUDA1  # no delegate: its output's
    assert instruction_device(*_with_delegate(spec(b"??")), DelegateCall(0, (0,), (1,))) == CUDA1  # unreadable spec
    assert instruction_device(*_with_delegate([]), DelegateCall(0, (0,), ())) == CPU
    scalar_out = KernelCall("aten::sum.out", (0,), ())  # writes no tensor: where it reads
    assert instruction_device(program, m, scalar_out) == CPU


def test_owner():
    values = [TensorValue("float32", (4,), CPU, PlanEntry(1, 0)), TensorValue("float32", (4,), storage="input"),
              TensorValue("float32", (4,), storage="view", alias_of=1)]
    m = Method("f", values, [], inputs=[1], outputs=[], buffers=[Buffer(0), Buffer(16)])
    assert [owner(m, v) for v in range(3)] == ["planned", "caller-owned", "view, caller-owned"]


def test_device_memory_counts_the_planned_buffers_of_each_device():
    program = chain()
    m = program.method("forward")
    m.max_memory = {"cuda:1": 1000}
    rows = device_memory(program, m)
    assert {d: r["planned"] for d, r in rows.items()} == {"cpu:0": 192, "cuda:0": 128, "cuda:1": 128}
    assert all(r["total"] == r["planned"] + r["weights"] and r["weights"] >= 0 for r in rows.values())
    assert [r["budget"] for r in rows.values()] == [None, None, 1000]
