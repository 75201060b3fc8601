"""What a method captured as CUDA graphs, per shape, and why the rest runs step by step.

A plan's device segments are captured on their second run and replayed after; one that cannot
be captured (it reads a tensor the caller passes per call, or pageable host memory) runs step by
step with a note from the schedule, and one whose capture failed runs eagerly from then on. A
method with dynamic sizes has a plan for any shape (never captured: its sizes change per call)
and one plan per shape seen, each captured on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShapeGraphs", "nothing_captured", "report_lines", "shape_graphs"]


@dataclass(frozen=True)
class ShapeGraphs:
    """One plan of a method: the input shapes it is bound at (None: a static method's plan), its device
    segments captured, waiting for a second run to be captured, and those left step by step with
    why (capture failures, and the schedule's notes)."""

    shapes: tuple | None
    captured: int
    waiting: int
    eager: tuple[str, ...]


def shape_graphs(shapes: tuple | None, plan) -> ShapeGraphs:
    failed = tuple(f"{g.label}: capture failed ({g.failure})" for g in plan.graphs if g.failed)
    return ShapeGraphs(shapes, sum(g.graph is not None for g in plan.graphs),
                       sum(g.graph is None and not g.failed for g in plan.graphs), failed + tuple(plan.notes))


def nothing_captured(report: list[ShapeGraphs], asynchronous: bool) -> str:
    """Why a method loaded with graphs captures nothing, or "" when it captures (or will)."""
    if any(r.captured or r.waiting for r in report):
        return ""
    if not asynchronous:
        return "none of its work runs on a GPU (its steps run on the host)"
    why = [e for r in report for e in r.eager]
    return "; ".join(dict.fromkeys(why)) or "it has no device work to capture"


def report_lines(report: list[ShapeGraphs]) -> list[str]:
    """The report as `ferry run --cuda-graphs` prints it."""
    lines = []
    for r in report:
        where = "" if r.shapes is None else " at inputs " + ", ".join(str(list(s)) for s in r.shapes)
        lines.append(f"graphs{where}: {r.captured} captured, {r.waiting} waiting for a second run"
                     + (f", {len(r.eager)} step by step" if r.eager else ""))
        lines += [f"  {e}" for e in r.eager]
    return lines
