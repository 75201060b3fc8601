"""The memory timeline of each planned buffer: every planned tensor a block spanning its
lifetime (x: instruction index) at its offset (y: byte offset, growing downwards), the
planner's lower bound (the peak of bytes live at once) marked, and a strip above showing where
each instruction runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.program.schema import Method
from ferry.views.facts import fmt_bytes, plan_of, shape_text
from ferry.views.graph import Node
from ferry.views.markup import clip, esc, num, text_width
from ferry.views.palette import BLOCK_COLORS, Palette

__all__ = ["Block", "byte_ticks", "memory_section", "timeline_blocks", "timeline_svg"]

Lifetimes = dict[int, tuple[int, int]]


@dataclass(frozen=True)
class Block:
    """A planned value in its buffer: bytes [offset, offset + nbytes), live from instruction
    `start` to `end` (-1: a method input, alive from the start; n: an output, to the end)."""

    vid: int
    offset: int
    nbytes: int
    start: int
    end: int


def timeline_blocks(m: Method, buffer: int, life: Lifetimes) -> list[Block]:
    """The blocks of one buffer, by offset, then lifetime."""
    blocks = [Block(vid, plan_of(m.tensor(vid)).offset, m.tensor(vid).nbytes, *life[vid])
              for vid in life if plan_of(m.tensor(vid)).buffer == buffer]
    return sorted(blocks, key=lambda b: (b.offset, b.start, b.vid))


def byte_ticks(size: int) -> list[int]:
    """Offsets to mark on the byte axis: powers of two read better for memory, 2^k steps giving 4..8 ticks."""
    if size <= 0:
        return [0]
    step = 1
    while size / step > 6:
        step *= 2
    return list(range(0, size + 1, step))


@dataclass(frozen=True)
class _Frame:
    """The geometry of one plot: a column per instruction plus 'start' and 'end'."""

    n: int  # instructions
    cw: float  # column width
    plot_h: float
    size: int  # bytes the plot's height stands for
    left: float = 78.0
    top: float = 34.0

    @property
    def plot_w(self) -> float:
        return self.cw * (self.n + 2)

    @property
    def scale(self) -> float:
        return self.plot_h / self.size

    def x_of(self, i: float) -> float:
        return self.left + (i + 1) * self.cw


def _frame(m: Method, buffer: int, blocks: list[Block]) -> _Frame:
    n = len(m.instructions)
    size = max(m.buffers[buffer].size, max([b.offset + b.nbytes for b in blocks] or [0]), 1)
    plot_h = float(max(170, min(320, 70 + 26 * len(blocks))))
    return _Frame(n, max(7.0, min(72.0, 960.0 / (n + 2))), plot_h, size)


def _index_ticks(f: _Frame) -> list[tuple[float, float, str]]:
    """(left, right, text) of the instruction labels that fit, left to right without overlap."""
    every = next(k for k in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10**9) if k * f.cw >= 26)
    ticks = [(-1, "start")] + [(i, str(i)) for i in range(0, f.n, every)] + [(f.n, "end")]
    kept: list[tuple[float, float, str]] = []
    for i, label in ticks:
        c = f.x_of(i) + f.cw / 2
        half_w = text_width(label, 10.5) / 2
        while kept and kept[-1][1] + 4 > c - half_w:
            if i != f.n:
                break
            kept.pop()  # "end" wins over the number before it
        if kept and kept[-1][1] + 4 > c - half_w:
            continue
        kept.append((c - half_w, c + half_w, label))
    return kept


def _gradients(buffer: int, instructions: list[Node], pal: Palette) -> str:
    pairs = pal.copy_pairs((nd.src_device, nd.device) for nd in instructions if nd.src_device is not None)
    if not pairs:
        return ""
    return "<defs>" + "".join(
        f'<linearGradient id="tg{buffer}-{a}-{b}" x1="0" y1="0" x2="1" y2="0"><stop offset="0" '
        f'stop-color="{pal.color[pal.devices[a]][1]}"/><stop offset="1" stop-color="{pal.color[pal.devices[b]][1]}"/>'
        f'</linearGradient>' for a, b in pairs) + "</defs>"


def _strip(f: _Frame, buffer: int, instructions: list[Node], pal: Palette) -> list[str]:
    """Which device each instruction runs on, so blocks line up with the graph; copies shaded
    from source to destination."""
    out = [_gradients(buffer, instructions, pal), '<g class="strip">']
    for i, nd in enumerate(instructions):
        geo = f'x="{num(f.x_of(i) + 0.5)}" y="{num(f.top - 13)}" width="{num(max(1.0, f.cw - 1))}" height="7" rx="1.5"'
        if nd.src_device is not None:
            fill = f"url(#tg{buffer}-{pal.lane[nd.src_device]}-{pal.lane[nd.device]})"
            out.append(f'<rect {geo} fill="{fill}"><title>#{i} copy {esc(nd.src_device)} -> {esc(nd.device)}</title></rect>')
        else:
            out.append(f'<rect {geo} fill="{pal.color[nd.device][1]}" fill-opacity="0.8"><title>#{i} {esc(nd.kind)} on '
                       f'{esc(nd.device)}</title></rect>')
    out.append("</g>")
    return out


def _axes(f: _Frame) -> list[str]:
    top, left, plot_w, plot_h = f.top, f.left, f.plot_w, f.plot_h
    out = [f'<rect class="plot" x="{num(left)}" y="{num(top)}" width="{num(plot_w)}" height="{num(plot_h)}" '
           f'fill="#fbfcfd" stroke="#cbd2da"/>', '<g class="grid">']
    for i in range(0, f.n + 1):
        x = num(f.x_of(i))
        out.append(f'<line x1="{x}" y1="{num(top)}" x2="{x}" y2="{num(top + plot_h)}" stroke="#eef1f4"/>')
    for lo, hi, label in _index_ticks(f):
        out.append(f'<text class="tick" x="{num((lo + hi) / 2)}" y="{num(top + plot_h + 14)}" '
                   f'text-anchor="middle">{label}</text>')
    for b in byte_ticks(f.size):
        y = top + b * f.scale
        out.append(f'<line x1="{num(left - 4)}" y1="{num(y)}" x2="{num(left + plot_w)}" y2="{num(y)}" stroke="#e5e9ee"/>')
        out.append(f'<text class="tick" x="{num(left - 7)}" y="{num(y + 4)}" text-anchor="end">{esc(fmt_bytes(b))}</text>')
    out.append("</g>")
    out.append(f'<text class="axis" x="{num(left + plot_w / 2)}" y="{num(top + plot_h + 34)}" text-anchor="middle">'
               f'instruction index (start = before the first instruction, end = after the last)</text>')
    out.append(f'<text class="axis" transform="translate(16 {num(top + plot_h / 2)}) rotate(-90)" text-anchor="middle">'
               f'byte offset \u2193</text>')
    return out


def _block(m: Method, f: _Frame, k: int, b: Block) -> list[str]:
    v = m.tensor(b.vid)
    fill, stroke = BLOCK_COLORS[k % len(BLOCK_COLORS)]
    x, w = f.x_of(b.start) + 1, (b.end - b.start + 1) * f.cw - 2
    y, h = f.top + b.offset * f.scale, b.nbytes * f.scale
    role = " (method input)" if b.vid in m.inputs else (" (method output)" if b.vid in m.outputs else "")
    tip = (f"%{v.name or b.vid}{role}\n{shape_text(v)} on {v.device}\n{fmt_bytes(b.nbytes)} ({b.nbytes:,} B) at offset "
           f"{b.offset:,}\nlive from {'start' if b.start < 0 else '#' + str(b.start)} to "
           f"{'end' if b.end >= f.n else '#' + str(b.end)}")
    out = [f'<rect class="value" data-vid="{b.vid}" data-offset="{b.offset}" data-nbytes="{b.nbytes}" '
           f'data-start="{b.start}" data-end="{b.end}" '
           f'x="{num(x)}" y="{y!r}" width="{num(max(w, 1.0))}" height="{h!r}" fill="{fill}" stroke="{stroke}" '
           f'stroke-width="0.8"><title>{esc(tip)}</title></rect>']
    label = v.name or f"v{b.vid}"
    fit = int((w - 8) / (10.5 * 0.58))
    if fit < len(label):
        label = clip(label, fit) if fit >= 4 else ""
    if h >= 14 and label:
        out.append(f'<text class="vlabel" x="{num(x + 4)}" y="{num(y + min(h / 2 + 4, 14))}">{esc(label)}</text>')
    return out


def _lower_bound(m: Method, f: _Frame, buffer: int) -> list[str]:
    """The peak of bytes live at one time on the buffer's device, when it is the device's only buffer."""
    dev = m.buffers[buffer].device
    lb = m.lower_bounds.get(str(dev))
    if lb is None or sum(b.device == dev for b in m.buffers[1:]) != 1:
        return []
    y, x = f.top + lb * f.scale, f.left + f.plot_w
    return [f'<line class="lower-bound" x1="{num(f.left)}" y1="{num(y)}" x2="{num(x + 8)}" y2="{num(y)}" '
            f'stroke="#dc2626" stroke-width="1.5" stroke-dasharray="6 3"/>',
            f'<text class="lb" x="{num(x + 12)}" y="{num(y + 4)}" fill="#dc2626">lower bound</text>',
            f'<text class="lb" x="{num(x + 12)}" y="{num(y + 17)}" fill="#dc2626">{esc(fmt_bytes(lb))}</text>']


def timeline_svg(m: Method, buffer: int, life: Lifetimes, pal: Palette, instructions: list[Node]) -> str:
    """The plot of one buffer; `instructions` are the graph's instruction nodes, in order."""
    blocks = timeline_blocks(m, buffer, life)
    f = _frame(m, buffer, blocks)
    width, height = f.left + f.plot_w + 150, f.top + f.plot_h + 58
    out = [f'<svg class="timeline" data-buffer="{buffer}" data-device="{esc(m.buffers[buffer].device)}" '
           f'width="{num(width)}" height="{num(height)}" viewBox="0 0 {num(width)} {num(height)}" role="img" '
           f'aria-label="memory plan of buffer {buffer}">']
    out += _strip(f, buffer, instructions, pal) + _axes(f)
    out.append(f'<g class="values" data-y0="{num(f.top)}" data-scale="{f.scale!r}">')
    for k, b in enumerate(blocks):
        out += _block(m, f, k, b)
    out.append("</g>")
    out += _lower_bound(m, f, buffer)
    out.append(f'<text class="tick" x="{num(f.left + f.plot_w + 12)}" y="{num(f.top + 4)}">offset 0</text>')
    if not blocks:
        out.append(f'<text class="axis" x="{num(f.left + f.plot_w / 2)}" y="{num(f.top + f.plot_h / 2)}" '
                   f'text-anchor="middle">no planned values</text>')
    out.append("</svg>")
    return "\n".join(out)


