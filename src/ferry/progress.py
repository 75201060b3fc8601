"""Progress of long steps, told to a callback the caller passes (`progress=` of ferry.compile,
ferry.Module and ferry.generate). ferry draws nothing itself: the `ferry` command turns the
calls into progress bars on stderr.

`progress(task, done, total, unit)`: `done` of `total` `unit`s of `task` are finished, e.g.
("compile", 1, 2, "step"), ("load forward", 3, 5, "part"), ("upload weights", 4096, 0, "B"),
("generate", 7, 32, "token"); a total of 0 is not known ahead. One task's `done` only grows.
"""

from __future__ import annotations

from collections.abc import Callable

from ferry.errors import ConfigError

__all__ = ["Progress", "checked", "tell"]

Progress = Callable[[str, int, int, str], object]


def checked(progress) -> Progress | None:
    """`progress` (None or a callable), or a ConfigError saying what it must be."""
    if progress is not None and not callable(progress):
        raise ConfigError(f"progress must be None or a callable progress(task, done, total, unit), got "
                          f"{type(progress).__name__}")
    return progress


def tell(progress: Progress | None, task: str, done: int, total: int, unit: str = "step") -> None:
    if progress is not None:
        progress(task, done, total, unit)
