"""Editing a compiled program by hand, as a hostile file's author would: a method's instructions
(`edited`), or a saved file's bytes — its header, its JSON metadata and that metadata's checksum
(`header_of`, `metadata_of`, `rebuild`, `json_paths`, `parent_of`). Shared by the tests of hostile
programs, of the file format and the fuzz test."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

from ferry.program import format as ser

HEADER = struct.Struct("<8sIIQQ")  # magic, version, flags, metadata length, segment area offset


def edited(m, make):
    """`m` with instructions `make(values, add_value)`: `add_value(v)` appends a value, returns its id."""
    values = list(m.values)

    def add(v):
        values.append(v)
        return len(values) - 1

    return dataclasses.replace(m, values=values, instructions=make(values, add))


def header_of(data: bytes):
    return HEADER.unpack_from(data, 0)


def metadata_of(data: bytes) -> dict:
    _, _, _, meta_len, _ = header_of(data)
    return json.loads(data[32 : 32 + meta_len])


def rebuild(data: bytes, meta: object, *, raw: bytes | None = None, checksum: bool | str = True,
            header: tuple | None = None, segments: bytes | None = None) -> bytes:
    """A file with `meta` (or raw metadata bytes) and the segment area of `data` (or `segments`).
    Its header is the format's own, or `header` (magic, version, flags). Its metadata checksum is
    recomputed (True: as someone who edits a file on purpose would), zeros (False), or "kept" from
    `data` (as corruption leaves it)."""
    _, _, _, meta_len, area = header_of(data)
    meta_bytes = raw if raw is not None else json.dumps(meta).encode()
    new_area = -(-(32 + len(meta_bytes) + 32) // 64) * 64
    magic, version, flags = header or (ser.MAGIC, ser.FORMAT_VERSION, ser.FLAG_CHECKSUMS)
    head = HEADER.pack(magic, version, flags, len(meta_bytes), new_area)
    if checksum == "kept":
        digest = data[32 + meta_len : 64 + meta_len]
    else:
        digest = hashlib.sha256(meta_bytes).digest() if checksum else bytes(32)
    tail = data[area:] if segments is None else segments
    return head + meta_bytes + digest + bytes(new_area - 64 - len(meta_bytes)) + tail


def json_paths(node, path=()):
    """(path, node) for `node` and everything inside it, each parent before its children."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from json_paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from json_paths(v, path + (i,))


def parent_of(meta, path):
    """The dict or list that holds the node at `path` (a non-empty path of `json_paths`)."""
    for key in path[:-1]:
        meta = meta[key]
    return meta
