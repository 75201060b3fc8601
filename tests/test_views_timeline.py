"""The memory timeline: one block per planned value at its planned offset over its lifetime,
the bytes of each device as the plan has them."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import torch

import ferry
from ferry.examples import transformer_block
from ferry.program import Buffer, KernelCall, Method, PlanEntry, TensorValue
from ferry.program.lifetimes import value_lifetimes
from ferry.runtime import emulated_device
from ferry.views.facts import planned_lifetimes
from ferry.views.graph import build_graph
from ferry.views.palette import Palette
from ferry.views.timeline import Block, byte_ticks, memory_section, timeline_blocks, timeline_svg
from test_device_map import TinyLM, ids
from test_views_graph import _TwoDevices, chain


@pytest.fixture(scope="module")
def programs():
    """Programs whose plans have no value written over another in place: the peak of bytes live
    at once is then exactly the planner's lower bound."""
    model, inputs = transformer_block()
    out = [chain(), ferry.compile(torch.export.export(model, tuple(inputs)), _TwoDevices())]
    with emulated_device(num_devices=2):
        out.append(ferry.compile(torch.export.export(TinyLM(layers=4), (ids(0),)), device_map="auto",
                                 max_memory={"emu:0": "10MB", "emu:1": "10MB"}))
    return out


def _svg(program, bi):
    m = program.method("forward")
    g = build_graph(program, m)
    pal = Palette(g.devices() | {b.device for b in m.buffers[1:]})
    instructions = [nd for nd in g.nodes if nd.index is not None]
    return ET.fromstring(timeline_svg(m, bi, planned_lifetimes(m), pal, instructions))


def test_blocks_are_the_planned_values_of_a_buffer_at_their_offsets_and_lifetimes():
    m = chain().method("forward")
    life = planned_lifetimes(m)
    # the input from the start, the output to the end; both host ends of copies to two devices: to the end
    assert timeline_blocks(m, 1, life) == [Block(0, 0, 16, -1, 5), Block(5, 64, 16, 4, 5)]
    assert timeline_blocks(m, 2, life) == [Block(1, 0, 16, 0, 1), Block(2, 64, 16, 1, 2)]
    assert timeline_blocks(m, 3, life) == [Block(3, 0, 16, 2, 3), Block(4, 64, 16, 3, 4)]
    assert timeline_blocks(m, 4, life) == []


def test_blocks_sort_by_offset_then_start():
    values = [TensorValue("float32", (4,), plan=PlanEntry(1, off), name=n) for n, off in (("a", 64), ("b", 0), ("c", 0))]
    m = Method("f", values, [KernelCall("aten::neg.out", (0, 1), (1,)), KernelCall("aten::neg.out", (1, 2), (2,))],
               inputs=[0], outputs=[2], buffers=[Buffer(0), Buffer(128)])
    assert [b.vid for b in timeline_blocks(m, 1, planned_lifetimes(m))] == [1, 2, 0]


def test_the_bytes_of_each_device_are_the_plans(programs):
    for program in programs:
        m = program.method("forward")
        life = planned_lifetimes(m)
        assert life == {v: span for v, span in value_lifetimes(m).items() if m.tensor(v).storage == "planned"}
        peak: dict[str, int] = {}
        for bi, buf in enumerate(m.buffers[1:], start=1):
            blocks = timeline_blocks(m, bi, life)
            assert {b.vid for b in blocks} == {v for v in life if m.tensor(v).plan.buffer == bi}
            assert all(b.offset + b.nbytes <= buf.size for b in blocks)
            live = [sum(b.nbytes for b in blocks if b.start <= i <= b.end) for i in range(-1, len(m.instructions) + 1)]
            peak[str(buf.device)] = peak.get(str(buf.device), 0) + max(live)
        assert peak == m.lower_bounds


