"""The HTML page of a method: graph by device, copies with their bytes, memory timelines, summary."""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

import ferry
from ferry import OpSupportPartitioner, Partition, target_device
from ferry.aot.compile import device_bytes
from ferry.device import CPU, Device
from ferry.examples import TransformerBlock, transformer_block
from ferry.program import (
    DEFAULT_ARG,
    Buffer,
    ConstValue,
    Delegate,
    DelegateCall,
    KernelCall,
    Method,
    PlanEntry,
    Program,
    TensorValue,
)
from ferry.program.dataflow import written_over
from ferry.program.lifetimes import value_lifetimes
from ferry.program.report import copy_report
from ferry.views import fmt_bytes, render_html, write_html
from test_device_map import TinyLM, ids

CUDA0 = Device("cuda", 0)


# ---------------------------------------------------------------- programs


def _export(model, inputs):
    return torch.export.export(model, tuple(inputs))


@pytest.fixture(scope="module")
def block():
    """The README example: a transformer block on cuda:0 with softmax kept on the CPU."""
    model, inputs = transformer_block()
    return ferry.compile(_export(model, inputs), OpSupportPartitioner("cuda:0", exclude=["aten.softmax"]))


class _Stack(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture(scope="module")
def stack_inputs():
    torch.manual_seed(0)
    return _Stack(2).eval(), (torch.randn(2, 16, 64),)


@pytest.fixture(scope="module")
def busy(stack_inputs):
    """Many host/device round trips: every norm, add, gelu and softmax stays on the CPU."""
    model, inputs = stack_inputs
    ex = ["aten.softmax", "aten.gelu", "aten.layer_norm", "aten.add"]
    return ferry.compile(_export(model, inputs), OpSupportPartitioner("cuda:0", exclude=ex))


@pytest.fixture(scope="module")
def big(stack_inputs):
    """About a hundred CPU instructions (views, matmuls, norms), no partitioner."""
    model, inputs = stack_inputs
    return ferry.compile(_export(model, inputs))


class _TwoDevices:
    """First half of the ops on cuda:0, second half on cuda:1."""

    def partition(self, ep):
        names = [n.name for n in ep.graph.nodes if n.op == "call_function"]
        h = len(names) // 2
        return [Partition(names[:h], target_device("cuda:0")), Partition(names[h:], target_device("cuda:1"))]


WEIRD = "<zz>&\"x'</zz>"


def _weird_program() -> Program:
    """Hand-built: names full of markup, a tensor-list argument, a default argument, two devices."""
    cpu_a = TensorValue("float32", (4,), CPU, PlanEntry(1, 0), name=f"in{WEIRD}")
    dev_a = TensorValue("float32", (4,), CUDA0, PlanEntry(2, 0), name="</svg><script>alert(1)</script>")
    dev_b = TensorValue("float32", (4,), CUDA0, PlanEntry(2, 256), name="y]]>&amp;")
    cpu_b = TensorValue("float32", (4,), CPU, PlanEntry(1, 64), name="back<")
    out = TensorValue("float32", (8,), CPU, PlanEntry(1, 128), name="out&")
    values = [
        cpu_a, dev_a, dev_b, cpu_b,
        ConstValue("tensors", [3, 0]),  # 4: a tensor list: follow it
        ConstValue("int", 0),  # 5: a scalar: ignore it
        out,  # 6
    ]
    instructions = [
        KernelCall("et_copy::_h2d_copy.out", (0, 1), (1,)),
        DelegateCall(0, (1,), (2,)),
        KernelCall("et_copy::_d2h_copy.out", (2, 3), (3,)),
        KernelCall(f"my{WEIRD}::cat.out", (4, 5, DEFAULT_ARG, 6), (6,)),
    ]
    method = Method(
        name=f"m{WEIRD}", values=values, instructions=instructions, inputs=[0], outputs=[6],
        buffers=[Buffer(0, CPU), Buffer(192, CPU), Buffer(512, CUDA0)], lower_bounds={"cpu:0": 64, "cuda:0": 32},
    )
    delegate = Delegate(f"be{WEIRD}", (("target_device", b"cuda:0"), (f"k{WEIRD}", WEIRD.encode())), 0)
    return Program({method.name: method}, [delegate], [b"\x00"])


# ---------------------------------------------------------------- parsing helpers


def _parse(text: str) -> ET.Element:
    assert text.startswith("<!DOCTYPE html>\n")
    return ET.fromstring(text.removeprefix("<!DOCTYPE html>\n"))


def _classes(el) -> list[str]:
    return (el.get("class") or "").split()


def _all(root, tag=None, cls=None, **attrs):
    out = []
    for el in root.iter(tag):
        if cls is not None and cls not in _classes(el):
            continue
        if all(el.get(k.replace("_", "-")) == v for k, v in attrs.items()):
            out.append(el)
    return out


def _section(root, sid: str):
    (sec,) = _all(root, "section", id=sid)
    return sec


def _text(el) -> str:
    """Own text of an element, without the <title> tooltip children."""
    return (el.text or "").strip()


def _nodes(root):
    return {el.get("data-key"): el for el in _all(_section(root, "graph"), "g", cls="node")}


# ---------------------------------------------------------------- the page


def test_page_is_well_formed_and_self_contained(block):
    text = render_html(block)
    root = _parse(text)
    assert root.tag == "html"
    assert len(list(_section(root, "graph").iter("svg"))) == 1
    m = block.method("forward")
    timelines = list(_section(root, "memory").iter("svg"))
    assert len(timelines) == len(m.buffers) - 1 == 2
    assert [t.get("data-buffer") for t in timelines] == ["1", "2"]
    _section(root, "summary")
    # offline: no scripts, no links, nothing fetched
    for bad in ("<script", "<link", "http://", "https://", "@import", " src=", " href="):
        assert bad not in text
    assert list(root.iter("style"))


def test_every_instruction_is_a_node_with_a_short_name(block):
    root = _parse(render_html(block))
    nodes = _nodes(root)
    m = block.method("forward")
    expected = ["h2d copy", "delegate 0 (torch)", "d2h copy", "softmax.int_out", "h2d copy", "delegate 1 (torch)", "d2h copy"]
    assert len(m.instructions) == len(expected)
    for i, label in enumerate(expected):
        (node,) = _all(_section(root, "graph"), "g", cls="node", data_instruction=str(i))
        assert _text(node.find("text")) == label
        assert node.find("title").text.startswith(f"#{i} ")
    assert {"in0", "out0"} <= set(nodes)
    assert [v.get("data-instruction") for v in nodes.values() if v.get("data-instruction")] == [str(i) for i in range(7)]
    kinds = {k: _classes(v)[1] for k, v in nodes.items()}
    assert kinds["i0"] == "copy" and kinds["i1"] == "delegate" and kinds["i3"] == "instr"
    assert kinds["in0"] == "input" and kinds["out0"] == "output"


def test_edges_follow_definitions_to_reads(block):
    root = _parse(render_html(block))
    graph = _section(root, "graph")
    edges = {(p.get("data-from"), p.get("data-to")) for p in graph.iter("path") if p.get("data-from")}
    assert edges == {
        ("in0", "i0"), ("i0", "i1"), ("i1", "i2"), ("i2", "i3"), ("i3", "i4"),
        ("i1", "i5"), ("i4", "i5"), ("i0", "i5"), ("i5", "i6"), ("i6", "out0"),
    }
    # edges leaving a copy are drawn as copy edges, the others as plain edges
    for p in graph.iter("path"):
        if p.get("data-from"):
            expect = "copy-edge" if p.get("data-from") in ("i0", "i2", "i4", "i6") else "edge"
            assert expect in _classes(p)


def test_device_colors(block):
    root = _parse(render_html(block))
    nodes = _nodes(root)
    fill = {k: v.find("rect").get("fill") for k, v in nodes.items()}
    assert nodes["i1"].get("data-device") == nodes["i5"].get("data-device") == "cuda:0"
    assert nodes["i3"].get("data-device") == "cpu:0"
    assert fill["i1"] == fill["i5"]
    assert fill["i1"] != fill["i3"]
    # copies look different from both: a gradient from source to destination color
    assert fill["i0"].startswith("url(#") and fill["i2"].startswith("url(#") and fill["i0"] != fill["i2"]
    legend = ET.tostring(_all(_section(root, "graph"), "div", cls="legend")[0], encoding="unicode")
    assert "cpu:0" in legend and "cuda:0" in legend and "copy cpu:0 \u2192 cuda:0" in legend


def test_two_devices_get_two_colors():
    model, inputs = transformer_block()
    program = ferry.compile(_export(model, inputs), _TwoDevices())
    root = _parse(render_html(program))
    nodes = _nodes(root)
    fills = {}
    for node in nodes.values():
        if "delegate" in _classes(node):
            fills.setdefault(node.get("data-device"), set()).add(node.find("rect").get("fill"))
        if "instr" in _classes(node) and node.get("data-device") == "cpu:0":
            fills.setdefault("cpu:0", set()).add(node.find("rect").get("fill"))
    assert set(fills) >= {"cuda:0", "cuda:1"}
    assert all(len(f) == 1 for f in fills.values())
    assert len({next(iter(f)) for f in fills.values()}) == len(fills)
    rep = copy_report(program, "forward")
    assert "d2d" in {r.direction for r in rep.rows}
    _check_copy_labels(root, rep)


def _check_copy_labels(root, rep):
    groups = _all(_section(root, "graph"), "g", cls="copy-out")
    assert len(groups) == len(rep.rows) > 0
    for row in rep.rows:
        (g,) = _all(_section(root, "graph"), "g", cls="copy-out", data_instruction=str(row.instruction))
        assert g.get("data-bytes") == str(row.nbytes)
        (label,) = _all(g, "text", cls="edge-label")
        assert _text(label) == fmt_bytes(row.nbytes)
        assert _all(g, "path", cls="copy-edge"), "a copy's outgoing edge is drawn"


def test_copy_edges_carry_the_bytes_of_the_copy_report(block, busy):
    for program in (block, busy):
        rep = copy_report(program, "forward")
        _check_copy_labels(_parse(render_html(program)), rep)
    labels = [_text(t) for t in _all(_parse(render_html(block)), "text", cls="edge-label")]
    assert labels == ["8.0 KiB"] * 4


def test_fmt_bytes():
    assert fmt_bytes(0) == "0 B"
    assert fmt_bytes(80) == "80 B"
    assert fmt_bytes(1023) == "1023 B"
    assert fmt_bytes(8192) == "8.0 KiB"
    assert fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(3 * 1024 * 1024) == "3.0 MiB"


def _timeline_blocks(root):
    out = {}
    for svg in _section(root, "memory").iter("svg"):
        (values,) = _all(svg, "g", cls="values")
        (plot,) = _all(svg, "rect", cls="plot")
        out[int(svg.get("data-buffer"))] = (values, plot, _all(values, "rect", cls="value"))
    return out


def _planned(m, buffer):
    return {vid for vid, v in enumerate(m.values) if isinstance(v, TensorValue) and v.plan and v.plan.buffer == buffer}


@pytest.mark.parametrize("which", ["block", "busy", "big"])
def test_timeline_has_one_block_per_planned_value_at_scale(which, request):
    program = request.getfixturevalue(which)
    m = program.method("forward")
    root = _parse(render_html(program))
    blocks = _timeline_blocks(root)
    assert set(blocks) == set(range(1, len(m.buffers)))
    for bi, (values, plot, rects) in blocks.items():
        vids = [int(r.get("data-vid")) for r in rects]
        assert len(vids) == len(set(vids))
        assert set(vids) == _planned(m, bi)
        y0, scale = float(values.get("data-y0")), float(values.get("data-scale"))
        assert float(plot.get("y")) == pytest.approx(y0)
        assert float(plot.get("height")) == pytest.approx(m.buffers[bi].size * scale)  # buffer size = plot height
        spans = []
        for r, vid in zip(rects, vids):
            v = m.values[vid]
            assert int(r.get("data-offset")) == v.plan.offset and int(r.get("data-nbytes")) == v.nbytes
            assert float(r.get("y")) - y0 == pytest.approx(v.plan.offset * scale, abs=1e-6)
            assert float(r.get("height")) == pytest.approx(v.nbytes * scale, abs=1e-6)
            tip = r.find("title").text
            assert v.name in tip and v.dtype in tip and f"{v.nbytes:,} B" in tip
            spans.append((int(r.get("data-start")), int(r.get("data-end")), v.plan.offset, v.plan.offset + v.nbytes))
        # the lifetimes are the planner's: blocks that share time never share bytes, but for a
        # result planned over the input that dies where it is made (in place)
        life = value_lifetimes(m)
        for k, ((s1, e1, a1, b1), v1) in enumerate(zip(spans, vids)):
            for (s2, e2, a2, b2), v2 in zip(spans[k + 1:], vids[k + 1:]):
                if s1 <= e2 and s2 <= e1 and a1 < b1 and a2 < b2 and not written_over(m, life, v1, v2):
                    assert b1 <= a2 or b2 <= a1


def test_timeline_lifetimes_and_lower_bound(block):
    m = block.method("forward")
    root = _parse(render_html(block))
    blocks = _timeline_blocks(root)
    life = {}
    for _, (_, _, rects) in blocks.items():
        for r in rects:
            life[m.values[int(r.get("data-vid"))].name] = (int(r.get("data-start")), int(r.get("data-end")))
    n = len(m.instructions)
    assert life["x"] == (-1, 0)  # method input: alive from the start, last read by #0
    assert life["_d2h_copy_default_1"] == (6, n)  # method output: alive to the end
    assert life["_h2d_copy_default"] == (0, 5)  # read by delegate 0 and delegate 1
    assert life["softmax"] == (3, 4)
    for bi, (values, _, _) in blocks.items():
        svg = next(s for s in _section(root, "memory").iter("svg") if s.get("data-buffer") == str(bi))
        dev = str(m.buffers[bi].device)
        (line,) = _all(svg, "line", cls="lower-bound")
        y = float(values.get("data-y0")) + m.lower_bounds[dev] * float(values.get("data-scale"))
        assert float(line.get("y1")) == pytest.approx(y, abs=0.01)
    headings = [ET.tostring(h, encoding="unicode", method="text") for h in _section(root, "memory").iter("h3")]
    assert headings[0].startswith("Buffer 1 on cpu:0 \u00b7 16.0 KiB")
    # the cuda:0 arena holds the delegates' working memory too, one plan for the device
    assert f"lower bound on cuda:0: {m.lower_bounds['cuda:0'] / 1024:.1f} KiB" in headings[1]
    assert "7 values" in headings[1] and "plan is 1.00\u00d7 the bound" in headings[1]


def test_summary_tables(busy):
    m = busy.method("forward")
    root = _parse(render_html(busy))
    summary = _section(root, "summary")
    rep = copy_report(busy, "forward")
    copy_rows = [r for r in summary.iter("tr") if r.get("data-instruction") is not None]
    assert [int(r.get("data-instruction")) for r in copy_rows] == [row.instruction for row in rep.rows]
    assert [int(r.get("data-bytes")) for r in copy_rows] == [row.nbytes for row in rep.rows]
    totals = {r.get("data-direction"): (int(r.get("data-count")), int(r.get("data-bytes")))
              for r in summary.iter("tr") if r.get("data-direction")}
    assert totals == rep.totals()
    buffers = [r for r in summary.iter("tr") if r.get("data-buffer")]
    assert [(int(r.get("data-buffer")), r.get("data-device"), int(r.get("data-size"))) for r in buffers] == [
        (bi, str(b.device), b.size) for bi, b in enumerate(m.buffers) if bi
    ]


def test_special_characters_are_escaped():
    program = _weird_program()
    text = render_html(program)
    assert "<script>" not in text and "<zz>" not in text and "]]>&amp;" not in text
    root = _parse(text)  # well formed despite the names
    h1 = ET.tostring(next(root.iter("h1")), encoding="unicode", method="text")
    assert f"m{WEIRD}" in h1
    nodes = _nodes(root)
    assert _text(nodes["i3"].find("text")).startswith("my<zz>")  # unescaped by the parser, so it was escaped once
    tips = "\n".join(t.text or "" for t in root.iter("title"))
    assert "%</svg><script>alert(1)</script>" in tips and f"be{WEIRD}" in tips
    # the tensor list [3, 0] is followed (3 from the d2h copy, 0 the input); the scalar and the default are not
    edges = {(p.get("data-from"), p.get("data-to")) for p in root.iter("path") if p.get("data-from")}
    assert edges == {("in0", "i0"), ("i0", "i1"), ("i1", "i2"), ("i2", "i3"), ("in0", "i3"), ("i3", "out0")}
    _check_copy_labels(root, copy_report(program, f"m{WEIRD}"))


def test_method_selection():
    model, inputs = transformer_block()
    ep = _export(model, inputs)
    program = ferry.compile({"forward": ep, "second": ep}, OpSupportPartitioner("cuda:0"))
    first = render_html(program)
    assert first == render_html(program, "forward")
    assert render_html(program, "second") != first
    assert "<code>second</code>" in render_html(program, "second")
    with pytest.raises(KeyError) as err:
        render_html(program, "nope")
    assert "forward" in str(err.value) and "second" in str(err.value)


def test_deterministic_and_same_after_save_and_load(block, tmp_path):
    a = render_html(block)
    assert a == render_html(block)
    path = tmp_path / "p.ferry"
    block.save(path)
    assert render_html(ferry.load_program(path)) == a


def test_write_html(block, tmp_path):
    out = write_html(block, tmp_path / "page.html")
    assert out == tmp_path / "page.html"
    assert out.read_text(encoding="utf-8") == render_html(block)
    with pytest.raises(KeyError):
        write_html(block, tmp_path / "nope.html", method="nope")
    assert not (tmp_path / "nope.html").exists()


def test_a_hundred_instructions_stay_readable(big):
    m = big.method("forward")
    assert len(m.instructions) >= 45
    root = _parse(render_html(big))
    (svg,) = _section(root, "graph").iter("svg")
    nodes = _nodes(root)
    assert sorted(int(v.get("data-instruction")) for v in nodes.values() if v.get("data-instruction")) == list(
        range(len(m.instructions)))
    assert float(svg.get("width")) < 1400  # one lane: rows grow down, the width stays put
    assert float(svg.get("height")) == pytest.approx(54 + (len(nodes)) * 34 + 16)
    for _values, _, rects in _timeline_blocks(root).values():
        assert rects


def test_cli_inspect_html(block, tmp_path, capsys):
    from ferry.cli import main

    path = tmp_path / "block.ferry"
    block.save(path)
    out = tmp_path / "out.html"
    assert main(["inspect", str(path), "--html", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    root = _parse(out.read_text(encoding="utf-8"))
    assert len(_nodes(root)) == len(block.method("forward").instructions) + 2
    assert main(["inspect", str(path), "--html", str(tmp_path / "x.html"), "--method", "nope"]) == 2
    assert "forward" in capsys.readouterr().err


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(_chromium() is None, reason="needs headless chromium (apt-get install -y chromium)")
def test_renders_in_headless_chromium(block, tmp_path):
    page = write_html(block, tmp_path / "page.html")
    png = tmp_path / "shot.png"
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={png}",
           "--window-size=1400,2000", page.resolve().as_uri()]
    subprocess.run(cmd, check=False, capture_output=True, timeout=180)
    assert png.exists(), "chromium wrote no screenshot"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000  # a blank page compresses to a few KiB


def test_a_split_program_shows_its_map_and_each_device_against_its_budget(emu):
    model = TinyLM(layers=4)
    program = ferry.compile(torch.export.export(model, (ids(0),)), device_map="auto",
                            max_memory={"emu:0": "10MB", "emu:1": "10MB"})
    page = render_html(program)
    method = program.methods["forward"]
    for path, dev in method.device_map.items():
        assert f'data-module="{path}" data-device="{dev}"' in page
    need = device_bytes(program)
    for dev in ("emu:0", "emu:1"):
        row = page.split(f'<tr data-device="{dev}" data-planned=')[1].split(">")[0]
        total = int(row.split('data-total="')[1].split('"')[0])
        assert total == need[Device.parse(dev)] and 'data-budget="10000000"' in row
    # the lanes and the copy between them are drawn
    assert page.count("d2d") >= 1
