"""The text view `ferry inspect` prints, and its JSON."""

from __future__ import annotations

import json
import math

import ferry.inspect
import ferry.views
from ferry.device import CPU
from ferry.program import Buffer, ConstValue, KernelCall, Method, PlanEntry, Program, TensorValue
from ferry.views import fmt_bytes, program_json, program_summary
from test_views_graph import chain


def test_the_listing_shows_each_instruction_with_its_values_places():
    text = program_summary(chain())
    assert text.startswith("method 'forward': 5 instructions, 6 values\n  input 0: float32[4] on cpu:0 (planned)\n")
    lines = text.splitlines()
    start = lines.index("  instructions:")
    assert lines[start + 1:start + 6] == [
        "    #0    et_copy::_h2d_copy.out(%x@cpu:0[b1+0]) -> %x_d@cuda:0[b2+0]",  # the out argument is not repeated
        "    #1    delegate 0 (vendor on cuda:0)(%x_d@cuda:0[b2+0]) -> %y_d@cuda:0[b2+64]",
        "    #2    et_copy::_d2d_copy.out(%y_d@cuda:0[b2+64]) -> %y_1@cuda:1[b3+0]",
        "    #3    aten::relu.out(%y_1@cuda:1[b3+0]) -> %z_1@cuda:1[b3+64]",
        "    #4    et_copy::_d2h_copy.out(%z_1@cuda:1[b3+64]) -> %back@cpu:0[b1+64]",
    ]
    assert "  instructions:" not in program_summary(chain(), instructions=False)


def test_the_memory_plan_and_devices():
    program = chain()
    program.method("forward").buffers[1] = Buffer(3 * 2**20 + 512, CPU)
    lines = program_summary(program).splitlines()
    assert f"    buffer 1: {fmt_bytes(3 * 2**20 + 512):>10} on cpu:0" in lines  # the one byte formatter
    assert "    buffer 1:    3.0 MiB on cpu:0" in lines
    assert "    cuda:1: planned 128 B, lower bound (peak live) 32 B" in lines
    per_device = lines[lines.index(next(x for x in lines if x.startswith("  per device:"))) + 1:][:3]
    assert [x.split() for x in per_device] == [
        ["cpu:0", "0", f"{3 * 2**20 + 512:,}", f"{3 * 2**20 + 512:,}", "-"],
        ["cuda:0", "0", "128", "128", "-"], ["cuda:1", "0", "128", "128", "-"]]
    assert lines[-1] == "delegates: 1, segments: 1 (1 B)"
    copies = [x.split()[:2] for x in lines if x.startswith("    #") and " -> " in x and "B  " in x]
    assert copies == [["#0", "h2d"], ["#2", "d2d"], ["#4", "d2h"]]


def test_one_method_of_several():
    m = chain().method("forward")
    other = Method("other", [TensorValue("float32", (2,), CPU, PlanEntry(1, 0))], [], inputs=[0], outputs=[0],
                   buffers=[Buffer(0), Buffer(64)])
    program = Program({"forward": m, "other": other}, chain().delegates, chain().segments)
    both = program_summary(program)
    assert "method 'forward'" in both and "method 'other'" in both
    only = program_summary(program, method="other")
    assert "method 'forward'" not in only and only.startswith("method 'other': 0 instructions, 1 values")
    assert set(program_json(program, "other")["methods"]) == {"other"}


def test_json_is_strict_and_matches_the_plan():
    values = [TensorValue("float32", (4,), CPU, PlanEntry(1, 0), name="x"), ConstValue("float", -math.inf),
              TensorValue("float32", (4,), CPU, PlanEntry(1, 64), name="y")]
    m = Method("f", values, [KernelCall("aten::clamp_min.out", (0, 1, 2), (2,))], inputs=[0], outputs=[2],
               buffers=[Buffer(0), Buffer(128)])
    data = program_json(Program({"f": m}, [], []))
    text = json.dumps(data, allow_nan=False)  # no inf/nan reaches strict JSON
    assert json.loads(text) == data
    (ins,) = data["methods"]["f"]["instructions"]
    assert ins["args"][1] == {"value": "-inf", "kind": "float"}
    assert ins["outputs"] == [{"value_id": 2, "name": "y", "device": "cpu:0", "dtype": "float32", "shape": [4],
                               "buffer": 1, "offset": 64}]
    assert data["methods"]["f"]["buffers"] == [{"index": 0, "size": 0, "device": "cpu:0"},
                                               {"index": 1, "size": 128, "device": "cpu:0"}]


def test_json_copies_and_devices():
    data = program_json(chain())["methods"]["forward"]
    assert [(c["instruction"], c["direction"], c["nbytes"]) for c in data["copies"]] == [(0, "h2d", 16), (2, "d2d", 16),
                                                                                         (4, "d2h", 16)]
    assert data["copy_totals"] == {d: {"count": 1, "bytes": 16} for d in ("h2d", "d2h", "d2d")}
    assert {d: r["planned"] for d, r in data["devices"].items()} == {"cpu:0": 192, "cuda:0": 128, "cuda:1": 128}


def test_the_old_module_name_is_the_same_functions():
    for name in ferry.inspect.__all__:
        assert getattr(ferry.inspect, name) is getattr(ferry.views, name)
