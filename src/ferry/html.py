"""A one-page HTML picture of a compiled method: where every instruction runs, where the
copies are and how many bytes they move, and how each per-device buffer is packed.

`render_html(program, method)` returns the page as a string; `write_html` writes it to a file
(`ferry inspect FILE --html out.html`). The page is self-contained: inline CSS and inline SVG,
no scripts, no fonts or styles fetched from anywhere, so it opens offline and can be attached
to a bug report. Tooltips are SVG <title> elements (hover a node, an edge or a block).

Three sections:
  * graph:   one row per instruction in program order (a valid topological order), one lane
             per device; copies (pills shaded from source to destination color) sit between the
             lanes they connect and the edges leaving them carry the bytes moved. Edges that
             would cross a node are routed on tracks beside the lane of their target, shorter
             edges on the inner tracks.
  * memory:  per planned buffer, each planned tensor as a block spanning its lifetime
             (x: instruction index) at its offset (y: byte offset, growing downwards),
             with the planner's lower bound (the peak of bytes live at once) marked.
  * summary: the copy report and the buffers per device.

The output is deterministic: the same program gives the same bytes.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

from ferry.device import CPU, Device
from ferry.errors import ProgramError
from ferry.inspect import device_memory, owner
from ferry.program import Program
from ferry.program.lifetimes import tensor_ids, value_lifetimes
from ferry.program.report import copy_report
from ferry.program.schema import DelegateCall, KernelCall, Method, PlanEntry, TensorValue

__all__ = ["render_html", "write_html"]

# ---------------------------------------------------------------- small helpers


def _e(x) -> str:
    """Escape for text and attribute values alike."""
    return html.escape(str(x), quote=True)


def _f(x: float) -> str:
    """A coordinate: at most two decimals, no trailing zeros (stable across platforms)."""
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def fmt_bytes(n: int) -> str:
    """8192 -> '8.0 KiB'; below 1 KiB exact bytes."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"  # unreachable


def _plan(v: TensorValue) -> PlanEntry:
    """A planned value's (buffer, offset): storage 'planned' always has one (validate.py checks)."""
    if v.plan is None:
        raise ProgramError(f"value %{v.name} has storage {v.storage!r} but no plan entry")
    return v.plan


def _shape(v: TensorValue) -> str:
    return f"{v.dtype}[{', '.join(str(s) for s in v.shape)}]"


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: max(1, n - 1)] + "\u2026"


def _text_w(s: str, size: float = 12.0) -> float:
    """Rough width of sans-serif text; only used to size boxes."""
    return len(s) * size * 0.58


def _parse_device(text: str, fallback: Device) -> Device:
    """Lenient: a program may name a device type whose allocator is not registered here."""
    try:
        return Device.from_canonical(text.strip())  # 'cuda:0', 'rank1:cuda:0'
    except ValueError:
        pass
    kind, _, idx = text.strip().lower().partition(":")
    try:
        return Device(kind or fallback.type, int(idx) if idx.strip() else 0)
    except ValueError:
        return fallback


# device colors: (fill, stroke, text on the fill). CPU is slate; each other device its own hue.
_CPU_COLOR = ("#dfe6ee", "#64748b", "#1e293b")
_DEVICE_COLORS = (
    ("#c6e9a0", "#4d7c0f", "#1a2e05"),  # green
    ("#fcd9a8", "#c2410c", "#431407"),  # orange
    ("#dccbf7", "#6d28d9", "#2e1065"),  # violet
    ("#b5e7e0", "#0f766e", "#042f2e"),  # teal
    ("#f9c9dc", "#be185d", "#500724"),  # pink
    ("#fbe9a0", "#a16207", "#422006"),  # amber
    ("#c4dafc", "#1d4ed8", "#172554"),  # blue
)
# memory blocks: soft hues, neighbours in the plan get different ones
_BLOCK_COLORS = (
    ("#bfdbfe", "#2563eb"), ("#fed7aa", "#ea580c"), ("#bbf7d0", "#16a34a"), ("#e9d5ff", "#9333ea"),
    ("#fecdd3", "#e11d48"), ("#a5f3fc", "#0891b2"), ("#fef08a", "#ca8a04"), ("#d9f99d", "#65a30d"),
    ("#fbcfe8", "#db2777"), ("#c7d2fe", "#4f46e5"),
)

_COPY_NAMES = {"_h2d_copy": "h2d", "_d2h_copy": "d2h", "_d2d_copy": "d2d"}


def _is_copy(ins) -> bool:
    return isinstance(ins, KernelCall) and ins.kernel.startswith("et_copy::")


def _copy_direction(kernel: str) -> str:
    op = kernel.removeprefix("et_copy::").split(".", 1)[0]
    return _COPY_NAMES.get(op, op.lstrip("_"))


def _short_kernel(kernel: str) -> str:
    if kernel.startswith("et_copy::"):
        return f"{_copy_direction(kernel)} copy"
    return kernel.removeprefix("aten::").removesuffix(".default")


_tensor_ids = tensor_ids


def _reads(m: Method, ins) -> list[int]:
    seen: dict[int, None] = {}
    for a in ins.args:
        for t in _tensor_ids(m, a):
            seen.setdefault(t, None)
    return list(seen)


def _vdesc(m: Method, vid: int, device: bool = True) -> str:
    """One line about a value, for tooltips."""
    v = m.values[vid]
    if not isinstance(v, TensorValue):
        return f"{v.kind} {v.value!r}"
    name = v.name or f"v{vid}"
    if v.storage == "planned":
        where = f"buffer {_plan(v).buffer} + {_plan(v).offset}"
    elif v.storage == "view" and v.alias_of is not None and 0 <= v.alias_of < len(m.values):
        where = f"view of %{m.tensor(v.alias_of).name or v.alias_of}"
    else:
        where = owner(m, vid)
    dev = f" on {v.device}" if device else ""
    return f"%{name} {_shape(v)}{dev} ({fmt_bytes(v.nbytes)}, {where})"


def _vshort(m: Method, vid: int) -> str:
    """A compact line about a value, for the column right of the graph."""
    v = m.values[vid]
    if not isinstance(v, TensorValue):
        return f"{v.kind} {v.value!r}"
    where = f"b{_plan(v).buffer}+{_plan(v).offset}" if v.storage == "planned" else owner(m, vid)
    return f"%{v.name or f'v{vid}'}  {_shape(v)}  {where}"


# ---------------------------------------------------------------- the graph model


@dataclass
class _Node:
    key: str
    kind: str  # input | state | instr | delegate | copy | output | update
    row: int
    label: str
    title: str
    device: Device
    src_device: Device | None = None  # copies
    index: int | None = None  # instruction index
    info: str = ""  # the line right of the drawing
    slot: int = 0
    w: float = 0.0


