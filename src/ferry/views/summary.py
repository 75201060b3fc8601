"""The page's summary tables: the copy report, the planned buffers, each device against its
budget, the device map and the program's delegates and segments."""

from __future__ import annotations

from ferry.program import Program
from ferry.program.report import CopyReport
from ferry.program.schema import DelegateCall, Method
from ferry.views.facts import device_memory, fmt_bytes, plan_of
from ferry.views.markup import esc

__all__ = ["summary"]

_DASH = "\u2013"


def ranges(ints: list[int]) -> str:
    """[0, 1, 2, 5] -> '0–2, 5'."""
    out, k = [], 0
    while k < len(ints):
        j = k
        while j + 1 < len(ints) and ints[j + 1] == ints[j] + 1:
            j += 1
        out.append(str(ints[k]) if j == k else f"{ints[k]}{_DASH}{ints[j]}")
        k = j + 1
    return ", ".join(out)


def _copies(rep: CopyReport) -> list[str]:
    total = sum(r.nbytes for r in rep.rows)
    out = ['<div class="tbl"><h3>Copies</h3>',
           '<table class="copy-totals"><thead><tr><th>direction</th><th class="num">copies</th>'
           '<th class="num">size</th><th class="num">bytes</th></tr></thead><tbody>']
    for d, (n, b) in rep.totals().items():
        out.append(f'<tr class="total" data-direction="{d}" data-count="{n}" data-bytes="{b}"><td>{d}</td>'
                   f'<td class="num">{n}</td><td class="num">{esc(fmt_bytes(b))}</td><td class="num">{b:,}</td></tr>')
    n = len(rep.rows)
    out.append(f'<tr class="total all" data-count="{n}" data-bytes="{total}"><td>all</td><td class="num">{n}</td>'
               f'<td class="num">{esc(fmt_bytes(total))}</td><td class="num">{total:,}</td></tr></tbody></table>')
    if not rep.rows:
        out.append('<p class="none">No copies: every instruction reads its inputs where they already are.</p>')
        return out + ["</div>"]
    out.append('<table class="copies"><thead><tr><th>#</th><th>dir</th><th>src → dst</th><th>tensor</th>'
               '<th>value</th><th class="num">bytes</th></tr></thead><tbody>')
    for r in rep.rows:
        out.append(f'<tr data-instruction="{r.instruction}" data-bytes="{r.nbytes}"><td>{r.instruction}</td>'
                   f'<td>{esc(r.direction)}</td>'
                   f'<td>{esc(r.src)} → {esc(r.dst)}</td><td>{esc(r.dtype)}[{esc(", ".join(map(str, r.shape)))}]</td>'
                   f'<td>%{esc(r.value)}</td><td class="num">{esc(fmt_bytes(r.nbytes))}</td></tr>')
    return out + ["</tbody></table>", "</div>"]


def _buffers(m: Method, life) -> list[str]:
    out = ['<div class="tbl"><h3>Planned buffers</h3><table class="buffers"><thead><tr><th>buffer</th><th>device</th>'
           '<th class="num">values</th><th class="num">size</th><th class="num">bytes</th></tr></thead><tbody>']
    counts: dict[int, int] = {}
    for vid in life:
        counts[plan_of(m.tensor(vid)).buffer] = counts.get(plan_of(m.tensor(vid)).buffer, 0) + 1
    for bi, b in enumerate(m.buffers[1:], start=1):
        out.append(f'<tr data-buffer="{bi}" data-device="{esc(b.device)}" data-size="{b.size}"><td>{bi}</td>'
                   f'<td>{esc(b.device)}</td><td class="num">{counts.get(bi, 0)}</td>'
                   f'<td class="num">{esc(fmt_bytes(b.size))}</td><td class="num">{b.size:,}</td></tr>')
    if len(m.buffers) <= 1:
        out.append('<tr><td colspan="5">no planned buffers</td></tr>')
    out.append("</tbody></table>")
    return out


def _devices(program: Program, m: Method) -> str:
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
        ratio = f"{planned / lb:.2f}\u00d7" if lb else _DASH
        use = f" ({100 * (row['total'] or 0) / budget:.0f}%)" if budget else ""
        out.append(
            f'<tr data-device="{esc(d)}" data-planned="{planned}" data-weights="{row["weights"]}" '
            f'data-total="{row["total"]}" data-budget="{"" if budget is None else budget}"><td>{esc(d)}</td>'
            f'<td class="num">{buffers.get(d, 0)}</td><td class="num">{esc(fmt_bytes(planned))}</td>'
            f'<td class="num">{esc(fmt_bytes(lb) if lb is not None else _DASH)}</td><td class="num">{ratio}</td>'
            f'<td class="num">{esc(fmt_bytes(row["weights"] or 0))}</td><td class="num">{esc(fmt_bytes(row["total"] or 0))}</td>'
            f'<td class="num">{esc(fmt_bytes(budget) + use if budget is not None else _DASH)}</td></tr>')
    out.append("</tbody></table>")
    return "\n".join(out)


def _device_map(m: Method) -> list[str]:
    if not m.device_map:
        return []
    out = ['<div class="tbl"><h3>Device map</h3><p class="note">pass it back as <code>device_map=</code> '
           'to compile the same split</p><table class="device-map"><thead><tr><th>module</th><th>device</th>'
           '</tr></thead><tbody>']
    for path, dev in m.device_map.items():
        out.append(f'<tr data-module="{esc(path)}" data-device="{esc(dev)}"><td>{esc(path or "(whole model)")}</td>'
                   f'<td>{esc(dev)}</td></tr>')
    out.append("</tbody></table></div>")
    return out


def _program(program: Program, m: Method) -> list[str]:
    out = ['<div class="tbl"><h3>Program</h3><table class="program"><tbody>',
           f"<tr><td>methods</td><td>{esc(', '.join(program.methods))}</td></tr>",
           f"<tr><td>instructions</td><td>{len(m.instructions)}</td></tr>",
           f"<tr><td>values</td><td>{len(m.values)}</td></tr>"]
    groups: dict[tuple, list[int]] = {}  # delegates with the same backend and specs share a row
    for k in sorted({ins.delegate for ins in m.instructions if isinstance(ins, DelegateCall)}):
        if 0 <= k < len(program.delegates):
            d = program.delegates[k]
            groups.setdefault((d.backend_id, d.compile_specs), []).append(k)
    for (backend, specs), ks in groups.items():
        spec = ", ".join(f"{key}={v.decode(errors='replace')}" for key, v in specs)
        what = f"delegate{'s' if len(ks) > 1 else ''} {ranges(ks)}"
        out.append(f"<tr><td>{esc(what)}</td><td>{esc(backend)}" + (f" ({esc(spec)})" if spec else "") + "</td></tr>")
    seg = sum(len(memoryview(s)) for s in program.segments)
    out.append(f"<tr><td>segments</td><td>{len(program.segments)} ({esc(fmt_bytes(seg))})</td></tr>")
    if m.runtime_allocating_ops:
        out.append(f"<tr><td>allocate at run time</td><td>{esc(', '.join(m.runtime_allocating_ops))}</td></tr>")
    out.append("</tbody></table></div>")
    return out


def summary(program: Program, m: Method, rep: CopyReport, life) -> str:
    out = ['<div class="tables">', *_copies(rep)]
    out += _buffers(m, life) + [_devices(program, m), "</div>"]
    out += _device_map(m) + _program(program, m) + ["</div>"]
    return "\n".join(out)
