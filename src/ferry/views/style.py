"""The page's style sheet, inline in the page (nothing is fetched)."""

__all__ = ["CSS"]

CSS = """
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