@dataclass
class _Edge:
    src: int  # node position
    dst: int
    values: list[int] = field(default_factory=list)


def _instr_device(program: Program, m: Method, ins) -> Device:
    if isinstance(ins, DelegateCall):
        outs = [m.tensor(o) for o in ins.outputs if 0 <= o < len(m.values) and isinstance(m.values[o], TensorValue)]
        fallback = outs[0].device if outs else CPU
        d = program.delegates[ins.delegate] if 0 <= ins.delegate < len(program.delegates) else None
        spec = d.spec("target_device") if d is not None else None
        return _parse_device(spec.decode(errors="replace"), fallback) if spec else (CPU if d is not None else fallback)
    for o in ins.outputs:
        for t in _tensor_ids(m, o):
            return m.tensor(t).device
    for a in ins.args:
        for t in _tensor_ids(m, a):
            return m.tensor(t).device
    return CPU


def _build_graph(program: Program, m: Method) -> tuple[list[_Node], list[_Edge]]:
    nodes: list[_Node] = []
    last_def: dict[int, int] = {}  # value id -> node position that last wrote it

    def add(node: _Node) -> int:
        nodes.append(node)
        return len(nodes) - 1

    for k, vid in enumerate(m.inputs):
        v = m.values[vid]
        dev = v.device if isinstance(v, TensorValue) else CPU
        name = v.name if isinstance(v, TensorValue) else ""
        who = owner(m, vid) if isinstance(v, TensorValue) else v.kind
        pos = add(_Node(f"in{k}", "input", len(nodes), _clip(f"input {k}" + (f": {name}" if name else ""), 28),
                        f"method input {k} ({who})\n{_vdesc(m, vid)}", dev, info=_vshort(m, vid)))
        last_def.setdefault(vid, pos)
    for k, mb in enumerate(m.mutable_buffers):
        if mb.value in last_def or not 0 <= mb.value < len(m.values):
            continue
        v = m.values[mb.value]
        dev = v.device if isinstance(v, TensorValue) else CPU
        pos = add(_Node(f"st{k}", "state", len(nodes), _clip(f"buffer {mb.name or k}", 28),
                        f"mutable buffer {mb.name!r}, kept between calls\n{_vdesc(m, mb.value)}", dev,
                        info=_vshort(m, mb.value)))
        last_def[mb.value] = pos

    edges: dict[tuple[int, int], _Edge] = {}

    def link(src: int, dst: int, vid: int) -> None:
        e = edges.get((src, dst))
        if e is None:
            e = edges[(src, dst)] = _Edge(src, dst)
        if vid not in e.values:
            e.values.append(vid)

    for i, ins in enumerate(m.instructions):
        reads = _reads(m, ins)
        dev = _instr_device(program, m, ins)
        outs = [t for o in ins.outputs for t in _tensor_ids(m, o)]
        consts = [r for r in reads if r not in last_def and m.tensor(r).storage == "constant"]
        if isinstance(ins, DelegateCall):
            d = program.delegates[ins.delegate] if 0 <= ins.delegate < len(program.delegates) else None
            backend = d.backend_id if d is not None else "?"
            kind, label = "delegate", f"delegate {ins.delegate} ({backend})"
            specs = ", ".join(f"{k}={v.decode(errors='replace')}" for k, v in d.compile_specs) if d is not None else ""
            head = f"#{i} delegate {ins.delegate}: backend {backend!r} on {dev}" + (f"\ncompile specs: {specs}" if specs else "")
            src_dev = None
        elif _is_copy(ins):
            kind, label = "copy", _short_kernel(ins.kernel)
            src = _tensor_ids(m, ins.args[0]) if ins.args else []
            src_dev = m.tensor(src[0]).device if src else dev
            nbytes = m.tensor(src[0]).nbytes if src else 0
            head = f"#{i} {ins.kernel}: {src_dev} -> {dev}, {fmt_bytes(nbytes)} ({nbytes:,} B)"
        else:
            kind, label = "instr", _short_kernel(ins.kernel)
            head = f"#{i} {ins.kernel} on {dev}"
            src_dev = None
        lines = [head]
        own = set(outs)
        lines += [f"reads  {_vdesc(m, r)}" for r in reads if r not in own or r in last_def]
        lines += [f"writes {_vdesc(m, o)}" for o in outs]
        if consts:
            lines.append(f"({len(consts)} constant{'s' if len(consts) != 1 else ''} read)")
        info = ""
        if outs:
            info = _vshort(m, outs[0]) + (f"  (+{len(outs) - 1} more)" if len(outs) > 1 else "")
        pos = add(_Node(f"i{i}", kind, len(nodes), _clip(label, 30), "\n".join(lines), dev, src_dev, i, info))
        for r in reads:
            src_pos = last_def.get(r)
            if src_pos is not None and src_pos != pos:
                link(src_pos, pos, r)
        for o in outs:
            last_def[o] = pos

    for k, vid in enumerate(m.outputs):
        v = m.values[vid]
        dev = v.device if isinstance(v, TensorValue) else CPU
        who = owner(m, vid) if isinstance(v, TensorValue) else v.kind
        pos = add(_Node(f"out{k}", "output", len(nodes), f"output {k}", f"method output {k} ({who})\n{_vdesc(m, vid)}",
                        dev, info=_vshort(m, vid)))
        if vid in last_def:
            link(last_def[vid], pos, vid)
    for k, mb in enumerate(m.mutable_buffers):
        if not 0 <= mb.update < len(m.values):
            continue
        v = m.values[mb.update]
        dev = v.device if isinstance(v, TensorValue) else CPU
        pos = add(_Node(f"up{k}", "update", len(nodes), _clip(f"update {mb.name or k}", 28),
                        f"written back into mutable buffer {mb.name!r} after the call\n{_vdesc(m, mb.update)}", dev,
                        info=_vshort(m, mb.update)))
        if mb.update in last_def:
            link(last_def[mb.update], pos, mb.update)
    return nodes, list(edges.values())


# ---------------------------------------------------------------- palette


class _Palette:
    """Lanes and colors: cpu:0 first (slate), then every other device by (type, index), each
    with its own hue."""

    def __init__(self, devices):
        others = sorted((d for d in set(devices) if d != CPU), key=lambda d: (d.type, d.index))
        self.devices = ([CPU] if CPU in devices or not others else []) + others
        self.lane = {d: k for k, d in enumerate(self.devices)}
        self.color = {d: _DEVICE_COLORS[k % len(_DEVICE_COLORS)] for k, d in enumerate(others)}
        self.color[CPU] = _CPU_COLOR

    def css_id(self, d: Device) -> str:
        return f"d{self.lane[d]}"


# ---------------------------------------------------------------- graph drawing

_ROW = 34.0  # row pitch
_BOX_H = 22.0
_TRACK = 6.0  # distance between routing tracks
_PAD = 26.0  # between slots
_TOP = 54.0  # room for lane headers
_GUTTER = 46.0  # instruction numbers


