"""Writing HTML and SVG text: escaping, coordinates, clipped labels, the width of a label."""

from __future__ import annotations

import html

__all__ = ["clip", "esc", "num", "text_width"]


def esc(x) -> str:
    """Escape for text and attribute values alike."""
    return html.escape(str(x), quote=True)


def num(x: float) -> str:
    """A coordinate: at most two decimals, no trailing zeros (stable across platforms)."""
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def clip(s: str, n: int) -> str:
    """`s` cut to `n` characters, an ellipsis marking the cut."""
    return s if len(s) <= n else s[: max(1, n - 1)] + "\u2026"


def text_width(s: str, size: float = 12.0) -> float:
    """Rough width of sans-serif text; only used to size boxes."""
    return len(s) * size * 0.58
