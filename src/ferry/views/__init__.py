"""Pictures of a compiled program, from small parts that read one set of facts (`facts`):

- `text`: what `ferry inspect` prints (`program_summary`) and its JSON (`program_json`);
- the HTML page (`page.render_html`, `page.write_html`), assembled from `graph` (the nodes and
  edges, as data), `layout` (where they go, as data), `svg` (drawing the layout), `timeline`
  (the memory plan of each buffer) and `summary` (the tables).
"""

from ferry.views.facts import device_memory, fmt_bytes, owner
from ferry.views.page import render_html, write_html
from ferry.views.text import program_json, program_summary

__all__ = ["device_memory", "fmt_bytes", "owner", "program_json", "program_summary", "render_html", "write_html"]
