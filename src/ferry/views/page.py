"""A one-page HTML picture of a compiled method: where every instruction runs, where the
copies are and how many bytes they move, and how each per-device buffer is packed.

`render_html(program, method)` returns the page as a string; `write_html` writes it to a file
(`ferry inspect FILE --html out.html`). The page is self-contained: inline CSS and inline SVG,
no scripts, no fonts or styles fetched from anywhere, so it opens offline and can be attached
to a bug report. Tooltips are SVG <title> elements (hover a node, an edge or a block).

Three sections:
  * graph:   one row per instruction in program order, one lane per device, copies between
             the lanes they connect (`graph` the data, `layout` the geometry, `svg` the drawing);
  * memory:  per planned buffer, each planned tensor as a block spanning its lifetime at its
             offset, with the planner's lower bound marked (`timeline`);
  * summary: the copy report and the buffers per device (`summary`).

The output is deterministic: the same program gives the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from ferry.program import Program
from ferry.program.report import CopyReport, copy_report
from ferry.program.schema import DelegateCall, Method
from ferry.views.facts import fmt_bytes, planned_lifetimes
from ferry.views.graph import build_graph
from ferry.views.layout import layout_graph
from ferry.views.markup import esc
from ferry.views.palette import Palette
from ferry.views.style import CSS
from ferry.views.summary import summary
from ferry.views.svg import graph_svg, legend
from ferry.views.timeline import memory_section

__all__ = ["render_html", "write_html"]

_GRAPH_NOTE = ("One row per instruction in program order; one lane per device. Copies sit between the lanes "
               "they connect; the edges leaving a copy carry the bytes it moves. Edges that would cross a node run on "
               "tracks beside the lane of the instruction that reads the value.")
_MEMORY_NOTE = ("Each planned tensor is a block at its offset in the buffer (y, growing downwards), spanning "
                "its lifetime (x: from the instruction that writes it to the last one that reads it; method inputs from the "
                "start, outputs to the end). The strip above each plot shows where every instruction runs. The red line "
                "is the lower bound: the peak of bytes live at one time, which no plan can beat.")


def _stats(m: Method, rep: CopyReport) -> list[tuple[str, str]]:
    """(value, what) pairs for the header: counts, bytes copied per direction, buffer sizes."""
    stats = [
        (str(len(m.instructions)), "instructions"),
        (str(sum(isinstance(i, DelegateCall) for i in m.instructions)), "delegate calls"),
        (str(len(rep.rows)), "copies"),
    ]
    for d, (n, b) in rep.totals().items():
        if n:
            stats.append((fmt_bytes(b), f"{d} ({n} cop{'y' if n == 1 else 'ies'})"))
    stats += [(fmt_bytes(b.size), f"buffer {bi} on {b.device}") for bi, b in enumerate(m.buffers[1:], start=1)]
    return stats


def _header(program: Program, m: Method, rep: CopyReport) -> list[str]:
    others = [n for n in program.methods if n != m.name]
    which = (f"Other methods: {esc(', '.join(others))} (draw one with <code>ferry inspect FILE --html OUT --method NAME</code>)."
             if others else "The program has this one method.")
    out = ["<header>", f"<h1>Method <code>{esc(m.name)}</code>: placement, copies and memory plan</h1>",
           f'<p class="sub">{which} Hover any node, edge or block for details.</p>', '<div class="stats">']
    out += [f'<div class="stat"><b>{esc(val)}</b><span>{esc(what)}</span></div>' for val, what in _stats(m, rep)]
    return out + ["</div></header>"]


def _section(sid: str, title: str, note: str | None, parts: list[str]) -> list[str]:
    head = [f'<section id="{sid}" class="{sid}-section">', f"<h2>{title}</h2>"]
    return head + ([f'<p class="note">{note}</p>'] if note else []) + parts + ["</section>"]


def render_html(program: Program, method: str | None = None) -> str:
    """The page for `method` (the first method when None) as one self-contained HTML string.
    An unknown method raises KeyError listing the methods."""
    if method is None:
        if not program.methods:
            raise KeyError("program has no methods to draw")
        method = next(iter(program.methods))
    m = program.method(method)  # KeyError with the method list

    graph = build_graph(program, m)
    pal = Palette(graph.devices() | {b.device for b in m.buffers[1:]})
    layout = layout_graph(graph.nodes, graph.edges, pal.lane)
    instructions = [nd for nd in graph.nodes if nd.index is not None]
    life = planned_lifetimes(m)
    rep = copy_report(program, m.name)

    p = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8"/>',
         '<meta name="viewport" content="width=device-width, initial-scale=1"/>',
         f"<title>ferry \u00b7 {esc(m.name)} \u00b7 placement and memory plan</title>",
         f"<style>{CSS}</style>", "</head>", "<body>"]
    p += _header(program, m, rep)
    p += _section("graph", "1 \u00b7 Instructions by device", _GRAPH_NOTE,
                  [legend(graph, pal), '<div class="scroll">' + graph_svg(m, graph, layout, pal) + "</div>"])
    p += _section("memory", "2 \u00b7 Memory plan", _MEMORY_NOTE, memory_section(m, life, pal, instructions))
    p += _section("summary", "3 \u00b7 Summary", None, [summary(program, m, rep, life)])
    p += ["<footer>Written by ferry (<code>ferry inspect FILE --html OUT</code>). Self-contained: no scripts, "
          "no external resources.</footer>", "</body>", "</html>"]
    return "\n".join(p) + "\n"


def write_html(program: Program, path, method: str | None = None) -> Path:
    """Render `method` (the first one when None) and write the page to `path`; returns the path."""
    text = render_html(program, method)
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    return path
