"""Where the graph's parts go, as plain data: no SVG here, so the geometry can be tested alone.

One row per node. Lane k of device k sits at slot 2k; a copy between lanes a and b at slot a+b,
between the lanes it connects. An edge goes straight from its source to its target unless the
line would meet a box of a row in between; such an edge is routed on a track beside the slot of
its target (per target slot, shorter edges on the inner tracks). Making room for tracks moves
the columns, so straight edges are checked again until none meets a box.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ferry.device import Device
from ferry.views.graph import Edge, Node
from ferry.views.markup import clip, text_width

__all__ = ["BOX_H", "GUTTER", "ROW", "TOP", "Layout", "Route", "layout_graph", "y_top"]

ROW = 34.0  # row pitch
BOX_H = 22.0
TRACK = 6.0  # distance between routing tracks
PAD = 26.0  # between slots
TOP = 54.0  # room for lane headers
GUTTER = 46.0  # instruction numbers
INFO_CHARS = 64  # the line right of the drawing is clipped to this

Point = tuple[float, float]


def y_top(row: int) -> float:
    return TOP + row * ROW + (ROW - BOX_H) / 2


def _y_mid(row: int) -> float:
    return TOP + row * ROW + ROW / 2


@dataclass(frozen=True)
class Route:
    """An edge's path: 'line' (two points), 'curve' (a cubic: start, two controls, end) or
    'tracks' (an orthogonal polyline, drawn with rounded corners)."""

    kind: str
    points: tuple[Point, ...]


@dataclass(frozen=True)
class Layout:
    slot: tuple[int, ...]  # per node
    width: tuple[float, ...]  # per node: its box's width
    center: Mapping[int, float]  # slot -> x of its middle
    half: Mapping[int, float]  # slot -> half the widest box in it
    tracks: Mapping[int, int]  # edge index -> its track, for the edges that are routed
    routes: tuple[Route, ...]  # per edge
    label_at: Mapping[int, tuple[float, float, str]]  # copy node -> (x, y, text-anchor) of its bytes
    info_x: float  # where the column right of the drawing starts
    size: tuple[float, float]  # (width, height) of the drawing

    def box(self, pos: int) -> tuple[float, float, float, float]:
        """(x, y, width, height) of the box of the node at `pos` (its row)."""
        return self.center[self.slot[pos]] - self.width[pos] / 2, y_top(pos), self.width[pos], BOX_H


def _slots(nodes: list[Node], lane: Mapping[Device, int]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    slots, widths = [], []
    for nd in nodes:
        a = lane[nd.device]
        slots.append(a + lane[nd.src_device] if nd.src_device is not None else 2 * a)
        bold = 1.1 if nd.kind == "delegate" else 1.0  # delegate labels are bold
        widths.append(min(256.0, max(96.0 if nd.kind != "copy" else 78.0, text_width(nd.label) * bold + 22)))
    return tuple(slots), tuple(widths)


class _Columns:
    """The slots' columns and the test whether an edge can be drawn straight between them."""

    def __init__(self, nodes: list[Node], edges: list[Edge], slots: tuple[int, ...], widths: tuple[float, ...], lanes: int):
        self.nodes, self.edges, self.slot, self.w = nodes, edges, slots, widths
        self.used = sorted(set(slots) | {2 * k for k in range(lanes)})
        self.half = {s: max([w / 2 for w, ws in zip(widths, slots) if ws == s] or [60.0]) for s in self.used}

    def place(self, zones: Mapping[int, float]) -> dict[int, float]:
        cx, x = {}, GUTTER
        for s in self.used:
            x += zones.get(s, 0.0) + self.half[s]
            cx[s] = x
            x += self.half[s] + PAD
        return cx

    def clear(self, e: Edge, cx: Mapping[int, float]) -> bool:
        """No box of a row in between meets the straight segment from source to target."""
        s, t = self.nodes[e.src], self.nodes[e.dst]
        if t.row == s.row + 1:
            return True
        x0, y0 = cx[self.slot[e.src]], y_top(s.row) + BOX_H
        x1, y1 = cx[self.slot[e.dst]], y_top(t.row)
        for r in range(s.row + 1, t.row):
            lo, hi = y_top(r) - 4, y_top(r) + BOX_H + 4
            xa = x0 + (x1 - x0) * (lo - y0) / (y1 - y0)
            xb = x0 + (x1 - x0) * (hi - y0) / (y1 - y0)
            left, right = cx[self.slot[r]] - self.w[r] / 2 - 6, cx[self.slot[r]] + self.w[r] / 2 + 6
            if max(xa, xb) >= left and min(xa, xb) <= right:
                return False
        return True

    def assign_tracks(self, routed: list[int]) -> tuple[dict[int, int], dict[int, float]]:
        """Per target slot, greedy interval coloring: shorter edges first, on the inner tracks.
        Returns the track of each routed edge and the room the tracks take left of each slot."""
        tracks: dict[int, list[list[tuple[int, int]]]] = {}
        track_of: dict[int, int] = {}
        span = {k: (self.nodes[self.edges[k].src].row, self.nodes[self.edges[k].dst].row) for k in routed}
        for k in sorted(routed, key=lambda k: (span[k][1] - span[k][0], *span[k])):
            a, b = span[k]
            lanes = tracks.setdefault(self.slot[self.edges[k].dst], [])
            for t, occupied in enumerate(lanes):
                if all(not (a < d and c < b) for c, d in occupied):
                    occupied.append((a, b))
                    track_of[k] = t
                    break
            else:
                lanes.append([(a, b)])
                track_of[k] = len(lanes) - 1
        return track_of, {s: len(ts) * TRACK + 8 for s, ts in tracks.items()}

    def route_all(self) -> tuple[dict[int, float], dict[int, int]]:
        """Column centers and the tracks of the edges a straight line cannot take (the routed set only grows)."""
        routed: set[int] = set()
        track_of: dict[int, int] = {}
        zones: dict[int, float] = {}
        for _ in range(len(self.edges) + 1):
            cx = self.place(zones)
            more = [k for k, e in enumerate(self.edges) if k not in routed and not self.clear(e, cx)]
            if not more:
                break
            routed.update(more)
            track_of, zones = self.assign_tracks(sorted(routed))
        return cx, track_of


