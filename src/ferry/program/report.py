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
    dynamic: tuple[bool, ...] = ()  # dims sized per call: shape and bytes are their bound

    @property
    def at_bound(self) -> bool:
        return any(self.dynamic)

    @property
    def between_ranks(self) -> bool:
        """The two ends are in two processes (a send and a receive over torch.distributed)."""
        rank = lambda device: device.split(":")[0] if device.startswith("rank") else "rank0"  # noqa: E731
        return rank(self.src) != rank(self.dst)

    @property
    def shape_text(self) -> str:
        """`[<=8, 16]`: a dim sized per call shows its bound."""
        dyn = self.dynamic or (False,) * len(self.shape)
        return "[" + ", ".join(f"<={n}" if d else str(n) for n, d in zip(self.shape, dyn)) + "]"


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
        width = max([7, *(len(r.src) for r in self.rows), *(len(r.dst) for r in self.rows)])
        for r in self.rows:
            notes = (" at the bound" if r.at_bound else "") + (" between ranks" if r.between_ranks else "")
            lines.append(f"  #{r.instruction:<4} {r.direction}  {r.src:>{width}} -> {r.dst:<{width}} {r.dtype:>9}"
                         f"{r.shape_text:>16}  {r.nbytes:>12,} B{notes}  {r.value}")
        t = self.totals()
        crossing = [r.nbytes for r in self.rows if r.between_ranks]
        lines.append("  totals: " + ", ".join(f"{d} {n} copies / {b:,} B" for d, (n, b) in t.items())
                     + (f"; {len(crossing)} between ranks / {sum(crossing):,} B" if crossing else "")
                     + (" (at most: copies at the bound move fewer bytes in a smaller call)"
                        if any(r.at_bound for r in self.rows) else ""))
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
                                src.nbytes, src.name, tuple(src.dynamic)))
    return CopyReport(method, tuple(rows))