def _rounded(points: list[tuple[float, float]], r: float = 5.0) -> str:
    """An orthogonal polyline with rounded corners, as SVG path data."""
    out = [f"M{_f(points[0][0])},{_f(points[0][1])}"]
    for k in range(1, len(points) - 1):
        (x0, y0), (x1, y1), (x2, y2) = points[k - 1], points[k], points[k + 1]
        d1 = max(abs(x1 - x0), abs(y1 - y0))
        d2 = max(abs(x2 - x1), abs(y2 - y1))
        rr = min(r, d1 / 2, d2 / 2)
        if rr <= 0.01:
            out.append(f"L{_f(x1)},{_f(y1)}")
            continue
        ax = x1 - rr * (1 if x1 > x0 else -1 if x1 < x0 else 0)
        ay = y1 - rr * (1 if y1 > y0 else -1 if y1 < y0 else 0)
        bx = x1 + rr * (1 if x2 > x1 else -1 if x2 < x1 else 0)
        by = y1 + rr * (1 if y2 > y1 else -1 if y2 < y1 else 0)
        out.append(f"L{_f(ax)},{_f(ay)}Q{_f(x1)},{_f(y1)} {_f(bx)},{_f(by)}")
    out.append(f"L{_f(points[-1][0])},{_f(points[-1][1])}")
    return "".join(out)


