"""What the kernel choices timed at load decided in this process, as lines for people: per family,
how many shapes run faster another way than eager's kernel, and the largest saving (`ferry run`
prints them). A composed multi-head attention's parts are counted though the whole may stay
eager's (it is timed whole as well)."""

from __future__ import annotations

from ferry.choices.decisions import DECISIONS, Decision

__all__ = ["details", "summary"]


def summary(decisions: list[Decision] | None = None) -> list[str]:
    """One line per family that timed anything; none where nothing was timed (no GPU)."""
    made = DECISIONS.values(timed=True) if decisions is None else decisions
    families = list(dict.fromkeys(d.family for d in made))
    return [_line(family, [d for d in made if d.family == family]) for family in families]


def details(decisions: list[Decision] | None = None) -> list[str]:
    """One line per decision timed at load: where, the forms and their times, the pick and why."""
    made = DECISIONS.values(timed=True) if decisions is None else decisions
    return [f"{d.family} {d.shape} on {d.device}: "
            + ", ".join(f"{form} {us:.1f} µs" for form, us in zip(d.forms, d.times_us))
            + f" -> {d.pick} ({d.why})" for d in made]


def _line(family: str, made: list[Decision]) -> str:
    chosen = [d for d in made if d.taken]
    other = made[0].forms[1]
    line = f"{family}: {len(chosen)} of {len(made)} timed at load are faster as {other}"
    if chosen:
        best = max(chosen, key=lambda d: d.saving_us)
        line += f" (largest saving: {best.shape}, {best.times_us[0]:.1f} -> {min(best.times_us):.1f} µs)"
    return line
