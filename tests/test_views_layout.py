"""The graph's layout as data: lanes and slots, columns that never overlap, straight edges that
meet no box, routed edges on tracks that do not share rows."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry import OpSupportPartitioner
from ferry.device import CPU, Device
from ferry.examples import transformer_block
from ferry.views.graph import Edge, Node, build_graph
from ferry.views.layout import BOX_H, ROW, TOP, layout_graph, y_top
from ferry.views.palette import Palette
from test_views_graph import CUDA0, CUDA1, _TwoDevices, chain


def _node(row: int, device: Device = CPU, kind: str = "instr", src: Device | None = None, label: str = "op") -> Node:
    return Node(f"n{row}", kind, row, label, "", device, src)


def _layout(program):
    m = program.method("forward")
    g = build_graph(program, m)
    pal = Palette(g.devices() | {b.device for b in m.buffers[1:]})
    return g, pal, layout_graph(g.nodes, g.edges, pal.lane)


@pytest.fixture(scope="module")
def programs():
    torch.manual_seed(0)
    model, inputs = transformer_block()
    ep = torch.export.export(model, tuple(inputs))
    return [chain(), ferry.compile(ep), ferry.compile(ep, OpSupportPartitioner("cuda:0", exclude=["aten.softmax"])),
            ferry.compile(ep, _TwoDevices())]


def _inside(x: float, y: float, box, margin: float = 0.0) -> bool:
    bx, by, bw, bh = box
    return bx - margin < x < bx + bw + margin and by - margin < y < by + bh + margin


def test_lanes_at_even_slots_and_copies_between_the_lanes_they_connect():
    g, pal, lay = _layout(chain())
    assert pal.devices == [CPU, CUDA0, CUDA1]
    # cpu, h2d cpu|cuda:0, cuda:0, d2d cuda:0|cuda:1, cuda:1, d2h cuda:1|cpu (slot 0+4: the column of
    # cuda:0, the lane between them), cpu
    assert lay.slot == (0, 1, 2, 3, 4, 2, 0)
    for pos, nd in enumerate(g.nodes):
        if nd.kind == "copy":
            a, b = sorted((lay.center[2 * pal.lane[nd.src_device]], lay.center[2 * pal.lane[nd.device]]))
            assert a < lay.center[lay.slot[pos]] < b
        else:
            assert lay.slot[pos] == 2 * pal.lane[nd.device]


@pytest.mark.parametrize("which", range(4))
def test_columns_do_not_overlap_and_every_box_fits_its_column(programs, which):
    g, _, lay = _layout(programs[which])
    slots = sorted(lay.center)
    for s, t in zip(slots, slots[1:]):
        assert lay.center[s] + lay.half[s] < lay.center[t] - lay.half[t]
    for pos in range(len(g.nodes)):
        x, y, w, h = lay.box(pos)
        s = lay.slot[pos]
        assert lay.center[s] - lay.half[s] <= x and x + w <= lay.center[s] + lay.half[s] + 1e-9
        assert y == pytest.approx(TOP + pos * ROW + (ROW - BOX_H) / 2) and h == BOX_H
    assert lay.info_x > max(lay.center[s] + lay.half[s] for s in slots)
    assert lay.size[1] == TOP + len(g.nodes) * ROW + 16


@pytest.mark.parametrize("which", range(4))
def test_no_edge_runs_through_a_box(programs, which):
    g, _, lay = _layout(programs[which])
    boxes = [lay.box(pos) for pos in range(len(g.nodes))]
    for k, (e, route) in enumerate(zip(g.edges, lay.routes)):
        others = [boxes[r] for r in range(len(boxes)) if r not in (e.src, e.dst)]
        pts = route.points if route.kind != "curve" else (route.points[0], route.points[-1])
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            for step in range(101):  # points along each segment
                x, y = x0 + (x1 - x0) * step / 100, y0 + (y1 - y0) * step / 100
                assert not any(_inside(x, y, b) for b in others), f"edge {k} ({route.kind}) meets a box"
        assert route.points[0][1] >= boxes[e.src][1] + BOX_H - 1e-9  # leaves below its source
        assert (route.kind == "tracks") == (k in lay.tracks)


def test_an_edge_that_would_cross_a_box_is_routed_and_crossing_edges_get_two_tracks():
    # rows: 0 -> 3 and 1 -> 3 jump over the boxes in between (all in one lane): both routed,
    # their rows overlap, so they take two tracks; the shorter one the inner track
    nodes = [_node(r) for r in range(4)]
    edges = [Edge(0, 1, [0]), Edge(1, 2, [1]), Edge(2, 3, [2]), Edge(0, 3, [0]), Edge(1, 3, [1])]
    lay = layout_graph(nodes, edges, {CPU: 0})
    assert dict(lay.tracks) == {3: 1, 4: 0}
    assert [r.kind for r in lay.routes] == ["line", "line", "line", "tracks", "tracks"]
    x_outer, x_inner = lay.routes[3].points[2][0], lay.routes[4].points[2][0]
    left_of_boxes = lay.center[0] - lay.half[0]
    assert x_outer < x_inner < left_of_boxes
    assert lay.routes[3].points[-1] == (lay.box(3)[0] - 1, y_top(3) + BOX_H / 2)  # ends at the target's side


def test_edges_on_disjoint_rows_share_a_track():
    nodes = [_node(r) for r in range(6)]
    edges = [Edge(0, 2, [0]), Edge(3, 5, [3]), Edge(0, 1, [0]), Edge(1, 2, [1]), Edge(3, 4, [3]), Edge(4, 5, [4])]
    lay = layout_graph(nodes, edges, {CPU: 0})
    assert dict(lay.tracks) == {0: 0, 1: 0}


def test_a_copy_label_sits_on_the_side_no_edge_leaves_towards():
    cuda = Device("cuda", 0)
    nodes = [_node(0), _node(1, cuda, "copy", CPU, "h2d copy"), _node(2, cuda)]
    lay = layout_graph(nodes, [Edge(0, 1, [0]), Edge(1, 2, [1])], {CPU: 0, cuda: 1})
    x, y, anchor = lay.label_at[1]
    assert anchor == "end" and x < lay.center[1]  # the edge leaves to the right, towards cuda:0
    nodes = [_node(0, cuda), _node(1, CPU, "copy", cuda, "d2h copy"), _node(2)]
    lay = layout_graph(nodes, [Edge(0, 1, [0]), Edge(1, 2, [1])], {CPU: 0, cuda: 1})
    x, y, anchor = lay.label_at[1]
    assert anchor == "start" and x > lay.center[1]
    assert y > lay.box(1)[1] + BOX_H


def test_long_labels_widen_their_column():
    short = layout_graph([_node(0, label="mm")], [], {CPU: 0})
    long = layout_graph([_node(0, label="x" * 30)], [], {CPU: 0})
    assert short.width[0] == 96.0 and long.width[0] > 96.0
    assert long.half[0] == long.width[0] / 2 and long.info_x > short.info_x
