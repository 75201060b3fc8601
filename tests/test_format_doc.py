"""docs/format.md is true to the reader: it names every key the reader requires or accepts, and
the header flags the reader insists on."""

from __future__ import annotations

import pathlib
import re

import pytest

from ferry.program import codec, fields, format  # internal: the reader's own record descriptions

DOC = (pathlib.Path(__file__).parent.parent / "docs" / "format.md").read_text()


def _records():
    return {"tensor": codec.TENSOR, "kernel": codec.INSTRUCTION.records[0],
            "delegate call": codec.INSTRUCTION.records[1], "buffer": codec.BUFFER, "mutable buffer": codec.MUTABLE_BUFFER,
            "method": codec.METHOD, "delegate": codec.DELEGATE, "plan": codec.PLAN}


@pytest.mark.parametrize("name", ["tensor", "kernel", "delegate call", "buffer", "mutable buffer", "method", "delegate",
                                  "plan"])
def test_every_key_of_every_record_is_named(name):
    record = _records()[name]
    assert isinstance(record, fields.Record)
    missing = [key for key, _ in record.fields if f'"{key}"' not in DOC and f"`{key}`" not in DOC]
    assert missing == []


def test_the_optional_keys_are_the_ones_said_optional():
    said = re.search(r"except the method keys marked optional below \(([^)]*)\)", DOC)
    assert said and set(re.findall(r"`(\w+)`", said.group(1))) == set(codec.METHOD.optional)


def test_the_top_level_keys_are_named():
    assert all(f'"{key}"' in DOC for key in format._TOP_KEYS)


def test_the_header_flags_are_the_readers():
    assert f"flags == {format.FLAG_CHECKSUMS}" in DOC and "flags == 0" not in DOC
