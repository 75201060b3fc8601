"""The text view of a program, by its old name: `ferry.views.text` (and `ferry.views.facts`)
hold it; this module keeps `from ferry.inspect import ...` working for the callers that use it."""

from ferry.views.facts import device_memory, owner
from ferry.views.text import program_json, program_summary

__all__ = ["device_memory", "owner", "program_json", "program_summary"]
