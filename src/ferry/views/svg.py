"""Drawing the graph's layout as inline SVG, and its legend. Tooltips are SVG <title> elements
(hover a node, an edge or a copy's label)."""

from __future__ import annotations

from ferry.program.schema import Method
from ferry.views.facts import fmt_bytes
from ferry.views.graph import Graph, Node
from ferry.views.layout import GUTTER, INFO_CHARS, ROW, TOP, Layout, Route
from ferry.views.markup import clip, esc, num
from ferry.views.palette import Palette

__all__ = ["graph_svg", "legend", "path_data"]

_VALUE_KINDS = ("input", "output", "state", "update")


def _sign(a: float, b: float) -> int:
    """Which way from a to b."""
    return 1 if b > a else -1 if b < a else 0


def _rounded(points: tuple[tuple[float, float], ...], r: float = 5.0) -> str:
    """An orthogonal polyline with rounded corners, as SVG path data."""
    out = [f"M{num(points[0][0])},{num(points[0][1])}"]
    for k in range(1, len(points) - 1):
        (x0, y0), (x1, y1), (x2, y2) = points[k - 1], points[k], points[k + 1]
        rr = min(r, max(abs(x1 - x0), abs(y1 - y0)) / 2, max(abs(x2 - x1), abs(y2 - y1)) / 2)
        if rr <= 0.01:
            out.append(f"L{num(x1)},{num(y1)}")
            continue
        ax, ay = x1 - rr * _sign(x0, x1), y1 - rr * _sign(y0, y1)
        bx, by = x1 + rr * _sign(x1, x2), y1 + rr * _sign(y1, y2)
        out.append(f"L{num(ax)},{num(ay)}Q{num(x1)},{num(y1)} {num(bx)},{num(by)}")
    out.append(f"L{num(points[-1][0])},{num(points[-1][1])}")
    return "".join(out)


def path_data(route: Route) -> str:
    """A route as SVG path data."""
    if route.kind == "tracks":
        return _rounded(route.points)
    p = [f"{num(x)},{num(y)}" for x, y in route.points]
    return f"M{p[0]}C{p[1]} {p[2]} {p[3]}" if route.kind == "curve" else f"M{p[0]}L{p[1]}"