def _graph_svg(program: Program, m: Method, nodes: list[_Node], edges: list[_Edge], pal: _Palette) -> str:
    # slots: lane k of device k sits at slot 2k; a copy between lanes a and b at slot a+b
    for nd in nodes:
        a = pal.lane[nd.device]
        nd.slot = (a + pal.lane[nd.src_device]) if nd.src_device is not None else 2 * a
        bold = 1.1 if nd.kind == "delegate" else 1.0  # delegate labels are bold
        nd.w = min(256.0, max(96.0 if nd.kind != "copy" else 78.0, _text_w(nd.label) * bold + 22))
    used = sorted({nd.slot for nd in nodes} | {2 * k for k in range(len(pal.devices))})
    half = {s: max([nd.w / 2 for nd in nodes if nd.slot == s] or [60.0]) for s in used}

    def y_top(row: int) -> float:
        return _TOP + row * _ROW + (_ROW - _BOX_H) / 2

    def y_mid(row: int) -> float:
        return _TOP + row * _ROW + _ROW / 2

    def gap_y(row: int) -> float:
        return _TOP + (row + 1) * _ROW

    # which edges can be drawn straight: no box of a row in between meets the segment
    def clear(e: _Edge, cx: dict[int, float]) -> bool:
        s, t = nodes[e.src], nodes[e.dst]
        if t.row == s.row + 1:
            return True
        x0, y0 = cx[s.slot], y_top(s.row) + _BOX_H
        x1, y1 = cx[t.slot], y_top(t.row)
        for r in range(s.row + 1, t.row):
            nd = nodes[r]
            lo, hi = y_top(r) - 4, y_top(r) + _BOX_H + 4
            xa = x0 + (x1 - x0) * (lo - y0) / (y1 - y0)
            xb = x0 + (x1 - x0) * (hi - y0) / (y1 - y0)
            left, right = cx[nd.slot] - nd.w / 2 - 6, cx[nd.slot] + nd.w / 2 + 6
            if max(xa, xb) >= left and min(xa, xb) <= right:
                return False
        return True

    def place(zones: dict[int, float]) -> dict[int, float]:
        cx, x = {}, _GUTTER
        for s in used:
            x += zones.get(s, 0.0) + half[s]
            cx[s] = x
            x += half[s] + _PAD
        return cx

    def assign_tracks(routed: list[_Edge]):
        """Per target slot, greedy interval coloring: shorter edges first, on the inner tracks."""
        tracks: dict[int, list[list[tuple[int, int]]]] = {}
        track_of: dict[int, int] = {}
        order = sorted(range(len(routed)), key=lambda k: (nodes[routed[k].dst].row - nodes[routed[k].src].row,
                                                          nodes[routed[k].src].row, nodes[routed[k].dst].row))
        for k in order:
            e = routed[k]
            a, b = nodes[e.src].row, nodes[e.dst].row
            lanes = tracks.setdefault(nodes[e.dst].slot, [])
            for t, occupied in enumerate(lanes):
                if all(not (a < d and c < b) for c, d in occupied):
                    occupied.append((a, b))
                    track_of[k] = t
                    break
            else:
                lanes.append([(a, b)])
                track_of[k] = len(lanes) - 1
        return track_of, {s: len(ts) * _TRACK + 8 for s, ts in tracks.items()}

    # route the edges a straight line cannot take; making room for tracks moves the columns,
    # so check again until no straight edge meets a box (the routed set only grows)
    routed_ids: set[int] = set()
    routed: list[_Edge] = []
    track_of: dict[int, int] = {}
    zones: dict[int, float] = {}
    for _ in range(len(edges) + 1):
        cx = place(zones)
        more = [k for k, e in enumerate(edges) if k not in routed_ids and not clear(e, cx)]
        if not more:
            break
        routed_ids.update(more)
        routed = [e for k, e in enumerate(edges) if k in routed_ids]
        track_of, zones = assign_tracks(routed)

    info_x = max(cx[s] + half[s] for s in used) + 22
    info_w = max([_text_w(_clip(nd.info, 64), 11) for nd in nodes] or [0])
    width = info_x + info_w + 16
    height = _TOP + len(nodes) * _ROW + 16

    out = [f'<svg class="graph" width="{_f(width)}" height="{_f(height)}" viewBox="0 0 {_f(width)} {_f(height)}" '
           f'role="img" aria-label="instruction graph of method {_e(m.name)}">']
    out.append("<defs>")
    markers = {"plain": "#8a94a3"}
    for d in pal.devices:
        markers[pal.css_id(d)] = pal.color[d][1]
    for key, color in markers.items():
        out.append(f'<marker id="ah-{key}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                   f'markerUnits="userSpaceOnUse" orient="auto"><path d="M0,0L10,5L0,10z" fill="{color}"/></marker>')
    pairs = sorted({(pal.lane[nd.src_device], pal.lane[nd.device]) for nd in nodes if nd.kind == "copy"})
    for a, b in pairs:
        ca, cb = pal.color[pal.devices[a]][0], pal.color[pal.devices[b]][0]  # read left to right: source, destination
        out.append(f'<linearGradient id="cg-{a}-{b}" x1="0" y1="0" x2="1" y2="0">'
                   f'<stop offset="0.15" stop-color="{ca}"/><stop offset="0.85" stop-color="{cb}"/></linearGradient>')
    out.append("</defs>")

    # backgrounds: row stripes, lane bands and headers
    out.append('<g class="rows">')
    for nd in nodes:
        if nd.row % 2 == 1:
            out.append(f'<rect x="0" y="{_f(_TOP + nd.row * _ROW)}" width="{_f(width)}" height="{_f(_ROW)}" fill="#f6f7f9"/>')
    out.append("</g>")
    out.append('<g class="lanes">')
    for lane, d in enumerate(pal.devices):
        slot = 2 * lane
        fill, stroke, _ = pal.color[d]
        x0 = cx[slot] - half[slot] - 8
        out.append(f'<rect x="{_f(x0)}" y="{_f(_TOP - 30)}" width="{_f(2 * half[slot] + 16)}" height="{_f(height - _TOP + 22)}" '
                   f'rx="8" fill="{fill}" fill-opacity="0.22" stroke="{stroke}" stroke-opacity="0.25"/>')
        out.append(f'<text class="lane-head" x="{_f(cx[slot])}" y="{_f(_TOP - 12)}" text-anchor="middle" fill="{stroke}">{_e(d)}</text>')
    out.append("</g>")
    out.append(f'<text class="gutter-head" x="{_f(_GUTTER - 14)}" y="{_f(_TOP - 12)}" text-anchor="end">#</text>')

    # edges
    out.append('<g class="edges">')
    copy_out: dict[int, list[str]] = {}
    routed_k = {id(e): k for k, e in enumerate(routed)}
    for e in edges:
        s, t = nodes[e.src], nodes[e.dst]
        xs, xt = cx[s.slot], cx[t.slot]
        k = routed_k.get(id(e))
        if k is None:
            y0, y1 = y_top(s.row) + _BOX_H, y_top(t.row) - 1
            if abs(xs - xt) < 0.5 or t.row > s.row + 1:  # exactly the segment `clear` checked
                d = f"M{_f(xs)},{_f(y0)}L{_f(xt)},{_f(y1)}"
            else:
                c = (y1 - y0) * 0.5
                d = f"M{_f(xs)},{_f(y0)}C{_f(xs)},{_f(y0 + c)} {_f(xt)},{_f(y1 - c)} {_f(xt)},{_f(y1)}"
        else:
            tx = cx[t.slot] - half[t.slot] - 8 - track_of[k] * _TRACK
            gy = gap_y(s.row)
            pts = [(xs, y_top(s.row) + _BOX_H), (xs, gy), (tx, gy), (tx, y_mid(t.row)), (xt - t.w / 2 - 1, y_mid(t.row))]
            if abs(xs - tx) < 0.5:
                pts = [pts[0], (tx, y_mid(t.row)), pts[-1]]
            d = _rounded(pts)
        names = ", ".join(f"%{m.tensor(v).name or v}" for v in e.values)
        if s.kind == "copy":
            key = pal.css_id(s.device)  # a copy node's device is its destination
            color = pal.color[s.device][1]
            copy_out.setdefault(e.src, []).append(
                f'<path class="copy-edge" d="{d}" stroke="{color}" marker-end="url(#ah-{key})" '
                f'data-from="{_e(s.key)}" data-to="{_e(t.key)}">'
                f'<title>{_e(f"{s.label} #{s.index} -> {t.label}: {names}")}</title></path>')
        else:
            out.append(f'<path class="edge" d="{d}" marker-end="url(#ah-plain)" data-from="{_e(s.key)}" data-to="{_e(t.key)}">'
                       f'<title>{_e(f"{s.label} -> {t.label}: {names}")}</title></path>')
    # copy edges on top, grouped per copy with one label: the bytes the copy moves
    for pos, s in enumerate(nodes):
        if s.kind != "copy":
            continue
        paths = copy_out.get(pos, [])
        assert s.index is not None  # a copy node is an instruction
        ins = m.instructions[s.index]
        src = _tensor_ids(m, ins.args[0]) if ins.args else []
        nbytes = m.tensor(src[0]).nbytes if src else 0
        # the label sits beside the copy's outgoing stub, on the side no edge leaves towards
        right_first = any(cx[nodes[e.dst].slot] - (half[nodes[e.dst].slot] + 8 if id(e) in routed_k else 0) > cx[s.slot] + 1
                          for e in edges if e.src == pos)
        lx = cx[s.slot] + (-6 if right_first else 6)
        anchor = "end" if right_first else "start"
        ly = y_top(s.row) + _BOX_H + 11.5
        out.append(f'<g class="copy-out" data-instruction="{s.index}" data-bytes="{nbytes}" data-from="{_e(s.key)}">')
        out.extend(paths)
        out.append(f'<text class="edge-label" x="{_f(lx)}" y="{_f(ly)}" text-anchor="{anchor}" fill="{pal.color[s.device][1]}">'
                   f'{_e(fmt_bytes(nbytes))}<title>{_e(f"{s.label} moves {nbytes:,} bytes")}</title></text>')
        out.append("</g>")
    out.append("</g>")

    # nodes
    out.append('<g class="nodes">')
    for nd in nodes:
        x, y = cx[nd.slot] - nd.w / 2, y_top(nd.row)
        fill, stroke, ink = pal.color[nd.device]
        cls = f"node {nd.kind}"
        attrs = (f'class="{cls}" data-key="{_e(nd.key)}" data-device="{_e(nd.device)}"'
                 + (f' data-instruction="{nd.index}"' if nd.index is not None else ""))
        out.append(f"<g {attrs}><title>{_e(nd.title)}</title>")
        if nd.kind == "copy":
            a, b = pal.lane[nd.src_device], pal.lane[nd.device]
            out.append(f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(nd.w)}" height="{_f(_BOX_H)}" rx="{_f(_BOX_H / 2)}" '
                       f'fill="url(#cg-{a}-{b})" stroke="{stroke}" stroke-width="1.4" stroke-dasharray="4 2"/>')
        elif nd.kind in ("input", "output", "state", "update"):
            out.append(f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(nd.w)}" height="{_f(_BOX_H)}" rx="3" '
                       f'fill="#ffffff" stroke="{stroke}" stroke-width="1.6"/>')
            out.append(f'<rect x="{_f(x)}" y="{_f(y)}" width="7" height="{_f(_BOX_H)}" rx="2" fill="{stroke}"/>')
        else:
            out.append(f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(nd.w)}" height="{_f(_BOX_H)}" rx="5" '
                       f'fill="{fill}" stroke="{stroke}" stroke-width="{"1.8" if nd.kind == "delegate" else "1"}"/>')
        weight = ' font-weight="600"' if nd.kind == "delegate" else ""
        out.append(f'<text x="{_f(cx[nd.slot] + (3 if nd.kind in ("input", "output", "state", "update") else 0))}" '
                   f'y="{_f(y + _BOX_H / 2 + 4)}" text-anchor="middle" fill="{ink}"{weight}>{_e(nd.label)}</text>')
        out.append("</g>")
        num = f"#{nd.index}" if nd.index is not None else ("in" if nd.kind in ("input", "state") else "out")
        out.append(f'<text class="rownum" x="{_f(_GUTTER - 14)}" y="{_f(y + _BOX_H / 2 + 4)}" text-anchor="end">{_e(num)}</text>')
        if nd.info:
            out.append(f'<text class="info" x="{_f(info_x)}" y="{_f(y + _BOX_H / 2 + 4)}">{_e(_clip(nd.info, 64))}</text>')
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _legend(pal: _Palette, nodes: list[_Node]) -> str:
    items = []
    for d in pal.devices:
        fill, stroke, _ = pal.color[d]
        items.append(f'<span class="key"><span class="sw" style="background:{fill};border-color:{stroke}"></span>{_e(d)}</span>')
    pairs = sorted({(pal.lane[nd.src_device], pal.lane[nd.device]) for nd in nodes if nd.kind == "copy"})
    for a, b in pairs:
        ca, cb = pal.color[pal.devices[a]], pal.color[pal.devices[b]]
        items.append(f'<span class="key"><span class="sw copy" style="background:linear-gradient(90deg,{ca[0]},{cb[0]});'
                     f'border-color:{cb[1]}"></span>copy {_e(pal.devices[a])} \u2192 {_e(pal.devices[b])}</span>')
    items.append('<span class="key"><span class="sw io"></span>method input / output</span>')
    if any(nd.kind == "delegate" for nd in nodes):
        items.append('<span class="key"><span class="sw dl"></span>delegate call (bold outline)</span>')
    items.append('<span class="key"><span class="ln"></span>data dependency</span>')
    if pairs:
        items.append('<span class="key"><span class="ln cp"></span>copy result (in the destination\u2019s color), labelled with the bytes moved</span>')
    return '<div class="legend">' + "".join(items) + "</div>"


