"""Progress bars of the `ferry` command: tqdm bars on stderr, drawn from the progress calls of
ferry.compile, ferry.Module and ferry.generate (ferry/progress.py). Only where stderr is a
terminal and --no-progress is not given; stdout never sees them (tests and scripts parse it)."""

from __future__ import annotations

import contextlib
import sys

__all__ = ["Bars", "progress_bars"]


def progress_bars(args) -> Bars | contextlib.nullcontext:
    """Bars for this command (a context that closes them), or a context giving None: stderr is
    not a terminal, or --no-progress."""
    if getattr(args, "no_progress", False) or not sys.stderr.isatty():
        return contextlib.nullcontext()
    return Bars()


class Bars:
    """One tqdm bar per task, made on its first call and closed when it is done (or by `close`)."""

    def __init__(self):
        self.bars: dict = {}

    def __call__(self, task: str, done: int, total: int, unit: str) -> None:
        bar = self.bars.get(task)
        if bar is None:
            from tqdm import tqdm

            bar = self.bars[task] = tqdm(desc=task, total=total or None, unit=unit, unit_scale=unit == "B",
                                         unit_divisor=1024 if unit == "B" else 1000, file=sys.stderr, leave=False,
                                         dynamic_ncols=True)
        bar.update(done - bar.n)
        if total and done >= total:
            self.bars.pop(task).close()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
