"""The search of device_map="auto" on hand-built units: the dynamic program against every
contiguous split, with stage costs computed from their definition."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.aot.auto_cost import copy_seconds
from ferry.aot.auto_split import Spans, search
from ferry.aot.auto_units import Facts, Unit, Value

# one op per unit: position k is unit k; a value made at k and read at positions `reads`


@st.composite
def chains(draw):
    n = draw(st.integers(2, 7))
    weights = [draw(st.integers(0, 50)) for _ in range(n)]
    shared = draw(st.booleans())  # the last unit reads the first one's weight (tied)
    values = []
    for k in range(-1, n):
        later = draw(st.lists(st.integers(max(k + 1, 0), n), min_size=1, max_size=3, unique=True))
        values.append(Value(k, tuple(sorted(later)), draw(st.integers(1, 30))))
    units = []
    for k in range(n):
        w = {f"w{k}": weights[k]} | ({"w0": weights[0]} if shared and k == n - 1 else {})
        units.append(Unit(f"u{k}", [k], draw(st.floats(1e-6, 1e-3)), w))
    facts = Facts(list(range(n)), [u.seconds for u in units], [u.weights for u in units], values, {}, {}, {})
    budgets = [draw(st.integers(20, 200)) for _ in range(draw(st.integers(1, 3)))]
    return facts, units, budgets


def stage(facts: Facts, units: list[Unit], a: int, b: int):
    """Seconds, weights and activations of units a..b from the definition: weights read
    (once each), tensors entering (held throughout), and the most of its own live at once."""
    inside = range(a, b + 1)
    weights = {name: n for u in units[a:b + 1] for name, n in u.weights.items()}
    entering = [v for v in facts.values if v.made < a and any(r in inside for r in v.reads)]
    peak = 0
    for k in inside:  # live at unit k: made in a..k, read at k or later (or at k's end, if made at k)
        peak = max(peak, sum(v.nbytes for v in facts.values if a <= v.made <= k and max(v.reads) >= k))
    seconds = sum(u.seconds for u in units[a:b + 1]) + copy_seconds(sum(v.nbytes for v in entering), len(entering))
    return seconds, sum(weights.values()), sum(v.nbytes for v in entering) + peak


def splits(n: int, devices: int):
    """Every way to cut n units into `devices` runs in order (runs may be empty)."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), devices - 1):
        bounds = (0, *cuts, n)
        yield [(bounds[i], bounds[i + 1]) for i in range(devices)]


@settings(max_examples=150, deadline=None)
@given(chains())
def test_the_program_finds_the_fastest_split_that_fits(case):
    facts, units, budgets = case
    devices = [(False, b) for b in budgets]
    best = None
    for runs in splits(len(units), len(budgets)):
        costs = [stage(facts, units, a, b - 1) if b > a else (0.0, 0, 0) for a, b in runs]
        if all(w + act <= budget for (_, w, act), budget in zip(costs, budgets)):
            slowest = max(s for s, _, _ in costs)
            best = slowest if best is None else min(best, slowest)
    found = search(Spans(facts, units), devices, strict=True)
    assert (found is None) == (best is None)
    if found is not None:
        assert abs(found.score.slowest - best) <= 1e-12
        for (a, b), (w, act, _), budget in zip(found.runs, found.estimates, budgets):
            assert b == a or (w + act <= budget and (w, act) == stage(facts, units, a, b - 1)[1:])


@settings(max_examples=60, deadline=None)
@given(chains())
def test_the_leanest_split_within_a_time_limit_holds_the_fewest_weights(case):
    facts, units, budgets = case
    devices = [(False, b) for b in budgets]
    fastest = search(Spans(facts, units), devices, strict=True)
    if fastest is None:
        return
    limit = fastest.score.slowest * 1.5
    lean = search(Spans(facts, units), devices, strict=True, limit=limit)
    fewest = min(
        sum(stage(facts, units, a, b - 1)[1] for a, b in runs if b > a)
        for runs in splits(len(units), len(budgets))
        if all(b == a or (lambda c: c[1] + c[2] <= budget and c[0] <= limit)(stage(facts, units, a, b - 1))
               for (a, b), budget in zip(runs, budgets)))
    assert lean is not None and lean.score.weights == fewest