# ---------------------------------------------------------------- memory timelines


def _lifetimes(m: Method) -> dict[int, tuple[int, int]]:
    """(first, last) instruction of every planned value: the lifetimes the planner used."""
    return {vid: life for vid, life in value_lifetimes(m).items() if m.tensor(vid).storage == "planned"}


def _byte_ticks(size: int) -> list[int]:
    if size <= 0:
        return [0]
    # powers of two read better for memory: pick 2^k steps giving 4..8 ticks
    step = 1
    while size / step > 6:
        step *= 2
    return list(range(0, size + 1, step))


def _timeline_svg(program: Program, m: Method, bi: int, life: dict[int, tuple[int, int]], pal: _Palette,
                  kinds: list[tuple[str, Device, Device | None]]) -> str:
    buf = m.buffers[bi]
    n = len(m.instructions)
    vids = sorted((vid for vid, (s, e) in life.items() if _plan(m.tensor(vid)).buffer == bi),
                  key=lambda v: (_plan(m.tensor(v)).offset, life[v][0], v))
    cols = n + 2  # -1 .. n
    cw = max(7.0, min(72.0, 960.0 / cols))
    left, top = 78.0, 34.0
    plot_h = float(max(170, min(320, 70 + 26 * len(vids))))
    plot_w = cw * cols
    width, height = left + plot_w + 150, top + plot_h + 58
    size = max(buf.size, max([_plan(m.tensor(v)).offset + m.tensor(v).nbytes for v in vids] or [0]), 1)
    scale = plot_h / size

    def x_of(i: float) -> float:
        return left + (i + 1) * cw

    dev = buf.device
    out = [f'<svg class="timeline" data-buffer="{bi}" data-device="{_e(dev)}" width="{_f(width)}" height="{_f(height)}" '
           f'viewBox="0 0 {_f(width)} {_f(height)}" role="img" aria-label="memory plan of buffer {bi}">']
    out.append(_tl_defs(pal, kinds, bi))
    # instruction strip: which device each instruction runs on, so blocks line up with the graph
    out.append('<g class="strip">')
    for i, (kind, d, sd) in enumerate(kinds):
        geo = f'x="{_f(x_of(i) + 0.5)}" y="{_f(top - 13)}" width="{_f(max(1.0, cw - 1))}" height="7" rx="1.5"'
        if kind == "copy":
            out.append(f'<rect {geo} fill="url(#tg{bi}-{pal.lane[sd]}-{pal.lane[d]})"><title>#{i} copy {_e(sd)} -> {_e(d)}</title></rect>')
        else:
            out.append(f'<rect {geo} fill="{pal.color[d][1]}" fill-opacity="0.8"><title>#{i} {_e(kind)} on {_e(d)}</title></rect>')
    out.append("</g>")
    # grid and axes
    out.append(f'<rect class="plot" x="{_f(left)}" y="{_f(top)}" width="{_f(plot_w)}" height="{_f(plot_h)}" fill="#fbfcfd" stroke="#cbd2da"/>')
    out.append('<g class="grid">')
    for i in range(0, n + 1):
        x = x_of(i)
        out.append(f'<line x1="{_f(x)}" y1="{_f(top)}" x2="{_f(x)}" y2="{_f(top + plot_h)}" stroke="#eef1f4"/>')
    every = next(k for k in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10**9) if k * cw >= 26)
    ticks = [(-1, "start")] + [(i, str(i)) for i in range(0, n, every)] + [(n, "end")]
    kept: list[tuple[float, float, str]] = []  # (left, right, text), left to right without overlap
    for i, label in ticks:
        c = x_of(i) + cw / 2
        half_w = _text_w(label, 10.5) / 2
        while kept and kept[-1][1] + 4 > c - half_w:
            if i != n:
                break
            kept.pop()  # "end" wins over the number before it
        if kept and kept[-1][1] + 4 > c - half_w:
            continue
        kept.append((c - half_w, c + half_w, label))
    for lo, hi, label in kept:
        out.append(f'<text class="tick" x="{_f((lo + hi) / 2)}" y="{_f(top + plot_h + 14)}" text-anchor="middle">{label}</text>')
    for b in _byte_ticks(size):
        y = top + b * scale
        out.append(f'<line x1="{_f(left - 4)}" y1="{_f(y)}" x2="{_f(left + plot_w)}" y2="{_f(y)}" stroke="#e5e9ee"/>')
        out.append(f'<text class="tick" x="{_f(left - 7)}" y="{_f(y + 4)}" text-anchor="end">{_e(fmt_bytes(b))}</text>')
    out.append("</g>")
    out.append(f'<text class="axis" x="{_f(left + plot_w / 2)}" y="{_f(top + plot_h + 34)}" text-anchor="middle">'
               f'instruction index (start = before the first instruction, end = after the last)</text>')
    out.append(f'<text class="axis" transform="translate(16 {_f(top + plot_h / 2)}) rotate(-90)" text-anchor="middle">byte offset \u2193</text>')

    # blocks
    out.append(f'<g class="values" data-y0="{_f(top)}" data-scale="{scale!r}">')
    for k, vid in enumerate(vids):
        v = m.tensor(vid)
        offset = _plan(v).offset
        s, e = life[vid]
        fill, stroke = _BLOCK_COLORS[k % len(_BLOCK_COLORS)]
        x, w = x_of(s) + 1, (e - s + 1) * cw - 2
        y, h = top + offset * scale, v.nbytes * scale
        role = " (method input)" if vid in m.inputs else (" (method output)" if vid in m.outputs else "")
        tip = (f"%{v.name or vid}{role}\n{_shape(v)} on {v.device}\n{fmt_bytes(v.nbytes)} ({v.nbytes:,} B) at offset {offset:,}\n"
               f"live from {'start' if s < 0 else '#' + str(s)} to {'end' if e >= n else '#' + str(e)}")
        out.append(f'<rect class="value" data-vid="{vid}" data-offset="{offset}" data-nbytes="{v.nbytes}" '
                   f'data-start="{s}" data-end="{e}" '
                   f'x="{_f(x)}" y="{y!r}" width="{_f(max(w, 1.0))}" height="{h!r}" fill="{fill}" stroke="{stroke}" '
                   f'stroke-width="0.8"><title>{_e(tip)}</title></rect>')
        label = v.name or f"v{vid}"
        fit = int((w - 8) / (10.5 * 0.58))
        if fit < len(label):
            label = _clip(label, fit) if fit >= 4 else ""
        if h >= 14 and label:
            out.append(f'<text class="vlabel" x="{_f(x + 4)}" y="{_f(y + min(h / 2 + 4, 14))}">{_e(label)}</text>')
    out.append("</g>")
    # the lower bound: peak bytes live at one time on this device
    lb = m.lower_bounds.get(str(dev))
    same_dev = [b for b in m.buffers[1:] if b.device == dev]
    if lb is not None and len(same_dev) == 1:
        y = top + lb * scale
        out.append(f'<line class="lower-bound" x1="{_f(left)}" y1="{_f(y)}" x2="{_f(left + plot_w + 8)}" y2="{_f(y)}" '
                   f'stroke="#dc2626" stroke-width="1.5" stroke-dasharray="6 3"/>')
        out.append(f'<text class="lb" x="{_f(left + plot_w + 12)}" y="{_f(y + 4)}" fill="#dc2626">lower bound</text>')
        out.append(f'<text class="lb" x="{_f(left + plot_w + 12)}" y="{_f(y + 17)}" fill="#dc2626">{_e(fmt_bytes(lb))}</text>')
    out.append(f'<text class="tick" x="{_f(left + plot_w + 12)}" y="{_f(top + 4)}">offset 0</text>')
    if not vids:
        out.append(f'<text class="axis" x="{_f(left + plot_w / 2)}" y="{_f(top + plot_h / 2)}" text-anchor="middle">no planned values</text>')
    out.append("</svg>")
    return "\n".join(out)


