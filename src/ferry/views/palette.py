"""Lanes and colors: one lane per device, cpu:0 first (slate), then every other device by
(type, index), each with its own hue; and the soft hues of the memory blocks."""

from __future__ import annotations

from collections.abc import Iterable

from ferry.device import CPU, Device

__all__ = ["BLOCK_COLORS", "Palette"]

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
BLOCK_COLORS = (
    ("#bfdbfe", "#2563eb"), ("#fed7aa", "#ea580c"), ("#bbf7d0", "#16a34a"), ("#e9d5ff", "#9333ea"),
    ("#fecdd3", "#e11d48"), ("#a5f3fc", "#0891b2"), ("#fef08a", "#ca8a04"), ("#d9f99d", "#65a30d"),
    ("#fbcfe8", "#db2777"), ("#c7d2fe", "#4f46e5"),
)


class Palette:
    """`devices` in lane order, `lane[device]` its lane, `color[device]` its (fill, stroke, ink)."""

    def __init__(self, devices: Iterable[Device]):
        devices = set(devices)
        others = sorted((d for d in devices if d != CPU), key=lambda d: (d.type, d.index))
        self.devices = ([CPU] if CPU in devices or not others else []) + others
        self.lane = {d: k for k, d in enumerate(self.devices)}
        self.color = {d: _DEVICE_COLORS[k % len(_DEVICE_COLORS)] for k, d in enumerate(others)}
        self.color[CPU] = _CPU_COLOR

    def css_id(self, d: Device) -> str:
        return f"d{self.lane[d]}"

    def copy_pairs(self, copies: Iterable[tuple[Device, Device]]) -> list[tuple[int, int]]:
        """The (source lane, destination lane) pairs of (source, destination) copies, sorted, once each."""
        return sorted({(self.lane[src], self.lane[dst]) for src, dst in copies})