def _defs(graph: Graph, pal: Palette) -> list[str]:
    """Arrow heads (plain, and one per device for the copies into it) and the copies' fills."""
    out = ["<defs>"]
    markers = {"plain": "#8a94a3"} | {pal.css_id(d): pal.color[d][1] for d in pal.devices}
    for key, color in markers.items():
        out.append(f'<marker id="ah-{key}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                   f'markerUnits="userSpaceOnUse" orient="auto"><path d="M0,0L10,5L0,10z" fill="{color}"/></marker>')
    for a, b in pal.copy_pairs(graph.copies()):
        ca, cb = pal.color[pal.devices[a]][0], pal.color[pal.devices[b]][0]  # read left to right: source, destination
        out.append(f'<linearGradient id="cg-{a}-{b}" x1="0" y1="0" x2="1" y2="0">'
                   f'<stop offset="0.15" stop-color="{ca}"/><stop offset="0.85" stop-color="{cb}"/></linearGradient>')
    out.append("</defs>")
    return out


def _backgrounds(graph: Graph, lay: Layout, pal: Palette) -> list[str]:
    """Row stripes, lane bands with their headers, the head of the instruction numbers."""
    width, height = lay.size
    out = ['<g class="rows">']
    for nd in graph.nodes:
        if nd.row % 2 == 1:
            out.append(f'<rect x="0" y="{num(TOP + nd.row * ROW)}" width="{num(width)}" height="{num(ROW)}" fill="#f6f7f9"/>')
    out.append("</g>")
    out.append('<g class="lanes">')
    for lane, d in enumerate(pal.devices):
        x, half = lay.center[2 * lane], lay.half[2 * lane]
        fill, stroke, _ = pal.color[d]
        out.append(f'<rect x="{num(x - half - 8)}" y="{num(TOP - 30)}" width="{num(2 * half + 16)}" '
                   f'height="{num(height - TOP + 22)}" rx="8" fill="{fill}" fill-opacity="0.22" stroke="{stroke}" '
                   f'stroke-opacity="0.25"/>')
        out.append(f'<text class="lane-head" x="{num(x)}" y="{num(TOP - 12)}" text-anchor="middle" '
                   f'fill="{stroke}">{esc(d)}</text>')
    out.append("</g>")
    out.append(f'<text class="gutter-head" x="{num(GUTTER - 14)}" y="{num(TOP - 12)}" text-anchor="end">#</text>')
    return out


def _edges(m: Method, graph: Graph, lay: Layout, pal: Palette) -> list[str]:
    """Plain edges, then the edges leaving each copy on top, grouped per copy with one label:
    the bytes the copy moves."""
    out = ['<g class="edges">']
    copy_out: dict[int, list[str]] = {}
    for e, route in zip(graph.edges, lay.routes):
        s, t = graph.nodes[e.src], graph.nodes[e.dst]
        d = path_data(route)
        names = ", ".join(f"%{m.tensor(v).name or v}" for v in e.values)
        ends = f'data-from="{esc(s.key)}" data-to="{esc(t.key)}"'
        if s.kind == "copy":  # a copy node's device is its destination
            copy_out.setdefault(e.src, []).append(
                f'<path class="copy-edge" d="{d}" stroke="{pal.color[s.device][1]}" marker-end="url(#ah-{pal.css_id(s.device)})" '
                f'{ends}><title>{esc(f"{s.label} #{s.index} -> {t.label}: {names}")}</title></path>')
        else:
            out.append(f'<path class="edge" d="{d}" marker-end="url(#ah-plain)" {ends}>'
                       f'<title>{esc(f"{s.label} -> {t.label}: {names}")}</title></path>')
    for pos, (x, y, anchor) in lay.label_at.items():
        s = graph.nodes[pos]
        out.append(f'<g class="copy-out" data-instruction="{s.index}" data-bytes="{s.nbytes}" data-from="{esc(s.key)}">')
        out.extend(copy_out.get(pos, []))
        out.append(f'<text class="edge-label" x="{num(x)}" y="{num(y)}" text-anchor="{anchor}" fill="{pal.color[s.device][1]}">'
                   f'{esc(fmt_bytes(s.nbytes))}<title>{esc(f"{s.label} moves {s.nbytes:,} bytes")}</title></text>')
        out.append("</g>")
    out.append("</g>")
    return out


def _box(nd: Node, box: tuple[float, float, float, float], pal: Palette) -> list[str]:
    """A node's shape: a pill shaded from source to destination for a copy, a white box with a
    bar for a value at the method's edge, a box in the device's color for an instruction."""
    x, y, w, h = box
    fill, stroke, _ = pal.color[nd.device]
    geo = f'x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}"'
    if nd.kind == "copy":
        assert nd.src_device is not None
        grad = f"cg-{pal.lane[nd.src_device]}-{pal.lane[nd.device]}"
        return [f'<rect {geo} rx="{num(h / 2)}" fill="url(#{grad})" stroke="{stroke}" stroke-width="1.4" '
                'stroke-dasharray="4 2"/>']
    if nd.kind in _VALUE_KINDS:
        return [f'<rect {geo} rx="3" fill="#ffffff" stroke="{stroke}" stroke-width="1.6"/>',
                f'<rect x="{num(x)}" y="{num(y)}" width="7" height="{num(h)}" rx="2" fill="{stroke}"/>']
    return [f'<rect {geo} rx="5" fill="{fill}" stroke="{stroke}" stroke-width="{"1.8" if nd.kind == "delegate" else "1"}"/>']


def _nodes(graph: Graph, lay: Layout, pal: Palette) -> list[str]:
    out = ['<g class="nodes">']
    for pos, nd in enumerate(graph.nodes):
        _, y, _, h = box = lay.box(pos)
        attrs = (f'class="node {nd.kind}" data-key="{esc(nd.key)}" data-device="{esc(nd.device)}"'
                 + (f' data-instruction="{nd.index}"' if nd.index is not None else ""))
        out.append(f"<g {attrs}><title>{esc(nd.title)}</title>")
        out.extend(_box(nd, box, pal))
        weight = ' font-weight="600"' if nd.kind == "delegate" else ""
        text_y = num(y + h / 2 + 4)
        middle = lay.center[lay.slot[pos]]
        out.append(f'<text x="{num(middle + (3 if nd.kind in _VALUE_KINDS else 0))}" '
                   f'y="{text_y}" text-anchor="middle" fill="{pal.color[nd.device][2]}"{weight}>{esc(nd.label)}</text>')
        out.append("</g>")
        number = f"#{nd.index}" if nd.index is not None else ("in" if nd.kind in ("input", "state") else "out")
        out.append(f'<text class="rownum" x="{num(GUTTER - 14)}" y="{text_y}" text-anchor="end">{esc(number)}</text>')
        if nd.info:
            out.append(f'<text class="info" x="{num(lay.info_x)}" y="{text_y}">{esc(clip(nd.info, INFO_CHARS))}</text>')
    out.append("</g>")
    return out


def graph_svg(m: Method, graph: Graph, lay: Layout, pal: Palette) -> str:
    width, height = lay.size
    out = [f'<svg class="graph" width="{num(width)}" height="{num(height)}" viewBox="0 0 {num(width)} {num(height)}" '
           f'role="img" aria-label="instruction graph of method {esc(m.name)}">']
    out += _defs(graph, pal) + _backgrounds(graph, lay, pal) + _edges(m, graph, lay, pal) + _nodes(graph, lay, pal)
    out.append("</svg>")
    return "\n".join(out)


def legend(graph: Graph, pal: Palette) -> str:
    items = []
    for d in pal.devices:
        fill, stroke, _ = pal.color[d]
        items.append(f'<span class="key"><span class="sw" style="background:{fill};border-color:{stroke}"></span>{esc(d)}</span>')
    pairs = pal.copy_pairs(graph.copies())
    for a, b in pairs:
        ca, cb = pal.color[pal.devices[a]], pal.color[pal.devices[b]]
        items.append(f'<span class="key"><span class="sw copy" style="background:linear-gradient(90deg,{ca[0]},{cb[0]});'
                     f'border-color:{cb[1]}"></span>copy {esc(pal.devices[a])} \u2192 {esc(pal.devices[b])}</span>')
    items.append('<span class="key"><span class="sw io"></span>method input / output</span>')
    if any(nd.kind == "delegate" for nd in graph.nodes):
        items.append('<span class="key"><span class="sw dl"></span>delegate call (bold outline)</span>')
    items.append('<span class="key"><span class="ln"></span>data dependency</span>')
    if pairs:
        items.append('<span class="key"><span class="ln cp"></span>copy result (in the destination\u2019s color), '
                     'labelled with the bytes moved</span>')
    return '<div class="legend">' + "".join(items) + "</div>"