# ---------------------------------------------------------------- summary tables


def _ranges(ints: list[int]) -> str:
    """[0, 1, 2, 5] -> '0–2, 5'."""
    out, k = [], 0
    while k < len(ints):
        j = k
        while j + 1 < len(ints) and ints[j + 1] == ints[j] + 1:
            j += 1
        out.append(str(ints[k]) if j == k else f"{ints[k]}–{ints[j]}")
        k = j + 1
    return ", ".join(out)


def _summary(program: Program, m: Method, life) -> str:
    rep = copy_report(program, m.name)
    out = ['<div class="tables">']
    out.append('<div class="tbl"><h3>Copies</h3>')
    total = sum(r.nbytes for r in rep.rows)
    out.append('<table class="copy-totals"><thead><tr><th>direction</th><th class="num">copies</th>'
               '<th class="num">size</th><th class="num">bytes</th></tr></thead><tbody>')
    for d, (n, b) in rep.totals().items():
        out.append(f'<tr class="total" data-direction="{d}" data-count="{n}" data-bytes="{b}"><td>{d}</td><td class="num">{n}</td>'
                   f'<td class="num">{_e(fmt_bytes(b))}</td><td class="num">{b:,}</td></tr>')
    out.append(f'<tr class="total all" data-count="{len(rep.rows)}" data-bytes="{total}"><td>all</td><td class="num">{len(rep.rows)}</td>'
               f'<td class="num">{_e(fmt_bytes(total))}</td><td class="num">{total:,}</td></tr></tbody></table>')
    if rep.rows:
        out.append('<table class="copies"><thead><tr><th>#</th><th>dir</th><th>src → dst</th><th>tensor</th>'
                   '<th>value</th><th class="num">bytes</th></tr></thead><tbody>')
        for r in rep.rows:
            out.append(f'<tr data-instruction="{r.instruction}" data-bytes="{r.nbytes}"><td>{r.instruction}</td><td>{_e(r.direction)}</td>'
                       f'<td>{_e(r.src)} → {_e(r.dst)}</td><td>{_e(r.dtype)}[{_e(", ".join(map(str, r.shape)))}]</td>'
                       f'<td>%{_e(r.value)}</td><td class="num">{_e(fmt_bytes(r.nbytes))}</td></tr>')
        out.append("</tbody></table>")
    else:
        out.append('<p class="none">No copies: every instruction reads its inputs where they already are.</p>')
    out.append("</div>")

    out.append('<div class="tbl"><h3>Planned buffers</h3><table class="buffers"><thead><tr><th>buffer</th><th>device</th>'
               '<th class="num">values</th><th class="num">size</th><th class="num">bytes</th></tr></thead><tbody>')
    counts: dict[int, int] = {}
    for vid in life:
        counts[_plan(m.tensor(vid)).buffer] = counts.get(_plan(m.tensor(vid)).buffer, 0) + 1
    for bi, b in enumerate(m.buffers):
        if bi == 0:
            continue
        out.append(f'<tr data-buffer="{bi}" data-device="{_e(b.device)}" data-size="{b.size}"><td>{bi}</td><td>{_e(b.device)}</td>'
                   f'<td class="num">{counts.get(bi, 0)}</td><td class="num">{_e(fmt_bytes(b.size))}</td><td class="num">{b.size:,}</td></tr>')
    if len(m.buffers) <= 1:
        out.append('<tr><td colspan="5">no planned buffers</td></tr>')
    out.append("</tbody></table>")
    out.append(_devices_table(program, m))
    out.append("</div>")
    if m.device_map:
        out.append('<div class="tbl"><h3>Device map</h3><p class="note">pass it back as <code>device_map=</code> '
                   'to compile the same split</p><table class="device-map"><thead><tr><th>module</th><th>device</th>'
                   '</tr></thead><tbody>')
        for path, dev in m.device_map.items():
            out.append(f'<tr data-module="{_e(path)}" data-device="{_e(dev)}"><td>{_e(path or "(whole model)")}</td>'
                       f'<td>{_e(dev)}</td></tr>')
        out.append("</tbody></table></div>")

    out.append('<div class="tbl"><h3>Program</h3><table class="program"><tbody>')
    out.append(f"<tr><td>methods</td><td>{_e(', '.join(program.methods))}</td></tr>")
    out.append(f"<tr><td>instructions</td><td>{len(m.instructions)}</td></tr>")
    out.append(f"<tr><td>values</td><td>{len(m.values)}</td></tr>")
    used = sorted({ins.delegate for ins in m.instructions if isinstance(ins, DelegateCall)})
    groups: dict[tuple, list[int]] = {}
    for k in used:
        if 0 <= k < len(program.delegates):
            d = program.delegates[k]
            groups.setdefault((d.backend_id, d.compile_specs), []).append(k)
    for (backend, specs), ks in groups.items():
        spec = ", ".join(f"{key}={v.decode(errors='replace')}" for key, v in specs)
        what = f"delegate{'s' if len(ks) > 1 else ''} {_ranges(ks)}"
        out.append(f"<tr><td>{_e(what)}</td><td>{_e(backend)}" + (f" ({_e(spec)})" if spec else "") + "</td></tr>")
    seg = sum(len(memoryview(s)) for s in program.segments)
    out.append(f"<tr><td>segments</td><td>{len(program.segments)} ({_e(fmt_bytes(seg))})</td></tr>")
    if m.runtime_allocating_ops:
        out.append(f"<tr><td>allocate at run time</td><td>{_e(', '.join(m.runtime_allocating_ops))}</td></tr>")
    out.append("</tbody></table></div>")
    out.append("</div>")
    return "\n".join(out)