def test_the_plot_draws_each_block_at_its_bytes():
    program = chain()
    m = program.method("forward")
    svg = _svg(program, 2)
    assert svg.get("data-buffer") == "2" and svg.get("data-device") == "cuda:0"
    (values,) = [g for g in svg.iter("g") if g.get("class") == "values"]
    y0, scale = float(values.get("data-y0")), float(values.get("data-scale"))
    rects = [r for r in values.iter("rect")]
    assert [(int(r.get("data-vid")), int(r.get("data-offset")), int(r.get("data-nbytes"))) for r in rects] == [
        (1, 0, 16), (2, 64, 16)]
    for r in rects:
        assert float(r.get("y")) == pytest.approx(y0 + int(r.get("data-offset")) * scale)
        assert float(r.get("height")) == pytest.approx(16 * scale)
    (plot,) = [r for r in svg.iter("rect") if r.get("class") == "plot"]
    assert float(plot.get("height")) == pytest.approx(128 * scale)  # the buffer's size is the plot's height
    (lb,) = [line for line in svg.iter("line") if line.get("class") == "lower-bound"]
    assert float(lb.get("y1")) == pytest.approx(y0 + 32 * scale, abs=0.01)
    strip = [r for g in svg.iter("g") if g.get("class") == "strip" for r in g.iter("rect")]
    assert len(strip) == len(m.instructions)
    assert [r.get("fill").startswith("url(#tg2-") for r in strip] == [True, False, True, False, True]  # the copies


def test_no_lower_bound_line_when_the_device_has_two_buffers():
    program = chain()
    assert [line for line in _svg(program, 2).iter("line") if line.get("class") == "lower-bound"]
    m = program.method("forward")
    m.buffers.append(Buffer(64, m.buffers[2].device))
    svg = _svg(program, 2)
    assert not [line for line in svg.iter("line") if line.get("class") == "lower-bound"]


def _long_chain(n: int) -> ferry.Program:
    values = [TensorValue("float32", (4,), plan=PlanEntry(1, 64 * (i % 2)), name=f"v{i}") for i in range(n + 1)]
    instructions = [KernelCall("aten::neg.out", (i, i + 1), (i + 1,)) for i in range(n)]
    m = Method("forward", values, instructions, inputs=[0], outputs=[n], buffers=[Buffer(0), Buffer(128)])
    return ferry.Program({"forward": m}, [], [])


def test_the_instruction_axis_labels_what_fits_and_ends_with_end():
    def labels(n):
        svg = _svg(_long_chain(n), 1)
        ticks = [t for t in svg.iter("text") if t.get("class") == "tick" and t.get("text-anchor") == "middle"]
        xs = [float(t.get("x")) for t in ticks]
        widths = [len(t.text) * 10.5 * 0.58 for t in ticks]
        assert all(xs[k] + widths[k] / 2 + 4 <= xs[k + 1] - widths[k + 1] / 2 + 1e-6 for k in range(len(xs) - 1))
        return [t.text for t in ticks]

    assert labels(5) == ["start", "0", "1", "2", "3", "4", "end"]
    # 153 columns of 7 px: every 5th instruction; 0 sits too close to "start", which came first;
    # 150 too close to "end", which wins
    assert labels(151) == ["start"] + [str(i) for i in range(5, 150, 5)] + ["end"]


def test_byte_ticks():
    assert byte_ticks(0) == [0]
    assert byte_ticks(1000) == [0, 256, 512, 768]
    assert byte_ticks(4096) == [0, 1024, 2048, 3072, 4096]
    for size in (1, 7, 100, 12345, 10**9):
        ticks = byte_ticks(size)
        step = ticks[1] - ticks[0] if len(ticks) > 1 else 1
        assert step & (step - 1) == 0 and ticks[-1] <= size < ticks[-1] + step and len(ticks) <= 7


def test_the_section_has_a_heading_per_buffer_or_says_there_are_none():
    m = chain().method("forward")
    g = build_graph(chain(), m)
    pal = Palette(g.devices())
    parts = memory_section(m, planned_lifetimes(m), pal, [nd for nd in g.nodes if nd.index is not None])
    heads = [p for p in parts if p.startswith('<div class="buffer"')]
    assert len(heads) == 3
    assert "Buffer 3 on cuda:1 \u00b7 128 B (128 B) \u00b7 2 values \u00b7 lower bound on cuda:1: 32 B (32 B), plan is 4.00" in heads[2]
    empty = Method("f", [], [], inputs=[], outputs=[], buffers=[Buffer(0)])
    assert memory_section(empty, {}, pal, []) == ['<p class="none">This method has no planned buffers.</p>']