def _route(c: _Columns, cx: Mapping[int, float], e: Edge, track: int | None) -> Route:
    s, t = c.nodes[e.src], c.nodes[e.dst]
    xs, xt = cx[c.slot[e.src]], cx[c.slot[e.dst]]
    if track is None:
        y0, y1 = y_top(s.row) + BOX_H, y_top(t.row) - 1
        if abs(xs - xt) < 0.5 or t.row > s.row + 1:  # exactly the segment `clear` checked
            return Route("line", ((xs, y0), (xt, y1)))
        k = (y1 - y0) * 0.5
        return Route("curve", ((xs, y0), (xs, y0 + k), (xt, y1 - k), (xt, y1)))
    tx = xt - c.half[c.slot[e.dst]] - 8 - track * TRACK
    gy = TOP + (s.row + 1) * ROW  # the gap below the source's row
    ym = _y_mid(t.row)
    pts = [(xs, y_top(s.row) + BOX_H), (xs, gy), (tx, gy), (tx, ym), (xt - c.w[e.dst] / 2 - 1, ym)]
    if abs(xs - tx) < 0.5:
        pts = [pts[0], (tx, ym), pts[-1]]
    return Route("tracks", tuple(pts))


def _copy_label(c: _Columns, cx: Mapping[int, float], pos: int, tracks: Mapping[int, int]) -> tuple[float, float, str]:
    """Beside the copy's outgoing stub, on the side no edge leaves towards."""
    x = cx[c.slot[pos]]
    right_first = any(cx[c.slot[e.dst]] - (c.half[c.slot[e.dst]] + 8 if k in tracks else 0) > x + 1
                      for k, e in enumerate(c.edges) if e.src == pos)
    return x + (-6 if right_first else 6), y_top(c.nodes[pos].row) + BOX_H + 11.5, "end" if right_first else "start"


def layout_graph(nodes: list[Node], edges: list[Edge], lane: Mapping[Device, int]) -> Layout:
    """The layout of a graph whose devices sit in lanes `lane[device]` (0, 1, ...)."""
    slots, widths = _slots(nodes, lane)
    c = _Columns(nodes, edges, slots, widths, len(set(lane.values())))
    cx, tracks = c.route_all()
    routes = tuple(_route(c, cx, e, tracks.get(k)) for k, e in enumerate(edges))
    labels = {pos: _copy_label(c, cx, pos, tracks) for pos, nd in enumerate(nodes) if nd.kind == "copy"}
    info_x = max(cx[s] + c.half[s] for s in c.used) + 22
    info_w = max([text_width(clip(nd.info, INFO_CHARS), 11) for nd in nodes] or [0])
    size = (info_x + info_w + 16, TOP + len(nodes) * ROW + 16)
    return Layout(slots, widths, cx, c.half, tracks, routes, labels, info_x, size)