def _devices_table(program: Program, m: Method) -> str:
    """Per device: the planned buffers against the planner's lower bound, and what loading
    allocates there (weights included) against the budget compile checked it against."""
    out = ['<h3>Per device</h3><table class="devices"><thead><tr><th>device</th><th class="num">buffers</th>'
           '<th class="num">planned</th><th class="num">lower bound</th><th class="num">plan / bound</th>'
           '<th class="num">weights</th><th class="num">total</th><th class="num">budget</th></tr></thead><tbody>']
    buffers: dict[str, int] = {}
    for b in m.buffers[1:]:
        buffers[str(b.device)] = buffers.get(str(b.device), 0) + 1
    memory = device_memory(program, m)
    for d in sorted(set(memory) | set(m.lower_bounds)):
        row = memory.get(d, {"planned": 0, "weights": 0, "total": 0, "budget": None})
        planned, lb, budget = row["planned"] or 0, m.lower_bounds.get(d), row["budget"]
        ratio = f"{planned / lb:.2f}\u00d7" if lb else "\u2013"
        lb_text = fmt_bytes(lb) if lb is not None else "\u2013"
        use = f" ({100 * (row['total'] or 0) / budget:.0f}%)" if budget else ""
        out.append(
            f'<tr data-device="{_e(d)}" data-planned="{planned}" data-weights="{row["weights"]}" '
            f'data-total="{row["total"]}" data-budget="{"" if budget is None else budget}"><td>{_e(d)}</td>'
            f'<td class="num">{buffers.get(d, 0)}</td><td class="num">{_e(fmt_bytes(planned))}</td>'
            f'<td class="num">{_e(lb_text)}</td><td class="num">{ratio}</td>'
            f'<td class="num">{_e(fmt_bytes(row["weights"] or 0))}</td><td class="num">{_e(fmt_bytes(row["total"] or 0))}</td>'
            f'<td class="num">{_e(fmt_bytes(budget) + use if budget is not None else chr(0x2013))}</td></tr>')
    out.append("</tbody></table>")
    return "\n".join(out)


# ---------------------------------------------------------------- page

_CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, "Segoe UI", Helvetica, Arial, "Liberation Sans", "DejaVu Sans", sans-serif;
       margin: 0; color: #1f2933; background: #ffffff; }