def _heading(m: Method, buffer: int, values: int) -> str:
    b = m.buffers[buffer]
    head = (f"Buffer {buffer} on {b.device} \u00b7 {fmt_bytes(b.size)} ({b.size:,} B) \u00b7 "
            f"{values} value{'s' if values != 1 else ''}")
    lb = m.lower_bounds.get(str(b.device))
    if lb is not None:
        head += f" \u00b7 lower bound on {b.device}: {fmt_bytes(lb)} ({lb:,} B)"
        if lb:
            same = sum(x.size for x in m.buffers[1:] if x.device == b.device)
            head += f", plan is {same / lb:.2f}\u00d7 the bound"
    return head


def memory_section(m: Method, life: Lifetimes, pal: Palette, instructions: list[Node]) -> list[str]:
    """A heading and a plot per planned buffer (buffer 0 stands for 'not planned')."""
    if len(m.buffers) <= 1:
        return ['<p class="none">This method has no planned buffers.</p>']
    out = []
    for bi in range(1, len(m.buffers)):
        values = sum(1 for vid in life if plan_of(m.tensor(vid)).buffer == bi)
        out.append(f'<div class="buffer" data-buffer="{bi}"><h3>{esc(_heading(m, bi, values))}</h3>')
        out.append('<div class="scroll">' + timeline_svg(m, bi, life, pal, instructions) + "</div></div>")
    return out
