"""Editing a compiled method by hand, as a hostile file's author would (shared by the tests of hostile programs)."""

import dataclasses


def edited(m, make):
    """`m` with instructions `make(values, add_value)`: `add_value(v)` appends a value, returns its id."""
    values = list(m.values)

    def add(v):
        values.append(v)
        return len(values) - 1

    return dataclasses.replace(m, values=values, instructions=make(values, add))