header { padding: 18px 28px 10px; border-bottom: 1px solid #e4e7eb; }
h1 { font-size: 21px; margin: 0 0 4px; font-weight: 650; }
h1 code { font-size: 19px; }
h2 { font-size: 17px; margin: 0 0 6px; font-weight: 650; }
h3 { font-size: 14px; margin: 12px 0 6px; font-weight: 650; }
.sub { color: #52606d; margin: 0; }
.stats { display: flex; flex-wrap: wrap; gap: 8px 26px; margin-top: 10px; }
.stat b { display: block; font-size: 17px; }
.stat span { color: #616e7c; font-size: 12px; }
section { padding: 16px 28px 8px; border-bottom: 1px solid #e4e7eb; }
.note { color: #616e7c; font-size: 12.5px; margin: 0 0 8px; }
.scroll { overflow: auto; max-width: 100%; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 18px; font-size: 12.5px; margin: 4px 0 10px; color: #3e4c59; }
.key { display: inline-flex; align-items: center; gap: 6px; }
.sw { display: inline-block; width: 22px; height: 13px; border: 1px solid #888; border-radius: 3px; }
.sw.copy { border-radius: 7px; border-style: dashed; }
.sw.io { background: #fff; border: 1.6px solid #64748b; border-left: 6px solid #64748b; border-radius: 2px; }
.sw.dl { background: #eef2f6; border: 2px solid #475569; }
.ln { display: inline-block; width: 26px; border-top: 1.5px solid #8a94a3; }
.ln.cp { border-top: 2.4px solid #4d7c0f; }
svg text { font-family: system-ui, "Segoe UI", Helvetica, Arial, "Liberation Sans", "DejaVu Sans", sans-serif; font-size: 12px; }
svg .lane-head { font-size: 13px; font-weight: 650; }
svg .gutter-head, svg .rownum { fill: #7b8794; font-size: 11px; }
svg .info { fill: #52606d; font-size: 11px; }
svg .edge { fill: none; stroke: #8a94a3; stroke-width: 1.3; }
svg .copy-edge { fill: none; stroke-width: 2; }
svg .copy-edge:hover { stroke-width: 3; }
svg .edge-label { font-size: 10.5px; font-weight: 650; paint-order: stroke; stroke: #ffffff; stroke-width: 3px; }
svg .node:hover rect { filter: brightness(0.93); }
svg .edge:hover { stroke: #1f2933; stroke-width: 2.2; }
svg .tick { fill: #616e7c; font-size: 10.5px; }
svg .axis { fill: #3e4c59; font-size: 11.5px; }
svg .vlabel { fill: #1f2933; font-size: 10.5px; pointer-events: none; }
svg .lb { font-size: 11px; font-weight: 650; }
svg .value:hover { stroke: #111827; stroke-width: 1.6; }
.buffer { margin: 6px 0 16px; }
.buffer h3 { margin-bottom: 2px; }
.tables { display: flex; flex-wrap: wrap; gap: 10px 44px; align-items: flex-start; }
table { border-collapse: collapse; font-size: 12.5px; }
th, td { padding: 3px 10px 3px 0; text-align: left; border-bottom: 1px solid #edf0f3; white-space: nowrap; }
th { color: #52606d; font-weight: 600; border-bottom: 1.5px solid #cbd2d9; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tfoot td { color: #323f4b; font-weight: 600; border-bottom: none; }
tr.total.all td { border-top: 1.5px solid #cbd2d9; font-weight: 600; }
table.copy-totals { margin-bottom: 12px; }
.none { color: #52606d; }
footer { padding: 10px 28px 20px; color: #7b8794; font-size: 12px; }
"""


def _tl_defs(pal: _Palette, kinds, bi: int) -> str:
    pairs = sorted({(pal.lane[sd], pal.lane[d]) for k, d, sd in kinds if k == "copy"})
    if not pairs:
        return ""
    out = ["<defs>"]
    for a, b in pairs:
        ca, cb = pal.color[pal.devices[a]][1], pal.color[pal.devices[b]][1]
        out.append(f'<linearGradient id="tg{bi}-{a}-{b}" x1="0" y1="0" x2="1" y2="0"><stop offset="0" stop-color="{ca}"/>'
                   f'<stop offset="1" stop-color="{cb}"/></linearGradient>')
    out.append("</defs>")
    return "".join(out)


def render_html(program: Program, method: str | None = None) -> str:
    """The page for `method` (the first method when None) as one self-contained HTML string.
    An unknown method raises KeyError listing the methods."""
    if method is None:
        if not program.methods:
            raise KeyError("program has no methods to draw")
        method = next(iter(program.methods))
    m = program.method(method)  # KeyError with the method list

    nodes, edges = _build_graph(program, m)
    devices = {nd.device for nd in nodes} | {nd.src_device for nd in nodes if nd.src_device is not None}
    devices |= {b.device for b in m.buffers[1:]}
    pal = _Palette(devices)
    life = _lifetimes(m)
    kinds = [(nd.kind, nd.device, nd.src_device) for nd in nodes if nd.index is not None]
    rep = copy_report(program, m.name)
    tot = rep.totals()

    p = ['<!DOCTYPE html>', '<html lang="en">', "<head>", '<meta charset="utf-8"/>',
         '<meta name="viewport" content="width=device-width, initial-scale=1"/>',
         f"<title>ferry \u00b7 {_e(m.name)} \u00b7 placement and memory plan</title>",
         f"<style>{_CSS}</style>", "</head>", "<body>"]
    p.append("<header>")
    p.append(f"<h1>Method <code>{_e(m.name)}</code>: placement, copies and memory plan</h1>")
    others = [n for n in program.methods if n != m.name]
    p.append('<p class="sub">' + (f"Other methods: {_e(', '.join(others))} (draw one with <code>ferry inspect FILE --html OUT --method NAME</code>)."
                                  if others else "The program has this one method.") + " Hover any node, edge or block for details.</p>")
    p.append('<div class="stats">')
    stats = [
        (str(len(m.instructions)), "instructions"),
        (str(sum(isinstance(i, DelegateCall) for i in m.instructions)), "delegate calls"),
        (str(len(rep.rows)), "copies"),
    ]
    for d in ("h2d", "d2h", "d2d"):
        if tot[d][0]:
            stats.append((fmt_bytes(tot[d][1]), f"{d} ({tot[d][0]} cop{'y' if tot[d][0] == 1 else 'ies'})"))
    for bi, b in enumerate(m.buffers):
        if bi:
            stats.append((fmt_bytes(b.size), f"buffer {bi} on {b.device}"))
    for val, what in stats:
        p.append(f'<div class="stat"><b>{_e(val)}</b><span>{_e(what)}</span></div>')
    p.append("</div></header>")

    p.append('<section id="graph" class="graph-section">')
    p.append("<h2>1 \u00b7 Instructions by device</h2>")
    p.append('<p class="note">One row per instruction in program order; one lane per device. Copies sit between the lanes '
             "they connect; the edges leaving a copy carry the bytes it moves. Edges that would cross a node run on "
             "tracks beside the lane of the instruction that reads the value.</p>")
    p.append(_legend(pal, nodes))
    p.append('<div class="scroll">' + _graph_svg(program, m, nodes, edges, pal) + "</div>")
    p.append("</section>")

    p.append('<section id="memory" class="memory-section">')
    p.append("<h2>2 \u00b7 Memory plan</h2>")
    p.append('<p class="note">Each planned tensor is a block at its offset in the buffer (y, growing downwards), spanning '
             "its lifetime (x: from the instruction that writes it to the last one that reads it; method inputs from the "
             "start, outputs to the end). The strip above each plot shows where every instruction runs. The red line "
             "is the lower bound: the peak of bytes live at one time, which no plan can beat.</p>")
    planned = [bi for bi in range(1, len(m.buffers))]
    if not planned:
        p.append('<p class="none">This method has no planned buffers.</p>')
    for bi in planned:
        b = m.buffers[bi]
        nvals = sum(1 for v in life if _plan(m.tensor(v)).buffer == bi)
        lb = m.lower_bounds.get(str(b.device))
        head = f"Buffer {bi} on {b.device} \u00b7 {fmt_bytes(b.size)} ({b.size:,} B) \u00b7 {nvals} value{'s' if nvals != 1 else ''}"
        if lb is not None:
            head += f" \u00b7 lower bound on {b.device}: {fmt_bytes(lb)} ({lb:,} B)"
            if lb:
                same = sum(x.size for x in m.buffers[1:] if x.device == b.device)
                head += f", plan is {same / lb:.2f}\u00d7 the bound"
        p.append(f'<div class="buffer" data-buffer="{bi}"><h3>{_e(head)}</h3>')
        p.append('<div class="scroll">' + _timeline_svg(program, m, bi, life, pal, kinds) + "</div></div>")
    p.append("</section>")

    p.append('<section id="summary" class="summary-section">')
    p.append("<h2>3 \u00b7 Summary</h2>")
    p.append(_summary(program, m, life))
    p.append("</section>")
    p.append("<footer>Written by ferry (<code>ferry inspect FILE --html OUT</code>). Self-contained: no scripts, "
             "no external resources.</footer>")
    p.append("</body>")
    p.append("</html>")
    return "\n".join(p) + "\n"


def write_html(program: Program, path, method: str | None = None) -> Path:
    """Render `method` (the first one when None) and write the page to `path`; returns the path."""
    text = render_html(program, method)
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    return path
