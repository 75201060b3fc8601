"""The ferry file format in bytes: a fixed header, JSON metadata, 64-byte aligned segments.

No pickle, no eval, no code execution: the metadata is JSON, bounded before it is parsed
and read field by field from the descriptions in program/codec.py; segments are raw bytes.
A file loaded from a path is memory-mapped read-only and its segments are memoryviews into
the mapping (no copy). docs/format.md is the specification.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Iterator
from itertools import accumulate
from types import MappingProxyType

from ferry.errors import ProgramError
from ferry.program import codec
from ferry.program.schema import Method

MAGIC = b"FERRY\x00PG"
FORMAT_VERSION = 3  # 3: a constant's bytes in the memory order of its strides (2 read the same: none had strides)
SEGMENT_ALIGNMENT = 64
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, flags, metadata length, segment-area offset
HEADER_SIZE = _HEADER.size  # 32
MAX_JSON_DEPTH = 32  # deepest nesting of JSON arrays/objects accepted in the metadata
MAX_RANK = codec.MAX_RANK
_MAX_INT_DIGITS = 24  # a JSON integer literal longer than this is refused before int()
_TOP_KEYS = ("methods", "delegates", "segments", "segment_sha256")
# header flag: a SHA-256 of the metadata follows it (version 2 and later writers always set it)
FLAG_CHECKSUMS = 1
_DIGEST = 32
_OLD_VERSIONS = MappingProxyType({1: "it predates storage kinds and buffer alignment in the file"})


def _align(n: int) -> int:
    return -(-n // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT


# ---------------------------------------------------------------- writing


def byte_view(seg) -> memoryview:
    mv = memoryview(seg)
    if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
        return mv
    try:
        return mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
    except (TypeError, ValueError):
        return memoryview(mv.tobytes())


def file_chunks(methods, delegates, segments) -> Iterator[bytes | memoryview]:
    """The file as byte chunks (the program must already be valid)."""
    views = [byte_view(s) for s in segments]
    table: list[list[int]] = []
    end = 0
    for v in views:
        off = _align(end)
        table.append([off, v.nbytes])
        end = off + v.nbytes
    meta = {
        "methods": [codec.METHOD.encode(m) for m in methods],
        "delegates": [codec.DELEGATE.encode(d) for d in delegates],
        "segments": table,
        "segment_sha256": [hashlib.sha256(v).hexdigest() for v in views],
    }
    meta_bytes = json.dumps(meta, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
    area = _align(HEADER_SIZE + len(meta_bytes) + _DIGEST)
    out: list[bytes | memoryview] = [
        _HEADER.pack(MAGIC, FORMAT_VERSION, FLAG_CHECKSUMS, len(meta_bytes), area),
        meta_bytes,
        hashlib.sha256(meta_bytes).digest(),
        bytes(area - HEADER_SIZE - len(meta_bytes) - _DIGEST),
    ]
    pos = 0
    for (off, size), v in zip(table, views):
        if off > pos:
            out.append(bytes(off - pos))
        out.append(v)
        pos = off + size
    return iter(out)


# ---------------------------------------------------------------- JSON parsing, bounded

_JSON_STRING_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NON_BRACKET_RE = re.compile(r"[^\[\]{}]+")
_BRACKET_DELTA = MappingProxyType({"[": 1, "{": 1, "]": -1, "}": -1})


_LONG_INT_RE = re.compile(rf"(?<![.0-9])-?[0-9]{{{_MAX_INT_DIGITS + 1}}}")


def _prescan(text: str) -> None:
    """Bound the work json.loads can be made to do: nesting depth (the C parser recurses) and
    integer literal length (int() is quadratic in the digits). Strings are removed first;
    the string pattern tokenises exactly as JSON does, up to the first syntax error."""
    outside = _JSON_STRING_RE.sub("", text)
    m = _LONG_INT_RE.search(outside)
    if m:
        raise ProgramError(f"metadata: an integer literal has more than {_MAX_INT_DIGITS} digits")
    brackets = _NON_BRACKET_RE.sub("", outside)
    depth = max(accumulate(map(_BRACKET_DELTA.__getitem__, brackets))) if brackets else 0
    if depth > MAX_JSON_DEPTH:
        raise ProgramError(f"metadata JSON nests {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed")


def _no_duplicates(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise ProgramError(f"metadata: duplicate key {codec.show(k)} in a JSON object")
            seen.add(k)
    return d


def _parse_float(s: str) -> float:
    f = float(s)
    if not math.isfinite(f):
        raise ProgramError(f"metadata: number {s[:40]!r} overflows a float (write 'inf' or '-inf' as a string)")
    return f


def _parse_constant(s: str):
    raise ProgramError(f"metadata: {s} is not valid JSON (write 'inf', '-inf', 'nan' as strings)")


def _parse_metadata(raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProgramError(f"metadata is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    _prescan(text)
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except ProgramError:
        raise
    except RecursionError:
        raise ProgramError("metadata JSON nests too deeply") from None
    except ValueError as e:  # json.JSONDecodeError and int/float conversion limits
        raise ProgramError(f"metadata is not valid JSON: {e}") from None


# ---------------------------------------------------------------- header and layout


def _header(view: memoryview) -> tuple[int, int]:
    """(metadata end, segment-area offset), after checking magic, version, flags and sizes."""
    size = view.nbytes
    if size >= len(MAGIC) and bytes(view[: len(MAGIC)]) != MAGIC:
        raise ProgramError(f"not a ferry program (magic bytes {bytes(view[:8])!r}, expected {MAGIC!r})")
    if size < HEADER_SIZE:
        raise ProgramError(f"file is truncated: {size} bytes, the header alone needs {HEADER_SIZE}")
    magic, version, flags, meta_len, area = _HEADER.unpack(view[:HEADER_SIZE])
    if version > FORMAT_VERSION:
        raise ProgramError(
            f"format version {version} is newer than this ferry supports ({FORMAT_VERSION}); upgrade ferry"
        )
    if version in _OLD_VERSIONS:
        raise ProgramError(f"format version {version} is no longer read: {_OLD_VERSIONS[version]}; "
                           f"compile the model again with this ferry (format version {FORMAT_VERSION})")
    if version < 1:
        raise ProgramError(f"format version {version} is not valid (versions start at 1)")
    if flags != FLAG_CHECKSUMS:
        raise ProgramError(f"header flags 0x{flags:x} are not valid for format version {version} "
                           f"(must be 0x{FLAG_CHECKSUMS:x}: checksums)")
    if meta_len > size - HEADER_SIZE:
        raise ProgramError(
            f"metadata length {meta_len} exceeds the file: {size} bytes, {size - HEADER_SIZE} after the header "
            "(file truncated or corrupt)"
        )
    meta_end = HEADER_SIZE + meta_len
    if area % SEGMENT_ALIGNMENT or area < meta_end + _DIGEST or area > size:
        raise ProgramError(
            f"segment-area offset {area} is invalid: it must be a multiple of {SEGMENT_ALIGNMENT}, "
            f">= the end of the metadata and its checksum ({meta_end + _DIGEST}) and <= the file size ({size})"
        )
    if hashlib.sha256(view[HEADER_SIZE:meta_end]).digest() != bytes(view[meta_end:meta_end + _DIGEST]):
        raise ProgramError("the metadata does not match its SHA-256 checksum: the file was changed or corrupted")
    return meta_end, area


def _segment_table(entries: object, area_size: int, area: int) -> list[tuple[int, int]]:
    """The segment table, checked against the file size before any segment is touched."""
    table: list[tuple[int, int]] = []
    end = 0
    for j, entry in enumerate(codec.Seq(codec.ANY).decode(entries, "segments")):
        p = f"segments[{j}]"
        if not isinstance(entry, list) or len(entry) != 2:
            raise codec.bad(p, f"expected an [offset, size] pair, got {codec.jtype(entry)}")
        off, n = codec.Int().decode(entry[0], f"{p}[0]"), codec.Int().decode(entry[1], f"{p}[1]")
        if off % SEGMENT_ALIGNMENT:
            raise ProgramError(f"segment {j} offset {off} is not a multiple of {SEGMENT_ALIGNMENT}")
        if off < end:
            raise ProgramError(f"segment {j} offset {off} overlaps or precedes segment {j - 1} (which ends at {end})")
        if off + n > area_size:
            raise ProgramError(
                f"segment {j} (offset {off} + {n} bytes) exceeds the segment area "
                f"({area_size} bytes from file offset {area}); file truncated or corrupt"
            )
        table.append((off, n))
        end = off + n
    if end != area_size:
        raise ProgramError(f"file size {area + area_size} does not match its layout: the segments end at file "
                           f"offset {area + end}")
    return table


def _checked_segments(view, area, table, digests: object, delegates, verify: bool) -> list[memoryview]:
    """The segments, each checked against its SHA-256: delegate payloads always (small, and
    parsed or run as code), every segment when `verify` (reading every weight once)."""
    hexes: list[str] = codec.Seq(codec.Str()).decode(digests, "segment_sha256")
    if len(hexes) != len(table):
        raise codec.bad("segment_sha256", f"{len(hexes)} checksums for {len(table)} segments")
    segments = [view[area + off : area + off + n] for off, n in table]
    payloads = {d.payload for d in delegates}
    for j, seg in enumerate(segments):
        if (verify or j in payloads) and hashlib.sha256(seg).hexdigest() != hexes[j]:
            raise ProgramError(f"segment {j} does not match its SHA-256 checksum: the file was changed or corrupted")
    return segments


def read_parts(view: memoryview, verify: bool = False) -> tuple[dict[str, Method], list, list]:
    """(methods by name, delegates, segments) of a file image; every field type-checked, the
    metadata and delegate payloads checked against their checksums (every segment with `verify`)."""
    meta_end, area = _header(view)
    top = codec.check_keys(_parse_metadata(bytes(view[HEADER_SIZE:meta_end])), "(top level)", _TOP_KEYS)
    table = _segment_table(top["segments"], view.nbytes - area, area)
    delegates = codec.Seq(codec.DELEGATE).decode(top["delegates"], "delegates")
    methods: dict[str, Method] = {}
    for j, m in enumerate(codec.Seq(codec.ANY).decode(top["methods"], "methods")):
        method = codec.METHOD.decode(m, f"methods[{j}]")
        if method.name in methods:
            raise codec.bad(f"methods[{j}].name", f"duplicate method name {method.name!r}")
        methods[method.name] = method
    segments = _checked_segments(view, area, table, top["segment_sha256"], delegates, verify)
    return methods, delegates, segments
