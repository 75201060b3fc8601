"""The copy report: every host<->device transfer of a method, with its bytes."""

from __future__ import annotations

from dataclasses import dataclass

from ferry.ops import COPY_KERNELS
from ferry.program.schema import KernelCall


@dataclass(frozen=True)
class CopyRow:
    instruction: int
    direction: str
    src: str
    dst: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    value: str


@dataclass(frozen=True)
class CopyReport:
    method: str
    rows: tuple[CopyRow, ...]

    def totals(self) -> dict[str, tuple[int, int]]:
        """direction -> (number of copies, bytes)."""
        out = {"h2d": (0, 0), "d2h": (0, 0), "d2d": (0, 0)}
        for r in self.rows:
            n, b = out[r.direction]
            out[r.direction] = (n + 1, b + r.nbytes)
        return out

    def count(self, direction: str | None = None) -> int:
        return sum(1 for r in self.rows if direction in (None, r.direction))

    def __str__(self) -> str:
        lines = [f"copies of method {self.method!r}:"]
        if not self.rows:
            lines.append("  (none)")
        for r in self.rows:
            lines.append(f"  #{r.instruction:<4} {r.direction}  {r.src:>7} -> {r.dst:<7} {r.dtype:>9}"
                         f"{list(r.shape)!s:>16}  {r.nbytes:>12,} B  {r.value}")
        t = self.totals()
        lines.append("  totals: " + ", ".join(f"{d} {n} copies / {b:,} B" for d, (n, b) in t.items()))
        return "\n".join(lines)


def copy_report(program, method: str | None = None):
    """One report for `method`; a dict of reports by method name when `method` is None."""
    if method is None:
        return {name: copy_report(program, name) for name in program.methods}
    m = program.method(method)
    rows = []
    for i, ins in enumerate(m.instructions):
        if isinstance(ins, KernelCall) and ins.kernel in COPY_KERNELS:
            src, dst = m.tensor(ins.args[0]), m.tensor(ins.outputs[0])
            rows.append(CopyRow(i, COPY_KERNELS[ins.kernel], str(src.device), str(dst.device), src.shape, src.dtype,
                                src.nbytes, src.name))
    return CopyReport(method, tuple(rows))
